"""Jobs and sensors: process one snapshot end to end, then mix, train and evaluate."""
import dagster as dg

from workflows.kiln import CONFIG, SNAPSHOTS

PER_SNAPSHOT = ["raw_crawl", "documents", "quality_signals", "filtered", "deduplicated", "tokenized"]

curate_snapshot_job = dg.define_asset_job(
    "curate_snapshot",
    selection=dg.AssetSelection.assets(*PER_SNAPSHOT[:-1]),
    description="Ingest and curate one crawl snapshot (raw_crawl → deduplicated).",
)
train_job = dg.define_asset_job(
    "mix_train_evaluate",
    selection=dg.AssetSelection.assets("mixed_shards", "checkpoints", "eval_report"),
    description="Mix all tokenized snapshots, train with DeepSpeed ZeRO-3 and write the eval report.",
)


@dg.sensor(job=curate_snapshot_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED)
def configured_snapshots_sensor(context: dg.SensorEvaluationContext) -> dg.SensorResult:
    """Registers snapshots named in the pipeline config as partitions and curates the new ones."""
    known = set(context.instance.get_dynamic_partitions(SNAPSHOTS.name))
    new = sorted(set(CONFIG.raw_crawl.snapshots) - known)
    return dg.SensorResult(
        dynamic_partitions_requests=[SNAPSHOTS.build_add_request(new)] if new else [],
        run_requests=[dg.RunRequest(partition_key=snapshot, run_key=f"snapshot-{snapshot}") for snapshot in new],
    )


JOBS = [curate_snapshot_job, train_job]
SENSORS = [configured_snapshots_sensor]
