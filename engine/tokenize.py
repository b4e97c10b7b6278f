"""Tokenize documents with Spark into Megatron MMapIndexedDataset shards.

Output folder (docs/CONTRACTS.md, `tokenized`): `shard-{i:05d}.bin` / `.idx` and
`doc_index.parquet`. Each document is one Megatron "sequence" ending with EOS, so
`doc_idx` is simply 0..num_docs.

Index file layout (Megatron-LM `_IndexWriter`, little-endian):
    b"MMIDIDX\\x00\\x00" | u64 version=1 | u8 dtype code | u64 num_sequences | u64 len(doc_idx)
    | int32 sizes[num_sequences] | int64 pointers[num_sequences] (byte offsets into .bin)
    | int64 doc_idx[num_docs + 1]

Megatron's dtype table has no uint32, so tokens are uint16 when the vocabulary fits
(<= 65535 ids) and int32 (code 4, what Megatron itself picks for large vocabularies)
otherwise; ids below 2**31 have the same bytes in int32 and uint32.
"""
from __future__ import annotations

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
DOC_INDEX_FILE = "doc_index.parquet"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.int32)


def shard_prefix(out_dir: str, shard: int) -> str:
    return os.path.join(out_dir, f"shard-{shard:05d}")


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

# One SentencePieceProcessor per Python worker and model file; Spark reuses workers across
# tasks, so a shard task does not pay the model load again. Keyed by mtime and size too, so a
# retrained model written to the same path is picked up.
_PROCESSORS: dict[tuple[str, int, int], object] = {}


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
    """Flat token array (EOS after every document) and per-document lengths."""
    ids = processor.encode(texts, num_threads=1)  # one core per Spark task
    sizes = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    eos = [eos_id]
    flat = np.fromiter(itertools.chain.from_iterable(x + eos for x in ids), dtype=dtype, count=int(sizes.sum()))
    return flat, sizes


def _shard_task(model_path: str, out_dir: str, eos_id: int, dtype: np.dtype):
    def tokenize_shard(batches):
        import pyarrow as pa
        from pyspark import TaskContext

        context = TaskContext.get()
        shard = context.partitionId()
        processor = load_processor(model_path)
        writer = IndexedDatasetWriter(
            shard_prefix(out_dir, shard), dtype, tmp_suffix=f".tmp-{context.taskAttemptId()}"
        )
        doc_ids: list[str] = []
        buckets: list[str] = []
        for batch in batches:
            texts = [t or "" for t in batch.column("text").to_pylist()]
            flat, sizes = encode_documents(processor, texts, eos_id, dtype)
            writer.add_documents(flat, sizes)
            doc_ids.extend(batch.column("doc_id").to_pylist())
            buckets.extend(batch.column("bucket").to_pylist())
        sizes = writer.finalize()
        offsets = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1], out=offsets[1:])
        yield pa.RecordBatch.from_pydict({
            "doc_id": pa.array(doc_ids, pa.string()),
            "bucket": pa.array(buckets, pa.string()),
            "shard": pa.array(np.full(len(sizes), shard, dtype=np.int32)),
            "shard_doc": pa.array(np.arange(len(sizes), dtype=np.int64)),
            "token_offset": pa.array(offsets),
            "num_tokens": pa.array(sizes.astype(np.int64)),
        })

    return tokenize_shard


DOC_INDEX_SCHEMA = "doc_id string, bucket string, shard int, shard_doc long, token_offset long, num_tokens long"


def tokenize_documents(spark, docs_df, model_path: str, out_dir: str, *, num_shards: int, eos_id: int) -> dict:
    """Tokenize `docs_df` (doc_id, bucket, text) into `num_shards` Megatron shards in `out_dir`.

    Documents are hash-partitioned by doc_id and sorted by doc_id inside each shard, so the
    output bytes depend only on the set of documents. Every Spark task writes its own shard;
    the driver collects one small row per document for `doc_index.parquet`. `model_path` and
    `out_dir` must be on a filesystem every executor sees, and workers must be able to import
    `engine` (true when Spark is started from the repository root).
    Returns stats: documents and tokens per bucket, totals, dtype, vocab size and shards.
    """
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
    if any(name.startswith("shard-") or name == DOC_INDEX_FILE for name in os.listdir(out_dir)):
        raise FileExistsError(f"{out_dir} already holds tokenized shards; write into a fresh folder")

    shaped = (
        docs_df.select("doc_id", "bucket", "text")
        .repartition(num_shards, "doc_id")
        .sortWithinPartitions("doc_id")
    )
    rows = shaped.mapInArrow(_shard_task(model_path, out_dir, eos_id, dtype), DOC_INDEX_SCHEMA).toArrow()

    # A partition that received no rows may not run a task; give it an empty shard so the
    # folder always holds num_shards pairs.
    for shard in range(num_shards):
        prefix = shard_prefix(out_dir, shard)
        if not os.path.exists(prefix + ".idx"):
            write_indexed_dataset(prefix, [], dtype)

    doc_index = rows.sort_by([("shard", "ascending"), ("shard_doc", "ascending")])
    pq.write_table(doc_index, os.path.join(out_dir, DOC_INDEX_FILE), compression="zstd")

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
