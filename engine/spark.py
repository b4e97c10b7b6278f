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
    """Write `df` as `part-00000.parquet ...`, hash-partitioned and sorted by `sort_key`.

    Spark's own writer names files with random UUIDs; this writer's bytes depend only on
    the rows, so reruns produce the same content hash. Returns the row count.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from pyspark.sql.pandas.types import to_arrow_schema

    os.makedirs(out_dir, exist_ok=True)
    arrow_schema = to_arrow_schema(df.schema)

    def write_partition(batches):
        from pyspark import TaskContext

        part = TaskContext.get().partitionId()
        table = pa.Table.from_batches(list(batches), schema=arrow_schema)
        rows = 0
        if table.num_rows:
            table = table.sort_by(sort_key)
            pq.write_table(table, os.path.join(out_dir, f"part-{part:05d}.parquet"), compression="zstd")
            rows = table.num_rows
        yield pa.RecordBatch.from_pydict({"rows": [rows]})

    shaped = df.repartition(num_files, sort_key) if num_files > 1 else df.coalesce(1)
    counts = shaped.mapInArrow(write_partition, "rows long").collect()
    if not any(name.endswith(".parquet") for name in os.listdir(out_dir)):
        # An empty table still gets a file so readers see the schema.
        pq.write_table(arrow_schema.empty_table(), os.path.join(out_dir, "part-00000.parquet"))
    return int(sum(r["rows"] for r in counts))
