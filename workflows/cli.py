"""`kiln` command line: `kiln demo` materializes the whole graph on the bundled sample."""
from __future__ import annotations

import argparse
import json
import sys
import time

from workflows.config import ConfigError
from workflows.instance import ensure_dagster_home  # sqlite, or Postgres when DAGSTER_PG_HOST is set

# Waves of one run each: partitioned assets run per snapshot, unpartitioned ones once.
DEMO_WAVES: list[tuple[list[str], bool]] = [
    (["raw_crawl", "documents"], True),
    (["quality_classifier"], False),
    (["quality_signals", "filtered", "deduplicated"], True),
    (["tokenizer"], False),
    (["tokenized"], True),
    (["mixed_shards", "checkpoints", "eval_report"], False),
]




def materialize_all(snapshots: list[str] | None = None, log=print) -> dict:
    """Materialize every asset, wave by wave, into the persistent Dagster instance."""
    import dagster as dg

    from workflows.definitions import ALL_ASSETS, defs
    from workflows.kiln import CONFIG, SNAPSHOTS

    ensure_dagster_home()
    instance = dg.DagsterInstance.get()
    snapshots = snapshots or sorted(CONFIG.raw_crawl.snapshots)
    instance.add_dynamic_partitions(SNAPSHOTS.name, snapshots)
    resources = {"kiln": defs.resources["kiln"]}
    timings = {}
    for names, partitioned in DEMO_WAVES:
        for key in snapshots if partitioned else [None]:
            label = f"{', '.join(names)}" + (f" [{key}]" if key else "")
            log(f"▶ materializing {label}")
            started = time.time()
            result = dg.materialize(
                ALL_ASSETS,
                selection=dg.AssetSelection.assets(*names),
                partition_key=key,
                instance=instance,
                resources=resources,
                tags={"kiln/launched_by": "kiln demo"},
                raise_on_error=False,
            )
            timings[label] = round(time.time() - started, 1)
            if not result.success:
                failures = [e for e in result.all_events if e.is_failure]
                detail = failures[0].event_specific_data.error.to_string() if failures and hasattr(failures[0].event_specific_data, "error") else ""
                raise SystemExit(f"✗ {label} failed after {timings[label]}s\n{detail}")
            log(f"  done in {timings[label]}s")
    return timings


def summary(snapshots: list[str] | None = None) -> str:
    """A short, plain report of what each stage kept, read back from the stored manifests."""
    from workflows.kiln import CONFIG
    from workflows.storage import configured_storage

    storage = configured_storage(CONFIG)
    snapshots = snapshots or sorted(CONFIG.raw_crawl.snapshots)
    lines = []
    for snapshot in snapshots:
        counts = {a: storage.latest(a, snapshot).manifest()["counts"] for a in
                  ("raw_crawl", "documents", "filtered", "deduplicated", "tokenized")}
        f = counts["filtered"]
        removed = sorted(((k[len("removed_"):], v) for k, v in f.items() if k.startswith("removed_")), key=lambda kv: -kv[1])
        lines += [
            f"Snapshot {snapshot}",
            f"  raw_crawl     {counts['raw_crawl']['files']} WARC files, {counts['raw_crawl']['records']} records",
            f"  documents     {counts['documents']['documents']} extracted",
            f"  filtered      {f['kept']} kept of {f['documents_in']}; top removal reasons: "
            + ", ".join(f"{rule} {n}" for rule, n in removed[:4]),
            f"  deduplicated  {counts['deduplicated']['kept']} kept, {counts['deduplicated']['duplicates_removed']} duplicates removed",
            "  tokenized     " + ", ".join(f"{k[len('tokens_'):]} {v:,} tokens" for k, v in counts["tokenized"].items()
                                          if k.startswith("tokens_")),
        ]
    mixed = storage.latest("mixed_shards", None)
    manifest = json.loads((mixed.path / "manifest.json").read_text())
    lines.append("Mixture        " + ", ".join(
        f"{b} {v['tokens_sampled']:,} tokens ({v['realised_share']:.1%}, {v['epochs']:.2f} epochs)" for b, v in manifest["buckets"].items()))
    ckpt = storage.latest("checkpoints", None)
    result = json.loads((ckpt.path / "result.json").read_text())
    lines.append(f"Training       loss {result['first_loss']:.3f} → {result['final_loss']:.3f} over {result['steps']} steps "
                 f"(MLflow run {result.get('mlflow_run_id')})")
    report = storage.latest("eval_report", None)
    metrics = json.loads((report.path / "metrics.json").read_text())
    for bucket, m in metrics["trained"].items():
        init = metrics["initial"][bucket]
        lines.append(f"Eval [{bucket:<9}] perplexity {m['perplexity']:.2f} (step 0: {init['perplexity']:.1f}), "
                     f"bits/byte {m['bits_per_byte']:.3f} (step 0: {init['bits_per_byte']:.3f})")
    for bucket, cloze in metrics.get("cloze", {}).items():
        if cloze["trained"]["items"]:
            lines.append(f"Cloze [{bucket:<8}] accuracy {cloze['trained']['accuracy']:.1%} of {cloze['trained']['items']} "
                         f"items (step 0: {cloze['initial']['accuracy']:.1%})")
    lines += [
        f"Report:    {report.path / 'report.html'}",
        "",
        f"Outputs:   {storage.root}  (eval report: {report.path / 'report.md'})",
        "Dagster:   make ui      → http://127.0.0.1:3000",
        "MLflow:    make mlflow  → http://127.0.0.1:5000",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="materialize every asset on the configured snapshots and print a summary")
    sub.add_parser("validate", help="check the pipeline config and exit")
    sub.add_parser("summary", help="print the summary of the last materialization")
    from workflows import trace as trace_command

    trace_command.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        from workflows.config import load_config

        load_config()
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    if args.command == "validate":
        print("pipeline config OK")
        return 0
    if args.command == "trace":
        return trace_command.run(args)
    if args.command == "demo":
        started = time.time()
        materialize_all()
        print(f"\nPipeline finished in {time.time() - started:.0f}s\n")
    print(summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
