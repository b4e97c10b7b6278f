"""raw_crawl: the WARC files of one crawl snapshot, with a manifest (sizes, sha256, records).

Where the files come from (sample, local/S3 folder, Common Crawl, seed crawl) is the snapshot's
source in `raw_crawl.snapshots` or the refresh template its name matches; engine/sources.py.
"""
import time

import dagster as dg

from engine.sources import SourceError, fetch_snapshot, source_for_snapshot
from engine.warc_manifest import describe_warc_files
from workflows.config import state_dir
from workflows.kiln import KilnResource, markdown_table, stage, write_json


@stage("raw_crawl", "ingest", partitioned=True)
def raw_crawl(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    snapshot = context.partition_key
    try:
        source = source_for_snapshot(kiln.config.raw_crawl, snapshot)
    except SourceError as error:
        raise dg.Failure(str(error)) from None
    with kiln.staging(context) as out:
        try:
            # Downloads are cached (and resumed) outside the staging folder, which a failure discards.
            summary = fetch_snapshot(source, out, snapshot=snapshot, cache_dir=state_dir() / "cache" / "raw_crawl",
                                     log=context.log.info)
        except SourceError as error:
            raise dg.Failure(f"raw_crawl[{snapshot}] ({source.kind} source): {error}") from None
        files = describe_warc_files(out / "warc")
        write_json(out / "files.json", files)
    return kiln.publish(
        context,
        out,
        counts={"files": len(files), "bytes": sum(f["size"] for f in files), "records": sum(f["records"] for f in files)},
        metadata={
            "source": source.kind,
            "files": dg.MetadataValue.md(markdown_table(files, ["name", "size", "records", "sha256"])),
            **{f"{source.kind}_{k}": v for k, v in summary.items() if isinstance(v, (int, str))},
        },
        started=started,
    )
