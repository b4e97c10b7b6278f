"""An `s3://bucket/prefix` storage root, through boto3.

Same layout and rules as a local root: `<prefix>/<asset>/<partition>/<data_version>/...`, then
`_MANIFEST.json`, then `_SUCCESS` last, then the partition's `_LATEST` pointer (and, for stages
with checks, `_CHECKS.json`). Readers only
take versions that hold `_SUCCESS`.

Stages keep writing into a LOCAL staging folder (Spark here has no hadoop-aws jar, so it cannot
read or write s3a:// itself). Publishing hashes that folder with the same `content_hash` as a
local root (so data versions are identical between roots), uploads every file, checks the
listing against what was staged, and only then writes the manifest and the markers. Reading an
artifact downloads it once into a local read-only copy keyed by data version: a published
version never changes, so the copy stays valid.

Requests use botocore's standard retry mode (throttling, 5xx and dropped connections are
retried with backoff). Credentials come only from boto3's default chain (environment, profile,
IAM role): never from the config, and they are written nowhere.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from pathlib import Path
from urllib.parse import urlsplit

from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.exceptions import ClientError

from engine.sources import s3_client
from workflows.storage import (
    CHECKS,
    LATEST,
    MANIFEST,
    SUCCESS,
    UNPARTITIONED,
    Artifact,
    LocalStorage,
    StorageError,
    content_hash,
)

_MISSING = {"404", "NoSuchKey", "NotFound"}


def _reason(error: Exception) -> str:
    """A short, credential-free description of a boto3/botocore failure."""
    if isinstance(error, ClientError):
        err = error.response.get("Error", {})
        return f"{err.get('Code', 'error')}: {err.get('Message', '')}".rstrip(": ")
    return f"{type(error).__name__}: {error}"


def storage_client(endpoint_url: str | None, max_attempts: int, timeout_s: float = 60):
    """The storage root's S3 client: `engine.sources.s3_client` with one timeout for both phases."""
    return s3_client(endpoint_url, max_attempts=max_attempts, connect_timeout=timeout_s, read_timeout=timeout_s)


def _read_only(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


class S3Storage(LocalStorage):
    """Storage root in an S3 (or S3-compatible) bucket, with a local work and read-cache folder.

    Staging folders (and the cleanup of dead writers' ones) are LocalStorage's, under the local
    folder; publishing, reading and listing go to the bucket."""

    def __init__(self, root: str, local_dir: str | Path, *, endpoint_url: str | None = None,
                 max_attempts: int = 5, upload_concurrency: int = 4):
        from engine.sources import parse_s3_url

        self.root = root.rstrip("/")
        self.bucket, self.prefix = parse_s3_url(self.root)  # prefix is "" or ends in "/"
        self.endpoint_url = endpoint_url
        self.max_attempts = max_attempts
        self.client = storage_client(endpoint_url, max_attempts)
        self._transfer = TransferConfig(max_concurrency=upload_concurrency, use_threads=upload_concurrency > 1)
        endpoint = urlsplit(endpoint_url).netloc.replace(":", "_") if endpoint_url else "aws"
        self.local_root = Path(local_dir).expanduser().resolve() / endpoint / self.bucket / self.prefix

    # -- layout ---------------------------------------------------------------------------------

    def partition_dir(self, asset: str, partition: str | None) -> Path:
        """The LOCAL folder of `asset[partition]`: staging, work folders (`.run-*`) and read copies."""
        return self.local_root / asset / (partition or UNPARTITIONED)

    def _key(self, asset: str, partition: str | None, *parts: str) -> str:
        return self.prefix + "/".join([asset, partition or UNPARTITIONED, *parts])

    def uri(self, asset: str, partition: str | None, data_version: str) -> str:
        return f"s3://{self.bucket}/{self._key(asset, partition, data_version)}"

    # -- small S3 helpers -----------------------------------------------------------------------

    def _exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in _MISSING:
                return False
            raise

    def _listing(self, prefix: str) -> dict[str, int]:
        found = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                found[item["Key"]] = item["Size"]
        return found

    def _put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=key, Body=body)

    # -- the storage interface ------------------------------------------------------------------

    def publish(
        self,
        staging: Path,
        asset: str,
        partition: str | None,
        manifest: dict,
        version_files: list[str] | None = None,
        checks: dict[str, bool] | None = None,
        failed_blocking: list[str] = (),
    ) -> Artifact:
        data_version = content_hash(staging, version_files)[:16]
        base = self._key(asset, partition, data_version) + "/"
        uri = self.uri(asset, partition, data_version)
        name = f"{asset}[{partition or UNPARTITIONED}]"
        try:
            if self._exists(base + SUCCESS):
                # Same content already published (a rerun with nothing changed): keep the original.
                self.discard(staging)
            else:
                won = self._upload(staging, base, uri, {**manifest, "asset": asset, "partition": partition,
                                                        "data_version": data_version})
                if won:
                    self._keep_local_copy(staging, self.partition_dir(asset, partition) / data_version)
                else:
                    self.discard(staging)
        except StorageError:
            raise
        except Exception as error:  # botocore/s3transfer errors, after the configured retries
            raise StorageError(
                f"publishing {name} to {uri} failed after up to {self.max_attempts} attempts per request "
                f"({_reason(error)}). It was not marked complete (no {SUCCESS}); the staged files stay in {staging}."
            ) from error
        try:
            self.settle_latest(asset, partition, data_version, checks, list(failed_blocking))
        except Exception as error:
            raise StorageError(
                f"{uri} is published and complete ({SUCCESS} written), but the partition's {LATEST} pointer "
                f"could not be settled ({_reason(error)}); readers still get the previous version. "
                f"Re-running the stage republishes nothing and retries the pointer."
            ) from error
        return self.artifact(asset, partition, data_version)

    def _upload(self, staging: Path, base: str, uri: str, manifest: dict) -> bool:
        """Upload, verify, then mark complete; False if a concurrent publisher completed it first."""
        files = {}
        for path in sorted(staging.rglob("*")):
            rel = path.relative_to(staging).as_posix()
            if path.is_file() and rel not in (SUCCESS, MANIFEST):
                files[rel] = path
        with create_transfer_manager(self.client, self._transfer) as manager:
            futures = [manager.upload(str(path), self.bucket, base + rel) for rel, path in files.items()]
            for future in futures:
                future.result()
        if self._exists(base + SUCCESS):
            # A concurrent publisher of this version completed it while we uploaded: its manifest
            # and files stand (the data files are byte-identical; logs and timings may differ).
            return False
        # Every staged file must be listed with its size before anything marks the version complete.
        listed = self._listing(base)
        wrong = sorted(rel for rel, path in files.items() if listed.get(base + rel) != path.stat().st_size)
        if wrong and self._exists(base + SUCCESS):
            return False  # overwritten by a concurrent publisher that has completed meanwhile
        if wrong:
            raise StorageError(f"{uri}: {len(wrong)} uploaded files are missing or have the wrong size "
                               f"(first: {wrong[0]}); not marked complete")
        # Left over by an earlier run of this version that was killed before its _SUCCESS. Never the
        # markers: a concurrent publisher of the same version may have completed it meanwhile.
        for key in sorted(set(listed) - {base + rel for rel in files} - {base + MANIFEST, base + SUCCESS}):
            self.client.delete_object(Bucket=self.bucket, Key=key)
        manifest = {**manifest, "files": {rel: path.stat().st_size for rel, path in files.items()}}
        text = json.dumps(manifest, indent=2, sort_keys=True, default=str)
        (staging / MANIFEST).write_text(text)
        self._put(base + MANIFEST, text.encode())
        self._put(base + SUCCESS, b"")
        (staging / SUCCESS).write_text("")
        return True

    def _keep_local_copy(self, folder: Path, final: Path) -> None:
        """The published staging folder becomes the read copy, so this process need not download it."""
        if final.exists():
            self.discard(folder)
            return
        _read_only(folder)
        try:
            os.rename(folder, final)
            self._release(folder)
        except OSError:  # another process put its copy there first
            self.discard(folder)

    def latest(self, asset: str, partition: str | None) -> Artifact:
        try:
            version = self._get_latest(asset, partition)
            if version is None:
                raise StorageError(self._no_latest(asset, partition))
        except ClientError as error:
            raise StorageError(f"cannot read the {LATEST} pointer of s3://{self.bucket}/"
                               f"{self._key(asset, partition)}: {_reason(error)}") from None
        return self.artifact(asset, partition, version)

    def _get_object(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") in _MISSING:
                return None
            raise

    def _get_latest(self, asset: str, partition: str | None) -> str | None:
        body = self._get_object(self._key(asset, partition, LATEST))
        return body.decode().strip() if body is not None else None

    def _set_latest(self, asset: str, partition: str | None, version: str | None) -> None:
        key = self._key(asset, partition, LATEST)
        if version is None:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        else:
            self._put(key, version.encode())

    def _read_checks(self, asset: str, partition: str | None) -> dict:
        body = self._get_object(self._key(asset, partition, CHECKS))
        return json.loads(body) if body is not None else {}

    def _write_checks(self, asset: str, partition: str | None, record: dict) -> None:
        self._put(self._key(asset, partition, CHECKS), json.dumps(record, indent=2, sort_keys=True).encode())

    def artifact(self, asset: str, partition: str | None, data_version: str) -> Artifact:
        """The complete artifact with this data version, as a local read-only copy (downloaded once)."""
        local = self.partition_dir(asset, partition) / data_version
        uri = self.uri(asset, partition, data_version)
        if not (local / SUCCESS).is_file():
            base = self._key(asset, partition, data_version) + "/"
            try:
                if not self._exists(base + SUCCESS):
                    raise StorageError(f"{uri} has no {SUCCESS} marker: its run did not finish")
                self._download(base, local, uri)
            except StorageError:
                raise
            except Exception as error:
                raise StorageError(f"cannot download {uri}: {_reason(error)}") from error
        return Artifact(asset, partition or UNPARTITIONED, data_version, local, uri)

    def _download(self, base: str, local: Path, uri: str) -> None:
        listed = self._listing(base)
        tmp = local.parent / f".download-{uuid.uuid4().hex}"
        try:
            with create_transfer_manager(self.client, self._transfer) as manager:
                futures = []
                for key in sorted(listed):
                    dest = tmp / key[len(base):]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    futures.append(manager.download(self.bucket, key, str(dest)))
                for future in futures:
                    future.result()
            short = [k for k, size in listed.items() if (tmp / k[len(base):]).stat().st_size != size]
            if short:
                raise StorageError(f"{uri}: downloaded {len(short)} files with the wrong size")
            _read_only(tmp)
            try:
                os.rename(tmp, local)  # the copy appears whole or not at all
            except OSError:
                if not (local / SUCCESS).is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def complete_versions(self, asset: str, partition: str | None) -> dict[str, float]:
        """Every complete data version of `asset[partition]` and when its `_SUCCESS` was written (epoch s)."""
        prefix = self._key(asset, partition) + "/"
        versions = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                version = common["Prefix"][len(prefix):].rstrip("/")
                try:
                    head = self.client.head_object(Bucket=self.bucket, Key=f"{prefix}{version}/{SUCCESS}")
                except ClientError as error:
                    if error.response.get("Error", {}).get("Code") in _MISSING:
                        continue
                    raise
                versions[version] = head["LastModified"].timestamp()
        return versions
