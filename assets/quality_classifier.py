"""quality_classifier: fastText model telling reference-quality text from random crawl text.

Positives: documents of `positive_buckets` and/or an external reference corpus
(`reference_paths`); negatives: every other crawled document.
"""
import time

import dagster as dg
from pyspark.sql import functions as F

from engine.classifier import ReferenceCorpusError, read_reference_texts, sample_texts, train_quality_classifier
from workflows.config import resolve_path
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

    reference, corpus = [], {}
    if cfg.reference_paths:
        try:
            reference, corpus = read_reference_texts(
                [resolve_path(p) for p in cfg.reference_paths], field=cfg.reference_field,
                passage_chars=cfg.reference_passage_chars, patterns=cfg.reference_patterns, exclude=cfg.reference_exclude,
            )
        except (ReferenceCorpusError, OSError, UnicodeDecodeError) as exc:
            raise dg.Failure(f"quality_classifier.reference_paths: {exc}") from exc
    from_buckets = sample(is_positive) if cfg.positive_buckets else []
    # One cap for the class: a large external corpus must not drown the buckets' share silently.
    positives = sample_texts(from_buckets + reference, cfg.max_docs_per_class, cfg.seed)
    negatives = sample(~is_positive)
    if not positives or not negatives:
        raise dg.Failure(
            f"quality_classifier needs both classes: {len(from_buckets)} documents in buckets {cfg.positive_buckets} "
            f"and {len(reference)} from reference_paths, {len(negatives)} other documents"
        )
    with kiln.staging(context) as out:
        report = train_quality_classifier(
            positives, negatives, str(out / "quality.bin"), seed=cfg.seed, epoch=cfg.epoch, holdout=cfg.holdout
        )
    metadata = {k: v for k, v in report.items() if isinstance(v, (int, float, str))}
    if corpus:
        metadata["reference_sha256"] = corpus["sha256"]  # the corpus's identity: paths alone do not pin its content
        metadata["reference_files"] = dg.MetadataValue.json(corpus["files"])
    return kiln.publish(
        context,
        out,
        inputs={"documents": docs_in},
        counts={"positives": len(positives), "negatives": len(negatives),
                "positives_from_buckets": len(from_buckets), "reference_documents": len(reference)},
        metadata=metadata,
        started=started,
    )
