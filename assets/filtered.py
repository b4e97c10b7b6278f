"""filtered: config thresholds applied to the stored signals; every rejection keeps its reason.

Cheap by design: no HTML is parsed and no model is loaded here, so a threshold change
re-runs this stage alone on top of the stored `quality_signals`.
"""
import time

import dagster as dg

from engine.filters import apply_filters, rule_counts
from engine.spark import write_parquet_sorted
from workflows.kiln import KilnResource, markdown_table, stage

KEEP_RATE_CHECK = dg.AssetCheckSpec("keep_rate_in_band", asset="filtered", blocking=True,
                                    description="The share of documents kept stays inside filters.min_keep_rate..max_keep_rate.")


@stage("filtered", "curate", partitioned=True, deps=["documents", "quality_signals"], check_specs=[KEEP_RATE_CHECK])
def filtered(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    cfg = kiln.config.filters
    spark = kiln.spark()
    docs_in = kiln.input("documents", context.partition_key)
    signals_in = kiln.input("quality_signals", context.partition_key)
    kept, rejected = apply_filters(
        spark.read.parquet(str(signals_in.path / "data")), spark.read.parquet(str(docs_in.path / "data")), cfg
    )
    with kiln.staging(context) as out:
        n_kept = write_parquet_sorted(kept, str(out / "kept"), "doc_id")
        n_rejected = write_parquet_sorted(rejected, str(out / "rejected"), "doc_id")
        by_rule = rule_counts(spark.read.parquet(str(out / "rejected")))
    total = n_kept + n_rejected
    keep_rate = n_kept / total if total else 0.0
    in_band = cfg.min_keep_rate <= keep_rate <= cfg.max_keep_rate
    rules = [{"rule": rule, "removed": n, "share": n / total if total else 0.0}
             for rule, n in sorted(by_rule.items(), key=lambda kv: -kv[1])]
    check = dg.AssetCheckResult(
        check_name=KEEP_RATE_CHECK.name,
        passed=in_band,
        metadata={"keep_rate": keep_rate, "band": f"{cfg.min_keep_rate}..{cfg.max_keep_rate}"},
        description=None if in_band else f"keep rate {keep_rate:.3f} left the band {cfg.min_keep_rate}..{cfg.max_keep_rate}",
    )
    return kiln.publish(
        context,
        out,
        inputs={"documents": docs_in, "quality_signals": signals_in},
        counts={"documents_in": total, "kept": n_kept, "rejected": n_rejected, "keep_rate": round(keep_rate, 4),
                **{f"removed_{rule}": n for rule, n in by_rule.items()}},
        metadata={"removed_by_rule": dg.MetadataValue.md(markdown_table(rules))},
        started=started,
        check_results=[check],
    )
