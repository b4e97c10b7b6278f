"""DeepSpeed ZeRO-3 entry point.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 training/train.py --config run.json
    python -m training.train --config run.json        # one rank, no launcher

Writes into out_dir: ds_config.json, resolved_config.json, model_config.json, metrics.jsonl
(rank 0, one line per step), ckpt/global_step<N>/ (every rank), export/ and result.json.
Restarting with the same out_dir resumes from ckpt/latest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import socket
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by the launcher: make `training` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from training.config import build_deepspeed_config, lr_ratio, resolve_model_config, resolve_run_config
from training.data import TrainBatches
from training.model import build_model, weights_fingerprint

_STEP_DIR = re.compile(r"^global_step(\d+)$")


class SkipGuard:
    """Counts consecutive skipped steps and aborts the run past a limit."""

    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.total = 0

    def record(self, skipped: bool, step: int, loss: float, grad_norm: float) -> None:
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.total += 1
        if self.consecutive > self.max_consecutive:
            raise RuntimeError(
                f"aborting at step {step}: {self.consecutive} consecutive steps skipped for a "
                f"non-finite loss or gradient norm (limit max_consecutive_skips={self.max_consecutive}; "
                f"last loss={loss}, grad_norm={grad_norm}). Lower lr, check the data, or resume "
                f"from an earlier checkpoint."
            )


def decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: decaying RMSNorm gains pulls them toward 0, not toward identity."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_steps(ckpt_dir: Path) -> list[int]:
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in ckpt_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def prune_checkpoints(ckpt_dir: Path, keep_last: int) -> list[int]:
    """Delete all but the newest keep_last step folders (never the one `latest` names)."""
    latest_file = ckpt_dir / "latest"
    latest = latest_file.read_text().strip() if latest_file.exists() else None
    removed = []
    for step in checkpoint_steps(ckpt_dir)[:-keep_last]:
        if f"global_step{step}" != latest:
            shutil.rmtree(ckpt_dir / f"global_step{step}")
            removed.append(step)
    return removed


def _flatten(prefix: str, value, out: dict) -> dict:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Rank0Reporter:
    """metrics.jsonl and MLflow, written by rank 0 only (MLflow's sqlite store takes one writer)."""

    def __init__(self, cfg: dict, out_dir: Path, resume_step: int, run_id: str | None):
        self.metrics_path = out_dir / "metrics.jsonl"
        self.log_every = cfg["log_every"]
        self.total_steps = cfg["train_steps"]
        self._truncate_after(resume_step)
        self.mlflow = None
        self.run_id = None
        ml = cfg["mlflow"]
        if ml.get("tracking_uri"):
            import mlflow

            mlflow.set_tracking_uri(ml["tracking_uri"])
            mlflow.set_experiment(ml["experiment"])
            # Resume continues the same MLflow run; steps redone after the checkpoint are logged again.
            run = mlflow.start_run(run_id=run_id) if run_id else mlflow.start_run(run_name=ml.get("run_name"))
            self.mlflow = mlflow
            self.run_id = run.info.run_id

    def _truncate_after(self, step: int) -> None:
        """Drop lines from steps the resumed run will redo (they ran after the last checkpoint)."""
        if not self.metrics_path.exists():
            return
        kept = [line for line in self.metrics_path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.metrics_path.write_text("".join(line + "\n" for line in kept))

    def start(self, params: dict, tags: dict, fresh: bool) -> None:
        if not self.mlflow:
            return
        self.mlflow.set_tags({k: str(v) for k, v in tags.items()})
        if fresh:  # MLflow refuses to re-log a param, and a resumed run already has them
            flat = _flatten("", params, {})
            self.mlflow.log_params({k: ("" if v is None else v) for k, v in flat.items()})

    def step(self, record: dict) -> None:
        # Strict JSON: a non-finite loss/grad_norm is written as null (the line says skipped).
        strict = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(strict, allow_nan=False) + "\n")
        if record["step"] % self.log_every == 0 or record["skipped"]:
            print(f"[kiln] step {record['step']}/{self.total_steps} loss {record['loss']:.4f} "
                  f"lr {record['lr']:.3g} grad_norm {record['grad_norm']:.3g} "
                  f"tokens/s {record['tokens_per_s']:.0f}" + (" SKIPPED" if record["skipped"] else ""),
                  flush=True)
        if self.mlflow:
            numeric = {k: float(v) for k, v in record.items()
                       if k != "step" and isinstance(v, (int, float)) and math.isfinite(float(v))}
            self.mlflow.log_metrics(numeric, step=record["step"])

    def first_loss(self) -> float | None:
        if not self.metrics_path.exists():
            return None
        for line in self.metrics_path.read_text().splitlines():
            record = json.loads(line)
            if not record["skipped"]:
                return record["loss"]
        return None

    def finish(self, status: str = "FINISHED") -> None:
        if self.mlflow:
            self.mlflow.end_run(status=status)


def _ensure_single_rank_env() -> None:
    """Let `python -m training.train` run as one rank without the launcher."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def train(config: dict | str | Path) -> dict | None:
    """Run (or resume) training in this rank; rank 0 returns result.json's contents."""
    cfg = resolve_run_config(config)
    _ensure_single_rank_env()
    local_world = int(os.environ.get("LOCAL_SIZE", "1"))
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # Ranks share the cores; torch's default (all cores per rank) oversubscribes them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))

    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)
    device = torch.device(accelerator.current_device_name())

    out_dir = Path(cfg["out_dir"]).resolve()
    ckpt_dir = out_dir / "ckpt"
    model_cfg = resolve_model_config(cfg)
    use_bf16 = accelerator.device_name() != "cpu" and accelerator.is_bf16_supported()
    ds_config = build_deepspeed_config(cfg, bf16=use_bf16)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        ckpt_dir.mkdir(exist_ok=True)
        (out_dir / "ds_config.json").write_text(json.dumps(ds_config, indent=2) + "\n")
        (out_dir / "resolved_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (out_dir / "model_config.json").write_text(json.dumps(model_cfg.to_dict(), indent=2) + "\n")
    dist.barrier()

    # Same seed on every rank, so every rank builds the same step-0 weights before partitioning.
    random.seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"] + rank)
    model = build_model(model_cfg, cfg["seed"])
    init_fingerprint = weights_fingerprint(model)
    num_params = model_cfg.num_params()

    def schedule(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_ratio(
            s, cfg["warmup_steps"], cfg["train_steps"], cfg["min_lr_ratio"]))

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=decay_param_groups(model, cfg["weight_decay"]),
        config=ds_config, lr_scheduler=schedule,
    )
    data = TrainBatches(cfg["mixed_shards_dir"], cfg["micro_batch_size"], cfg["seed"], rank, world_size)
    gas = cfg["grad_accum_steps"]
    tokens_per_step = cfg["micro_batch_size"] * gas * world_size * data.seq_len
    flops_per_token = model_cfg.train_flops_per_token(data.seq_len)

    step, tokens_seen, prior_wall_s, run_id = 0, 0, 0.0, None
    guard = SkipGuard(cfg["max_consecutive_skips"])
    fresh = not (ckpt_dir / "latest").exists()
    if not fresh:
        # A fresh engine is what load_checkpoint needs after ZeRO-3 (FIELD-NOTES); this is one.
        load_path, client_state = engine.load_checkpoint(str(ckpt_dir))
        if load_path is None:
            raise RuntimeError(f"{ckpt_dir}/latest exists but no checkpoint could be loaded")
        client = client_state["kiln"]
        if client["model_config"] != model_cfg.to_dict():
            raise ValueError(f"checkpoint in {ckpt_dir} was trained with model {client['model_config']}, "
                             f"this config builds {model_cfg.to_dict()}; use a new out_dir")
        step, tokens_seen, prior_wall_s = client["step"], client["tokens_seen"], client["wall_s"]
        run_id = client.get("mlflow_run_id")
        guard.total, guard.consecutive = client["skipped_steps"], client["consecutive_skips"]
        data.load_state_dict(client["data_cursor"])
        set_rng_state(client["rng"])
        if rank == 0:
            print(f"[kiln] resumed from {load_path} at step {step}", flush=True)

    reporter = Rank0Reporter(cfg, out_dir, step, run_id) if rank == 0 else None
    if reporter:
        reporter.start(
            params={"model": model_cfg.to_dict(), "num_params": num_params, "world_size": world_size,
                    "tokens_per_step": tokens_per_step, "seq_len": data.seq_len,
                    "optim": {k: cfg[k] for k in ("lr", "warmup_steps", "min_lr_ratio", "weight_decay",
                                                   "betas", "adam_eps", "grad_clip", "train_steps",
                                                   "micro_batch_size", "grad_accum_steps")},
                    "data": {"mixed_shards_dir": cfg["mixed_shards_dir"], "seed": cfg["seed"]},
                    "zero_stage": 3, "bf16": use_bf16},
            tags={**cfg["mlflow"].get("tags", {}), "kiln.out_dir": str(out_dir),
                  "kiln.init_fingerprint": init_fingerprint},
            fresh=run_id is None,
        )
        run_id = reporter.run_id

    def save(at_step: int) -> None:
        # One namespaced key: DeepSpeed drops client keys that collide with its own (e.g. skipped_steps).
        client_state = {"kiln": {
            "step": at_step, "tokens_seen": tokens_seen, "data_cursor": data.state_dict(),
            "rng": rng_state(), "mlflow_run_id": run_id, "model_config": model_cfg.to_dict(),
            "wall_s": prior_wall_s + (time.time() - start_time), "skipped_steps": guard.total,
            "consecutive_skips": guard.consecutive, "init_fingerprint": init_fingerprint,
        }}
        engine.save_checkpoint(str(ckpt_dir), tag=f"global_step{at_step}", client_state=client_state)
        dist.barrier()  # every rank's shards are on disk before anything is deleted
        if rank == 0:
            prune_checkpoints(ckpt_dir, cfg["keep_last"])

    nan_steps = set(cfg["debug_nan_loss_steps"])
    start_time = time.time()
    last_saved = step if not fresh else None
    final_loss = None
    engine.train()
    try:
        while step < cfg["train_steps"]:
            step += 1
            t0 = time.time()
            skipped_before = engine.skipped_steps
            lr = engine.get_lr()[0]
            loss_sum = torch.zeros((), device=device, dtype=torch.float32)
            for _ in range(gas):
                inputs, targets = data.next_batch()
                loss = engine(inputs.to(device), targets.to(device))
                if step in nan_steps and rank == 0:
                    loss = loss * float("nan")
                if not torch.isfinite(loss):
                    # Make the gradient NaN too (an inf loss can have finite gradients), so ZeRO-3's
                    # global-norm check discards the step on every rank consistently.
                    loss = loss * float("nan")
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().float()
            dist.all_reduce(loss_sum)
            step_loss = float(loss_sum) / (gas * world_size)
            grad_norm = engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            skipped = (engine.skipped_steps > skipped_before or not math.isfinite(step_loss)
                       or not math.isfinite(grad_norm))
            tokens_seen += tokens_per_step
            step_s = time.time() - t0
            if not skipped:
                final_loss = step_loss
            if reporter:
                reporter.step({
                    "step": step, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                    "tokens": tokens_seen, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
                    "flops_per_s": flops_per_token * tokens_per_step / step_s, "skipped": skipped,
                })
            guard.record(skipped, step, step_loss, grad_norm)
            if step % cfg["checkpoint_every"] == 0:
                save(step)
                last_saved = step
        if last_saved != step:
            save(step)
    except BaseException:
        if reporter:
            reporter.finish(status="FAILED")
        raise

    if rank != 0:
        return None
    wall_s = prior_wall_s + (time.time() - start_time)
    export_dir = None
    if cfg["export"]:
        from training.export import export_checkpoint

        export_dir = out_dir / "export"
        export_checkpoint(ckpt_dir, export_dir, model_cfg, tag=f"global_step{step}",
                          tokenizer_dir=cfg.get("tokenizer_dir"),
                          metadata={"step": str(step), "seed": str(cfg["seed"]),
                                    "init_fingerprint": init_fingerprint})
    if final_loss is None:  # resumed at or past train_steps: take it from the log
        lines = [json.loads(line) for line in reporter.metrics_path.read_text().splitlines()]
        final_loss = next((r["loss"] for r in reversed(lines) if not r["skipped"]), None)
    result = {
        "first_loss": reporter.first_loss(),
        "final_loss": final_loss,
        "steps": step,
        "tokens": tokens_seen,
        "wall_s": wall_s,
        "mlflow_run_id": reporter.run_id,
        "params": num_params,
        "skipped_steps": guard.total,
        "world_size": world_size,
        "init_fingerprint": init_fingerprint,
        "checkpoint": str(ckpt_dir / f"global_step{step}"),
        "export_dir": str(export_dir) if export_dir else None,
        "model_config": model_cfg.to_dict(),
    }
    (out_dir / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    if reporter.mlflow:
        reporter.mlflow.log_metrics({"final_loss": final_loss, "wall_s": wall_s} if final_loss is not None
                                    else {"wall_s": wall_s})
    reporter.finish()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Kiln DeepSpeed ZeRO-3 training")
    parser.add_argument("--config", required=True, help="run.json")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    train(args.config)


if __name__ == "__main__":
    main()
