"""DeepSpeed ZeRO-3 entry point.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 training/train.py --config run.json
    python -m training.train --config run.json        # one rank, no launcher

Writes into out_dir: ds_config.json, resolved_config.json, model_config.json, metrics.jsonl
(rank 0, one line per step), ckpt/global_step<N>/ (every rank), export/ and result.json.
Restarting with the same out_dir resumes from the newest committed checkpoint (checkpointing.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import shutil
import socket
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by the launcher: make `training` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from training import checkpointing
from training.config import build_deepspeed_config, lr_ratio, resolve_model_config, resolve_run_config
from training.data import TrainBatches, load_manifest
from training.hardware import memory_metrics, mfu
from training.model import build_model, weights_fingerprint
from training.provenance import git_commit
from training.reporting import SKIP_REASONS, Rank0Reporter
from training.settings import SharedTrainingSettings

DEBUG_HOLD_ENV = "KILN_DEBUG_HOLD"


class SkipGuard:
    """Decides which steps to skip and aborts the run after too many in a row.

    A step is skipped for a non-finite loss or gradient norm ("non_finite"), or for a loss spike
    ("spike"): a step loss above mean + k standard deviations (population) of the last `window`
    accepted step losses, once `min_history` steps were accepted. A step loss is the mean of the
    step's micro-batch losses (each the mean over ranks), the quantity the window holds: a single
    micro-batch is noisier by about sqrt(grad_accum_steps), so testing it against step statistics
    would skip healthy steps more often the more micro-batches a step has. Skipped steps never
    enter the window, so a spike cannot raise its own threshold. Every rank keeps its own guard;
    they agree because they decide from the same all-reduced losses (`step_losses`: the step's
    micro-batch losses, each the mean over ranks).
    """

    def __init__(self, settings: SharedTrainingSettings):
        self.max_consecutive = settings.max_consecutive_skips
        self.spike_k = settings.spike_k if settings.spike_enabled else None
        self.min_history = settings.spike_min_history
        self.losses: collections.deque[float] = collections.deque(maxlen=settings.spike_window)
        self.consecutive = 0
        self.total = 0
        self.by_reason: dict[str, int] = {reason: 0 for reason in SKIP_REASONS}

    def spike_threshold(self) -> float | None:
        """The step loss above which a step counts as a spike now; None while the check is off."""
        if self.spike_k is None or len(self.losses) < self.min_history:
            return None
        return statistics.fmean(self.losses) + self.spike_k * statistics.pstdev(self.losses)

    @staticmethod
    def step_loss(step_losses: torch.Tensor) -> torch.Tensor:
        """The mean of the step's micro-batch losses, in float64 on their device: the same number on
        every rank, and the exact value the host later logs and compares."""
        return step_losses.double().mean()

    def poison(self, local_loss: torch.Tensor, step_losses: torch.Tensor | None,
               threshold: float | None) -> torch.Tensor:
        """Whether the micro-batch whose loss (this rank's) is `local_loss` must be poisoned (a bool
        tensor, decided on the device without a host sync). A non-finite loss is poisoned at once,
        on its own rank: ZeRO-3's global gradient-norm check then discards the step on every rank.
        `step_losses` is given at the step's last micro-batch, before its backward: the step is
        poisoned there, on every rank alike, when a micro-batch's mean over ranks is not finite or
        the step loss is a spike. Poisoning any micro-batch makes the accumulated gradient NaN,
        which discards the step."""
        bad = ~torch.isfinite(local_loss)
        if step_losses is not None:
            bad |= ~torch.isfinite(step_losses).all()
            if threshold is not None:
                bad |= self.step_loss(step_losses) > threshold
        return bad

    def verdict(self, step_losses: torch.Tensor, threshold: float | None) -> tuple[float, str | None]:
        """(step loss, why the step was poisoned or None), read back on the host from the same
        tensor `poison` decided from at the last micro-batch."""
        step_loss = float(self.step_loss(step_losses))
        if not all(math.isfinite(v) for v in step_losses.tolist()):
            return step_loss, "non_finite"
        if threshold is not None and step_loss > threshold:
            return step_loss, "spike"
        return step_loss, None

    def record(self, reason: str | None, step: int, loss: float, grad_norm: float) -> None:
        """Account for a finished step: `reason` is None for an applied step, else why it was skipped."""
        if reason is None:
            self.consecutive = 0
            self.losses.append(loss)
            return
        self.consecutive += 1
        self.total += 1
        self.by_reason[reason] += 1
        if self.consecutive > self.max_consecutive:
            raise RuntimeError(
                f"aborting at step {step}: {self.consecutive} consecutive steps skipped (last: {reason}; "
                f"skipped so far: {self.by_reason}; limit max_consecutive_skips={self.max_consecutive}; "
                f"last loss={loss}, grad_norm={grad_norm}). Lower lr, check the data, or resume "
                f"from an earlier checkpoint."
            )

    def state_dict(self) -> dict:
        # Plain floats and ints: checkpoints load with weights_only=True.
        return {"losses": list(self.losses), "consecutive": self.consecutive, "total": self.total,
                "by_reason": dict(self.by_reason)}

    def load_state_dict(self, state: dict) -> None:
        self.losses.clear()
        self.losses.extend(state["losses"])
        self.consecutive, self.total = state["consecutive"], state["total"]
        self.by_reason = {reason: 0 for reason in SKIP_REASONS} | state["by_reason"]


def decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: decaying RMSNorm gains pulls them toward 0, not toward identity."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def rng_state() -> dict:
    # numpy's state as plain ints: checkpoints load with weights_only=True, which refuses ndarrays.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def export_meta(cfg: dict, step: int, init_fingerprint: str) -> dict:
    """export_meta.json: what the exported weights were trained from. Only inputs that are the same
    on a rerun (no timings, paths, run ids or commit: a docs-only commit, or a resume under a later
    one, trains the same weights), since the export's files make the checkpoints data version."""
    return {"step": step, "seed": cfg["seed"], "init_fingerprint": init_fingerprint,
            "data_versions": dict(sorted(cfg["data_versions"].items()))}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _debug_hold_point() -> tuple[str, int] | None:
    """Test hook: KILN_DEBUG_HOLD=step:K (rank 0 stops mid-step K) or commit:K (stops after step
    K's shards are written, before they are committed); a test then kills the process group."""
    value = os.environ.get(DEBUG_HOLD_ENV)
    if not value:
        return None
    where, _, step = value.partition(":")
    if where not in ("step", "commit") or not step.isdigit():
        raise ValueError(f"{DEBUG_HOLD_ENV}={value!r}: expected step:<N> or commit:<N>")
    return where, int(step)


def _hold_forever(where: str, step: int) -> None:
    print(f"[kiln] debug hold: {where} at step {step}", flush=True)
    while True:
        time.sleep(60)


def _ensure_single_rank_env() -> None:
    """Let `python -m training.train` run as one rank without the launcher."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


def _skip_cpu_shm_comm_op() -> None:
    """On CPU, DeepSpeed's comm backend JIT-builds a shared-memory op that only its inference all-reduce
    uses. Training never calls it, and torch's build lock (a bare file in ~/.cache/torch_extensions)
    outlives a killed build, after which every later run waits on it forever; so it is not built."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def train(config: dict | str | Path) -> dict | None:
    """Run (or resume) training in this rank; rank 0 returns result.json's contents."""
    cfg = resolve_run_config(config)
    _ensure_single_rank_env()
    hold = _debug_hold_point()
    local_world = int(os.environ.get("LOCAL_SIZE", "1"))
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        # Ranks share the cores; torch's default (all cores per rank) oversubscribes them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))

    import deepspeed
    import torch.distributed as torch_dist
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        _skip_cpu_shm_comm_op()
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    on_gpu = accelerator.device_name() != "cpu"
    if on_gpu:
        accelerator.set_device(local_rank)
    device = torch.device(accelerator.current_device_name())
    gpu_name = torch.cuda.get_device_name(device) if on_gpu and torch.cuda.is_available() else None

    out_dir = Path(cfg["out_dir"]).resolve()
    ckpt_dir = out_dir / "ckpt"
    model_cfg = resolve_model_config(cfg)
    use_bf16 = on_gpu and accelerator.is_bf16_supported()
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
    # A run setting, not part of the model: a checkpoint resumes with it on or off.
    model.activation_checkpointing = cfg["activation_checkpointing"]
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
    # resolve_run_config validated these already.
    guard = SkipGuard(SharedTrainingSettings.model_construct(
        **{k: cfg[k] for k in SharedTrainingSettings.model_fields}))
    # Every rank decides from the same files; only a committed, complete checkpoint is trusted.
    resume_tag, notes = checkpointing.resume_point(ckpt_dir, world_size)
    if rank == 0:
        for note in notes:
            print(f"[kiln] passing over a checkpoint: {note}", flush=True)
    if resume_tag is not None:
        # A fresh engine is what load_checkpoint needs after ZeRO-3 (FIELD-NOTES); this is one.
        with checkpointing.weights_only_loads():
            load_path, client_state = engine.load_checkpoint(str(ckpt_dir), tag=resume_tag)
        if load_path is None:
            raise RuntimeError(f"{ckpt_dir / resume_tag} is committed but DeepSpeed could not load it")
        client = client_state["kiln"]
        if client["model_config"] != model_cfg.to_dict():
            raise ValueError(f"checkpoint in {ckpt_dir} was trained with model {client['model_config']}, "
                             f"this config builds {model_cfg.to_dict()}; use a new out_dir")
        step, tokens_seen, prior_wall_s = client["step"], client["tokens_seen"], client["wall_s"]
        run_id = client.get("mlflow_run_id")
        if "guard" in client:  # the spike window too, so a resumed run makes the same skip decisions
            guard.load_state_dict(client["guard"])
        else:  # a checkpoint from before the spike guard, which stored only the two counters
            guard.total, guard.consecutive = client["skipped_steps"], client["consecutive_skips"]
        data.load_state_dict(client["data_cursor"])
        set_rng_state(client["rng"])
        if rank == 0:
            print(f"[kiln] resumed from {load_path} at step {step}", flush=True)
    elif rank == 0 and notes:
        print("[kiln] no complete checkpoint: starting from step 0", flush=True)

    reporter = Rank0Reporter(cfg, out_dir, step, run_id) if rank == 0 else None
    if reporter:
        # The code this process runs: a resumed run's tag names the commit that finished it.
        commit = cfg["git_commit"] or git_commit()
        manifest = load_manifest(cfg["mixed_shards_dir"])
        reporter.start(
            params={
                "model": model_cfg.to_dict(), "num_params": num_params,
                "optim": {k: cfg[k] for k in ("lr", "warmup_steps", "min_lr_ratio", "weight_decay", "betas",
                                              "adam_eps", "grad_clip", "train_steps")},
                "guard": {k: cfg[k] for k in ("max_consecutive_skips", "spike_k", "spike_window", "spike_min_history")},
                "activation_checkpointing": cfg["activation_checkpointing"],
                "batch": {"micro_batch_size": cfg["micro_batch_size"], "grad_accum_steps": gas,
                          "tokens_per_step": tokens_per_step},
                "data": {"mixed_shards_dir": cfg["mixed_shards_dir"], "tokenizer_dir": cfg["tokenizer_dir"],
                         "seed": cfg["seed"], "seq_len": data.seq_len, "vocab_size": manifest["vocab_size"],
                         "dtype": manifest["dtype"], "train_sequences": manifest["train"]["num_sequences"],
                         "versions": cfg["data_versions"]},
                "checkpoint": {"every": cfg["checkpoint_every"], "keep_last": cfg["keep_last"]},
                "world_size": world_size, "zero_stage": 3, "bf16": use_bf16, "device": gpu_name or "cpu",
                "deepspeed": ds_config,
            },
            tags={**({"git_commit": commit} if commit else {}), **cfg["mlflow"].get("tags", {}),
                  "kiln.out_dir": str(out_dir), "kiln.init_fingerprint": init_fingerprint},
            fresh=run_id is None,
        )
        run_id = reporter.run_id

    def save(at_step: int) -> None:
        tag = checkpointing.tag_for(at_step)
        if rank == 0 and (ckpt_dir / tag).exists():
            # Left by a killed run (at most committed without `latest`): rewrite it from scratch.
            shutil.rmtree(ckpt_dir / tag)
        dist.barrier()
        # One namespaced key: DeepSpeed drops client keys that collide with its own (e.g. skipped_steps).
        client_state = {"kiln": {
            "step": at_step, "tokens_seen": tokens_seen, "data_cursor": data.state_dict(),
            "rng": rng_state(), "mlflow_run_id": run_id, "model_config": model_cfg.to_dict(),
            "wall_s": prior_wall_s + (time.time() - start_time), "guard": guard.state_dict(),
            "init_fingerprint": init_fingerprint,
        }}
        # save_latest=False: DeepSpeed would write `latest` before the other ranks finish (checkpointing.py).
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client_state, save_latest=False)
        files: list[dict] = [{} for _ in range(world_size)]
        torch_dist.all_gather_object(files, checkpointing.rank_files(ckpt_dir / tag, rank))
        if hold == ("commit", at_step) and rank == 0:
            _hold_forever("commit", at_step)
        if rank == 0:
            checkpointing.commit(ckpt_dir, at_step, world_size, {k: v for f in files for k, v in f.items()})
            checkpointing.prune(ckpt_dir, cfg["keep_last"])
        dist.barrier()

    nan_steps = set(cfg["debug_nan_loss_steps"])
    loss_scale_steps = cfg["debug_loss_scale_steps"]
    start_time = time.time()
    last_saved = step if resume_tag is not None else None
    final_loss = None
    engine.train()
    try:
        while step < cfg["train_steps"]:
            step += 1
            t0 = time.time()
            skipped_before = engine.skipped_steps
            lr = engine.get_lr()[0]
            threshold = guard.spike_threshold()
            local_losses, step_losses = [], None
            for micro in range(gas):
                inputs, targets = data.next_batch()
                loss = engine(inputs.to(device), targets.to(device))
                if step in loss_scale_steps and rank == 0:
                    loss = loss * loss_scale_steps[step]
                if step in nan_steps and rank == 0:
                    loss = loss * float("nan")
                local_losses.append(loss.detach().float())
                if micro == gas - 1:
                    # One all-reduce per step, before the last backward: each micro-batch's mean over
                    # ranks, so every rank takes the same spike decision from the same numbers.
                    step_losses = torch.stack(local_losses)
                    dist.all_reduce(step_losses)
                    step_losses /= world_size
                bad = guard.poison(local_losses[-1], step_losses, threshold)
                # A NaN loss makes this micro-batch's gradients NaN (an inf loss can have finite
                # gradients), and DeepSpeed sums micro-batch gradients until the step's last one,
                # so ZeRO-3's global-norm check discards the whole step on every rank. A factor of
                # 1.0 leaves the loss bit-identical.
                loss = loss * torch.where(bad, float("nan"), 1.0)
                engine.backward(loss)
                if hold == ("step", step) and rank == 0:
                    _hold_forever("step", step)  # the other ranks wait in a collective
                engine.step()
            # reason: why Kiln poisoned the step, the same on every rank
            step_loss, reason = guard.verdict(step_losses, threshold)
            grad_norm = engine.get_global_grad_norm()
            grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
            if reason is not None and engine.skipped_steps == skipped_before:
                raise RuntimeError(f"step {step}: Kiln skipped it ({reason}) but DeepSpeed applied the update")
            if reason is None and (engine.skipped_steps > skipped_before or not math.isfinite(grad_norm)):
                reason = "non_finite"  # finite loss, but DeepSpeed found non-finite gradients
            skipped = reason is not None
            if skipped:
                print(f"[kiln] rank {rank}: step {step} skipped ({reason}; loss {step_loss:.6g}"
                      + (f", spike threshold {threshold:.6g}" if threshold is not None else "") + ")", flush=True)
            tokens_seen += tokens_per_step
            step_s = time.time() - t0
            if not skipped:
                final_loss = step_loss
            if reporter:
                flops_per_s = flops_per_token * tokens_per_step / step_s
                record = {
                    "step": step, "loss": step_loss, "lr": lr, "grad_norm": grad_norm,
                    "tokens": tokens_seen, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
                    "flops_per_s": flops_per_s, "skipped": skipped, "skip_reason": reason,
                    "skipped_steps": guard.total + skipped, "spike_threshold": threshold,
                    **memory_metrics(on_gpu),
                }
                utilisation = mfu(flops_per_s, world_size, gpu_name, use_bf16)
                if utilisation is not None:
                    record["mfu"] = utilisation
                reporter.step(record)
            guard.record(reason, step, step_loss, grad_norm)
            if step % cfg["checkpoint_every"] == 0:
                save(step)
                last_saved = step
        if last_saved != step:
            save(step)

        if rank != 0:
            return None
        wall_s = prior_wall_s + (time.time() - start_time)
        export_dir = None
        if cfg["export"]:
            from training.export import export_checkpoint

            export_dir = out_dir / "export"
            export_checkpoint(ckpt_dir, export_dir, model_cfg, tag=checkpointing.tag_for(step),
                              tokenizer_dir=cfg.get("tokenizer_dir"),
                              metadata=export_meta(cfg, step, init_fingerprint))
        if final_loss is None:  # resumed at or past train_steps: take it from the log
            final_loss = reporter.last_loss()
        records = [json.loads(line) for line in reporter.metrics_path.read_text().splitlines()]
        ran = [r for r in records if not r["skipped"]]

        def median(key: str) -> float | None:
            values = [r[key] for r in ran if r.get(key) is not None]
            return statistics.median(values) if values else None

        memory_key = "cuda_max_allocated_bytes" if on_gpu else "rss_bytes"
        result = {
            "first_loss": reporter.first_loss(),
            "final_loss": final_loss,
            "steps": step,
            "tokens": tokens_seen,
            "wall_s": wall_s,
            "mlflow_run_id": reporter.run_id,
            "mlflow_experiment_id": reporter.experiment_id,
            "params": num_params,
            "skipped_steps": guard.total,
            **{f"skipped_{reason}": count for reason, count in guard.by_reason.items()},
            "world_size": world_size,
            "device": gpu_name or "cpu",
            "median_step_s": median("step_s"),
            "median_tokens_per_s": median("tokens_per_s"),
            "median_flops_per_s": median("flops_per_s"),
            "median_mfu": median("mfu"),
            f"peak_{memory_key}": max((r.get(memory_key) or 0 for r in records), default=None),
            "init_fingerprint": init_fingerprint,
            "checkpoint": str(ckpt_dir / checkpointing.tag_for(step)),
            "export_dir": str(export_dir) if export_dir else None,
            "model_config": model_cfg.to_dict(),
        }
        checkpointing.write_atomic(out_dir / "result.json", json.dumps(result, indent=2) + "\n")
        reporter.finish(result)
        return result
    except BaseException as error:
        if reporter:
            reporter.fail(error)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Kiln DeepSpeed ZeRO-3 training")
    parser.add_argument("--config", required=True, help="run.json")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    train(args.config)


if __name__ == "__main__":
    main()
