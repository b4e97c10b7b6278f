"""Every file under infra/ is checked by a schema, a parser or a linter, and none holds a credential."""
import glob
import json
import re
import shutil
import subprocess
import zipfile
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import skip_or_fail
from workflows.config import REPO_ROOT, SparkConfig

INFRA = REPO_ROOT / "infra"
HELM_VALUES = INFRA / "helm" / "dagster-values.yaml"
HELM_SCHEMA = INFRA / "helm" / "dagster-values.schema.json"
SPARK_K8S = INFRA / "spark" / "kubernetes.yaml"
MLFLOW = INFRA / "mlflow" / "mlflow.yaml"
HOSTFILE = INFRA / "deepspeed" / "hostfile.example"
PG_SCRIPT = INFRA / "postgres" / "local-postgres.sh"
CHECKED = {HELM_VALUES, HELM_SCHEMA, SPARK_K8S, MLFLOW, HOSTFILE, PG_SCRIPT, INFRA / "README.md"}


def infra_files() -> list[Path]:
    return sorted(p for p in INFRA.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_every_infra_file_is_checked_here_and_documented_on_the_one_page():
    assert set(infra_files()) == CHECKED, "a new infra/ file needs a check in tests/test_infra.py"
    readme = (INFRA / "README.md").read_text()
    for path in CHECKED - {INFRA / "README.md"}:
        assert str(path.relative_to(INFRA)) in readme, f"{path.name} is not documented in infra/README.md"


# --- Dagster Helm values ----------------------------------------------------------------------------

def helm_validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(HELM_SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_helm_values_match_the_schema_of_what_kiln_relies_on():
    values = yaml.safe_load(HELM_VALUES.read_text())
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in helm_validator().iter_errors(values)]
    assert not errors, errors
    deployment = values["dagster-user-deployments"]["deployments"][0]
    # The code location is importable here, as the image's code server will import it.
    assert deployment["dagsterApiGrpcArgs"][1] == "workflows.definitions"
    assert (REPO_ROOT / "workflows" / "definitions.py").exists()


@pytest.mark.parametrize("mutate, message", [
    (lambda v: v["runLauncher"].update(type="DefaultRunLauncher"), "K8sRunLauncher"),
    (lambda v: v["postgresql"].update(postgresqlPassword="hunter2"), "should not be valid"),
    (lambda v: v.update(generatePostgresqlPasswordSecret=True), "False"),
    (lambda v: v["dagster-user-deployments"]["deployments"][0].update(dagsterApiGrpcArgs=["-f", "x.py"]), ""),
    (lambda v: v["dagster-user-deployments"]["deployments"][0]["image"].update(tag="latest"), ""),
    (lambda v: v.pop("dagster-user-deployments"), "required"),
])
def test_the_helm_schema_rejects_what_kiln_cannot_run_with(mutate, message):
    values = yaml.safe_load(HELM_VALUES.read_text())
    mutate(values)
    errors = list(helm_validator().iter_errors(values))
    assert errors and message in " ".join(e.message for e in errors)


# --- Spark on Kubernetes ----------------------------------------------------------------------------

@cache
def spark_known_keys() -> tuple[set[str], set[str]]:
    """Setting names that Spark's own jars define (core and the Kubernetes resource manager), read
    from their compiled config classes; names ending in '.' are prefixes (volumes, executorEnv)."""
    import pyspark

    jars = glob.glob(str(Path(pyspark.__file__).parent / "jars" / "spark-kubernetes_*.jar"))
    jars += glob.glob(str(Path(pyspark.__file__).parent / "jars" / "spark-core_*.jar"))
    jars += glob.glob(str(Path(pyspark.__file__).parent / "jars" / "spark-sql-api_*.jar"))
    jars += glob.glob(str(Path(pyspark.__file__).parent / "jars" / "spark-catalyst_*.jar"))
    names: set[str] = set()
    suffixes: set[str] = set()  # some names are built as prefix + suffix, e.g. authenticate.driver + .serviceAccountName
    for jar in jars:
        with zipfile.ZipFile(jar) as archive:
            for entry in archive.namelist():
                if entry.startswith(("org/apache/spark/deploy/k8s/Config", "org/apache/spark/internal/config/",
                                     "org/apache/spark/sql/internal/SQLConf")) and entry.endswith(".class"):
                    data = archive.read(entry)
                    names |= {m.decode() for m in re.findall(rb"spark\.[A-Za-z0-9.\-]+", data)}
                    if "k8s" in entry:  # constant-pool strings (tag 1, u2 length) of a "." suffix; \x01 marks a concat recipe
                        suffixes |= {m.decode() for m in re.findall(rb"\x01\x00[\x03-\x40]\x01?(\.[a-z][A-Za-z]+)(?=[\x00-\x1f])", data)}
    assert any(n.startswith("spark.kubernetes.") for n in names), "no Kubernetes settings found in Spark's jars"
    names |= {n + s for n in names if n.startswith("spark.kubernetes.") and not n.endswith(".") for s in suffixes}
    return {n for n in names if not n.endswith(".")}, {n for n in names if n.endswith(".")}


VOLUME_KEY = re.compile(r"^spark\.kubernetes\.(driver|executor)\.volumes\.(hostPath|emptyDir|nfs|persistentVolumeClaim)"
                        r"\.[a-z0-9]([-a-z0-9]*[a-z0-9])?\.(mount\.(path|readOnly|subPath)|options\.\w+)$")
BYTES = re.compile(r"^\d+[kmgtp]?b?$", re.IGNORECASE)
ENV_REF = re.compile(r"^\$\{env:[A-Za-z_][A-Za-z0-9_]*\}$")


def spark_conf_problems(conf: dict[str, str]) -> list[str]:
    exact, prefixes = spark_known_keys()
    problems = []
    for key, value in conf.items():
        if VOLUME_KEY.match(key):
            pass
        elif key not in exact and not any(key.startswith(p) and len(key) > len(p) for p in prefixes):
            problems.append(f"{key}: not a Spark setting")
        if key.endswith((".memory", ".memoryOverhead")) and not BYTES.match(value):
            problems.append(f"{key}: {value!r} is not a size")
        if key.endswith((".instances", ".cores", ".port", ".partitions")) and "request" not in key and not value.isdigit():
            problems.append(f"{key}: {value!r} is not an integer")
        if key.endswith("request.cores") and not re.match(r"^\d+(\.\d+)?m?$", value):
            problems.append(f"{key}: {value!r} is not a Kubernetes CPU quantity")
        if key.endswith((".readOnly", "deleteOnTermination")) and value not in ("true", "false"):
            problems.append(f"{key}: {value!r} is not a boolean")
        if "${" in value and not ENV_REF.match(value):
            problems.append(f"{key}: {value!r}: Spark substitutes only whole ${{env:NAME}} references here")
    return problems


def test_spark_on_kubernetes_settings_are_spark_settings_with_valid_values():
    section = yaml.safe_load(SPARK_K8S.read_text())["spark"]
    spark = SparkConfig.model_validate(section)  # the pipeline config's own schema
    assert spark.master.startswith("k8s://https://")
    assert any(k.startswith("spark.kubernetes.") for k in spark.conf)
    assert spark_conf_problems(spark.conf) == []
    # The driver's address comes from the variable the Helm values set from the pod IP.
    env = yaml.safe_load(HELM_VALUES.read_text())["dagster-user-deployments"]["deployments"][0]["env"]
    assert "${env:KILN_POD_IP}" == spark.conf["spark.driver.host"] and "KILN_POD_IP" in {e["name"] for e in env}


def test_the_spark_check_catches_typos_and_bad_values():
    assert spark_conf_problems({"spark.kubernetes.contianer.image": "x", "spark.executor.memory": "lots",
                                "spark.executor.instances": "four", "spark.driver.host": "${KILN_POD_IP}"}) == [
        "spark.kubernetes.contianer.image: not a Spark setting", "spark.executor.memory: 'lots' is not a size",
        "spark.executor.instances: 'four' is not an integer",
        "spark.driver.host: '${KILN_POD_IP}': Spark substitutes only whole ${env:NAME} references here"]


# --- DeepSpeed hostfile -----------------------------------------------------------------------------

def test_hostfile_parses_with_deepspeeds_own_parser(tmp_path):
    from deepspeed.launcher.runner import fetch_hostfile

    hosts = fetch_hostfile(str(HOSTFILE))
    assert list(hosts) == ["gpu-node-1", "gpu-node-2"] and set(hosts.values()) == {8}
    # The parser really rejects what is wrong (so the check above can fail).
    bad = tmp_path / "hostfile"
    bad.write_text("gpu-node-1 slots=eight\n")
    with pytest.raises(ValueError):
        fetch_hostfile(str(bad))
    # The settings the README pairs with it fit the file: num_nodes hosts, num_gpus slots each.
    readme = (INFRA / "README.md").read_text()
    nodes = int(re.search(r"num_nodes: (\d+)", readme).group(1))
    gpus = int(re.search(r"num_gpus: (\d+)", readme).group(1))
    assert len(hosts) == nodes and all(slots >= gpus for slots in hosts.values())


# --- MLflow server ----------------------------------------------------------------------------------

def manifests(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def test_mlflow_manifest_is_kubernetes_objects_whose_server_flags_mlflow_accepts():
    import click
    from mlflow.cli import server

    docs = manifests(MLFLOW)
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}
    for doc in docs:
        assert re.match(r"^(apps/)?v1$", doc["apiVersion"]) and doc["metadata"]["name"] and doc["metadata"]["namespace"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"][
        "labels"].items()
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["mlflow", "server"]
    # mlflow's own click parser: unknown flags and bad values raise here as they would in the pod.
    with server.make_context("server", list(container["args"])) as ctx:
        params = ctx.params
    assert params["artifacts_destination"].startswith("s3://") and params["serve_artifacts"]
    assert params["port"] == int(container["ports"][0]["containerPort"])
    with pytest.raises(click.UsageError):
        server.make_context("server", [*container["args"], "--backend-store-url", "x"])
    # The backend store (Postgres) arrives through the variable mlflow reads, from a Secret.
    option = next(p for p in server.params if p.name == "backend_store_uri")
    env = {e["name"]: e for e in container["env"]}
    assert env[option.envvar]["valueFrom"]["secretKeyRef"]["name"]
    assert "--backend-store-uri" not in container["args"]


# --- the Postgres helper script and credentials -----------------------------------------------------

def test_postgres_script_passes_the_shell_linters():
    syntax = subprocess.run(["bash", "-n", str(PG_SCRIPT)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    if not shutil.which("shellcheck"):  # bash -n above always runs; CI installs and requires shellcheck
        skip_or_fail("shellcheck", "shellcheck not installed (Debian: apt-get install shellcheck)")
    lint = subprocess.run(["shellcheck", str(PG_SCRIPT), str(REPO_ROOT / ".ci" / "run")], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


SECRET_TEXT = [
    re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b"),  # AWS access key ids
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"(?i)(password|passwd|secret_access_key|api_key|token)\s*[:=]\s*[\"']?(?![\"'$({<]|$)[^\s\"']{4,}"),
]
URL_CREDENTIALS = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@]+:([^@\s/]+)@")
SECRET_KEY = re.compile(r"(password|passwd|secretaccesskey|secretkey|token|apikey|credentials)$")
SECRET_ENV = re.compile(r"(PASSWORD|SECRET|TOKEN|_KEY$|STORE_URI$|CREDENTIALS)")


def secret_findings(name: str, text: str) -> list[str]:
    """Literal credentials in a file: known key formats, `password: value` assignments, URLs with a
    password, and (in YAML) secret-named keys or env vars with a literal value instead of a reference."""
    found = [f"{name}: {m.group(0)[:40]!r}" for pattern in SECRET_TEXT for m in pattern.finditer(text)]
    for match in URL_CREDENTIALS.finditer(text):
        if not re.fullmatch(r"[A-Z_]+|\$\{?\(?[A-Za-z_]+\)?\}?", match.group(1)):  # PASSWORD placeholders are fine
            found.append(f"{name}: URL with a password")
    if name.endswith((".yaml", ".yml")):
        def walk(node):
            if isinstance(node, dict):
                if isinstance(node.get("name"), str) and SECRET_ENV.search(node["name"]) and node.get("value"):
                    found.append(f"{name}: env {node['name']} has a literal value")
                for key, value in node.items():
                    if SECRET_KEY.search(re.sub(r"[^a-z]", "", str(key).lower())) and isinstance(value, (str, int)) \
                            and value != "":
                        found.append(f"{name}: {key} has a literal value")
                    walk(value)
            elif isinstance(node, list):
                for item in node:
                    walk(item)
        for doc in yaml.safe_load_all(text):
            walk(doc)
    return found


def test_no_credentials_in_infra():
    findings = [f for path in infra_files() for f in secret_findings(path.name, path.read_text())]
    findings += secret_findings("dagster.yaml", (REPO_ROOT / "dagster.yaml").read_text())
    assert findings == []


@pytest.mark.parametrize("name, text", [
    ("a.yaml", "aws_access_key_id: AKIAABCDEFGHIJKLMNOP\n"),
    ("a.yaml", "postgresql:\n  postgresqlPassword: hunter22\n"),
    ("a.yaml", "env:\n  - name: AWS_SECRET_ACCESS_KEY\n    value: abc/def+ghi\n"),
    ("a.yaml", "uri: postgresql://kiln:s3cr3t@db:5432/mlflow\n"),
    ("run.sh", "export DAGSTER_PG_PASSWORD=hunter22\n"),
    ("key.pem", "-----BEGIN RSA PRIVATE KEY-----\n"),
])
def test_the_credential_check_finds_planted_secrets(name, text):
    assert secret_findings(name, text)
