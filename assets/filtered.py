"""filtered: config thresholds applied to the stored signals; every rejection keeps its reason.

Cheap by design: no HTML is parsed and no model is loaded here, so a threshold change
re-runs this stage alone on top of the stored `quality_signals`. The kept text loses C4's lines
(from the stored per-line facts) and then its PII.
"""
import time

import dagster as dg
from pyspark import StorageLevel

from engine.filters import (
    C4_LINE_REASONS,
    c4_line_counts,
    check_keep_rate,
    decide,
    rule_counts_parquet,
    signal_report,
    signal_report_markdown,
    split_decisions,
)
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
    signals_df = spark.read.parquet(str(signals_in.path / "data"))
    docs_df = spark.read.parquet(str(docs_in.path / "data"))
    # Decided once, then split: the rules run on each document once for both outputs.
    decided = decide(signals_df, docs_df, cfg).persist(StorageLevel.MEMORY_AND_DISK)
    kept, rejected = split_decisions(decided, docs_df.columns)
    try:
        with kiln.staging(context) as out:
            n_kept = write_parquet_sorted(kept, str(out / "kept"), "doc_id")
            n_rejected = write_parquet_sorted(rejected, str(out / "rejected"), "doc_id")
            by_rule = rule_counts_parquet(str(out / "rejected"))
            lines = c4_line_counts(decided)  # zero for rejected documents: lines of the kept text
    finally:
        decided.unpersist()
    # Where each threshold cuts its signal, from the stored signals: no HTML is parsed and no
    # model runs; only C4's page signals are recomputed (vectorised, from the stored c4_lines,
    # in each of the report's two passes), as `decide` recomputed them for these line settings.
    report = signal_report(signals_df, cfg)
    total = n_kept + n_rejected
    keep = check_keep_rate(n_kept, total, cfg)
    rules = [{"rule": rule, "removed": n, "share": n / total if total else 0.0}
             for rule, n in sorted(by_rule.items(), key=lambda kv: -kv[1])]
    lines_in = lines["c4_lines_in"]
    line_rows = [{"reason": reason, "lines": lines[f"c4_lines_removed_{reason}"],
                  "share_of_lines": lines[f"c4_lines_removed_{reason}"] / lines_in if lines_in else 0.0}
                 for reason in C4_LINE_REASONS]
    line_rows.append({"reason": "(citation markers removed, line kept)", "lines": lines["c4_lines_citations_removed"],
                      "share_of_lines": lines["c4_lines_citations_removed"] / lines_in if lines_in else 0.0})
    band = f"{cfg.min_keep_rate}..{cfg.max_keep_rate}"
    check = dg.AssetCheckResult(
        check_name=KEEP_RATE_CHECK.name,
        passed=keep["passed"],
        metadata={"keep_rate": keep["keep_rate"], "band": band},
        description=None if keep["passed"] else f"keep rate {keep['keep_rate']:.3f} left the band {band}",
    )
    return kiln.publish(
        context,
        out,
        inputs={"documents": docs_in, "quality_signals": signals_in},
        counts={"documents_in": total, "kept": n_kept, "rejected": n_rejected, "keep_rate": round(keep["keep_rate"], 4),
                **{f"removed_{rule}": n for rule, n in by_rule.items()}, **lines},
        metadata={
            "removed_by_rule": dg.MetadataValue.md(markdown_table(rules)),
            # Lines C4 removed from the kept documents' text, by reason (datatrove's order).
            "c4_lines_removed": dg.MetadataValue.md(f"Lines in kept documents: {lines_in}\n\n" + markdown_table(line_rows)),
            "signal_histograms": dg.MetadataValue.md(signal_report_markdown(signals_df, cfg, report=report)),
            "signal_report": dg.MetadataValue.json(report),
        },
        started=started,
        check_results=[check],
    )
