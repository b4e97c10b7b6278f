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
