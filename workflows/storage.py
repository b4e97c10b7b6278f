"""The storage root: every artifact is a folder `<root>/<asset>/<partition>/<data_version>/`.

Write-then-mark-done: a stage writes into a hidden staging folder, the folder is renamed to its
content hash, `_MANIFEST.json` is written, and `_SUCCESS` comes last. Readers only ever resolve
folders that hold `_SUCCESS`, so a killed run leaves nothing that could pass as complete.
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

SUCCESS = "_SUCCESS"
MANIFEST = "_MANIFEST.json"
LATEST = "_LATEST"
UNPARTITIONED = "all"


class StorageError(RuntimeError):
    pass


@dataclass(frozen=True)
class Artifact:
    """A published, complete artifact folder and its content-hash data version."""

    asset: str
    partition: str
    data_version: str
    path: Path

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


class LocalStorage:
    """Storage root on a local (or mounted shared) file system."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()

    def partition_dir(self, asset: str, partition: str | None) -> Path:
        return self.root / asset / (partition or UNPARTITIONED)

    def new_staging_dir(self, asset: str, partition: str | None) -> Path:
        staging = self.partition_dir(asset, partition) / f".staging-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
        return staging

    def discard(self, staging: Path) -> None:
        shutil.rmtree(staging, ignore_errors=True)

    def publish(
        self,
        staging: Path,
        asset: str,
        partition: str | None,
        manifest: dict,
        version_files: list[str] | None = None,
    ) -> Artifact:
        data_version = content_hash(staging, version_files)[:16]
        final = self.partition_dir(asset, partition) / data_version
        if (final / SUCCESS).exists():
            # Same content already published (a rerun with nothing changed): keep the original.
            self.discard(staging)
        else:
            if final.exists():  # left by a run killed between rename and _SUCCESS
                shutil.rmtree(final)
            os.replace(staging, final)
            manifest = {**manifest, "asset": asset, "partition": partition, "data_version": data_version}
            _write_atomic(final / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str))
            (final / SUCCESS).write_text("")
        _write_atomic(self.partition_dir(asset, partition) / LATEST, data_version)
        return Artifact(asset, partition or UNPARTITIONED, data_version, final)

    def latest(self, asset: str, partition: str | None) -> Artifact:
        pointer = self.partition_dir(asset, partition) / LATEST
        if not pointer.exists():
            raise StorageError(f"{asset}[{partition or UNPARTITIONED}] has not been materialized under {self.root}")
        data_version = pointer.read_text().strip()
        final = self.partition_dir(asset, partition) / data_version
        if not (final / SUCCESS).exists():
            raise StorageError(f"{final} has no {SUCCESS} marker: its run did not finish")
        return Artifact(asset, partition or UNPARTITIONED, data_version, final)


def open_storage(root: str | Path) -> LocalStorage:
    if str(root).startswith("s3://"):
        raise StorageError("s3:// storage roots are not supported yet; use a local or mounted path")
    return LocalStorage(root)
