"""Checkpoint commit protocol (training/checkpointing.py) and a hard kill of a 1-rank run mid-save."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_training import assert_same_weights, build_text_shards, launch_and_kill_at_hold, metric_records
from training.checkpointing import (
    COMPLETE, commit, complete_steps, problem_with, prune, rank_files, read_latest, resume_point, write_atomic,
)


def fake_checkpoint(ckpt_dir: Path, step: int, world_size: int = 2, committed: bool = True) -> Path:
    """A step folder holding `world_size` shard pairs (as DeepSpeed names them), committed or not."""
    tag_dir = ckpt_dir / f"global_step{step}"
    tag_dir.mkdir(parents=True)
    files = {}
    for rank in range(world_size):
        for kind, size in (("model", 100 + rank), ("optim", 1000 + rank)):
            name = f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
            (tag_dir / name).write_bytes(b"x" * size)
            files[name] = size
    if committed:
        commit(ckpt_dir, step, world_size, files)
    return tag_dir


def test_commit_writes_marker_then_latest_and_validates_sizes(tmp_path):
    tag_dir = fake_checkpoint(tmp_path, 10)
    assert read_latest(tmp_path) == "global_step10" and problem_with(tag_dir) is None
    marker = json.loads((tag_dir / COMPLETE).read_text())
    assert marker["world_size"] == 2 and len(marker["files"]) == 4
    assert not [p for p in tmp_path.rglob("*.tmp")]  # atomic writes leave no temp files

    optim = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:500])  # a shard cut short
    assert "has 500 bytes, the commit recorded 1001" in problem_with(tag_dir)
    optim.unlink()
    assert "is missing" in problem_with(tag_dir)
    assert "save never finished" in problem_with(fake_checkpoint(tmp_path, 20, committed=False))
    (tag_dir / COMPLETE).write_text('{"tag": "glob')  # a marker torn by a crash without the rename
    assert problem_with(tag_dir) == f"unreadable {COMPLETE}"


def test_resume_point_trusts_latest_only_when_complete(tmp_path):
    assert resume_point(tmp_path / "none", world_size=2) == (None, [])
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 20)
    assert resume_point(tmp_path, 2) == ("global_step20", [])

    # What DeepSpeed's own save_latest=True allows: `latest` already names step 30 while another
    # rank's shard is still being written (rank 0 writes it with no barrier first).
    torn = fake_checkpoint(tmp_path, 30, committed=False)
    (tmp_path / "latest").write_text("global_step30")
    tag, notes = resume_point(tmp_path, 2)
    assert tag == "global_step20" and "latest names global_step30, which is incomplete" in notes[0]

    (tmp_path / "latest").write_text("")  # truncated by a kill between open('w') and write
    tag, notes = resume_point(tmp_path, 2)
    assert tag == "global_step20" and notes[0] == "latest is empty"

    assert problem_with(torn) is not None and complete_steps(tmp_path) == [10, 20]
    # Committed, but killed before `latest` moved: `latest` is still the commit point.
    fake_checkpoint(tmp_path / "other", 10)
    fake_checkpoint(tmp_path / "other", 20)
    write_atomic(tmp_path / "other" / "latest", "global_step10")
    assert resume_point(tmp_path / "other", 2) == ("global_step10", [])

    with pytest.raises(ValueError, match="saved by 2 ranks and this run has 4"):
        resume_point(tmp_path, 4)


def test_resume_point_with_nothing_complete_starts_fresh(tmp_path):
    fake_checkpoint(tmp_path, 10, committed=False)
    tag, notes = resume_point(tmp_path, 2)
    assert tag is None and "global_step10 is incomplete" in notes[0]


def test_prune_keeps_newest_complete_up_to_latest(tmp_path):
    for step in (10, 20, 30):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 25, committed=False)  # left by a save killed earlier
    fake_checkpoint(tmp_path, 40, committed=False)  # newer than latest: the run will rewrite it
    assert prune(tmp_path, keep_last=2) == [10, 25]
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step20", "global_step30",
                                                                     "global_step40"]
    write_atomic(tmp_path / "latest", "global_step20")  # e.g. latest re-pointed by hand
    assert prune(tmp_path, keep_last=1) == []  # 30 is newer than latest: left alone
    assert read_latest(tmp_path) == "global_step20"


def test_rank_files_takes_only_its_own_shards(tmp_path):
    tag_dir = fake_checkpoint(tmp_path, 10, world_size=12, committed=False)
    mine = rank_files(tag_dir, 1)
    assert sorted(mine) == ["zero_pp_rank_1_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert mine["zero_pp_rank_1_mp_rank_00_optim_states.pt"] == 1001
    with pytest.raises(RuntimeError, match="rank 12 finds none of its shards"):
        rank_files(tag_dir, 12)


# ---------------------------------------------------------------- a real 1-rank run, killed mid-save

STEPS, EVERY = 8, 4


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    from training.launch import run

    root = tmp_path_factory.mktemp("one_rank")
    shards, tokenizer_dir = build_text_shards(root)
    config = {"model": {"preset": "tiny"}, "mixed_shards_dir": str(shards), "tokenizer_dir": str(tokenizer_dir),
              "seed": 5, "train_steps": STEPS, "micro_batch_size": 8, "lr": 3e-3, "warmup_steps": 2,
              "checkpoint_every": EVERY, "keep_last": 2}
    result = run(config, root / "full", num_gpus=1, log=lambda line: None)
    return {"root": root, "config": config, "result": result}


@pytest.mark.slow
def test_hard_kill_during_a_save_then_restart_is_bit_identical(one_rank_run):
    """SIGKILL while step 8's shards are written but not committed. Then make it worse, the way
    DeepSpeed's own `latest` handling could: point `latest` at the uncommitted folder and cut a
    shard short. The restart must pass over it, resume from step 4, and end bit-identical."""
    from training.launch import run

    config, out = one_rank_run["config"], one_rank_run["root"] / "killed"
    launch_and_kill_at_hold(config, out, num_gpus=1, hold=f"commit:{STEPS}")
    ckpt = out / "ckpt"
    assert read_latest(ckpt) == f"global_step{EVERY}" and problem_with(ckpt / f"global_step{EVERY}") is None
    half_written = ckpt / f"global_step{STEPS}"
    assert "save never finished" in problem_with(half_written)
    assert [r["step"] for r in metric_records(out)] == list(range(1, STEPS + 1))

    (ckpt / "latest").write_text(f"global_step{STEPS}")
    optim = half_written / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[: optim.stat().st_size // 2])

    log: list[str] = []
    result = run(config, out, num_gpus=1, log=log.append)
    assert any(f"latest names global_step{STEPS}, which is incomplete" in line for line in log)
    assert any("resumed from" in line and f"global_step{EVERY}" in line for line in log)

    def key(r):
        return r["step"], r["loss"], r["lr"], r["grad_norm"], r["tokens"]

    assert [key(r) for r in metric_records(out)] == [key(r) for r in metric_records(one_rank_run["root"] / "full")]
    assert_same_weights(one_rank_run["root"] / "full" / "export", out / "export")
    assert result["final_loss"] == one_rank_run["result"]["final_loss"] and result["steps"] == STEPS
    assert read_latest(ckpt) == f"global_step{STEPS}" and problem_with(half_written) is None


class _Payload:
    """Stands in for anything a hostile checkpoint could pickle."""


def test_loads_are_weights_only_even_where_deepspeed_asks_otherwise(tmp_path):
    import os
    import pickle

    import torch

    from training.checkpointing import weights_only_loads

    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    torch.save({"w": torch.ones(2), "obj": _Payload()}, tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    with weights_only_loads():
        with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
            torch.load(tmp_path / "evil.pt", weights_only=False)  # what DeepSpeed's loaders pass
        assert torch.equal(torch.load(tmp_path / "plain.pt", weights_only=False)["w"], torch.ones(2))
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == before  # restored afterwards
