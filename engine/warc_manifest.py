"""What a folder of WARC files holds: names, sizes, sha256 and record counts."""
from pathlib import Path

from fastwarc.warc import ArchiveIterator

from workflows.storage import file_sha256


def count_records(path: Path) -> int:
    """Records fastwarc can read; a corrupt tail stops the count instead of raising."""
    count = 0
    try:
        with open(path, "rb") as stream:
            for _ in ArchiveIterator(stream, parse_http=False):
                count += 1
    except Exception:  # malformed input is counted, never fatal
        pass
    return count


def describe_warc_files(folder: Path) -> list[dict]:
    return [
        {"name": p.name, "size": p.stat().st_size, "sha256": file_sha256(p), "records": count_records(p)}
        for p in sorted(folder.iterdir())
        if p.is_file()
    ]
