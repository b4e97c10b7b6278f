"""End to end: `kiln demo` materializes the whole graph on a small generated crawl, twice.

Runs in a subprocess with its own state folder and a smaller config (the session fixture
`demo_pipeline` in conftest.py, shared with the browser tests), then checks real outcomes against
the sample's ground-truth labels.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from engine.filters import NON_THRESHOLD_RULES
from kiln_demo import ASSETS, PARTITIONED
from workflows.config import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline(demo_pipeline):
    return demo_pipeline


def latest(root: Path, asset: str) -> Path:
    folder = root / asset / ("sample" if asset in PARTITIONED else "all")
    path = folder / (folder / "_LATEST").read_text().strip()
    assert (path / "_SUCCESS").exists()
    return path


def rows(path: Path, columns=None) -> list[dict]:
    return ds.dataset(str(path), format="parquet").to_table(columns=columns).to_pylist()


def test_every_asset_is_published_with_manifest(pipeline):
    for asset in ASSETS:
        manifest = json.loads((latest(pipeline["root"], asset) / "_MANIFEST.json").read_text())
        assert manifest["asset"] == asset and manifest["code_version"].startswith("v")


def test_filters_remove_spam_and_boilerplate_and_keep_good_prose(pipeline):
    root = pipeline["root"]
    labels = json.loads((latest(root, "raw_crawl") / "labels.json").read_text())
    url_of = {r["doc_id"]: r["url"] for r in rows(latest(root, "documents") / "data", ["doc_id", "url"])}
    kept = {r["doc_id"] for r in rows(latest(root, "filtered") / "kept", ["doc_id"])}
    rejected = rows(latest(root, "filtered") / "rejected")
    for r in rejected:
        # Every row says why in words; numeric rules also keep their value and threshold, while
        # language_not_allowed and missing_signals have none (NON_THRESHOLD_RULES).
        assert r["rule"] and r["detail"], r
        assert (r["threshold"] is None) == (r["rule"] in NON_THRESHOLD_RULES), r
        assert r["value"] is not None or r["rule"] in (*NON_THRESHOLD_RULES, "classifier_score"), r
    by_kind: dict[str, list[bool]] = {}
    for doc_id, url in url_of.items():
        by_kind.setdefault(labels[url]["kind"], []).append(doc_id in kept)
    assert by_kind["spam"] and not any(by_kind["spam"]), "spam pages must all be removed"
    assert by_kind["boilerplate"] and not any(by_kind["boilerplate"]), "boilerplate pages must all be removed"
    good_web = [doc_id in kept for doc_id, url in url_of.items()
                if labels[url]["kind"] == "good" and labels[url]["bucket"] == "web"]
    assert sum(good_web) / len(good_web) >= 0.95
    languages = {labels[url_of[d]]["lang"] for d in kept}
    assert len(languages) >= 4


def test_planted_duplicates_are_gone(pipeline):
    root = pipeline["root"]
    labels = json.loads((latest(root, "raw_crawl") / "labels.json").read_text())
    final = {r["url"] for r in rows(latest(root, "deduplicated") / "kept", ["url"])}
    planted = [(url, label["dup_of"]) for url, label in labels.items() if label.get("dup_of")]
    assert len(planted) >= 10
    both_survived = [(url, original) for url, original in planted if url in final and original in final]
    assert not both_survived
    duplicates = rows(latest(root, "deduplicated") / "duplicates")
    assert {d["reason"] for d in duplicates} == {"exact", "near"}


def test_tokens_per_bucket_and_training_and_eval(pipeline):
    root = pipeline["root"]
    manifest = json.loads((latest(root, "mixed_shards") / "manifest.json").read_text())
    assert set(manifest["buckets"]) == {"web", "reference"}
    assert all(b["tokens_sampled"] > 0 for b in manifest["buckets"].values())

    checkpoints = latest(root, "checkpoints")
    result = json.loads((checkpoints / "result.json").read_text())
    assert result["final_loss"] < result["first_loss"]
    steps = [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1]["loss"] < steps[0]["loss"]
    tag = (checkpoints / "ckpt" / "latest").read_text().strip()
    shards = sorted(p.name for p in (checkpoints / "ckpt" / tag).glob("*model_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    assert (checkpoints / "export" / "model.safetensors").stat().st_size > 0

    report = latest(root, "eval_report")
    metrics = json.loads((report / "metrics.json").read_text())
    assert set(metrics["trained"]) == {"web", "reference"}
    for bucket, m in metrics["trained"].items():
        assert math.isfinite(m["bits_per_byte"]) and math.isfinite(m["perplexity"])
        assert m["bits_per_byte"] < metrics["initial"][bucket]["bits_per_byte"]
    assert "bits_per_byte" in (report / "report.md").read_text()


def test_summary_is_printed(pipeline):
    out = pipeline["runs"][0]["stdout"]
    for needle in ("top removal reasons", "duplicates removed", "tokens", "loss", "perplexity", "make ui"):
        assert needle in out


def test_second_materialization_gives_the_same_data_versions(pipeline):
    first, second = (run["versions"] for run in pipeline["runs"])
    assert first == second


def test_dagster_ui_shows_every_asset_materialized(pipeline):
    """`dagster dev` (bound to 127.0.0.1) serves the graph, and every asset has a materialization."""
    import socket
    import time
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    state = pipeline["state"]
    env = {**os.environ, "KILN_STATE_DIR": str(state), "KILN_CONFIG": str(state / "pipeline.yaml"),
           "DAGSTER_HOME": str(state / "dagster")}
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "dagster"), "dev", "-m", "workflows.definitions", "-h", "127.0.0.1",
         "-p", str(port)], cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    query = json.dumps({"query": "{ assetNodes { assetKey { path } groupName "
                                 "assetMaterializations(limit: 1) { runId } } }"}).encode()
    try:
        deadline = time.time() + 240
        while True:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/graphql", data=query,
                                                 headers={"Content-Type": "application/json"})
                nodes = json.loads(urllib.request.urlopen(request, timeout=10).read())["data"]["assetNodes"]
                break
            except OSError:
                assert time.time() < deadline, "dagster dev did not answer within 240 s"
                time.sleep(3)
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    assert {n["assetKey"]["path"][0] for n in nodes} == set(ASSETS)
    assert all(n["assetMaterializations"] for n in nodes)
    assert {n["groupName"] for n in nodes} == {"ingest", "curate", "tokenize", "mix", "train", "evaluate"}
