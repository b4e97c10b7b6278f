"""`kiln trace`: from a training sequence (or a doc_id) back to the crawl.

Resolves a `mixed_shards` artifact (the latest, or the one named by its data version) and then
exactly the artifacts it was built from, by following the inputs recorded in each manifest:
mixed_shards -> tokenized, deduplicated, tokenizer; deduplicated -> filtered, quality_signals;
filtered -> documents. The lookups themselves are engine/trace.py.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from engine.trace import Lineage, SnapshotFolders, format_document, format_sequence, trace_document, trace_sequence
from workflows.config import PipelineConfig, load_config
from workflows.storage import UNPARTITIONED, Artifact, LocalStorage, StorageError, configured_storage

_VERSION = re.compile(r"^[0-9a-f]{1,64}$")


def storage_for(config: PipelineConfig) -> LocalStorage:
    return configured_storage(config)


def artifact_at(storage: LocalStorage, asset: str, partition: str | None, version: str) -> Artifact:
    """The complete artifact of `asset[partition]` with data version `version` (or a unique prefix)."""
    if not _VERSION.match(version):
        raise StorageError(f"{version!r} is not a data version (hex digits)")
    matches = sorted(v for v in storage.complete_versions(asset, partition) if v.startswith(version))
    if version in matches:
        matches = [version]
    if len(matches) != 1:
        found = "no complete artifact" if not matches else f"{len(matches)} artifacts"
        raise StorageError(f"{asset}[{partition or UNPARTITIONED}]: {found} with data version {version!r} under {storage.root}")
    return storage.artifact(asset, partition, matches[0])


def resolve_lineage(storage: LocalStorage, mixed_version: str | None = None) -> Lineage:
    """The mixed_shards artifact and, per snapshot, the exact upstream artifacts it was built from.

    An upstream artifact a manifest names but storage no longer holds is left out (its part of
    the trace reads "unknown") and named in `versions["notes"]`, rather than replaced by a
    newer one that may disagree.
    """
    mixed = storage.latest("mixed_shards", None) if mixed_version is None else artifact_at(
        storage, "mixed_shards", None, mixed_version)
    inputs = mixed.manifest().get("inputs", {})
    notes: list[str] = []

    def upstream(asset: str, partition: str | None, version: str | None) -> Artifact | None:
        if not version:
            notes.append(f"{asset}[{partition or UNPARTITIONED}] is not named in the manifests")
            return None
        try:
            return artifact_at(storage, asset, partition, version)
        except StorageError as missing:
            notes.append(str(missing))
            return None

    tokenizer = upstream("tokenizer", None, inputs.get("tokenizer"))
    snapshots, snapshot_versions = [], {}
    for snapshot in sorted(inputs.get("tokenized") or {}):
        found: dict[str, Artifact] = {}

        def add(asset: str, version: str | None) -> dict:
            artifact = upstream(asset, snapshot, version)
            if artifact is None:
                return {}
            found[asset] = artifact
            return artifact.manifest()

        add("tokenized", inputs["tokenized"][snapshot])
        dedup = add("deduplicated", (inputs.get("deduplicated") or {}).get(snapshot))
        filtered = add("filtered", dedup.get("inputs", {}).get("filtered"))
        add("quality_signals", dedup.get("inputs", {}).get("quality_signals"))
        add("documents", filtered.get("inputs", {}).get("documents"))
        snapshots.append(SnapshotFolders(
            snapshot=snapshot,
            folders={asset: str(a.path) for asset, a in found.items()},
            filter_config=filtered.get("config", {}).get("filters"),
        ))
        snapshot_versions[snapshot] = {asset: a.data_version for asset, a in sorted(found.items())}
    versions = {
        "mixed_shards": mixed.data_version,
        "tokenizer": tokenizer.data_version if tokenizer else None,
        "snapshots": snapshot_versions,
        "notes": notes,
    }
    return Lineage(mixed=str(mixed.path), snapshots=tuple(snapshots),
                   tokenizer=str(tokenizer.path) if tokenizer else None, versions=versions)


def trace(*, seq: int | None = None, doc_id: str | None = None, mixed: str | None = None, bucket: str | None = None,
          storage: LocalStorage | None = None, include_text: bool = False) -> dict:
    """Trace training sequence `seq` (validation row of `bucket` if given) or document `doc_id`."""
    if (seq is None) == (doc_id is None):
        raise ValueError("give exactly one of seq and doc_id")
    lineage = resolve_lineage(storage or storage_for(load_config()), mixed)
    if doc_id is not None:
        return trace_document(lineage, doc_id, include_text=include_text)
    return trace_sequence(lineage, seq, bucket=bucket, include_text=include_text)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "trace", help="trace a training sequence or a document back to its URL, WARC record, signals, "
                      "filter decision and dedup cluster")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--seq", type=int, metavar="N", help="row N of train.bin (of val_<BUCKET>.bin with --val)")
    which.add_argument("--doc-id", metavar="ID", help="a doc_id, also one the filters or dedup removed")
    parser.add_argument("--mixed", metavar="DATA_VERSION", help="mixed_shards data version (or a unique prefix); default: latest")
    parser.add_argument("--val", metavar="BUCKET", help="with --seq: trace a held-out validation row of BUCKET")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def run(args: argparse.Namespace, storage: LocalStorage | None = None) -> int:
    """The `kiln trace` command; returns the exit status."""
    if args.val is not None and args.seq is None:
        print("kiln trace: --val needs --seq", file=sys.stderr)
        return 2
    try:
        result = trace(seq=args.seq, doc_id=args.doc_id, mixed=args.mixed, bucket=args.val, storage=storage)
    except (StorageError, IndexError, KeyError) as error:
        print(f"kiln trace: {error.args[0] if error.args else error}", file=sys.stderr)
        return 1
    for note in result["versions"].get("notes", []):
        print(f"kiln trace: note: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print(format_document(result) if args.doc_id is not None else format_sequence(result))
    return 0
