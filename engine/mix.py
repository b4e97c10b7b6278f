"""Build the training mixture: decontaminate, hold out validation documents, sample buckets
to their weights, pack tokens into fixed windows and shuffle them.

Output folder (docs/CONTRACTS.md, `mixed_shards`): `manifest.json`, `train.bin`,
`val_<bucket>.bin`, `train_spans.parquet`, `token_bytes.npy`; plus `val_spans.parquet`
(bucket, seq_index, seq_offset, doc_id, doc_token_start, length), the lineage of the
validation rows.

Every random choice is a hash of (seed, purpose, item) through SplitMix64, never a stateful
RNG, so the bytes depend only on the seed and the set of input documents (not on the order
of `tokenized_dirs` nor on the NumPy version).

Packing: the sampled documents are concatenated in a seeded order into one stream of
exactly N * (seq_len + 1) tokens, cut into N non-overlapping windows (each row holds its own
targets), and the windows are written in a seeded global order. Each bucket's target is met
exactly: whole documents in a seeded order per epoch, and the one document that crosses the
target is cut to a prefix (visible in the spans as a shorter `length`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from typing import Iterator

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.decontam import DecontamConfig, decontaminate
from engine.tokenize import IndexedDataset, read_doc_index, shard_prefix

log = logging.getLogger(__name__)

_BUCKET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # it becomes part of a file name
_ROWS_PER_WRITE = 256


class MixConfig(BaseModel):
    """How the mixture is drawn. Shares are of training tokens; validation is held out first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bucket_weights: dict[str, float] = Field(
        default_factory=lambda: {"web": 1.0},
        description="Target share of training tokens per bucket; must sum to 1. Buckets absent here get 0.",
    )
    total_tokens: int = Field(
        100_000_000, ge=1,
        description="Training tokens wanted; rounded down to whole (seq_len + 1)-token sequences.",
    )
    seq_len: int = Field(2048, ge=8, le=1 << 20, description="Model context; rows hold seq_len + 1 tokens.")
    seed: int = Field(0, ge=0, description="Seed of the split, the document order and the window shuffle.")
    val_fraction: float = Field(
        0.01, ge=0.0, lt=0.5,
        description="Share of each bucket's documents held out, chosen by a hash of (doc_id, seed).",
    )
    min_val_docs_per_bucket: int = Field(
        1, ge=0,
        description="Held-out documents per bucket at least (and at least one full sequence of tokens).",
    )
    max_epochs_warn: float = Field(4.0, gt=0, description="Warn when a bucket is repeated more often than this.")
    decontam: DecontamConfig = Field(default_factory=DecontamConfig, description="Eval-set n-gram decontamination.")

    @field_validator("bucket_weights")
    @classmethod
    def _weights_valid(cls, weights: dict[str, float]) -> dict[str, float]:
        if not weights:
            raise ValueError("bucket_weights is empty")
        for bucket, weight in weights.items():
            if not _BUCKET_NAME.match(bucket):
                raise ValueError(f"bucket name {bucket!r} is not usable in a file name")
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"weight of {bucket!r} must be finite and >= 0, got {weight}")
        if abs(sum(weights.values()) - 1.0) > 1e-6:
            raise ValueError(f"bucket_weights must sum to 1, got {sum(weights.values())}")
        return weights

    @model_validator(mode="after")
    def _at_least_one_sequence(self) -> "MixConfig":
        if self.total_tokens < self.seq_len + 1:
            raise ValueError(f"total_tokens {self.total_tokens} is less than one sequence of {self.seq_len + 1}")
        return self


# --- deterministic hashing ---------------------------------------------------------------

_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    z = np.asarray(x, dtype=_U64) + _U64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
    return z ^ (z >> _U64(31))


def _stream_key(seed: int, *parts) -> np.uint64:
    text = "\x00".join(str(p) for p in (seed, *parts))
    return _U64(int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little"))


def _doc_keys(doc_ids) -> np.ndarray:
    """uint64 hash per doc_id (an Arrow string array), converted a slice at a time."""
    keys = np.empty(len(doc_ids), dtype=_U64)
    step = 1 << 18
    for begin in range(0, len(doc_ids), step):
        chunk = doc_ids.slice(begin, step).to_pylist()
        keys[begin:begin + len(chunk)] = np.fromiter(
            (int.from_bytes(hashlib.blake2b(d.encode(), digest_size=8).digest(), "little") for d in chunk),
            dtype=_U64, count=len(chunk),
        )
    return keys


def _seeded_order(keys: np.ndarray, seed: int, *purpose) -> np.ndarray:
    """Permutation of positions ordered by a hash of (key, seed, purpose)."""
    return np.argsort(_splitmix64(keys ^ _stream_key(seed, *purpose)), kind="stable")


# --- inputs ------------------------------------------------------------------------------

class _Corpus:
    """All documents of all snapshots, sorted by doc_id, as parallel arrays.

    doc_id stays an Arrow string array and buckets are integer codes, so millions of
    documents cost a few dozen bytes each rather than a Python object each.
    """

    def __init__(self, tokenized_dirs: list[str], eos_id: int):
        import pyarrow as pa
        import pyarrow.compute as pc

        if not tokenized_dirs:
            raise ValueError("no tokenized folders given")
        self.dirs = [os.path.abspath(d) for d in tokenized_dirs]
        tables = []
        for source, folder in enumerate(self.dirs):
            table = read_doc_index(folder)  # the index files beside the folder's shards
            tables.append(table.append_column("source", pa.array(np.full(table.num_rows, source, dtype=np.int32))))
        table = pa.concat_tables(tables).sort_by("doc_id")
        self.doc_id = table.column("doc_id").combine_chunks()
        self.bucket_names = sorted(pc.unique(table.column("bucket")).to_pylist())
        self.bucket_code = pc.index_in(table.column("bucket"), value_set=pa.array(self.bucket_names, pa.string())).to_numpy()
        self.source = table.column("source").to_numpy()
        self.shard = table.column("shard").to_numpy().astype(np.int64)
        self.token_offset = table.column("token_offset").to_numpy().astype(np.int64)
        self.num_tokens = table.column("num_tokens").to_numpy().astype(np.int64)
        if len(self.doc_id) > 1:
            same = pc.equal(self.doc_id.slice(1), self.doc_id.slice(0, len(self.doc_id) - 1))
            if pc.any(same).as_py():
                dup = self.doc_id[int(np.flatnonzero(same.to_numpy(zero_copy_only=False))[0]) + 1].as_py()
                raise ValueError(f"doc_id {dup} occurs more than once across the tokenized folders")
        self._readers: dict[tuple[int, int], IndexedDataset] = {}
        self._check_eos(eos_id)

    def reader(self, source: int, shard: int) -> IndexedDataset:
        key = (int(source), int(shard))
        if key not in self._readers:
            self._readers[key] = IndexedDataset(shard_prefix(self.dirs[key[0]], key[1]) + ".bin")
        return self._readers[key]

    def _check_eos(self, eos_id: int) -> None:
        """Every document must end with EOS (the tokenized contract); also one token dtype."""
        dtypes = set()
        order = np.lexsort((self.shard, self.source))
        group_key = self.source[order].astype(np.int64) * (int(self.shard.max(initial=0)) + 1) + self.shard[order]
        starts = np.flatnonzero(np.r_[True, group_key[1:] != group_key[:-1]]) if len(order) else []
        for begin, end in zip(starts, list(starts[1:]) + [len(order)]):
            rows = order[begin:end]
            source, shard = int(self.source[rows[0]]), int(self.shard[rows[0]])
            tokens = self.reader(source, shard).tokens
            dtypes.add(tokens.dtype.name)
            if (self.num_tokens[rows] < 1).any() or (tokens[self.token_offset[rows] + self.num_tokens[rows] - 1] != eos_id).any():
                raise ValueError(f"{self.dirs[source]} shard {shard}: documents do not all end with EOS {eos_id}")
        if len(dtypes) > 1:
            raise ValueError(f"tokenized folders use different token dtypes {sorted(dtypes)}")

    def tokens(self, row: int, start: int, length: int) -> np.ndarray:
        reader = self.reader(self.source[row], self.shard[row])
        begin = self.token_offset[row] + start
        return reader.tokens[begin:begin + length]


def _iter_doc_texts(doc_texts, wanted: set[str]) -> Iterator[tuple[str, str]]:
    """(doc_id, text) once per wanted id, from a mapping or Parquet files/folders (doc_id, text).

    Ids are removed from `wanted` as they are found; what is left had no text.
    """
    if isinstance(doc_texts, Mapping):
        for doc_id in sorted(wanted):
            if doc_id in doc_texts:
                wanted.discard(doc_id)
                yield doc_id, doc_texts[doc_id]
        return
    import pyarrow.dataset as ds

    paths = [str(p) for p in doc_texts] if isinstance(doc_texts, (list, tuple)) else [str(doc_texts)]
    batches = (b for path in paths for b in ds.dataset(path, format="parquet").to_batches(columns=["doc_id", "text"]))
    for batch in batches:
        for doc_id, text in zip(batch.column("doc_id").to_pylist(), batch.column("text").to_pylist()):
            if doc_id in wanted:
                wanted.discard(doc_id)
                yield doc_id, text or ""


# --- planning ----------------------------------------------------------------------------

def _split_validation(rows: np.ndarray, keys: np.ndarray, num_tokens: np.ndarray, cfg: MixConfig):
    """(val rows in held-out order, train rows) of one bucket.

    A document is held out when the hash of (doc_id, seed) falls below val_fraction, so its
    side never changes when later snapshots add documents. Small buckets are topped up with
    the next documents in hash order until they have min_val_docs_per_bucket documents and
    one full sequence of tokens; at least one document always stays for training.
    """
    n = len(rows)
    if n < 2 or (cfg.val_fraction == 0 and cfg.min_val_docs_per_bucket == 0):
        return rows[:0], rows
    split_hash = _splitmix64(keys[rows] ^ _stream_key(cfg.seed, "validation"))
    order = np.argsort(split_hash, kind="stable")
    below = int(np.count_nonzero(split_hash < _U64(min(int(cfg.val_fraction * 2.0**64), 2**64 - 1))))
    cum_tokens = np.cumsum(num_tokens[rows[order]])
    for_one_sequence = int(np.searchsorted(cum_tokens, cfg.seq_len + 1)) + 1
    take = min(max(below, cfg.min_val_docs_per_bucket, for_one_sequence), n - 1)
    return rows[order[:take]], np.sort(rows[order[take:]])


def _allocate(weights: dict[str, float], total: int) -> dict[str, int]:
    """Integer token targets summing to `total`, by largest remainder."""
    exact = {b: w * total for b, w in weights.items()}
    targets = {b: int(math.floor(v)) for b, v in exact.items()}
    short = total - sum(targets.values())
    for b in sorted(exact, key=lambda b: (-(exact[b] - targets[b]), b))[:short]:
        targets[b] += 1
    return targets


def _sample_bucket(rows: np.ndarray, keys: np.ndarray, num_tokens: np.ndarray, target: int, seed: int, bucket: str):
    """Segments (row, start, length) adding up to `target` tokens: whole documents in a seeded
    order per epoch, the last one cut. Each epoch uses a fresh order."""
    seg_rows, seg_lengths = [], []
    remaining, epoch = target, 0
    while remaining > 0:
        order = rows[_seeded_order(keys[rows], seed, "order", bucket, epoch)]
        lengths = num_tokens[order]
        cum = np.cumsum(lengths)
        if cum[-1] <= remaining:
            seg_rows.append(order)
            seg_lengths.append(lengths)
            remaining -= int(cum[-1])
        else:
            whole = int(np.searchsorted(cum, remaining, side="right"))
            cut = remaining - (int(cum[whole - 1]) if whole else 0)
            seg_rows.append(order[:whole + (cut > 0)])
            seg_lengths.append(np.append(lengths[:whole], cut) if cut > 0 else lengths[:whole])
            remaining = 0
        epoch += 1
    rows_out = np.concatenate(seg_rows) if seg_rows else np.zeros(0, dtype=np.int64)
    lengths_out = np.concatenate(seg_lengths) if seg_lengths else np.zeros(0, dtype=np.int64)
    return rows_out, np.zeros(len(rows_out), dtype=np.int64), lengths_out


# --- packing -----------------------------------------------------------------------------

class _SpanWriter:
    """Streams lineage rows to Parquet, one row group per flush, and counts tokens per bucket.

    Rows arrive in seq_index order, so row-group statistics let readers skip to a sequence.
    """

    FLUSH_ROWS = 65_536

    def __init__(self, path: str, corpus: _Corpus, with_bucket: bool = False):
        self.path, self.corpus, self.with_bucket = path, corpus, with_bucket
        self.tokens_per_bucket = np.zeros(len(corpus.bucket_names), dtype=np.int64)
        self._columns: tuple[list[int], ...] = ([], [], [], [], [])
        self._writer = None

    def add(self, seq_index: int, seq_offset: int, row: int, doc_token_start: int, length: int) -> None:
        seq_indices, seq_offsets, rows, doc_token_starts, lengths = self._columns
        seq_indices.append(seq_index)
        seq_offsets.append(seq_offset)
        rows.append(row)
        doc_token_starts.append(doc_token_start)
        lengths.append(length)
        if len(seq_indices) >= self.FLUSH_ROWS:
            self._flush()

    def _table(self):
        import pyarrow as pa

        seq_index, seq_offset, rows, doc_token_start, length = (np.asarray(c, dtype=np.int64) for c in self._columns)
        codes = self.corpus.bucket_code[rows]
        self.tokens_per_bucket += np.bincount(codes, weights=length, minlength=len(self.tokens_per_bucket)).astype(np.int64)
        columns = {
            "seq_index": pa.array(seq_index),
            "seq_offset": pa.array(seq_offset.astype(np.int32)),
            "doc_id": self.corpus.doc_id.take(pa.array(rows)),
            "doc_token_start": pa.array(doc_token_start),
            "length": pa.array(length.astype(np.int32)),
        }
        if self.with_bucket:
            columns = {"bucket": pa.array(self.corpus.bucket_names, pa.string()).take(pa.array(codes)), **columns}
        return pa.table(columns)

    def _flush(self) -> None:
        import pyarrow.parquet as pq

        table = self._table()
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, table.schema, compression="zstd")
        self._writer.write_table(table)
        for column in self._columns:
            column.clear()

    def close(self) -> None:
        if self._columns[0] or self._writer is None:
            self._flush()  # also writes the schema of an empty file
        self._writer.close()


def _write_windows(path: str, corpus: _Corpus, seg_rows, seg_starts, seg_lengths, window_order: np.ndarray,
                   width: int, dtype: np.dtype, vocab_size: int, spans: _SpanWriter) -> None:
    """Write windows of the segment stream in `window_order` (row r = window window_order[r]).

    The output is written sequentially; the shards are read through their memory maps.
    """
    seg_ends = np.cumsum(seg_lengths)
    seg_begins = seg_ends - seg_lengths
    buffer = np.empty((_ROWS_PER_WRITE, width), dtype=dtype)
    with open(path, "wb") as out:
        for first in range(0, len(window_order), _ROWS_PER_WRITE):
            block = window_order[first:first + _ROWS_PER_WRITE]
            for i, window in enumerate(block.tolist()):
                pos, end = window * width, (window + 1) * width
                seg = int(np.searchsorted(seg_ends, pos, side="right"))
                while pos < end:
                    within = pos - int(seg_begins[seg])
                    take = min(end - pos, int(seg_ends[seg]) - pos)
                    row, start = int(seg_rows[seg]), int(seg_starts[seg]) + within
                    buffer[i, pos - window * width:pos - window * width + take] = corpus.tokens(row, start, take)
                    spans.add(first + i, pos - window * width, row, start, take)
                    pos += take
                    seg += 1
            chunk = buffer[:len(block)]
            if len(chunk) and int(chunk.max()) >= vocab_size:
                raise ValueError(f"token id {int(chunk.max())} is outside the vocabulary of {vocab_size}")
            out.write(chunk.astype(dtype.newbyteorder("<"), copy=False).tobytes())


# --- entry points ------------------------------------------------------------------------

def build_mixture(tokenized_dirs: list[str], out_dir: str, cfg: MixConfig | None = None, *, vocab_size: int,
                  eos_id: int, token_bytes_path: str,
                  doc_texts: Mapping[str, str] | str | list[str] | None = None) -> dict:
    """Write the `mixed_shards` folder into `out_dir` from `tokenized` folders; returns the manifest.

    `doc_texts` (mapping doc_id -> text, or one or more Parquet files/folders with doc_id and
    text, e.g. the deduplicated `kept/` folders) is required when `cfg.decontam.eval_sets`
    is non-empty; relative eval-set paths are resolved against the repository root, as
    pipeline.yaml's paths are. Warnings (heavy repetition, missing validation) are also listed
    in the manifest under "warnings".
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    cfg = cfg or MixConfig()
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id {eos_id} outside the vocabulary of {vocab_size}")
    token_bytes = np.load(token_bytes_path)
    if token_bytes.shape != (vocab_size,):
        raise ValueError(f"token_bytes has shape {token_bytes.shape}, expected ({vocab_size},)")
    out_dtype = np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)
    width = cfg.seq_len + 1

    corpus = _Corpus(tokenized_dirs, eos_id)
    notes: list[str] = []  # warnings, also kept in the manifest

    # 1. decontamination, before anything is split or sampled
    if cfg.decontam.eval_sets:
        if doc_texts is None:
            raise ValueError("decontamination is configured but no doc_texts were given")
        without_text = set(corpus.doc_id.to_pylist())
        dropped, decontam_report = decontaminate(_iter_doc_texts(doc_texts, without_text), cfg.decontam)
        decontam_report["documents_without_text"] = len(without_text)
        if without_text:
            notes.append(f"{len(without_text)} documents had no text and were not checked for contamination")
    else:
        dropped, decontam_report = set(), {"enabled": False}
    kept = ~pc.is_in(corpus.doc_id, value_set=pa.array(sorted(dropped), pa.string())).to_numpy(zero_copy_only=False)

    keys = _doc_keys(corpus.doc_id)
    all_buckets = [corpus.bucket_names[c] for c in np.unique(corpus.bucket_code[kept])]
    missing = [b for b, w in cfg.bucket_weights.items() if w > 0 and b not in all_buckets]
    if missing:
        raise ValueError(f"weighted buckets have no documents: {missing}")
    for bucket in all_buckets:
        if not _BUCKET_NAME.match(bucket):
            raise ValueError(f"bucket name {bucket!r} is not usable in a file name")

    # 2. held-out split per bucket, then 3. sampling of the training side
    num_sequences = cfg.total_tokens // width
    train_total = num_sequences * width
    targets = _allocate({b: cfg.bucket_weights.get(b, 0.0) for b in all_buckets}, train_total)
    val_rows: dict[str, np.ndarray] = {}
    plan, bucket_stats = [], {}
    for bucket in all_buckets:
        rows = np.flatnonzero(kept & (corpus.bucket_code == corpus.bucket_names.index(bucket)))
        val, train = _split_validation(rows, keys, corpus.num_tokens, cfg)
        val_rows[bucket] = val
        available = int(corpus.num_tokens[train].sum())
        target = targets[bucket]
        if target and not available:
            raise ValueError(f"bucket {bucket!r} has no training tokens left after the validation split")
        epochs = target / available if available else 0.0
        if epochs > cfg.max_epochs_warn:
            notes.append(f"bucket {bucket!r} is repeated {epochs:.2f} times (max_epochs_warn={cfg.max_epochs_warn})")
        segments = _sample_bucket(train, keys, corpus.num_tokens, target, cfg.seed, bucket)
        plan.append(segments)
        bucket_stats[bucket] = {
            "documents_available": int(len(train)),
            "tokens_available": available,
            "documents_sampled": int(len(np.unique(segments[0]))),
            "tokens_sampled": int(segments[2].sum()),
            "epochs": epochs,
            "target_share": cfg.bucket_weights.get(bucket, 0.0),
            "val_documents": int(len(val)),
        }

    # 4. one stream of all sampled segments in a seeded order, cut into windows, shuffled
    seg_rows = np.concatenate([p[0] for p in plan])
    seg_starts = np.concatenate([p[1] for p in plan])
    seg_lengths = np.concatenate([p[2] for p in plan])
    stream = _seeded_order(np.arange(len(seg_rows), dtype=_U64), cfg.seed, "stream")
    seg_rows, seg_starts, seg_lengths = seg_rows[stream], seg_starts[stream], seg_lengths[stream]
    window_order = _seeded_order(np.arange(num_sequences, dtype=_U64), cfg.seed, "windows")

    os.makedirs(out_dir, exist_ok=True)
    train_spans = _SpanWriter(os.path.join(out_dir, "train_spans.parquet"), corpus)
    _write_windows(os.path.join(out_dir, "train.bin"), corpus, seg_rows, seg_starts, seg_lengths,
                   window_order, width, out_dtype, vocab_size, train_spans)
    train_spans.close()
    for bucket, stats in bucket_stats.items():
        realised = int(train_spans.tokens_per_bucket[corpus.bucket_names.index(bucket)])
        stats["realised_share"] = realised / train_total

    # 5. validation rows per bucket: held-out documents in their seeded order, not shuffled
    validation = {}
    val_spans = _SpanWriter(os.path.join(out_dir, "val_spans.parquet"), corpus, with_bucket=True)
    wants_validation = cfg.val_fraction > 0 or cfg.min_val_docs_per_bucket > 0
    for bucket in all_buckets:
        rows = val_rows[bucket]
        lengths = corpus.num_tokens[rows]
        num_val = int(lengths.sum()) // width
        if num_val == 0 and wants_validation:
            notes.append(f"bucket {bucket!r} has too little text for one validation sequence")
        path = os.path.join(out_dir, f"val_{bucket}.bin")
        _write_windows(path, corpus, rows, np.zeros(len(rows), dtype=np.int64), lengths,
                       np.arange(num_val, dtype=np.int64), width, out_dtype, vocab_size, val_spans)
        val_tokens = np.fromfile(path, dtype=out_dtype.newbyteorder("<"))  # held-out sets are small
        validation[bucket] = {
            "file": f"val_{bucket}.bin",
            "num_sequences": num_val,
            "num_tokens": int(len(val_tokens)),
            "num_bytes": int(token_bytes[val_tokens].astype(np.int64).sum()),
        }
    val_spans.close()
    for note in notes:
        warnings.warn(note, stacklevel=2)
        log.warning(note)

    shutil.copyfile(token_bytes_path, os.path.join(out_dir, "token_bytes.npy"))
    manifest = {
        "dtype": out_dtype.name,
        "seq_len": cfg.seq_len,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "train": {"file": "train.bin", "num_sequences": int(num_sequences), "num_tokens": int(train_total)},
        "validation": validation,
        "buckets": bucket_stats,
        "token_bytes_file": "token_bytes.npy",
        "lineage": {"train_spans": "train_spans.parquet", "val_spans": "val_spans.parquet"},
        "decontam": decontam_report,
        "warnings": notes,
        "config": cfg.model_dump(mode="json"),
    }
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return manifest


def load_rows(mixed_dir: str, file: str = "train.bin") -> np.ndarray:
    """Memory-map `train.bin` (or a `val_<bucket>.bin`) as (N, seq_len + 1)."""
    with open(os.path.join(mixed_dir, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    width = manifest["seq_len"] + 1
    path = os.path.join(mixed_dir, file)
    if os.path.getsize(path) == 0:
        return np.zeros((0, width), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r").reshape(-1, width)


def trace_sequence(mixed_dir: str, seq_index: int, bucket: str | None = None) -> list[dict]:
    """Spans of training sequence `seq_index` (or of validation row `seq_index` of `bucket`):
    doc_id, doc_token_start, length, seq_offset, tokens; in sequence order.

    The span table is read with a predicate on seq_index, so only the row groups whose
    statistics can hold it are read (spans are written in seq_index order).
    """
    import pyarrow.parquet as pq

    if bucket is None:
        rows = load_rows(mixed_dir)
        spans_file, filters = "train_spans.parquet", [("seq_index", "==", seq_index)]
    else:
        with open(os.path.join(mixed_dir, "manifest.json"), encoding="utf-8") as f:
            validation = json.load(f)["validation"]
        if bucket not in validation:
            raise KeyError(f"no validation rows for bucket {bucket!r}; buckets: {', '.join(sorted(validation))}")
        rows = load_rows(mixed_dir, validation[bucket]["file"])
        spans_file, filters = "val_spans.parquet", [("bucket", "==", bucket), ("seq_index", "==", seq_index)]
    if not 0 <= seq_index < len(rows):
        raise IndexError(f"sequence {seq_index} outside 0..{len(rows) - 1}")
    spans = pq.read_table(os.path.join(mixed_dir, spans_file), filters=filters)
    row = rows[seq_index]
    out = []
    for span in sorted(spans.to_pylist(), key=lambda s: s["seq_offset"]):
        offset, length = span["seq_offset"], span["length"]
        out.append({
            "doc_id": span["doc_id"],
            "doc_token_start": span["doc_token_start"],
            "length": length,
            "seq_offset": offset,
            "tokens": row[offset:offset + length].tolist(),
        })
    return out


def validation_doc_ids(mixed_dir: str) -> list[str]:
    """doc_ids whose tokens fill the validation rows (from val_spans.parquet)."""
    import pyarrow.parquet as pq

    return sorted(set(pq.read_table(os.path.join(mixed_dir, "val_spans.parquet"), columns=["doc_id"])
                      .column("doc_id").to_pylist()))
