"""documents: main text of every HTML response in a snapshot's WARC files (Parquet)."""
import time

import dagster as dg

from engine.documents import documents_stage
from workflows.kiln import KilnResource, markdown_table, stage


@stage("documents", "ingest", partitioned=True, deps=["raw_crawl"])
def documents(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    cfg = kiln.config.documents
    crawl = kiln.input("raw_crawl", context.partition_key)
    warc_paths = sorted(str(p) for p in (crawl.path / "warc").iterdir())
    with kiln.staging(context) as out:
        # One engine call for extraction, duplicate doc_ids and the write (bench_extraction times the same).
        result = documents_stage(
            kiln.spark(),
            warc_paths,
            str(out / "data"),
            context.partition_key,
            domain_buckets=cfg.domain_buckets,
            default_bucket=cfg.default_bucket,
            extractor=cfg.extractor,
            max_bytes=cfg.max_bytes,
        )
    rows, counts, per_bucket = result["rows"], result["counts"], result["per_bucket"]
    skipped = sorted(((k, v) for k, v in counts.items() if k != "documents"), key=lambda kv: (-kv[1], kv[0]))
    return kiln.publish(
        context,
        out,
        inputs={"raw_crawl": crawl},
        counts={"documents": rows, **{f"docs_{b}": n for b, n in per_bucket.items()}, **{f"skipped_{k}": v for k, v in skipped}},
        metadata={
            "skipped_records": dg.MetadataValue.md(markdown_table([{"reason": k, "records": v} for k, v in skipped])),
        },
        started=started,
    )
