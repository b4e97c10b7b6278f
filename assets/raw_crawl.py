"""raw_crawl: the WARC files of one crawl snapshot, with a manifest (sizes, sha256, records)."""
import shutil
import time

import dagster as dg

from engine.sample_crawl import generate_sample_crawl
from engine.warc_manifest import describe_warc_files
from workflows.config import SampleSource, resolve_path
from workflows.kiln import KilnResource, markdown_table, stage, write_json


@stage("raw_crawl", "ingest", partitioned=True)
def raw_crawl(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
    started = time.time()
    snapshot = context.partition_key
    source = kiln.config.raw_crawl.snapshots.get(snapshot)
    if source is None:
        raise dg.Failure(
            f"Snapshot {snapshot!r} has no source in raw_crawl.snapshots; configured: {sorted(kiln.config.raw_crawl.snapshots)}"
        )
    with kiln.staging(context) as out:
        warc_dir = out / "warc"
        if isinstance(source, SampleSource):
            summary = generate_sample_crawl(str(warc_dir), seed=source.seed, num_pages=source.pages, num_files=source.files)
            # Ground-truth labels of the generated pages travel beside the WARCs, for tests and reports.
            shutil.move(str(warc_dir / "labels.json"), out / "labels.json")
        else:
            folder = resolve_path(source.path)
            files = sorted(folder.glob(source.pattern))
            if not files:
                raise dg.Failure(f"raw_crawl.snapshots.{snapshot}.path: no files match {source.pattern} in {folder}")
            warc_dir.mkdir()
            for path in files:
                shutil.copyfile(path, warc_dir / path.name)
            summary = {}
        files = describe_warc_files(warc_dir)
        write_json(out / "files.json", files)
    return kiln.publish(
        context,
        out,
        counts={"files": len(files), "bytes": sum(f["size"] for f in files), "records": sum(f["records"] for f in files)},
        metadata={"files": dg.MetadataValue.md(markdown_table(files, ["name", "size", "records", "sha256"])), **{
            f"sample_{k}": v for k, v in summary.items() if isinstance(v, (int, str))
        }},
        started=started,
    )
