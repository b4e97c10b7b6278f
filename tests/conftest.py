import os
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("KILN_SHARED_DATA", REPO.parent / "shared" / "data"))


def skip_or_fail(tool: str, reason: str):
    """Skip a test whose external tool is missing, or fail it where CI requires the tool:
    .ci/run sets KILN_REQUIRE_<TOOL>=1 (POSTGRES, BROWSER, SHELLCHECK, LM_EVAL, DATATROVE) after
    installing them, so a broken install turns the run red instead of silently skipping tests."""
    flag = f"KILN_REQUIRE_{tool.upper()}"
    if os.environ.get(flag) == "1":
        pytest.fail(f"{flag}=1 but {reason}")
    pytest.skip(reason)


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


@contextmanager
def moto_s3(access_key: str, secret: str, token: str | None = None):
    """moto's S3 server on 127.0.0.1 with credentials only in the environment (nothing from the
    user's own AWS config). Yields (endpoint URL, an admin boto3 client)."""
    import boto3
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as env:
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN",
                     "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            env.delenv(name, raising=False)
        env.setenv("AWS_ACCESS_KEY_ID", access_key)
        env.setenv("AWS_SECRET_ACCESS_KEY", secret)
        if token:
            env.setenv("AWS_SESSION_TOKEN", token)
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            yield endpoint, boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        finally:
            server.stop()
