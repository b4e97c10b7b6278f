"""Training settings that run.json (training/config.py) and the pipeline config's `training`
section (workflows/config.py) share: one definition, one set of defaults and checks, including
the model presets and their shape rules (training/model.py builds from them).

Only pydantic here, so the pipeline config loads without importing torch or DeepSpeed.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Unit = Annotated[float, Field(ge=0.0, lt=1.0)]

# Presets follow published shapes: 125M/350M are GPT-3-paper sizes with Llama blocks, 1B is
# Llama-3.2-1B's shape. vocab_size is a placeholder: training overrides it with the tokenizer's.
MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=352, max_seq_len=512),
    "125M": dict(dim=768, n_layers=12, n_heads=12, hidden_dim=2048, max_seq_len=2048),
    "350M": dict(dim=1024, n_layers=24, n_heads=16, hidden_dim=2816, max_seq_len=2048),
    "1B": dict(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192, max_seq_len=2048,
        rope_theta=500000.0,
    ),
}


def model_shape_errors(shape: Mapping[str, Any]) -> list[tuple[tuple[str, ...], str]]:
    """What makes a model shape unbuildable: (the fields involved, the problem) for each rule broken.

    `shape` holds dim, n_heads and n_kv_heads (None or missing: n_heads, plain multi-head attention).
    """
    dim, n_heads = shape["dim"], shape["n_heads"]
    n_kv_heads = shape.get("n_kv_heads") or n_heads
    errors = []
    if dim % n_heads:
        errors.append((("dim", "n_heads"), f"dim {dim} is not divisible by n_heads {n_heads}"))
    elif (dim // n_heads) % 2:  # RoPE rotates pairs of channels
        errors.append((("dim", "n_heads"), f"head_dim {dim // n_heads} (dim / n_heads) must be even for RoPE"))
    if n_heads % n_kv_heads:
        errors.append((("n_kv_heads", "n_heads"), f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}"))
    return errors


def format_validation_errors(header: str, error: ValidationError, unknown_key: str | None = None) -> str:
    """`header`, then one line per problem naming the field (dotted), what is wrong and the value
    given (a mapping's is left out). `unknown_key`: what a key the schema lacks is called (run.json's
    wording); None keeps pydantic's message and the value."""
    lines = [header]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if unknown_key is not None and item["type"] == "extra_forbidden":
            lines.append(f"  - {field}: {unknown_key}")
            continue
        message = item["msg"].removeprefix("Value error, ")
        got = f" (got {item['input']!r})" if "input" in item and not isinstance(item["input"], dict) else ""
        lines.append(f"  - {field}: {message}{got}")
    return "\n".join(lines)


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
        6.0, description="Skip a step whose loss (mean over its micro-batches and the ranks) exceeds mean + spike_k "
                         "standard deviations of the last spike_window accepted step losses; null or <= 0 disables "
                         "the check.")
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
