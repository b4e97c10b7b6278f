"""Which checkpoint a restart may trust, and the commit protocol that makes that knowable.

DeepSpeed's own `save_checkpoint(save_latest=True)` writes `latest` from rank 0 right after rank
0's files, with no barrier before it, and with a plain truncate-then-write: a kill at the wrong
moment leaves `latest` naming a folder whose other ranks' shards are half written, or an empty
`latest`. Kiln therefore saves with `save_latest=False` and commits itself, after every rank's
shards are fsynced: first `kiln_checkpoint.json` (every file and its size) inside the step folder,
then `latest`, each written to a temp file and renamed over. A restart trusts a folder only if its
marker is there and every listed file has the listed size; otherwise it falls back to the newest
complete one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Iterator

COMPLETE = "kiln_checkpoint.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^global_step(\d+)$")


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every torch.load inside runs with weights_only=True, including DeepSpeed's own (its
    checkpoint engine and zero_to_fp32 pass weights_only=False): a checkpoint folder is data, never
    code. The two DeepSpeed classes its ZeRO-3 optimizer state pickles are allow-listed by name.
    """
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum])
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def tag_for(step: int) -> str:
    return f"global_step{step}"


def step_of(tag: str) -> int | None:
    match = _STEP_DIR.match(tag)
    return int(match.group(1)) if match else None


def checkpoint_steps(ckpt_dir: Path) -> list[int]:
    """Steps with a folder, complete or not."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(s for p in ckpt_dir.iterdir() if p.is_dir() and (s := step_of(p.name)) is not None)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Temp file, fsync, rename over, fsync the folder: readers see the old or the new text, whole."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def rank_files(tag_dir: Path, rank: int) -> dict[str, int]:
    """fsync this rank's ZeRO shards in tag_dir and return {name: size}.

    ZeRO-3 names every rank's files `zero_pp_rank_<rank>_mp_rank_00_{model,optim}_states.pt`.
    """
    pattern = re.compile(rf"(^|_)pp_rank_{rank}_mp_rank_")
    files = {}
    for path in sorted(tag_dir.iterdir()):
        if path.is_file() and pattern.search(path.name):
            fsync_path(path)
            files[path.name] = path.stat().st_size
    if not files:
        raise RuntimeError(f"rank {rank} finds none of its shards in {tag_dir}; refusing to commit it")
    return files


def commit(ckpt_dir: Path, step: int, world_size: int, files: dict[str, int]) -> None:
    """Rank 0, after every rank's shards are on disk: the marker, then `latest`."""
    tag_dir = ckpt_dir / tag_for(step)
    fsync_path(tag_dir)
    marker = {"tag": tag_for(step), "step": step, "world_size": world_size, "files": files}
    write_atomic(tag_dir / COMPLETE, json.dumps(marker, indent=2, sort_keys=True) + "\n")
    write_atomic(ckpt_dir / LATEST, tag_for(step))


def problem_with(tag_dir: Path) -> str | None:
    """Why tag_dir is not a complete, committed checkpoint (None if it is)."""
    if not tag_dir.is_dir():
        return "no such folder"
    try:
        marker = json.loads((tag_dir / COMPLETE).read_text())
    except FileNotFoundError:
        return f"no {COMPLETE}: its save never finished"
    except ValueError:
        return f"unreadable {COMPLETE}"
    for name, size in marker["files"].items():
        path = tag_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the commit recorded {size}"
    return None


def complete_steps(ckpt_dir: Path) -> list[int]:
    return [s for s in checkpoint_steps(ckpt_dir) if problem_with(ckpt_dir / tag_for(s)) is None]


def read_latest(ckpt_dir: Path) -> str | None:
    try:
        return (ckpt_dir / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


def resume_point(ckpt_dir: Path, world_size: int) -> tuple[str | None, list[str]]:
    """(tag to resume from or None for a fresh start, notes on what was passed over and why).

    `latest` is trusted only when its folder is complete; otherwise the newest complete folder is
    used. A complete checkpoint from a different world size is an error, not a silent restart.
    """
    notes = []
    latest = read_latest(ckpt_dir)
    if latest is not None:
        problem = problem_with(ckpt_dir / latest)
        if problem is None:
            _check_world_size(ckpt_dir / latest, world_size)
            return latest, notes
        notes.append(f"{LATEST} names {latest}, which is incomplete ({problem})")
    elif (ckpt_dir / LATEST).exists():
        notes.append(f"{LATEST} is empty")
    for step in reversed(checkpoint_steps(ckpt_dir)):
        tag = tag_for(step)
        problem = problem_with(ckpt_dir / tag)
        if problem is None:
            _check_world_size(ckpt_dir / tag, world_size)
            return tag, notes
        if tag != latest:
            notes.append(f"{tag} is incomplete ({problem})")
    return None, notes


def _check_world_size(tag_dir: Path, world_size: int) -> None:
    saved = json.loads((tag_dir / COMPLETE).read_text())["world_size"]
    if saved != world_size:
        raise ValueError(f"{tag_dir} was saved by {saved} ranks and this run has {world_size}: ZeRO-3 "
                         f"shards only load into the same world size; use a new out_dir or {saved} ranks")


def prune(ckpt_dir: Path, keep_last: int) -> list[int]:
    """After a commit: keep the newest keep_last complete checkpoints up to `latest`, drop the rest.

    Incomplete folders older than `latest` are leftovers of a killed save and go too; folders newer
    than `latest` are left alone (the run rewrites them when it gets there).
    """
    latest = read_latest(ckpt_dir)
    latest_step = step_of(latest) if latest else None
    if latest_step is None:
        return []
    upto = [s for s in checkpoint_steps(ckpt_dir) if s <= latest_step]
    complete = [s for s in upto if problem_with(ckpt_dir / tag_for(s)) is None]
    keep = set(complete[-keep_last:]) | {latest_step}
    removed = [s for s in upto if s not in keep]
    for step in removed:
        shutil.rmtree(ckpt_dir / tag_for(step))
    return removed
