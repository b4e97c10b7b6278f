"""Training settings that run.json (training/config.py) and the pipeline config's `training`
section (workflows/config.py) share: one definition, one set of defaults and checks.

Only pydantic here, so the pipeline config loads without importing torch or DeepSpeed.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

Unit = Annotated[float, Field(ge=0.0, lt=1.0)]


class SharedTrainingSettings(BaseModel):
    """Optimizer, checkpoint retention and step-guard settings."""

    # A typo must not silently train with a default.
    model_config = ConfigDict(extra="forbid")

    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay floor as a fraction of lr.")
    betas: tuple[Unit, Unit] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1).")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clipping threshold.")
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder block in backward (torch non-reentrant checkpoint): less "
                           "activation memory for about one more forward pass of compute.")
    keep_last: int = Field(2, ge=1, description="Complete checkpoints kept.")
    max_consecutive_skips: int = Field(
        5, ge=1, description="Abort after more consecutive skipped steps (non-finite loss or gradient, or a loss spike).")
    spike_k: float | None = Field(
        6.0, description="Skip a step whose micro-batch loss (mean over ranks) exceeds mean + spike_k standard "
                         "deviations of the last spike_window accepted step losses; null or <= 0 disables the check.")
    spike_window: int = Field(100, ge=2, description="Accepted step losses the spike statistics are taken over.")
    spike_min_history: int = Field(
        20, ge=2, description="Accepted steps needed before the spike check is active (the early loss falls fast).")
    log_every: int = Field(10, ge=1, description="A progress line on stdout and in the Dagster run every N steps "
                                                 "(skipped steps always get one); metrics.jsonl and MLflow get every step.")
    deepspeed: dict[str, Any] = Field(
        default_factory=dict,
        description="Merged over the generated DeepSpeed config (ZeRO-3); keys that repeat a setting above must "
                    "agree with it, e.g. {zero_optimization: {stage3_param_persistence_threshold: 0}}.")

    @model_validator(mode="after")
    def _spike_history_fits_window(self):
        if self.spike_min_history > self.spike_window:
            raise ValueError(f"spike_min_history ({self.spike_min_history}) must be <= spike_window "
                             f"({self.spike_window})")
        return self

    @property
    def spike_enabled(self) -> bool:
        return self.spike_k is not None and self.spike_k > 0
