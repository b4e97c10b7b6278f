"""Find training documents that share word n-grams with evaluation sets.

Text on both sides is normalised the same way: lower-cased words made of letters and digits
(punctuation, symbols and underscores separate words). Every window of `ngram` consecutive
words is hashed to 64 bits (per-word BLAKE2b folded with a polynomial, vectorised in NumPy);
a document is contaminated when any of its window hashes occurs in an eval set. Eval items
shorter than `ngram` words cannot match and are counted as `items_too_short`.

Relative eval-set paths are resolved against `base_dir` (default: the repository root, which
pipeline.yaml's relative paths are relative to), never against the current directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.paths import open_text, resolve_path

# Fields that hold the text a model could have memorised, for the eval sets Kiln ships with.
GSM8K_FIELDS = ["question", "answer"]
HUMANEVAL_FIELDS = ["prompt", "canonical_solution"]

_WORD_RE = re.compile(r"[^\W_]+")
_HASH_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)  # odd, so the fold is a bijection per step
_MAX_SPAN_CHARS = 400  # a matching span as kept in the manifest: enough to read the overlap in context


class EvalSetConfig(BaseModel):
    """One evaluation set: a JSONL file (optionally gzipped) and the fields to protect."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Key of this set in reports, e.g. 'gsm8k'.")
    path: str = Field(min_length=1,
                      description="`.jsonl` or `.jsonl.gz` file (relative to the repository root, or absolute).")
    fields: list[str] = Field(min_length=1, description="Text fields whose n-grams are protected, e.g. GSM8K_FIELDS.")
    id_field: str | None = Field(None, description="Field naming an item in examples (e.g. 'task_id'); line number otherwise.")

    @field_validator("path")
    @classmethod
    def _is_jsonl(cls, path: str) -> str:
        if not (path.endswith(".jsonl") or path.endswith(".jsonl.gz")):
            raise ValueError(f"eval set must be .jsonl or .jsonl.gz: {path}")
        return path


class DecontamConfig(BaseModel):
    """Which eval sets to protect and what to do with documents that overlap them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    eval_sets: list[EvalSetConfig] = Field(default_factory=list, description="Empty disables decontamination.")
    ngram: int = Field(13, ge=3, le=64, description="Words per n-gram (13 as in GPT-3).")
    mode: Literal["remove", "flag"] = Field("remove", description="remove: drop matching documents; flag: report only.")
    max_examples: int = Field(5, ge=0, description="Matching spans kept per eval set in the report.")
    examples_shown: int = Field(
        3, ge=0, description="Matching spans per eval set shown in mixed_shards' metadata (the manifest keeps "
        "max_examples, so at most that many).")
    shown_span_chars: int = Field(
        160, ge=20, le=_MAX_SPAN_CHARS,
        description=f"Characters of a matching span shown in mixed_shards' metadata; a longer span is cut and ends "
        f"in '...' (the manifest keeps up to {_MAX_SPAN_CHARS}).")

    @field_validator("eval_sets")
    @classmethod
    def _names_unique(cls, sets: list[EvalSetConfig]) -> list[EvalSetConfig]:
        names = [s.name for s in sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval set names must be unique: {names}")
        return sets


def normalize_words(text: str) -> list[str]:
    return [w.lower() for w in _WORD_RE.findall(text)]


@lru_cache(maxsize=1 << 20)
def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def ngram_hashes(words: list[str], n: int) -> np.ndarray:
    """uint64 hash of every window of n words (empty when there are fewer than n words)."""
    if len(words) < n:
        return np.zeros(0, dtype=np.uint64)
    word_hashes = np.fromiter((_word_hash(w) for w in words), dtype=np.uint64, count=len(words))
    count = len(words) - n + 1
    out = np.zeros(count, dtype=np.uint64)
    for k in range(n):  # uint64 arithmetic wraps, which is the modulus we want
        out = out * _HASH_MULTIPLIER + word_hashes[k:k + count]
    return out


def load_eval_items(eval_set: EvalSetConfig, base_dir: str | os.PathLike | None = None) -> list[tuple[str, list[str]]]:
    """(item id, texts of the configured fields) per JSONL line; a relative path is under
    `base_dir` (default: the repository root)."""
    items = []
    with open_text(resolve_path(eval_set.path, base_dir)) as f:
        for line_no, line in enumerate(f):
            if not line.strip():
                continue
            record = json.loads(line)
            item_id = str(record.get(eval_set.id_field, line_no)) if eval_set.id_field else str(line_no)
            items.append((item_id, [str(record[k]) for k in eval_set.fields if record.get(k)]))
    return items


@dataclass
class _EvalSetIndex:
    config: EvalSetConfig
    hashes: np.ndarray  # sorted, unique
    hash_item: np.ndarray  # item position of each hash (first item that has it)
    item_ids: list[str]
    items_too_short: int


@dataclass
class EvalNgramIndex:
    ngram: int
    sets: list[_EvalSetIndex] = field(default_factory=list)


def build_eval_index(cfg: DecontamConfig, base_dir: str | os.PathLike | None = None) -> EvalNgramIndex:
    index = EvalNgramIndex(cfg.ngram)
    for eval_set in cfg.eval_sets:
        items = load_eval_items(eval_set, base_dir)
        chunks, owners, too_short = [], [], 0
        for position, (_, texts) in enumerate(items):
            grams = [ngram_hashes(normalize_words(t), cfg.ngram) for t in texts]
            grams = np.concatenate(grams) if grams else np.zeros(0, dtype=np.uint64)
            too_short += not len(grams)
            chunks.append(grams)
            owners.append(np.full(len(grams), position, dtype=np.int64))
        all_hashes = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint64)
        all_owners = np.concatenate(owners) if owners else np.zeros(0, dtype=np.int64)
        hashes, first = np.unique(all_hashes, return_index=True)
        index.sets.append(_EvalSetIndex(eval_set, hashes, all_owners[first], [i for i, _ in items], too_short))
    return index


def _member(sorted_hashes: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Boolean hit mask and the position of each query in `sorted_hashes`."""
    if not len(sorted_hashes):
        return np.zeros(len(queries), dtype=bool), np.zeros(len(queries), dtype=np.int64)
    pos = np.searchsorted(sorted_hashes, queries)
    pos = np.minimum(pos, len(sorted_hashes) - 1)
    return sorted_hashes[pos] == queries, pos


def _first_run_span(text: str, word_spans: list[tuple[int, int]], hit_positions: np.ndarray, n: int) -> str:
    """Text of the first run of consecutive matching windows."""
    start = end = int(hit_positions[0])
    for p in hit_positions[1:]:
        if int(p) != end + 1:
            break
        end = int(p)
    return clip_span(text[word_spans[start][0]:word_spans[end + n - 1][1]], _MAX_SPAN_CHARS)


def clip_span(span: str, chars: int) -> str:
    """`span` cut to `chars` characters, with '...' marking a cut."""
    return span if len(span) <= chars else span[:chars] + "..."


def scan_documents(docs: Iterable[tuple[str, str]], index: EvalNgramIndex, max_examples: int = 5) -> dict:
    """Match (doc_id, text) pairs against the eval index.

    Returns {"documents_scanned", "contaminated": {doc_id: [eval set names]},
    "eval_sets": {name: {items, items_too_short, ngrams, documents_matched, items_matched, examples}}}.
    """
    n = index.ngram
    per_set = {
        s.config.name: {"documents_matched": 0, "items": set(), "examples": []} for s in index.sets
    }
    contaminated: dict[str, list[str]] = {}
    scanned = 0
    for doc_id, text in docs:
        scanned += 1
        if not index.sets or not text:
            continue
        matches = list(_WORD_RE.finditer(text))
        if len(matches) < n:
            continue
        grams = ngram_hashes([m.group().lower() for m in matches], n)
        for eval_index in index.sets:
            hit, pos = _member(eval_index.hashes, grams)
            if not hit.any():
                continue
            stats = per_set[eval_index.config.name]
            stats["documents_matched"] += 1
            hit_items = eval_index.hash_item[pos[hit]]
            stats["items"].update(hit_items.tolist())
            contaminated.setdefault(doc_id, []).append(eval_index.config.name)
            if len(stats["examples"]) < max_examples:
                positions = np.flatnonzero(hit)
                spans = [(m.start(), m.end()) for m in matches]
                stats["examples"].append({
                    "doc_id": doc_id,
                    "item": eval_index.item_ids[int(hit_items[0])],
                    "matching_ngrams": int(hit.sum()),
                    "span": _first_run_span(text, spans, positions, n),
                })
    report = {}
    for eval_index in index.sets:
        stats = per_set[eval_index.config.name]
        report[eval_index.config.name] = {
            "path": eval_index.config.path,
            "fields": list(eval_index.config.fields),
            "items": len(eval_index.item_ids),
            "items_too_short": eval_index.items_too_short,
            "ngrams": int(len(eval_index.hashes)),
            "documents_matched": stats["documents_matched"],
            "items_matched": len(stats["items"]),
            "examples": stats["examples"],
        }
    return {"documents_scanned": scanned, "contaminated": contaminated, "eval_sets": report}


def decontaminate(docs: Iterable[tuple[str, str]], cfg: DecontamConfig,
                  base_dir: str | os.PathLike | None = None) -> tuple[set[str], dict]:
    """Scan documents; return (doc ids to drop, report). Nothing is dropped in `flag` mode.

    Per eval set the report also says what happened to its matched documents:
    `documents_removed` (remove mode) or `documents_flagged` (flag mode); a document matching
    two sets counts in both.
    """
    if not cfg.eval_sets:
        return set(), {"enabled": False}
    result = scan_documents(docs, build_eval_index(cfg, base_dir), cfg.max_examples)
    contaminated = result["contaminated"]
    drop = set(contaminated) if cfg.mode == "remove" else set()
    for stats in result["eval_sets"].values():
        matched = stats["documents_matched"]
        stats["documents_removed"] = matched if cfg.mode == "remove" else 0
        stats["documents_flagged"] = matched if cfg.mode == "flag" else 0
    report = {
        "enabled": True,
        "mode": cfg.mode,
        "ngram": cfg.ngram,
        "documents_scanned": result["documents_scanned"],
        "documents_contaminated": len(contaminated),
        "documents_removed": len(drop),
        "contaminated_doc_ids": sorted(contaminated),
        "eval_sets": result["eval_sets"],
    }
    return drop, report
