"""The storage root: every artifact is a folder `<root>/<asset>/<partition>/<data_version>/`.

Write-then-mark-done: a stage writes into a hidden staging folder, the folder is renamed to its
content hash, `_MANIFEST.json` is written, and `_SUCCESS` comes last. Readers only ever resolve
folders that hold `_SUCCESS`, so a killed run leaves nothing that could pass as complete.

Concurrency (local root): publishing holds an exclusive `flock` on the partition's `.publish.lock`,
so two runs of the same partition never interleave: the second finds the first's `_SUCCESS` and
drops its own identical staging folder, or publishes its different content beside it. While a
process writes a staging folder it holds a `flock` on `.staging-<id>.lock` next to it; the kernel
drops that lock when the process dies, so the next `new_staging_dir` of the partition removes the
staging folders of dead writers only (never a live run's, on this host or another sharing the
mount). Staging folders without a lock file (older Kiln versions) are left alone.

The root is a local (or mounted) folder, or `s3://bucket/prefix` (`S3Storage`, through boto3):
stages still write into a local staging folder, and publishing uploads it under the same layout.
"""
from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from workflows.s3_storage import S3Storage

SUCCESS = "_SUCCESS"
MANIFEST = "_MANIFEST.json"
LATEST = "_LATEST"
# Per partition: each version's blocking-check outcome at its most recent publish (a version's own
# folder never changes after _SUCCESS, but the same content can pass one run's checks and fail the next).
CHECKS = "_CHECKS.json"
PUBLISH_LOCK = ".publish.lock"
STAGING_PREFIX = ".staging-"
# Staging folder -> its held owner lock, per process (not per LocalStorage object, so dropping or
# recreating a storage object never releases a lock while this process still writes the folder).
_OWNER_LOCKS: dict[Path, IO] = {}
UNPARTITIONED = "all"


class StorageError(RuntimeError):
    pass


@dataclass(frozen=True)
class Artifact:
    """A published, complete artifact folder and its content-hash data version."""

    asset: str
    partition: str
    data_version: str
    path: Path  # a local folder: the artifact itself, or its read-only local copy for an S3 root
    uri: str | None = None  # where it is stored, when that is not `path` (s3://...)

    @property
    def location(self) -> str:
        return self.uri or str(self.path)

    def manifest(self) -> dict:
        return json.loads((self.path / MANIFEST).read_text())


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def content_hash(folder: Path, include: list[str] | None = None) -> str:
    """Hash of relative paths and bytes of the files in `folder` (optionally only glob matches).

    Stages whose output holds timings (logs, throughput figures) name the deterministic files
    in `include` so that a rerun with the same inputs keeps its data version.
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel in (SUCCESS, MANIFEST):
            continue
        if include is not None and not any(fnmatch.fnmatch(rel, pattern) for pattern in include):
            continue
        digest.update(rel.encode() + b"\0" + file_sha256(path).encode() + b"\n")
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing); released on exit or if the process dies."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class LocalStorage:
    """Storage root on a local (or mounted shared) file system."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()

    def partition_dir(self, asset: str, partition: str | None) -> Path:
        return self.root / asset / (partition or UNPARTITIONED)

    def new_staging_dir(self, asset: str, partition: str | None) -> Path:
        folder = self.partition_dir(asset, partition)
        folder.mkdir(parents=True, exist_ok=True)
        self.remove_dead_staging(asset, partition)
        while True:
            staging = folder / f"{STAGING_PREFIX}{uuid.uuid4().hex}"
            owner = open(staging.with_name(staging.name + ".lock"), "a")
            try:  # the lock comes before the folder, so no one sees a staging folder without a live owner
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a concurrent cleaner opened the new file first: take another name
                owner.close()
                continue
            staging.mkdir()
            _OWNER_LOCKS[staging] = owner
            return staging

    def remove_dead_staging(self, asset: str, partition: str | None) -> list[Path]:
        """Remove the staging folders of `asset[partition]` whose writer has died; returns them."""
        folder = self.partition_dir(asset, partition)
        removed = []
        for lock in folder.glob(f"{STAGING_PREFIX}*.lock") if folder.is_dir() else []:
            with open(lock, "a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # its writer is alive
                    continue
                staging = lock.with_name(lock.name[: -len(".lock")])
                if staging.exists():
                    shutil.rmtree(staging, ignore_errors=True)
                    removed.append(staging)
                lock.unlink(missing_ok=True)
        return removed

    def _release(self, staging: Path) -> None:
        owner = _OWNER_LOCKS.pop(staging, None)
        if owner is not None:
            Path(owner.name).unlink(missing_ok=True)
            owner.close()

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)
        self._release(staging)

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
        """Publish `staging` as a complete version and settle `_LATEST` (`settle_latest`)."""
        data_version = content_hash(staging, version_files)[:16]
        folder = self.partition_dir(asset, partition)
        final = folder / data_version
        # One publisher of the partition at a time (other processes, other hosts on the mount).
        with _exclusive(folder / PUBLISH_LOCK):
            if (final / SUCCESS).exists():
                # Same content already published (a rerun, or a concurrent run that won): keep it.
                self.discard(staging)
            else:
                if final.exists():  # no _SUCCESS while we hold the lock: its publisher died mid-way
                    shutil.rmtree(final)
                os.replace(staging, final)
                self._release(staging)
                manifest = {**manifest, "asset": asset, "partition": partition, "data_version": data_version}
                _write_atomic(final / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str))
                (final / SUCCESS).write_text("")
            self.settle_latest(asset, partition, data_version, checks, list(failed_blocking))
        return Artifact(asset, partition or UNPARTITIONED, data_version, final)

    def settle_latest(self, asset: str, partition: str | None, version: str, checks: dict[str, bool] | None,
                      failed_blocking: list[str]) -> None:
        """Record `version`'s check outcome, then point `_LATEST` at it if no blocking check failed.

        If one failed, `_LATEST` stays where it was, or, when it points at this very content (the
        same bytes now fail a tightened check), moves back to the newest complete version that
        passed; with none left the pointer is removed and `latest` says why."""
        record = self._read_checks(asset, partition)
        if checks is not None or version in record:
            record[version] = {"checks": checks or {}, "failed_blocking_checks": failed_blocking}
            self._write_checks(asset, partition, record)
        if not failed_blocking:
            self._set_latest(asset, partition, version)
        elif self._get_latest(asset, partition) == version:
            done = self.complete_versions(asset, partition)
            passed = [v for v in done if v != version and not record.get(v, {}).get("failed_blocking_checks")]
            self._set_latest(asset, partition, max(passed, key=lambda v: (done[v], v), default=None))

    def failed_checks(self, asset: str, partition: str | None, version: str) -> list[str]:
        """The blocking checks `version` failed at its most recent publish ([] if none or never checked)."""
        return self._read_checks(asset, partition).get(version, {}).get("failed_blocking_checks", [])

    def latest(self, asset: str, partition: str | None) -> Artifact:
        version = self._get_latest(asset, partition)
        if version is None:
            raise StorageError(self._no_latest(asset, partition))
        return self.artifact(asset, partition, version)

    def _no_latest(self, asset: str, partition: str | None) -> str:
        name = f"{asset}[{partition or UNPARTITIONED}]"
        failed = sorted(v for v, r in self._read_checks(asset, partition).items() if r.get("failed_blocking_checks"))
        if failed:
            return (f"{name} has no version that passed its blocking checks (failed: {', '.join(failed)}; see "
                    f"{CHECKS}): fix the config or the data and materialize it again")
        return f"{name} has not been materialized under {self.root}"

    # -- the partition's pointer and check record (S3Storage keeps them in the bucket) ---------------

    def _get_latest(self, asset: str, partition: str | None) -> str | None:
        pointer = self.partition_dir(asset, partition) / LATEST
        return pointer.read_text().strip() if pointer.exists() else None

    def _set_latest(self, asset: str, partition: str | None, version: str | None) -> None:
        pointer = self.partition_dir(asset, partition) / LATEST
        if version is None:
            pointer.unlink(missing_ok=True)
        else:
            _write_atomic(pointer, version)

    def _read_checks(self, asset: str, partition: str | None) -> dict:
        path = self.partition_dir(asset, partition) / CHECKS
        return json.loads(path.read_text()) if path.exists() else {}

    def _write_checks(self, asset: str, partition: str | None, record: dict) -> None:
        _write_atomic(self.partition_dir(asset, partition) / CHECKS, json.dumps(record, indent=2, sort_keys=True))

    def artifact(self, asset: str, partition: str | None, data_version: str) -> Artifact:
        """The complete artifact `asset[partition]` with this data version (not only the latest)."""
        final = self.partition_dir(asset, partition) / data_version
        if not (final / SUCCESS).exists():
            raise StorageError(f"{final} has no {SUCCESS} marker: its run did not finish")
        return Artifact(asset, partition or UNPARTITIONED, data_version, final)

    def complete_versions(self, asset: str, partition: str | None) -> dict[str, float]:
        """Every complete data version of `asset[partition]` and when it was marked complete (epoch s)."""
        folder = self.partition_dir(asset, partition)
        if not folder.is_dir():
            return {}
        return {p.name: (p / SUCCESS).stat().st_mtime for p in folder.iterdir()
                if not p.name.startswith(".") and (p / SUCCESS).is_file()}

    def uri(self, asset: str, partition: str | None, data_version: str) -> str:
        return str(self.partition_dir(asset, partition) / data_version)


def open_storage(root: str | Path, *, endpoint_url: str | None = None, max_attempts: int = 5,
                 upload_concurrency: int = 4, local_dir: str | Path | None = None) -> "LocalStorage | S3Storage":
    """A local root, or an `s3://bucket/prefix` root (S3 settings and its local folder apply to it only)."""
    if str(root).startswith("s3://"):
        from workflows.s3_storage import S3Storage

        if local_dir is None:
            from workflows.config import state_dir

            local_dir = state_dir() / "s3"
        return S3Storage(str(root), local_dir, endpoint_url=endpoint_url, max_attempts=max_attempts,
                         upload_concurrency=upload_concurrency)
    return LocalStorage(root)


def configured_storage(config) -> "LocalStorage | S3Storage":
    """The storage root a pipeline config names (`storage` section); default `<state>/storage`."""
    from workflows.config import resolve_path, state_dir

    cfg = config.storage
    return open_storage(cfg.root or state_dir() / "storage", endpoint_url=cfg.endpoint_url,
                        max_attempts=cfg.max_attempts, upload_concurrency=cfg.upload_concurrency,
                        local_dir=resolve_path(cfg.local_dir) if cfg.local_dir else None)
