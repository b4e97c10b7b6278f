import gzip
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from engine.classifier import load_classifier, score, train_quality_classifier

# Small and quick: a test run trains five models on 2 shared cores.
SMALL = dict(dim=16, thread=1)
CHARS = 3000  # of each page: plenty to tell articles from navigation


@pytest.fixture(scope="module")
def article_vs_boilerplate(shared_data):
    """Positives: the benchmark's hand-made article bodies. Negatives: the same pages' other
    text (navigation, footers, teasers), i.e. what a main-content extractor should drop."""
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    root = shared_data / "extraction" / "scrapinghub_aeb"
    truth = json.loads((root / "ground-truth.json").read_text())
    positives, negatives = [], []
    for key in sorted(truth):
        body = truth[key]["articleBody"]
        raw = gzip.decompress((root / "html" / f"{key}.html.gz").read_bytes())
        page = extract_plain_text(bytes_to_str(raw, detect_encoding(raw)), main_content=False)
        body_lines = {line.strip() for line in body.splitlines() if line.strip()}
        boilerplate = [line.strip() for line in page.splitlines() if line.strip() and line.strip() not in body_lines]
        positives.append(body[:CHARS])
        if boilerplate:
            negatives.append("\n".join(boilerplate)[:CHARS])
    return positives, negatives


def test_classifier_beats_chance_on_held_out_pages(article_vs_boilerplate, tmp_path):
    positives, negatives = article_vs_boilerplate
    out = tmp_path / "models" / "quality.bin"
    report = train_quality_classifier(positives, negatives, str(out), seed=0, holdout=0.2, **SMALL)
    assert out.is_file()
    assert os.listdir(out.parent) == ["quality.bin"]  # no temporary file left behind
    assert report["n_test"] >= 60 and report["n_train"] + report["n_test"] == len(positives) + len(negatives)
    assert report["accuracy"] >= 0.8, report
    assert report["auc"] >= 0.85, report
    json.dumps(report)  # plain types: goes straight into asset metadata


def test_training_is_reproducible_with_one_thread(article_vs_boilerplate, tmp_path):
    positives, negatives = article_vs_boilerplate
    first = train_quality_classifier(positives[:80], negatives[:80], str(tmp_path / "a.bin"), seed=3, **SMALL)
    second = train_quality_classifier(positives[:80], negatives[:80], str(tmp_path / "b.bin"), seed=3, **SMALL)
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert first["accuracy"] == second["accuracy"]


@pytest.fixture(scope="module")
def model_without_first_pages(article_vs_boilerplate, tmp_path_factory):
    """Trained on all pages but the first 20 of each class, which stay unseen."""
    positives, negatives = article_vs_boilerplate
    path = str(tmp_path_factory.mktemp("clf") / "quality.bin")
    train_quality_classifier(positives[20:], negatives[20:], path, seed=0, holdout=0.0, **SMALL)
    return path


def test_score_is_probability_of_reference_quality(article_vs_boilerplate, model_without_first_pages):
    positives, negatives = article_vs_boilerplate
    path = model_without_first_pages
    unseen_positive = score(positives[:20], path)
    unseen_negative = score(negatives[:20], path)
    assert np.all((unseen_positive >= 0) & (unseen_positive <= 1))
    assert unseen_positive.mean() > unseen_negative.mean() + 0.3
    assert score(["", None], path).tolist() == [0.0, 0.0]
    assert load_classifier(path) is load_classifier(path)  # loaded once per process


def test_quantized_model_scores_alike(article_vs_boilerplate, model_without_first_pages, tmp_path):
    positives, negatives = article_vs_boilerplate
    path = str(tmp_path / "quality.ftz")
    train_quality_classifier(
        positives[20:], negatives[20:], path, seed=0, holdout=0.0, quantize=True, quantize_cutoff=5000, **SMALL
    )
    assert os.path.getsize(path) < os.path.getsize(model_without_first_pages)
    unseen = positives[:20] + negatives[:20]
    full, small = score(unseen, model_without_first_pages), score(unseen, path)
    assert np.mean((full >= 0.5) == (small >= 0.5)) >= 0.9


def test_classifier_score_signal(article_vs_boilerplate, model_without_first_pages):
    from engine.langid import ensure_lid_model
    from engine.signals import compute_signals_pandas

    try:
        lid = ensure_lid_model(str(Path(__file__).resolve().parents[1] / ".kiln" / "models"))
    except RuntimeError as exc:
        pytest.skip(f"lid.176.ftz unavailable: {exc}")
    positives, negatives = article_vs_boilerplate
    path = model_without_first_pages
    docs = pd.DataFrame({"doc_id": ["p", "n"], "text": [positives[0], negatives[0]]})
    out = compute_signals_pandas(docs, lid_model_path=lid, classifier_model_path=path, with_minhash=False)
    assert out["classifier_score"].tolist() == pytest.approx(score(docs["text"].tolist(), path).tolist())


def test_holdout_must_leave_training_data(tmp_path):
    with pytest.raises(ValueError, match="holdout"):
        train_quality_classifier(["a b c"], ["d e f"], str(tmp_path / "m.bin"), holdout=1.0)


# ---------------------------------------------------------------------------------------------
# An external reference corpus (quality_classifier.reference_paths)


def test_reference_corpus_from_a_folder_of_text_files(shared_data):
    from engine.classifier import read_reference_texts
    from workflows.config import ClassifierConfig

    cfg = ClassifierConfig(reference_paths=[str(shared_data / "prose")])
    texts, report = read_reference_texts(
        cfg.reference_paths, field=cfg.reference_field, passage_chars=cfg.reference_passage_chars,
        patterns=cfg.reference_patterns, exclude=cfg.reference_exclude)
    # The two books; not SOURCE.txt (provenance), the HTML edition or metadata.yaml.
    assert sorted(Path(p).name for p in report["files"]) == ["1342-0.txt", "data_tinyshakespeare_input.txt"]
    assert report["documents"] == len(texts) == sum(report["files"].values()) and len(texts) > 500
    # Passages cut at paragraph breaks: about reference_passage_chars each, none empty.
    lengths = sorted(map(len, texts))
    assert lengths[0] > 0 and lengths[len(lengths) // 2] >= cfg.reference_passage_chars
    assert any("Elizabeth" in t for t in texts) and any("First Citizen" in t for t in texts)
    assert not any("\r" in t for t in texts) and not texts[0].startswith("\ufeff")
    again, report_again = read_reference_texts(cfg.reference_paths, exclude=cfg.reference_exclude)
    assert again == texts and report_again["sha256"] == report["sha256"]


def test_reference_corpus_from_jsonl_with_a_field_name(tmp_path):
    from engine.classifier import ReferenceCorpusError, read_reference_texts

    path = tmp_path / "wiki.jsonl"
    path.write_text("\n".join(json.dumps({"id": i, "content": f"Article {i} has several sentences. This is one."})
                              for i in range(5)) + "\n\n")
    texts, report = read_reference_texts([path], field="content")
    assert texts == [f"Article {i} has several sentences. This is one." for i in range(5)]
    assert report["files"] == {str(path): 5}
    with pytest.raises(ReferenceCorpusError, match=r"wiki.jsonl:1: no string field 'text'"):
        read_reference_texts([path])
    with pytest.raises(ReferenceCorpusError, match="does not exist"):
        read_reference_texts([tmp_path / "missing.jsonl"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReferenceCorpusError, match="no file matching"):
        read_reference_texts([tmp_path / "empty"])


def test_reference_config_is_validated(shared_data):
    from pydantic import ValidationError

    from workflows.config import ClassifierConfig, ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"quality_classifier\.reference_paths\.0: 'no/such/corpus' does not exist"):
        parse_config({"quality_classifier": {"reference_paths": ["no/such/corpus"]}})
    with pytest.raises(ValidationError, match="positive_buckets and reference_paths are both empty"):
        ClassifierConfig(positive_buckets=[])
    with pytest.raises(ValidationError, match="reference_passage_chars"):
        ClassifierConfig(reference_passage_chars=10)
    # Instead of the bucket: the external corpus alone.
    cfg = parse_config({"quality_classifier": {"positive_buckets": [], "reference_paths": [str(shared_data / "prose")]}})
    assert cfg.quality_classifier.reference_paths == [str(shared_data / "prose")]


def test_classifier_trained_on_prose_tells_it_from_boilerplate(shared_data, article_vs_boilerplate, tmp_path):
    from engine.classifier import read_reference_texts, sample_texts

    texts, _ = read_reference_texts([shared_data / "prose"], exclude=["SOURCE*"])
    _, negatives = article_vs_boilerplate
    positives = sample_texts(texts, len(negatives), seed=0)
    report = train_quality_classifier(positives, negatives, str(tmp_path / "prose.bin"), seed=0, holdout=0.2, **SMALL)
    assert report["n_train_positive"] + report["n_train_negative"] == report["n_train"] > 100
    assert report["accuracy"] >= 0.9 and report["auc"] >= 0.95, report
    # Unseen prose (the held-out tail of the books) scores higher than unseen boilerplate.
    unseen = [t for t in texts if t not in set(positives)][:30]
    assert score(unseen, str(tmp_path / "prose.bin")).mean() > 0.5


MATERIALIZE = """
import json, sys
import dagster as dg
from workflows.cli import ensure_dagster_home
from workflows.definitions import ALL_ASSETS, defs
from workflows.kiln import CONFIG, SNAPSHOTS

ensure_dagster_home()
instance = dg.DagsterInstance.get()
instance.add_dynamic_partitions(SNAPSHOTS.name, ["sample"])
for names, key in [(["raw_crawl", "documents"], "sample"), (["quality_classifier"], None)]:
    dg.materialize(ALL_ASSETS, selection=dg.AssetSelection.assets(*names), partition_key=key,
                   instance=instance, resources={"kiln": defs.resources["kiln"]}, raise_on_error=True)
"""


@pytest.mark.slow
def test_quality_classifier_asset_with_reference_paths_only(shared_data, tmp_path):
    import subprocess
    import sys

    import yaml

    from workflows.config import DEFAULT_CONFIG_PATH, REPO_ROOT
    from workflows.storage import LocalStorage

    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["raw_crawl"]["snapshots"] = {"sample": {"kind": "sample", "seed": 0, "pages": 60, "files": 1}}
    config["quality_classifier"].update(positive_buckets=[], reference_paths=[str(shared_data / "prose")],
                                        max_docs_per_class=300)
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "KILN_STATE_DIR": str(tmp_path), "KILN_CONFIG": str(tmp_path / "pipeline.yaml")}
    env.pop("DAGSTER_HOME", None)
    result = subprocess.run([sys.executable, "-c", MATERIALIZE], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    storage = LocalStorage(tmp_path / "storage")
    manifest = storage.latest("quality_classifier", None).manifest()
    counts = manifest["counts"]
    # Every crawled document is a negative; the positives are 300 of the books' passages.
    assert counts["positives_from_buckets"] == 0 and counts["reference_documents"] > 500
    assert counts["positives"] == 300
    assert counts["negatives"] == storage.latest("documents", "sample").manifest()["counts"]["documents"]
