"""Reliability under faults, local storage root: killed runs, concurrent publishers, stale staging.

The storage-level tests race real processes on `LocalStorage.publish`. The slow tests run real
Dagster materializations in subprocesses (own state folder, small sample crawl), SIGKILL one while
Spark is writing its staging folder, and re-run it. Fault tests of the S3 root are in
tests/test_storage_s3.py.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from workflows.config import DEFAULT_CONFIG_PATH, REPO_ROOT
from workflows.storage import LATEST, MANIFEST, SUCCESS, LocalStorage, StorageError, content_hash

SNAPSHOT = "sample"

# Materializes the given waves ([[asset names], partitioned?], ...) into the Dagster instance under
# KILN_STATE_DIR, as `kiln demo` does, one run per wave; prints one line per finished run.
MATERIALIZE = """
import json, sys
import dagster as dg
from workflows.cli import ensure_dagster_home
from workflows.definitions import ALL_ASSETS, defs
from workflows.kiln import CONFIG, SNAPSHOTS

ensure_dagster_home()
instance = dg.DagsterInstance.get()
snapshots = sorted(CONFIG.raw_crawl.snapshots)
instance.add_dynamic_partitions(SNAPSHOTS.name, snapshots)
for names, partitioned in json.loads(sys.argv[1]):
    for key in snapshots if partitioned else [None]:
        result = dg.materialize(ALL_ASSETS, selection=dg.AssetSelection.assets(*names), partition_key=key,
                                instance=instance, resources={"kiln": defs.resources["kiln"]}, raise_on_error=True)
        print("materialized", names, key, result.success, flush=True)
        for event in result.get_asset_materialization_events():
            print("data_version", event.asset_key.to_user_string(),
                  event.materialization.tags.get("dagster/data_version"), flush=True)
"""


def reported_versions(output: str, asset: str) -> list[str]:
    """The data versions a MATERIALIZE run reported to Dagster for `asset`."""
    return [line.split()[2] for line in output.splitlines() if line.startswith(f"data_version {asset} ")]

UPSTREAM_OF_TOKENIZED = [
    [["raw_crawl", "documents"], True],
    [["quality_classifier"], False],
    [["quality_signals", "filtered", "deduplicated"], True],
    [["tokenizer"], False],
    [["tokenized"], True],
]


# --- storage level: real processes racing on one partition -----------------------------------------

def _files_for(text: str) -> dict[str, bytes]:
    """Several files, one large enough that renaming and hashing take a measurable moment."""
    return {"data/part-00000.bin": text.encode() * 20_000, "data/part-00001.bin": text[::-1].encode(),
            "meta.json": json.dumps({"text": text}).encode()}


def _publisher(root: str, worker: int, rounds: int, same_content: bool, barrier, results) -> None:
    storage = LocalStorage(root)
    versions = []
    for round_ in range(rounds):
        text = f"round {round_}" + ("" if same_content else f" worker {worker}")
        staging = storage.new_staging_dir("a", "p")
        for rel, data in _files_for(text).items():
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            (staging / rel).write_bytes(data)
        barrier.wait(timeout=60)  # every worker hashes and publishes at the same moment
        versions.append(storage.publish(staging, "a", "p", {"worker": worker, "round": round_}).data_version)
    results.put((worker, versions))


def _reader(root: str, stop, results) -> None:
    """What a downstream stage does: resolve the latest artifact and read it, over and over."""
    storage, seen, bad = LocalStorage(root), 0, []
    while not stop.is_set():
        try:
            artifact = storage.latest("a", "p")
        except StorageError:
            continue  # nothing published yet
        try:
            manifest = artifact.manifest()
            if content_hash(artifact.path)[:16] != artifact.data_version or manifest["data_version"] != artifact.data_version:
                bad.append(artifact.data_version)
            seen += 1
        except (OSError, ValueError) as error:  # vanished or half-written while being read
            bad.append(f"{artifact.data_version}: {error!r}")
    results.put(("reader", seen, bad))


def check_partition(folder: Path) -> set[str]:
    """Every version folder is complete and matches its hash; no staging or owner locks are left."""
    complete = set()
    for path in folder.iterdir():
        if path.name.startswith("."):
            assert path.name == ".publish.lock", f"leftover {path.name}"
            continue
        if path.name == LATEST:
            continue
        assert (path / SUCCESS).is_file(), f"{path} has no {SUCCESS}"
        manifest = json.loads((path / MANIFEST).read_text())
        assert manifest["data_version"] == path.name == content_hash(path)[:16]
        complete.add(path.name)
    assert (folder / LATEST).read_text().strip() in complete
    return complete


@pytest.mark.parametrize("same_content", [True, False], ids=["same-content", "different-content"])
def test_concurrent_publishers_never_corrupt_a_partition(tmp_path, same_content):
    workers, rounds = 4, 25
    ctx = multiprocessing.get_context("spawn")
    barrier, results, stop = ctx.Barrier(workers), ctx.Queue(), ctx.Event()
    reader = ctx.Process(target=_reader, args=(str(tmp_path), stop, results))
    procs = [ctx.Process(target=_publisher, args=(str(tmp_path), w, rounds, same_content, barrier, results))
             for w in range(workers)]
    reader.start()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    stop.set()
    reader.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0] * workers, "a publisher failed (see its traceback above)"
    outcome = [results.get(timeout=10) for _ in range(workers + 1)]
    (_, reads, bad), = [r for r in outcome if r[0] == "reader"]
    published = dict(r for r in outcome if r[0] != "reader")
    assert not bad and reads > 0, f"the reader saw incomplete or changing artifacts: {bad[:5]}"

    complete = check_partition(tmp_path / "a" / "p")
    storage = LocalStorage(tmp_path)
    for worker, versions in published.items():
        assert len(versions) == rounds and set(versions) <= complete
        for round_, version in enumerate(versions):
            assert storage.artifact("a", "p", version).manifest()["round"] == round_
    if same_content:  # everyone wrote the same bytes: one folder per round, whoever won
        assert all(versions == published[0] for versions in published.values())
        assert len(complete) == rounds
    else:
        assert len(complete) == rounds * workers


def _stage_and_wait(root: str, signals: str) -> None:
    """Open a staging folder, say where, and keep writing it until told to stop. Files, not
    multiprocessing queues or events, carry the signals: a SIGKILLed process can leave those locked."""
    staging = LocalStorage(root).new_staging_dir("a", "p")
    (staging / "partial.bin").write_bytes(b"x" * 1000)
    Path(signals, f"{os.getpid()}.staging").write_text(str(staging))
    deadline = time.time() + 120
    while not Path(signals, "release").exists() and time.time() < deadline:
        time.sleep(0.05)


def _start_stager(ctx, root: Path, signals: Path):
    proc = ctx.Process(target=_stage_and_wait, args=(str(root), str(signals)))
    proc.start()
    report = signals / f"{proc.pid}.staging"
    deadline = time.time() + 60
    while not report.exists():
        assert proc.is_alive() and time.time() < deadline, "the staging process did not start"
        time.sleep(0.05)
    return proc, Path(report.read_text())


def test_stale_staging_of_a_dead_writer_is_removed_and_a_live_one_is_kept(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    root, signals = tmp_path / "root", tmp_path / "signals"
    signals.mkdir()
    dead, dead_staging = _start_stager(ctx, root, signals)
    live, live_staging = _start_stager(ctx, root, signals)
    os.kill(dead.pid, signal.SIGKILL)  # as a killed run: no cleanup code runs
    dead.join(timeout=30)
    legacy = root / "a" / "p" / ".staging-from-an-older-kiln"  # no owner lock file: never touched
    legacy.mkdir()
    try:
        storage = LocalStorage(root)
        with pytest.raises(StorageError):  # leftovers are never resolved as artifacts
            storage.latest("a", "p")
        assert storage.complete_versions("a", "p") == {}
        assert dead_staging.exists() and live_staging.exists()

        staging = storage.new_staging_dir("a", "p")  # the next run of the partition collects the dead one
        assert not dead_staging.exists() and not Path(f"{dead_staging}.lock").exists()
        assert live.is_alive() and (live_staging / "partial.bin").exists() and legacy.exists()
        (staging / "x.txt").write_text("done")
        artifact = storage.publish(staging, "a", "p", {})
        assert storage.latest("a", "p") == artifact and not Path(f"{staging}.lock").exists()
        assert storage.remove_dead_staging("a", "p") == []  # the live writer is still there
    finally:
        (signals / "release").write_text("")
        live.join(timeout=30)
    assert live.exitcode == 0
    assert storage.remove_dead_staging("a", "p") == [live_staging]  # its process has exited since
    assert sorted(p.name for p in (root / "a" / "p").iterdir()) == sorted(
        [".publish.lock", legacy.name, LATEST, artifact.data_version])


def test_a_folder_left_between_rename_and_success_is_replaced(tmp_path):
    storage = LocalStorage(tmp_path)
    staging = storage.new_staging_dir("a", "p")
    (staging / "x.txt").write_text("hello")
    version = content_hash(staging)[:16]
    half = tmp_path / "a" / "p" / version  # what a publisher killed before writing _SUCCESS leaves
    half.mkdir()
    (half / "x.txt").write_text("hel")
    with pytest.raises(StorageError):
        storage.artifact("a", "p", version)
    artifact = storage.publish(staging, "a", "p", {})
    assert artifact.data_version == version and (half / "x.txt").read_text() == "hello"
    check_partition(tmp_path / "a" / "p")


# --- real materializations, killed and raced -------------------------------------------------------

@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """A small sample crawl (80 pages) materialized up to `tokenized`, uninterrupted: the reference."""
    state = tmp_path_factory.mktemp("faults-state")
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["raw_crawl"]["snapshots"] = {SNAPSHOT: {"kind": "sample", "seed": 0, "pages": 80, "files": 2}}
    config["tokenizer"]["vocab_size"] = 1024
    (state / "pipeline.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "KILN_STATE_DIR": str(state), "KILN_CONFIG": str(state / "pipeline.yaml")}
    env.pop("DAGSTER_HOME", None)
    result = _materialize(env, UPSTREAM_OF_TOKENIZED, state / "upstream.log")
    assert result.returncode == 0, result.stdout[-5000:]
    storage = LocalStorage(state / "storage")
    reference = {asset: storage.latest(asset, SNAPSHOT).data_version for asset in ("documents", "tokenized")}
    assert [reported_versions(result.stdout, a) for a in reference] == [[v] for v in reference.values()]
    return {"state": state, "env": env, "storage": storage, "reference": reference}


def _materialize(env, waves, log: Path) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", MATERIALIZE, json.dumps(waves)], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    log.write_text(result.stdout)
    return result


def _set_aside(upstream, asset: str) -> Path:
    """Move the reference output of `asset[sample]` out of the storage root, as if never run."""
    part = upstream["storage"].partition_dir(asset, SNAPSHOT)
    aside = upstream["state"] / "aside" / f"{asset}-{time.time_ns()}"
    aside.parent.mkdir(exist_ok=True)
    part.rename(aside)
    return aside


def _staged_files(part: Path) -> list[str]:
    if not part.is_dir():
        return []
    return [str(f.relative_to(part)) for s in part.glob(".staging-*") if s.is_dir()
            for f in s.rglob("*") if f.is_file()]


def _kill_while_writing(upstream, asset: str) -> list[str]:
    """Run `asset[sample]` and SIGKILL its whole process group (Dagster, the Spark JVM, Python
    workers) as soon as its staging folder holds a file; returns what was staged at that moment."""
    part = upstream["storage"].partition_dir(asset, SNAPSHOT)
    log = open(upstream["state"] / f"killed-{asset}.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", MATERIALIZE, json.dumps([[[asset], True]])], cwd=REPO_ROOT,
                            env=upstream["env"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 600
        while not (staged := _staged_files(part)):
            assert proc.poll() is None, f"the run of {asset} ended (rc {proc.returncode}) before anything was staged: " \
                                        "the kill came too late, nothing was tested"
            assert time.time() < deadline, f"{asset} staged nothing within 600 s"
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        log.close()
    assert proc.returncode == -signal.SIGKILL, "the run finished before the kill: it came too late"
    _wait_group_gone(proc.pid)
    return staged


def _wait_group_gone(pgid: int, timeout: float = 30) -> None:
    """Let the kernel finish tearing down the killed group, so nothing writes after we look."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)


def _assert_nothing_visible(storage: LocalStorage, asset: str) -> None:
    part = storage.partition_dir(asset, SNAPSHOT)
    assert not (part / LATEST).exists(), "a killed run left a _LATEST pointer"
    assert storage.complete_versions(asset, SNAPSHOT) == {}, "the killed run published: the kill came too late"
    with pytest.raises(StorageError):  # what every downstream stage calls to find its input
        storage.latest(asset, SNAPSHOT)
    visible = [p.name for p in part.iterdir() if not p.name.startswith(".")]
    assert visible == [], f"non-staging entries after the kill: {visible}"


def _assert_rerun_matches(upstream, asset: str, aside: Path) -> None:
    storage = upstream["storage"]
    result = _materialize(upstream["env"], [[[asset], True]], upstream["state"] / f"rerun-{asset}.log")
    assert result.returncode == 0, result.stdout[-5000:]
    artifact = storage.latest(asset, SNAPSHOT)
    assert artifact.data_version == upstream["reference"][asset]
    assert reported_versions(result.stdout, asset) == [artifact.data_version]  # what Dagster recorded
    reference = aside / artifact.data_version
    files = sorted(str(p.relative_to(artifact.path)) for p in artifact.path.rglob("*") if p.is_file())
    assert files == sorted(str(p.relative_to(reference)) for p in reference.rglob("*") if p.is_file())
    # The re-run collected the killed run's staging folder (its owner lock died with it).
    assert _staged_files(storage.partition_dir(asset, SNAPSHOT)) == []
    assert check_partition(storage.partition_dir(asset, SNAPSHOT)) == {artifact.data_version}


@pytest.mark.slow
@pytest.mark.parametrize("asset", ["documents", "tokenized"])
def test_killed_materialization_leaves_nothing_visible_and_rerun_matches(upstream, asset):
    aside = _set_aside(upstream, asset)
    staged = _kill_while_writing(upstream, asset)
    print(f"{asset}: killed with {len(staged)} staged file(s): {staged[:5]}")
    _assert_nothing_visible(upstream["storage"], asset)
    assert _staged_files(upstream["storage"].partition_dir(asset, SNAPSHOT)), "the partial output vanished"
    _assert_rerun_matches(upstream, asset, aside)


@pytest.mark.slow
def test_two_concurrent_materializations_of_one_partition(upstream):
    storage = upstream["storage"]
    _set_aside(upstream, "documents")
    logs = [open(upstream["state"] / f"concurrent-{i}.log", "w") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", MATERIALIZE, json.dumps([[["documents"], True]])], cwd=REPO_ROOT,
                              env=upstream["env"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
             for log in logs]
    part = storage.partition_dir("documents", SNAPSHOT)
    most_writing = 0  # the most staging folders seen at once: 2 shows that the runs really overlapped
    try:
        deadline = time.time() + 600
        while any(proc.poll() is None for proc in procs) and time.time() < deadline:
            writing = [s for s in part.glob(".staging-*") if s.is_dir()] if part.is_dir() else []
            most_writing = max(most_writing, len(writing))
            time.sleep(0.02)
        codes = [proc.wait(timeout=60) for proc in procs]
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    outputs = [(upstream["state"] / f"concurrent-{i}.log").read_text() for i in range(2)]
    assert 0 in codes, "neither concurrent run succeeded:\n" + "\n".join(o[-3000:] for o in outputs)
    for code, output in zip(codes, outputs):  # a loser must fail as a plain error, not be killed or hang
        assert code == 0 or (code == 1 and "Traceback" in output), output[-3000:]
    print("concurrent exit codes:", codes, "staging folders at once:", most_writing)
    assert most_writing == 2, "the two runs never wrote at the same time: nothing concurrent was tested"
    for code, output in zip(codes, outputs):  # every winner reported the same bytes to Dagster
        assert code != 0 or reported_versions(output, "documents") == [upstream["reference"]["documents"]]
    artifact = storage.latest("documents", SNAPSHOT)
    assert artifact.data_version == upstream["reference"]["documents"]
    assert artifact.manifest()["data_version"] == artifact.data_version == content_hash(artifact.path)[:16]
    assert check_partition(storage.partition_dir("documents", SNAPSHOT)) == {artifact.data_version}
