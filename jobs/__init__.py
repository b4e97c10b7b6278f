"""Jobs, sensors and schedules: process one snapshot end to end, then mix, train and evaluate.

New snapshots arrive two ways: `configured_snapshots_sensor` registers the ones named in the
config, and the `snapshot_refresh` schedule discovers new Common Crawl crawls and dated seed
crawls (engine/sources.py: discover_snapshots). Either starts `curate_snapshot` for the new
partition; `snapshot_automation` then materializes what the job does not cover (tokenized) and
re-runs per-snapshot stages whose inputs changed (the stages' eager conditions, workflows/kiln.py).
All start STOPPED: turning them on is a deployment decision.
"""
from datetime import datetime, timezone

import dagster as dg

from engine.sources import discover_snapshots
from workflows.config import PipelineConfig
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


def build_refresh_schedule(config: PipelineConfig) -> dg.ScheduleDefinition:
    """The crawl refresh on `raw_crawl.refresh.cron`: add discovered snapshots, curate each."""

    @dg.schedule(
        name="snapshot_refresh",
        cron_schedule=config.raw_crawl.refresh.cron,
        execution_timezone="UTC",
        job=curate_snapshot_job,
        default_status=dg.DefaultScheduleStatus.STOPPED,
    )
    def snapshot_refresh(context: dg.ScheduleEvaluationContext):
        when = context.scheduled_execution_time or datetime.now(timezone.utc)
        known = set(context.instance.get_dynamic_partitions(SNAPSHOTS.name))
        new = discover_snapshots(config.raw_crawl, known, when.astimezone(timezone.utc).date(), log=context.log.info)
        if not new:
            yield dg.SkipReason(f"no new snapshots ({len(known)} known)")
            return
        # A schedule can only return run requests (a sensor could return SNAPSHOTS.build_add_request),
        # so the partitions are added through the instance before their runs are requested.
        context.instance.add_dynamic_partitions(SNAPSHOTS.name, new)
        for snapshot in new:
            yield dg.RunRequest(partition_key=snapshot, run_key=f"snapshot-{snapshot}")

    return snapshot_refresh


snapshot_refresh_schedule = build_refresh_schedule(CONFIG)
snapshot_automation_sensor = dg.AutomationConditionSensorDefinition(
    "snapshot_automation",
    target=dg.AssetSelection.assets(*PER_SNAPSHOT[1:]),
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Evaluates the per-snapshot stages' automation conditions (eager: run when inputs land).",
)

JOBS = [curate_snapshot_job, train_job]
SENSORS = [configured_snapshots_sensor, snapshot_automation_sensor]
SCHEDULES = [snapshot_refresh_schedule]
