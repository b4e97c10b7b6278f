"""Tokenize documents with Spark into Megatron MMapIndexedDataset shards.

Output folder (docs/CONTRACTS.md, `tokenized`): per shard `shard-{i:05d}.bin` / `.idx` and,
beside them, its document index `shard-{i:05d}.doc_index.parquet` (doc_id, bucket, shard,
shard_doc, token_offset, num_tokens). Each document is one Megatron "sequence" ending with EOS,
so `doc_idx` is simply 0..num_docs.

Index file layout (Megatron-LM `_IndexWriter`, little-endian):
    b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 num_sequences | u64 len(doc_idx)
    | int32 sizes[num_sequences] | int64 pointers[num_sequences] (byte offsets into .bin)
    | int64 doc_idx[num_docs + 1]

Megatron's dtype table (megatron/core/datasets/indexed_dataset.py `DType`: codes 1-8, uint8 int8
int16 int32 int64 float64 float32 uint16) has no uint32, so tokens are uint16 when the vocabulary
fits (<= 65535 ids) and int32 (code 4, what Megatron's own `DType.optimal_dtype` picks for large
vocabularies) otherwise; ids below 2**31 have the same bytes in int32 and uint32.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import struct
from typing import Iterable, Iterator

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {
    np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
    np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
DOC_INDEX_SUFFIX = ".doc_index.parquet"
# One index per snapshot, as tokenized code version 2 wrote it; still read, so older artifacts
# (an older mixture traced with `kiln trace --mixed`) keep working.
DOC_INDEX_FILE = "doc_index.parquet"
DOC_INDEX_COLUMNS = ("doc_id", "bucket", "shard", "shard_doc", "token_offset", "num_tokens")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.int32)


def shard_prefix(out_dir: str, shard: int) -> str:
    return os.path.join(out_dir, f"shard-{shard:05d}")


def doc_index_path(out_dir: str, shard: int) -> str:
    """The document index beside shard `shard`: `shard-00000.doc_index.parquet`."""
    return shard_prefix(out_dir, shard) + DOC_INDEX_SUFFIX


def num_shards_in(folder: str) -> int:
    """Shards of a tokenized folder: its `shard-*.idx` files, numbered 0..n-1."""
    n = sum(1 for name in os.listdir(folder) if name.startswith("shard-") and name.endswith(".idx"))
    if n and not os.path.exists(shard_prefix(folder, n - 1) + ".idx"):
        raise ValueError(f"{folder}: shard files are not numbered 0..{n - 1}")
    return n


def doc_index_files(folder: str, shards=None) -> list[str]:
    """Document index files of a tokenized folder (of `shards` only, if given), in shard order;
    the one legacy `doc_index.parquet` for folders written before the per-shard layout."""
    per_shard = range(num_shards_in(folder)) if shards is None else sorted(set(int(s) for s in shards))
    files = [doc_index_path(folder, s) for s in per_shard]
    if files and not os.path.exists(files[0]) and os.path.exists(os.path.join(folder, DOC_INDEX_FILE)):
        return [os.path.join(folder, DOC_INDEX_FILE)]
    missing = [f for f in files if not os.path.exists(f)]
    if missing:
        names = ", ".join(os.path.basename(f) for f in missing)
        raise FileNotFoundError(f"{folder}: no document index beside its shard: {names}")
    return files


def read_doc_index(folder: str):
    """All documents of a tokenized folder as one Arrow table (DOC_INDEX_COLUMNS), in shard order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(path, columns=list(DOC_INDEX_COLUMNS)) for path in doc_index_files(folder)]
    return pa.concat_tables(tables) if tables else _empty_doc_index()


def _empty_doc_index():
    import pyarrow as pa

    return pa.table({"doc_id": pa.array([], pa.string()), "bucket": pa.array([], pa.string()),
                     "shard": pa.array([], pa.int32()), "shard_doc": pa.array([], pa.int64()),
                     "token_offset": pa.array([], pa.int64()), "num_tokens": pa.array([], pa.int64())})


# --- Megatron MMapIndexedDataset ---------------------------------------------------------

class IndexedDatasetWriter:
    """Streams documents into `<prefix>.bin` and writes `<prefix>.idx` on `finalize`.

    Both files are written under a temporary suffix and renamed at the end, so a retried or
    speculative Spark task never leaves a half-written shard under the final name.
    """

    def __init__(self, prefix: str, dtype: np.dtype, tmp_suffix: str = ".tmp"):
        if np.dtype(dtype) not in DTYPE_CODES:
            raise ValueError(f"dtype {dtype} has no Megatron code")
        self.prefix, self.dtype, self.tmp_suffix = prefix, np.dtype(dtype), tmp_suffix
        self._bin = open(prefix + ".bin" + tmp_suffix, "wb")
        self._sizes: list[np.ndarray] = []

    def add_documents(self, flat_tokens: np.ndarray, sizes: np.ndarray) -> None:
        """Append documents given as one flat array and their lengths."""
        if int(sizes.sum()) != len(flat_tokens):
            raise ValueError("sizes do not add up to the token count")
        self._bin.write(np.ascontiguousarray(flat_tokens, dtype=self.dtype).tobytes())
        self._sizes.append(np.asarray(sizes, dtype=np.int32))

    def finalize(self) -> np.ndarray:
        """Write the index, publish both files and return the document sizes."""
        self._bin.close()
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, dtype=np.int32)
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(len(sizes) + 1, dtype=np.int64)
        with open(self.prefix + ".idx" + self.tmp_suffix, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<Q", INDEX_VERSION))
            f.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", len(sizes)))
            f.write(struct.pack("<Q", len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())
        os.replace(self.prefix + ".bin" + self.tmp_suffix, self.prefix + ".bin")
        os.replace(self.prefix + ".idx" + self.tmp_suffix, self.prefix + ".idx")
        return sizes


def write_indexed_dataset(prefix: str, documents: Iterable[np.ndarray], dtype) -> np.ndarray:
    """Write a list of token arrays as one shard; returns the sizes."""
    docs = [np.asarray(d) for d in documents]
    writer = IndexedDatasetWriter(prefix, np.dtype(dtype))
    if docs:
        writer.add_documents(np.concatenate(docs), np.array([len(d) for d in docs], dtype=np.int64))
    return writer.finalize()


class IndexedDataset:
    """Read-only, memory-mapped view of one shard; `ds[i]` is document i's tokens (no copy)."""

    def __init__(self, bin_path: str):
        prefix = bin_path[:-4] if bin_path.endswith(".bin") else bin_path
        self.bin_path, self.idx_path = prefix + ".bin", prefix + ".idx"
        with open(self.idx_path, "rb") as f:
            header = f.read(len(INDEX_HEADER))
            if header != INDEX_HEADER:
                raise ValueError(f"{self.idx_path} is not a Megatron MMapIndexedDataset index")
            (version,) = struct.unpack("<Q", f.read(8))
            if version != INDEX_VERSION:
                raise ValueError(f"{self.idx_path}: unsupported index version {version}")
            (code,) = struct.unpack("<B", f.read(1))
            (num_sequences,) = struct.unpack("<Q", f.read(8))
            (num_doc_idx,) = struct.unpack("<Q", f.read(8))
            offset = f.tell()
        self.dtype = CODE_DTYPES[code]
        self.sizes = np.memmap(self.idx_path, dtype="<i4", mode="r", offset=offset, shape=(num_sequences,))
        offset += 4 * num_sequences
        self.pointers = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=offset, shape=(num_sequences,))
        offset += 8 * num_sequences
        self.doc_idx = np.memmap(self.idx_path, dtype="<i8", mode="r", offset=offset, shape=(num_doc_idx,))
        num_tokens = int(self.sizes.sum(dtype=np.int64))
        # np.memmap refuses zero-length maps; an empty shard reads as an empty array.
        self.tokens = (
            np.memmap(self.bin_path, dtype=self.dtype.newbyteorder("<"), mode="r", shape=(num_tokens,))
            if num_tokens else np.zeros(0, dtype=self.dtype)
        )

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start:start + int(self.sizes[i])]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))

    def token_offsets(self) -> np.ndarray:
        return np.asarray(self.pointers) // self.dtype.itemsize


def read_indexed_dataset(bin_path: str) -> IndexedDataset:
    """Memory-map a shard (`shard-00000.bin` or its prefix); index it to get documents."""
    return IndexedDataset(bin_path)


# --- Spark tokenization ------------------------------------------------------------------
#
# Two passes, and the text crosses into Python once and is never shuffled or sorted:
#   1. encode: each task encodes its documents (SentencePiece on Arrow batches) and appends the
#      tokens, EOS after each document, to one piece file of its own under `<out>/.pieces/`; it
#      returns one small key row per document (doc_id, bucket, shard, piece, offset, length).
#   2. assemble: the driver sorts the keys by (shard, doc_id), which is the only sort, and each
#      shard is gathered from the pieces (memory-mapped) into its Megatron .bin/.idx.
# Input is either a DataFrame (text reaches Python through mapInArrow) or Parquet files, which
# the tasks read with pyarrow themselves so the JVM never touches the text at all. Compared with
# a repartition + sortWithinPartitions of the text, nothing of the text size goes through
# Spark's shuffle files or sorter, and the token pieces are half the size of the text.
# Measured on 2 cores (tests/benchmarks/bench_tokenize.py), what is left beyond the encode itself
# is mostly Spark's fixed cost per job and task, not per token.

# One SentencePieceProcessor per Python worker and model file; Spark reuses workers across
# tasks, so a shard task does not pay the model load again. Keyed by mtime and size too, so a
# retrained model written to the same path is picked up.
_PROCESSORS: dict[tuple[str, int, int], object] = {}
PIECES_DIR = ".pieces"
ENCODE_BATCH_DOCS = 1024  # documents per SentencePiece call when reading Parquet directly
_ASSEMBLE_CHUNK_TOKENS = 1 << 22
KEY_SCHEMA = "doc_id string, bucket string, shard int, piece long, piece_offset long, num_tokens long"


def load_processor(model_path: str):
    import sentencepiece as spm

    stat = os.stat(model_path)
    key = (os.path.abspath(model_path), stat.st_mtime_ns, stat.st_size)
    processor = _PROCESSORS.get(key)
    if processor is None:
        processor = spm.SentencePieceProcessor(model_file=model_path)
        _PROCESSORS[key] = processor
    return processor


def encode_documents(processor, texts: list[str], eos_id: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Flat token array (EOS after every document) and per-document lengths (EOS included).

    One SentencePiece call per batch; the id lists are flattened by one C-level iterator, with
    no per-document list copies (about 30 ns per token, 3% of the encode itself).
    """
    ids = processor.encode(texts, num_threads=1)  # one core per Spark task
    sizes = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1
    with_eos = itertools.chain.from_iterable(zip(ids, itertools.repeat([eos_id])))
    flat = np.fromiter(itertools.chain.from_iterable(with_eos), dtype=dtype, count=int(sizes.sum()))
    return flat, sizes


def shard_of(doc_ids: list[str], num_shards: int) -> np.ndarray:
    """Shard of each doc_id: a stable hash, the same on every machine and Python version."""
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(d.encode("utf-8"), digest_size=8).digest(), "little") % num_shards
         for d in doc_ids), dtype=np.int32, count=len(doc_ids))


def piece_path(out_dir: str, piece: int) -> str:
    return os.path.join(out_dir, PIECES_DIR, f"piece-{piece:08d}.bin")


class _PieceEncoder:
    """Pass 1 of one task: encodes batches into the task's piece file, collects their keys.

    The piece is named by the task attempt, so a retried or speculative attempt writes its own
    file and its keys point at it; pieces are removed when the shards are assembled.
    """

    def __init__(self, model_path: str, out_dir: str, eos_id: int, dtype: np.dtype, num_shards: int, piece: int):
        self.processor = load_processor(model_path)
        self.eos_id, self.dtype, self.num_shards, self.piece = eos_id, dtype, num_shards, piece
        self.file = open(piece_path(out_dir, piece), "wb")
        self.offset = 0
        self.keys: list = []

    def add(self, batch) -> None:
        import pyarrow as pa

        if batch.num_rows == 0:
            return
        texts = [t or "" for t in batch.column("text").to_pylist()]
        doc_ids = batch.column("doc_id").to_pylist()
        flat, sizes = encode_documents(self.processor, texts, self.eos_id, self.dtype)
        self.file.write(flat.tobytes())
        offsets = self.offset + np.cumsum(sizes) - sizes
        self.offset += len(flat)
        self.keys.append(pa.RecordBatch.from_pydict({
            "doc_id": pa.array(doc_ids, pa.string()),
            "bucket": batch.column("bucket").cast(pa.string()),
            "shard": pa.array(shard_of(doc_ids, self.num_shards)),
            "piece": pa.array(np.full(len(sizes), self.piece, dtype=np.int64)),
            "piece_offset": pa.array(offsets.astype(np.int64)),
            "num_tokens": pa.array(sizes.astype(np.int64)),
        }))

    def finish(self) -> list:
        self.file.close()
        return self.keys


def _encode_dataframe_task(model_path: str, out_dir: str, eos_id: int, dtype: np.dtype, num_shards: int):
    def encode(batches):
        from pyspark import TaskContext

        encoder = _PieceEncoder(model_path, out_dir, eos_id, dtype, num_shards, TaskContext.get().taskAttemptId())
        for batch in batches:
            encoder.add(batch)
        yield from encoder.finish()

    return encode


def _encode_parquet_task(model_path: str, out_dir: str, eos_id: int, dtype: np.dtype, num_shards: int):
    def encode(units):
        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        encoder = _PieceEncoder(model_path, out_dir, eos_id, dtype, num_shards, TaskContext.get().taskAttemptId())
        for file, row_group in units:
            for batch in pq.ParquetFile(file).iter_batches(
                    batch_size=ENCODE_BATCH_DOCS, row_groups=[row_group], columns=["doc_id", "bucket", "text"]):
                encoder.add(batch)
        keys = encoder.finish()
        if keys:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, keys[0].schema) as stream:
                for batch in keys:
                    stream.write_batch(batch)
            yield sink.getvalue().to_pybytes()

    return encode


def _assemble_task(out_dir: str, dtype: np.dtype):
    def assemble(plans):
        from pyspark import TaskContext

        attempt = TaskContext.get().taskAttemptId()
        for shard, pieces, offsets, sizes in plans:
            writer = IndexedDatasetWriter(shard_prefix(out_dir, shard), dtype, tmp_suffix=f".tmp-{attempt}")
            maps: dict[int, np.ndarray] = {}
            chunk, chunk_sizes, chunk_tokens = [], [], 0
            for piece, offset, size in zip(pieces.tolist(), offsets.tolist(), sizes.tolist()):
                if piece not in maps:
                    maps[piece] = np.memmap(piece_path(out_dir, piece), dtype=dtype, mode="r")
                chunk.append(maps[piece][offset:offset + size])
                chunk_sizes.append(size)
                chunk_tokens += size
                if chunk_tokens >= _ASSEMBLE_CHUNK_TOKENS:
                    writer.add_documents(np.concatenate(chunk), np.array(chunk_sizes, dtype=np.int64))
                    chunk, chunk_sizes, chunk_tokens = [], [], 0
            if chunk:
                writer.add_documents(np.concatenate(chunk), np.array(chunk_sizes, dtype=np.int64))
            writer.finalize()
            yield shard

    return assemble


def parquet_units(paths: str | list[str]) -> list[tuple[str, int]]:
    """(file, row group) of every Parquet file under `paths` (files or folders), in path order."""
    import pyarrow.parquet as pq

    files = []
    for path in [paths] if isinstance(paths, (str, os.PathLike)) else paths:
        path = os.path.abspath(path)
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
                files += [os.path.join(root, n) for n in sorted(names)
                          if n.endswith(".parquet") and not n.startswith((".", "_"))]
        else:
            files.append(path)
    return [(f, g) for f in files for g in range(pq.ParquetFile(f).metadata.num_row_groups)]


def tokenize_documents(spark, docs, model_path: str, out_dir: str, *, num_shards: int, eos_id: int) -> dict:
    """Tokenize documents (doc_id, bucket, text) into `num_shards` Megatron shards in `out_dir`.

    `docs` is a DataFrame, or one or more Parquet files or folders (what the `tokenized` asset
    passes: the tasks then read the files with pyarrow, a few row groups per task). A document's
    shard is a stable hash of its doc_id and documents are sorted by doc_id inside each shard,
    so the output bytes depend only on the set of documents. The driver holds one small key row
    per document (it writes the document index beside each shard). `model_path` and `out_dir` must be on a
    filesystem every executor sees, and workers must be able to import `engine` (true when
    Spark is started from the repository root).
    Returns stats: documents and tokens per bucket, totals, dtype, vocab size and shards.
    """
    import shutil

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    model_path = os.path.abspath(model_path)
    out_dir = os.path.abspath(out_dir)
    vocab_size = load_processor(model_path).get_piece_size()
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"eos_id {eos_id} outside the vocabulary of {vocab_size}")
    dtype = token_dtype(vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    if any(name.startswith("shard-") or name in (DOC_INDEX_FILE, PIECES_DIR) for name in os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} already holds tokenized shards; write into a fresh folder")
    os.makedirs(os.path.join(out_dir, PIECES_DIR))
    sc = spark.sparkContext

    # Pass 1: encode into pieces, collect the keys.
    if hasattr(docs, "mapInArrow"):
        keys = (docs.select("doc_id", "bucket", "text")
                .mapInArrow(_encode_dataframe_task(model_path, out_dir, eos_id, dtype, num_shards), KEY_SCHEMA)
                .toArrow())
    else:
        units = parquet_units(docs)
        # A few tasks per core, each over consecutive row groups: every task costs tens of ms of
        # scheduling and worker time, which is a visible share of the work on small inputs.
        streams = (sc.parallelize(units, min(len(units), 2 * sc.defaultParallelism))
                   .mapPartitions(_encode_parquet_task(model_path, out_dir, eos_id, dtype, num_shards))
                   .collect()) if units else []
        tables = [pa.ipc.open_stream(stream).read_all() for stream in streams]
        keys = pa.concat_tables(tables) if tables else None
    if keys is None or keys.num_rows == 0:
        keys = pa.table({"doc_id": pa.array([], pa.string()), "bucket": pa.array([], pa.string()),
                         "shard": pa.array([], pa.int32()), "piece": pa.array([], pa.int64()),
                         "piece_offset": pa.array([], pa.int64()), "num_tokens": pa.array([], pa.int64())})

    # The only sort: keys by (shard, doc_id). Then offsets inside each shard.
    keys = keys.sort_by([("shard", "ascending"), ("doc_id", "ascending")]).combine_chunks()
    shard = keys.column("shard").to_numpy().astype(np.int64)
    sizes = keys.column("num_tokens").to_numpy()
    if keys.num_rows > 1:
        doc_ids = keys.column("doc_id")
        same = pc.and_(pc.equal(doc_ids.slice(1), doc_ids.slice(0, keys.num_rows - 1)),
                       pc.equal(keys.column("shard").slice(1), keys.column("shard").slice(0, keys.num_rows - 1)))
        if pc.any(same).as_py():
            first = int(np.flatnonzero(same.to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"doc_id {doc_ids[first].as_py()} occurs more than once")
    starts = np.searchsorted(shard, np.arange(num_shards + 1))
    exclusive = np.cumsum(sizes) - sizes
    shard_doc = np.arange(keys.num_rows, dtype=np.int64) - starts[shard]
    token_offset = exclusive - exclusive[starts[shard]] if keys.num_rows else exclusive

    # Pass 2: each task assembles whole shards from the pieces (empty shards included).
    pieces, offsets = keys.column("piece").to_numpy(), keys.column("piece_offset").to_numpy()
    plans = [(s, pieces[starts[s]:starts[s + 1]], offsets[starts[s]:starts[s + 1]], sizes[starts[s]:starts[s + 1]])
             for s in range(num_shards)]
    sc.parallelize(plans, min(num_shards, 2 * sc.defaultParallelism)).mapPartitions(_assemble_task(out_dir, dtype)).collect()
    shutil.rmtree(os.path.join(out_dir, PIECES_DIR))

    doc_index = pa.table({
        "doc_id": keys.column("doc_id"),
        "bucket": keys.column("bucket"),
        "shard": pa.array(shard.astype(np.int32)),
        "shard_doc": pa.array(shard_doc.astype(np.int64)),
        "token_offset": pa.array(token_offset.astype(np.int64)),
        "num_tokens": pa.array(sizes.astype(np.int64)),
    })
    # Beside each shard its own index, sorted by doc_id (row-group statistics serve trace lookups).
    for s in range(num_shards):
        pq.write_table(doc_index.slice(int(starts[s]), int(starts[s + 1] - starts[s])), doc_index_path(out_dir, s),
                       compression="zstd")

    buckets: dict[str, dict[str, int]] = {}
    if doc_index.num_rows:
        summary = doc_index.group_by("bucket").aggregate([("num_tokens", "sum"), ("num_tokens", "count")])
        for row in sorted(summary.to_pylist(), key=lambda r: r["bucket"]):
            buckets[row["bucket"]] = {"documents": row["num_tokens_count"], "tokens": row["num_tokens_sum"]}
    return {
        "documents": doc_index.num_rows,
        "tokens": int(pc.sum(doc_index.column("num_tokens")).as_py() or 0),
        "buckets": buckets,
        "shards": num_shards,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
    }
