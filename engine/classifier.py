"""fastText quality classifier: P(text looks like the reference corpus).

The recipe of GPT-3 / DCLM-style quality filters: positives are reference-quality text
(curated prose, references of Wikipedia, ...), negatives are random web text; a bag of word
n-grams classifier separates them and its probability is a signal, not a decision.
"""
from __future__ import annotations

import math
import os
import random
import tempfile
from typing import Sequence

import numpy as np

from engine.langid import load_fasttext_model, normalize_for_fasttext

POSITIVE_LABEL = "__label__hq"
NEGATIVE_LABEL = "__label__lq"


def prepare_text(text: str | None) -> str:
    """One lower-cased line: fastText needs one line per example, and lower-casing makes a
    small training set generalise better (the same function is used for training and scoring)."""
    return normalize_for_fasttext(text, lowercase=True)


def _write_examples(path: str, examples: Sequence[tuple[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for label, text in examples:
            handle.write(f"{label} {text}\n")


def _roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Probability that a random positive outscores a random negative (Mann-Whitney U)."""
    import pandas as pd

    n_pos, n_neg = int(labels.sum()), int((labels == 0).sum())
    if not n_pos or not n_neg:
        return float("nan")
    ranks = pd.Series(scores).rank(method="average").to_numpy()
    return float((ranks[labels == 1].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def train_quality_classifier(
    positive_texts: Sequence[str],
    negative_texts: Sequence[str],
    out_path: str,
    *,
    seed: int = 0,
    epoch: int = 10,
    lr: float = 0.1,
    word_ngrams: int = 2,
    dim: int = 64,
    min_count: int = 1,
    bucket: int = 200_000,
    thread: int = 1,
    holdout: float = 0.2,
    quantize: bool = False,
) -> dict:
    """Train a fastText hq/lq classifier, write it atomically to `out_path`, report held-out metrics.

    A `holdout` share of each class (shuffled with `seed`) is kept out of training and scored.
    thread=1 makes training reproducible (fastText's Hogwild updates race with more threads);
    never use more threads than cores (fastText fails with "Encountered NaN" on small inputs).
    `bucket` sizes the hashed word-n-gram table (bucket x dim floats): fastText's default of
    2M makes a 500 MB model at dim 64. quantize=True writes a much smaller .ftz-format model.
    """
    import fasttext

    if not 0 <= holdout < 1:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    rng = random.Random(seed)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "test": []}
    for label, texts in ((POSITIVE_LABEL, positive_texts), (NEGATIVE_LABEL, negative_texts)):
        lines = [line for line in (prepare_text(t) for t in texts) if line]
        rng.shuffle(lines)
        n_test = int(round(len(lines) * holdout))
        if len(lines) - n_test < 1:
            raise ValueError(f"no training examples left for {label}")
        splits["test"] += [(label, line) for line in lines[:n_test]]
        splits["train"] += [(label, line) for line in lines[n_test:]]
    rng.shuffle(splits["train"])

    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kiln-clf-") as tmp:
        train_file = os.path.join(tmp, "train.txt")
        _write_examples(train_file, splits["train"])
        model = fasttext.train_supervised(
            input=train_file,
            epoch=epoch,
            lr=lr,
            wordNgrams=word_ngrams,
            dim=dim,
            minCount=min_count,
            bucket=bucket,
            thread=thread,
            seed=seed,
            loss="softmax",
            verbose=0,
        )
        if quantize:
            model.quantize(input=train_file, retrain=False, thread=thread, verbose=0)
    fd, tmp_model = tempfile.mkstemp(prefix=".tmp-", suffix=".bin", dir=out_dir)
    os.close(fd)
    try:
        model.save_model(tmp_model)
        os.chmod(tmp_model, 0o644)  # mkstemp creates 0600; others (Spark executors) must read it
        os.replace(tmp_model, out_path)  # readers see the old model or the new one, never half
    finally:
        if os.path.exists(tmp_model):
            os.unlink(tmp_model)

    report = {
        "path": out_path,
        "n_train": len(splits["train"]),
        "n_test": len(splits["test"]),
        "n_train_positive": sum(label == POSITIVE_LABEL for label, _ in splits["train"]),
        "n_train_negative": sum(label == NEGATIVE_LABEL for label, _ in splits["train"]),
        "epoch": epoch,
        "lr": lr,
        "word_ngrams": word_ngrams,
        "dim": dim,
        "bucket": bucket,
        "seed": seed,
        "thread": thread,
        "quantized": quantize,
        "accuracy": float("nan"),
        "precision": float("nan"),
        "recall": float("nan"),
        "auc": float("nan"),
    }
    if splits["test"]:
        labels = np.array([label == POSITIVE_LABEL for label, _ in splits["test"]], dtype=np.int64)
        scores = _positive_probability(model, [line for _, line in splits["test"]])
        predicted = (scores >= 0.5).astype(np.int64)
        true_positive = int(((predicted == 1) & (labels == 1)).sum())
        report["accuracy"] = float((predicted == labels).mean())
        report["precision"] = true_positive / int(predicted.sum()) if predicted.sum() else float("nan")
        report["recall"] = true_positive / int(labels.sum()) if labels.sum() else float("nan")
        report["auc"] = _roc_auc(labels, scores)
    report = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in report.items()}
    return report


def _positive_probability(model, lines: list[str]) -> np.ndarray:
    scores = np.zeros(len(lines), dtype=np.float64)
    todo = [i for i, line in enumerate(lines) if line]
    if not todo:
        return scores
    all_labels, all_probs = model.predict([lines[i] for i in todo], k=2)
    for i, labels, probs in zip(todo, all_labels, all_probs):
        by_label = dict(zip(labels, (float(p) for p in probs)))
        if POSITIVE_LABEL in by_label:
            scores[i] = by_label[POSITIVE_LABEL]
        elif NEGATIVE_LABEL in by_label:
            scores[i] = 1.0 - by_label[NEGATIVE_LABEL]
    return np.clip(scores, 0.0, 1.0)


def load_classifier(path: str):
    """The model at `path`, loaded once per process."""
    return load_fasttext_model(path)


def score(texts: Sequence[str | None], model_or_path) -> np.ndarray:
    """P(__label__hq) for each text; empty texts score 0."""
    model = load_classifier(model_or_path) if isinstance(model_or_path, (str, os.PathLike)) else model_or_path
    return _positive_probability(model, [prepare_text(t) for t in texts])
