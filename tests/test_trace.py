"""`kiln trace`: every span of a training sequence leads back to its document, URL, WARC record,
signals, filter decision and dedup cluster.

The first part builds a small storage root by hand (real prose, real tokenizer, real mixture);
the slow part runs the pipeline up to mixed_shards on the generated sample crawl and traces
seeded random sequences through the CLI.
"""
import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
import yaml

from kiln_demo import run_pipeline
from engine.filters import FilterConfig
from engine.mix import MixConfig, build_mixture, load_rows
from engine.tokenize import doc_index_path, read_indexed_dataset, shard_of, write_indexed_dataset
from engine.tokenizer import EOS_ID, TokenizerConfig, train_tokenizer
from engine.trace import id_filter, read_rows, token_index_files
from workflows.config import DEFAULT_CONFIG_PATH, REPO_ROOT
from workflows.storage import LocalStorage, StorageError
from workflows.trace import artifact_at, resolve_lineage, run, trace


def piece_bytes(sp) -> list[bytes]:
    """UTF-8 bytes of every id, so a span cut inside a multi-byte character still compares."""
    out = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            out.append(bytes([int(piece[3:5], 16)]))
        elif sp.is_control(i) or sp.is_unknown(i):
            out.append(b"")
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


# --- a hand-built storage root -------------------------------------------------------------------

SNAPSHOT = "snap-a"


def _write(folder: Path, rows: list[dict], schema: pa.Schema | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema).sort_by("doc_id") if rows else schema.empty_table()
    pq.write_table(table, folder / "part-00000.parquet", row_group_size=4)  # several row groups to skip


def _publish(storage: LocalStorage, asset: str, partition, build, inputs: dict, config: dict):
    staging = storage.new_staging_dir(asset, partition)
    build(staging)
    return storage.publish(staging, asset, partition, {"inputs": inputs, "config": config})


@pytest.fixture(scope="module")
def store(shared_data, tmp_path_factory):
    """documents -> signals -> filtered -> deduplicated -> tokenizer -> tokenized -> mixed_shards."""
    root = tmp_path_factory.mktemp("trace-store")
    storage = LocalStorage(root / "storage")
    novel = (shared_data / "prose" / "gutenberg_pride_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    paragraphs = [p.strip() for p in novel.replace("\r\n", "\n").split("\n\n")[40:] if len(p.strip()) > 200]
    texts = ["\n".join(paragraphs[i * 3:i * 3 + 3]) for i in range(12)]
    ids = [f"doc{i:02d}" for i in range(12)]
    docs = [{"doc_id": d, "url": f"https://books.example.org/{d}.html", "domain": "books.example.org",
             "snapshot": SNAPSHOT, "warc_file": f"crawl-{i % 2}.warc.gz", "warc_record_id": f"<urn:uuid:{d}>",
             "fetch_time": "2024-01-01T00:00:00Z", "charset": "utf-8", "bucket": "web", "text": t}
            for i, (d, t) in enumerate(zip(ids, texts))]
    signals = [{"doc_id": d["doc_id"], "language": "en", "language_score": 0.9,
                "word_count": len(d["text"].split()) if i != 10 else 20, "minhash": b"\x00" * 8}
               for i, d in enumerate(docs)]
    filters = FilterConfig(min_words=50).model_dump(mode="json")

    documents = _publish(storage, "documents", SNAPSHOT, lambda out: _write(out / "data", docs), {}, {})
    quality = _publish(storage, "quality_signals", SNAPSHOT, lambda out: _write(out / "data", signals),
                       {"documents": documents.data_version}, {})
    rejected = [{"doc_id": "doc10", "url": docs[10]["url"], "bucket": "web", "rule": "min_words", "value": 20.0,
                 "threshold": 50.0},
                {"doc_id": "doc11", "url": docs[11]["url"], "bucket": "web", "rule": "language_score", "value": 0.2,
                 "threshold": 0.65}]

    def build_filtered(out):
        _write(out / "kept", docs[:10])
        _write(out / "rejected", rejected)

    filtered = _publish(storage, "filtered", SNAPSHOT, build_filtered,
                        {"documents": documents.data_version, "quality_signals": quality.data_version},
                        {"filters": filters})
    duplicates = [{"doc_id": "doc08", "cluster_id": "doc00", "kept_doc_id": "doc00", "reason": "exact"},
                  {"doc_id": "doc09", "cluster_id": "doc01", "kept_doc_id": "doc01", "reason": "near"}]

    def build_dedup(out):
        _write(out / "kept", [{k: d[k] for k in ("doc_id", "url", "domain", "bucket", "text")} for d in docs[:8]])
        _write(out / "duplicates", duplicates)

    dedup = _publish(storage, "deduplicated", SNAPSHOT, build_dedup,
                     {"filtered": filtered.data_version, "quality_signals": quality.data_version}, {})
    tok = _publish(storage, "tokenizer", None, lambda out: train_tokenizer(
        {"web": paragraphs[:400]}, str(out), TokenizerConfig(vocab_size=600, sample_chars_per_bucket=100_000),
        export_hf=False), {"deduplicated": {SNAPSHOT: dedup.data_version}}, {})
    sp = spm.SentencePieceProcessor(model_file=str(tok.path / "tokenizer.model"))

    def build_tokenized(out):
        encoded = [np.array(sp.encode(d["text"]) + [EOS_ID], np.uint16) for d in docs[:8]]
        sizes = write_indexed_dataset(str(out / "shard-00000"), encoded, np.uint16)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        pq.write_table(pa.table({"doc_id": ids[:8], "bucket": ["web"] * 8, "shard": pa.array([0] * 8, pa.int32()),
                                 "shard_doc": pa.array(range(8), pa.int64()), "token_offset": offsets.astype(np.int64),
                                 "num_tokens": sizes.astype(np.int64)}), doc_index_path(str(out), 0))

    tokenized = _publish(storage, "tokenized", SNAPSHOT, build_tokenized,
                         {"deduplicated": dedup.data_version, "tokenizer": tok.data_version}, {})
    mixed = _publish(storage, "mixed_shards", None, lambda out: build_mixture(
        [str(tokenized.path)], str(out), MixConfig(total_tokens=2_000, seq_len=32, val_fraction=0.2),
        vocab_size=sp.get_piece_size(), eos_id=EOS_ID, token_bytes_path=str(tok.path / "token_bytes.npy")),
        {"tokenized": {SNAPSHOT: tokenized.data_version}, "deduplicated": {SNAPSHOT: dedup.data_version},
         "tokenizer": tok.data_version}, {})
    return {"storage": storage, "docs": {d["doc_id"]: d for d in docs}, "sp": sp, "mixed": mixed,
            "tokenized": tokenized, "versions": {"documents": documents, "filtered": filtered, "deduplicated": dedup}}


def test_read_rows_filters_by_id_with_both_predicate_forms(store):
    folder = store["versions"]["documents"].path / "data"
    few = read_rows(str(folder), ["doc03", "doc07", "missing"], columns=["doc_id", "url", "minhash"])
    assert sorted(r["doc_id"] for r in few) == ["doc03", "doc07"] and set(few[0]) == {"doc_id", "url"}
    many = [f"x{i}" for i in range(100)] + ["doc05"]  # past the equality-chain limit: an isin predicate
    assert [r["doc_id"] for r in read_rows(str(folder), many, columns=["doc_id"])] == ["doc05"]
    assert "is_in" in str(id_filter("doc_id", many)) and "==" in str(id_filter("doc_id", ["a", "b"]))
    assert read_rows(str(folder), []) == [] and read_rows(None, ["doc01"]) == []


def test_token_index_lookup_reads_only_the_index_beside_the_hashed_shard(tmp_path):
    ids = [f"id{i:03d}" for i in range(40)]
    shards = shard_of(ids, 3)
    for s in range(3):
        mine = [d for d, sh in zip(ids, shards) if sh == s]
        sizes = write_indexed_dataset(str(tmp_path / f"shard-{s:05d}"), [np.array([7, EOS_ID], np.uint16)] * len(mine),
                                      np.uint16)
        pq.write_table(pa.table({"doc_id": mine, "bucket": ["web"] * len(mine), "shard": pa.array([s] * len(mine), pa.int32()),
                                 "shard_doc": pa.array(range(len(mine)), pa.int64()),
                                 "token_offset": pa.array(np.arange(len(mine)) * 2, pa.int64()),
                                 "num_tokens": sizes.astype(np.int64)}), doc_index_path(str(tmp_path), s))
    doc_id = ids[5]
    wanted = doc_index_path(str(tmp_path), int(shards[5]))
    assert token_index_files(str(tmp_path), [doc_id]) == [wanted]
    for s in set(range(3)) - {int(shards[5])}:  # the other indexes are not even opened
        (tmp_path / f"shard-{s:05d}.doc_index.parquet").write_bytes(b"not parquet")
    [row] = read_rows(token_index_files(str(tmp_path), [doc_id]), [doc_id])
    assert row["shard"] == shards[5] and row["num_tokens"] == 2


def test_every_span_traces_to_its_document(store):
    sp, pieces = store["sp"], piece_bytes(store["sp"])
    rows = load_rows(str(store["mixed"].path))
    shard = read_indexed_dataset(str(store["tokenized"].path / "shard-00000.bin"))
    for seq_index in range(len(rows)):
        result = trace(seq=seq_index, storage=store["storage"], include_text=True)
        assert result["versions"]["mixed_shards"] == store["mixed"].data_version
        assert sum((s["tokens"] for s in result["spans"]), []) == rows[seq_index].tolist()
        for span in result["spans"]:
            doc = span["document"]
            source = store["docs"][span["doc_id"]]
            assert doc["url"] == source["url"] and doc["warc_record_id"] == source["warc_record_id"]
            assert doc["warc_file"] == source["warc_file"] and doc["snapshot"] == SNAPSHOT and doc["bucket"] == "web"
            assert doc["filter"]["decision"] == "kept" and all(r["passed"] for r in doc["filter"]["passed"])
            assert doc["signals"]["word_count"] == len(source["text"].split()) and "minhash" not in doc["signals"]
            decoded = b"".join(pieces[t] for t in span["tokens"])
            assert decoded in doc["text"].encode("utf-8") and doc["text"] == source["text"]
            start = doc["tokenized"]["token_offset"] + span["doc_token_start"]
            assert shard.tokens[start:start + span["length"]].tolist() == span["tokens"]
            assert span["span_text"] == sp.decode(span["tokens"])


def test_dedup_clusters_and_filter_rules_are_reported(store):
    def doc(doc_id):
        return trace(doc_id=doc_id, storage=store["storage"])["document"]

    assert doc("doc10")["filter"] == {"decision": "rejected", "rule": "min_words", "value": 20.0, "threshold": 50.0}
    assert doc("doc10")["dedup"]["status"] == "not_reached" and doc("doc10")["mixture"]["train_spans"] == 0
    assert doc("doc08")["dedup"] == {"status": "removed", "reason": "exact", "cluster_id": "doc00",
                                     "kept_doc_id": "doc00"}
    assert doc("doc08")["filter"]["decision"] == "kept"  # passed the filters, then lost to its duplicate
    representative = doc("doc00")["dedup"]
    assert representative["status"] == "kept" and representative["cluster_id"] == "doc00"
    assert representative["removed_doc_ids"] == ["doc08"] and representative["reasons"] == {"exact": 1}
    assert doc("doc03")["dedup"] == {"status": "unique"}
    word_rule = [r for r in doc("doc03")["filter"]["passed"] if r["rule"] == "min_words"]
    assert word_rule == [{"rule": "min_words", "signal": "word_count", "value": float(len(store["docs"]["doc03"]["text"].split())),
                          "condition": ">=", "threshold": 50.0, "passed": True}]
    used = [d for d in (f"doc{i:02d}" for i in range(8)) if doc(d)["mixture"]["train_spans"]]
    held_out = [d for d in (f"doc{i:02d}" for i in range(8)) if doc(d)["mixture"]["held_out"]]
    assert used and held_out and not set(used) & set(held_out)
    with pytest.raises(KeyError):
        doc("doc99")


def test_validation_rows_and_version_selection(store):
    mixed = store["mixed"]
    first = trace(seq=0, bucket="web", storage=store["storage"])
    assert first["split"] == "validation" and first["bucket"] == "web" and first["spans"]
    held_out = {d for d in store["docs"] if trace(doc_id=d, storage=store["storage"])["document"]["mixture"]["held_out"]}
    assert {s["doc_id"] for s in first["spans"]} <= held_out
    assert trace(seq=0, mixed=mixed.data_version[:6], storage=store["storage"])["versions"]["mixed_shards"] == mixed.data_version
    with pytest.raises(StorageError):
        artifact_at(store["storage"], "mixed_shards", None, "ffff0000")
    with pytest.raises(StorageError):
        artifact_at(store["storage"], "mixed_shards", None, "../x")
    with pytest.raises(IndexError):
        trace(seq=10_000, storage=store["storage"])
    lineage = resolve_lineage(store["storage"])
    assert lineage.versions["snapshots"][SNAPSHOT]["filtered"] == store["versions"]["filtered"].data_version
    assert lineage.snapshots[0].filter_config["min_words"] == 50


def test_missing_upstream_artifact_is_reported_not_replaced(store, tmp_path):
    import shutil

    copy = tmp_path / "storage"
    shutil.copytree(store["storage"].root, copy)
    shutil.rmtree(copy / "quality_signals")
    result = trace(seq=0, storage=LocalStorage(copy))
    assert any("quality_signals" in note for note in result["versions"]["notes"])
    doc = result["spans"][0]["document"]
    assert doc["signals"] is None and doc["filter"] == {"decision": "kept", "passed": None}
    assert doc["url"] == store["docs"][doc["doc_id"]]["url"]


def _args(**kwargs):
    return argparse.Namespace(**{"seq": None, "doc_id": None, "mixed": None, "val": None, "json": False, **kwargs})


def test_cli_text_and_json(store, capsys):
    assert run(_args(seq=1, json=True), storage=store["storage"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["seq_index"] == 1 and result["spans"]
    assert run(_args(seq=1), storage=store["storage"]) == 0
    text = capsys.readouterr().out
    for span in result["spans"]:
        doc = span["document"]
        assert doc["url"] in text and doc["warc_record_id"] in text and doc["doc_id"] in text
    assert "kept, passed" in text and "word_count" in text
    assert run(_args(doc_id="doc10"), storage=store["storage"]) == 0
    assert "REJECTED by min_words: value 20, threshold 50" in capsys.readouterr().out
    assert run(_args(doc_id="doc08"), storage=store["storage"]) == 0
    assert "REMOVED as exact duplicate of doc00 (cluster doc00)" in capsys.readouterr().out
    assert run(_args(seq=10_000), storage=store["storage"]) == 1
    assert "outside" in capsys.readouterr().err
    assert run(_args(doc_id="doc01", val="web"), storage=store["storage"]) == 2


# --- a real pipeline run -------------------------------------------------------------------------

MATERIALIZE_UP_TO_MIXED_SHARDS = """
import dagster as dg
from workflows.cli import DEMO_WAVES, ensure_dagster_home
from workflows.definitions import ALL_ASSETS, defs
from workflows.kiln import CONFIG, SNAPSHOTS

ensure_dagster_home()
instance = dg.DagsterInstance.get()
snapshots = sorted(CONFIG.raw_crawl.snapshots)
instance.add_dynamic_partitions(SNAPSHOTS.name, snapshots)
graph = defs.resolve_asset_graph()
needed = {k.to_user_string() for k in dg.AssetSelection.assets("mixed_shards").upstream().resolve(graph)}
for names, partitioned in DEMO_WAVES:
    names = [n for n in names if n in needed]
    for key in (snapshots if partitioned else [None]) if names else []:
        result = dg.materialize(ALL_ASSETS, selection=dg.AssetSelection.assets(*names), partition_key=key,
                                instance=instance, resources={"kiln": defs.resources["kiln"]}, raise_on_error=True)
        print("materialized", names, key, result.success, flush=True)
"""


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    state = tmp_path_factory.mktemp("trace-state")
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["raw_crawl"]["snapshots"] = {"sample": {"kind": "sample", "seed": 0, "pages": 120, "files": 2}}
    config["training"]["steps"] = 5
    (state / "pipeline.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "KILN_STATE_DIR": str(state), "KILN_CONFIG": str(state / "pipeline.yaml")}
    env.pop("DAGSTER_HOME", None)
    result = run_pipeline(["-c", MATERIALIZE_UP_TO_MIXED_SHARDS], env, state / "materialize.log")
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return {"state": state, "env": env, "storage": LocalStorage(state / "storage")}


def _latest(storage: LocalStorage, asset: str, partition=None) -> Path:
    return storage.latest(asset, partition).path


def _kiln(pipeline, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workflows.cli", "trace", *args], cwd=REPO_ROOT, env=pipeline["env"],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_random_sequences_of_a_real_run_trace_to_their_documents(pipeline):
    storage = pipeline["storage"]
    sp = spm.SentencePieceProcessor(model_file=str(_latest(storage, "tokenizer") / "tokenizer.model"))
    pieces = piece_bytes(sp)
    stored_text = {r["doc_id"]: r["text"] for r in
                   ds.dataset(str(_latest(storage, "deduplicated", "sample") / "kept")).to_table(
                       columns=["doc_id", "text"]).to_pylist()}
    documents = {r["doc_id"]: r for r in ds.dataset(str(_latest(storage, "documents", "sample") / "data")).to_table(
        columns=["doc_id", "url", "warc_file", "warc_record_id", "bucket", "snapshot"]).to_pylist()}
    signals = {r["doc_id"]: r for r in ds.dataset(str(_latest(storage, "quality_signals", "sample") / "data")).to_table(
        columns=["doc_id", "language", "word_count"]).to_pylist()}
    rows = load_rows(str(_latest(storage, "mixed_shards")))
    for seq_index in random.Random(0).sample(range(len(rows)), 8):
        result = trace(seq=seq_index, storage=storage)
        assert sum((s["tokens"] for s in result["spans"]), []) == rows[seq_index].tolist()
        for span in result["spans"]:
            doc_id = span["doc_id"]
            doc = span["document"]
            # Every document ends with EOS, which decodes to nothing: a span reaching the end of its
            # document ends with it, and a span can be that EOS alone (the rest of the document
            # fell into the previous window).
            ends_document = span["doc_token_start"] + span["length"] == doc["tokenized"]["num_tokens"]
            text_tokens = span["tokens"][:-1] if ends_document else span["tokens"]
            assert EOS_ID not in text_tokens and (not ends_document or span["tokens"][-1] == EOS_ID)
            if text_tokens:
                decoded = b"".join(pieces[t] for t in text_tokens)
                assert decoded and decoded in stored_text[doc_id].encode("utf-8")
            else:
                assert span["tokens"] == [EOS_ID] and span["doc_token_start"] == doc["tokenized"]["num_tokens"] - 1
                assert span["span_text"] == ""
            assert {k: doc[k] for k in ("url", "warc_file", "warc_record_id", "bucket", "snapshot")} == {
                k: documents[doc_id][k] for k in ("url", "warc_file", "warc_record_id", "bucket", "snapshot")}
            assert doc["signals"]["language"] == signals[doc_id]["language"]
            assert doc["signals"]["word_count"] == signals[doc_id]["word_count"]
            assert doc["filter"]["decision"] == "kept" and all(r["passed"] for r in doc["filter"]["passed"])
            assert doc["dedup"]["status"] in ("unique", "kept")

    seq_index = random.Random(1).randrange(len(rows))
    cli = _kiln(pipeline, "--seq", str(seq_index), "--json")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == json.loads(json.dumps(trace(seq=seq_index, storage=storage)))
    text = _kiln(pipeline, "--seq", str(seq_index))
    assert text.returncode == 0 and f"train sequence {seq_index}" in text.stdout
    for span in json.loads(cli.stdout)["spans"]:
        assert span["document"]["url"] in text.stdout and span["document"]["warc_record_id"] in text.stdout


@pytest.mark.slow
def test_removed_documents_of_a_real_run_trace_to_their_reason(pipeline):
    storage = pipeline["storage"]
    rejected = ds.dataset(str(_latest(storage, "filtered", "sample") / "rejected")).to_table().to_pylist()
    duplicates = ds.dataset(str(_latest(storage, "deduplicated", "sample") / "duplicates")).to_table().to_pylist()
    assert rejected and duplicates
    for row in rejected[:3]:
        cli = _kiln(pipeline, "--doc-id", row["doc_id"], "--json")
        assert cli.returncode == 0, cli.stderr
        decision = json.loads(cli.stdout)["document"]["filter"]
        assert decision["decision"] == "rejected" and decision["rule"] == row["rule"]
        assert decision["threshold"] == row["threshold"] or row["threshold"] is None
    for row in duplicates[:3]:
        doc = trace(doc_id=row["doc_id"], storage=storage)["document"]
        assert doc["dedup"] == {"status": "removed", "reason": row["reason"], "cluster_id": row["cluster_id"],
                                "kept_doc_id": row["kept_doc_id"]}
        assert doc["mixture"]["train_spans"] == 0 and not doc["mixture"]["held_out"]
        kept = trace(doc_id=row["kept_doc_id"], storage=storage)["document"]["dedup"]
        assert kept["status"] == "kept" and row["doc_id"] in kept["removed_doc_ids"]


@pytest.mark.slow
def test_real_tokenizer_has_hf_export_manifest_and_language_fertility(pipeline):
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    tokenizer = _latest(pipeline["storage"], "tokenizer")
    manifest = json.loads((tokenizer / "training_manifest.json").read_text())
    assert set(manifest["languages"]) == {"web", "reference"}
    assert len({lang for langs in manifest["languages"].values() for lang in langs}) >= 2
    for bucket, langs in manifest["languages"].items():
        assert sum(v["documents"] for v in langs.values()) == manifest["buckets"][bucket]["documents"]
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tokenizer / "hf"))
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer / "tokenizer.model"))
    texts = ds.dataset(str(_latest(pipeline["storage"], "deduplicated", "sample") / "kept")).to_table(
        columns=["text"]).column("text").to_pylist()
    assert hf(texts)["input_ids"] == sp.encode(texts)

    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(pipeline["state"] / "dagster")))
    event = instance.get_latest_materialization_event(dg.AssetKey("tokenizer"))
    metadata = event.asset_materialization.metadata
    table = metadata["fertility_by_language"].value
    assert "| bucket | language |" in table and "| web | en |" in table
    assert metadata["hf_export"].value["exported"] is True
