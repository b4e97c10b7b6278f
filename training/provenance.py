"""Which code produced an artifact. Plain Python, so the ranks and the Dagster assets share it."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


@functools.cache  # once per process: a checkout moved mid-run does not change the code already imported
def git_commit() -> str | None:
    """HEAD of the checkout Kiln runs from, or None outside a git checkout (or without git)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None
