"""Where a snapshot's WARC files come from, and which new snapshots exist.

`fetch_snapshot` dispatches on the source's `kind` and fills `<out>/warc/` (WARC files only: the
documents stage reads every file there) plus provenance beside it:
- `sample`: the bundled generated crawl (engine/sample_crawl.py), `labels.json` beside it;
- `warc_dir`: a local folder or `s3://bucket/prefix`, `sources.json` for S3;
- `common_crawl`: a seeded sample of N files of a crawl's `warc.paths.gz` / `wet.paths.gz`
  listing, read unsigned from the `commoncrawl` bucket, `sources.json`;
- `seed_crawl`: Kiln's own polite crawl (engine/crawler.py), `crawl_log.jsonl`.

S3 objects go through a local download cache. Each is written to `<name>.part`, resumed with a
range request after an interruption (If-Match on the ETag, so a changed object is never stitched
onto old bytes), checked against its size and, where the server keeps one, its full-object SHA-256
checksum, then renamed into place beside a `.verified.json` sidecar. A later run re-hashes the
cached file against the sidecar instead of downloading it again. Credentials come from boto3's
default chain (environment, profile, IAM role); nothing here logs or stores them.

`discover_snapshots` is what the refresh schedule (jobs/) calls: Common Crawl ids that appeared
under `crawl-data/` (listed through boto3) and today's dated seed crawl.
"""
from __future__ import annotations

import base64
import fcntl
import fnmatch
import gzip
import hashlib
import json
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator
from urllib.parse import urlsplit

import boto3
import urllib3
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from engine.crawler import CrawlSettings, crawl_to_warc
from workflows.config import (
    COMMON_CRAWL_ID,
    SEED_SNAPSHOT,
    CommonCrawlSource,
    RawCrawlConfig,
    SampleSource,
    SeedCrawlSource,
    WarcDirSource,
    resolve_path,
)
from workflows.storage import file_sha256

WARC_SUFFIXES = (".warc", ".warc.gz", ".wet", ".wet.gz")
CHUNK_BYTES = 1 << 20
Log = Callable[[str], None]


class SourceError(RuntimeError):
    """A snapshot source that cannot deliver: nothing matched, a download failed its checks, ..."""


def is_warc_name(name: str) -> bool:
    return name.lower().endswith(WARC_SUFFIXES)


# ---------------------------------------------------------------------------------------------
# Which source a snapshot has
# ---------------------------------------------------------------------------------------------

def source_for_snapshot(raw: RawCrawlConfig, snapshot: str):
    """The configured source of `snapshot`, or the refresh template its name matches."""
    source = raw.snapshots.get(snapshot)
    if isinstance(source, CommonCrawlSource) and source.crawl is None:
        return source.model_copy(update={"crawl": snapshot})
    if source is not None:
        return source
    refresh = raw.refresh
    if refresh.common_crawl is not None and re.fullmatch(COMMON_CRAWL_ID, snapshot):
        return refresh.common_crawl.model_copy(update={"crawl": snapshot})
    if refresh.seed_crawl is not None and re.fullmatch(SEED_SNAPSHOT, snapshot):
        return refresh.seed_crawl
    raise SourceError(
        f"Snapshot {snapshot!r} has no source: not in raw_crawl.snapshots ({', '.join(sorted(raw.snapshots))}) "
        "and no raw_crawl.refresh template matches its name"
    )


# ---------------------------------------------------------------------------------------------
# S3
# ---------------------------------------------------------------------------------------------

class _RedactSecrets(logging.Filter):
    """Replaces known secret values in a log record's message with `***`."""

    def __init__(self) -> None:
        super().__init__()
        self.secrets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = message
        for secret in self.secrets:
            redacted = redacted.replace(secret, "***")
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


# botocore's DEBUG lines print request headers and canonical requests, the session token included.
_LOGGERS_THAT_PRINT_HEADERS = ("botocore.endpoint", "botocore.auth", "botocore.httpsession", "botocore.hooks")
_REDACT = _RedactSecrets()


def _redact_credentials_in_logs(session: boto3.session.Session) -> None:
    """Keep this session's secret key and session token out of botocore's own log lines."""
    credentials = session.get_credentials()
    if credentials is None:
        return
    frozen = credentials.get_frozen_credentials()
    _REDACT.secrets.update(value for value in (frozen.secret_key, frozen.token) if value and len(value) >= 8)
    for name in _LOGGERS_THAT_PRINT_HEADERS:
        logger = logging.getLogger(name)
        if _REDACT not in logger.filters:
            logger.addFilter(_REDACT)


def s3_client(endpoint_url: str | None = None, *, max_attempts: int = 5, unsigned: bool = False,
              connect_timeout: float = 20, read_timeout: float = 60):
    """boto3 S3 client with standard-mode retries; credentials from boto3's default chain.

    `total_max_attempts` counts the first request too (botocore's `max_attempts` counts only
    retries). A fresh session each time: the default session would keep the credentials it
    first found, and credentials rotated in the environment must be picked up.
    """
    session = boto3.session.Session()
    region = session.region_name or "us-east-1"  # Common Crawl lives in us-east-1
    config = Config(
        retries={"mode": "standard", "total_max_attempts": max_attempts},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        **({"signature_version": UNSIGNED} if unsigned else {}),
    )
    if not unsigned:
        _redact_credentials_in_logs(session)
    return session.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix/"): the path names a folder."""
    parts = urlsplit(url)
    prefix = parts.path.lstrip("/")
    return parts.netloc, (prefix.rstrip("/") + "/") if prefix else ""


def list_warc_objects(client, bucket: str, prefix: str, pattern: str = "*", recursive: bool = False) -> list[str]:
    keys = []
    paginator = client.get_paginator("list_objects_v2")
    extra = {} if recursive else {"Delimiter": "/"}
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix, **extra):
        for item in page.get("Contents", []):
            name = PurePosixPath(item["Key"]).name
            if is_warc_name(name) and fnmatch.fnmatch(name, pattern):
                keys.append(item["Key"])
    return sorted(keys)


def crawl_listing(client, bucket: str, crawl: str, file_type: str = "warc") -> list[str]:
    """Keys of one crawl's files, from `crawl-data/<crawl>/<file_type>.paths.gz`."""
    key = f"crawl-data/{crawl}/{file_type}.paths.gz"
    try:
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        raise SourceError(f"cannot read s3://{bucket}/{key}: {error.response['Error'].get('Code')}") from None
    return [line.strip() for line in gzip.decompress(body).decode("utf-8").splitlines() if line.strip()]


def sample_paths(paths: list[str], n: int, seed: int) -> list[str]:
    """N paths ranked by a seeded hash: the same for the same seed, and stable if the listing grows."""
    ranked = sorted(set(paths), key=lambda p: hashlib.sha256(f"{seed}\0{p}".encode()).hexdigest())
    return sorted(ranked[:n])


def list_common_crawl_ids(client, bucket: str = "commoncrawl") -> list[str]:
    """Crawl ids with a folder under `crawl-data/` (published or still being uploaded)."""
    ids = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="crawl-data/", Delimiter="/"):
        for item in page.get("CommonPrefixes", []):
            name = item["Prefix"].removeprefix("crawl-data/").rstrip("/")
            if re.fullmatch(COMMON_CRAWL_ID, name):
                ids.append(name)
    return sorted(ids)


def _object_exists(client, bucket: str, key: str) -> bool:
    try:
        client.head_object(Bucket=bucket, Key=key)
        return True
    except ClientError as error:
        if error.response["Error"].get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise


def _full_object_sha256(head: dict) -> str | None:
    """The server's SHA-256 of the whole object, hex; None when it keeps none (or a composite one)."""
    value = head.get("ChecksumSHA256")
    if not value or "-" in value or head.get("ChecksumType", "FULL_OBJECT") != "FULL_OBJECT":
        return None
    return base64.b64decode(value).hex()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One downloader per cache file, across processes (two runs of one snapshot)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


# Streaming failures worth another (resumed) attempt; botocore already retried the request itself.
_TRANSIENT = (BotoCoreError, urllib3.exceptions.HTTPError, ConnectionError)


def download_object(
    client,
    bucket: str,
    key: str,
    dest: Path,
    *,
    max_attempts: int = 5,
    backoff_seconds: float = 1.0,
    chunk_bytes: int = CHUNK_BYTES,
    log: Log = print,
) -> dict:
    """Download s3://bucket/key to `dest`: resumable, verified by size and SHA-256, renamed last.

    Returns {"key", "size", "sha256", "etag", "checksum" ("s3-sha256" when the server's checksum
    was compared, "computed" otherwise), "cached", "resumed_from", "attempts"}.
    """
    with _locked(dest):
        try:
            head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        except ClientError as error:
            raise SourceError(f"s3://{bucket}/{key}: {error.response['Error'].get('Code')}") from None
        size, etag = head["ContentLength"], head["ETag"]
        expected = _full_object_sha256(head)
        sidecar = dest.with_name(dest.name + ".verified.json")
        part = dest.with_name(dest.name + ".part")
        part_etag = dest.with_name(dest.name + ".part.etag")

        if dest.exists() and sidecar.exists():
            known = json.loads(sidecar.read_text())
            if (known.get("etag"), known.get("size")) == (etag, size) and dest.stat().st_size == size \
                    and file_sha256(dest) == known["sha256"] and expected in (None, known["sha256"]):
                return {**known, "cached": True, "resumed_from": 0, "attempts": 0}
            log(f"cached {dest.name} is stale or damaged; downloading again")
        for stale in (dest, sidecar):
            stale.unlink(missing_ok=True)
        # A partial file only continues the same object version.
        if part.exists() and (not part_etag.exists() or part_etag.read_text() != etag):
            part.unlink()
        part_etag.write_text(etag)
        first_offset = part.stat().st_size if part.exists() else 0

        attempt, problem = 0, ""
        while attempt < max_attempts:
            attempt += 1
            if attempt > 1:
                time.sleep(min(backoff_seconds * 2 ** (attempt - 2), 30.0))
            offset = part.stat().st_size if part.exists() else 0
            if offset > size:
                part.unlink()
                offset = 0
            try:
                if offset < size:
                    ranged = {"Range": f"bytes={offset}-"} if offset else {}
                    response = client.get_object(Bucket=bucket, Key=key, IfMatch=etag, **ranged)
                    with open(part, "ab") as handle:
                        for chunk in response["Body"].iter_chunks(chunk_bytes):
                            handle.write(chunk)
                elif not part.exists():
                    part.touch()  # an empty object
            except ClientError as error:
                code = error.response["Error"].get("Code")
                if code in ("PreconditionFailed", "412", "InvalidRange", "416"):
                    raise SourceError(f"s3://{bucket}/{key} changed while downloading ({code}); run again") from None
                status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status < 500 and code not in ("SlowDown", "Throttling", "RequestTimeout"):
                    raise  # 403, 404, ...: another attempt cannot help
                problem = f"{code}"
                log(f"{key}: attempt {attempt} failed ({problem}); resuming")
                continue
            except _TRANSIENT as error:
                problem = f"{type(error).__name__}: {error}"
                reached = part.stat().st_size if part.exists() else 0
                log(f"{key}: attempt {attempt} failed at byte {reached} ({problem}); resuming")
                continue
            got = part.stat().st_size
            if got != size:
                problem = f"size {got} != {size}"
                if got > size:
                    part.unlink()
                continue
            sha256 = file_sha256(part)
            if expected is not None and sha256 != expected:
                problem = f"sha256 {sha256} != server checksum {expected}"
                log(f"{key}: {problem}; downloading from scratch")
                part.unlink()  # the bytes are wrong somewhere: no resuming from them
                continue
            os.replace(part, dest)
            part_etag.unlink(missing_ok=True)
            record = {
                "key": key, "size": size, "sha256": sha256, "etag": etag,
                "checksum": "s3-sha256" if expected else "computed",
            }
            _write_json(sidecar, record)
            return {**record, "cached": False, "resumed_from": first_offset, "attempts": attempt}
        raise SourceError(f"s3://{bucket}/{key}: gave up after {max_attempts} attempts ({problem})")


def _cache_path(cache_dir: Path, endpoint_url: str | None, bucket: str, key: str) -> Path:
    endpoint = urlsplit(endpoint_url).netloc.replace(":", "_") if endpoint_url else "aws"
    return cache_dir / "s3" / endpoint / bucket / key


def _place(cached: Path, target: Path) -> None:
    """Into the staging folder: a hard link where the file system allows one, else a copy."""
    if target.exists():
        raise SourceError(f"two source files are both named {target.name}")
    try:
        os.link(cached, target)
    except OSError:
        shutil.copyfile(cached, target)


def _download_all(client, bucket, keys, warc_dir, cache_dir, endpoint_url, max_attempts, backoff_seconds, log) -> list[dict]:
    records = []
    for index, key in enumerate(keys, 1):
        cached = _cache_path(cache_dir, endpoint_url, bucket, key)
        record = download_object(client, bucket, key, cached, max_attempts=max_attempts,
                                 backoff_seconds=backoff_seconds, log=log)
        _place(cached, warc_dir / PurePosixPath(key).name)
        log(f"[{index}/{len(keys)}] {key}: {record['size']} bytes, "
            + ("cached" if record["cached"] else f"downloaded in {record['attempts']} attempt(s)"))
        records.append({k: record[k] for k in ("key", "size", "sha256", "etag", "checksum")})
    return records


# ---------------------------------------------------------------------------------------------
# One function per source kind
# ---------------------------------------------------------------------------------------------

def fetch_sample(source: SampleSource, out: Path) -> dict:
    from engine.sample_crawl import generate_sample_crawl

    summary = generate_sample_crawl(str(out / "warc"), seed=source.seed, num_pages=source.pages, num_files=source.files)
    # Ground-truth labels of the generated pages travel beside the WARCs, for tests and reports.
    shutil.move(str(out / "warc" / "labels.json"), out / "labels.json")
    return summary


def fetch_warc_dir(source: WarcDirSource, out: Path, *, cache_dir: Path, backoff_seconds: float = 1.0, log: Log = print) -> dict:
    warc_dir = out / "warc"
    if source.path.startswith("s3://"):
        bucket, prefix = parse_s3_url(source.path)
        client = s3_client(source.endpoint_url, max_attempts=source.max_attempts, unsigned=source.unsigned)
        try:
            keys = list_warc_objects(client, bucket, prefix, source.pattern, source.recursive)
        except NoCredentialsError:
            raise SourceError(
                f"no AWS credentials for {source.path}: set them in the environment (or a profile or IAM role), "
                "or `unsigned: true` for a public bucket"
            ) from None
        except ClientError as error:
            raise SourceError(f"cannot list {source.path}: {error.response['Error'].get('Code')}") from None
        if not keys:
            raise SourceError(f"no {'/'.join(WARC_SUFFIXES)} files match {source.pattern!r} under {source.path}")
        records = _download_all(client, bucket, keys, warc_dir, cache_dir, source.endpoint_url,
                                source.max_attempts, backoff_seconds, log)
        _write_json(out / "sources.json", {"kind": "warc_dir", "bucket": bucket, "prefix": prefix, "files": records})
        return {"files": len(records), "location": source.path}
    folder = resolve_path(source.path)
    if not folder.is_dir():
        raise SourceError(f"{folder} is not a folder")
    candidates = folder.rglob("*") if source.recursive else folder.iterdir()
    files = sorted(p for p in candidates if p.is_file() and is_warc_name(p.name) and fnmatch.fnmatch(p.name, source.pattern))
    if not files:
        raise SourceError(f"no {'/'.join(WARC_SUFFIXES)} files match {source.pattern!r} in {folder}")
    for path in files:
        target = warc_dir / path.name
        if target.exists():
            raise SourceError(f"two source files are both named {path.name}")
        shutil.copyfile(path, target)
    return {"files": len(files), "location": str(folder)}


def fetch_common_crawl(source: CommonCrawlSource, out: Path, *, cache_dir: Path, backoff_seconds: float = 1.0,
                       log: Log = print) -> dict:
    client = s3_client(source.endpoint_url, max_attempts=source.max_attempts, unsigned=True)  # a public bucket
    listing = crawl_listing(client, source.bucket, source.crawl, source.file_type)
    keys = sample_paths(listing, source.files, source.seed)
    if len(keys) < source.files:
        log(f"{source.crawl} lists only {len(listing)} {source.file_type} files; taking all of them")
    log(f"{source.crawl}: {len(keys)} of {len(listing)} {source.file_type} files (seed {source.seed})")
    records = _download_all(client, source.bucket, keys, out / "warc", cache_dir, source.endpoint_url,
                            source.max_attempts, backoff_seconds, log)
    _write_json(out / "sources.json", {
        "kind": "common_crawl", "bucket": source.bucket, "crawl": source.crawl, "file_type": source.file_type,
        "listed": len(listing), "seed": source.seed, "files": records,
    })
    return {"crawl": source.crawl, "listed": len(listing), "files": len(records)}


def crawl_settings(source: SeedCrawlSource) -> CrawlSettings:
    return CrawlSettings(
        user_agent=source.user_agent,
        allowed_domains=tuple(d.lower().lstrip(".") for d in source.allowed_domains),
        max_depth=source.max_depth,
        max_pages=source.max_pages,
        max_bytes_per_page=source.max_bytes_per_page,
        delay_seconds=source.delay_seconds,
        timeout_seconds=source.timeout_seconds,
        page_timeout_seconds=source.page_timeout_seconds,
        max_redirects=source.max_redirects,
        allow_private_networks=source.allow_private_networks,
        ca_bundle=str(resolve_path(source.ca_bundle)) if source.ca_bundle else None,
    )


def fetch_seed_crawl(source: SeedCrawlSource, out: Path, *, snapshot: str, log: Log = print) -> dict:
    stats = crawl_to_warc(
        source.seeds, out / "warc" / f"{snapshot}-00000.warc.gz", out / "crawl_log.jsonl", crawl_settings(source), log=log
    )
    if not stats["responses"]:
        raise SourceError(f"the seed crawl fetched nothing; outcomes: {stats['outcomes']} (see crawl_log.jsonl)")
    return {k: v for k, v in stats.items() if k != "outcomes"} | {f"outcome_{k}": v for k, v in stats["outcomes"].items()}


def fetch_snapshot(source, out: Path, *, snapshot: str, cache_dir: Path, backoff_seconds: float = 1.0, log: Log = print) -> dict:
    """Fill `out/warc/` from `source`; returns a flat summary for the asset's metadata."""
    (out / "warc").mkdir(parents=True, exist_ok=True)
    if isinstance(source, SampleSource):
        return fetch_sample(source, out)
    if isinstance(source, WarcDirSource):
        return fetch_warc_dir(source, out, cache_dir=cache_dir, backoff_seconds=backoff_seconds, log=log)
    if isinstance(source, CommonCrawlSource):
        return fetch_common_crawl(source, out, cache_dir=cache_dir, backoff_seconds=backoff_seconds, log=log)
    if isinstance(source, SeedCrawlSource):
        return fetch_seed_crawl(source, out, snapshot=snapshot, log=log)
    raise SourceError(f"unknown source kind {getattr(source, 'kind', source)!r}")


# ---------------------------------------------------------------------------------------------
# Discovery (for the refresh schedule)
# ---------------------------------------------------------------------------------------------

def discover_snapshots(raw: RawCrawlConfig, known: set[str], today: date, *, log: Log = print) -> list[str]:
    """Snapshots the refresh templates make available that are not partitions yet, sorted."""
    refresh, new = raw.refresh, []
    template = refresh.common_crawl
    if template is not None:
        client = s3_client(template.endpoint_url, max_attempts=template.max_attempts, unsigned=True)
        for crawl in list_common_crawl_ids(client, template.bucket):
            if crawl < refresh.common_crawl_since or crawl in known:
                continue
            # A crawl's folder appears while it is uploaded; its listing comes last.
            if _object_exists(client, template.bucket, f"crawl-data/{crawl}/{template.file_type}.paths.gz"):
                new.append(crawl)
            else:
                log(f"{crawl} has no {template.file_type}.paths.gz yet; not adding it")
    if refresh.seed_crawl is not None:
        dated = f"seed-{today:%Y-%m-%d}"
        if dated not in known:
            new.append(dated)
    return sorted(new)
