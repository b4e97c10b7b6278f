"""training/: model, shard reader, schedule, evaluation, export, and one real 2-rank DeepSpeed run."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from training.config import build_deepspeed_config, lr_ratio, resolve_model_config, resolve_run_config
from training.data import TrainBatches, validation_batches
from training.evaluate import evaluate, summarize
from training.export import (
    EMBED, LM_HEAD, hf_config, load_exported, model_config_from_hf, save_export,
)
from training.checkpointing import problem_with, read_latest
from training.launch import _redactor, build_command, child_environment, main as launch_main, placement
from training.model import (
    Attention, ModelConfig, apply_rope, build_model, rope_cos_sin, weights_fingerprint,
)
from training.settings import SharedTrainingSettings
from training.train import SkipGuard

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=32)


def write_mixed_shards(folder: Path, train_rows: np.ndarray, val_rows: dict[str, np.ndarray],
                       vocab_size: int, token_bytes: np.ndarray, eos_id: int = 2) -> Path:
    """A mixed_shards folder per docs/CONTRACTS.md (rows are (N, seq_len + 1) token arrays)."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = "uint16" if vocab_size <= 65536 else "uint32"
    seq_len = train_rows.shape[1] - 1
    train_rows.astype(dtype).tofile(folder / "train.bin")
    validation = {}
    for bucket, rows in val_rows.items():
        rows.astype(dtype).tofile(folder / f"val_{bucket}.bin")
        validation[bucket] = {"file": f"val_{bucket}.bin", "num_sequences": len(rows),
                              "num_tokens": int(rows.size), "num_bytes": int(token_bytes[rows].sum())}
    np.save(folder / "token_bytes.npy", token_bytes.astype(np.int32))
    manifest = {
        "dtype": dtype, "seq_len": seq_len, "vocab_size": vocab_size, "eos_id": eos_id,
        "train": {"file": "train.bin", "num_sequences": len(train_rows)},
        "validation": validation,
        "buckets": {b: {"tokens_available": int(r.size), "tokens_sampled": int(r.size), "epochs": 1.0,
                        "target_share": 1.0 / len(val_rows), "realised_share": 1.0 / len(val_rows)}
                    for b, r in val_rows.items()},
        "token_bytes_file": "token_bytes.npy",
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.fixture
def random_shards(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    vocab = 64
    token_bytes = rng.integers(1, 5, size=vocab)
    token_bytes[:3] = 0  # control tokens
    return write_mixed_shards(tmp_path / "mixed", rng.integers(0, vocab, size=(37, 17)),
                              {"web": rng.integers(0, vocab, size=(10, 17)),
                               "books": rng.integers(0, vocab, size=(5, 17))}, vocab, token_bytes)


# ---------------------------------------------------------------- model

def test_forward_shapes_and_initial_loss():
    cfg = ModelConfig(**TINY)
    model = build_model(cfg, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (3, 16))
    assert model(ids).shape == (3, 16, cfg.vocab_size)
    # Small init means near-uniform predictions: loss close to ln(vocab).
    loss = model(ids, torch.randint(0, cfg.vocab_size, (3, 16)))
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_attention_is_causal():
    model = build_model(ModelConfig(**TINY), seed=1).eval()
    ids = torch.randint(0, 64, (1, 12))
    changed = ids.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 64
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_rope_scores_depend_only_on_relative_position():
    head_dim = 16
    cos, sin = rope_cos_sin(32, head_dim, 10000.0, "cpu", torch.float64)
    # Seeded: with unlucky vectors a score is near 0 and the relative comparisons below are noise.
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(head_dim, dtype=torch.float64, generator=gen) for _ in range(2))

    def score(m, n):
        return float(apply_rope(q, cos[m], sin[m]) @ apply_rope(k, cos[n], sin[n]))

    assert score(5, 2) == pytest.approx(score(20, 17), rel=1e-6)  # angles are computed in fp32
    assert score(3, 3) == pytest.approx(float(q @ k), rel=1e-6)  # position 0 offset is the identity
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)


def test_gqa_matches_explicitly_repeated_kv_heads():
    cfg = ModelConfig(**{**TINY, "n_heads": 4, "n_kv_heads": 2})
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, 10, cfg.dim)
    cos, sin = rope_cos_sin(10, cfg.head_dim, cfg.rope_theta, "cpu", torch.float32)
    b, t, hd = 2, 10, cfg.head_dim
    q = apply_rope(attn.q_proj(x).view(b, t, 4, hd).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(b, t, 2, hd).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(b, t, 2, hd).transpose(1, 2)
    # HF's repeat_kv: query head h reads kv head h // 2.
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    weights = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(
        torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf")).softmax(-1)
    expected = attn.o_proj((weights @ v).transpose(1, 2).reshape(b, t, -1))
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = build_model(ModelConfig(**TINY, tie_embeddings=True), seed=0)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied_cfg = ModelConfig(**TINY, tie_embeddings=False)
    untied = build_model(untied_cfg, seed=0)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in untied.parameters()) == untied_cfg.num_params()
    assert untied_cfg.num_params() - ModelConfig(**TINY).num_params() == 64 * 32


def test_init_is_a_function_of_config_and_seed():
    cfg = ModelConfig(**TINY)
    torch.manual_seed(123)  # the global RNG must not matter
    a = build_model(cfg, seed=7)
    torch.manual_seed(456)
    b = build_model(cfg, seed=7)
    assert weights_fingerprint(a) == weights_fingerprint(b)
    assert weights_fingerprint(a) != weights_fingerprint(build_model(cfg, seed=8))


def test_presets_resolve_and_count_parameters():
    sizes = {name: ModelConfig.from_preset(name, vocab_size=32000).num_params() for name in ("125M", "350M", "1B")}
    assert 100e6 < sizes["125M"] < 150e6
    assert 300e6 < sizes["350M"] < 420e6
    assert 0.9e9 < sizes["1B"] < 1.3e9
    with pytest.raises(ValueError):
        ModelConfig.from_preset("7B")


@pytest.mark.parametrize("overrides, field, problem", [
    ({"n_kv_heads": 3}, "n_kv_heads", "n_heads 4 is not a multiple of n_kv_heads 3"),
    ({"dim": 130}, "dim", "dim 130 is not divisible by n_heads 4"),
    ({"n_heads": 3}, "n_heads", "dim 128 is not divisible by n_heads 3"),
    ({"dim": 120, "n_heads": 8, "n_kv_heads": 8}, "dim", "head_dim 15 (dim / n_heads) must be even"),
])
def test_model_overrides_are_checked_against_the_preset_at_config_load(overrides, field, problem):
    """The pipeline config's training.model overrides fail at load with the field named (not when the
    ranks start), and loading the config imports no torch."""
    code = ("import sys, json; from workflows.config import ConfigError, parse_config\n"
            "try: parse_config({'training': {'preset': 'tiny', 'model': json.loads(sys.argv[1])}})\n"
            "except ConfigError as error: print(error)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(overrides)], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, check=True)
    assert f"training.model.{field}: {problem}" in done.stdout and "(preset tiny)" in done.stdout, done.stdout
    assert done.stdout.strip().endswith("no torch")
    # The same rule where the model is built: no config that passes one check fails the other.
    with pytest.raises(ValueError, match=re.escape(problem)):
        ModelConfig.from_preset("tiny", **overrides)


# ---------------------------------------------------------------- data

def _drain(reader: TrainBatches, n: int) -> list[torch.Tensor]:
    return [reader.next_batch()[0] for _ in range(n)]


def test_reader_batches_are_shifted_int64_pairs(random_shards):
    inputs, targets = TrainBatches(random_shards, micro_batch_size=4, seed=0).next_batch()
    assert inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (4, 16)
    rows = np.fromfile(random_shards / "train.bin", dtype=np.uint16).reshape(-1, 17)
    first = rows[[i for i in range(len(rows)) if (rows[i, :16] == inputs[0].numpy()).all()][0]]
    assert (first[1:] == targets[0].numpy()).all()


def test_reader_is_deterministic_and_splits_ranks(random_shards):
    # 37 rows / batch 4 = 9 batches; with 2 ranks each epoch has 4 rounds (batch 8 dropped).
    one = _drain(TrainBatches(random_shards, 4, seed=3), 12)
    again = _drain(TrainBatches(random_shards, 4, seed=3), 12)
    assert all(torch.equal(a, b) for a, b in zip(one, again))
    assert not torch.equal(one[0], _drain(TrainBatches(random_shards, 4, seed=4), 1)[0])

    r0 = TrainBatches(random_shards, 4, seed=3, rank=0, world_size=2)
    r1 = TrainBatches(random_shards, 4, seed=3, rank=1, world_size=2)
    rows0, rows1 = _drain(r0, 4), _drain(r1, 4)
    # Rank r of 2 takes global batches r, r+2, ... of the same permutation as a single rank.
    single = _drain(TrainBatches(random_shards, 4, seed=3), 8)
    for i in range(4):
        assert torch.equal(rows0[i], single[2 * i]) and torch.equal(rows1[i], single[2 * i + 1])
    seen = {tuple(r.tolist()) for batch in rows0 + rows1 for r in batch}
    assert len(seen) == 32  # disjoint within the epoch
    # The next round starts epoch 1, with a different order.
    assert r0.next_batch() is not None and r0.epoch == 1


def test_reader_cursor_round_trip(random_shards):
    reader = TrainBatches(random_shards, 4, seed=5, rank=1, world_size=2)
    _drain(reader, 6)  # crosses an epoch boundary
    state = json.loads(json.dumps(reader.state_dict()))  # it must survive a JSON/pickle trip
    expected = _drain(reader, 5)
    resumed = TrainBatches(random_shards, 4, seed=5, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(expected, _drain(resumed, 5)))
    with pytest.raises(ValueError, match="seed"):
        TrainBatches(random_shards, 4, seed=6).load_state_dict(state)


def test_validation_batches_read_in_file_order(random_shards):
    batches = list(validation_batches(random_shards, "web", batch_size=4, max_sequences=9))
    assert [b[0].shape[0] for b in batches] == [4, 4, 1]
    rows = np.fromfile(random_shards / "val_web.bin", dtype=np.uint16).reshape(-1, 17)
    assert (batches[0][0].numpy() == rows[:4, :-1]).all() and (batches[2][1].numpy() == rows[8:9, 1:]).all()


# ---------------------------------------------------------------- schedule and config

def test_lr_schedule_warmup_cosine_floor():
    ratios = [lr_ratio(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for s in range(130)]
    assert ratios[0] == pytest.approx(0.1) and ratios[4] == pytest.approx(0.5) and ratios[9] == 1.0
    assert ratios[10] == 1.0
    assert ratios[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))
    decay = ratios[10:110]
    assert all(a >= b for a, b in zip(decay, decay[1:]))
    assert ratios[109] == pytest.approx(0.1) and ratios[129] == pytest.approx(0.1)
    assert lr_ratio(0, 0, 10, 0.0) == 1.0  # no warmup: start at peak


def test_deepspeed_config_is_zero3_and_rejects_conflicts(random_shards, tmp_path):
    cfg = resolve_run_config({"mixed_shards_dir": str(random_shards), "out_dir": str(tmp_path / "o"),
                              "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}})
    ds = build_deepspeed_config(cfg, bf16=False)
    assert ds["zero_optimization"] == {"stage": 3, "contiguous_gradients": True, "overlap_comm": False,
                                       "stage3_param_persistence_threshold": 0}
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["torch_adam"] is True
    assert ds["gradient_clipping"] == cfg["grad_clip"] and ds["bf16"] == {"enabled": False}
    assert build_deepspeed_config(cfg, bf16=True)["bf16"] == {"enabled": True}
    with pytest.raises(ValueError, match="conflicts with lr"):
        build_deepspeed_config({**cfg, "deepspeed": {"optimizer": {"params": {"lr": 1.0}}}}, bf16=False)
    with pytest.raises(ValueError, match="stage 3"):
        build_deepspeed_config({**cfg, "deepspeed": {"zero_optimization": {"stage": 2}}}, bf16=False)
    with pytest.raises(ValueError, match="learning_rate: unknown run config key"):
        resolve_run_config({"mixed_shards_dir": "x", "out_dir": "y", "learning_rate": 1.0})
    with pytest.raises(ValueError, match=r"spike_min_history \(30\) must be <= spike_window \(10\)"):
        resolve_run_config({"mixed_shards_dir": "x", "out_dir": "y", "spike_window": 10, "spike_min_history": 30})
    with pytest.raises(ValueError, match="debug_loss_scale_steps: .*finite and > 0"):
        resolve_run_config({"mixed_shards_dir": "x", "out_dir": "y", "debug_loss_scale_steps": {"3": -1}})
    # JSON object keys are strings; the hook's steps come back as ints. A model override keeps the preset.
    hooks = resolve_run_config({"mixed_shards_dir": "x", "out_dir": "y", "debug_loss_scale_steps": {"3": 5},
                                "model": {"n_kv_heads": 1}})
    assert hooks["debug_loss_scale_steps"] == {3: 5.0} and hooks["model"] == {"preset": "tiny", "n_kv_heads": 1}
    model_cfg = resolve_model_config(cfg)
    assert (model_cfg.vocab_size, model_cfg.max_seq_len, model_cfg.eos_id) == (64, 16, 2)


def guard_with(**settings) -> SkipGuard:
    return SkipGuard(SharedTrainingSettings(**settings))


def test_skip_guard_aborts_after_too_many_consecutive_skips():
    guard = guard_with(max_consecutive_skips=2)
    for reason in ("non_finite", "spike", None, "non_finite", "non_finite"):
        guard.record(reason, step=1, loss=float("nan"), grad_norm=float("nan"))
    assert guard.total == 4 and guard.by_reason == {"non_finite": 3, "spike": 1}
    with pytest.raises(RuntimeError, match="3 consecutive steps skipped \\(last: spike"):
        guard.record("spike", step=6, loss=50.0, grad_norm=1.0)


def test_spike_window_statistics():
    guard = guard_with(spike_k=3.0, spike_window=4, spike_min_history=3)
    assert guard.spike_threshold() is None
    for loss in (5.0, 4.0):
        guard.record(None, step=0, loss=loss, grad_norm=1.0)
    assert guard.spike_threshold() is None  # fewer than min_history accepted steps: no check yet
    guard.record(None, step=3, loss=3.0, grad_norm=1.0)
    # mean 4, population std sqrt(2/3): threshold = 4 + 3 * 0.8165
    assert guard.spike_threshold() == pytest.approx(4.0 + 3.0 * math.sqrt(2 / 3))
    for loss in (2.0, 1.0):
        guard.record(None, step=4, loss=loss, grad_norm=1.0)
    assert list(guard.losses) == [4.0, 3.0, 2.0, 1.0]  # the window keeps the last 4
    assert guard.spike_threshold() == pytest.approx(2.5 + 3.0 * math.sqrt(1.25))
    before = guard.spike_threshold()
    guard.record("spike", step=6, loss=40.0, grad_norm=1.0)
    guard.record("non_finite", step=7, loss=float("nan"), grad_norm=float("nan"))
    assert guard.spike_threshold() == before  # skipped steps never enter the window

    # Round trip through what a checkpoint stores (plain floats and ints, weights_only-safe).
    state = guard.state_dict()
    assert json.loads(json.dumps(state)) == state
    resumed = guard_with(spike_k=3.0, spike_window=4, spike_min_history=3)
    resumed.load_state_dict(state)
    assert resumed.spike_threshold() == before
    assert (resumed.total, resumed.consecutive, resumed.by_reason) == (2, 2, {"non_finite": 1, "spike": 1})
    resumed.record(None, step=8, loss=0.5, grad_norm=1.0)
    assert list(resumed.losses) == [3.0, 2.0, 1.0, 0.5] and resumed.consecutive == 0

    for off in (None, 0.0, -1.0):  # disabled
        disabled = guard_with(spike_k=off, spike_window=4, spike_min_history=2)
        for loss in (1.0, 1.0, 1.0):
            disabled.record(None, step=1, loss=loss, grad_norm=1.0)
        assert disabled.spike_threshold() is None


def run_guard_step(guard: SkipGuard, step: int, micro_losses: list[float]) -> tuple[list[bool], str | None]:
    """One optimizer step through the guard as train.py runs it (one rank, so a micro-batch's mean
    over ranks is its own loss): `poison` decides before each micro-batch's backward, given the
    stacked step losses at the last one, and `verdict` reads them back."""
    threshold, seen, poisoned, step_losses = guard.spike_threshold(), [], [], None
    for i, value in enumerate(micro_losses):
        seen.append(torch.tensor(value, dtype=torch.float32))
        if i == len(micro_losses) - 1:
            step_losses = torch.stack(seen)
        poisoned.append(bool(guard.poison(seen[-1], step_losses, threshold)))
    step_loss, reason = guard.verdict(step_losses, threshold)
    guard.record(reason, step, step_loss, grad_norm=1.0)
    return poisoned, reason


def test_spike_guard_with_gradient_accumulation_tests_the_step_loss():
    """grad_accum_steps = 8, micro-batch losses i.i.d. Gaussian: the window holds step losses (means
    of 8), so the step loss, not a single micro-batch (sqrt(8) times noisier), is what is tested.
    With the defaults (k = 6 over 100 steps) no healthy step is skipped; a real spike still is."""
    gas, mean, sigma, steps = 8, 3.0, 0.3, 3000
    settings = SharedTrainingSettings()
    guard = SkipGuard(settings)
    rng = np.random.default_rng(0)
    losses = rng.normal(mean, sigma, size=(steps, gas)).astype(np.float32)
    # The data is a fair test: each micro-batch against mean + k·σ of step losses would fire often.
    step_sigma = sigma / math.sqrt(gas)
    assert (losses[settings.spike_min_history:] > mean + settings.spike_k * step_sigma).any(axis=1).sum() > 100

    reasons = [run_guard_step(guard, step, row.tolist())[1] for step, row in enumerate(losses, 1)]
    assert reasons.count("spike") == 0 and guard.total == 0
    assert guard.spike_threshold() == pytest.approx(mean + settings.spike_k * step_sigma, rel=0.05)

    # The loss jumps on every micro-batch (divergence): the step is poisoned at its last micro-batch.
    poisoned, reason = run_guard_step(guard, steps + 1, [mean + 10 * step_sigma] * gas)
    assert reason == "spike" and poisoned == [False] * (gas - 1) + [True]
    # One micro-batch 50 times the loss (a bad batch) lifts the step loss far above the threshold.
    poisoned, reason = run_guard_step(guard, steps + 2, [mean] * (gas - 1) + [50 * mean])
    assert reason == "spike" and poisoned[-1]
    # A non-finite micro-batch is poisoned at once, whatever follows.
    poisoned, reason = run_guard_step(guard, steps + 3, [mean, float("inf")] + [mean] * (gas - 2))
    assert reason == "non_finite" and poisoned[1]
    assert guard.by_reason == {"non_finite": 1, "spike": 2} and len(guard.losses) == settings.spike_window


def test_mfu_only_against_a_known_gpu_peak():
    from training.hardware import memory_metrics, mfu, peak_bf16_flops

    assert peak_bf16_flops("NVIDIA H200") == 989.4e12 and peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_bf16_flops("NVIDIA H100 PCIe") == 756.5e12 and peak_bf16_flops("NVIDIA H200 NVL") == 835.5e12
    assert peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_bf16_flops("NVIDIA L4") == 121e12 and peak_bf16_flops("NVIDIA L40S") == 362.05e12
    assert peak_bf16_flops("Tesla V100-SXM2-32GB") is None
    # 8 H100s at 40% of peak.
    assert mfu(8 * 0.4 * 989.4e12, 8, "NVIDIA H100 80GB HBM3", bf16=True) == pytest.approx(0.4)
    assert mfu(1e12, 1, None, bf16=False) is None  # CPU: no peak, no MFU
    assert mfu(1e12, 1, "NVIDIA A100-SXM4-80GB", bf16=False) is None  # fp32 against a bf16 peak: no
    assert mfu(1e12, 1, "Tesla V100-SXM2-32GB", bf16=True) is None
    assert memory_metrics(on_gpu=False)["rss_bytes"] > 10e6


# ---------------------------------------------------------------- evaluation

class _UniformLM(torch.nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(()))  # gives evaluate() a device

    def forward(self, ids):
        return torch.zeros(*ids.shape, self.vocab)


def test_bits_per_byte_of_a_uniform_model(random_shards):
    # Uniform over 64 tokens: every target costs ln 64 nats = 6 bits, whatever the token.
    results = evaluate(_UniformLM(64), random_shards, max_sequences_per_bucket=None, batch_size=3)
    token_bytes = np.load(random_shards / "token_bytes.npy")
    rows = np.fromfile(random_shards / "val_books.bin", dtype=np.uint16).reshape(-1, 17)
    books = results["books"]
    assert books["tokens"] == 5 * 16 and books["bytes"] == int(token_bytes[rows[:, 1:]].sum())
    assert books["loss"] == pytest.approx(math.log(64))
    assert books["perplexity"] == pytest.approx(64)
    assert books["bits_per_byte"] == pytest.approx(6 * books["tokens"] / books["bytes"])
    assert sorted(results) == ["books", "web"]
    # Arithmetic alone: 2 tokens, 3 bytes, total NLL 2·ln 2 nats = 2 bits over 3 bytes.
    assert summarize(2 * math.log(2), 2, 3)["bits_per_byte"] == pytest.approx(2 / 3)


def test_evaluate_is_deterministic_and_limits_sequences(random_shards):
    model = build_model(ModelConfig(**{**TINY, "max_seq_len": 16}), seed=0)
    first = evaluate(model, random_shards, max_sequences_per_bucket=4, batch_size=3)
    assert first == evaluate(model, random_shards, max_sequences_per_bucket=4, batch_size=2)
    assert first["web"]["tokens"] == 4 * 16
    assert model.training  # mode restored


# ---------------------------------------------------------------- export

@pytest.mark.parametrize("tied", [True, False])
def test_export_round_trip_reproduces_logits(tmp_path, tied):
    cfg = ModelConfig(**TINY, tie_embeddings=tied, bos_id=1, eos_id=2)
    model = build_model(cfg, seed=3)
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.model").write_bytes(b"sentencepiece-bytes")
    save_export(model.state_dict(), cfg, tmp_path / "export", tokenizer_dir)

    hf = json.loads((tmp_path / "export" / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert hf["tie_word_embeddings"] is tied and hf["num_key_value_heads"] == 2
    assert (tmp_path / "export" / "tokenizer.model").read_bytes() == b"sentencepiece-bytes"
    from safetensors import safe_open
    with safe_open(tmp_path / "export" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert (LM_HEAD in names) is not tied and "model.layers.1.mlp.gate_proj.weight" in names

    loaded, loaded_cfg = load_exported(tmp_path / "export")
    assert loaded_cfg == cfg
    ids = torch.randint(0, 64, (2, 20))
    # A float32 copy of the same weights runs the same kernels: logits are bit-identical.
    with torch.no_grad():
        assert torch.equal(loaded(ids), model.eval()(ids))
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_export_rejects_empty_or_misshapen_tensors(tmp_path):
    cfg = ModelConfig(**TINY)
    state = build_model(cfg, seed=0).state_dict()
    # DeepSpeed #1896: ZeRO-3 consolidation once produced empty tensors for tied weights.
    with pytest.raises(ValueError, match="lm_head.weight"):
        save_export({**state, LM_HEAD: torch.empty(0)}, cfg, tmp_path / "a")
    with pytest.raises(ValueError, match="missing"):
        save_export({k: v for k, v in state.items() if k not in (EMBED, LM_HEAD)}, cfg, tmp_path / "b")


def test_activation_checkpointing_recomputes_blocks_with_identical_gradients():
    cfg = ModelConfig(**TINY)
    ids, targets = torch.randint(0, 64, (2, 24)), torch.randint(0, 64, (2, 24))

    def grads_and_block_calls(checkpointing: bool):
        model = build_model(cfg, seed=0)
        model.activation_checkpointing = checkpointing
        calls = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda *_: calls.append(1))
        model(ids, targets).backward()
        return {n: p.grad for n, p in model.named_parameters()}, len(calls)

    plain, plain_calls = grads_and_block_calls(False)
    recomputed, recomputed_calls = grads_and_block_calls(True)
    assert plain_calls == cfg.n_layers and recomputed_calls == 2 * cfg.n_layers  # each block ran again in backward
    # Same kernels on the same inputs: bit-identical gradients on CPU.
    assert all(torch.equal(plain[name], recomputed[name]) for name in plain)
    model = build_model(cfg, seed=0).eval()
    model.activation_checkpointing = True
    with torch.no_grad():  # nothing to recompute without a backward
        model(ids)


def test_export_carries_the_hugging_face_tokenizer(tmp_path):
    """AutoTokenizer.from_pretrained(export_dir) encodes exactly like the SentencePiece model."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from engine.tokenizer import TokenizerConfig, train_tokenizer

    texts = _documents(np.random.default_rng(1), 200) + ["Zürich, naïve café: 12.5% — “quoted” ümlaut ∑ 日本"]
    train_tokenizer({"web": texts}, str(tmp_path / "tok"), TokenizerConfig(vocab_size=400, sample_chars_per_bucket=100_000))
    cfg = ModelConfig(**{**TINY, "vocab_size": 400})
    save_export(build_model(cfg, seed=0).state_dict(), cfg, tmp_path / "export", tmp_path / "tok",
                metadata={"step": 3})
    names = {p.name for p in (tmp_path / "export").iterdir()}
    assert {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "llama"  # not replaced
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "export" / "tokenizer.model"))
    hf = AutoTokenizer.from_pretrained(tmp_path / "export")
    for text in texts[:50] + texts[-1:] + ["</s> is plain text here", "  two  spaces\nand a newline"]:
        assert hf.encode(text) == sp.encode(text), text
        assert hf.decode(hf.encode(text)) == sp.decode(sp.encode(text))


def test_hf_config_round_trip():
    cfg = ModelConfig.from_preset("1B", vocab_size=32000, bos_id=1, eos_id=2)
    assert model_config_from_hf(hf_config(cfg)) == cfg


# Kiln's model against transformers' LlamaForCausalLM on the same fp32 weights. With the default
# "sdpa" attention the logits come out bit-identical (transformers 5.23, CPU); "eager" attention
# computes the softmax explicitly, in another order, and differs by up to ~2e-5 on logits of
# magnitude ~10. HF_LOGITS_TOLERANCE covers both, and is far below any real mismatch (a wrong
# RoPE layout, GQA mapping or tied head changes logits by O(1)).
HF_LOGITS_TOLERANCE = dict(rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("tied", [True, False])
def test_export_loads_in_transformers_llama_with_equal_logits(tmp_path, tied, attention):
    """The export is a real HF Llama checkpoint (names, RoPE layout, GQA, tying), not just similar."""
    import transformers  # a dev dependency: this test must run, never skip

    # init_std 0.2 gives activations large enough for a layout error to show in every logit.
    cfg = ModelConfig(**TINY, tie_embeddings=tied, init_std=0.2)
    model = build_model(cfg, seed=4).eval()
    save_export(model.state_dict(), cfg, tmp_path / "export")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation=attention).eval()
    assert (hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()) is tied
    ids = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), **HF_LOGITS_TOLERANCE)


# ---------------------------------------------------------------- launcher

def test_build_command_targets_train_script(tmp_path):
    cmd = build_command(tmp_path / "run.json", num_gpus=2, master_port=29555, use_cpu=True)
    assert Path(cmd[0]).name == "deepspeed" or cmd[1:3] == ["-m", "deepspeed.launcher.runner"]
    assert cmd[cmd.index("--num_gpus") + 1] == "2" and cmd[cmd.index("--master_port") + 1] == "29555"
    assert cmd[-3].endswith("training/train.py") and cmd[-2:] == ["--config", str(tmp_path / "run.json")]
    auto = build_command(tmp_path / "run.json", use_cpu=True)
    assert int(auto[auto.index("--master_port") + 1]) > 0
    assert auto[auto.index("--num_gpus") + 1] == "2" and "--num_nodes" not in auto  # 2 CPU ranks by default
    multi = build_command(tmp_path / "run.json", num_gpus=8, num_nodes=2, hostfile="/etc/hostfile")
    assert "--hostfile" in multi and "--master_addr" not in multi and "--num_nodes" in multi


def test_rank_selection_honours_cuda_visible_devices():
    """DeepSpeed's runner uses CUDA_VISIBLE_DEVICES only when no --num_gpus/--num_nodes/--include
    is passed, takes GPUs 0..N-1 with --num_gpus, and refuses --num_nodes next to --include."""
    from training.launch import resource_args, visible_gpus

    assert resource_args(None, 1, None, use_cpu=True, visible=None) == ["--num_gpus", "2"]
    assert resource_args(3, 1, None, use_cpu=True, visible=["0"]) == ["--num_gpus", "3"]  # CPU ranks are processes
    # GPU host, auto: no flag at all, so the runner turns CUDA_VISIBLE_DEVICES (or every GPU) into ranks.
    assert resource_args(None, 1, None, use_cpu=False, visible=["2", "3"]) == []
    assert resource_args(None, 1, None, use_cpu=False, visible=None) == []
    # An explicit count on a host with CUDA_VISIBLE_DEVICES: the first N of those devices, by id.
    assert resource_args(1, 1, None, use_cpu=False, visible=["2", "3"]) == ["--include", "localhost:2"]
    assert resource_args(2, 1, None, use_cpu=False, visible=None) == ["--num_gpus", "2"]
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES lists 1 GPUs"):
        resource_args(2, 1, None, use_cpu=False, visible=["5"])
    assert resource_args(None, 2, "hosts", use_cpu=False, visible=None) == ["--num_nodes", "2", "--hostfile", "hosts"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1, 3"}) == ["1", "3"] and visible_gpus({}) is None
    cmd = build_command("run.json", num_gpus=1, use_cpu=False, env={"CUDA_VISIBLE_DEVICES": "7"})
    assert "--include" in cmd and "--num_gpus" not in cmd and "--num_nodes" not in cmd


def test_dry_run_default_ranks_are_two_cpu_processes(random_shards, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the default is every visible GPU on a CUDA host")
    out = tmp_path / "out"
    (tmp_path / "run.json").write_text(json.dumps({"mixed_shards_dir": str(random_shards), "out_dir": str(out)}))
    assert launch_main(["--dry-run", str(tmp_path / "run.json")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0] == "[kiln] dry run: 2 ranks on localhost:2"
    assert "DS_ACCELERATOR=cpu" in printed[-1] and " --num_gpus 2 --master_port " in printed[-1]
    assert "--num_nodes" not in printed[-1]


def test_dry_run_prints_the_exact_command_and_runs_nothing(random_shards, tmp_path, capsys):
    out = tmp_path / "out"
    config = {"mixed_shards_dir": str(random_shards), "out_dir": str(out), "train_steps": 3}
    (tmp_path / "run.json").write_text(json.dumps(config))
    assert launch_main(["--dry-run", "--num-gpus", "2", str(tmp_path / "run.json")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0] == "[kiln] dry run: 2 ranks on localhost:2"
    line = printed[-1]
    assert line.startswith(f"cd {out} && ") and " --num_gpus 2 --master_port " in line
    assert line.endswith(f"training/train.py --config {out / 'run.json'}")
    if not torch.cuda.is_available():
        assert "DS_ACCELERATOR=cpu" in line
    # Only run.json (the file the command names) is written: no checkpoints, no result, no metrics.
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]
    assert json.loads((out / "run.json").read_text())["train_steps"] == 3


def test_multi_node_placement_is_checked_against_the_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two GPU nodes\ngpu-a slots=8\ngpu-b slots=4  # smaller\n\ngpu-c slots=8\n")
    assert placement(4, 2, hostfile) == {"gpu-a": 4, "gpu-b": 4}
    with pytest.raises(ValueError, match="gpu-b \\(slots=4\\) has fewer slots"):
        placement(8, 2, hostfile)
    with pytest.raises(ValueError, match="lists 3 hosts"):
        placement(1, 4, hostfile)
    with pytest.raises(ValueError, match="needs a hostfile"):
        placement(8, 2, None)
    # DeepSpeed's runner would silently fall back to this machine; Kiln refuses.
    with pytest.raises(FileNotFoundError):
        placement(8, 2, tmp_path / "missing")
    (tmp_path / "bad").write_text("gpu-a 8\n")
    with pytest.raises(ValueError, match="slots="):
        placement(8, 1, tmp_path / "bad")


def test_dry_run_of_a_multi_node_launch(random_shards, tmp_path, capsys):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-1 slots=8\nnode-2 slots=8\n")
    config = {"mixed_shards_dir": str(random_shards), "out_dir": str(tmp_path / "out")}
    (tmp_path / "run.json").write_text(json.dumps(config))
    assert launch_main(["--dry-run", "--num-gpus", "8", "--num-nodes", "2", "--hostfile", str(hostfile),
                        str(tmp_path / "run.json")]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0] == "[kiln] dry run: 16 ranks on node-1:8, node-2:8"
    assert "--num_gpus 8 --num_nodes 2 --hostfile" in printed[-1]
    assert f"--hostfile {hostfile}" in printed[-1] and "--master_addr" not in printed[-1]


def test_training_package_never_imports_dagster():
    """training/ runs standalone: neither dagster nor dagster_pipes is imported outside Pipes."""
    code = ("import sys, training.train, training.launch, training.reporting, training.export, "
            "training.evaluate, training.provenance; bad = [m for m in sys.modules if m.split('.')[0] in ('dagster', 'dagster_pipes')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGSTER_PIPES")}
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for path in Path(__file__).resolve().parents[1].joinpath("training").glob("*.py"):
        for line in path.read_text().splitlines():
            assert not line.strip().startswith(("import dagster", "from dagster ", "from dagster.")), (path, line)


def test_child_environment_is_minimal_and_output_redacted(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "hunter2-secret")
    monkeypatch.setenv("UNRELATED_SERVICE_URL", "http://x")
    env = child_environment(use_cpu=True)
    assert env["DS_ACCELERATOR"] == "cpu" and "UNRELATED_SERVICE_URL" not in env
    redact = _redactor(env)
    assert redact("export MLFLOW_TRACKING_PASSWORD=hunter2-secret; python") == \
        "export MLFLOW_TRACKING_PASSWORD=***; python"


# ---------------------------------------------------------------- end to end

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the river", "a small bird", "the teacher"]
_VERBS = ["sees", "likes", "follows", "paints", "remembers", "carries", "finds"]
_OBJECTS = ["a red apple", "the long road", "an empty boat", "the green hill", "a quiet song"]
_PLACES = ["in the garden", "by the sea", "at night", "after the rain", "near the old bridge"]


def _documents(rng: np.random.Generator, n: int) -> list[str]:
    def sentence():
        return " ".join(str(rng.choice(part)) for part in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES)) + "."

    return [" ".join(sentence() for _ in range(int(rng.integers(3, 8)))) for _ in range(n)]


def build_text_shards(folder: Path, seq_len: int = 64) -> tuple[Path, Path]:
    """The pipeline's own tokenizer (SentencePiece plus its Hugging Face export in hf/) and
    mixed_shards built from a small, learnable grammar."""
    import sentencepiece as spm

    from engine.tokenizer import TokenizerConfig, train_tokenizer

    rng = np.random.default_rng(0)
    tokenizer_dir = folder / "tokenizer"
    meta = train_tokenizer({"web": _documents(rng, 400)}, str(tokenizer_dir),
                           TokenizerConfig(vocab_size=384, sample_chars_per_bucket=200_000))
    assert meta["hf_export"]["exported"] and meta["hf_export"]["mismatches"] == 0, meta["hf_export"]
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    vocab = sp.get_piece_size()
    token_bytes = np.load(tokenizer_dir / "token_bytes.npy")

    def rows(docs: list[str]) -> np.ndarray:
        stream = [t for doc in docs for t in sp.encode(doc) + [sp.eos_id()]]
        n = len(stream) // (seq_len + 1)
        return np.array(stream[:n * (seq_len + 1)]).reshape(n, seq_len + 1)

    shards = write_mixed_shards(folder / "mixed", rows(_documents(rng, 600)),
                                {"web": rows(_documents(rng, 40)), "books": rows(_documents(rng, 40))},
                                vocab, token_bytes, eos_id=sp.eos_id())
    return shards, tokenizer_dir


TRAIN_STEPS = 30
NAN_STEP = 7
MIXED_VERSION = "0123456789abcdef"  # stands in for the mixed_shards data version Dagster passes


def metric_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(export_a: Path, export_b: Path) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(export_a / "model.safetensors")), load_file(str(export_b / "model.safetensors"))
    assert sorted(a) == sorted(b)
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"weights differ bitwise: {different}"


def _live_group_members(pgid: int) -> list[int]:
    import psutil

    alive = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def launch_and_kill_at_hold(config: dict, out_dir: Path, num_gpus: int, hold: str) -> list[str]:
    """Start the real `deepspeed` launcher on `config`, wait until rank 0 reports the debug hold
    (KILN_DEBUG_HOLD, see training/train.py), then SIGKILL the launcher and every rank at once."""
    out_dir.mkdir(parents=True)
    config_path = out_dir / "run.json"
    config_path.write_text(json.dumps({**config, "out_dir": str(out_dir)}))
    env = {**child_environment(use_cpu=not torch.cuda.is_available()), "KILN_DEBUG_HOLD": hold}
    proc = subprocess.Popen(build_command(config_path, num_gpus=num_gpus), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=out_dir, start_new_session=True)
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "[kiln] debug hold" in line:
                break
        else:
            pytest.fail("the run ended before reaching the hold:\n" + "\n".join(lines[-40:]))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, the per-node launcher and the ranks
        proc.wait()
        proc.stdout.close()
    deadline = time.time() + 30
    while _live_group_members(proc.pid):
        assert time.time() < deadline, f"processes survived SIGKILL: {_live_group_members(proc.pid)}"
        time.sleep(0.2)
    return lines


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """One real `deepspeed --num_gpus 2` ZeRO-3 run on CPU (gloo) over the grammar shards."""
    from training.launch import run

    root = tmp_path_factory.mktemp("train")
    shards, tokenizer_dir = build_text_shards(root)
    config = {
        "model": {"preset": "tiny"},
        "mixed_shards_dir": str(shards), "tokenizer_dir": str(tokenizer_dir), "seed": 11,
        "train_steps": TRAIN_STEPS, "micro_batch_size": 8, "grad_accum_steps": 2,
        "lr": 3e-3, "warmup_steps": 5, "min_lr_ratio": 0.1, "checkpoint_every": 10, "keep_last": 2,
        "debug_nan_loss_steps": [NAN_STEP],
        "data_versions": {"mixed_shards": MIXED_VERSION},
        "mlflow": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment": "kiln-test",
                   "run_name": "tiny-2rank", "tags": {"kiln.test": "yes"}, "system_metrics_interval_s": 1},
        # Partition every parameter (the default keeps small ones whole), so ZeRO-3 really shards.
        "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    }
    # A build lock left by a killed JIT build of DeepSpeed's CPU shm op once hung every later run.
    torch_extensions = root / "torch_extensions"
    (torch_extensions / "deepspeed_shm_comm").mkdir(parents=True)
    (torch_extensions / "deepspeed_shm_comm" / "lock").touch()
    lines: list[str] = []
    result = run(config, root / "out", log=lines.append, extra_env={"TORCH_EXTENSIONS_DIR": str(torch_extensions)})
    return {"root": root, "out": root / "out", "config": config, "result": result, "shards": shards,
            "log": lines}


@pytest.mark.slow
@pytest.mark.timeout(900)  # builds two_rank_run; a hang on a build lock fails here, not at the 40-minute default
def test_two_rank_zero3_run(two_rank_run):
    out, result = two_rank_run["out"], two_rank_run["result"]
    assert result["steps"] == TRAIN_STEPS and result["world_size"] == 2
    assert result["tokens"] == TRAIN_STEPS * 8 * 2 * 2 * 64
    assert result["final_loss"] < 0.5 * result["first_loss"]

    records = metric_records(out)
    assert [r["step"] for r in records] == list(range(1, TRAIN_STEPS + 1))
    assert {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "flops_per_s", "skipped", "skip_reason",
            "skipped_steps", "spike_threshold", "rss_bytes"} <= set(records[0])
    # CPU: achieved FLOP/s only; an MFU needs a known peak, which a CPU does not have here.
    assert all("mfu" not in r for r in records) and result["median_mfu"] is None
    assert all(r["flops_per_s"] > 0 and r["rss_bytes"] > 50e6 for r in records)
    # The injected NaN is skipped on both ranks: no update, and the schedule does not advance.
    assert [r["step"] for r in records if r["skipped"]] == [NAN_STEP] and result["skipped_steps"] == 1
    assert records[NAN_STEP - 1]["skip_reason"] == "non_finite" and result["skipped_non_finite"] == 1
    assert result["skipped_spike"] == 0 and {r["skip_reason"] for r in records if not r["skipped"]} == {None}
    # The spike check (default spike_min_history 20) starts once 20 steps were accepted: after step 21.
    assert [r["step"] for r in records if r["spike_threshold"] is not None] == list(range(22, TRAIN_STEPS + 1))
    assert all(r["loss"] < r["spike_threshold"] for r in records if r["spike_threshold"] is not None)
    assert [r["skipped_steps"] for r in records] == [0] * (NAN_STEP - 1) + [1] * (TRAIN_STEPS - NAN_STEP + 1)
    assert records[NAN_STEP - 1]["loss"] is None
    assert records[NAN_STEP]["lr"] == records[NAN_STEP - 1]["lr"]
    assert records[0]["lr"] == pytest.approx(3e-3 / 5)
    assert any("SKIPPED" in line for line in two_rank_run["log"])

    ckpt = out / "ckpt"
    assert read_latest(ckpt) == f"global_step{TRAIN_STEPS}"
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step20", "global_step30"]
    names = sorted(p.name for p in (ckpt / "global_step30").iterdir())
    assert names == ["kiln_checkpoint.json"] + [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"
                                                for r in (0, 1) for kind in ("model", "optim")]
    assert problem_with(ckpt / "global_step30") is None
    # Resume and export load these with weights_only=True: no pickled code beyond two allow-listed
    # DeepSpeed classes (the RNG states are stored as plain ints and tensors).
    for shard in (ckpt / "global_step30").glob("*.pt"):
        assert set(torch.serialization.get_unsafe_globals_in_checkpoint(shard)) <= {
            "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.zero.config.ZeroStageEnum"}
    ds_config = json.loads((out / "ds_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 3 and ds_config["gradient_accumulation_steps"] == 2

    model, cfg = load_exported(out / "export")
    assert (out / "export" / "tokenizer.model").exists() and cfg.tie_embeddings
    # Lineage: what the weights were trained from, and nothing that changes on a rerun (not the
    # commit either: export/* is the checkpoints data version; the commit is an MLflow tag).
    assert json.loads((out / "export" / "export_meta.json").read_text()) == {
        "step": TRAIN_STEPS, "seed": 11, "init_fingerprint": result["init_fingerprint"],
        "data_versions": {"mixed_shards": MIXED_VERSION}}
    assert model.lm_head.weight.abs().sum() > 0
    # The step-0 model is build_model(cfg, seed): the same weights training started from.
    initial = build_model(cfg, two_rank_run["config"]["seed"])
    assert weights_fingerprint(initial) == result["init_fingerprint"]
    trained_eval = evaluate(model, two_rank_run["shards"], max_sequences_per_bucket=16)
    initial_eval = evaluate(initial, two_rank_run["shards"], max_sequences_per_bucket=16)
    for bucket in ("web", "books"):
        assert trained_eval[bucket]["bits_per_byte"] < 0.6 * initial_eval[bucket]["bits_per_byte"]

    # The consolidated ZeRO-3 export (tied head) is what transformers loads, with the same logits.
    import transformers

    hf_model = transformers.LlamaForCausalLM.from_pretrained(out / "export").eval()
    ids = torch.from_numpy(np.fromfile(two_rank_run["shards"] / "val_web.bin", dtype=np.uint16)
                           .reshape(-1, 65)[:4, :64].astype(np.int64))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(ids).logits, model(ids), **HF_LOGITS_TOLERANCE)
    # ... with its tokenizer: the Hugging Face one in the export encodes like the SentencePiece model.
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(out / "export" / "tokenizer.model"))
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out / "export")
    for text in _documents(np.random.default_rng(5), 20):
        assert hf_tokenizer.encode(text) == sp.encode(text)

    import mlflow
    client = mlflow.MlflowClient(two_rank_run["config"]["mlflow"]["tracking_uri"])
    run = client.get_run(result["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["kiln.test"] == "yes"
    assert run.data.tags["git_commit"] == _head_commit()  # run.json left it null: this checkout's HEAD
    params = run.data.params
    assert params["model.dim"] == "128" and params["world_size"] == "2" and params["optim.lr"] == "0.003"
    assert params["batch.grad_accum_steps"] == "2" and params["data.seq_len"] == "64"
    assert params["deepspeed.zero_optimization.stage"] == "3" and params["data.versions.mixed_shards"] == MIXED_VERSION
    history = client.get_metric_history(result["mlflow_run_id"], "loss")
    assert sorted(m.step for m in history) == [s for s in range(1, TRAIN_STEPS + 1) if s != NAN_STEP]
    for name in ("lr", "grad_norm", "tokens_per_s", "flops_per_s", "rss_bytes", "skipped", "skipped_steps"):
        assert len(client.get_metric_history(result["mlflow_run_id"], name)) >= TRAIN_STEPS - 1, name
    assert "mfu" not in run.data.metrics
    non_finite = client.get_metric_history(result["mlflow_run_id"], "skipped_non_finite")
    assert [m.step for m in non_finite if m.value == 1.0] == [NAN_STEP]
    assert not [m for m in client.get_metric_history(result["mlflow_run_id"], "skipped_spike") if m.value]
    assert params["guard.spike_k"] == "6.0" and params["activation_checkpointing"] == "False"
    assert any(key.startswith("system/") for key in run.data.metrics), sorted(run.data.metrics)
    [dataset_input] = run.inputs.dataset_inputs
    assert dataset_input.dataset.name == "mixed_shards" and dataset_input.dataset.digest == MIXED_VERSION
    assert json.loads(dataset_input.dataset.source)["uri"] == str(two_rank_run["shards"].resolve())
    assert {t.key: t.value for t in dataset_input.tags}["mlflow.data.context"] == "training"


@pytest.mark.slow
def test_hard_kill_mid_step_then_restart_is_bit_identical(two_rank_run):
    """SIGKILL the launcher and both ranks in the middle of step 15 (step 10 committed, 11-14
    done and lost), restart with the same config: every step's loss and the final weights equal
    the uninterrupted run bit for bit."""
    from training.launch import run

    config, out = two_rank_run["config"], two_rank_run["root"] / "killed"
    lines = launch_and_kill_at_hold(config, out, num_gpus=2, hold="step:15")
    ckpt = out / "ckpt"
    assert read_latest(ckpt) == "global_step10" and problem_with(ckpt / "global_step10") is None
    assert [r["step"] for r in metric_records(out)] == list(range(1, 15))
    assert not (out / "result.json").exists() and not (out / "export").exists()
    assert any("debug hold: step at step 15" in line for line in lines)

    log: list[str] = []
    result = run(config, out, log=log.append)  # the same config, the same folder
    assert any("resumed from" in line and "global_step10" in line for line in log)

    def key(r):
        # spike_threshold comes from the window of accepted losses in the checkpoint's client_state:
        # equal thresholds at steps 22-30 mean the window was restored bit for bit.
        return (r["step"], r["loss"], r["lr"], r["grad_norm"], r["tokens"], r["skipped"], r["skip_reason"],
                r["skipped_steps"], r["spike_threshold"])

    assert [key(r) for r in metric_records(out)] == [key(r) for r in metric_records(two_rank_run["out"])]
    assert_same_weights(two_rank_run["out"] / "export", out / "export")
    original = two_rank_run["result"]
    assert (result["final_loss"], result["first_loss"], result["tokens"], result["skipped_steps"]) == \
        (original["final_loss"], original["first_loss"], original["tokens"], 1)

    # The resumed process continued the killed run's MLflow run (its id was in the checkpoint).
    import mlflow
    client = mlflow.MlflowClient(config["mlflow"]["tracking_uri"])
    assert client.get_run(result["mlflow_run_id"]).info.status == "FINISHED"
    assert result["mlflow_run_id"] != original["mlflow_run_id"]
    history = client.get_metric_history(result["mlflow_run_id"], "loss")
    assert sorted({m.step for m in history}) == [s for s in range(1, TRAIN_STEPS + 1) if s != NAN_STEP]


def _head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, check=True).stdout.strip()


SPIKE_STEP = 6


@pytest.mark.slow
def test_loss_spike_is_skipped_on_every_rank_and_the_run_goes_on(two_rank_run):
    """Rank 0's loss is multiplied by 50 at step 6 (debug_loss_scale_steps). Both ranks see the
    all-reduced loss above the spike threshold, discard the update, say why, and train on."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from training.checkpointing import weights_only_loads
    from training.launch import run

    config = {**two_rank_run["config"], "train_steps": 8, "debug_nan_loss_steps": [],
              "debug_loss_scale_steps": {str(SPIKE_STEP): 50.0}, "spike_window": 4, "spike_min_history": 3,
              "checkpoint_every": 1, "keep_last": 20, "export": False,
              "mlflow": {**two_rank_run["config"]["mlflow"], "run_name": "spike"}}
    out = two_rank_run["root"] / "spike"
    log: list[str] = []
    result = run(config, out, log=log.append)
    records = metric_records(out)
    assert result["steps"] == 8 and [r["step"] for r in records] == list(range(1, 9))
    assert [(r["step"], r["skip_reason"]) for r in records if r["skipped"]] == [(SPIKE_STEP, "spike")]
    spike = records[SPIKE_STEP - 1]
    # The logged loss is the real (spiking) one, far above the threshold from steps 2-5.
    assert spike["loss"] > spike["spike_threshold"] and spike["loss"] > 10 * records[SPIKE_STEP - 2]["loss"]
    assert result["skipped_spike"] == 1 and result["skipped_non_finite"] == 0 and result["skipped_steps"] == 1
    # Each rank decided for itself, from the all-reduced loss (only rank 0's was scaled).
    for rank in (0, 1):
        assert any(f"rank {rank}: step {SPIKE_STEP} skipped (spike" in line for line in log), rank
    assert any(f"step {SPIKE_STEP}/8" in line and "SKIPPED (spike" in line for line in log)

    # The update was discarded: the weights after step 6 are those after step 5, bit for bit,
    # the schedule did not advance, and step 7 trained again.
    def weights(step: int) -> dict:
        with weights_only_loads():
            return get_fp32_state_dict_from_zero_checkpoint(str(out / "ckpt"), tag=f"global_step{step}")

    before, at_spike, after = weights(SPIKE_STEP - 1), weights(SPIKE_STEP), weights(SPIKE_STEP + 1)
    assert all(torch.equal(before[name], at_spike[name]) for name in before)
    assert not all(torch.equal(at_spike[name], after[name]) for name in at_spike)
    assert records[SPIKE_STEP]["lr"] == records[SPIKE_STEP - 1]["lr"]
    assert records[SPIKE_STEP]["loss"] < records[SPIKE_STEP - 2]["loss"] * 1.5  # back to normal

    import mlflow
    client = mlflow.MlflowClient(config["mlflow"]["tracking_uri"])
    history = client.get_metric_history(result["mlflow_run_id"], "skipped_spike")
    assert [m.step for m in history if m.value == 1.0] == [SPIKE_STEP]


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_losses(two_rank_run):
    """The first 6 steps of the 2-rank ZeRO-3 run again, every decoder block recomputed in
    backward: per-step losses and gradient norms equal the run without it, bit for bit on CPU
    (the recompute runs the same kernels on the same inputs). Steps 1-6 have the same learning
    rates for 6 and for 30 training steps (warmup is 5 steps; step 6 is the cosine's start)."""
    from training.launch import run

    config = {**two_rank_run["config"], "train_steps": 6, "activation_checkpointing": True, "export": False,
              "mlflow": {**two_rank_run["config"]["mlflow"], "run_name": "activation-checkpointing"}}
    out = two_rank_run["root"] / "recompute"
    run(config, out, log=lambda line: None)
    assert json.loads((out / "resolved_config.json").read_text())["activation_checkpointing"] is True

    def key(r):
        return r["step"], r["loss"], r["lr"], r["grad_norm"], r["skipped"]

    assert [key(r) for r in metric_records(out)] == [key(r) for r in metric_records(two_rank_run["out"])[:6]]


@pytest.mark.slow
def test_too_many_skipped_steps_abort_the_run(two_rank_run):
    from training.launch import TrainingFailed, run

    config = {**two_rank_run["config"], "train_steps": 6, "debug_nan_loss_steps": [2, 3, 4],
              "max_consecutive_skips": 2, "mlflow": {**two_rank_run["config"]["mlflow"], "run_name": "aborts"}}
    out = two_rank_run["root"] / "aborted"
    with pytest.raises(TrainingFailed, match="3 consecutive steps skipped") as failure:
        run(config, out, log=lambda line: None)
    assert "exited with status" in str(failure.value)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, True, True, True]
    assert not (out / "result.json").exists()

    import mlflow
    client = mlflow.MlflowClient(config["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name("kiln-test")
    runs = client.search_runs([experiment.experiment_id], filter_string="attributes.run_name = 'aborts'")
    assert [r.info.status for r in runs] == ["FAILED"]
