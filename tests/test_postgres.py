"""Dagster on Postgres: DAGSTER_PG_* switch the instance to Postgres storage, and a partitioned
materialization is recorded there (runs, materializations, dynamic partitions).

The server: KILN_TEST_PG_* (CI starts one with infra/postgres/local-postgres.sh), else a throwaway one
started here when PostgreSQL's server binaries are installed, else the test skips, or fails when
KILN_REQUIRE_POSTGRES=1 (as in CI).
"""
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import skip_or_fail
from workflows.config import DEFAULT_CONFIG_PATH, REPO_ROOT, ConfigError
from workflows.instance import HEADER, ensure_dagster_home, instance_yaml

PG_SCRIPT = REPO_ROOT / "infra" / "postgres" / "local-postgres.sh"
PG_VARS = ("HOST", "PORT", "USER", "PASSWORD", "DB")
FAKE_ENV = {"DAGSTER_PG_HOST": "db.internal", "DAGSTER_PG_USER": "kiln", "DAGSTER_PG_DB": "kiln",
            "DAGSTER_PG_PASSWORD": "pw-" + secrets.token_hex(8)}


# --- the instance config (fast) ---------------------------------------------------------------------

def test_without_postgres_env_the_instance_is_the_sqlite_base():
    config = yaml.safe_load(instance_yaml({}))
    assert "storage" not in config and config["run_coordinator"]["class"] == "QueuedRunCoordinator"


def test_postgres_env_adds_storage_as_env_references_only():
    text = instance_yaml(FAKE_ENV)
    assert FAKE_ENV["DAGSTER_PG_PASSWORD"] not in text and "db.internal" not in text
    db = yaml.safe_load(text)["storage"]["postgres"]["postgres_db"]
    assert db == {"hostname": {"env": "DAGSTER_PG_HOST"}, "username": {"env": "DAGSTER_PG_USER"},
                  "db_name": {"env": "DAGSTER_PG_DB"}, "password": {"env": "DAGSTER_PG_PASSWORD"},
                  "scheme": "postgresql+psycopg2"}
    assert yaml.safe_load(instance_yaml({**FAKE_ENV, "DAGSTER_PG_PORT": "6543"}))["storage"]["postgres"][
        "postgres_db"]["port"] == {"env": "DAGSTER_PG_PORT"}
    with pytest.raises(ConfigError, match="DAGSTER_PG_DB"):
        instance_yaml({"DAGSTER_PG_HOST": "db", "DAGSTER_PG_USER": "kiln"})


def test_dagster_accepts_the_postgres_instance_config(tmp_path, monkeypatch):
    from dagster._core.instance.config import dagster_instance_config

    for key, value in {**FAKE_ENV, "DAGSTER_PG_PORT": "6543"}.items():
        monkeypatch.setenv(key, value)
    (tmp_path / "dagster.yaml").write_text(instance_yaml({**FAKE_ENV, "DAGSTER_PG_PORT": "6543"}))
    config, _ = dagster_instance_config(str(tmp_path))  # Dagster's own schema check of the file
    assert set(config["storage"]) == {"postgres"} and config["run_coordinator"]


def test_dagster_home_follows_the_environment_but_keeps_a_users_own_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))  # ensure_dagster_home exports it; monkeypatch restores
    env = {"DAGSTER_HOME": str(tmp_path)}
    ensure_dagster_home(env)
    assert "postgres" not in yaml.safe_load((tmp_path / "dagster.yaml").read_text()).get("storage", {})
    ensure_dagster_home({**env, **FAKE_ENV})
    assert "postgres" in yaml.safe_load((tmp_path / "dagster.yaml").read_text())["storage"]
    own = (tmp_path / "dagster.yaml").read_text().removeprefix(HEADER)
    (tmp_path / "dagster.yaml").write_text(own)
    ensure_dagster_home(env)
    assert (tmp_path / "dagster.yaml").read_text() == own


# --- a real server (slow) -------------------------------------------------------------------------

def _unavailable(reason: str):
    skip_or_fail("postgres", reason)


@pytest.fixture(scope="module")
def server():
    """Connection settings of a Postgres server the test may create databases on."""
    if os.environ.get("KILN_TEST_PG_HOST"):
        yield {var: os.environ[f"KILN_TEST_PG_{var}"] for var in PG_VARS}
        return
    have_server = any(Path("/usr/lib/postgresql").glob("*/bin/initdb")) or shutil.which("initdb")
    if not have_server:
        _unavailable("no Postgres: set KILN_TEST_PG_HOST/PORT/USER/PASSWORD/DB, or install PostgreSQL's "
                     "server (apt-get install postgresql) so the test can start a throwaway one")
    # Not under pytest's tmp_path: as root the server runs as `postgres`, which cannot enter it.
    folder = tempfile.mkdtemp(prefix="kiln-test-pg-")
    started = subprocess.run([str(PG_SCRIPT), "start", folder], capture_output=True, text=True, timeout=180,
                             env={**os.environ, "PREFIX": "PG"})
    if started.returncode != 0:
        shutil.rmtree(folder, ignore_errors=True)
        _unavailable(f"could not start a throwaway Postgres: {started.stderr[-2000:]}")
    settings = dict(pair.split("=", 1) for pair in started.stdout.split()[1:])
    try:
        yield {var: settings[f"PG_{var}"] for var in PG_VARS}
    finally:
        subprocess.run([str(PG_SCRIPT), "stop", folder], capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def database(server):
    """A fresh database for this test, so nothing else recorded there can be counted."""
    import psycopg2

    name = f"kiln_test_{secrets.token_hex(4)}"
    connect = dict(host=server["HOST"], port=int(server["PORT"]), user=server["USER"], password=server["PASSWORD"])
    admin = psycopg2.connect(dbname=server["DB"], **connect)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    try:
        yield {**connect, "dbname": name}
    finally:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


MATERIALIZE = """
import dagster as dg
from dagster_postgres import PostgresRunStorage
from workflows.cli import ensure_dagster_home
from workflows.definitions import ALL_ASSETS, defs
from workflows.kiln import SNAPSHOTS

ensure_dagster_home()
instance = dg.DagsterInstance.get()
assert isinstance(instance.run_storage, PostgresRunStorage), type(instance.run_storage)
instance.add_dynamic_partitions(SNAPSHOTS.name, ["sample"])
result = dg.materialize(ALL_ASSETS, selection=dg.AssetSelection.assets("raw_crawl", "documents"),
                        partition_key="sample", instance=instance, resources={"kiln": defs.resources["kiln"]})
print("RUN_ID", result.run_id, flush=True)
"""


@pytest.mark.slow
def test_partitioned_materialization_is_recorded_in_postgres(database, tmp_path):
    import dagster as dg
    import psycopg2
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["raw_crawl"]["snapshots"] = {"sample": {"kind": "sample", "seed": 0, "pages": 40, "files": 1}}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    pg_env = {"DAGSTER_PG_HOST": database["host"], "DAGSTER_PG_PORT": str(database["port"]),
              "DAGSTER_PG_USER": database["user"], "DAGSTER_PG_PASSWORD": database["password"],
              "DAGSTER_PG_DB": database["dbname"]}
    env = {**os.environ, **pg_env, "KILN_STATE_DIR": str(tmp_path), "KILN_CONFIG": str(tmp_path / "pipeline.yaml")}
    env.pop("DAGSTER_HOME", None)
    result = subprocess.run([sys.executable, "-c", MATERIALIZE], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    run_id = next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("RUN_ID"))

    home = tmp_path / "dagster"
    instance_text = (home / "dagster.yaml").read_text()
    assert "postgres_db" in instance_text and database["password"] not in instance_text
    assert not list(home.rglob("*.db")), "no sqlite storage may be created next to Postgres"

    # Read back through Dagster, from the same home and environment.
    saved = {k: os.environ.get(k) for k in pg_env}
    os.environ.update(pg_env)
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:
            assert isinstance(instance.run_storage, PostgresRunStorage)
            assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
            run = instance.get_run_by_id(run_id)
            assert run.status == dg.DagsterRunStatus.SUCCESS and run.tags["dagster/partition"] == "sample"
            for asset in ("raw_crawl", "documents"):
                event = instance.get_latest_materialization_event(dg.AssetKey(asset))
                assert event.run_id == run_id and event.asset_materialization.partition == "sample"
                assert "dagster/data_version" in event.asset_materialization.tags
            assert instance.get_dynamic_partitions("snapshot") == ["sample"]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    # ... and straight from Postgres's tables.
    with psycopg2.connect(**database) as conn, conn.cursor() as cur:
        cur.execute("SELECT run_id, status FROM runs")
        assert cur.fetchall() == [(run_id, "SUCCESS")]
        cur.execute("SELECT asset_key, partition FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
                    "ORDER BY asset_key")
        assert cur.fetchall() == [('["documents"]', "sample"), ('["raw_crawl"]', "sample")]
