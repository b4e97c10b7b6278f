"""fastText quality classifier: P(text looks like the reference corpus).

The recipe of GPT-3 / DCLM-style quality filters: positives are reference-quality text
(curated prose, references of Wikipedia, ...), negatives are random web text; a bag of word
(and word-bigram) features separates them, and its probability is a signal, not a decision.

Why training looks unusual: fastText's DenseMatrix::uniform initialises only `thread` tenths of
the input matrix (blocks of rows*dim/10 values, one per thread). With thread < 10 the rest is
whatever the heap held: zeros in a fresh process, stale floats (even NaN) after earlier
allocations. That makes thread=1 training irreproducible and is the "Encountered NaN." seen on
small inputs. So we (1) add word bigrams as explicit tokens instead of fastText's hashed
`wordNgrams` buckets, which leaves only dictionary words as input rows, and (2) initialise every
one of those rows ourselves through `pretrainedVectors` (seeded uniform(-1/dim, 1/dim), fastText's
own scheme). With thread=1 the result is then bit-for-bit reproducible.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import os
import random
import re
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from engine.langid import forget_model, load_fasttext_model, normalize_for_fasttext
from engine.paths import text_from_bytes

POSITIVE_LABEL = "__label__hq"
NEGATIVE_LABEL = "__label__lq"
EOS = "</s>"  # fastText's end-of-line token: also an input row
BIGRAM_JOINER = "\u2581"  # "▁": joins the two words of a bigram token, rare in real text


def prepare_text(text: str | None) -> str:
    """One lower-cased line: fastText needs one line per example, and lower-casing makes a
    small training set generalise better (the same function is used for training and scoring)."""
    return normalize_for_fasttext(text, lowercase=True)


def with_bigrams(line: str) -> str:
    """The words of `line` followed by its word bigrams as single tokens."""
    words = line.split()
    if len(words) < 2:
        return line
    return line + " " + " ".join(a + BIGRAM_JOINER + b for a, b in zip(words, words[1:]))


# --------------------------------------------------------------------------------------------
# An external reference corpus: text and JSONL files


class ReferenceCorpusError(ValueError):
    """A reference path that cannot be read as configured (missing, empty, wrong field)."""


_PARAGRAPH_BREAK = re.compile(r"\n[ \t\f\v]*\n")


def reference_files(paths: Sequence[str | os.PathLike], patterns: Sequence[str], exclude: Sequence[str] = ()) -> list[Path]:
    """The files of `paths`: each a file (taken as it is) or a folder, searched recursively for
    names matching one of `patterns` and none of `exclude`, in sorted order (so the corpus, and
    the model trained on it, do not depend on the file system's listing order)."""
    files: list[Path] = []
    for entry in paths:
        path = Path(entry)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(
                p for p in path.rglob("*")
                if p.is_file() and any(fnmatch.fnmatch(p.name, pat) for pat in patterns)
                and not any(fnmatch.fnmatch(p.name, pat) for pat in exclude)
            )
            if not found:
                raise ReferenceCorpusError(f"{path}: no file matching {list(patterns)} (excluding {list(exclude)})")
            files += found
        else:
            raise ReferenceCorpusError(f"{path} does not exist")
    return files


def passages(text: str, chars: int) -> Iterator[str]:
    """`text` cut at paragraph breaks into passages of about `chars` characters (a paragraph
    longer than that is a passage of its own): a book is thousands of examples, not one."""
    current: list[str] = []
    size = 0
    for paragraph in _PARAGRAPH_BREAK.split(text.replace("\r\n", "\n")):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        current.append(paragraph)
        size += len(paragraph)
        if size >= chars:
            yield "\n\n".join(current)
            current, size = [], 0
    if current:
        yield "\n\n".join(current)


def read_reference_texts(
    paths: Sequence[str | os.PathLike],
    *,
    field: str = "text",
    passage_chars: int = 2000,
    patterns: Sequence[str] = ("*.txt", "*.jsonl", "*.txt.gz", "*.jsonl.gz"),
    exclude: Sequence[str] = (),
) -> tuple[list[str], dict]:
    """Reference-quality documents from text and JSONL files (or folders of them).

    A .jsonl(.gz) file is one document per line, its text in `field`; any other file is plain
    UTF-8 text cut into passages of about `passage_chars` characters at paragraph breaks.
    Returns (texts, report) with the files read, their documents and a sha256 over their bytes
    (the corpus's identity in the model's metadata). Raises ReferenceCorpusError naming the file
    (and line) for a missing path, an empty folder, a JSONL line without `field`, no text at all.
    """
    texts: list[str] = []
    digest = hashlib.sha256()
    per_file: dict[str, int] = {}
    for path in reference_files(paths, patterns, exclude):
        data = path.read_bytes()  # read once: hashed, then decoded from memory
        digest.update(data)
        before = len(texts)
        with text_from_bytes(path, data) as handle:
            if path.name.endswith((".jsonl", ".jsonl.gz")):
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise ReferenceCorpusError(f"{path}:{number}: not JSON ({exc.msg})") from None
                    value = record.get(field) if isinstance(record, dict) else None
                    if not isinstance(value, str):
                        raise ReferenceCorpusError(f"{path}:{number}: no string field {field!r}")
                    if value.strip():
                        texts.append(value)
            else:
                texts += list(passages(handle.read(), passage_chars))
        per_file[str(path)] = len(texts) - before
    if not texts:
        raise ReferenceCorpusError(f"no text in {[str(p) for p in paths]}")
    return texts, {"files": per_file, "documents": len(texts), "sha256": digest.hexdigest()}


def sample_texts(texts: Sequence[str], limit: int, seed: int) -> list[str]:
    """At most `limit` of `texts`, a seeded sample in their original order (reproducible)."""
    if len(texts) <= limit:
        return list(texts)
    chosen = sorted(random.Random(seed).sample(range(len(texts)), limit))
    return [texts[i] for i in chosen]


def _write_examples(path: str, examples: Sequence[tuple[str, str]]) -> set[str]:
    vocabulary: set[str] = set()
    with open(path, "w", encoding="utf-8") as handle:
        for label, line in examples:
            handle.write(f"{label} {line}\n")
            vocabulary.update(line.split())
    return vocabulary


def _write_initial_vectors(path: str, vocabulary: set[str], dim: int, seed: int) -> None:
    """A .vec file covering every input row fastText will create: seeded uniform(-1/dim, 1/dim),
    fastText's own initialisation. Coordinates are drawn from 4096 pre-formatted values, which
    is plenty of entropy to break symmetry and keeps writing millions of floats fast."""
    words = sorted(vocabulary | {EOS})
    rng = np.random.default_rng(seed)
    table = np.array([f"{v:.6g}" for v in rng.uniform(-1.0 / dim, 1.0 / dim, size=4096)])
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(f"{len(words)} {dim}\n")
        for start in range(0, len(words), 8192):
            chunk = words[start : start + 8192]
            rows = table[rng.integers(0, table.size, size=(len(chunk), dim))].tolist()
            handle.write("".join(word + " " + " ".join(row) + "\n" for word, row in zip(chunk, rows)))


def _prune_vocabulary(
    examples: list[tuple[str, str]], min_count: int, bigram_min_count: int, max_vocabulary: int
) -> list[tuple[str, str]]:
    counts = Counter(token for _, line in examples for token in line.split())
    keep = {t for t, c in counts.items() if c >= (bigram_min_count if BIGRAM_JOINER in t else min_count)}
    if max_vocabulary and len(keep) > max_vocabulary:
        keep = set(sorted(keep, key=lambda t: (-counts[t], t))[:max_vocabulary])
    pruned = [(label, " ".join(t for t in line.split() if t in keep)) for label, line in examples]
    return [(label, line) for label, line in pruned if line]


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
    dim: int = 64,
    min_count: int = 1,
    bigrams: bool = True,
    bigram_min_count: int = 2,
    max_vocabulary: int = 500_000,
    thread: int = 1,
    holdout: float = 0.2,
    quantize: bool = False,
    quantize_cutoff: int = 0,
) -> dict:
    """Train a fastText hq/lq classifier, write it atomically to `out_path`, report held-out metrics.

    A `holdout` share of each class (shuffled with `seed`) is kept out of training and scored.
    Tokens rarer than `min_count` (bigrams: `bigram_min_count`) are dropped, and at most the
    `max_vocabulary` most frequent are kept: the model holds one dim-float row per token
    (500k x dim 64 = 128 MB), and bigrams grow with the corpus where fastText's hashed ones don't.
    thread=1 makes training reproducible (more threads race on shared weights, Hogwild-style);
    never use more threads than cores. quantize=True writes a much smaller .ftz-format model
    (product-quantised; `quantize_cutoff` > 0 also keeps only that many most useful rows).
    """
    import fasttext

    if not 0 <= holdout < 1:
        raise ValueError(f"holdout must be in [0, 1), got {holdout}")
    if thread < 1:
        raise ValueError(f"thread must be >= 1, got {thread}")
    rng = random.Random(seed)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "test": []}
    for label, texts in ((POSITIVE_LABEL, positive_texts), (NEGATIVE_LABEL, negative_texts)):
        lines = [line for line in (prepare_text(t) for t in texts) if line]
        if bigrams:
            lines = [with_bigrams(line) for line in lines]
        rng.shuffle(lines)
        n_test = int(round(len(lines) * holdout))
        if len(lines) - n_test < 1:
            raise ValueError(f"no training examples left for {label}")
        splits["test"] += [(label, line) for line in lines[:n_test]]
        splits["train"] += [(label, line) for line in lines[n_test:]]
    rng.shuffle(splits["train"])
    splits["train"] = _prune_vocabulary(splits["train"], min_count, bigram_min_count, max_vocabulary)

    out_dir = os.path.dirname(os.path.abspath(out_path))
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kiln-clf-") as tmp:
        train_file = os.path.join(tmp, "train.txt")
        vectors_file = os.path.join(tmp, "init.vec")
        vocabulary = _write_examples(train_file, splits["train"])
        _write_initial_vectors(vectors_file, vocabulary, dim, seed)
        model = fasttext.train_supervised(
            input=train_file,
            pretrainedVectors=vectors_file,
            epoch=epoch,
            lr=lr,
            dim=dim,
            minCount=1,  # already applied by _prune_vocabulary
            wordNgrams=1,  # bigrams are explicit tokens (see module docstring)
            minn=0,
            maxn=0,
            bucket=0,
            thread=thread,
            seed=seed,
            loss="softmax",
            verbose=0,
        )
        if quantize:
            model.quantize(input=train_file, qnorm=True, cutoff=quantize_cutoff, retrain=False, thread=thread, verbose=0)
    fd, tmp_model = tempfile.mkstemp(prefix=".tmp-", suffix=".bin", dir=out_dir)
    os.close(fd)
    try:
        model.save_model(tmp_model)
        os.chmod(tmp_model, 0o644)  # mkstemp creates 0600; others (Spark executors) must read it
        os.replace(tmp_model, out_path)  # readers see the old model or the new one, never half
    finally:
        if os.path.exists(tmp_model):
            os.unlink(tmp_model)
    forget_model(out_path)
    _BIGRAM_MODELS.pop(os.path.abspath(out_path), None)

    report = {
        "path": out_path,
        "n_train": len(splits["train"]),
        "n_test": len(splits["test"]),
        "n_train_positive": sum(label == POSITIVE_LABEL for label, _ in splits["train"]),
        "n_train_negative": sum(label == NEGATIVE_LABEL for label, _ in splits["train"]),
        "vocabulary": len(model.words),
        "epoch": epoch,
        "lr": lr,
        "dim": dim,
        "bigrams": bigrams,
        "min_count": min_count,
        "bigram_min_count": bigram_min_count,
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
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in report.items()}


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


_BIGRAM_MODELS: dict[str, bool] = {}
_BIGRAM_LOCK = threading.Lock()


def _uses_bigram_tokens(model, key: str | None) -> bool:
    """Models trained here have bigram tokens in their dictionary; others (e.g. DCLM's
    fastText classifier, which also predicts __label__hq) get plain text."""
    if key is not None and key in _BIGRAM_MODELS:
        return _BIGRAM_MODELS[key]
    answer = any(BIGRAM_JOINER in word for word in model.words)
    if key is not None:
        with _BIGRAM_LOCK:
            _BIGRAM_MODELS[key] = answer
    return answer


def load_classifier(path: str):
    """The model at `path`, loaded once per process."""
    return load_fasttext_model(path)


def score(texts: Sequence[str | None], model_or_path) -> np.ndarray:
    """P(__label__hq) for each text; empty texts score 0."""
    if isinstance(model_or_path, (str, os.PathLike)):
        key = os.path.abspath(model_or_path)
        model = load_classifier(str(model_or_path))
    else:
        key, model = None, model_or_path
    lines = [prepare_text(t) for t in texts]
    if _uses_bigram_tokens(model, key):
        lines = [with_bigrams(line) for line in lines]
    return _positive_probability(model, lines)
