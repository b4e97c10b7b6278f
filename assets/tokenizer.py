"""tokenizer: SentencePiece trained on a deterministic, bucket-balanced sample of deduplicated text."""
import time

import dagster as dg
from pyspark.sql import functions as F

from engine.tokenizer import train_tokenizer
from workflows.kiln import KilnResource, markdown_table, stage, write_json

META_FILE = "tokenizer_meta.json"


@stage("tokenizer", "tokenize", partitioned=False, deps=["deduplicated"])
def tokenizer(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    cfg = kiln.config.tokenizer
    dedup_in = kiln.inputs_all(context, "deduplicated")
    docs = kiln.spark().read.parquet(*[str(a.path / "kept") for a in dedup_in])
    texts_by_bucket: dict[str, list[str]] = {}
    for bucket in kiln.config.buckets:
        # Hash order is a deterministic random sample, independent of partitioning; stream it
        # until the bucket's character budget is met instead of collecting the whole bucket.
        rows = docs.where(F.col("bucket") == bucket).orderBy(F.xxhash64("doc_id"), "doc_id").select("text")
        texts, chars = [], 0
        for row in rows.toLocalIterator():
            texts.append(row["text"])
            chars += len(row["text"])
            if chars >= cfg.sample_chars_per_bucket:
                break
        texts_by_bucket[bucket] = texts
    with kiln.staging(context) as out:
        report = train_tokenizer(texts_by_bucket, str(out), cfg)
        write_json(out / META_FILE, {k: report[k] for k in ("vocab_size", "special_ids", "model_sha256")})
    fertility = [{"bucket": b, **v} for b, v in report["buckets"].items()]
    return kiln.publish(
        context,
        out,
        inputs={"deduplicated": dedup_in},
        counts={"vocab_size": report["vocab_size"], **{f"sample_docs_{b}": len(t) for b, t in texts_by_bucket.items()}},
        metadata={"fertility": dg.MetadataValue.md(markdown_table(fertility))},
        started=started,
    )
