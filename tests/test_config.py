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


def test_classifier_code_version_hashes_only_the_reference_files_it_reads(tmp_path):
    """A reference folder is hashed as quality_classifier reads it (reference_patterns minus
    reference_exclude): a README beside the corpus is not part of its code_version."""
    import os

    from workflows.config import code_version

    corpus = tmp_path / "prose"
    (corpus / "part").mkdir(parents=True)
    (corpus / "part" / "book.txt").write_text("A reference paragraph.\n\nAnother one.\n", encoding="utf-8")
    (corpus / "README.md").write_text("Where the books came from.\n", encoding="utf-8")
    (corpus / "SOURCE.txt").write_text("https://example.org/books\n", encoding="utf-8")  # a *.txt, but excluded
    data = base()
    data["quality_classifier"]["reference_paths"] = [str(corpus)]
    config = parse_config(data)
    before = code_version(config, "quality_classifier")

    for excluded in ("README.md", "SOURCE.txt"):
        (corpus / excluded).write_text("Edited provenance notes, longer than before.\n", encoding="utf-8")
        (corpus / "notes.md").write_text("not a reference pattern\n", encoding="utf-8")
    assert code_version(config, "quality_classifier") == before

    book = corpus / "part" / "book.txt"
    book.write_text(book.read_text(encoding="utf-8") + "\nA third paragraph.\n", encoding="utf-8")
    os.utime(book, ns=(2, 2))  # the hash cache is keyed by (path, mtime, size): a new mtime, set explicitly
    assert code_version(config, "quality_classifier") != before


def test_a_reference_folder_without_readable_files_names_the_field(tmp_path):
    from workflows.config import code_version

    (tmp_path / "README.md").write_text("only notes here\n", encoding="utf-8")
    data = base()
    data["quality_classifier"]["reference_paths"] = [str(tmp_path)]
    with pytest.raises(ConfigError, match=r"quality_classifier\.reference_paths\.0: .*no file matching"):
        code_version(parse_config(data), "quality_classifier")
