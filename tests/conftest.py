import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("KILN_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def spark():
    from engine.spark import get_spark

    return get_spark("local[2]", {"spark.sql.shuffle.partitions": "4"})


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"shared test data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def demo_pipeline(tmp_path_factory):
    """`kiln demo`, twice, on a small config: the fully materialized graph that the end-to-end and
    browser tests share (about 5 minutes per run, so it is built once per session)."""
    from kiln_demo import materialize_demo

    return materialize_demo(tmp_path_factory.mktemp("kiln-state"))
