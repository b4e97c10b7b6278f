"""The materialized demo pipeline that several slow tests share (fixture `demo_pipeline` in conftest.py).

`kiln demo` runs twice in a subprocess with its own state folder and a smaller config: the end-to-end
test checks both runs, the browser tests click through the result.
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from workflows.config import DEFAULT_CONFIG_PATH, REPO_ROOT

ASSETS = ["raw_crawl", "documents", "quality_classifier", "quality_signals", "filtered", "deduplicated",
          "tokenizer", "tokenized", "mixed_shards", "checkpoints", "eval_report"]
PARTITIONED = {"raw_crawl", "documents", "quality_signals", "filtered", "deduplicated", "tokenized"}
GROUPS = {"ingest", "curate", "tokenize", "mix", "train", "evaluate"}
SNAPSHOT = "sample"


# A demo run takes minutes; a hang fails its test with the output so far instead of using up CI's 90.
PIPELINE_TIMEOUT_S = 900


def run_pipeline(args: list[str], env: dict, log: Path) -> subprocess.CompletedProcess:
    """`python <args>` in the repository in its own process group, output kept in `log`. On a timeout
    the whole group (Spark, DeepSpeed ranks) is killed and the test fails with the output's tail."""
    with subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=PIPELINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            log.write_text(stdout + stderr)
            raise AssertionError(f"python {' '.join(args)} did not finish within {PIPELINE_TIMEOUT_S} s "
                                 f"(output in {log}); its last output:\n{(stdout + stderr)[-5000:]}") from None
    log.write_text(stdout + stderr)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def small_config() -> dict:
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["raw_crawl"]["snapshots"] = {SNAPSHOT: {"kind": "sample", "seed": 0, "pages": 200, "files": 2}}
    config["mix"]["total_tokens"] = 60_000
    config["training"].update(steps=40, checkpoint_every=20, warmup_steps=5)
    config["evaluation"]["max_sequences_per_bucket"] = 32
    return config


def data_versions(root: Path) -> dict[str, str]:
    return {
        asset: (root / asset / (SNAPSHOT if asset in PARTITIONED else "all") / "_LATEST").read_text().strip()
        for asset in ASSETS
    }


def materialize_demo(state: Path, runs: int = 2) -> dict:
    """`kiln demo` `runs` times into `state`; returns the state folder, storage root and each run's output."""
    config_path = state / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(small_config()))
    env = {**os.environ, "KILN_STATE_DIR": str(state), "KILN_CONFIG": str(config_path)}
    env.pop("DAGSTER_HOME", None)
    results = []
    for attempt in range(runs):
        result = run_pipeline(["-m", "workflows.cli", "demo"], env, state / f"demo-{attempt}.log")
        assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
        results.append({"stdout": result.stdout, "versions": data_versions(state / "storage")})
    return {"state": state, "root": state / "storage", "runs": results}
