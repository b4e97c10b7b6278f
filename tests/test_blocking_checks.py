"""A blocking check that fails stops the corpus from moving on: the version is published complete
for inspection, `_LATEST` stays on the last good one, and downstream in the same run does not run."""
import dagster as dg
import pytest

from workflows.kiln import KilnResource, stage
from workflows.storage import LocalStorage, StorageError

CHECK = dg.AssetCheckSpec("in_band", asset="filtered", blocking=True)


def graph(value: str, passed: bool, seen: list[str]):
    @stage("filtered", "curate", partitioned=False, check_specs=[CHECK])
    def filtered(context: dg.AssetExecutionContext, kiln: KilnResource) -> dg.MaterializeResult:
        with kiln.staging(context) as out:
            (out / "data.txt").write_text(value)
        return kiln.publish(context, out, check_results=[dg.AssetCheckResult(check_name=CHECK.name, passed=passed)])

    @stage("deduplicated", "curate", partitioned=False, deps=["filtered"])
    def deduplicated(context: dg.AssetExecutionContext, kiln: KilnResource) -> None:
        seen.append((kiln.input("filtered").path / "data.txt").read_text())

    return [filtered, deduplicated]


def test_a_failed_blocking_check_publishes_the_version_but_never_marks_it_latest(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_STATE_DIR", str(tmp_path))
    resources = {"kiln": KilnResource()}
    seen: list[str] = []
    good = dg.materialize(graph("good corpus", True, seen), resources=resources)
    assert good.success and seen == ["good corpus"]

    bad = dg.materialize(graph("emptied corpus", False, seen), resources=resources, raise_on_error=False)
    assert not bad.success and seen == ["good corpus"]  # downstream did not run in the failed run
    meta = bad.asset_materializations_for_node("filtered")[0].metadata
    assert meta["marked_latest"].value is False

    storage = LocalStorage(tmp_path / "storage")
    failed = storage.artifact("filtered", None, meta["data_version"].value)
    assert (failed.path / "data.txt").read_text() == "emptied corpus"
    assert storage.failed_checks("filtered", None, failed.data_version) == ["in_band"]
    assert (storage.latest("filtered", None).path / "data.txt").read_text() == "good corpus"

    # A later run of downstream alone reads the last version that passed.
    dg.materialize(graph("unused", True, seen)[1:], resources=resources)
    assert seen == ["good corpus", "good corpus"]


def test_the_same_content_failing_a_tightened_check_comes_off_latest_and_back_when_it_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_STATE_DIR", str(tmp_path))
    resources, seen = {"kiln": KilnResource()}, []
    storage = LocalStorage(tmp_path / "storage")
    first = dg.materialize(graph("corpus v1", True, seen)[:1], resources=resources)
    v1 = first.asset_materializations_for_node("filtered")[0].metadata["data_version"].value
    dg.materialize(graph("corpus v2", True, seen)[:1], resources=resources)
    assert (storage.latest("filtered", None).path / "data.txt").read_text() == "corpus v2"

    # v2's very bytes fail a tightened band: _LATEST falls back to v1, the newest version that passed.
    dg.materialize(graph("corpus v2", False, seen)[:1], resources=resources, raise_on_error=False)
    assert storage.latest("filtered", None).data_version == v1
    # v1 fails too: no version passes, and reading says so.
    dg.materialize(graph("corpus v1", False, seen)[:1], resources=resources, raise_on_error=False)
    with pytest.raises(StorageError, match="no version that passed its blocking checks"):
        storage.latest("filtered", None)
    # The band is loosened again: the same v2 bytes pass and are latest again, with a clean record.
    dg.materialize(graph("corpus v2", True, seen)[:1], resources=resources)
    latest = storage.latest("filtered", None)
    assert (latest.path / "data.txt").read_text() == "corpus v2"
    assert storage.failed_checks("filtered", None, latest.data_version) == []
