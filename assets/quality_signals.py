"""quality_signals: every signal the filters and dedup need, computed once per document."""
import time

import dagster as dg

from engine.langid import ensure_lid_model
from engine.signals import compute_signals
from engine.spark import write_parquet_sorted
from workflows.config import resolve_path
from workflows.kiln import KilnResource, markdown_table, stage


@stage("quality_signals", "curate", partitioned=True, deps=["documents", "quality_classifier"])
def quality_signals(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    cfg = kiln.config.quality_signals
    docs_in = kiln.input("documents", context.partition_key)
    classifier = kiln.input("quality_classifier")
    lid_path = str(resolve_path(cfg.lid_model_path)) if cfg.lid_model_path else ensure_lid_model(str(kiln.models_dir()))
    spark = kiln.spark()
    signals = compute_signals(
        spark,
        spark.read.parquet(str(docs_in.path / "data")),
        lid_model_path=lid_path,
        classifier_model_path=str(classifier.path / "quality.bin"),
        badword_paths=[str(resolve_path(p)) for p in cfg.badword_paths],
        url_blocklist=cfg.url_blocklist,
        num_perm=cfg.num_perm,
        ngram=cfg.ngram,
        minhash_seed=cfg.minhash_seed,
    )
    with kiln.staging(context) as out:
        # As many files as `documents` has (one per WARC file): the layout, and so the data
        # version, must not depend on how many cores the Spark cluster has.
        num_files = max(1, len(list((docs_in.path / "data").glob("*.parquet"))))
        rows = write_parquet_sorted(signals, str(out / "data"), "doc_id", num_files=num_files)
        # Read back what was written: recomputing `signals` would run every model again.
        languages = (
            spark.read.parquet(str(out / "data")).groupBy("language").count()
            .orderBy("count", ascending=False).limit(15).collect()
        )
    return kiln.publish(
        context,
        out,
        inputs={"documents": docs_in, "quality_classifier": classifier},
        counts={"documents": rows},
        metadata={"languages": dg.MetadataValue.md(markdown_table([r.asDict() for r in languages]))},
        started=started,
    )
