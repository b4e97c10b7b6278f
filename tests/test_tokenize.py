import hashlib
import struct

import numpy as np
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from engine.tokenize import (
    DOC_INDEX_FILE, INDEX_HEADER, doc_index_files, doc_index_path, read_doc_index, read_indexed_dataset, shard_of,
    token_dtype, tokenize_documents, write_indexed_dataset,
)
from engine.tokenizer import EOS_ID, TokenizerConfig, train_tokenizer

DOC_SCHEMA = "doc_id string, bucket string, text string"


def prose_rows(shared_data, docs_per_bucket=60):
    prose = shared_data / "prose"
    plays = (prose / "tinyshakespeare" / "data_tinyshakespeare_input.txt").read_text(encoding="utf-8").split("\n\n")
    novel = (prose / "gutenberg_pride_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    novel = novel.replace("\r\n", "\n").split("\n\n")[40:]
    group = lambda parts, k: ["\n".join(p.strip() for p in parts[i:i + k]) for i in range(0, len(parts), k)]
    buckets = {"shakespeare": group(plays, 8)[:docs_per_bucket], "austen": group(novel, 4)[:docs_per_bucket]}
    return [
        (hashlib.sha1(f"{bucket}\x00{i}".encode()).hexdigest()[:20], bucket, text)
        for bucket, texts in buckets.items() for i, text in enumerate(texts)
    ]


@pytest.fixture(scope="module")
def rows(shared_data):
    return prose_rows(shared_data)


@pytest.fixture(scope="module")
def model_path(rows, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    texts = {}
    for _, bucket, text in rows:
        texts.setdefault(bucket, []).append(text)
    train_tokenizer(texts, str(out), TokenizerConfig(vocab_size=1024, sample_chars_per_bucket=50_000))
    return str(out / "tokenizer.model")


@pytest.fixture(scope="module")
def tokenized(spark, rows, model_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenized")
    stats = tokenize_documents(spark, spark.createDataFrame(rows, DOC_SCHEMA), model_path, str(out),
                               num_shards=3, eos_id=EOS_ID)
    return out, stats


def test_megatron_index_round_trip(tmp_path):
    docs = [np.array([5, 6, 7], np.uint16), np.array([], np.uint16), np.array([65535, 2], np.uint16)]
    sizes = write_indexed_dataset(str(tmp_path / "s"), docs, np.uint16)
    assert sizes.tolist() == [3, 0, 2]
    raw = (tmp_path / "s.idx").read_bytes()
    assert raw[:9] == INDEX_HEADER == b"MMIDIDX\x00\x00"
    version, = struct.unpack("<Q", raw[9:17])
    code = raw[17]
    num_seq, num_doc_idx = struct.unpack("<QQ", raw[18:34])
    assert (version, code, num_seq, num_doc_idx) == (1, 8, 3, 4)
    body = raw[34:]
    assert np.frombuffer(body[:12], "<i4").tolist() == [3, 0, 2]
    assert np.frombuffer(body[12:36], "<i8").tolist() == [0, 6, 6]  # byte pointers
    assert np.frombuffer(body[36:], "<i8").tolist() == [0, 1, 2, 3]
    assert (tmp_path / "s.bin").read_bytes() == np.array([5, 6, 7, 65535, 2], "<u2").tobytes()
    ds = read_indexed_dataset(str(tmp_path / "s.bin"))
    assert ds.dtype == np.uint16 and len(ds) == 3
    assert [d.tolist() for d in ds] == [d.tolist() for d in docs]


def test_large_vocab_uses_int32_code(tmp_path):
    assert token_dtype(65535) == np.uint16 and token_dtype(65536) == np.int32
    write_indexed_dataset(str(tmp_path / "w"), [np.array([70_000, 2], np.int32)], np.int32)
    assert (tmp_path / "w.idx").read_bytes()[17] == 4
    assert read_indexed_dataset(str(tmp_path / "w"))[0].tolist() == [70_000, 2]


def test_empty_shard_reads_as_empty(tmp_path):
    write_indexed_dataset(str(tmp_path / "e"), [], np.uint16)
    assert len(read_indexed_dataset(str(tmp_path / "e.bin"))) == 0


def test_every_document_round_trips_and_ends_with_eos(tokenized, rows, model_path):
    out, stats = tokenized
    sp = spm.SentencePieceProcessor(model_file=model_path)
    texts = {doc_id: text for doc_id, _, text in rows}
    index = read_doc_index(str(out))
    assert index.column_names == ["doc_id", "bucket", "shard", "shard_doc", "token_offset", "num_tokens"]
    assert index.num_rows == len(rows) == stats["documents"]
    shards = {s: read_indexed_dataset(str(out / f"shard-{s:05d}.bin")) for s in range(3)}
    assert sum(len(ds) for ds in shards.values()) == len(rows)
    for doc in index.to_pylist():
        ds = shards[doc["shard"]]
        tokens = ds[doc["shard_doc"]]
        assert ds.token_offsets()[doc["shard_doc"]] == doc["token_offset"]
        assert len(tokens) == doc["num_tokens"] and tokens[-1] == EOS_ID
        assert EOS_ID not in tokens[:-1].tolist()
        assert sp.decode(tokens[:-1].tolist()) == texts[doc["doc_id"]]


def test_a_document_index_sits_beside_each_shard(tokenized):
    out, _ = tokenized
    assert doc_index_files(str(out)) == [str(out / f"shard-{s:05d}.doc_index.parquet") for s in range(3)]
    assert not (out / DOC_INDEX_FILE).exists()
    for s in range(3):
        index = pq.read_table(doc_index_path(str(out), s)).to_pylist()
        shard = read_indexed_dataset(str(out / f"shard-{s:05d}.bin"))
        assert index and len(index) == len(shard)  # every document of this shard, nothing else
        assert [d["shard"] for d in index] == [s] * len(index) and [d["shard_doc"] for d in index] == list(range(len(index)))
        assert shard_of([d["doc_id"] for d in index], 3).tolist() == [s] * len(index)
        assert [d["token_offset"] for d in index] == shard.token_offsets().tolist()
        assert [d["num_tokens"] for d in index] == shard.sizes.tolist()


def test_legacy_single_doc_index_is_still_read(tokenized, tmp_path):
    """Folders written before the per-shard layout (tokenized v2) had one doc_index.parquet."""
    import shutil

    out, _ = tokenized
    for path in out.iterdir():
        if not path.name.endswith(".doc_index.parquet"):
            shutil.copy(path, tmp_path / path.name)
    pq.write_table(read_doc_index(str(out)), tmp_path / DOC_INDEX_FILE)
    assert doc_index_files(str(tmp_path)) == [str(tmp_path / DOC_INDEX_FILE)]
    assert read_doc_index(str(tmp_path)).equals(read_doc_index(str(out)))
    (tmp_path / DOC_INDEX_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="shard-00000.doc_index.parquet"):
        doc_index_files(str(tmp_path))


def test_shards_sorted_by_doc_id_and_stats_per_bucket(tokenized, rows):
    out, stats = tokenized
    index = read_doc_index(str(out)).to_pandas()
    for _, shard in index.groupby("shard"):
        assert shard.sort_values("shard_doc")["doc_id"].is_monotonic_increasing
    assert stats["shards"] == 3 and stats["dtype"] == "uint16" and stats["vocab_size"] == 1024
    for bucket, group in index.groupby("bucket"):
        assert stats["buckets"][bucket] == {"documents": len(group), "tokens": int(group["num_tokens"].sum())}
    assert stats["tokens"] == int(index["num_tokens"].sum())


def test_tokenize_is_deterministic_regardless_of_input_order(spark, tokenized, rows, model_path, tmp_path):
    out, stats = tokenized
    shuffled = spark.createDataFrame(list(reversed(rows)), DOC_SCHEMA).repartition(5)
    again = tokenize_documents(spark, shuffled, model_path, str(tmp_path), num_shards=3, eos_id=EOS_ID)
    assert again == stats
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_empty_parquet_folder_gives_empty_shards(spark, model_path, tmp_path):
    import pyarrow as pa

    (tmp_path / "docs").mkdir()
    pq.write_table(pa.table({"doc_id": pa.array([], pa.string()), "bucket": pa.array([], pa.string()),
                             "text": pa.array([], pa.string())}), tmp_path / "docs" / "part-00000.parquet")
    stats = tokenize_documents(spark, str(tmp_path / "docs"), model_path, str(tmp_path / "out"), num_shards=2, eos_id=EOS_ID)
    assert stats["documents"] == 0 and stats["tokens"] == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "shard-00000.bin", "shard-00000.doc_index.parquet", "shard-00000.idx",
        "shard-00001.bin", "shard-00001.doc_index.parquet", "shard-00001.idx"]
    assert read_doc_index(str(tmp_path / "out")).num_rows == 0


def test_refuses_a_folder_with_shards(spark, tokenized, model_path):
    out, _ = tokenized
    with pytest.raises(FileExistsError):
        tokenize_documents(spark, spark.createDataFrame([], DOC_SCHEMA), model_path, str(out), num_shards=1, eos_id=EOS_ID)


def test_more_shards_than_documents_gives_empty_shards(spark, rows, model_path, tmp_path):
    stats = tokenize_documents(spark, spark.createDataFrame(rows[:2], DOC_SCHEMA), model_path, str(tmp_path),
                               num_shards=4, eos_id=EOS_ID)
    assert stats["documents"] == 2
    assert sum(len(read_indexed_dataset(str(tmp_path / f"shard-{s:05d}.bin"))) for s in range(4)) == 2


def test_parquet_input_gives_the_same_bytes_as_a_dataframe(tokenized, rows, model_path, tmp_path, spark):
    """The asset passes Parquet folders (tasks read them with pyarrow, one per row group)."""
    import pyarrow as pa

    out, stats = tokenized
    docs = tmp_path / "docs"
    docs.mkdir()
    table = pa.table({name: [r[i] for r in rows] for i, name in enumerate(["doc_id", "bucket", "text"])})
    pq.write_table(table.slice(0, 50), docs / "part-00000.parquet", row_group_size=16)  # several row groups
    pq.write_table(table.slice(50), docs / "part-00001.parquet")
    again = tokenize_documents(spark, [str(docs)], model_path, str(tmp_path / "out"), num_shards=3, eos_id=EOS_ID)
    assert again == stats
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in (tmp_path / "out").iterdir())  # no pieces left behind
    for name in names:
        assert (out / name).read_bytes() == (tmp_path / "out" / name).read_bytes(), name


def test_duplicate_doc_ids_are_an_error(spark, rows, model_path, tmp_path):
    with pytest.raises(ValueError, match="more than once"):
        tokenize_documents(spark, spark.createDataFrame(rows[:3] + rows[:1], DOC_SCHEMA), model_path, str(tmp_path),
                           num_shards=2, eos_id=EOS_ID)
