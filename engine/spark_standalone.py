"""A Spark standalone cluster (one master, N workers) started from the pyspark wheel's `bin/spark-class`.

The wheel ships no `sbin/start-*.sh`, so the master and workers are started as plain processes.
Everything binds to one host (127.0.0.1 by default) on free ports. Used by the cluster test and
for trying `spark.master: spark://...` on one machine:

    python -m engine.spark_standalone --workers 2 --cores 1 --memory 1g

prints the master URL and runs until Ctrl-C. Point `spark.master` in the pipeline config at it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


@dataclass
class StandaloneCluster:
    """Start with `start()` (or as a context manager); `master_url` is what `spark.master` takes."""

    workers: int = 2
    cores: int = 1
    memory: str = "1g"
    host: str = "127.0.0.1"
    work_dir: Path | None = None
    start_timeout_s: float = 120.0
    master_url: str = ""
    webui_url: str = ""
    _procs: list[subprocess.Popen] = field(default_factory=list)

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        env = {
            **os.environ,
            "SPARK_HOME": str(spark_home()),
            "SPARK_LOCAL_IP": self.host,
            # Executors start the Python workers with the driver's PYSPARK_PYTHON (sent with each task);
            # this only covers what the worker itself might start.
            "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
        }
        log = open(self.work_dir / f"{name}.log", "wb")
        try:
            # Own process group: stop() ends the JVM and anything it spawned, and nothing else.
            proc = subprocess.Popen([str(spark_home() / "bin" / "spark-class"), *args], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()
        self._procs.append(proc)
        return proc

    def state(self) -> dict:
        """The master's own view (`/json/`): workers, cores, active and completed applications."""
        with urllib.request.urlopen(f"{self.webui_url}/json/", timeout=5) as response:
            return json.load(response)

    def start(self) -> "StandaloneCluster":
        if self.work_dir is None:
            self.work_dir = Path(tempfile.mkdtemp(prefix="kiln-spark-cluster-"))
        self.work_dir = Path(self.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:  # whatever fails on the way (a spawn, a timeout, Ctrl-C), nothing is left running
            self._start_master()
            for i in range(self.workers):
                worker_dir = self.work_dir / f"worker-{i}"
                worker_dir.mkdir(exist_ok=True)
                self._spawn(f"worker-{i}", ["org.apache.spark.deploy.worker.Worker", "--host", self.host,
                                            "--webui-port", str(free_port(self.host)), "--cores", str(self.cores),
                                            "--memory", self.memory, "--work-dir", str(worker_dir), self.master_url])
            self._wait_until(lambda state: len([w for w in state.get("workers", []) if w.get("state") == "ALIVE"])
                             >= self.workers, f"{self.workers} workers")
        except BaseException:
            self.stop()
            raise
        return self

    def _start_master(self) -> None:
        port, webui = free_port(self.host), free_port(self.host)
        self.webui_url = f"http://{self.host}:{webui}"
        self._spawn("master", ["org.apache.spark.deploy.master.Master", "--host", self.host, "--port", str(port),
                               "--webui-port", str(webui)])
        # The master's own URL: Spark moves to the next port if another process took this one meanwhile.
        self.master_url = self._wait_until(lambda state: state.get("url"), "the master")

    def _wait_until(self, ready, what: str):
        """Poll the master's state until `ready(state)` is truthy; fail fast if a process died."""
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            dead = [p.args[1] for p in self._procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"Spark process exited during start-up: {dead}; logs in {self.work_dir}")
            try:
                value = ready(self.state())
                if value:
                    return value
            except OSError:
                pass  # the master's web UI is not up yet
            if time.monotonic() > deadline:
                raise TimeoutError(f"Spark cluster: {what} not ready in {self.start_timeout_s}s; logs in {self.work_dir}")
            time.sleep(1)

    def stop(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()

    def __enter__(self) -> "StandaloneCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.spark_standalone", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cores", type=int, default=1, help="cores per worker")
    parser.add_argument("--memory", default="1g", help="memory per worker (executors take spark.executor.memory of it)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--work-dir", type=Path, default=None, help="logs and executor folders (default: a temp dir)")
    args = parser.parse_args(argv)
    cluster = StandaloneCluster(args.workers, args.cores, args.memory, args.host, args.work_dir).start()
    print(f"spark.master: {cluster.master_url}\nmaster UI:    {cluster.webui_url}\nlogs:         {cluster.work_dir}",
          flush=True)
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        signal.sigwait(stop_signals)
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
