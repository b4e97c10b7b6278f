"""Parquet written by Kiln depends on the rows only, never on Spark's task layout."""
import hashlib
from pathlib import Path

from engine.spark import write_parquet_sorted


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_rows_give_same_bytes_whatever_the_partitioning(spark, tmp_path):
    rows = spark.range(0, 2000).selectExpr("cast(id * 7919 % 2003 as string) as doc_id", "id as value")
    write_parquet_sorted(rows.repartition(7), str(tmp_path / "a"), "doc_id", num_files=3)
    written = write_parquet_sorted(rows.coalesce(1).orderBy("value"), str(tmp_path / "b"), "doc_id", num_files=3)
    assert written == 2000
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert len(digest(tmp_path / "a")) == 3
    back = spark.read.parquet(str(tmp_path / "a")).orderBy("doc_id").collect()
    assert [r["doc_id"] for r in back] == sorted(r["doc_id"] for r in rows.collect())


def test_empty_input_still_leaves_a_readable_file(spark, tmp_path):
    rows = spark.range(0, 10).selectExpr("cast(id as string) as doc_id").limit(0)
    assert write_parquet_sorted(rows, str(tmp_path / "e"), "doc_id", num_files=2) == 0
    assert spark.read.parquet(str(tmp_path / "e")).columns == ["doc_id"]
