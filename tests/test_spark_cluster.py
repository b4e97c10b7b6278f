"""The curate stages on a real Spark standalone cluster (one master, two 1-core workers on loopback)
give the same data versions and the same bytes as on local[2]. Only `spark.master` differs between
the two pipeline configs; each run is its own process with its own state folder.
"""
import hashlib
import os
import time
from pathlib import Path

import pytest
import yaml

from kiln_demo import run_pipeline
from engine.spark_standalone import StandaloneCluster
from workflows.config import DEFAULT_CONFIG_PATH

pytestmark = pytest.mark.slow
CURATE = ["raw_crawl", "documents", "quality_classifier", "quality_signals", "filtered", "deduplicated"]
PARTITIONED = {"raw_crawl", "documents", "quality_signals", "filtered", "deduplicated"}

MATERIALIZE_CURATE = """
import dagster as dg
from workflows.cli import DEMO_WAVES, ensure_dagster_home
from workflows.definitions import ALL_ASSETS, defs
from workflows.kiln import CONFIG, SNAPSHOTS

wanted = set(%r)
ensure_dagster_home()
instance = dg.DagsterInstance.get()
snapshots = sorted(CONFIG.raw_crawl.snapshots)
instance.add_dynamic_partitions(SNAPSHOTS.name, snapshots)
for names, partitioned in DEMO_WAVES:
    names = [n for n in names if n in wanted]
    for key in (snapshots if partitioned else [None]) if names else []:
        dg.materialize(ALL_ASSETS, selection=dg.AssetSelection.assets(*names), partition_key=key, instance=instance,
                       resources={"kiln": defs.resources["kiln"]}, raise_on_error=True)
        print("materialized", names, key, flush=True)
""" % CURATE


def config_for(master: str) -> dict:
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["raw_crawl"]["snapshots"] = {"sample": {"kind": "sample", "seed": 0, "pages": 100, "files": 2}}
    config["spark"]["master"] = master
    return config


def run_curate(state: Path, master: str) -> float:
    state.mkdir(parents=True)
    (state / "pipeline.yaml").write_text(yaml.safe_dump(config_for(master)))
    env = {**os.environ, "KILN_STATE_DIR": str(state), "KILN_CONFIG": str(state / "pipeline.yaml")}
    env.pop("DAGSTER_HOME", None)
    started = time.monotonic()
    result = run_pipeline(["-c", MATERIALIZE_CURATE], env, state / "materialize.log")
    wall = time.monotonic() - started
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return wall


def published(root: Path) -> dict[str, tuple[str, dict[str, str]]]:
    """Per asset: the `_LATEST` data version and the sha256 of every file in it but the manifest
    (which records timings and the config path, and so differs between any two runs)."""
    out = {}
    for asset in CURATE:
        folder = root / asset / ("sample" if asset in PARTITIONED else "all")
        version = (folder / "_LATEST").read_text().strip()
        files = {str(p.relative_to(folder / version)): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in sorted((folder / version).rglob("*")) if p.is_file() and p.name != "_MANIFEST.json"}
        out[asset] = (version, files)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("spark-cluster")
    walls = {"local": run_curate(base / "local", "local[2]")}
    with StandaloneCluster(workers=2, cores=1, memory="1g", work_dir=base / "cluster-work") as cluster:
        walls["cluster"] = run_curate(base / "cluster", cluster.master_url)
        state = cluster.state()
    print(f"\ncurate stages wall time: local[2] {walls['local']:.0f}s, standalone cluster {walls['cluster']:.0f}s")
    return {"base": base, "walls": walls, "master": state, "cluster_dir": base / "cluster-work"}


def test_cluster_gives_the_same_data_versions_and_bytes_as_local(runs):
    local = published(runs["base"] / "local" / "storage")
    cluster = published(runs["base"] / "cluster" / "storage")
    for asset in CURATE:
        assert local[asset][0] == cluster[asset][0], f"{asset}: data versions differ"
        assert local[asset][1] == cluster[asset][1], f"{asset}: output bytes differ"
        assert local[asset][1], f"{asset}: no output files"


def test_the_cluster_really_ran_the_stages(runs):
    master = runs["master"]
    assert len([w for w in master["workers"] if w["state"] == "ALIVE"]) == 2
    apps = [a for a in master["completedapps"] + master["activeapps"] if a["name"] == "kiln"]
    assert len(apps) == 1, master
    app_id = apps[0]["id"]
    # Each worker ran an executor of the app: Spark made a work folder for it there, with its log.
    for i in range(2):
        executors = list((runs["cluster_dir"] / f"worker-{i}" / app_id).iterdir())
        assert executors and (executors[0] / "stderr").stat().st_size > 0
    assert apps[0]["cores"] == 2 and apps[0]["duration"] > 0


def test_a_failed_start_leaves_no_process_running(tmp_path, monkeypatch):
    cluster = StandaloneCluster(workers=2, work_dir=tmp_path)
    spawn, spawned = cluster._spawn, []

    def worker_cannot_start(name, args):
        if name.startswith("worker"):
            raise OSError("no such executable")
        spawned.append(spawn(name, args))
        return spawned[-1]

    monkeypatch.setattr(cluster, "_spawn", worker_cannot_start)
    with pytest.raises(OSError, match="no such executable"):
        cluster.start()
    # The master had come up (its URL read back from it) and was stopped with its process group.
    assert cluster.master_url.startswith("spark://127.0.0.1:") and len(spawned) == 1
    assert spawned[0].poll() is not None
    assert f"Starting Spark master at {cluster.master_url}" in (tmp_path / "master.log").read_text()
