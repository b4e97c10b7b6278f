"""What the `checkpoints` asset hands the training launcher: run.json, every training setting of the
pipeline config.
"""
from __future__ import annotations

from workflows.config import TrainingConfig

# TrainingConfig fields that choose how the launcher starts the ranks rather than what they train.
LAUNCH_FIELDS = {"num_gpus", "num_nodes", "hostfile", "dry_run"}
# TrainingConfig field -> run.json key, where the names differ (training/config.py RunConfig).
RUN_JSON_NAMES = {"steps": "train_steps", "grad_accum": "grad_accum_steps"}
# Fields that go into a nested part of run.json (handled in training_run_config).
NESTED_FIELDS = {"preset", "model", "system_metrics_interval_s"}


def training_run_config(cfg: TrainingConfig) -> dict:
    """Every training setting of the pipeline config as run.json keys (the caller adds inputs,
    lineage and MLflow). A TrainingConfig field that is neither here nor a launch setting fails
    tests/test_training_asset.py, so a new option cannot silently stop at the asset."""
    run = {RUN_JSON_NAMES.get(name, name): value for name, value in cfg.model_dump(mode="json").items()
           if name not in LAUNCH_FIELDS | NESTED_FIELDS}
    run["model"] = {"preset": cfg.preset, **cfg.model.model_dump(exclude_none=True)}
    run["mlflow"] = {"system_metrics_interval_s": cfg.system_metrics_interval_s}
    return run

