"""Start a training run as an external `deepspeed` launcher process and wait for its result.

    python -m training.launch run.json                 # run it (resumes if out_dir has checkpoints)
    python -m training.launch --dry-run run.json       # print the exact launcher command, run nothing
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable

from training.config import resolve_model_config, resolve_run_config

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


def read_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} from a DeepSpeed hostfile (`<host> slots=<n>` per line, # comments)."""
    path = Path(path)
    if not path.is_file():
        # DeepSpeed's runner would warn and silently train on this machine alone; Kiln refuses.
        raise FileNotFoundError(f"hostfile {path} does not exist")
    hosts: dict[str, int] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots=(\d+)", line)
        if not match or match.group(1) in hosts:
            raise ValueError(f"{path}:{number}: expected '<host> slots=<n>' once per host, got {raw!r}")
        hosts[match.group(1)] = int(match.group(2))
    if not hosts:
        raise ValueError(f"hostfile {path} lists no hosts")
    return hosts


CPU_RANKS = 2  # without a GPU: the smallest world in which ZeRO-3 really partitions


def visible_gpus(env: dict[str, str]) -> list[str] | None:
    """The device ids CUDA_VISIBLE_DEVICES lists, or None when it is not set."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def placement(num_gpus: int | None, num_nodes: int, hostfile: str | Path | None,
              local_devices: int = CPU_RANKS) -> dict[str, int]:
    """{host: ranks} the launcher will start: the first num_nodes hosts, num_gpus ranks on each
    (None: every slot of each host, or `local_devices` on this machine)."""
    if hostfile is None:
        if num_nodes != 1:
            raise ValueError(f"num_nodes={num_nodes} needs a hostfile naming the nodes")
        return {"localhost": local_devices if num_gpus is None else num_gpus}
    hosts = read_hostfile(hostfile)
    if len(hosts) < num_nodes:
        raise ValueError(f"num_nodes={num_nodes} but {hostfile} lists {len(hosts)} hosts")
    chosen = dict(list(hosts.items())[:num_nodes])
    if num_gpus is None:
        return chosen
    short = [f"{host} (slots={slots})" for host, slots in chosen.items() if slots < num_gpus]
    if short:
        raise ValueError(f"num_gpus={num_gpus} ranks per node, but {', '.join(short)} has fewer slots")
    return {host: num_gpus for host in chosen}


def resource_args(num_gpus: int | None, num_nodes: int, hostfile: str | Path | None, use_cpu: bool,
                  visible: list[str] | None) -> list[str]:
    """The launcher's rank-selection flags.

    DeepSpeed's runner honours CUDA_VISIBLE_DEVICES only when none of --num_gpus, --num_nodes,
    --include, --exclude is given (it then turns it into --include); with --num_gpus it takes
    GPUs 0..N-1 whatever CUDA_VISIBLE_DEVICES says, and --num_nodes beside an --include is an
    error. So on one GPU host: nothing for "every visible GPU", --include with the first N
    visible ids for an explicit count, --num_gpus only when CUDA_VISIBLE_DEVICES is unset. CPU
    ranks are processes, not devices: always --num_gpus.
    """
    if hostfile is not None:
        return (["--num_gpus", str(num_gpus)] if num_gpus is not None else []) + \
            ["--num_nodes", str(num_nodes), "--hostfile", str(hostfile)]
    if use_cpu:
        return ["--num_gpus", str(num_gpus or CPU_RANKS)]
    if num_gpus is None:
        return []
    if visible is None:
        return ["--num_gpus", str(num_gpus)]
    if num_gpus > len(visible):
        raise ValueError(f"num_gpus={num_gpus} but CUDA_VISIBLE_DEVICES lists {len(visible)} GPUs ({','.join(visible)})")
    return ["--include", f"localhost:{','.join(visible[:num_gpus])}"]


def build_command(config_path: str | Path, num_gpus: int | None = None, num_nodes: int = 1,
                  hostfile: str | Path | None = None, master_port: int | None = None, *,
                  use_cpu: bool | None = None, env: dict[str, str] | None = None) -> list[str]:
    """The `deepspeed ... training/train.py --config run.json` command line (see resource_args).

    use_cpu defaults to "no CUDA here"; env (default: this process's) is the launcher's
    environment, whose CUDA_VISIBLE_DEVICES decides the GPUs. Without a hostfile the ranks
    rendezvous on 127.0.0.1; with one, DeepSpeed's runner reaches the nodes over ssh/pdsh and the
    first host is the master.
    """
    if use_cpu is None:
        import torch

        use_cpu = not torch.cuda.is_available()
    visible = visible_gpus(os.environ if env is None else env)
    cmd = _launcher() + resource_args(num_gpus, num_nodes, hostfile, use_cpu, visible)
    cmd += ["--master_port", str(master_port or free_port())]
    if hostfile is None:
        cmd += ["--master_addr", "127.0.0.1"]
    return cmd + [str(TRAIN_SCRIPT), "--config", str(Path(config_path).resolve())]


def child_environment(use_cpu: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in _PASS_NAMES or k.startswith(_PASS_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if use_cpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def shell_line(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    """The command as one copy-pasteable shell line, with the variables Kiln sets for it."""
    # CUDA_VISIBLE_DEVICES too: it decides which GPUs a command without --num_gpus uses.
    kiln_set = {k: env[k] for k in ("DS_ACCELERATOR", "CUDA_VISIBLE_DEVICES", "PYTHONPATH", "PYTHONUNBUFFERED")
                if k in env}
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in kiln_set.items())
    return f"cd {shlex.quote(str(cwd))} && {assignments} {shlex.join(cmd)}"


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
        dry_run: bool = False, extra_env: dict[str, str] | None = None, tail_lines: int = 60) -> dict:
    """Write out_dir/run.json, run the launcher, stream its output to `log`, return result.json.

    num_gpus (ranks per node) defaults to every visible GPU (CUDA_VISIBLE_DEVICES honoured), or 2
    CPU ranks without CUDA, or each hostfile host's slots. dry_run writes
    run.json, logs the exact command and returns {"dry_run": True, "command", "shell", "placement"}
    without starting anything. extra_env is added to the child's environment (Dagster Pipes puts
    its bootstrap variables there). Raises TrainingFailed with the last `tail_lines` lines of
    output when the launcher fails.
    """
    import torch

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    run_config = {**config, "out_dir": str(out_dir)}
    # Fail here, not in N ranks: the run config and the model it builds (e.g. heads that do not divide).
    resolve_model_config(resolve_run_config(run_config))
    config_path = out_dir / "run.json"
    config_path.write_text(json.dumps(run_config, indent=2) + "\n")

    use_cpu = not torch.cuda.is_available()
    env = {**child_environment(use_cpu), **(extra_env or {})}
    # torch.cuda.device_count() already counts only the devices CUDA_VISIBLE_DEVICES lists.
    ranks = placement(num_gpus, num_nodes, hostfile, local_devices=CPU_RANKS if use_cpu else torch.cuda.device_count())
    cmd = build_command(config_path, num_gpus=num_gpus, num_nodes=num_nodes, hostfile=hostfile, use_cpu=use_cpu,
                        env=env)
    if dry_run:
        line = shell_line(cmd, out_dir, env)
        log(f"[kiln] dry run: {sum(ranks.values())} ranks on {', '.join(f'{h}:{n}' for h, n in ranks.items())}")
        log(line)
        return {"dry_run": True, "command": cmd, "shell": line, "placement": ranks}

    # Multi-node: DeepSpeed's pdsh runner forwards only some variables to the other nodes, plus
    # those in `.deepspeed_env` of its working folder; the Pipes bootstrap must reach rank 0.
    env_file = out_dir / ".deepspeed_env"
    if hostfile is not None and extra_env:
        env_file.write_text("".join(f"{k}={v}\n" for k, v in extra_env.items()))
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
        proc.stdout.close()
        env_file.unlink(missing_ok=True)
    if returncode != 0:
        raise TrainingFailed(f"training exited with status {returncode}; last output:\n" + "\n".join(tail))
    result_path = out_dir / "result.json"
    if not result_path.exists():
        raise TrainingFailed(f"training exited 0 but wrote no {result_path}; last output:\n" + "\n".join(tail))
    return json.loads(result_path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Launch (or show) a Kiln DeepSpeed ZeRO-3 run")
    parser.add_argument("config", help="run.json; its out_dir is where the run works")
    parser.add_argument("--dry-run", action="store_true", help="print the launcher command, run nothing")
    parser.add_argument("--num-gpus", type=int, default=None,
                        help="ranks per node (default: every visible GPU, 2 CPU ranks without one, "
                             "or each hostfile host's slots)")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--hostfile", default=None, help="DeepSpeed hostfile for multi-node runs")
    args = parser.parse_args(argv)
    config = json.loads(Path(args.config).read_text())
    if not config.get("out_dir"):
        parser.error(f"{args.config} has no out_dir")
    try:
        result = run(config, config["out_dir"], num_gpus=args.num_gpus, num_nodes=args.num_nodes,
                     hostfile=args.hostfile, dry_run=args.dry_run)
    except TrainingFailed as failure:
        print(failure, file=sys.stderr)
        return 1
    if not args.dry_run:
        print(json.dumps({k: result[k] for k in ("steps", "tokens", "final_loss", "wall_s", "export_dir")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
