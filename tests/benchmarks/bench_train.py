"""Training step benchmark: Kiln's DeepSpeed ZeRO-3 step against a plain PyTorch loop.

    python tests/benchmarks/bench_train.py [--quick] [--ranks N] [--steps N] [--preset tiny]
    python tests/benchmarks/bench_train.py --shards .kiln/storage/mixed_shards/all/<version>  # real data
    python tests/benchmarks/bench_train.py --gpu --shards DIR   # 350M preset, bf16, 1 GPU: tokens/s and MFU

--shards trains on a published `mixed_shards` folder (its train.bin, seq_len and vocabulary)
instead of random tokens. --gpu is the GPU measurement of the Training issue: the 350M preset,
bf16 (Kiln's choice on any GPU that supports it; the plain loop autocasts to bf16), one rank
unless --ranks, seq_len 2048 for random tokens (real shards bring their own), micro-batch 8,
30 steps; it refuses to run without CUDA. tokens_per_s and mfu are Kiln's, against
training.hardware's table of dense bf16 peaks; plain_tokens_per_s and plain_mfu the plain loop's.

Both sides train the same model (training.model.build_model, same config and seed) on the
same token sequences: step i of the plain loop is the concatenation of what every Kiln rank
reads at step i (training.data.TrainBatches, rank r of N), so tokens per step are equal.

Kiln: the real entry point (`training/train.py`) in its own processes, ZeRO-3, torch AdamW,
gradient clipping, warmup+cosine schedule, metrics.jsonl, no MLflow, no export. Full mode
starts it through the `deepspeed` launcher with N ranks (2 CPU ranks by default, or every
GPU); --quick runs 1 rank as `python -m training.train` (no launcher), so it fits in a minute.
Plain: one process (started like Kiln's, same environment), torch.optim.AdamW with the same param groups, LambdaLR with the same
schedule, clip_grad_norm_, bf16 autocast on CUDA (Kiln trains bf16 there) and fp32 on CPU.

Step time is the median over the steps after `warmup` (the first steps pay one-off costs);
the plain loop runs before and after Kiln (--quick: after only) and its median pools both blocks (each block's median
and the load average are printed: on a shared machine, other processes move these numbers; both
sides run with OMP_WAIT_POLICY=PASSIVE unless set, since spinning OpenMP workers slowed a plain
2-thread loop 3-10x on a loaded 2-core machine);
Kiln's comes from its metrics.jsonl (`step_s`, rank 0's wall time per optimizer step, which
ends in an all-reduce so it covers every rank). ratio = kiln_step_s / plain_step_s: above 1
is ZeRO-3's overhead (parameter all-gathers, reduce-scatters, partitioned optimizer) at this
size. loss_max_abs_diff compares the two loss curves as a check that both did the same work.
On CUDA, tokens_per_s and mfu (against training.hardware's table of peaks) are added.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from training.config import lr_ratio, resolve_model_config, resolve_run_config  # noqa: E402
from training.data import TrainBatches, load_manifest  # noqa: E402
from training.hardware import mfu  # noqa: E402
from training.launch import child_environment, run as launch_run  # noqa: E402
from training.model import build_model  # noqa: E402
from training.train import decay_param_groups  # noqa: E402


def write_shards(folder: Path, vocab: int, seq_len: int, sequences: int, seed: int = 0) -> Path:
    """A mixed_shards folder (docs/CONTRACTS.md) of random tokens: speed does not depend on content."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    rng.integers(3, vocab, size=(sequences, seq_len + 1)).astype(np.uint16).tofile(folder / "train.bin")
    val = rng.integers(3, vocab, size=(4, seq_len + 1)).astype(np.uint16)
    val.tofile(folder / "val_web.bin")
    np.save(folder / "token_bytes.npy", np.full(vocab, 3, dtype=np.int32))
    (folder / "manifest.json").write_text(json.dumps({
        "dtype": "uint16", "seq_len": seq_len, "vocab_size": vocab, "eos_id": 2,
        "train": {"file": "train.bin", "num_sequences": sequences},
        "validation": {"web": {"file": "val_web.bin", "num_sequences": 4, "num_tokens": int(val.size),
                               "num_bytes": int(val.size * 3)}},
        "buckets": {"web": {"tokens_available": sequences * seq_len, "tokens_sampled": sequences * seq_len,
                            "epochs": 1.0, "target_share": 1.0, "realised_share": 1.0}},
        "token_bytes_file": "token_bytes.npy",
    }))
    return folder


def kiln_steps(config: dict, out_dir: Path, ranks: int, quick: bool) -> tuple[list[dict], float]:
    """Run Kiln's trainer; (metrics.jsonl records, wall seconds of the whole launch)."""
    started = time.time()
    if quick:
        out_dir.mkdir(parents=True)
        (out_dir / "run.json").write_text(json.dumps({**config, "out_dir": str(out_dir)}))
        done = subprocess.run([sys.executable, "-m", "training.train", "--config", str(out_dir / "run.json")],
                              cwd=REPO, env=child_environment(use_cpu=not torch.cuda.is_available()),
                              capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"training.train failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    else:
        launch_run(config, out_dir, log=lambda line: None, num_gpus=ranks)
    wall = time.time() - started
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return records, wall


def plain_steps(cfg: dict, ranks: int) -> list[dict]:
    """The same model, data, optimizer, schedule and clipping in a plain PyTorch loop."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model_cfg = resolve_model_config(cfg)
    torch.manual_seed(cfg["seed"])
    model = build_model(model_cfg, cfg["seed"]).to(device)
    model.activation_checkpointing = cfg["activation_checkpointing"]
    model.train()
    optimizer = torch.optim.AdamW(decay_param_groups(model, cfg["weight_decay"]), lr=cfg["lr"],
                                  betas=tuple(cfg["betas"]), eps=cfg["adam_eps"])
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_ratio(
        s, cfg["warmup_steps"], cfg["train_steps"], cfg["min_lr_ratio"]))
    readers = [TrainBatches(cfg["mixed_shards_dir"], cfg["micro_batch_size"], cfg["seed"], r, ranks)
               for r in range(ranks)]
    records = []
    for step in range(1, cfg["train_steps"] + 1):
        batches = [reader.next_batch() for reader in readers]  # what the Kiln ranks read at this step
        inputs = torch.cat([b[0] for b in batches]).to(device)
        targets = torch.cat([b[1] for b in batches]).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the step on CUDA
        records.append({"step": step, "loss": value, "step_s": time.perf_counter() - t0})
    return records


def plain_steps_in_subprocess(cfg: dict, ranks: int) -> list[dict]:
    """plain_steps in a fresh process with the environment Kiln's ranks get: equal footing."""
    done = subprocess.run([sys.executable, __file__, "--plain-worker", json.dumps({"cfg": cfg, "ranks": ranks})],
                          cwd=REPO, env=child_environment(use_cpu=not torch.cuda.is_available()),
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"plain loop failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_step_s(records: list[dict], warmup: int) -> float:
    return statistics.median(r["step_s"] for r in records[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 rank without the launcher, few steps")
    parser.add_argument("--ranks", type=int, default=None, help="Kiln ranks (default: 2 CPU ranks or every GPU)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--preset", default=None, help="model preset (default: tiny, or 350M with --gpu)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None, help="random tokens only (real shards have theirs)")
    parser.add_argument("--shards", type=Path, default=None,
                        help="a mixed_shards artifact folder (manifest.json, train.bin) to train on")
    parser.add_argument("--gpu", action="store_true",
                        help="GPU measurement: 350M preset in bf16, 1 rank, tokens_per_s and mfu (needs CUDA)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute decoder blocks in backward (both sides)")
    parser.add_argument("--plain-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_worker:
        job = json.loads(args.plain_worker)
        print(json.dumps(plain_steps(job["cfg"], job["ranks"])))
        return
    # OpenMP workers that spin while waiting (libgomp's default) crawl when other processes hold
    # the cores; passive waiting keeps both sides measurable on a shared machine. Both get it.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    on_gpu = torch.cuda.is_available()
    if args.gpu and not on_gpu:
        sys.exit("--gpu needs CUDA: torch.cuda.is_available() is False here")
    if args.shards is not None and args.seq_len is not None:
        sys.exit("--seq-len applies to random tokens only: the shards' manifest fixes seq_len")
    preset = args.preset or ("350M" if args.gpu else "tiny")
    default_ranks = 1 if args.gpu else (torch.cuda.device_count() if on_gpu else 2)
    ranks = 1 if args.quick else (args.ranks or default_ranks)
    steps = args.steps or (8 if args.quick else 30)
    warmup = 3
    if args.gpu:
        seq_len = args.seq_len or 2048  # the presets' context length
    else:
        seq_len = args.seq_len or (128 if args.quick else 256)
    vocab = 32000 if args.gpu else 4096  # a Llama-size vocabulary for the GPU figure
    with tempfile.TemporaryDirectory(prefix="bench_train-") as tmp:
        tmp = Path(tmp)
        if args.shards is not None:
            shards = args.shards.resolve()
            manifest = load_manifest(shards)
            seq_len, vocab = int(manifest["seq_len"]), int(manifest["vocab_size"])
        else:
            sequences = steps * args.micro_batch * ranks + args.micro_batch * ranks
            shards = write_shards(tmp / "mixed", vocab, seq_len, sequences)
        # log_every and checkpoint_every past the last step: no progress lines, one final save.
        config = {"model": {"preset": preset}, "mixed_shards_dir": str(shards), "seed": 0,
                  "train_steps": steps, "micro_batch_size": args.micro_batch, "lr": 1e-3, "warmup_steps": 2,
                  "checkpoint_every": steps + 1, "keep_last": 1, "log_every": steps + 1, "export": False,
                  "activation_checkpointing": args.activation_checkpointing}
        cfg = resolve_run_config({**config, "out_dir": str(tmp / "kiln")})
        load_before = os.getloadavg()[0]
        # One process: the plain loop gets every core (Kiln's ranks split them). It runs before and
        # after Kiln, so a load change on a shared machine shows as two different medians.
        plain_before = [] if args.quick else plain_steps_in_subprocess(cfg, ranks)  # --quick: after only
        kiln, kiln_wall = kiln_steps(config, tmp / "kiln", ranks, args.quick)
        plain_after = plain_steps_in_subprocess(cfg, ranks)
        load_after = os.getloadavg()[0]
        model_cfg = resolve_model_config(cfg)
        # What Kiln actually ran in (bf16 where the GPU supports it): MFU is only defined against a bf16 peak.
        kiln_bf16 = json.loads((tmp / "kiln" / "ds_config.json").read_text())["bf16"]["enabled"]

    plain = plain_after  # same data and math both times: the loss curve is compared from one
    kiln_step_s = median_step_s(kiln, warmup)
    plain_step_s = statistics.median([r["step_s"] for block in (plain_before, plain_after) for r in block[warmup:]])
    tokens_per_step = args.micro_batch * ranks * seq_len
    flops_per_step = model_cfg.train_flops_per_token(seq_len) * tokens_per_step
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(kiln, plain) if a["loss"] is not None]
    device = torch.cuda.get_device_name(0) if on_gpu else f"cpu ({os.cpu_count()} cores)"
    print(f"device {device}; preset {preset} ({model_cfg.num_params() / 1e6:.2f}M params), "
          f"{ranks} Kiln rank(s), {tokens_per_step} tokens/step, {steps} steps (median after {warmup})")
    print(f"kiln  ZeRO-3 step {kiln_step_s * 1e3:8.1f} ms  ({tokens_per_step / kiln_step_s:,.0f} tokens/s, "
          f"{flops_per_step / kiln_step_s / 1e9:,.1f} GFLOP/s; whole launch {kiln_wall:.1f} s)")
    print(f"plain AdamW  step {plain_step_s * 1e3:8.1f} ms  ({tokens_per_step / plain_step_s:,.0f} tokens/s, "
          f"{flops_per_step / plain_step_s / 1e9:,.1f} GFLOP/s)")
    summary = {
        "benchmark": "bench_train",
        "device": device,
        "preset": preset,
        "data": str(args.shards) if args.shards is not None else "random tokens",
        "seq_len": seq_len,
        "activation_checkpointing": args.activation_checkpointing,
        "ranks": ranks,
        "launcher": not args.quick,
        "steps": steps,
        "tokens_per_step": tokens_per_step,
        "kiln_step_s": round(kiln_step_s, 5),
        "plain_step_s": round(plain_step_s, 5),
        "ratio": round(kiln_step_s / plain_step_s, 3),
        "kiln_flops_per_s": round(flops_per_step / kiln_step_s),
        "plain_flops_per_s": round(flops_per_step / plain_step_s),
        "kiln_launch_wall_s": round(kiln_wall, 1),
        "loss_max_abs_diff": float(f"{max(diffs):.3g}") if diffs else None,
        "plain_step_s_before_after": [round(median_step_s(block, warmup), 5) if block else None
                                      for block in (plain_before, plain_after)],
        "load_avg_1m_before_after": [round(load_before, 2), round(load_after, 2)],
        "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
    }
    if on_gpu:
        summary["tokens_per_s"] = round(tokens_per_step / kiln_step_s)
        summary["plain_tokens_per_s"] = round(tokens_per_step / plain_step_s)
        kiln_mfu = mfu(flops_per_step / kiln_step_s, ranks, torch.cuda.get_device_name(0), bf16=kiln_bf16)
        plain_mfu = mfu(flops_per_step / plain_step_s, 1, torch.cuda.get_device_name(0), bf16=True)
        summary["mfu"] = round(kiln_mfu, 4) if kiln_mfu is not None else None
        summary["bf16"] = kiln_bf16
        summary["peak_cuda_allocated_gib"] = round(max(r.get("cuda_max_allocated_bytes") or 0 for r in kiln) / 2**30, 2)
        summary["plain_mfu"] = round(plain_mfu, 4) if plain_mfu is not None else None
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
