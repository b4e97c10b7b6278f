"""checkpoints: a DeepSpeed ZeRO-3 run launched as an external process, exported to safetensors.

The run works in a folder named after its config and inputs, so a run that was killed resumes
from its latest committed checkpoint when the asset is materialized again; the folder is
published (content hash of the exported weights, manifest, `_SUCCESS`) only when training
finished. The launcher runs inside a Dagster Pipes session: rank 0 sends every step's metrics
as a Pipes message, which this asset writes into the run's log as it arrives (every
`training.log_every` steps, and every skipped step), and reports the final metrics, which
become this materialization's metadata. `training.dry_run` logs the exact launcher command and
materializes nothing.
"""
import hashlib
import json
import time
from urllib.parse import urlsplit, urlunsplit

import dagster as dg

from training.launch import run as run_training
from training.provenance import git_commit
from workflows.config import code_version, resolve_path
from workflows.kiln import KilnResource, stage
from workflows.training_run import training_run_config

LOCAL_MLFLOW_UI = "http://127.0.0.1:5000"  # `make mlflow`
# Paths inside the work folder move when it is published; `path` in the metadata is the real one.
_NOT_METADATA = {"checkpoint", "export_dir"}


def without_credentials(uri: str) -> str:
    """The URI minus any user:password@ part: credentials never go into metadata."""
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    return urlunsplit(parts._replace(netloc=host + (f":{parts.port}" if parts.port else "")))


def mlflow_run_url(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """Link to the run in the MLflow UI: the tracking server itself, or `make mlflow` for local stores."""
    if not (experiment_id and run_id):
        return None
    if urlsplit(tracking_uri).scheme in ("http", "https"):
        base = without_credentials(tracking_uri).rstrip("/")
    else:
        base = LOCAL_MLFLOW_UI
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def loss_curve(steps: list[dict], points: int = 50) -> str:
    """A markdown table of about `points` evenly spaced steps (and the last one)."""
    if not steps:
        return "_(no steps)_"
    stride = max(1, len(steps) // points)
    chosen = steps[::stride] + ([steps[-1]] if (len(steps) - 1) % stride else [])
    rows = ["| step | loss | lr | grad_norm | tokens/s |", "|---|---|---|---|---|"]
    for s in chosen:
        if s.get("skipped") or s.get("loss") is None:
            loss = "skipped" + (f" ({s['skip_reason']})" if s.get("skip_reason") else "")
        else:
            loss = f"{s['loss']:.4f}"
        grad_norm = "–" if s.get("grad_norm") is None else f"{s['grad_norm']:.3g}"
        rows.append(f"| {s['step']} | {loss} | {s['lr']:.3g} | {grad_norm} | {s['tokens_per_s']:.0f} |")
    return "\n".join(rows)


@stage("checkpoints", "train", partitioned=False, deps=["mixed_shards", "tokenizer"], output_required=False)
def checkpoints(context: dg.AssetExecutionContext, kiln: KilnResource):
    started = time.time()
    cfg = kiln.config.training
    mixed = kiln.input("mixed_shards")
    tok = kiln.input("tokenizer")
    # The work folder must not depend on dry_run, so a dry run shows the command the real run uses.
    real = kiln.config.model_copy(update={"training": cfg.model_copy(update={"dry_run": False})})
    run_key = hashlib.sha256(
        f"{code_version(real, 'checkpoints')}/{mixed.data_version}/{tok.data_version}".encode()
    ).hexdigest()[:16]
    work_dir = kiln.storage.partition_dir("checkpoints", None) / f".run-{run_key}"
    tracking_uri = kiln.mlflow_tracking_uri()
    settings = training_run_config(cfg)
    run_config = {
        **settings,
        "mixed_shards_dir": str(mixed.path),
        "tokenizer_dir": str(tok.path),
        "git_commit": git_commit(),  # rank 0 tags the MLflow run with it
        "data_versions": {"mixed_shards": mixed.data_version, "tokenizer": tok.data_version},
        "mlflow": {
            **settings["mlflow"],
            "tracking_uri": tracking_uri,
            "experiment": kiln.config.mlflow.experiment,
            "run_name": f"checkpoints-{run_key[:8]}",
            "tags": {
                "dagster_run_id": context.run.run_id,
                **({"dagster_run_url": f"{kiln.config.mlflow.dagster_ui_url.rstrip('/')}/runs/{context.run.run_id}"}
                   if kiln.config.mlflow.dagster_ui_url else {}),
                "mixed_shards_data_version": mixed.data_version,
                "tokenizer_data_version": tok.data_version,
            },
        },
    }
    launch = dict(num_gpus=cfg.num_gpus, num_nodes=cfg.num_nodes,
                  hostfile=resolve_path(cfg.hostfile) if cfg.hostfile else None)
    if cfg.dry_run:
        plan = run_training(run_config, work_dir, log=context.log.info, dry_run=True, **launch)
        context.log.info(f"training.dry_run is set: nothing launched, nothing materialized. Command:\n{plan['shell']}")
        return

    kiln.mlflow_experiment_id()  # created up front so its artifacts live under the state folder
    if (work_dir / "ckpt").exists():
        context.log.info(f"resuming the interrupted run in {work_dir}")
    # Messages go through a file in the work folder: on a multi-node run rank 0 may sit on another
    # host, and the work folder is on the filesystem every node shares.
    work_dir.mkdir(parents=True, exist_ok=True)
    with dg.open_pipes_session(
        context=context,
        context_injector=dg.PipesEnvContextInjector(),
        message_reader=dg.PipesFileMessageReader(str(work_dir / "pipes-messages.jsonl")),
        extras={"run_key": run_key},
    ) as session:
        # Raw launcher and rank output at debug level; rank 0's progress arrives through Pipes.
        result = run_training(run_config, work_dir, log=context.log.debug,
                              extra_env=session.get_bootstrap_env_vars(), **launch)
    reported = [r for r in session.get_reported_results() if isinstance(r, dg.MaterializeResult)]
    steps = [m for m in session.get_custom_messages() if isinstance(m, dict) and m.get("kind") == "step"]
    if not reported:
        context.log.warning("rank 0 reported no final metrics through Pipes; taking them from result.json")
    metadata = {
        # result.json is the fallback; what rank 0 reported through Pipes wins.
        **{("train_wall_s" if k == "wall_s" else k): v for k, v in result.items()
           if isinstance(v, (int, float, str)) and not isinstance(v, bool) and k not in _NOT_METADATA},
        **{k: v for r in reported for k, v in (r.metadata or {}).items() if k not in _NOT_METADATA},
        "steps_streamed": len(steps),
        # From metrics.jsonl: a resumed run streams only the steps after its checkpoint.
        "loss_curve": dg.MetadataValue.md(loss_curve(
            [json.loads(line) for line in (work_dir / "metrics.jsonl").read_text().splitlines()])),
        "mlflow_tracking_uri": without_credentials(tracking_uri),
    }
    url = mlflow_run_url(tracking_uri, result.get("mlflow_experiment_id"), result.get("mlflow_run_id"))
    if url:
        metadata["mlflow_run"] = dg.MetadataValue.url(url)
    yield kiln.publish(
        context,
        work_dir,
        inputs={"mixed_shards": mixed, "tokenizer": tok},
        counts={"steps": result["steps"], "tokens": result["tokens"]},
        metadata=metadata,
        started=started,
        # Timings and MLflow ids differ per run; the weights are the content.
        version_files=["export/*"],
    )
