"""Where configured files are and how their text is opened: one definition for engine and workflows.

workflows.config re-exports REPO_ROOT and resolve_path; they live here because workflows.config
imports the engine's config sections, so the engine cannot import it back.
"""
from __future__ import annotations

import gzip
import io
import os
from pathlib import Path
from typing import TextIO

REPO_ROOT = Path(__file__).resolve().parents[1]


def resolve_path(value: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
    """A configured path: absolute as written (after ~), else relative to `base` (default: the
    repository root, which pipeline.yaml's paths are relative to), never to the current directory."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (Path(base if base is not None else REPO_ROOT) / path).resolve()


def open_text(path: str | os.PathLike) -> TextIO:
    """A UTF-8 text file, gunzipped when its name ends in .gz; a leading BOM (as in Project
    Gutenberg texts, or JSONL saved by some editors) is dropped, not read as text."""
    if os.fspath(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8-sig")
    return open(path, encoding="utf-8-sig")


def text_from_bytes(path: str | os.PathLike, data: bytes) -> TextIO:
    """`data` (the bytes of the file at `path`, already read) decoded as open_text(path) would
    read it: gunzipped when the name ends in .gz, a leading BOM dropped, universal newlines."""
    if os.fspath(path).endswith(".gz"):
        data = gzip.decompress(data)
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8-sig")
