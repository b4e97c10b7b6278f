"""What every asset module shares: the loaded config, the snapshot partitions, the `stage`
decorator, and the `KilnResource` that hands out storage, Spark and MLflow settings.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import dagster as dg
from pydantic import PrivateAttr

from training.provenance import git_commit
from workflows.config import (
    STAGE_SECTIONS,
    PipelineConfig,
    code_version,
    load_config,
    state_dir,
)
from workflows.storage import Artifact, LocalStorage, configured_storage

SNAPSHOTS = dg.DynamicPartitionsDefinition(name="snapshot")
# Loaded once when the definitions load, so an invalid config fails before anything runs.
CONFIG: PipelineConfig = load_config()


# Per-snapshot stages below raw_crawl follow a new snapshot on their own: each runs once its inputs
# have landed (the snapshot_automation sensor in jobs/ evaluates this). raw_crawl is started by a job.
SNAPSHOT_AUTOMATION = dg.AutomationCondition.eager()


def stage(name: str, group: str, *, partitioned: bool, deps: list[str] = (),
          automation_condition: dg.AutomationCondition | None = None, **kwargs):
    """`@dg.asset` with Kiln's conventions: group, snapshot partitions, config-hash code version,
    and `SNAPSHOT_AUTOMATION` for partitioned stages with inputs unless a condition is given."""
    if automation_condition is None and partitioned and deps:
        automation_condition = SNAPSHOT_AUTOMATION
    return dg.asset(
        name=name,
        group_name=group,
        partitions_def=SNAPSHOTS if partitioned else None,
        code_version=code_version(CONFIG, name),
        deps=list(deps),
        automation_condition=automation_condition,
        **kwargs,
    )


class KilnResource(dg.ConfigurableResource):
    """Storage, Spark and MLflow for the stages, configured by the pipeline config file."""

    config_path: str = ""
    _config: PipelineConfig = PrivateAttr()
    _storage: LocalStorage = PrivateAttr()

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._config = load_config(self.config_path or None)
        self._storage = configured_storage(self._config)

    @property
    def config(self) -> PipelineConfig:
        return self._config

    @property
    def storage(self) -> LocalStorage:
        return self._storage

    def spark(self):
        from engine.spark import get_spark

        return get_spark(self._config.spark.master, self._config.spark.conf)

    def mlflow_tracking_uri(self) -> str:
        return self._config.mlflow.tracking_uri or f"sqlite:///{state_dir() / 'mlflow.db'}"

    def mlflow_experiment_id(self) -> str:
        """The configured experiment, created with its artifacts under the state folder."""
        import mlflow

        client = mlflow.MlflowClient(self.mlflow_tracking_uri())
        name = self._config.mlflow.experiment
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        return client.create_experiment(name, artifact_location=(state_dir() / "mlartifacts").as_uri())

    def models_dir(self) -> Path:
        path = state_dir() / "models"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def input(self, asset: str, partition: str | None = None) -> Artifact:
        return self._storage.latest(asset, partition)

    def inputs_all(self, context: dg.AssetExecutionContext, asset: str) -> list[Artifact]:
        """The latest complete artifact of every snapshot partition of `asset` that has one."""
        found = []
        for snapshot in sorted(context.instance.get_dynamic_partitions(SNAPSHOTS.name)):
            try:
                found.append(self._storage.latest(asset, snapshot))
            except Exception as missing:  # a registered snapshot not processed yet
                context.log.warning(f"skipping {asset}[{snapshot}]: {missing}")
        if not found:
            raise dg.Failure(f"No materialized partition of {asset} found; materialize it first.")
        return found

    @contextmanager
    def staging(self, context: dg.AssetExecutionContext) -> Iterator[Path]:
        """A fresh folder to write the stage's output into; removed if the stage fails."""
        partition = context.partition_key if context.has_partition_key else None
        path = self._storage.new_staging_dir(context.asset_key.to_user_string(), partition)
        try:
            yield path
        except BaseException:
            self._storage.discard(path)
            raise

    def publish(
        self,
        context: dg.AssetExecutionContext,
        staging: Path,
        *,
        inputs: dict[str, Artifact | list[Artifact]] | None = None,
        counts: dict | None = None,
        metadata: dict | None = None,
        started: float | None = None,
        version_files: list[str] | None = None,
        check_results: list[dg.AssetCheckResult] | None = None,
    ) -> dg.MaterializeResult:
        """Publish the staging folder (content hash, manifest, `_SUCCESS`) and describe it to Dagster.

        A version whose blocking check failed is still published complete, so it can be inspected
        and traced by its data version, but it is never `_LATEST` (storage.settle_latest): later
        runs of downstream stages never read it."""
        asset = context.asset_key.to_user_string()
        partition = context.partition_key if context.has_partition_key else None
        input_versions = {
            name: ({a.partition: a.data_version for a in value} if isinstance(value, list) else value.data_version)
            for name, value in (inputs or {}).items()
        }
        blocking = {spec.name for spec in context.assets_def.check_specs if spec.blocking}
        checks = {result.check_name: bool(result.passed) for result in check_results or []}
        failed = sorted(name for name, passed in checks.items() if not passed and name in blocking)
        manifest = {
            "inputs": input_versions,
            "config": {s: getattr(self._config, s).model_dump(mode="json") for s in STAGE_SECTIONS[asset]},
            "code_version": code_version(self._config, asset),
            "git_commit": git_commit(),
            "dagster_run_id": context.run.run_id,
            "counts": counts or {},
            "wall_seconds": round(time.time() - started, 3) if started else None,
        }
        artifact = self._storage.publish(staging, asset, partition, manifest, version_files,
                                         checks=checks or None, failed_blocking=failed)
        if failed:
            context.log.warning(f"{asset}[{artifact.partition}] failed its blocking check(s) {failed}: published as "
                                f"{artifact.location} for inspection, NOT marked latest; downstream keeps reading "
                                f"the previous version")
        else:
            context.log.info(f"published {asset}[{artifact.partition}] -> {artifact.location}")
        meta = {
            "path": dg.MetadataValue.path(artifact.location),
            "data_version": artifact.data_version,
            "inputs": dg.MetadataValue.json(input_versions),
            **{k: v for k, v in (counts or {}).items() if isinstance(v, (int, float, str))},
            **(metadata or {}),
        }
        # Where it was published wins over a same-named key a stage passed (e.g. a staging path).
        meta.update(path=dg.MetadataValue.path(artifact.location), data_version=artifact.data_version,
                    marked_latest=not failed)
        return dg.MaterializeResult(
            metadata=meta, data_version=dg.DataVersion(artifact.data_version), check_results=check_results or []
        )


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "_(none)_"
    columns = columns or list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
