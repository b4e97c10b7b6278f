"""run.json: defaults, validation, and the DeepSpeed config derived from it.

Kept apart from train.py so callers (launch, Dagster assets, tests) can resolve and show a run's
settings without importing DeepSpeed.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

from training.data import load_manifest
from training.model import ModelConfig

REQUIRED = ("mixed_shards_dir", "out_dir")

DEFAULTS: dict = {
    # "preset" plus any ModelConfig field as an override; vocab_size/eos_id come from the data.
    "model": {"preset": "tiny"},
    "mixed_shards_dir": None,
    "tokenizer_dir": None,  # copied into the export when given
    "out_dir": None,
    "seed": 1234,
    "train_steps": 200,
    "micro_batch_size": 8,
    "grad_accum_steps": 1,
    "lr": 6e-4,
    "warmup_steps": 20,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.1,
    "betas": [0.9, 0.95],
    "adam_eps": 1e-8,
    "grad_clip": 1.0,
    "checkpoint_every": 100,
    "keep_last": 2,
    "max_consecutive_skips": 5,
    "log_every": 10,  # progress line on stdout every N steps (metrics.jsonl gets every step)
    "export": True,
    # system_metrics: MLflow samples CPU/memory/disk/network (and GPU with pynvml) in a thread.
    "mlflow": {"tracking_uri": None, "experiment": "kiln-train", "run_name": None, "tags": {},
               "system_metrics": True, "system_metrics_interval_s": 10.0},
    # Data versions of the inputs when the caller knows them (Dagster does); `mixed_shards` becomes
    # the digest of the MLflow dataset input, else a hash of its manifest is used.
    "data_versions": {},
    # Merged over the config built from the keys above; see build_deepspeed_config.
    "deepspeed": {},
    # Test hook: multiply rank 0's loss by NaN at these steps to exercise the skip guard.
    "debug_nan_loss_steps": [],
}


def _deep_merge(base: dict, override: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def resolve_run_config(config: dict | str | Path) -> dict:
    """Defaults filled in, unknown keys rejected (a typo must not silently train with a default)."""
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown run config keys: {sorted(unknown)}")
    unknown_mlflow = set(config.get("mlflow") or {}) - set(DEFAULTS["mlflow"])
    if unknown_mlflow:
        raise ValueError(f"unknown mlflow keys: {sorted(unknown_mlflow)}")
    cfg = _deep_merge(DEFAULTS, config)
    missing = [k for k in REQUIRED if not cfg.get(k)]
    if missing:
        raise ValueError(f"run config needs {missing}")
    for key in ("train_steps", "micro_batch_size", "grad_accum_steps", "checkpoint_every", "keep_last",
                "max_consecutive_skips", "log_every"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"{key} must be a positive integer, got {cfg[key]!r}")
    if not 0.0 <= cfg["min_lr_ratio"] <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {cfg['min_lr_ratio']}")
    if cfg["warmup_steps"] < 0:
        raise ValueError("warmup_steps must be >= 0")
    if not cfg["mlflow"]["system_metrics_interval_s"] > 0:
        raise ValueError("mlflow.system_metrics_interval_s must be > 0")
    if not isinstance(cfg["data_versions"], dict):
        raise ValueError("data_versions must map input names to data versions")
    return cfg


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
