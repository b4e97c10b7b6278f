"""run.json: its typed schema (defaults, descriptions, validation), and the DeepSpeed config derived from it.

Kept apart from train.py so callers (launch, Dagster assets, tests) can resolve and show a run's
settings without importing DeepSpeed.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from training.data import load_manifest
from training.model import ModelConfig
from training.settings import SharedTrainingSettings, format_validation_errors

DEFAULT_PRESET = "tiny"


class _Strict(BaseModel):
    # A typo must not silently train with a default.
    model_config = ConfigDict(extra="forbid")


class MlflowRunConfig(_Strict):
    tracking_uri: str | None = Field(None, description="MLflow tracking URI; null: no MLflow.")
    experiment: str = Field("kiln-train", description="MLflow experiment name.")
    run_name: str | None = Field(None, description="MLflow run name (a resumed run keeps its run).")
    tags: dict[str, str] = Field(default_factory=dict, description="Tags set on the run (e.g. dagster_run_id).")
    system_metrics: bool = Field(True, description="Sample CPU/memory/disk/network (and GPU with pynvml) in a thread.")
    system_metrics_interval_s: float = Field(10.0, gt=0, description="Seconds between system metric samples.")


class RunConfig(SharedTrainingSettings):
    """Everything one training run reads (run.json)."""

    model: dict[str, Any] = Field(
        default_factory=lambda: {"preset": DEFAULT_PRESET},
        description="`preset` (tiny, 125M, 350M, 1B; default tiny) plus any ModelConfig field as an override; "
                    "vocab_size/eos_id/max_seq_len default to the data manifest, bos_id to the tokenizer.")
    mixed_shards_dir: str = Field(min_length=1, description="Input mixed_shards folder.")
    tokenizer_dir: str | None = Field(
        None, description="Tokenizer folder: tokenizer.model and the Hugging Face tokenizer in hf/ go into the export.")
    out_dir: str = Field(min_length=1, description="Output folder (set by training.launch.run).")
    seed: int = Field(1234, description="Seed of the initial weights and of the data order.")
    train_steps: int = Field(200, ge=1, description="Optimizer steps (a skipped step counts).")
    micro_batch_size: int = Field(8, ge=1, description="Sequences per rank per micro step.")
    grad_accum_steps: int = Field(1, ge=1, description="Micro steps per optimizer step.")
    lr: float = Field(6e-4, gt=0, description="Peak learning rate.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps before the cosine decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (matrices only, not norm gains).")
    checkpoint_every: int = Field(100, ge=1, description="Checkpoint cadence in steps (the final step is saved too).")
    export: bool = Field(True, description="Consolidate the final checkpoint into export/.")
    git_commit: str | None = Field(None, description="Commit of the code (the MLflow run's `git_commit` tag; not in "
                                                     "export/, so it never changes the checkpoints data version); "
                                                     "null: `git rev-parse HEAD` of this checkout, if it is one.")
    mlflow: MlflowRunConfig = Field(default_factory=MlflowRunConfig)
    data_versions: dict[str, str] = Field(
        default_factory=dict,
        description="Data versions of the inputs (mixed_shards, tokenizer) when the caller knows them (Dagster "
                    "does): the MLflow dataset digest and export_meta.json lineage.")
    debug_nan_loss_steps: list[int] = Field(
        default_factory=list, description="Test hook: rank 0's loss becomes NaN at these steps.")
    debug_loss_scale_steps: dict[int, float] = Field(
        default_factory=dict, description="Test hook: rank 0's loss is multiplied by the factor at these steps "
                                          "(before the spike check), e.g. {\"12\": 50.0}.")

    @field_validator("model")
    @classmethod
    def _preset_default(cls, value: dict) -> dict:
        return {"preset": DEFAULT_PRESET, **value}

    @field_validator("debug_loss_scale_steps")
    @classmethod
    def _finite_factors(cls, value: dict[int, float]) -> dict[int, float]:
        bad = {step: f for step, f in value.items() if not (math.isfinite(f) and f > 0)}
        if bad:
            raise ValueError(f"factors must be finite and > 0, got {bad}")
        return value


def resolve_run_config(config: dict | str | Path) -> dict:
    """run.json validated, with defaults filled in, as a plain dict (what train.py and the logs use).

    Raises ValueError naming each bad field.
    """
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    try:
        return RunConfig.model_validate(config).model_dump(mode="python")
    except ValidationError as error:
        raise ValueError(format_validation_errors("invalid run config:", error, "unknown run config key")) from None


def resolve_model_config(cfg: dict) -> ModelConfig:
    """Preset + overrides, with vocabulary, EOS and context length taken from the data manifest."""
    manifest = load_manifest(cfg["mixed_shards_dir"])
    overrides = dict(cfg["model"])
    preset = overrides.pop("preset", None)
    overrides.setdefault("vocab_size", int(manifest["vocab_size"]))
    overrides.setdefault("eos_id", manifest.get("eos_id"))
    overrides.setdefault("max_seq_len", int(manifest["seq_len"]))
    if overrides["vocab_size"] < int(manifest["vocab_size"]):
        raise ValueError(f"model vocab_size {overrides['vocab_size']} < data vocab {manifest['vocab_size']}")
    if overrides["max_seq_len"] < int(manifest["seq_len"]):
        raise ValueError(f"model max_seq_len {overrides['max_seq_len']} < data seq_len {manifest['seq_len']}")
    if cfg.get("tokenizer_dir") and "bos_id" not in overrides:
        overrides["bos_id"] = _tokenizer_bos_id(Path(cfg["tokenizer_dir"]))
    if preset is None:
        return ModelConfig(**overrides)
    return ModelConfig.from_preset(preset, **overrides)


def _tokenizer_bos_id(tokenizer_dir: Path) -> int | None:
    model_file = tokenizer_dir / "tokenizer.model"
    if not model_file.exists():
        return None
    import sentencepiece as spm

    bos = spm.SentencePieceProcessor(model_file=str(model_file)).bos_id()
    return bos if bos >= 0 else None


def _deep_merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


# Keys the training loop derives from run.json; a different value under "deepspeed" would make
# the data reader, schedule or logs disagree with what DeepSpeed does, so it is an error.
_DERIVED = {
    ("train_micro_batch_size_per_gpu",): "micro_batch_size",
    ("gradient_accumulation_steps",): "grad_accum_steps",
    ("gradient_clipping",): "grad_clip",
    ("optimizer", "params", "lr"): "lr",
    ("optimizer", "params", "weight_decay"): "weight_decay",
    ("optimizer", "params", "betas"): "betas",
    ("optimizer", "params", "eps"): "adam_eps",
}


def build_deepspeed_config(cfg: dict, bf16: bool) -> dict:
    """The DeepSpeed JSON for this run: ZeRO-3, torch AdamW, clipping, bf16 on GPU / fp32 on CPU.

    torch AdamW ("torch_adam": true) instead of DeepSpeed's fused/CPU Adam: those are C++/CUDA ops
    JIT-built on first use, which is slow on CPU machines and needs nvcc on GPU ones.
    """
    ds = {
        "train_micro_batch_size_per_gpu": cfg["micro_batch_size"],
        "gradient_accumulation_steps": cfg["grad_accum_steps"],
        "gradient_clipping": cfg["grad_clip"],
        "zero_optimization": {"stage": 3, "contiguous_gradients": True, "overlap_comm": False},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg["lr"], "betas": list(cfg["betas"]), "eps": cfg["adam_eps"],
                       "weight_decay": cfg["weight_decay"], "torch_adam": True},
        },
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,  # metrics.jsonl and MLflow carry progress
        "wall_clock_breakdown": False,
    }
    user = cfg.get("deepspeed") or {}
    if "scheduler" in user:
        raise ValueError("deepspeed.scheduler is not supported: use warmup_steps/min_lr_ratio")
    if "train_batch_size" in user:
        raise ValueError("set micro_batch_size and grad_accum_steps instead of deepspeed.train_batch_size")
    for path, key in _DERIVED.items():
        node = user
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and node != cfg[key] and not (key == "betas" and list(node) == list(cfg[key])):
            raise ValueError(f"deepspeed.{'.'.join(path)}={node!r} conflicts with {key}={cfg[key]!r}; "
                             f"set it once, as {key}")
    ds = _deep_merge(ds, user)
    if ds["zero_optimization"].get("stage") != 3:
        raise ValueError("Kiln trains with ZeRO stage 3 (export and checkpoints assume it)")
    return ds


def lr_ratio(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based, counting applied steps).

    Linear warmup to 1 over warmup_steps (the first step already gets 1/warmup_steps, not 0),
    then cosine decay that reaches min_lr_ratio on the last step and stays there.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
