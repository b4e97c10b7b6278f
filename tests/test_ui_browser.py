"""The web UIs, driven as a person drives them: Playwright with Debian's Chromium, headless.

On a copy of the `demo_pipeline` state (so the end-to-end test's state is never touched), the test
starts the README's commands, `make ui` and `make mlflow`, with KILN_STATE_DIR at the copy and
UI_PORT/MLFLOW_PORT at free ports, and clicks through them: the asset graph, a partitioned
materialization of `filtered` and its rejection table, the training run in MLflow with its loss
chart and link back to Dagster, and the partial re-run after a threshold change. Screenshots go to $KILN_TEST_ARTIFACTS (default: a pytest temp folder), also on
failure. The tests run in file order; the threshold story mutates the copy and comes last.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from playwright.sync_api import expect, sync_playwright

from conftest import skip_or_fail
from kiln_demo import ASSETS, GROUPS, SNAPSHOT
from workflows.config import REPO_ROOT

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")  # Debian's package; Playwright's own browsers are not downloaded
UPSTREAM_OF_FILTERED = ["raw_crawl", "documents", "quality_signals", "quality_classifier"]
UI_TIMEOUT_MS = 120_000  # a slow, shared 2-core machine: generous waits for every UI step
RUN_TIMEOUT_S = 900
expect.set_options(timeout=UI_TIMEOUT_MS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, server: subprocess.Popen, log: Path, timeout_s: float = 300, data: bytes | None = None):
    deadline = time.time() + timeout_s
    while True:
        assert server.poll() is None, f"{url}: server exited with {server.returncode}:\n{log.read_text()[-3000:]}"
        try:
            request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
            return urllib.request.urlopen(request, timeout=10).read()
        except OSError:
            assert time.time() < deadline, f"{url} did not answer within {timeout_s} s:\n{log.read_text()[-3000:]}"
            time.sleep(3)


@contextmanager
def server(command: list[str], env: dict, log: Path):
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        yield process
    finally:
        os.killpg(process.pid, 15)  # dagster dev: webserver, daemon and code servers share the group
        try:
            process.wait(timeout=30)  # dagster dev sometimes hangs on shutdown
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        try:
            os.killpg(process.pid, 9)  # whatever is left of the group
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("KILN_TEST_ARTIFACTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser test screenshots: {folder}")
    return folder


@pytest.fixture(scope="module")
def ui_state(demo_pipeline, tmp_path_factory) -> dict:
    """A copy of the materialized state: storage, sqlite Dagster home and MLflow store resolve their
    paths from KILN_STATE_DIR/DAGSTER_HOME at run time, so the copy works on its own. (The MLflow
    experiment's artifact location still names the original folder; nothing here logs artifacts.)"""
    state = tmp_path_factory.mktemp("ui") / "state"
    shutil.copytree(demo_pipeline["state"], state, symlinks=True)
    # Dagster's first-visit "Join the Dagster community" dialog opens at a random moment, possibly over
    # another dialog where it cannot be dismissed; Dagster skips it once $DAGSTER_HOME/.nux/nux.yaml exists.
    (state / "dagster" / ".nux").mkdir(parents=True, exist_ok=True)
    (state / "dagster" / ".nux" / "nux.yaml").write_text("seen: 1\n")
    env = {**os.environ, "KILN_STATE_DIR": str(state), "KILN_CONFIG": str(state / "pipeline.yaml"),
           "DAGSTER_HOME": str(state / "dagster")}
    return {"state": state, "root": state / "storage", "env": env}


def make_command(target: str, ui_state: dict, **variables) -> list[str]:
    """The README's `make <target>` on the copied state, with its port variable set."""
    if not (REPO_ROOT / ".venv" / "bin" / "kiln").exists():
        skip_or_fail("browser", "no .venv: the browser tests start the UIs with `make`, run them through `make test`")
    settings = [f"{name}={value}" for name, value in variables.items()]
    return ["make", "--no-print-directory", target, f"KILN_STATE_DIR={ui_state['state']}", *settings]


@pytest.fixture(scope="module")
def dagster_ui(ui_state):
    """`make ui` (the README's command) on a free port."""
    port = free_port()
    log = ui_state["state"] / "dagster-dev.log"
    with server(make_command("ui", ui_state, UI_PORT=port), ui_state["env"], log) as process:
        base = f"http://127.0.0.1:{port}"
        query = json.dumps({"query": "{ assetNodes { id } }"}).encode()
        wait_http(f"{base}/graphql", process, log, data=query)
        nux = wait_http(f"{base}/graphql", process, log, data=json.dumps({"query": "{ shouldShowNux }"}).encode())
        assert json.loads(nux)["data"]["shouldShowNux"] is False, "Dagster would open its community dialog"
        yield base


@pytest.fixture(scope="module")
def mlflow_ui(ui_state):
    """`make mlflow` (the README's command) on a free port."""
    port = free_port()
    log = ui_state["state"] / "mlflow-ui.log"
    with server(make_command("mlflow", ui_state, MLFLOW_PORT=port), ui_state["env"], log) as process:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health", process, log)
        yield base


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        skip_or_fail("browser", f"{CHROMIUM} not found: install Debian's chromium package (.ci/run does)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, artifacts, request):
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    page.shot = lambda name: shot(page, artifacts, f"{request.node.name}-{name}")
    yield page
    context.close()


def shot(page, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@contextmanager
def step(page, what: str):
    """Names the UI step in the failure message, with the page's URL and a screenshot."""
    try:
        yield
    except Exception as failure:
        path = page.shot(f"FAILED-{re.sub(r'[^a-z0-9]+', '-', what.lower())}")
        raise AssertionError(f"UI step failed: {what} (at {page.url}; screenshot {path}): {failure}") from failure


def instance_for(ui_state):
    """The copy's Dagster instance, read from this process (sqlite; dagster dev keeps running)."""
    import dagster as dg

    return dg.DagsterInstance.from_config(ui_state["env"]["DAGSTER_HOME"])


def materialization_runs(instance, asset: str) -> list[str]:
    import dagster as dg

    records = instance.fetch_materializations(dg.AssetKey(asset), limit=1000).records
    return [r.run_id for r in records]


def latest_version(root: Path, asset: str) -> str:
    return (root / asset / SNAPSHOT / "_LATEST").read_text().strip()


def signal_rows(root: Path, column: str) -> dict:
    import pyarrow.dataset as ds

    path = root / "quality_signals" / SNAPSHOT / latest_version(root, "quality_signals") / "data"
    table = ds.dataset(str(path), format="parquet").to_table(columns=["doc_id", column])
    return dict(zip(table.column("doc_id").to_pylist(), table.column(column).to_pylist()))


def kept_ids(root: Path) -> set:
    import pyarrow.dataset as ds

    path = root / "filtered" / SNAPSHOT / latest_version(root, "filtered") / "kept"
    return set(ds.dataset(str(path), format="parquet").to_table(columns=["doc_id"]).column("doc_id").to_pylist())


def launch_partition_from_dialog(page) -> str:
    """In Dagster's 'Launch runs to materialize …' dialog: pick the snapshot partition, launch, and
    follow the toast to the run page. Returns the run id."""
    dialog = page.get_by_role("dialog").filter(has_text="Launch runs to materialize")
    dialog.get_by_text("Select a partition or create one").click()
    page.get_by_role("menuitem", name=re.compile(rf"^{SNAPSHOT}\b")).click()
    page.keyboard.press("Escape")  # closes the partition picker, not the dialog
    dialog.get_by_text("1 partition", exact=True).wait_for()
    page.shot("launch-dialog")
    dialog.get_by_role("button", name="Launch 1 run").click()
    page.get_by_role("region", name=re.compile("Notifications")).get_by_role("link", name="View").click()
    page.wait_for_url(re.compile(r"/runs/[0-9a-f-]{36}"))
    return re.search(r"/runs/([0-9a-f-]{36})", page.url).group(1)


def wait_for_run_success(page, run_id: str):
    """Watch the run page until the run's status reads Success (fail fast on Failure/Canceled)."""
    deadline = time.time() + RUN_TIMEOUT_S
    while True:
        for status in ("Failure", "Canceled"):
            if page.get_by_text(status, exact=True).count():
                page.shot(f"run-{status.lower()}")
                raise AssertionError(f"run {run_id} ended with {status}; see {page.url}")
        if page.get_by_text("Success", exact=True).count():
            return
        assert time.time() < deadline, f"run {run_id} not finished after {RUN_TIMEOUT_S} s"
        time.sleep(5)


def open_partition(page, base: str, asset: str):
    """Asset page → Partitions tab → the snapshot partition."""
    page.goto(f"{base}/assets/{asset}")
    page.get_by_role("tab", name="Partitions").click()
    page.get_by_text(SNAPSHOT, exact=True).first.click()
    # Loaded once the latest materialization's run link shows (its first 8 hex digits).
    page.get_by_role("link", name=re.compile(r"^[0-9a-f]{8}$")).first.wait_for()


def test_asset_graph_shows_every_group(dagster_ui, page):
    from workflows.definitions import ALL_ASSETS

    with step(page, "global asset lineage lists every group"):
        page.goto(f"{dagster_ui}/asset-groups")
        page.get_by_text("Global asset lineage").wait_for()
        groups = page.get_by_role("button", name=re.compile(r"^asset_group \w+"))
        groups.first.wait_for()
        shown = {text.split()[0] for text in groups.all_inner_texts()}
        assert shown == GROUPS
        for group in GROUPS:  # the graph itself draws one box per group
            assert page.locator("svg, [class*=graph]").get_by_text(group, exact=True).count() >= 1, group
        page.shot("asset-graph")
    with step(page, "catalog lists every asset in its group"):
        page.get_by_role("link", name=re.compile("Catalog$")).click()
        expected = {key.path[0]: group for a in ALL_ASSETS for key, group in a.group_names_by_key.items()}
        assert set(expected) == set(ASSETS)
        group_link = page.get_by_role("link", name=re.compile(r"^asset_group \w+$"))
        group_link.first.wait_for()
        shown = {}
        for asset in expected:
            asset_link = page.get_by_role("link", name=f"{asset} {asset}", exact=True)
            row = page.locator("div").filter(has=asset_link).filter(has=group_link).last  # the innermost: its row
            shown[asset] = row.get_by_role("link", name=re.compile(r"^asset_group ")).inner_text().strip()
        assert shown == expected
        page.shot("catalog")


def test_materialize_filtered_partition_from_the_ui_and_see_its_rejection_table(dagster_ui, ui_state, page):
    instance = instance_for(ui_state)
    before = set(materialization_runs(instance, "filtered"))
    with step(page, "asset page → Materialize… → partition → launch"):
        page.goto(f"{dagster_ui}/asset-groups")
        page.get_by_role("link", name=re.compile("Catalog$")).click()
        page.get_by_role("link", name="filtered filtered", exact=True).click()
        page.wait_for_url(re.compile("/assets/filtered"))
        page.get_by_role("button", name=re.compile("Materialize…$")).click()
        run_id = launch_partition_from_dialog(page)
    with step(page, f"run {run_id[:8]} succeeds"):
        page.get_by_text(f"partition: {SNAPSHOT}").first.wait_for()
        wait_for_run_success(page, run_id)
        page.shot("run-success")
    assert run_id in set(materialization_runs(instance, "filtered")) - before

    manifest = json.loads((ui_state["root"] / "filtered" / SNAPSHOT / latest_version(ui_state["root"], "filtered")
                           / "_MANIFEST.json").read_text())
    expected = {k[len("removed_"):]: v for k, v in manifest["counts"].items() if k.startswith("removed_")}
    with step(page, "partition view shows this run's removed_by_rule table"):
        open_partition(page, dagster_ui, "filtered")
        page.get_by_role("link", name=run_id[:8], exact=True).wait_for()
        cell = page.get_by_role("row", name=re.compile(r"^removed_by_rule rule removed share")).first
        table = cell.get_by_role("table")
        table.get_by_role("columnheader", name="rule").wait_for()
        rows = table.get_by_role("row")
        shown = {}
        for i in range(1, rows.count()):  # row 0: the header
            rule, removed, share = (c.inner_text().strip() for c in rows.nth(i).get_by_role("cell").all())
            shown[rule] = int(removed)
            assert 0 < float(share) <= 1
        assert shown == expected and sum(shown.values()) == manifest["counts"]["rejected"] > 0
        table.scroll_into_view_if_needed()
        page.shot("rejection-table")


def test_mlflow_shows_the_training_run_with_loss_chart_and_link_to_dagster(mlflow_ui, dagster_ui, ui_state, page):
    import dagster as dg

    # The latest checkpoints materialization links to its MLflow run (metadata `mlflow_run`).
    event = instance_for(ui_state).get_latest_materialization_event(dg.AssetKey("checkpoints"))
    metadata = event.asset_materialization.metadata
    mlflow_run_id = metadata["mlflow_run"].value.rsplit("/runs/", 1)[1]
    steps = metadata["steps"].value
    experiment = yaml.safe_load((ui_state["state"] / "pipeline.yaml").read_text())["mlflow"]["experiment"]

    with step(page, "MLflow home → Model training → experiment → training run"):
        page.goto(f"{mlflow_ui}/")
        page.get_by_role("button", name="Model training").click()
        page.get_by_role("link", name=experiment, exact=True).click()
        page.get_by_role("heading", name="Runs").wait_for()
        page.shot("mlflow-runs")
        link = page.get_by_role("link", name=re.compile(r"^checkpoints-")).and_(
            page.locator(f'a[href*="/runs/{mlflow_run_id}"]'))
        link.first.click()
        page.wait_for_url(re.compile(mlflow_run_id))
    with step(page, "run overview shows the tags that link back to Dagster"):
        tag = page.get_by_role("status", name="dagster_run_id")
        dagster_run_id = tag.inner_text().split(":", 1)[1].strip()
        assert dagster_run_id == event.run_id
        url = page.get_by_role("status", name="dagster_run_url").inner_text().split(":", 1)[1].strip()
        assert url.endswith(f"/runs/{dagster_run_id}"), url
        page.get_by_role("status", name="git_commit").wait_for()
        page.get_by_role("heading", name="Tags").scroll_into_view_if_needed()
        page.shot("mlflow-run-tags")
    with step(page, "Model metrics → loss chart over the training steps"):
        page.get_by_role("tab", name="Model metrics").click()
        page.get_by_role("searchbox", name="Search metric charts").fill("loss")
        heading = page.get_by_role("heading", name="loss", exact=True, level=4)
        heading.wait_for()
        card = heading.locator("xpath=ancestor::*[.//*[local-name()='svg'] and .//*[text()='Step']][1]")
        line = card.locator("path.js-line").first  # plotly draws a line chart for a per-step metric
        line.wait_for(state="attached")
        assert line.get_attribute("d").count("L") >= min(steps, 10) - 1  # one segment per logged step
        assert card.get_by_text(str(steps), exact=True).count() >= 1  # the x axis reaches the last step
        page.shot("mlflow-loss-chart")
    with step(page, "the tag's Dagster run exists and materialized checkpoints"):
        # The tag points at `make ui`'s port; the same path on this test's Dagster UI is that run.
        page.goto(dagster_ui + url[url.index("/runs/"):])
        page.get_by_text(dagster_run_id[:8], exact=True).first.wait_for()
        page.get_by_text("Success", exact=True).first.wait_for()
        page.get_by_text("checkpoints", exact=True).first.wait_for()
        page.shot("dagster-run-of-training")


def test_threshold_change_reruns_only_filtered_and_deduplicated_from_the_ui(dagster_ui, ui_state, page):
    """README "Changing a filter threshold", clicked through. What Dagster 1.13's UI shows: the
    partition filtered[<snapshot>] is Unsynced with "has a new code version"; the graph's
    "Materialize unsynced" finds nothing, because Dagster computes that without a partition
    (dagster#22553); selecting filtered and deduplicated and materializing the partition works."""
    root, instance = ui_state["root"], instance_for(ui_state)
    upstream_before = {asset: materialization_runs(instance, asset) for asset in UPSTREAM_OF_FILTERED}
    versions_before = {asset: latest_version(root, asset) for asset in ["documents", "quality_signals", "filtered"]}
    kept_before = json.loads((root / "filtered" / SNAPSHOT / versions_before["filtered"] / "_MANIFEST.json")
                             .read_text())["counts"]["kept"]

    config_path = ui_state["state"] / "pipeline.yaml"
    config = yaml.safe_load(config_path.read_text())
    # Stricter, chosen from the stored signals so that about a quarter of the kept pages go.
    kept_words = sorted(words for doc_id, words in signal_rows(root, "word_count").items() if doc_id in kept_ids(root))
    config["filters"]["min_words"] = kept_words[len(kept_words) // 4] + 1
    config_path.write_text(yaml.safe_dump(config))

    with step(page, "Deployment → Code locations → Reload"):
        page.goto(f"{dagster_ui}/asset-groups")
        page.get_by_role("link", name=re.compile("Deployment$")).click()
        reload = page.get_by_role("button", name=re.compile(r"(^| )Reload$"))
        reload.click()
        try:  # disabled while the code server restarts; a fast reload may end before this looks
            expect(reload).to_be_disabled(timeout=10_000)
        except AssertionError:
            pass
        expect(reload).to_be_enabled()
        page.shot("reloaded")
    with step(page, "filtered[snapshot] is Unsynced: has a new code version"):
        deadline = time.time() + 300
        while True:
            open_partition(page, dagster_ui, "filtered")
            if page.get_by_text("Unsynced (1)").count():
                break
            assert time.time() < deadline, "the partition never showed Unsynced after the reload"
            time.sleep(5)
        page.get_by_text("Unsynced (1)").hover()
        page.get_by_text("has a new code version").wait_for()
        page.get_by_text("1 code version change").wait_for()
        page.shot("filtered-partition-unsynced")
    with step(page, "graph of filtered+deduplicated: 'Materialize unsynced' finds nothing (dagster#22553)"):
        page.get_by_role("link", name=re.compile("Lineage$")).click()
        search = page.get_by_role("textbox", name="Search and filter assets")
        search.focus()  # a CodeMirror editor: its hidden textarea takes the keys
        page.keyboard.type('key:"filtered" or key:"deduplicated"')
        page.keyboard.press("Enter")
        page.wait_for_url(re.compile("deduplicated"))
        materialize = page.get_by_role("button", name=re.compile("Materialize all…$"))
        page.get_by_role("button", name="arrow_drop_down").last.click()  # the menu next to it
        page.get_by_role("menuitem", name=re.compile("Materialize unsynced$")).click()
        notice = page.get_by_role("dialog").filter(has_text="Materialize unsynced assets")
        notice.get_by_text("All assets are up to date").wait_for()
        page.shot("materialize-unsynced-finds-nothing")
        notice.get_by_role("button", name="Dismiss").click()
    with step(page, "Materialize all… on the selection → partition → launch"):
        materialize.click()
        page.get_by_role("dialog").get_by_text("Launch runs to materialize 2 assets").wait_for()
        run_id = launch_partition_from_dialog(page)
    with step(page, f"run {run_id[:8]} succeeds"):
        wait_for_run_success(page, run_id)
        page.shot("rerun-success")
    with step(page, "filtered[snapshot] is in sync again"):
        open_partition(page, dagster_ui, "filtered")
        page.get_by_role("link", name=run_id[:8], exact=True).wait_for()
        assert page.get_by_text(re.compile(r"^Unsynced")).count() == 0
        page.shot("filtered-partition-synced")

    run = instance.get_run_by_id(run_id)
    assert {key.path[0] for key in run.asset_selection} == {"filtered", "deduplicated"}
    assert run.tags.get("dagster/partition") == SNAPSHOT
    assert run_id in materialization_runs(instance, "deduplicated")
    # Nothing upstream re-ran: no new materialization, the same stored artifacts.
    assert {asset: materialization_runs(instance, asset) for asset in UPSTREAM_OF_FILTERED} == upstream_before
    assert latest_version(root, "documents") == versions_before["documents"]
    assert latest_version(root, "quality_signals") == versions_before["quality_signals"]
    new_filtered = latest_version(root, "filtered")
    assert new_filtered != versions_before["filtered"]
    manifest = json.loads((root / "filtered" / SNAPSHOT / new_filtered / "_MANIFEST.json").read_text())
    assert manifest["config"]["filters"]["min_words"] == config["filters"]["min_words"]
    assert manifest["counts"]["kept"] < kept_before and manifest["counts"].get("removed_min_words", 0) > 0
