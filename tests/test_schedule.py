"""The crawl refresh schedule and the automation that carries a new snapshot downstream.

Dagster's own test utilities throughout: build_schedule_context on instance_for_test (a schedule
context needs a persistent instance), evaluate_automation_conditions on an ephemeral instance.
The only server is moto's S3 on 127.0.0.1, standing in for Common Crawl.
"""
import gzip
from datetime import datetime, timezone

import boto3
import dagster as dg
import pytest

from jobs import PER_SNAPSHOT, build_refresh_schedule, curate_snapshot_job
from workflows.config import parse_config
from workflows.kiln import SNAPSHOTS


@pytest.fixture(scope="module")
def fake_common_crawl():
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "kiln-test-key")
        env.setenv("AWS_SECRET_ACCESS_KEY", "kiln-test-secret")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        admin = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        admin.create_bucket(Bucket="commoncrawl", ACL="public-read")
        listing = gzip.compress(b"crawl-data/x/segments/1/warc/a.warc.gz\n")
        for crawl in ("CC-MAIN-2024-18", "CC-MAIN-2024-22", "CC-MAIN-2024-26"):
            admin.put_object(Bucket="commoncrawl", Key=f"crawl-data/{crawl}/warc.paths.gz", Body=listing, ACL="public-read")
        # Still uploading: segments are there, the listing is not yet.
        admin.put_object(Bucket="commoncrawl", Key="crawl-data/CC-MAIN-2024-30/segments/1/warc/a.warc.gz", Body=b"x",
                         ACL="public-read")
        admin.put_object(Bucket="commoncrawl", Key="crawl-data/CC-NEWS/2024/06/x.warc.gz", Body=b"x", ACL="public-read")
        yield endpoint
        server.stop()


def refresh_config(endpoint: str | None, **refresh):
    return parse_config({"raw_crawl": {"refresh": {
        "cron": "0 6 * * *",
        "common_crawl": {"kind": "common_crawl", "files": 2, "endpoint_url": endpoint, "max_attempts": 1},
        "common_crawl_since": "CC-MAIN-2024-22",
        "seed_crawl": {"kind": "seed_crawl", "seeds": ["https://example.org/"]},
        **refresh,
    }}})


def tick(schedule, instance, when: datetime):
    from workflows.definitions import ALL_ASSETS
    from workflows.kiln import KilnResource

    repository = dg.Definitions(jobs=[curate_snapshot_job], schedules=[schedule], assets=ALL_ASSETS,
                                resources={"kiln": KilnResource()}).get_repository_def()
    context = dg.build_schedule_context(instance=instance, scheduled_execution_time=when, repository_def=repository)
    return schedule.evaluate_tick(context)


def test_refresh_adds_new_crawls_and_todays_seed_crawl_and_curates_them(fake_common_crawl):
    schedule = build_refresh_schedule(refresh_config(fake_common_crawl))
    with dg.instance_for_test() as instance:
        _refresh_ticks(schedule, instance)


def _refresh_ticks(schedule, instance):
    instance.add_dynamic_partitions(SNAPSHOTS.name, ["sample", "CC-MAIN-2024-22"])

    first = tick(schedule, instance, datetime(2024, 6, 1, 6, tzinfo=timezone.utc))
    # 2024-18 is older than common_crawl_since, 2024-22 is known, 2024-30 has no listing yet.
    assert [r.partition_key for r in first.run_requests] == ["CC-MAIN-2024-26", "seed-2024-06-01"]
    assert all(r.run_key == f"snapshot-{r.partition_key}" for r in first.run_requests)
    assert all(r.tags["dagster/partition"] == r.partition_key for r in first.run_requests)
    assert set(instance.get_dynamic_partitions(SNAPSHOTS.name)) == {
        "sample", "CC-MAIN-2024-22", "CC-MAIN-2024-26", "seed-2024-06-01"}

    again = tick(schedule, instance, datetime(2024, 6, 1, 6, tzinfo=timezone.utc))
    assert again.run_requests == [] and "no new snapshots" in again.skip_message

    next_day = tick(schedule, instance, datetime(2024, 6, 2, 6, tzinfo=timezone.utc))
    assert [r.partition_key for r in next_day.run_requests] == ["seed-2024-06-02"]


def test_refresh_without_templates_skips_and_reads_nothing():
    schedule = build_refresh_schedule(parse_config({"raw_crawl": {"refresh": {"cron": "30 2 * * 1"}}}))
    assert schedule.cron_schedule == "30 2 * * 1"
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    assert schedule.job_name == "curate_snapshot"
    with dg.instance_for_test() as instance:
        result = tick(schedule, instance, datetime(2024, 6, 3, 2, 30, tzinfo=timezone.utc))
    assert result.run_requests == [] and result.skip_message


def test_code_location_has_the_schedule_and_the_automation_sensor():
    from workflows.definitions import defs

    repository = defs.get_repository_def()
    assert repository.get_schedule_def("snapshot_refresh").cron_schedule == "0 6 * * *"
    sensor = repository.get_sensor_def("snapshot_automation")
    assert sensor.default_status == dg.DefaultSensorStatus.STOPPED
    graph = defs.resolve_asset_graph()
    automated = {k.to_user_string() for k in graph.get_all_asset_keys() if graph.get(k).automation_condition is not None}
    assert automated == set(PER_SNAPSHOT[1:])  # raw_crawl is started by the job, the rest follow


def _land(instance, asset: str, partition: str | None = None) -> None:
    instance.report_runless_asset_event(dg.AssetMaterialization(asset, partition=partition))


def _requested(result) -> dict[str, set]:
    from workflows.definitions import defs

    found = {}
    for key in defs.resolve_asset_graph().get_all_asset_keys():
        partitions = result.get_requested_partitions(key)
        if partitions:
            found[key.to_user_string()] = partitions
    return found


def test_a_new_snapshot_flows_downstream_as_its_inputs_land():
    from workflows.definitions import defs

    instance = dg.DagsterInstance.ephemeral()
    for asset in ("quality_classifier", "tokenizer"):  # trained earlier on older snapshots
        _land(instance, asset)
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    assert result.total_requested == 0

    instance.add_dynamic_partitions(SNAPSHOTS.name, ["CC-MAIN-2024-26"])
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert result.total_requested == 0  # nothing runs before raw_crawl has landed

    _land(instance, "raw_crawl", "CC-MAIN-2024-26")
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    # One request for the whole chain: inputs requested in the same tick do not count as missing.
    assert _requested(result) == {asset: {"CC-MAIN-2024-26"} for asset in PER_SNAPSHOT[1:]}

    result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert result.total_requested == 0  # requested once, not on every tick


def test_a_curate_run_is_not_repeated_and_tokenized_follows():
    """The refresh's curate_snapshot run materializes raw_crawl → deduplicated in one go; the
    conditions must not request those again, only tokenized, which that job leaves out."""
    from workflows.definitions import defs

    instance = dg.DagsterInstance.ephemeral()
    for asset in ("quality_classifier", "tokenizer"):
        _land(instance, asset)
    instance.add_dynamic_partitions(SNAPSHOTS.name, ["seed-2024-06-01"])
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    for asset in PER_SNAPSHOT[:-1]:
        _land(instance, asset, "seed-2024-06-01")
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert _requested(result) == {"tokenized": {"seed-2024-06-01"}}

    _land(instance, "tokenized", "seed-2024-06-01")
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert result.total_requested == 0

    # A retrained tokenizer makes every tokenized snapshot stale: it is requested again.
    _land(instance, "tokenizer")
    result = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=result.cursor)
    assert _requested(result) == {"tokenized": {"seed-2024-06-01"}}
