"""Write, then mark done: content-hash folders, manifest, _SUCCESS last."""
import pytest

from workflows.storage import MANIFEST, SUCCESS, LocalStorage, StorageError


def write(storage, text):
    staging = storage.new_staging_dir("a", "p")
    (staging / "data.txt").write_text(text)
    return storage.publish(staging, "a", "p", {"counts": {"n": 1}})


def test_publish_is_content_addressed_and_idempotent(tmp_path):
    storage = LocalStorage(tmp_path)
    first = write(storage, "hello")
    again = write(storage, "hello")
    other = write(storage, "world")
    assert first.data_version == again.data_version != other.data_version
    assert (first.path / SUCCESS).exists() and (first.path / MANIFEST).exists()
    assert first.manifest()["counts"] == {"n": 1}
    assert storage.latest("a", "p").data_version == other.data_version
    assert not [p for p in (tmp_path / "a" / "p").iterdir() if p.name.startswith(".staging")]


def test_unfinished_output_is_never_resolved(tmp_path):
    storage = LocalStorage(tmp_path)
    artifact = write(storage, "hello")
    (artifact.path / SUCCESS).unlink()  # as if the run died before marking it done
    with pytest.raises(StorageError, match="_SUCCESS"):
        storage.latest("a", "p")
    with pytest.raises(StorageError, match="has not been materialized"):
        storage.latest("a", "other")


def test_version_files_limit_what_the_hash_covers(tmp_path):
    storage = LocalStorage(tmp_path)
    versions = []
    for timing in ("1.0", "2.0"):
        staging = storage.new_staging_dir("b", None)
        (staging / "model.bin").write_bytes(b"weights")
        (staging / "timings.json").write_text(timing)
        versions.append(storage.publish(staging, "b", None, {}, version_files=["model.bin"]).data_version)
    assert versions[0] == versions[1]
