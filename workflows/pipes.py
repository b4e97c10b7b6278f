"""How the `checkpoints` asset talks to the training launcher: the run.json it hands over (every
training setting of the pipeline config) and the Dagster Pipes messages rank 0 sends back.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import dagster as dg

from training.reporting import progress_line
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


class StepProgress:
    """Rank 0's per-step Pipes messages as lines of the Dagster run's log, as they arrive: every
    `every`-th step, the last one, and every skipped step (as a warning, with its reason)."""

    def __init__(self, info: Callable[[str], None], warning: Callable[[str], None], *, every: int, total: int):
        self.info, self.warning, self.every, self.total = info, warning, every, total
        self.received = 0

    def __call__(self, payload) -> None:
        if not (isinstance(payload, dict) and payload.get("kind") == "step"):
            return
        self.received += 1
        try:
            step = payload["step"]
            if payload.get("skipped"):
                self.warning(progress_line(payload, self.total))
            elif step % self.every == 0 or step == self.total:
                self.info(progress_line(payload, self.total))
        except (KeyError, TypeError, ValueError) as error:  # a display problem, never a training failure
            self.warning(f"could not show step message {payload!r}: {error!r}")


class StepMessageReader(dg.PipesFileMessageReader):
    """Dagster's file message reader, plus a callback on each custom message when it is read.

    The session only buffers custom messages until the process ends (`get_custom_messages`); this
    hands each one on from the reader's thread as it arrives, so step metrics show in the run's log
    while training runs. Everything else is the stock reader and handler.
    """

    def __init__(self, path: str, on_custom_message: Callable[[object], None]):
        super().__init__(path)
        self._on_custom_message = on_custom_message

    @contextmanager
    def read_messages(self, handler):
        with super().read_messages(_CustomMessageTap(handler, self._on_custom_message)) as params:
            yield params


class _CustomMessageTap:
    """Stands in for the PipesMessageHandler the reader thread calls: passes every message on,
    then shows custom ones to the callback."""

    def __init__(self, handler, callback: Callable[[object], None]):
        self._handler, self._callback = handler, callback

    def handle_message(self, message) -> None:
        self._handler.handle_message(message)
        if message.get("method") == "report_custom_message":
            self._callback(message["params"]["payload"])

    def __getattr__(self, name):
        return getattr(self._handler, name)
