"""The `checkpoints` asset: the launcher under Dagster Pipes, metadata from rank 0, and dry runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dagster as dg
import pytest
import yaml

from test_training import build_text_shards
from workflows.config import DEFAULT_CONFIG_PATH

STEPS = 6


@pytest.fixture
def pipeline(tmp_path, monkeypatch):
    """A storage root holding published mixed_shards and tokenizer artifacts, and a config for it."""
    from workflows.storage import open_storage

    monkeypatch.setenv("KILN_STATE_DIR", str(tmp_path / "state"))
    shards, tokenizer_dir = build_text_shards(tmp_path / "inputs")
    storage = open_storage(tmp_path / "storage")
    artifacts = {}
    for asset, source in (("mixed_shards", shards), ("tokenizer", tokenizer_dir)):
        staging = storage.new_staging_dir(asset, None)
        shutil.copytree(source, staging, dirs_exist_ok=True)
        artifacts[asset] = storage.publish(staging, asset, None, manifest={})
    config = yaml.safe_load(Path(DEFAULT_CONFIG_PATH).read_text())
    config["training"] = {"preset": "tiny", "steps": STEPS, "micro_batch_size": 8, "lr": 0.003,
                          "warmup_steps": 2, "checkpoint_every": 3, "num_gpus": 2}
    config["storage"] = {"root": str(tmp_path / "storage")}
    config["mlflow"] = {**config.get("mlflow", {}), "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    return {"tmp": tmp_path, "config": config, "artifacts": artifacts, "storage": storage}


def materialize(pipeline: dict, **training) -> tuple[dg.ExecuteInProcessResult, dg.DagsterInstance]:
    from assets.checkpoints import checkpoints
    from workflows.kiln import KilnResource

    config = {**pipeline["config"], "training": {**pipeline["config"]["training"], **training}}
    path = pipeline["tmp"] / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize([checkpoints], resources={"kiln": KilnResource(config_path=str(path))},
                            instance=instance, raise_on_error=False)
    return result, instance


def run_logs(instance: dg.DagsterInstance, run_id: str) -> list[tuple[str, str]]:
    return [(entry.level, entry.user_message) for entry in instance.all_logs(run_id)]


@pytest.mark.slow
def test_checkpoints_asset_runs_the_launcher_under_pipes(pipeline):
    import logging

    import mlflow

    result, instance = materialize(pipeline)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    [event] = result.get_asset_materialization_events()
    metadata = {k: v.value for k, v in event.materialization.metadata.items()}

    published = pipeline["storage"].latest("checkpoints", None)
    result_json = json.loads((published.path / "result.json").read_text())
    # Rank 0 reported these through Pipes; they match what it wrote into result.json.
    for key in ("final_loss", "first_loss", "steps", "tokens", "mlflow_run_id", "median_tokens_per_s"):
        assert metadata[key] == result_json[key], key
    assert metadata["train_wall_s"] == result_json["wall_s"] and metadata["steps"] == STEPS
    assert metadata["steps_streamed"] == STEPS  # one Pipes message per step
    assert metadata["loss_curve"].count("\n") == STEPS + 1  # header, rule, one row per step
    assert metadata["data_version"] == published.data_version
    assert metadata["mlflow_run"] == (f"http://127.0.0.1:5000/#/experiments/{result_json['mlflow_experiment_id']}"
                                      f"/runs/{result_json['mlflow_run_id']}")
    assert "checkpoint" not in metadata and "export_dir" not in metadata  # paths of the work folder

    logs = run_logs(instance, result.run_id)
    info = [message for level, message in logs if level == logging.INFO]
    assert "[pipes] external process successfully opened dagster pipes." in info
    assert not [m for _, m in logs if "[pipes] did not receive" in m]  # rank 0 closed Pipes cleanly
    assert any(message.startswith(f"step {STEPS}/{STEPS} loss") for message in info)
    # The launcher's raw output is there too, one level down.
    assert any("[kiln] step" in message for level, message in logs if level == logging.DEBUG)
    assert not (published.path / "pipes-messages.jsonl").exists()

    mixed, tok = pipeline["artifacts"]["mixed_shards"], pipeline["artifacts"]["tokenizer"]
    client = mlflow.MlflowClient(pipeline["config"]["mlflow"]["tracking_uri"])
    run = client.get_run(result_json["mlflow_run_id"])
    tags = run.data.tags
    assert tags["dagster_run_id"] == result.run_id and len(tags["git_commit"]) >= 7
    assert tags["dagster_run_url"] == f"http://127.0.0.1:3000/runs/{result.run_id}"  # mlflow.dagster_ui_url default
    assert tags["mixed_shards_data_version"] == mixed.data_version
    assert tags["tokenizer_data_version"] == tok.data_version
    assert run.inputs.dataset_inputs[0].dataset.digest == mixed.data_version


def test_dry_run_logs_the_command_and_materializes_nothing(pipeline):
    result, instance = materialize(pipeline, dry_run=True)
    assert result.success and result.get_asset_materialization_events() == []
    messages = [message for _, message in run_logs(instance, result.run_id)]
    [command] = [m for m in messages if "training/train.py --config" in m and m.startswith("cd ")]
    work_dir = Path(command.split()[1])
    assert work_dir.name.startswith(".run-") and "--num_gpus 2" in command
    # Nothing ran: the work folder holds only the run.json the command names.
    assert sorted(p.name for p in work_dir.iterdir()) == ["run.json"]
    with pytest.raises(Exception, match="has not been materialized"):
        pipeline["storage"].latest("checkpoints", None)


def test_mlflow_links_and_uris_never_carry_credentials():
    from assets.checkpoints import mlflow_run_url, without_credentials

    assert without_credentials("https://user:s3cret@mlflow.example:8443/base") == "https://mlflow.example:8443/base"
    assert without_credentials("sqlite:////tmp/m.db") == "sqlite:////tmp/m.db"
    assert mlflow_run_url("https://user:s3cret@mlflow.example/", "7", "abc") == \
        "https://mlflow.example/#/experiments/7/runs/abc"
    assert mlflow_run_url("sqlite:////x/mlflow.db", "1", "abc") == "http://127.0.0.1:5000/#/experiments/1/runs/abc"
    assert mlflow_run_url("sqlite:////x/mlflow.db", None, None) is None


def test_loss_curve_samples_evenly_and_keeps_the_last_step():
    from assets.checkpoints import loss_curve

    steps = [{"step": i, "loss": None if i == 3 else 5.0 / i, "lr": 1e-3, "grad_norm": None if i == 3 else 1.0,
              "tokens_per_s": 100.0} for i in range(1, 104)]
    rows = loss_curve(steps, points=10).splitlines()[2:]
    assert [int(r.split("|")[1]) for r in rows] == list(range(1, 102, 10)) + [103]
    assert "| 3 | skipped |" in loss_curve(steps[:5])
