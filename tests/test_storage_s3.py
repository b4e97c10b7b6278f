"""The s3:// storage root against moto's S3 server on 127.0.0.1, and a faulty proxy in front of it.

Credentials are fake, distinctive values set in the environment only; several tests check that
they end up in no manifest, no Dagster metadata and no log output.
"""
import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from conftest import moto_s3
from kiln_demo import run_pipeline
from workflows.config import DEFAULT_CONFIG_PATH, REPO_ROOT, ConfigError, parse_config
from workflows.s3_storage import S3Storage
from workflows.storage import LATEST, MANIFEST, SUCCESS, LocalStorage, StorageError, open_storage

ACCESS_KEY = "AKIAKILNTESTS3ACCESS"
SECRET = "kiln-s3-secret-6f1d0c9e-do-not-log"
TOKEN = "kiln-s3-session-token-2b7e41-do-not-log"
BUCKET = "kiln-store"


@pytest.fixture(scope="module")
def moto():
    with moto_s3(ACCESS_KEY, SECRET, TOKEN) as (endpoint, admin):
        admin.create_bucket(Bucket=BUCKET)
        yield {"endpoint": endpoint, "admin": admin}


def keys(admin, prefix: str) -> dict[str, int]:
    found = {}
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        found.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return found


def body(admin, key: str) -> bytes:
    return admin.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def s3_storage(endpoint: str, local: Path, root: str | None = None, **kwargs) -> S3Storage:
    return S3Storage(root or f"s3://{BUCKET}/t-{uuid.uuid4().hex[:8]}", local, endpoint_url=endpoint, **kwargs)


FILES = {
    "data/part-00000.parquet": b"P" * 3000,
    "data/part-00001.parquet": b"Q" * 5000,
    "data/.part-00000.parquet.crc": b"crc",
    "index.json": b'{"rows": 2}',
    "nested/deeper/x.bin": bytes(range(256)) * 8,
}


def stage(storage, files=FILES, asset="a", partition="p") -> Path:
    staging = storage.new_staging_dir(asset, partition)
    for rel, data in files.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(data)
    return staging


def test_publish_then_latest_round_trip(moto, tmp_path):
    storage = s3_storage(moto["endpoint"], tmp_path / "writer")
    artifact = storage.publish(stage(storage), "a", "p", {"counts": {"n": 2}})
    base = f"{storage.prefix}a/p/{artifact.data_version}/"
    stored = keys(moto["admin"], base)
    assert stored == {**{base + rel: len(data) for rel, data in FILES.items()},
                      base + MANIFEST: stored[base + MANIFEST], base + SUCCESS: 0}
    assert body(moto["admin"], f"{storage.prefix}a/p/{LATEST}").decode() == artifact.data_version
    assert artifact.uri == f"s3://{BUCKET}/{base.rstrip('/')}"
    manifest = json.loads(body(moto["admin"], base + MANIFEST))
    assert manifest["data_version"] == artifact.data_version and manifest["counts"] == {"n": 2}
    assert manifest["files"] == {rel: len(data) for rel, data in FILES.items()}

    # Another machine (empty local folder) reads it back through a local read-only copy.
    reader = s3_storage(moto["endpoint"], tmp_path / "reader", root=storage.root)
    latest = reader.latest("a", "p")
    assert latest.data_version == artifact.data_version and latest.manifest() == manifest
    assert latest.path.is_relative_to(tmp_path / "reader") and (latest.path / SUCCESS).is_file()
    for rel, data in FILES.items():
        assert (latest.path / rel).read_bytes() == data
        assert not (latest.path / rel).stat().st_mode & 0o222  # read-only copy
    assert not list(latest.path.parent.glob(".download-*"))
    assert reader.complete_versions("a", "p").keys() == {artifact.data_version}
    with pytest.raises(StorageError, match="has not been materialized"):
        reader.latest("a", "other")


def test_same_data_version_as_a_local_root(moto, tmp_path):
    local = LocalStorage(tmp_path / "local")
    s3 = s3_storage(moto["endpoint"], tmp_path / "s3")
    assert (s3.publish(stage(s3, partition=None), "a", None, {}).data_version
            == local.publish(stage(local, partition=None), "a", None, {}).data_version)
    only = ["nested/*"]
    assert (s3.publish(stage(s3, asset="b"), "b", "p", {}, version_files=only).data_version
            == local.publish(stage(local, asset="b"), "b", "p", {}, version_files=only).data_version)


def test_open_storage_and_config_pick_the_s3_root(moto, tmp_path):
    storage = open_storage(f"s3://{BUCKET}/cfg", endpoint_url=moto["endpoint"], local_dir=tmp_path)
    assert isinstance(storage, S3Storage) and storage.prefix == "cfg/"
    assert storage.client.meta.config.retries == {"mode": "standard", "total_max_attempts": 5}
    config = parse_config({"storage": {"root": f"s3://{BUCKET}/x/y", "endpoint_url": moto["endpoint"]}})
    assert config.storage.root == f"s3://{BUCKET}/x/y"
    for bad, why in [("s3://Bad_Bucket/x", "valid bucket name"), ("s3://key:secret@bucket/x", "credentials"),
                     ("gs://bucket/x", "unsupported scheme"), ("  ", "not empty")]:
        with pytest.raises(ConfigError, match=f"storage.root: .*{why}"):
            parse_config({"storage": {"root": bad}})


def test_success_comes_last_and_only_over_every_object(moto, tmp_path):
    storage = s3_storage(moto["endpoint"], tmp_path)
    order, at_success = [], {}

    def record(params, **_):
        order.append(params["Key"])
        if params["Key"].endswith("/" + SUCCESS):  # what a reader could see right before _SUCCESS lands
            at_success.update(keys(moto["admin"], params["Key"].rsplit("/", 1)[0] + "/"))

    for op in ("PutObject", "CreateMultipartUpload"):
        storage.client.meta.events.register(f"before-parameter-build.s3.{op}", record)
    artifact = storage.publish(stage(storage), "a", "p", {})
    base = f"{storage.prefix}a/p/{artifact.data_version}/"
    assert order[-3:] == [base + MANIFEST, base + SUCCESS, f"{storage.prefix}a/p/{LATEST}"]
    assert sorted(order[:-3]) == sorted(base + rel for rel in FILES)
    assert set(at_success) == {base + rel for rel in FILES} | {base + MANIFEST}


def test_rerun_with_identical_content_keeps_the_original(moto, tmp_path):
    storage = s3_storage(moto["endpoint"], tmp_path)
    first = storage.publish(stage(storage, {**FILES, "log.txt": b"run 1"}), "a", "p", {"run": 1}, version_files=["data/*"])
    base = f"{storage.prefix}a/p/{first.data_version}/"
    success_at = moto["admin"].head_object(Bucket=BUCKET, Key=base + SUCCESS)["LastModified"]
    puts = []
    storage.client.meta.events.register("before-parameter-build.s3.PutObject", lambda params, **_: puts.append(params["Key"]))
    time.sleep(1.1)  # LastModified has one-second resolution
    staging = stage(storage, {**FILES, "log.txt": b"run 2, other timings"})
    second = storage.publish(staging, "a", "p", {"run": 2}, version_files=["data/*"])
    assert second.data_version == first.data_version and not staging.exists()
    assert puts == [f"{storage.prefix}a/p/{LATEST}"]  # nothing re-uploaded
    assert body(moto["admin"], base + "log.txt") == b"run 1"
    assert json.loads(body(moto["admin"], base + MANIFEST))["run"] == 1
    assert moto["admin"].head_object(Bucket=BUCKET, Key=base + SUCCESS)["LastModified"] == success_at


def test_a_racing_publisher_of_the_same_version_never_unmarks_it(moto, tmp_path):
    """B checked for _SUCCESS just before A wrote it, so B uploads the same version again: the
    version stays marked complete at every request B makes, and nothing of A's is deleted."""
    root = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:8]}"
    a = s3_storage(moto["endpoint"], tmp_path / "a", root=root)
    b = s3_storage(moto["endpoint"], tmp_path / "b", root=root)
    first = a.publish(stage(a), "a", "p", {"by": "a"})
    base = f"{a.prefix}a/p/{first.data_version}/"
    b._exists = lambda key: False  # B's check ran before A's _SUCCESS existed
    seen = []

    def still_complete(params, **_):
        seen.append((params["Key"], base + SUCCESS in keys(moto["admin"], base + SUCCESS)))

    for event in ("PutObject", "DeleteObject", "CompleteMultipartUpload"):
        b.client.meta.events.register(f"before-parameter-build.s3.{event}", still_complete)
    second = b.publish(stage(b), "a", "p", {"by": "b"})
    assert second.data_version == first.data_version
    assert seen and all(ok for _, ok in seen), [k for k, ok in seen if not ok]
    assert set(keys(moto["admin"], base)) == {base + rel for rel in FILES} | {base + MANIFEST, base + SUCCESS}
    assert {p.relative_to(second.path).as_posix(): p.read_bytes() for p in second.path.rglob("*")
            if p.is_file() and p.name not in (MANIFEST, SUCCESS)} == FILES


def test_a_publisher_that_loses_the_race_after_uploading_keeps_the_winners_manifest_and_files(moto, tmp_path):
    """B's first check ran before A's _SUCCESS existed; by the time B's uploads are done A has
    completed the version: B deletes nothing of A's, rewrites no marker, and returns A's version."""
    root = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:8]}"
    a = s3_storage(moto["endpoint"], tmp_path / "a", root=root)
    b = s3_storage(moto["endpoint"], tmp_path / "b", root=root)
    first = a.publish(stage(a, {**FILES, "log-a.txt": b"timings of run a"}), "a", "p", {"by": "a"},
                      version_files=["data/*"])
    base = f"{a.prefix}a/p/{first.data_version}/"
    real_exists, checks = b._exists, []

    def first_check_misses(key: str) -> bool:
        checks.append(key)
        return False if len(checks) == 1 else real_exists(key)

    b._exists = first_check_misses
    puts, deletes = [], []
    b.client.meta.events.register("before-parameter-build.s3.PutObject", lambda params, **_: puts.append(params["Key"]))
    b.client.meta.events.register("before-parameter-build.s3.DeleteObject", lambda params, **_: deletes.append(params["Key"]))
    second = b.publish(stage(b, {**FILES, "log-b.txt": b"b"}), "a", "p", {"by": "b"}, version_files=["data/*"])
    assert second.data_version == first.data_version and checks[:2] == [base + SUCCESS] * 2
    assert deletes == [] and base + MANIFEST not in puts and base + SUCCESS not in puts
    assert json.loads(body(moto["admin"], base + MANIFEST))["by"] == "a"
    assert body(moto["admin"], base + "log-a.txt") == b"timings of run a"


def test_a_failed_latest_pointer_says_the_version_is_complete(moto, tmp_path):
    storage = s3_storage(moto["endpoint"], tmp_path)

    def refuse_latest(params, **_):
        if params["Key"].endswith(LATEST):
            raise ConnectionError("dropped")

    storage.client.meta.events.register("before-parameter-build.s3.PutObject", refuse_latest)
    with pytest.raises(StorageError, match=r"published and complete .*_LATEST pointer could not be settled"):
        storage.publish(stage(storage), "a", "p", {})
    staged_version = next(iter(storage.complete_versions("a", "p")))
    assert storage.artifact("a", "p", staged_version).path.is_dir()


def test_a_version_that_fails_a_blocking_check_is_complete_but_never_latest(moto, tmp_path):
    storage = s3_storage(moto["endpoint"], tmp_path)
    good = storage.publish(stage(storage, {"data/x": b"good"}), "a", "p", {}, checks={"band": True})
    failed = storage.publish(stage(storage, {"data/x": b"failed a blocking check"}), "a", "p", {},
                             checks={"band": False}, failed_blocking=["band"])
    assert storage.latest("a", "p").data_version == good.data_version != failed.data_version
    assert storage.artifact("a", "p", failed.data_version).path.is_dir()
    assert storage.failed_checks("a", "p", failed.data_version) == ["band"]
    # The same bytes as the latest now fail a tightened check: the pointer comes off them.
    storage.publish(stage(storage, {"data/x": b"good"}), "a", "p", {}, checks={"band": False}, failed_blocking=["band"])
    with pytest.raises(StorageError, match="has no version that passed its blocking checks"):
        storage.latest("a", "p")


KILLED_PUBLISH = """
import os, signal, sys
from pathlib import Path
from workflows.s3_storage import S3Storage
storage = S3Storage(sys.argv[1], Path(sys.argv[2]), endpoint_url=sys.argv[3], upload_concurrency=1)
staging = storage.new_staging_dir("a", "p")
for i in range(30):
    (staging / f"part-{i:03d}.bin").write_bytes(bytes([i]) * 2000)
uploads = []
def kill_after_ten(params, **_):
    uploads.append(params["Key"])
    if len(uploads) == 10:  # SIGKILL halfway through the uploads: no cleanup code runs
        os.kill(os.getpid(), signal.SIGKILL)
storage.client.meta.events.register("before-parameter-build.s3.PutObject", kill_after_ten)
storage.publish(staging, "a", "p", {})
"""


def test_killed_publish_leaves_no_success_and_a_rerun_completes_it(moto, tmp_path):
    root = f"s3://{BUCKET}/killed-{uuid.uuid4().hex[:8]}"
    result = subprocess.run([sys.executable, "-c", KILLED_PUBLISH, root, str(tmp_path / "killed"), moto["endpoint"]],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    prefix = root.removeprefix(f"s3://{BUCKET}/") + "/a/p/"
    left = keys(moto["admin"], prefix)
    assert 0 < len(left) < 30 and not any(k.endswith((SUCCESS, MANIFEST, LATEST)) for k in left)
    version = next(iter(left)).removeprefix(prefix).split("/")[0]
    reader = s3_storage(moto["endpoint"], tmp_path / "reader", root=root)
    with pytest.raises(StorageError, match="has not been materialized"):
        reader.latest("a", "p")
    with pytest.raises(StorageError, match=f"no {SUCCESS} marker"):
        reader.artifact("a", "p", version)
    assert reader.complete_versions("a", "p") == {}

    # A stray object in the half-written version (say, from an older layout) must not survive.
    moto["admin"].put_object(Bucket=BUCKET, Key=f"{prefix}{version}/stray.bin", Body=b"x")
    staging = reader.new_staging_dir("a", "p")
    for i in range(30):
        (staging / f"part-{i:03d}.bin").write_bytes(bytes([i]) * 2000)
    artifact = reader.publish(staging, "a", "p", {})
    assert artifact.data_version == version
    assert set(keys(moto["admin"], f"{prefix}{version}/")) == (
        {f"{prefix}{version}/part-{i:03d}.bin" for i in range(30)} | {f"{prefix}{version}/{n}" for n in (MANIFEST, SUCCESS)})


# ---------------------------------------------------------------------------------------------
# Faults: a proxy between boto3 and moto that throttles or drops PUTs
# ---------------------------------------------------------------------------------------------

class FaultProxy:
    """HTTP proxy on 127.0.0.1 in front of moto. `decide(method, key, attempt)` returns "ok",
    "throttle" (503 SlowDown, as S3 sends it) or "drop" (the connection closes, no response)."""

    def __init__(self, upstream: str, decide):
        self.upstream = urlsplit(upstream)
        self.decide = decide
        self.attempts: dict[tuple[str, str], int] = {}
        self.faults: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                data = self.rfile.read(length) if length else b""
                key = unquote(urlsplit(self.path).path).lstrip("/").partition("/")[2]
                with proxy.lock:
                    attempt = proxy.attempts.get((self.command, key), 0) + 1
                    proxy.attempts[(self.command, key)] = attempt
                action = proxy.decide(self.command, key, attempt)
                if action != "ok":
                    with proxy.lock:
                        proxy.faults.append((action, self.command, key))
                if action == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if action == "throttle":
                    payload = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                               b"<Message>Please reduce your request rate.</Message></Error>")
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("expect", "connection")}
                conn.request(self.command, self.path, body=data, headers=headers)
                response = conn.getresponse()
                payload = response.read()
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)
                conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def proxy(moto):
    started = []

    def start(decide):
        started.append(FaultProxy(moto["endpoint"], decide))
        return started[-1]

    yield start
    for p in started:
        p.close()


def test_publish_retries_through_throttling_and_dropped_connections(moto, proxy, tmp_path):
    faults = itertools.cycle(["throttle", "drop"])

    def first_put_fails(method, key, attempt):
        return next(faults) if method == "PUT" and attempt == 1 else "ok"

    p = proxy(first_put_fails)
    storage = s3_storage(p.endpoint, tmp_path / "w", max_attempts=3)
    artifact = storage.publish(stage(storage), "a", "p", {})
    base = f"{storage.prefix}a/p/{artifact.data_version}/"
    # Every PUT (data, manifest, markers) failed once and was retried by botocore.
    assert {key for _, method, key in p.faults} == {base + rel for rel in FILES} | {
        base + MANIFEST, base + SUCCESS, f"{storage.prefix}a/p/{LATEST}"}
    assert {action for action, _, _ in p.faults} == {"throttle", "drop"}
    reader = s3_storage(moto["endpoint"], tmp_path / "r", root=storage.root)
    copy = reader.latest("a", "p")
    assert copy.data_version == artifact.data_version
    assert all((copy.path / rel).read_bytes() == data for rel, data in FILES.items())


@pytest.mark.parametrize("fault", ["throttle", "drop"])
@pytest.mark.parametrize("target", ["data/part-00001.parquet", MANIFEST, SUCCESS])
def test_permanent_failure_raises_clearly_and_marks_nothing(moto, proxy, tmp_path, fault, target):
    root = f"s3://{BUCKET}/perm-{uuid.uuid4().hex[:8]}"
    direct = s3_storage(moto["endpoint"], tmp_path / "direct", root=root)
    old = direct.publish(stage(direct, {"old.txt": b"the earlier version"}), "a", "p", {})
    p = proxy(lambda method, key, attempt: fault if method == "PUT" and key.endswith("/" + target) else "ok")
    storage = s3_storage(p.endpoint, tmp_path / "w", root=root, max_attempts=3)
    staging = stage(storage)
    with pytest.raises(StorageError) as raised:
        storage.publish(staging, "a", "p", {})
    message = str(raised.value)
    assert "publishing a[p] to s3://" in message and f"not marked complete (no {SUCCESS})" in message
    assert ("SlowDown" if fault == "throttle" else "ConnectionClosedError") in message
    assert SECRET not in message and ACCESS_KEY not in message
    assert staging.is_dir()  # kept: nothing is lost, a rerun publishes it
    # botocore's standard mode tried the request max_attempts times, then gave up.
    hits = [key for _, _, key in p.faults]
    assert len(hits) == 3 and len(set(hits)) == 1
    prefix = root.removeprefix(f"s3://{BUCKET}/") + "/a/p/"
    version = hits[0].removeprefix(prefix).split("/")[0]
    stored = keys(moto["admin"], f"{prefix}{version}/")
    assert stored and f"{prefix}{version}/{SUCCESS}" not in stored
    assert target == SUCCESS or f"{prefix}{version}/{MANIFEST}" not in stored  # the manifest comes before _SUCCESS
    assert body(moto["admin"], f"{prefix}{LATEST}").decode() == old.data_version
    reader = s3_storage(moto["endpoint"], tmp_path / "r", root=root)
    assert reader.latest("a", "p").data_version == old.data_version
    assert reader.complete_versions("a", "p").keys() == {old.data_version}
    with pytest.raises(StorageError, match=f"no {SUCCESS} marker"):
        reader.artifact("a", "p", version)


# ---------------------------------------------------------------------------------------------
# Credentials: from the environment only, and written nowhere
# ---------------------------------------------------------------------------------------------

def test_credentials_appear_in_no_manifest_metadata_or_log(moto, tmp_path, caplog, capfd):
    import logging

    import dagster as dg
    from dagster import serialize_value

    from workflows.kiln import KilnResource

    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    root = f"s3://{BUCKET}/creds-{uuid.uuid4().hex[:8]}"
    config["storage"] = {"root": root, "endpoint_url": moto["endpoint"], "local_dir": str(tmp_path / "s3")}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    assert SECRET not in (tmp_path / "pipeline.yaml").read_text()

    @dg.asset(name="raw_crawl")  # any stage name: publish records that stage's config sections
    def tiny(context: dg.AssetExecutionContext, kiln: KilnResource):
        with kiln.staging(context) as out:
            (out / "data.txt").write_text("hello")
        return kiln.publish(context, out, counts={"files": 1})

    caplog.set_level(logging.DEBUG)  # botocore's own debug logging included
    (tmp_path / "dagster").mkdir()
    with dg.instance_for_test(temp_dir=str(tmp_path / "dagster")) as instance:
        result = dg.materialize([tiny], instance=instance,
                                resources={"kiln": KilnResource(config_path=str(tmp_path / "pipeline.yaml"))})
        assert result.success
        events = [serialize_value(e) for e in instance.all_logs(result.run_id)]
        materialization = result.asset_materializations_for_node("raw_crawl")[0]
    assert materialization.metadata["path"].value.startswith(root + "/raw_crawl/all/")
    captured = capfd.readouterr()
    # The run really used the credentials (moto saw signed requests) and really published.
    admin = moto["admin"]
    listed = keys(admin, root.removeprefix(f"s3://{BUCKET}/") + "/")
    manifests = [body(admin, k).decode() for k in listed if k.endswith(MANIFEST)]
    assert len(manifests) == 1 and any(k.endswith(SUCCESS) for k in listed)
    dagster_files = [p.read_bytes() for p in (tmp_path / "dagster").rglob("*") if p.is_file()]
    local_files = [p.read_bytes() for p in (tmp_path / "s3").rglob("*") if p.is_file()]
    # Everything logged at INFO and above (what Dagster and Kiln emit), and all that went to stdout/stderr.
    logs = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.INFO) + captured.out + captured.err
    assert "published raw_crawl[all] -> s3://" in logs
    # Not even in botocore's own DEBUG lines, which print request headers (Kiln redacts them there).
    debug = "\n".join(r.getMessage() for r in caplog.records)
    assert any(r.name == "botocore.endpoint" and "***" in r.getMessage() for r in caplog.records)
    for value in (SECRET, TOKEN):
        assert value not in logs and value not in debug and value not in caplog.text
        assert not any(value in text for text in manifests + events)
        assert not any(value.encode() in data for data in dagster_files + local_files)
    # The key id is no secret, but Kiln writes it nowhere either (botocore's own debug lines aside).
    kiln_logs = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(("botocore", "urllib3", "s3transfer")))
    assert ACCESS_KEY not in kiln_logs + captured.out + captured.err
    assert not any(ACCESS_KEY in text for text in manifests + events)


# ---------------------------------------------------------------------------------------------
# The whole graph on an s3:// root
# ---------------------------------------------------------------------------------------------

ASSETS = {"raw_crawl": "sample", "documents": "sample", "quality_classifier": "all", "quality_signals": "sample",
          "filtered": "sample", "deduplicated": "sample", "tokenizer": "all", "tokenized": "sample",
          "mixed_shards": "all", "checkpoints": "all", "eval_report": "all"}


def small_s3_config(root: str, endpoint: str) -> dict:
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["raw_crawl"]["snapshots"] = {"sample": {"kind": "sample", "seed": 0, "pages": 100, "files": 2}}
    config["tokenizer"]["vocab_size"] = 2048
    config["mix"]["total_tokens"] = 20_000
    config["training"].update(steps=5, checkpoint_every=5, warmup_steps=1)
    config["evaluation"].update(max_sequences_per_bucket=8, cloze_items_per_bucket=8, sample_max_new_tokens=8)
    config["storage"] = {"root": root, "endpoint_url": endpoint}
    return config


@pytest.mark.slow
def test_whole_graph_runs_on_an_s3_root(moto, tmp_path):
    import dagster as dg
    from dagster import serialize_value

    state = tmp_path / "state"
    state.mkdir()
    root = f"s3://{BUCKET}/e2e-{uuid.uuid4().hex[:8]}"
    (state / "pipeline.yaml").write_text(yaml.safe_dump(small_s3_config(root, moto["endpoint"])))
    env = {**os.environ, "KILN_STATE_DIR": str(state), "KILN_CONFIG": str(state / "pipeline.yaml")}
    env.pop("DAGSTER_HOME", None)
    assert env["AWS_SECRET_ACCESS_KEY"] == SECRET  # the only place the credentials are
    started = time.time()
    result = run_pipeline(["-m", "workflows.cli", "demo"], env, state / "demo.log")
    wall = time.time() - started
    print(f"kiln demo on {root}: {wall:.0f}s wall")
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert f"Outputs:   {root}" in result.stdout

    admin = moto["admin"]
    prefix = root.removeprefix(f"s3://{BUCKET}/") + "/"
    stored = keys(admin, prefix)
    manifests = []
    for asset, partition in ASSETS.items():
        folder = f"{prefix}{asset}/{partition}/"
        version = body(admin, folder + LATEST).decode()
        assert folder + f"{version}/{SUCCESS}" in stored, asset
        manifest_text = body(admin, folder + f"{version}/{MANIFEST}").decode()
        manifests.append(manifest_text)
        manifest = json.loads(manifest_text)
        assert manifest["asset"] == asset and manifest["data_version"] == version
        assert {folder + f"{version}/{rel}": size for rel, size in manifest["files"].items()}.items() <= stored.items()
    # Nothing of the graph stayed only on local disk: every published folder is complete in the bucket.
    for key in (k for k in stored if k.endswith("/" + SUCCESS) and k.count("/") == prefix.count("/") + 3):
        assert key.replace(SUCCESS, MANIFEST) in stored

    instance = dg.DagsterInstance.from_config(str(state / "dagster"))
    events = [serialize_value(e) for run in instance.get_runs() for e in instance.all_logs(run.run_id)]
    paths = [e.asset_materialization.metadata["path"].value for run in instance.get_runs()
             for e in instance.all_logs(run.run_id) if e.is_dagster_event and e.dagster_event.is_step_materialization]
    assert len(paths) == len(ASSETS) and all(p.startswith(root + "/") for p in paths)
    state_files = [p for p in state.rglob("*") if p.is_file()]
    for value in (SECRET, TOKEN):
        assert value not in result.stdout + result.stderr
        assert not any(value in text for text in manifests + events)
        assert not any(value.encode() in p.read_bytes() for p in state_files), "a credential was written under the state folder"
