"""Start a training run as an external `deepspeed` launcher process and wait for its result."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

from training.config import resolve_run_config

TRAIN_SCRIPT = Path(__file__).resolve().parent / "train.py"
REPO_ROOT = TRAIN_SCRIPT.parents[1]

# The child gets only these variables: what Python, torch/DeepSpeed and MLflow (auth, S3
# artifacts) need. Everything else in the parent's environment stays out.
_PASS_NAMES = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ", "TMPDIR", "VIRTUAL_ENV",
               "PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_VISIBLE_DEVICES", "XDG_CACHE_HOME",
               "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"}
_PASS_PREFIXES = ("DS_", "DEEPSPEED_", "TORCH_", "NCCL_", "CCL_", "OMP_", "MKL_", "KMP_", "MLFLOW_", "AWS_")
_SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|KEY|CREDENTIAL|AUTH", re.IGNORECASE)


class TrainingFailed(RuntimeError):
    pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _launcher() -> list[str]:
    script = Path(sys.executable).parent / "deepspeed"
    if script.exists():
        return [str(script)]
    # Same program as the console script, for environments installed without bin/ scripts.
    return [sys.executable, "-m", "deepspeed.launcher.runner"]


def build_command(config_path: str | Path, num_gpus: int = 2, num_nodes: int = 1,
                  hostfile: str | Path | None = None, master_port: int | None = None) -> list[str]:
    """The `deepspeed ... training/train.py --config run.json` command line.

    Without a hostfile the ranks rendezvous on 127.0.0.1; with one, DeepSpeed's runner reaches
    the nodes over ssh/pdsh and the first host is the master.
    """
    cmd = _launcher() + ["--num_gpus", str(num_gpus), "--num_nodes", str(num_nodes),
                         "--master_port", str(master_port or free_port())]
    if hostfile is not None:
        cmd += ["--hostfile", str(hostfile)]
    else:
        cmd += ["--master_addr", "127.0.0.1"]
    return cmd + [str(TRAIN_SCRIPT), "--config", str(Path(config_path).resolve())]


def child_environment(use_cpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in _PASS_NAMES or k.startswith(_PASS_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if use_cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _redactor(env: dict[str, str]) -> Callable[[str], str]:
    # DeepSpeed's multi-node runner echoes `export MLFLOW_...=value` lines; never pass secrets on.
    secrets = sorted((v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= 4), key=len, reverse=True)

    def redact(line: str) -> str:
        for secret in secrets:
            line = line.replace(secret, "***")
        return line

    return redact


def run(config: dict, out_dir: str | Path, log: Callable[[str], None] = print, *,
        num_gpus: int | None = None, num_nodes: int = 1, hostfile: str | Path | None = None,
        tail_lines: int = 60) -> dict:
    """Write out_dir/run.json, run the launcher, stream its output to `log`, return result.json.

    num_gpus defaults to the visible CUDA devices, or 2 CPU ranks without CUDA. Raises
    TrainingFailed with the last `tail_lines` lines of output when the launcher fails.
    """
    import torch

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    run_config = {**config, "out_dir": str(out_dir)}
    resolve_run_config(run_config)  # fail here, not in N ranks
    config_path = out_dir / "run.json"
    config_path.write_text(json.dumps(run_config, indent=2) + "\n")

    use_cpu = not torch.cuda.is_available()
    if num_gpus is None:
        num_gpus = 2 if use_cpu else torch.cuda.device_count()
    cmd = build_command(config_path, num_gpus=num_gpus, num_nodes=num_nodes, hostfile=hostfile)
    env = child_environment(use_cpu)
    redact = _redactor(env)
    tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
    # Own process group, so an interrupted run() can stop the launcher and its ranks together.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=env, cwd=out_dir, start_new_session=True)
    try:
        for raw in proc.stdout:
            line = redact(raw.rstrip("\n"))
            tail.append(line)
            log(line)
        returncode = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
    if returncode != 0:
        raise TrainingFailed(f"training exited with status {returncode}; last output:\n" + "\n".join(tail))
    result_path = out_dir / "result.json"
    if not result_path.exists():
        raise TrainingFailed(f"training exited 0 but wrote no {result_path}; last output:\n" + "\n".join(tail))
    return json.loads(result_path.read_text())
