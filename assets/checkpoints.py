"""checkpoints: a DeepSpeed ZeRO-3 run launched as an external process, exported to safetensors.

The run works in a folder named after its config and inputs, so a run that was killed resumes
from its latest checkpoint when the asset is materialized again; the folder is published
(content hash of the exported weights, manifest, `_SUCCESS`) only when training finished.
"""
import hashlib
import json
import time

import dagster as dg

from training.launch import run as run_training
from workflows.config import code_version
from workflows.kiln import KilnResource, git_commit, stage


@stage("checkpoints", "train", partitioned=False, deps=["mixed_shards", "tokenizer"])
def checkpoints(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    cfg = kiln.config.training
    mixed = kiln.input("mixed_shards")
    tok = kiln.input("tokenizer")
    run_key = hashlib.sha256(
        f"{code_version(kiln.config, 'checkpoints')}/{mixed.data_version}/{tok.data_version}".encode()
    ).hexdigest()[:16]
    work_dir = kiln.storage.partition_dir("checkpoints", None) / f".run-{run_key}"
    run_config = {
        "model": {"preset": cfg.preset},
        "mixed_shards_dir": str(mixed.path),
        "tokenizer_dir": str(tok.path),
        "seed": cfg.seed,
        "train_steps": cfg.steps,
        "micro_batch_size": cfg.micro_batch_size,
        "grad_accum_steps": cfg.grad_accum,
        "lr": cfg.lr,
        "warmup_steps": cfg.warmup_steps,
        "min_lr_ratio": cfg.min_lr_ratio,
        "weight_decay": cfg.weight_decay,
        "grad_clip": cfg.grad_clip,
        "checkpoint_every": cfg.checkpoint_every,
        "keep_last": cfg.keep_last,
        "mlflow": {
            "tracking_uri": kiln.mlflow_tracking_uri(),
            "experiment": kiln.config.mlflow.experiment,
            "run_name": f"checkpoints-{run_key[:8]}",
            "tags": {
                "dagster_run_id": context.run_id,
                "git_commit": git_commit(),
                "mixed_shards_data_version": mixed.data_version,
                "tokenizer_data_version": tok.data_version,
            },
        },
    }
    kiln.mlflow_experiment_id()  # created up front so its artifacts live under the state folder
    if (work_dir / "ckpt").exists():
        context.log.info(f"resuming the interrupted run in {work_dir}")
    result = run_training(run_config, work_dir, log=context.log.info, num_gpus=cfg.num_gpus,
                          num_nodes=cfg.num_nodes, hostfile=cfg.hostfile)
    metadata = {
        "first_loss": result["first_loss"],
        "final_loss": result["final_loss"],
        "steps": result["steps"],
        "tokens": result["tokens"],
        "train_wall_s": result["wall_s"],
        "mlflow_run_id": result.get("mlflow_run_id") or "",
        "mlflow_tracking_uri": kiln.mlflow_tracking_uri(),
    }
    return kiln.publish(
        context,
        work_dir,
        inputs={"mixed_shards": mixed, "tokenizer": tok},
        counts={"steps": result["steps"], "tokens": result["tokens"]},
        metadata=metadata,
        started=started,
        # Timings and MLflow ids differ per run; the weights are the content.
        version_files=["export/model.safetensors", "export/config.json"],
    )
