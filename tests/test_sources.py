"""Snapshot sources against an S3-compatible server on loopback (moto) and real WARC files."""
import gzip
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import dagster as dg
import pytest
import yaml
from botocore.exceptions import ResponseStreamingError

from engine.sources import (
    SourceError,
    download_object,
    fetch_snapshot,
    s3_client,
    sample_paths,
    source_for_snapshot,
)
from conftest import moto_s3
from engine.warc_manifest import describe_warc_files
from workflows.config import CommonCrawlSource, SeedCrawlSource, WarcDirSource, parse_config

CRAWL = "CC-MAIN-2024-22"
SEGMENT = f"crawl-data/{CRAWL}/segments/1715971057216.39/warc"
SECRET = "kiln-test-secret-0d6f"  # must never show up in logs or outputs


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def warc_files(shared_data) -> list[Path]:
    files = sorted(p for p in (shared_data / "warc").rglob("*") if p.name.endswith((".warc", ".warc.gz", ".wet", ".wet.gz")))
    assert len(files) >= 8
    return files


@pytest.fixture(scope="module")
def s3(warc_files):
    """moto's S3 server on 127.0.0.1, holding a fake Common Crawl and a private WARC bucket."""
    with moto_s3("kiln-test-key", SECRET) as (endpoint, admin):
        # Common Crawl's bucket is public: everything below is read with unsigned requests.
        admin.create_bucket(Bucket="commoncrawl", ACL="public-read")
        keys = []
        for path in warc_files:
            key = f"{SEGMENT}/{path.name}"
            admin.put_object(Bucket="commoncrawl", Key=key, Body=path.read_bytes(), ACL="public-read",
                             ChecksumAlgorithm="SHA256")
            keys.append(key)
        listing = gzip.compress(("\n".join(keys) + "\n").encode())
        admin.put_object(Bucket="commoncrawl", Key=f"crawl-data/{CRAWL}/warc.paths.gz", Body=listing, ACL="public-read")
        # A private bucket of WARCs (signed requests, credentials from the environment).
        admin.create_bucket(Bucket="kiln-warcs")
        for path in warc_files[:3]:
            admin.put_object(Bucket="kiln-warcs", Key=f"drop/{path.name}", Body=path.read_bytes())
        admin.put_object(Bucket="kiln-warcs", Key="drop/SOURCE.txt", Body=b"not a warc")
        admin.put_object(Bucket="kiln-warcs", Key=f"drop/older/{warc_files[3].name}", Body=warc_files[3].read_bytes())
        admin.put_object(Bucket="kiln-warcs", Key="plain/big.warc.gz", Body=b"0123456789" * 50_000)
        yield {"endpoint": endpoint, "admin": admin, "keys": keys, "files": {f"{SEGMENT}/{p.name}": p for p in warc_files}}


@pytest.fixture()
def client(s3):
    return s3_client(s3["endpoint"], max_attempts=3, unsigned=True)


def calls_to(client, operation="GetObject") -> list[dict]:
    calls = []
    client.meta.events.register(f"before-parameter-build.s3.{operation}", lambda params, **_: calls.append(dict(params)))
    return calls


# ---------------------------------------------------------------------------------------------
# Common Crawl
# ---------------------------------------------------------------------------------------------

def test_sample_is_seeded_order_free_and_stable_as_the_listing_grows():
    paths = [f"crawl-data/x/{i:05d}.warc.gz" for i in range(200)]
    picked = sample_paths(paths, 10, seed=7)
    assert len(picked) == 10 and picked == sorted(picked)
    assert sample_paths(list(reversed(paths)), 10, seed=7) == picked
    assert sample_paths(paths, 10, seed=8) != picked
    grown = sample_paths(paths + [f"crawl-data/x/new-{i}.warc.gz" for i in range(50)], 10, seed=7)
    assert {p for p in grown if not p.startswith("crawl-data/x/new")} <= set(picked)
    assert sample_paths(paths[:3], 10, seed=7) == sorted(paths[:3])


def test_common_crawl_snapshot_downloads_a_verified_sample(s3, tmp_path):
    source = CommonCrawlSource(crawl=CRAWL, files=3, seed=5, endpoint_url=s3["endpoint"], max_attempts=2)
    messages = []
    summary = fetch_snapshot(source, tmp_path / "out", snapshot=CRAWL, cache_dir=tmp_path / "cache", log=messages.append)
    expected = sample_paths(s3["keys"], 3, 5)
    names = sorted(p.name for p in (tmp_path / "out" / "warc").iterdir())
    assert names == sorted(Path(k).name for k in expected)
    for key in expected:
        assert sha256(tmp_path / "out" / "warc" / Path(key).name) == sha256(s3["files"][key])
    provenance = json.loads((tmp_path / "out" / "sources.json").read_text())
    assert provenance["listed"] == len(s3["keys"]) and provenance["crawl"] == CRAWL
    assert [f["key"] for f in provenance["files"]] == expected
    assert {f["checksum"] for f in provenance["files"]} == {"s3-sha256"}  # the server's checksum was compared
    assert summary == {"crawl": CRAWL, "listed": len(s3["keys"]), "files": 3}
    assert describe_warc_files(tmp_path / "out" / "warc")[0]["records"] > 0

    # A second snapshot build reuses the verified cache, and picks the same files.
    again = fetch_snapshot(source, tmp_path / "again", snapshot=CRAWL, cache_dir=tmp_path / "cache", log=messages.append)
    assert again == summary
    assert sorted(p.name for p in (tmp_path / "again" / "warc").iterdir()) == names
    assert sum("cached" in m for m in messages) == 3
    assert not any(SECRET in m for m in messages)


def test_download_resumes_a_partial_file_with_a_range_request(s3, client, tmp_path):
    key = max(s3["keys"], key=lambda k: s3["files"][k].stat().st_size)
    data = s3["files"][key].read_bytes()
    dest = tmp_path / "f.warc.gz"
    # What an interrupted earlier run leaves: the first bytes and the ETag they belong to.
    etag = client.head_object(Bucket="commoncrawl", Key=key)["ETag"]
    (tmp_path / "f.warc.gz.part").write_bytes(data[:50_000])
    (tmp_path / "f.warc.gz.part.etag").write_text(etag)
    calls = calls_to(client)
    record = download_object(client, "commoncrawl", key, dest, backoff_seconds=0, log=lambda m: None)
    assert record["resumed_from"] == 50_000 and record["attempts"] == 1
    assert calls == [{"Bucket": "commoncrawl", "Key": key, "IfMatch": etag, "Range": "bytes=50000-"}]
    assert dest.read_bytes() == data
    assert not (tmp_path / "f.warc.gz.part").exists()
    assert json.loads((tmp_path / "f.warc.gz.verified.json").read_text())["sha256"] == hashlib.sha256(data).hexdigest()


def test_interrupted_stream_is_retried_from_where_it_stopped(s3, client, tmp_path):
    key = max(s3["keys"], key=lambda k: s3["files"][k].stat().st_size)
    data = s3["files"][key].read_bytes()

    class ResetAfter:
        """The first response's body dies after 30 000 bytes, like a dropped connection."""

        def __init__(self, body):
            self.body = body

        def iter_chunks(self, size):
            yield self.body.read(30_000)
            raise ResponseStreamingError(error="connection reset (simulated)")

    broken = []

    def break_first(parsed, **_):
        if not broken:
            broken.append(True)
            parsed["Body"] = ResetAfter(parsed["Body"])

    client.meta.events.register("after-call.s3.GetObject", break_first)
    calls = calls_to(client)
    messages = []
    record = download_object(client, "commoncrawl", key, tmp_path / "f", backoff_seconds=0, log=messages.append)
    assert record["attempts"] == 2 and record["resumed_from"] == 0
    assert [c.get("Range") for c in calls] == [None, "bytes=30000-"]
    assert (tmp_path / "f").read_bytes() == data
    assert any("attempt 1 failed at byte 30000" in m for m in messages)


def test_wrong_bytes_in_a_partial_file_are_caught_by_the_checksum(s3, client, tmp_path):
    key = s3["keys"][0]
    data = s3["files"][key].read_bytes()
    etag = client.head_object(Bucket="commoncrawl", Key=key)["ETag"]
    (tmp_path / "f.part").write_bytes(b"\0" * 1000)  # same length as a real prefix, wrong bytes
    (tmp_path / "f.part.etag").write_text(etag)
    calls = calls_to(client)
    record = download_object(client, "commoncrawl", key, tmp_path / "f", backoff_seconds=0, log=lambda m: None)
    assert [c.get("Range") for c in calls] == ["bytes=1000-", None]  # resumed, rejected, downloaded whole
    assert record["attempts"] == 2
    assert (tmp_path / "f").read_bytes() == data


def test_corrupted_transfer_fails_and_leaves_no_file(s3, client, tmp_path):
    class FlipFirstByte:
        def __init__(self, body):
            self.body = body

        def iter_chunks(self, size):
            first = True
            for chunk in self.body.iter_chunks(size):
                if first and chunk:
                    chunk, first = bytes([chunk[0] ^ 0xFF]) + chunk[1:], False
                yield chunk

    client.meta.events.register("after-call.s3.GetObject", lambda parsed, **_: parsed.update(Body=FlipFirstByte(parsed["Body"])))
    with pytest.raises(SourceError, match="gave up after 3 attempts .*sha256"):
        download_object(client, "commoncrawl", s3["keys"][0], tmp_path / "f", max_attempts=3, backoff_seconds=0,
                        log=lambda m: None)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith((".lock", ".etag"))) == []


def test_cached_file_is_reverified_and_replaced_when_damaged(s3, client, tmp_path):
    key = s3["keys"][1]
    dest = tmp_path / "f"
    download_object(client, "commoncrawl", key, dest, backoff_seconds=0, log=lambda m: None)
    calls = calls_to(client)
    assert download_object(client, "commoncrawl", key, dest, log=lambda m: None)["cached"] is True
    assert calls == []
    damaged = bytearray(dest.read_bytes())
    damaged[100] ^= 0xFF
    dest.write_bytes(bytes(damaged))
    record = download_object(client, "commoncrawl", key, dest, backoff_seconds=0, log=lambda m: None)
    assert record["cached"] is False and len(calls) == 1
    assert sha256(dest) == sha256(s3["files"][key])


def test_partial_file_of_another_object_version_is_discarded(s3, client, tmp_path):
    key = s3["keys"][2]
    (tmp_path / "f.part").write_bytes(b"old version bytes")
    (tmp_path / "f.part.etag").write_text('"an-older-etag"')
    calls = calls_to(client)
    record = download_object(client, "commoncrawl", key, tmp_path / "f", backoff_seconds=0, log=lambda m: None)
    assert record["resumed_from"] == 0 and "Range" not in calls[0]
    assert sha256(tmp_path / "f") == sha256(s3["files"][key])


def test_missing_listing_is_a_clear_error(s3, tmp_path):
    source = CommonCrawlSource(crawl="CC-MAIN-2030-01", endpoint_url=s3["endpoint"], max_attempts=1)
    with pytest.raises(SourceError, match="crawl-data/CC-MAIN-2030-01/warc.paths.gz"):
        fetch_snapshot(source, tmp_path / "out", snapshot="CC-MAIN-2030-01", cache_dir=tmp_path / "cache", log=lambda m: None)


# ---------------------------------------------------------------------------------------------
# WARC folders, local and S3
# ---------------------------------------------------------------------------------------------

def test_s3_warc_folder_with_credentials_from_the_environment(s3, warc_files, tmp_path):
    messages = []
    source = WarcDirSource(path="s3://kiln-warcs/drop", endpoint_url=s3["endpoint"], max_attempts=2)
    summary = fetch_snapshot(source, tmp_path / "a", snapshot="x", cache_dir=tmp_path / "cache", log=messages.append)
    names = sorted(p.name for p in (tmp_path / "a" / "warc").iterdir())
    assert names == sorted(p.name for p in warc_files[:3])  # not SOURCE.txt, not the subfolder
    assert summary == {"files": 3, "location": "s3://kiln-warcs/drop"}
    provenance = (tmp_path / "a" / "sources.json").read_text()
    assert {f["checksum"] for f in json.loads(provenance)["files"]} == {"computed"}  # uploaded without a checksum
    assert SECRET not in provenance and not any(SECRET in m for m in messages)

    recursive = source.model_copy(update={"recursive": True, "pattern": "*.warc.gz"})
    fetch_snapshot(recursive, tmp_path / "b", snapshot="x", cache_dir=tmp_path / "cache", log=messages.append)
    expected = sorted(p.name for p in warc_files[:4] if p.name.endswith(".warc.gz"))
    assert sorted(p.name for p in (tmp_path / "b" / "warc").iterdir()) == expected
    for path in warc_files[:4]:
        if path.name.endswith(".warc.gz"):
            assert sha256(tmp_path / "b" / "warc" / path.name) == sha256(path)


def test_s3_warc_folder_without_credentials_is_refused(s3, tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    source = WarcDirSource(path="s3://kiln-warcs/drop", endpoint_url=s3["endpoint"], max_attempts=1)
    with pytest.raises(SourceError, match="no AWS credentials for s3://kiln-warcs/drop"):
        fetch_snapshot(source, tmp_path / "a", snapshot="x", cache_dir=tmp_path / "cache", log=lambda m: None)


def test_local_warc_folder_takes_only_warc_and_wet_files(shared_data, tmp_path):
    folder = shared_data / "warc" / "edgecases_warcio"
    fetch_snapshot(WarcDirSource(path=str(folder)), tmp_path / "a", snapshot="x", cache_dir=tmp_path / "c")
    names = sorted(p.name for p in (tmp_path / "a" / "warc").iterdir())
    assert names == sorted(p.name for p in folder.iterdir() if p.name.endswith((".warc", ".warc.gz")))
    assert "test_data_example.arc.gz" not in names and "SOURCE.txt" not in names

    whirlwind = shared_data / "warc" / "cc_whirlwind"
    fetch_snapshot(WarcDirSource(path=str(whirlwind)), tmp_path / "b", snapshot="x", cache_dir=tmp_path / "c")
    # .wet and .wet.gz are taken; the WAT metadata file is not.
    assert sorted(p.name for p in (tmp_path / "b" / "warc").iterdir()) == [
        "whirlwind.warc.gz", "whirlwind.warc.wet", "whirlwind.warc.wet.gz"]

    with pytest.raises(SourceError, match="no .* files match"):
        fetch_snapshot(WarcDirSource(path=str(folder), pattern="*.nothing"), tmp_path / "c", snapshot="x",
                       cache_dir=tmp_path / "c")


# ---------------------------------------------------------------------------------------------
# Which source a snapshot has, the seed crawl source and the asset
# ---------------------------------------------------------------------------------------------

def test_source_for_snapshot_uses_config_then_refresh_templates():
    raw = parse_config({"raw_crawl": {
        "snapshots": {"sample": {"kind": "sample"}, "CC-MAIN-2023-50": {"kind": "common_crawl", "files": 2}},
        "refresh": {"common_crawl": {"kind": "common_crawl", "files": 4, "seed": 3},
                    "seed_crawl": {"kind": "seed_crawl", "seeds": ["https://example.org/"]}},
    }}).raw_crawl
    assert source_for_snapshot(raw, "sample").kind == "sample"
    assert source_for_snapshot(raw, "CC-MAIN-2023-50").crawl == "CC-MAIN-2023-50"
    discovered = source_for_snapshot(raw, "CC-MAIN-2024-30")
    assert (discovered.crawl, discovered.files, discovered.seed) == ("CC-MAIN-2024-30", 4, 3)
    assert source_for_snapshot(raw, "seed-2024-06-01").seeds == ["https://example.org/"]
    with pytest.raises(SourceError, match="no source"):
        source_for_snapshot(raw, "something-else")
    with pytest.raises(SourceError):
        source_for_snapshot(parse_config({}).raw_crawl, "CC-MAIN-2024-30")  # no refresh template configured


class _Page(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        body = b"<html><body><p>Hello</p><a href='/two.html'>two</a></body></html>"
        status = 404 if self.path == "/robots.txt" else 200
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture()
def tiny_site():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_seed_crawl_source_writes_warc_and_crawl_log(tiny_site, tmp_path):
    source = SeedCrawlSource(seeds=[tiny_site], allow_private_networks=True, delay_seconds=0, max_pages=5)
    summary = fetch_snapshot(source, tmp_path, snapshot="seed-2024-06-01", cache_dir=tmp_path / "c", log=lambda m: None)
    files = describe_warc_files(tmp_path / "warc")
    assert [f["name"] for f in files] == ["seed-2024-06-01-00000.warc.gz"]
    assert files[0]["records"] == 1 + 2 * 2  # warcinfo + request/response for / and /two.html
    assert summary["pages_ok"] == 2 and summary["outcome_fetched"] == 2
    assert len((tmp_path / "crawl_log.jsonl").read_text().splitlines()) == 2

    refused = source.model_copy(update={"allow_private_networks": False})
    with pytest.raises(SourceError, match="blocked_address"):
        fetch_snapshot(refused, tmp_path / "r", snapshot="seed-2024-06-01", cache_dir=tmp_path / "c", log=lambda m: None)


def test_raw_crawl_asset_materializes_a_common_crawl_snapshot(s3, tmp_path, monkeypatch):
    from assets.raw_crawl import raw_crawl
    from workflows.kiln import SNAPSHOTS, KilnResource

    monkeypatch.setenv("KILN_STATE_DIR", str(tmp_path / "state"))
    config = {
        "raw_crawl": {"snapshots": {CRAWL: {"kind": "common_crawl", "files": 2, "endpoint_url": s3["endpoint"]}}},
        "storage": {"root": str(tmp_path / "storage")},
    }
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SNAPSHOTS.name, [CRAWL])
    result = dg.materialize([raw_crawl], partition_key=CRAWL, instance=instance,
                            resources={"kiln": KilnResource(config_path=str(tmp_path / "pipeline.yaml"))})
    assert result.success
    metadata = result.asset_materializations_for_node("raw_crawl")[0].metadata
    assert metadata["source"].value == "common_crawl" and metadata["files"].value.count(".warc") >= 2
    published = next((tmp_path / "storage" / "raw_crawl" / CRAWL).glob("*/_SUCCESS")).parent
    assert len(list((published / "warc").iterdir())) == 2
    assert json.loads((published / "files.json").read_text())[0]["sha256"]
    assert (tmp_path / "state" / "cache" / "raw_crawl" / "s3").is_dir()  # downloads cached outside the artifact
