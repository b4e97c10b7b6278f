"""One Spark session per process, and deterministic Parquet output."""
from __future__ import annotations

import os
import sys

from pyspark.sql import DataFrame, SparkSession

DEFAULT_CONF = {
    "spark.sql.shuffle.partitions": "8",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.ui.enabled": "false",
    "spark.driver.memory": "4g",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
    # C1-only JIT: Kiln's JVM mostly moves Arrow batches to Python workers, and every Dagster run is
    # a fresh JVM, so C2's compile threads cost more than they return. Measured by
    # tests/benchmarks/bench_partial_rerun.py (15k pages, 2 cores): full curate CPU 101 -> 82 s,
    # threshold re-run 17.6 -> 12.7 s wall. A `spark.conf` entry for this key replaces it.
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
}


def get_spark(master: str = "local[2]", conf: dict[str, str] | None = None, app_name: str = "kiln") -> SparkSession:
    """Return the process-wide session, creating it on first use (start-up costs ~9 s)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in {**DEFAULT_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def write_parquet_sorted(df: DataFrame, out_dir: str, sort_key: str, num_files: int = 1) -> int:
    """Write `df` as `part-00000.parquet ...`: rows assigned to files by a hash of `sort_key`
    and sorted by it inside each file.

    Spark's own writer names files with random UUIDs, and its task layout may change from run
    to run (adaptive execution coalesces partitions). Here the file of a row and the order of
    rows in it depend only on the rows, so reruns produce the same bytes and content hash.
    Returns the row count.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from pyspark.sql import functions as F
    from pyspark.sql.pandas.types import to_arrow_schema

    os.makedirs(out_dir, exist_ok=True)
    arrow_schema = to_arrow_schema(df.schema)
    file_col = "__kiln_file"

    def write_files(batches):
        table = pa.Table.from_batches(list(batches), schema=arrow_schema.append(pa.field(file_col, pa.int32())))
        counts = []
        for index in sorted(set(table.column(file_col).to_pylist())):
            part = table.filter(pc.equal(table.column(file_col), index)).drop_columns([file_col])
            part = part.sort_by(sort_key).combine_chunks()
            pq.write_table(part, os.path.join(out_dir, f"part-{index:05d}.parquet"), compression="zstd")
            counts.append(part.num_rows)
        yield pa.RecordBatch.from_pydict({"rows": [sum(counts)]})

    keyed = df.withColumn(file_col, F.pmod(F.xxhash64(sort_key), F.lit(num_files)).cast("int"))
    counts = keyed.repartition(num_files, file_col).mapInArrow(write_files, "rows long").collect()
    if not any(name.endswith(".parquet") for name in os.listdir(out_dir)):
        # An empty table still gets a file so readers see the schema.
        pq.write_table(arrow_schema.empty_table(), os.path.join(out_dir, "part-00000.parquet"))
    return int(sum(r["rows"] for r in counts))
