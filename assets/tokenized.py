"""tokenized: token shards (Megatron .bin/.idx) plus a document index, per snapshot."""
import json
import time

import dagster as dg

from assets.tokenizer import META_FILE
from engine.tokenize import tokenize_documents
from workflows.kiln import KilnResource, markdown_table, stage


@stage("tokenized", "tokenize", partitioned=True, deps=["deduplicated", "tokenizer"])
def tokenized(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    spark = kiln.spark()
    dedup_in = kiln.input("deduplicated", context.partition_key)
    tok_in = kiln.input("tokenizer")
    eos_id = json.loads((tok_in.path / META_FILE).read_text())["special_ids"]["eos"]
    with kiln.staging(context) as out:
        # The Parquet folder itself, not a DataFrame: tasks read it with pyarrow, so the text
        # never passes through the JVM (see engine/tokenize.py).
        stats = tokenize_documents(
            spark,
            [str(dedup_in.path / "kept")],
            str(tok_in.path / "tokenizer.model"),
            str(out),
            num_shards=kiln.config.tokenized.num_shards,
            eos_id=eos_id,
        )
    buckets = [{"bucket": b, **v} for b, v in stats["buckets"].items()]
    return kiln.publish(
        context,
        out,
        inputs={"deduplicated": dedup_in, "tokenizer": tok_in},
        counts={"documents": stats["documents"], "tokens": stats["tokens"],
                **{f"tokens_{b}": v["tokens"] for b, v in stats["buckets"].items()}},
        metadata={"buckets": dg.MetadataValue.md(markdown_table(buckets)), "dtype": stats["dtype"]},
        started=started,
    )
