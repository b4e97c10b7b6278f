"""quality_classifier: fastText model telling reference-quality text from random crawl text."""
import time

import dagster as dg
from pyspark.sql import functions as F

from engine.classifier import train_quality_classifier
from workflows.kiln import KilnResource, stage


@stage("quality_classifier", "curate", partitioned=False, deps=["documents"])
def quality_classifier(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    cfg = kiln.config.quality_classifier
    docs_in = kiln.inputs_all(context, "documents")
    docs = kiln.spark().read.parquet(*[str(a.path / "data") for a in docs_in])
    is_positive = F.col("bucket").isin(cfg.positive_buckets)

    def sample(condition) -> list[str]:
        rows = docs.where(condition).orderBy("doc_id").limit(cfg.max_docs_per_class).select("text").collect()
        return [r["text"] for r in rows]

    positives, negatives = sample(is_positive), sample(~is_positive)
    if not positives or not negatives:
        raise dg.Failure(
            f"quality_classifier needs both classes: {len(positives)} documents in buckets {cfg.positive_buckets}, "
            f"{len(negatives)} elsewhere"
        )
    with kiln.staging(context) as out:
        report = train_quality_classifier(
            positives, negatives, str(out / "quality.bin"), seed=cfg.seed, epoch=cfg.epoch, holdout=cfg.holdout
        )
    return kiln.publish(
        context,
        out,
        inputs={"documents": docs_in},
        counts={"positives": len(positives), "negatives": len(negatives)},
        metadata={k: v for k, v in report.items() if isinstance(v, (int, float, str))},
        started=started,
    )
