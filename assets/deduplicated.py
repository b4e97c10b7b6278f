"""deduplicated: exact and MinHash-LSH near duplicates removed within a snapshot.

Reuses the signatures stored by `quality_signals`; nothing is re-shingled here.
"""
import time

import dagster as dg

from engine.dedup import deduplicate, example_pairs_markdown
from engine.spark import write_parquet_sorted
from workflows.kiln import KilnResource, markdown_table, stage


def dedup_metadata(stats: dict) -> dict:
    """The asset's explaining metadata, from `deduplicate`'s stats: the cluster size
    histogram (markdown table and JSON) and example pairs side by side (markdown)."""
    histogram = stats.get("cluster_size_histogram", {})
    rows = [{"cluster_size": int(k), "clusters": v} for k, v in sorted(histogram.items(), key=lambda kv: int(kv[0]))]
    return {
        "cluster_sizes": dg.MetadataValue.md(markdown_table(rows, ["cluster_size", "clusters"])),
        "cluster_size_histogram": dg.MetadataValue.json(histogram),
        "example_pairs": dg.MetadataValue.md(example_pairs_markdown(stats["example_pairs_shown"])),
    }


@stage("deduplicated", "curate", partitioned=True, deps=["filtered", "quality_signals"])
def deduplicated(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    spark = kiln.spark()
    filtered_in = kiln.input("filtered", context.partition_key)
    signals_in = kiln.input("quality_signals", context.partition_key)
    kept, duplicates, stats = deduplicate(
        spark,
        spark.read.parquet(str(filtered_in.path / "kept")),
        spark.read.parquet(str(signals_in.path / "data")).select("doc_id", "minhash"),
        kiln.config.dedup,
    )
    with kiln.staging(context) as out:
        n_kept = write_parquet_sorted(kept, str(out / "kept"), "doc_id")
        n_dups = write_parquet_sorted(duplicates, str(out / "duplicates"), "doc_id")
    return kiln.publish(
        context,
        out,
        inputs={"filtered": filtered_in, "quality_signals": signals_in},
        counts={"kept": n_kept, "duplicates_removed": n_dups,
                **{k: v for k, v in stats.items() if isinstance(v, (int, float))}},
        metadata=dedup_metadata(stats),
        started=started,
    )
