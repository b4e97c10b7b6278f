"""eval_report: the exported model against its step-0 self on the held-out split, as a report.

Held-out bits per byte and perplexity per bucket, cloze accuracy on passages of held-out
documents, the contamination audit of the mixture, samples through the HF export, optional
lm-evaluation-harness tasks, and the deltas against the previous eval_report. It all goes into
`report.md` and a self-contained `report.html` in the asset's folder, into an MLflow eval run
nested under the training run, and into the materialization's metadata.

The data version hashes only the deterministic results (`metrics.json`, `cloze_items.jsonl`),
not the report files, which name the previous report and the MLflow run: evaluating the same
checkpoint again gives the same data version.
"""
import json
import time
from pathlib import Path

import dagster as dg

from engine.report import (
    RESULT_FILES, build_report, check_finite, compare, contamination_audit, heldout_documents, key_metrics,
    log_eval_run, report_numbers, training_loss_history, write_results,
)
from training.evaluate import evaluate_checkpoint
from training.provenance import git_commit
from workflows.config import resolve_path
from workflows.kiln import KilnResource, stage
from workflows.storage import Artifact, StorageError, content_hash

FINITE_CHECK = dg.AssetCheckSpec("metrics_finite", asset="eval_report", blocking=True,
                                 description="Every held-out bucket has finite loss, perplexity and bits per byte "
                                             "(trained and step 0) and a finite cloze accuracy.")
CONTAMINATION_CHECK = dg.AssetCheckSpec("contamination_under_limit", asset="eval_report", blocking=True,
                                        description="No eval set has more than evaluation.max_contamination_rate "
                                                    "of its items overlapping documents left in training.")
IMPROVES_CHECK = dg.AssetCheckSpec("beats_step0", asset="eval_report",
                                   description="Trained bits per byte is below the step-0 model's in every bucket.")


@stage("eval_report", "evaluate", partitioned=False, deps=["checkpoints", "mixed_shards", "tokenizer"],
       check_specs=[FINITE_CHECK, CONTAMINATION_CHECK, IMPROVES_CHECK])
def eval_report(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    cfg = kiln.config.evaluation
    ckpt, mixed, tok = kiln.input("checkpoints"), kiln.input("mixed_shards"), kiln.input("tokenizer")
    training = json.loads((ckpt.path / "result.json").read_text())
    manifest = json.loads((mixed.path / "manifest.json").read_text())
    documents, without_text = heldout_documents(mixed.path, _deduplicated_texts(kiln, mixed))
    if without_text:
        context.log.warning(f"{without_text} held-out documents have no stored text: no cloze items from them")
    # Every evaluation setting but the contamination limit (the audit below) is an evaluate_checkpoint
    # keyword of the same name; the task folder goes in resolved.
    metrics = evaluate_checkpoint(
        ckpt.path / "export", mixed.path, documents, init_seed=_init_seed(ckpt, kiln),
        **cfg.model_dump(exclude={"max_contamination_rate", "lm_eval_task_dir"}),
        lm_eval_task_dir=resolve_path(cfg.lm_eval_task_dir) if cfg.lm_eval_task_dir else None,
        log=context.log.info,
    )
    if metrics["lm_eval"]["status"] != "ok":
        context.log.warning(f"lm_eval step skipped: {metrics['lm_eval']['reason']}")
    if training.get("init_fingerprint") not in (None, metrics["initial_fingerprint"]):
        context.log.warning("the rebuilt step-0 model differs from the one training started from")
    metrics["contamination"] = contamination_audit(manifest.get("decontam"), cfg.max_contamination_rate)
    loss_history, loss_source = training_loss_history(kiln.mlflow_tracking_uri(), training.get("mlflow_run_id"),
                                                      ckpt.path / "metrics.jsonl")
    with kiln.staging(context) as out:
        results = write_results(out, metrics)
        data_version = content_hash(out, RESULT_FILES)[:16]  # what publish will name it
        previous = _previous_report(kiln, data_version)
        comparison = compare(key_metrics(metrics), key_metrics(json.loads((previous.path / "metrics.json").read_text()))
                             ) if previous else None
        report = build_report(metrics, comparison=comparison, previous_version=previous and previous.data_version,
                              loss_history=loss_history, loss_source=loss_source, header=[
            f"Checkpoint `{ckpt.data_version}` ({training['steps']} steps, {training['tokens']:,} tokens, loss "
            f"{_loss(training.get('first_loss'))} → {_loss(training.get('final_loss'))}), mixed_shards `{mixed.data_version}`, "
            f"tokenizer `{tok.data_version}`. Training run: MLflow `{training.get('mlflow_run_id')}`."])
        numbers = report_numbers(metrics)
        commit = git_commit()
        eval_run_id = log_eval_run(
            kiln.mlflow_tracking_uri(), kiln.mlflow_experiment_id(), run_name=f"eval_report-{data_version[:8]}",
            training_run_id=training.get("mlflow_run_id"), key_numbers=numbers,
            params={f"evaluation.{k}": v for k, v in cfg.model_dump(mode="json").items()},
            tags={"dagster_run_id": context.run.run_id, **({"git_commit": commit} if commit else {}),
                  "kiln.stage": "eval_report", "eval_report_data_version": data_version,
                  "checkpoints_data_version": ckpt.data_version, "mixed_shards_data_version": mixed.data_version},
            artifacts=results + report.write(out))
    return kiln.publish(
        context, out, inputs={"checkpoints": ckpt, "mixed_shards": mixed, "tokenizer": tok},
        counts={f"{name}_{b}": m[name] for b, m in metrics["trained"].items() for name in ("bits_per_byte", "perplexity")},
        metadata={"report": dg.MetadataValue.md(report.summary),
                  "report_html": dg.MetadataValue.path(kiln.storage.uri("eval_report", None, data_version)
                                                       + "/report.html"),
                  "previous_report": previous.data_version if previous else "",
                  "mlflow_eval_run_id": eval_run_id, "lm_eval": metrics["lm_eval"]["status"],
                  **{k.replace("/", "_"): v for k, v in numbers.items()}},
        started=started, version_files=RESULT_FILES, check_results=_check_results(metrics, manifest),
    )


def _loss(value: float | None) -> str:
    """A loss for the report header; None when every logged step was skipped (or none was logged)."""
    return "n/a" if value is None else f"{value:.4f}"


def _check_results(metrics: dict, manifest: dict) -> list[dg.AssetCheckResult]:
    finite, problems = check_finite(metrics, [b for b, v in manifest["validation"].items() if v["num_sequences"]])
    audit = metrics["contamination"]
    beats = {b: m["bits_per_byte"] < metrics["initial"][b]["bits_per_byte"] for b, m in metrics["trained"].items()}
    return [
        dg.AssetCheckResult(check_name=FINITE_CHECK.name, passed=finite,
                            metadata={"problems": dg.MetadataValue.json(problems)}),
        dg.AssetCheckResult(check_name=CONTAMINATION_CHECK.name, passed=audit["passed"],
                            metadata={"max_item_rate": audit["max_item_rate"], "limit": audit["limit"],
                                      "item_rates": dg.MetadataValue.json(
                                          {n: s["item_rate"] for n, s in audit["eval_sets"].items()})}),
        dg.AssetCheckResult(check_name=IMPROVES_CHECK.name, passed=bool(beats) and all(beats.values()),
                            severity=dg.AssetCheckSeverity.WARN, metadata={"beats_step0": dg.MetadataValue.json(beats)}),
    ]


def _deduplicated_texts(kiln: KilnResource, mixed: Artifact) -> list[Path]:
    """The deduplicated `kept/` folders the mixture was built from (its manifest's inputs)."""
    inputs = mixed.manifest()["inputs"].get("deduplicated", {})
    folders = []
    for partition, version in sorted(inputs.items()):
        try:
            folders.append(kiln.storage.artifact("deduplicated", partition, version).path / "kept")
        except StorageError:  # no longer stored: its documents just get no cloze items
            pass
    return folders


def _init_seed(ckpt: Artifact, kiln: KilnResource) -> int:
    """The seed training initialised from (its resolved run config), else the configured one."""
    resolved = ckpt.path / "resolved_config.json"
    return json.loads(resolved.read_text())["seed"] if resolved.exists() else kiln.config.training.seed


def _previous_report(kiln: KilnResource, data_version: str) -> Artifact | None:
    """The latest published eval_report with other results than `data_version`.

    `_LATEST` first; when it holds these very results (a rerun), the newest other complete folder.
    """
    try:
        latest = kiln.storage.latest("eval_report", None)
        if latest.data_version != data_version:
            return latest
    except StorageError:
        pass
    done = kiln.storage.complete_versions("eval_report", None)
    for version in sorted((v for v in done if v != data_version), key=lambda v: (done[v], v), reverse=True):
        other = kiln.storage.artifact("eval_report", None, version)
        # A report that failed a blocking check is no baseline to compare against.
        if (other.path / "metrics.json").exists() and not kiln.storage.failed_checks("eval_report", None, version):
            return other
    return None
