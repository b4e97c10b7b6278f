"""The Dagster instance config that `kiln demo` and `make ui` put into $DAGSTER_HOME.

The repo's `dagster.yaml` is the base: sqlite storage under $DAGSTER_HOME. When DAGSTER_PG_HOST is
set, a Postgres storage block is added whose every field is an `{env: ...}` reference, so no host,
user or password is ever written to disk; Dagster reads them from the environment at start-up.
"""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from workflows.config import REPO_ROOT, ConfigError, state_dir

BASE_CONFIG = REPO_ROOT / "dagster.yaml"
# Field of Dagster's `postgres_db` block -> environment variable, and whether it must be set.
PG_ENV = {
    "hostname": ("DAGSTER_PG_HOST", True),
    "username": ("DAGSTER_PG_USER", True),
    "db_name": ("DAGSTER_PG_DB", True),
    "password": ("DAGSTER_PG_PASSWORD", False),  # unset: trust/peer auth
    "port": ("DAGSTER_PG_PORT", False),  # unset: 5432
}
PG_SCHEME = "postgresql+psycopg2"
HEADER = ("# Written by kiln from the repository's dagster.yaml (Postgres storage when DAGSTER_PG_HOST is set).\n"
          "# Kiln rewrites this file while this line is here; delete the line to keep your own edits.\n")


def uses_postgres(environ=os.environ) -> bool:
    return bool(environ.get("DAGSTER_PG_HOST"))


def instance_yaml(environ=os.environ) -> str:
    """The instance config for this environment: the base file, plus Postgres storage if configured."""
    text = HEADER + BASE_CONFIG.read_text()
    if not uses_postgres(environ):
        return text
    missing = [var for var, required in PG_ENV.values() if required and not environ.get(var)]
    if missing:
        raise ConfigError(f"DAGSTER_PG_HOST is set, so Dagster uses Postgres, but {', '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not set")
    db = {field: {"env": var} for field, (var, _) in PG_ENV.items() if environ.get(var)}
    # SQLAlchemy 2.1 maps plain postgresql:// to psycopg 3; dagster-postgres ships psycopg2.
    db["scheme"] = PG_SCHEME
    storage = {"storage": {"postgres": {"postgres_db": db}}}
    return text + "\n# DAGSTER_PG_HOST is set: run, event and schedule storage in Postgres.\n" + yaml.safe_dump(storage)


def _same_settings(a: str, b: str) -> bool:
    try:
        return yaml.safe_load(a) == yaml.safe_load(b)
    except yaml.YAMLError:
        return False


def ensure_dagster_home(environ=os.environ) -> Path:
    """DAGSTER_HOME defaults to <state>/dagster; its dagster.yaml follows the environment (sqlite or
    Postgres) unless the user has taken the file over by deleting Kiln's header line."""
    home = Path(environ.get("DAGSTER_HOME") or state_dir() / "dagster")
    home.mkdir(parents=True, exist_ok=True)
    target = home / "dagster.yaml"
    current = target.read_text() if target.exists() else None
    # Earlier Kiln versions copied the base file verbatim: a copy with the same settings is Kiln's too.
    if current is None or current.startswith(HEADER) or _same_settings(current, BASE_CONFIG.read_text()):
        wanted = instance_yaml(environ)
        if current != wanted:
            target.write_text(wanted)
    os.environ["DAGSTER_HOME"] = str(home)
    return home


if __name__ == "__main__":  # `make ui` prepares $DAGSTER_HOME this way
    import sys

    try:
        print(ensure_dagster_home())
    except ConfigError as error:
        sys.exit(f"dagster.yaml: {error}")
