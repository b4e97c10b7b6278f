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
    # num_gpus left at its default (null): 2 CPU ranks on a machine without a GPU.
    config["training"] = {"preset": "tiny", "steps": STEPS, "micro_batch_size": 8, "lr": 0.003,
                          "warmup_steps": 2, "checkpoint_every": 3, "log_every": 2}
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
    # Rank 0's progress lines, every log_every (2) steps, sent as Pipes log messages and written into
    # the run's log by Dagster's message handler as they arrived: while the launcher was still
    # running, not after it.
    progress = [m for m in info if m.startswith("step ")]
    assert [m.split()[1] for m in progress] == ["2/6", "4/6", "6/6"], progress
    assert all(" loss " in m and " lr " in m and " grad_norm " in m and " tokens/s " in m for m in progress)
    entries = instance.all_logs(result.run_id)
    first_progress = min(e.timestamp for e in entries if (e.user_message or "").startswith("step 2/6"))
    last_launcher_line = max(e.timestamp for e in entries if e.level == logging.DEBUG and "[kiln]" in e.user_message)
    assert first_progress < last_launcher_line
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


# A value other than the default for every training setting that reaches the ranks.
NON_DEFAULT_TRAINING = {
    "preset": "125M", "model": {"n_kv_heads": 4, "tie_embeddings": False}, "steps": 9, "micro_batch_size": 4,
    "grad_accum": 2, "lr": 0.002, "warmup_steps": 3, "min_lr_ratio": 0.2, "weight_decay": 0.05, "betas": [0.8, 0.9],
    "adam_eps": 1e-7, "grad_clip": 0.5, "activation_checkpointing": True, "checkpoint_every": 4, "keep_last": 3,
    "max_consecutive_skips": 7, "spike_k": 4.5, "spike_window": 50, "spike_min_history": 10, "log_every": 3,
    "system_metrics_interval_s": 2.5, "seed": 5,
    "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
}


def test_every_training_setting_reaches_run_json(pipeline):
    """The asset's run.json (written by the dry run; the real run writes the same) carries every
    training setting of the pipeline config, and the trainer accepts it."""
    from workflows.training_run import LAUNCH_FIELDS
    from training.config import resolve_run_config
    from workflows.config import TrainingConfig

    defaults = TrainingConfig().model_dump(mode="json")
    # A new TrainingConfig field fails here until it is wired into run.json and listed above.
    assert set(NON_DEFAULT_TRAINING) == set(TrainingConfig.model_fields) - LAUNCH_FIELDS
    assert all(defaults[name] != value for name, value in NON_DEFAULT_TRAINING.items())

    result, instance = materialize(pipeline, dry_run=True, **NON_DEFAULT_TRAINING)
    assert result.success
    [command] = [m for _, m in run_logs(instance, result.run_id) if m.startswith("cd ") and "train.py" in m]
    run_json = json.loads((Path(command.split()[1]) / "run.json").read_text())
    expected = {
        "model": {"preset": "125M", "n_kv_heads": 4, "tie_embeddings": False}, "train_steps": 9,
        "micro_batch_size": 4, "grad_accum_steps": 2, "lr": 0.002, "warmup_steps": 3, "min_lr_ratio": 0.2,
        "weight_decay": 0.05, "betas": [0.8, 0.9], "adam_eps": 1e-7, "grad_clip": 0.5,
        "activation_checkpointing": True, "checkpoint_every": 4, "keep_last": 3, "max_consecutive_skips": 7,
        "spike_k": 4.5, "spike_window": 50, "spike_min_history": 10, "log_every": 3, "seed": 5,
        "deepspeed": {"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    }
    assert {key: run_json[key] for key in expected} == expected
    assert run_json["mlflow"]["system_metrics_interval_s"] == 2.5
    mixed, tok = pipeline["artifacts"]["mixed_shards"], pipeline["artifacts"]["tokenizer"]
    assert run_json["data_versions"] == {"mixed_shards": mixed.data_version, "tokenizer": tok.data_version}
    # The commit goes to rank 0 (it tags the MLflow run), never into the export (the data version).
    assert len(run_json["git_commit"]) >= 7 and "git_commit" not in run_json["mlflow"]["tags"]
    resolved = resolve_run_config(run_json)
    assert resolved["betas"] == (0.8, 0.9) and resolved["model"]["n_kv_heads"] == 4


def test_rank0_sends_a_run_log_line_every_log_every_steps_and_every_step_as_a_message(tmp_path):
    from types import SimpleNamespace

    from training.reporting import Rank0Reporter

    info, warning, messages = [], [], []
    reporter = Rank0Reporter({"log_every": 3, "train_steps": 7, "mlflow": {}}, tmp_path, resume_step=0, run_id=None)
    reporter.pipes = SimpleNamespace(log=SimpleNamespace(info=info.append, warning=warning.append),
                                     report_custom_message=messages.append)
    for step in range(1, 8):
        skipped = step == 4
        reporter.step({"step": step, "loss": 9.5 if skipped else 2.0, "lr": 1e-3, "grad_norm": 0.5,
                       "tokens_per_s": 1000.0, "skipped": skipped, "skip_reason": "spike" if skipped else None,
                       "spike_threshold": 3.25 if skipped else None})
    assert [line.split()[1] for line in info] == ["3/7", "6/7", "7/7"]
    assert warning == ["step 4/7 loss 9.5000 lr 0.001 grad_norm 0.5 tokens/s 1000 SKIPPED "
                       "(spike: loss above the spike threshold 3.2500)"]
    assert [m["step"] for m in messages] == list(range(1, 8)) and all(m["kind"] == "step" for m in messages)


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
