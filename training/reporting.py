"""Rank 0's reporting: metrics.jsonl, MLflow, and Dagster Pipes when the run was launched by Dagster.

Only rank 0 reports: MLflow's sqlite store takes one writer, and one Pipes channel is enough.
Pipes is optional and never imports Dagster itself: the small `dagster_pipes` package is imported
only when the launcher's environment says the process runs under Pipes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

PIPES_CONTEXT_ENV = "DAGSTER_PIPES_CONTEXT"
SKIP_REASONS = ("non_finite", "spike")


def progress_line(record: dict, total_steps: int) -> str:
    """One step as a human line (stdout, and the Dagster run's log through Pipes); `record` is a
    metrics.jsonl record, where non-finite values are None."""
    def num(key: str, fmt: str) -> str:
        value = record.get(key)
        return "nan" if value is None else format(value, fmt)

    line = (f"step {record['step']}/{total_steps} loss {num('loss', '.4f')} lr {num('lr', '.3g')} "
            f"grad_norm {num('grad_norm', '.3g')} tokens/s {num('tokens_per_s', '.0f')}")
    if record.get("skipped"):
        line += f" SKIPPED ({record.get('skip_reason') or 'non_finite'}"
        if record.get("skip_reason") == "spike" and record.get("spike_threshold") is not None:
            line += f": loss above the spike threshold {record['spike_threshold']:.4f}"
        line += ")"
    return line


def flatten(prefix: str, value, out: dict) -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and other values become JSON strings."""
    if isinstance(value, dict):
        for key, inner in value.items():
            flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)
    return out


def strict_json(record: dict) -> dict:
    """Non-finite floats become null, so every line is strict JSON (the `skipped` flag says why)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def open_pipes():
    """The Dagster Pipes context when launched under Pipes, else None (standalone runs)."""
    if not os.environ.get(PIPES_CONTEXT_ENV):
        return None
    try:
        from dagster_pipes import open_dagster_pipes
    except ImportError:
        print("[kiln] launched under Dagster Pipes but dagster_pipes is not installed; "
              "reporting to stdout and MLflow only", flush=True)
        return None
    return open_dagster_pipes()


def mixed_shards_dataset(mixed_shards_dir: str | Path, digest: str | None):
    """The training token file as an MLflow dataset: source folder, token-tensor schema, digest.

    The digest is the `mixed_shards` data version when the caller knows it (Dagster does), else
    a hash of the manifest, which names the files and their sizes.
    """
    import numpy as np
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource
    from mlflow.types.schema import Schema, TensorSpec

    folder = Path(mixed_shards_dir).resolve()
    manifest_bytes = (folder / "manifest.json").read_bytes()
    manifest = json.loads(manifest_bytes)
    schema = Schema([TensorSpec(np.dtype(manifest["dtype"]), (-1, int(manifest["seq_len"]) + 1), "tokens")])
    return MetaDataset(source=LocalArtifactDatasetSource(str(folder)), name="mixed_shards",
                       digest=digest or hashlib.sha256(manifest_bytes).hexdigest()[:16], schema=schema), manifest


class Rank0Reporter:
    """metrics.jsonl (every step), stdout progress, MLflow metrics/params/tags/dataset, Pipes messages."""

    def __init__(self, cfg: dict, out_dir: Path, resume_step: int, run_id: str | None):
        self.cfg = cfg
        self.metrics_path = out_dir / "metrics.jsonl"
        self.log_every = cfg["log_every"]
        self.total_steps = cfg["train_steps"]
        self._truncate_after(resume_step)
        self.mlflow = None
        self.run_id = None
        self.experiment_id = None
        ml = cfg["mlflow"]
        if ml.get("tracking_uri"):
            import mlflow

            mlflow.set_tracking_uri(ml["tracking_uri"])
            mlflow.set_experiment(ml["experiment"])
            if ml["system_metrics"]:
                mlflow.set_system_metrics_sampling_interval(ml["system_metrics_interval_s"])
                mlflow.set_system_metrics_samples_before_logging(1)
            # Resume continues the same MLflow run; steps redone after the checkpoint are logged again.
            run = mlflow.start_run(run_id=run_id, log_system_metrics=ml["system_metrics"]) if run_id else \
                mlflow.start_run(run_name=ml.get("run_name"), log_system_metrics=ml["system_metrics"])
            self.mlflow = mlflow
            self.run_id = run.info.run_id
            self.experiment_id = run.info.experiment_id
        self.pipes = open_pipes()

    def _truncate_after(self, step: int) -> None:
        """Drop lines from steps the resumed run will redo (they ran after the last checkpoint)."""
        if not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError):  # a line torn by a hard kill
                continue
        self.metrics_path.write_text("".join(line + "\n" for line in kept))

    def start(self, params: dict, tags: dict, fresh: bool) -> None:
        if self.pipes:
            self.pipes.log.info(f"training {self.total_steps} steps; MLflow run {self.run_id or '(none)'}")
        if not self.mlflow:
            return
        self.mlflow.set_tags({k: str(v) for k, v in tags.items()})
        if fresh:  # MLflow refuses to re-log a param, and a resumed run already has them and its input
            flat = flatten("", params, {})
            self.mlflow.log_params({k: ("" if v is None else v) for k, v in flat.items()})
            dataset, manifest = mixed_shards_dataset(self.cfg["mixed_shards_dir"],
                                                     self.cfg["data_versions"].get("mixed_shards"))
            self.mlflow.log_input(dataset, context="training", tags={
                "num_sequences": str(manifest["train"]["num_sequences"]),
                "buckets": ",".join(sorted(manifest.get("buckets", {}))),
            })

    def step(self, record: dict) -> None:
        strict = strict_json(record)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(strict, allow_nan=False) + "\n")
        if record["step"] % self.log_every == 0 or record["skipped"] or record["step"] == self.total_steps:
            line = progress_line(strict, self.total_steps)
            print("[kiln] " + line, flush=True)
            if self.pipes:
                # A line of the Dagster run's log, written by Dagster's Pipes message handler as
                # its reader reads it, while training runs.
                (self.pipes.log.warning if record["skipped"] else self.pipes.log.info)(line)
        if self.pipes:
            # Every step, structured (the asset counts them).
            self.pipes.report_custom_message({"kind": "step", **strict})
        if self.mlflow:
            numeric = {k: float(v) for k, v in record.items()
                       if k != "step" and isinstance(v, (int, float)) and math.isfinite(float(v))}
            # The skip reason as 0/1 series (MLflow metrics are numbers).
            numeric.update({f"skipped_{reason}": float(record.get("skip_reason") == reason) for reason in SKIP_REASONS})
            self.mlflow.log_metrics(numeric, step=record["step"])

    def first_loss(self) -> float | None:
        if not self.metrics_path.exists():
            return None
        for line in self.metrics_path.read_text().splitlines():
            record = json.loads(line)
            if not record["skipped"]:
                return record["loss"]
        return None

    def last_loss(self) -> float | None:
        lines = [json.loads(line) for line in self.metrics_path.read_text().splitlines()]
        return next((r["loss"] for r in reversed(lines) if not r["skipped"]), None)

    def finish(self, result: dict) -> None:
        """Final metrics to MLflow and, under Pipes, as the asset's materialization metadata."""
        if self.mlflow:
            final = {"wall_s": result["wall_s"]}
            if result["final_loss"] is not None:
                final["final_loss"] = result["final_loss"]
            self.mlflow.log_metrics(final)
            self.mlflow.end_run(status="FINISHED")
        if self.pipes:
            # Scalars only (paths, fingerprints and ids included); the model config stays in result.json.
            metadata = {("train_wall_s" if k == "wall_s" else k): v for k, v in result.items()
                        if isinstance(v, (int, float, str)) and not isinstance(v, bool)}
            if self.pipes.is_asset_step:
                self.pipes.report_asset_materialization(metadata=metadata)
            self.pipes.close()

    def fail(self, error: BaseException) -> None:
        if self.mlflow:
            self.mlflow.end_run(status="FAILED")
        if self.pipes:
            # The context manager protocol turns the exception into Pipes' structured error.
            self.pipes.__exit__(type(error), error, error.__traceback__)
