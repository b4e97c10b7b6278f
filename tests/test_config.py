"""An invalid config fails at load, naming the field and what is allowed."""
import pytest
import yaml

from workflows.config import DEFAULT_CONFIG_PATH, ConfigError, load_config, parse_config


def base() -> dict:
    return yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())


def test_checked_in_config_is_valid():
    assert load_config().buckets == ["reference", "web"]


def test_negative_threshold_names_the_field():
    data = base()
    data["filters"]["max_dup_line_frac"] = -0.5
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert "filters.max_dup_line_frac" in str(error.value)
    assert "greater than or equal to 0" in str(error.value)


def test_weights_for_an_unknown_bucket_name_the_field():
    data = base()
    data["mix"]["bucket_weights"] = {"web": 0.5, "books": 0.5}
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    message = str(error.value)
    assert "mix.bucket_weights" in message and "'books'" in message and "reference, web" in message


def test_unknown_key_is_rejected():
    data = base()
    data["training"]["stpes"] = 10
    with pytest.raises(ConfigError, match=r"training\.stpes"):
        parse_config(data)


def test_signature_size_must_match_dedup():
    data = base()
    data["quality_signals"]["num_perm"] = 64
    with pytest.raises(ConfigError, match="num_perm"):
        parse_config(data)


def test_definitions_fail_to_load_on_invalid_config(tmp_path):
    import os
    import subprocess
    import sys

    data = base()
    data["training"]["steps"] = -1
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    result = subprocess.run([sys.executable, "-c", "import workflows.definitions"], capture_output=True, text=True,
                            env={**os.environ, "KILN_CONFIG": str(bad)})
    assert result.returncode != 0
    assert "training.steps" in result.stderr
