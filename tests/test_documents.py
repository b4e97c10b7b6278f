import gzip
import hashlib
import importlib.util
import json
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
from fastwarc.warc import ArchiveIterator

from engine.documents import (
    DOCUMENT_COLUMNS,
    bucket_resolver,
    count_skips,
    doc_id_for,
    extract_documents,
    extract_warc,
    normalise_warc_date,
    payload_key,
)
from engine.sample_crawl import SAMPLE_DOMAIN_BUCKETS, generate_sample_crawl

# What each shared test file holds (see its SOURCE.txt), as extract_warc must count it.
EXPECTED_SHARED = {
    "cc_whirlwind/whirlwind.warc.gz": {"documents": 1, "not_response": 3},
    "cc_whirlwind/whirlwind.warc.wat.gz": {"not_response": 2},
    "cc_whirlwind/whirlwind.warc.wet": {"documents": 1, "not_response": 1},
    "cc_whirlwind/whirlwind.warc.wet.gz": {"documents": 1, "not_response": 1},
    # wget: 22/15 pages, plus its arguments and log as text/plain resource records
    "dolma/tests_data_warc_sample-0000.warc.gz": {"documents": 22, "non_html": 2, "not_response": 24},
    "dolma/tests_data_warc_sample-0001.warc.gz": {"documents": 15, "non_html": 2, "not_response": 17},
    "edgecases_jwarc/test-resources_org_netpreserve_jwarc_cc.warc.gz": {"documents": 1},
    "edgecases_jwarc/test-resources_org_netpreserve_jwarc_gzip_extra_sl.warc.gz": {"not_response": 1},
    "edgecases_warcio/test_data_example.warc": {"documents": 1, "not_response": 4, "revisit": 1},
    "edgecases_warcio/test_data_example.warc.gz": {"documents": 1, "not_response": 4, "revisit": 1},
    "edgecases_warcio/test_data_example-bad-non-chunked.warc.gz": {"documents": 1, "not_response": 4, "revisit": 1},
    "edgecases_warcio/test_data_example-digest.warc": {"not_response": 4},
    "edgecases_warcio/test_data_example-iana.org-chunked.warc": {"documents": 1, "not_response": 2},
    "edgecases_warcio/test_data_example-resource.warc.gz": {"documents": 1, "not_response": 2},
    "edgecases_warcio/test_data_example-space-in-target-uri.warc.gz": {"non_html": 1, "not_response": 1},
    # the gzip body is two bytes short of its HTTP Content-Length
    "edgecases_warcio/test_data_example-trunc.warc": {"not_response": 3, "truncated": 1},
    "edgecases_warcio/test_data_example-wget-bad-target-uri.warc.gz": {"documents": 1, "non_html": 2, "not_response": 3},
    "edgecases_warcio/test_data_example-wrong-chunks.warc.gz": {"documents": 1, "not_response": 1},
    "edgecases_warcio/test_data_example.arc": {"not_warc": 1},
    "edgecases_warcio/test_data_example.arc.gz": {"not_warc": 1},
    "edgecases_warcio/test_data_post-test.warc.gz": {"non_html": 3, "not_response": 3},
    # one page cut off 13 kB before its declared Content-Length
    "resiliparse/tests_data_clipped.warc.gz": {"truncated": 1},
    "resiliparse/tests_data_clueweb-quirk.warc.gz": {"documents": 29, "not_response": 1},
    # two of its pages are a pagination bar and an empty listing: no main text (kiln extractor)
    "resiliparse/tests_data_warcfile.warc.gz": {"documents": 14, "empty_text": 2, "not_response": 34},
}
DOC_KINDS = {"good", "boilerplate", "spam", "exact_dup", "near_dup"}
MOJIBAKE = re.compile("[ÃÂÐÑ¤¥¡£¢]{2,}|\ufffd")


def _warc_dir(shared_data: Path) -> Path:
    path = shared_data / "warc"
    if not path.exists():
        pytest.skip("shared WARC data not present")
    return path


def _extract(path, snapshot="CC-TEST", **kwargs):
    rows = list(extract_warc(str(path), snapshot, **kwargs))
    return [r for r in rows if "doc_id" in r], count_skips(rows)


def _script_share(text: str, pattern: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(bool(re.match(pattern, c)) for c in letters) / max(len(letters), 1)


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample")
    summary = generate_sample_crawl(str(out))
    labels = json.loads((out / "labels.json").read_text(encoding="utf-8"))
    return [str(out / name) for name in summary["warc_files"]], labels


# --- shared real-world data ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(EXPECTED_SHARED))
def test_shared_file_counts(shared_data, name):
    path = _warc_dir(shared_data) / name
    if not path.exists():
        pytest.skip(f"{name} missing")
    docs, counts = _extract(path)
    assert dict(counts) == EXPECTED_SHARED[name]
    for doc in docs:
        assert tuple(doc) == DOCUMENT_COLUMNS
        assert all(isinstance(doc[c], str) for c in DOCUMENT_COLUMNS)
        assert doc["text"].strip() and "\n\n" not in doc["text"]
        assert doc["doc_id"] == hashlib.sha1(f"CC-TEST\x00{doc['warc_record_id']}".encode()).hexdigest()[:20]


def test_every_shared_file_is_read_without_raising(shared_data):
    files = [p for p in sorted(_warc_dir(shared_data).rglob("*")) if p.is_file() and p.name != "SOURCE.txt"]
    assert files
    for path in files:
        rows = list(extract_warc(str(path), "S"))
        assert all(("doc_id" in r) != ("skip_reason" in r) for r in rows), path


def test_legacy_charsets_decode_to_real_script(shared_data):
    warc = _warc_dir(shared_data) / "resiliparse"
    docs, _ = _extract(warc / "tests_data_warcfile.warc.gz")
    by_charset = {}
    for doc in docs:
        by_charset.setdefault(doc["charset"], []).append(doc)
    assert {"cp1251", "gbk", "cp1252", "utf-8"} <= set(by_charset)
    russian = next(d for d in by_charset["cp1251"] if d["domain"] == "01spb.ru")
    # (its headline "О компании" is dropped with every headline by the kiln extractor)
    assert "пожарной безопасности" in russian["text"] and _script_share(russian["text"], "[\u0400-\u04ff]") > 0.8
    chinese = [d for d in by_charset["gbk"] if _script_share(d["text"], "[\u4e00-\u9fff]") > 0.5]
    assert len(chinese) >= 4
    assert any("耐磨板特价销售" in d["text"] for d in chinese)
    for doc in by_charset["cp1251"] + by_charset["gbk"]:
        assert not MOJIBAKE.search(doc["text"]), doc["url"]

    japanese, _ = _extract(warc / "tests_data_clueweb-quirk.warc.gz")
    assert {d["charset"] for d in japanese} == {"euc_jp"}
    for doc in japanese:
        # the shop's name (吉田カバン) sits in its page header, which the kiln extractor drops
        assert "ポーター" in doc["text"] and not MOJIBAKE.search(doc["text"])
        assert _script_share(doc["text"], "[\u3040-\u30ff\u4e00-\u9fff]") > 0.5


def test_wet_conversion_text_passes_through(shared_data):
    folder = _warc_dir(shared_data) / "cc_whirlwind"
    raw = next(r.reader.read() for r in ArchiveIterator(str(folder / "whirlwind.warc.wet.gz"))
               if str(r.record_type) == "conversion")
    (wet,), _ = _extract(folder / "whirlwind.warc.wet.gz")
    (plain_wet,), _ = _extract(folder / "whirlwind.warc.wet")
    (html,), _ = _extract(folder / "whirlwind.warc.gz")
    assert wet["text"] == raw.decode("utf-8") == plain_wet["text"]
    assert wet["url"] == html["url"] == "https://an.wikipedia.org/wiki/Escopete"
    # WET points at its response record, so both routes key the capture the same way.
    assert wet["doc_id"] == html["doc_id"] and wet["warc_record_id"] == html["warc_record_id"]
    assert wet["fetch_time"] == html["fetch_time"] == "2024-05-18T01:58:10Z"
    assert "Escopete" in html["text"] and len(html["text"]) > 500


def test_transfer_and_content_encodings_are_undone(shared_data):
    warcio = _warc_dir(shared_data) / "edgecases_warcio"
    (chunked,), _ = _extract(warcio / "test_data_example-iana.org-chunked.warc")
    assert "Internet Assigned Numbers Authority" in chunked["text"]
    assert not re.search(r"^[0-9a-f]{2,6}$", chunked["text"], re.M)  # no chunk-size lines
    (gzipped,), _ = _extract(warcio / "test_data_example-bad-non-chunked.warc.gz")
    # the page's <h1> "Example Domain" is a headline, which the kiln extractor drops
    assert gzipped["text"].startswith("This domain is established to be used for illustrative examples")


def test_wget_angle_bracket_uris(shared_data):
    docs, _ = _extract(_warc_dir(shared_data) / "dolma" / "tests_data_warc_sample-0000.warc.gz")
    assert all(d["url"].startswith("https://") and d["domain"] == d["domain"].lower() for d in docs)
    assert "soldaini.net" in {d["domain"] for d in docs}


# --- damaged input built from the sample crawl (no shared data needed) ------------------------

def _members(path: str) -> list[bytes]:
    data = Path(path).read_bytes()
    starts = [rec.stream_pos for rec in ArchiveIterator(path, parse_http=False)] + [len(data)]
    return [data[a:b] for a, b in zip(starts, starts[1:])]


def test_bad_gzip_member_is_counted_and_reading_resumes(sample, tmp_path):
    path = sample[0][0]
    intact_docs, intact = _extract(path)
    members = _members(path)
    broken = bytearray(members[11])
    broken[len(broken) // 2:len(broken) // 2 + 64] = bytes(64)
    damaged = tmp_path / "damaged.warc.gz"
    damaged.write_bytes(b"".join(members[:11]) + bytes(broken) + b"".join(members[12:]))
    docs, counts = _extract(damaged)
    assert counts["bad_gzip"] == 1
    assert len(docs) >= len(intact_docs) - 1
    assert docs[-1]["doc_id"] == intact_docs[-1]["doc_id"]  # records after the damage survive


def _gzip_members(path: Path) -> list[int]:
    """Start offsets of the gzip members of `path`, read with zlib (independent of FastWARC)."""
    import zlib

    data, starts, pos = path.read_bytes(), [], 0
    while pos < len(data):
        starts.append(pos)
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
        inflater.decompress(data[pos:])
        pos = len(data) - len(inflater.unused_data)
    return starts


@pytest.mark.parametrize("where", ["deflate_data", "gzip_header"])
def test_damaged_first_gzip_member_costs_only_that_member(shared_data, tmp_path, where):
    """A real multi-member file (wget via dolma: 48 members, the first its warcinfo) with bytes
    zeroed inside the first member: it used to count as one not_warc and lose every record."""
    source = _warc_dir(shared_data) / "dolma" / "tests_data_warc_sample-0000.warc.gz"
    starts = _gzip_members(source)
    assert len(starts) == 48 and starts[1] > 200
    data = bytearray(source.read_bytes())
    at = 0 if where == "gzip_header" else 30  # the magic bytes, or the start of the deflate stream
    data[at:at + 16] = bytes(16)
    damaged = tmp_path / "damaged.warc.gz"
    damaged.write_bytes(bytes(data))
    intact_docs, intact = _extract(source)
    docs, counts = _extract(damaged)
    # Only the warcinfo record is lost; every page after it comes out as before.
    assert counts == {**intact, "bad_gzip": 1, "not_response": intact["not_response"] - 1}
    assert [{**d, "warc_file": ""} for d in docs] == [{**d, "warc_file": ""} for d in intact_docs]


def test_damaged_first_record_of_a_plain_warc(shared_data, tmp_path):
    source = _warc_dir(shared_data) / "edgecases_warcio" / "test_data_example.warc"
    data = source.read_bytes()
    assert data.startswith(b"WARC/1.0\r\n")
    damaged = tmp_path / "damaged.warc"
    damaged.write_bytes(b"XXXX" + data[4:])
    _, intact = _extract(source)
    _, counts = _extract(damaged)
    assert counts == {**intact, "corrupt": 1, "not_response": intact["not_response"] - 1}


def test_truncated_file(sample, tmp_path):
    data = Path(sample[0][0]).read_bytes()
    cut = tmp_path / "cut.warc.gz"
    cut.write_bytes(data[: len(data) // 2])
    docs, counts = _extract(cut)
    assert docs and counts["truncated"] + counts.get("bad_gzip", 0) == 1


def test_garbage_empty_and_missing_files(tmp_path):
    (tmp_path / "garbage.warc.gz").write_bytes(b"\x1f\x8b\x08\x00" + b"not really gzip" * 50)
    (tmp_path / "text.warc").write_bytes(b"hello\nworld\n" * 100)
    (tmp_path / "plain.txt.gz").write_bytes(gzip.compress(b"filedesc://an-arc-file 0.0.0.0 19960923142103\n"))
    (tmp_path / "empty.warc").write_bytes(b"")
    assert _extract(tmp_path / "garbage.warc.gz")[1] == {"not_warc": 1}
    assert _extract(tmp_path / "text.warc")[1] == {"not_warc": 1}
    assert _extract(tmp_path / "plain.txt.gz")[1] == {"not_warc": 1}
    assert _extract(tmp_path / "empty.warc")[1] == {}
    with pytest.raises(FileNotFoundError):
        list(extract_warc(str(tmp_path / "missing.warc.gz"), "S"))


def _response_without_id(url: str, payload: bytes, date: str) -> bytes:
    http = b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n\r\n" + payload
    head = (f"WARC/1.0\r\nWARC-Type: response\r\nWARC-Target-URI: {url}\r\nWARC-Date: {date}\r\n"
            f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(http)}\r\n\r\n")
    return head.encode() + http + b"\r\n\r\n"


PAGE = b"<html><body><article><p>" + b"A paragraph of text long enough to be main content. " * 8 + b"</p></article></body></html>"


def _records_without_id(path: Path) -> Path:
    """Three responses without WARC-Record-ID: two URLs with one payload, and the first one again
    (same URL and payload, fetched later): a true repeat."""
    path.write_bytes(
        _response_without_id("http://a.test/", PAGE, "2024-01-01T00:00:00Z")
        + _response_without_id("http://b.test/", PAGE, "2024-01-02T00:00:00Z")
        + _response_without_id("http://a.test/", PAGE, "2024-01-03T00:00:00Z"))
    return path


def test_record_without_record_id_is_keyed_by_url_and_payload(tmp_path):
    docs, counts = _extract(_records_without_id(tmp_path / "noid.warc"), snapshot="S")
    assert counts == {"documents": 3}
    assert [d["warc_record_id"] for d in docs] == ["", "", ""]
    ids = [d["doc_id"] for d in docs]
    # Not the hash of an empty id, which every such record used to share.
    assert doc_id_for("S", "") not in ids
    assert ids[0] == doc_id_for("S", payload_key("http://a.test/", PAGE)) == ids[2] != ids[1]


def test_spark_stage_keeps_one_row_per_doc_id(spark, shared_data, tmp_path):
    """The .warc.gz and both .wet files of one capture, and repeated id-less records, in one
    folder: one row per doc_id, the response record's, whatever order the files are listed in."""
    folder = tmp_path / "snapshot"
    folder.mkdir()
    for name in ("whirlwind.warc.gz", "whirlwind.warc.wet", "whirlwind.warc.wet.gz"):
        shutil.copy(_warc_dir(shared_data) / "cc_whirlwind" / name, folder / name)
    _records_without_id(folder / "noid.warc")
    paths = sorted(str(p) for p in folder.iterdir())
    loop = Counter()
    for path in paths:
        loop += _extract(path, snapshot="S")[1]
    assert loop["documents"] == 6
    for order in (paths, paths[::-1]):
        df, counts = extract_documents(spark, order, "S")
        rows = sorted((r.asDict() for r in df.collect()), key=lambda r: r["url"])
        assert counts == {**loop, "documents": 3, "duplicate_record": 3}
        assert [r["url"] for r in rows] == ["http://a.test/", "http://b.test/", "https://an.wikipedia.org/wiki/Escopete"]
        assert len({r["doc_id"] for r in rows}) == 3
        # The response record beats the WET conversions; the earlier of two repeats in a file wins.
        assert rows[2]["warc_file"] == "whirlwind.warc.gz"
        (html,), _ = _extract(folder / "whirlwind.warc.gz", snapshot="S")
        assert rows[2] == html
        assert rows[0]["fetch_time"] == "2024-01-01T00:00:00Z"


def test_documents_asset_lists_every_skip_reason(spark, shared_data, tmp_path, monkeypatch):
    """The asset's `skipped_records` table: each reason with its count, duplicate_record included,
    over a warc_dir snapshot with duplicates, a damaged first member and an ARC-in-WARC-name file."""
    import dagster as dg
    import pyarrow.parquet as pq
    import yaml

    from assets.documents import documents
    from assets.raw_crawl import raw_crawl
    from workflows.kiln import SNAPSHOTS, KilnResource

    shared = _warc_dir(shared_data)
    folder = tmp_path / "drop"
    folder.mkdir()
    for name in ("whirlwind.warc.gz", "whirlwind.warc.wet"):
        shutil.copy(shared / "cc_whirlwind" / name, folder / name)
    shutil.copy(shared / "edgecases_warcio" / "test_data_example-trunc.warc", folder / "trunc.warc")
    shutil.copy(shared / "edgecases_warcio" / "test_data_example.arc.gz", folder / "arc-named.warc.gz")
    damaged = bytearray((shared / "dolma" / "tests_data_warc_sample-0001.warc.gz").read_bytes())
    damaged[30:46] = bytes(16)
    (folder / "damaged.warc.gz").write_bytes(bytes(damaged))
    _records_without_id(folder / "noid.warc")
    expected = Counter()
    for path in folder.iterdir():
        expected += _extract(path, snapshot="drop")[1]
    expected["duplicate_record"] = 2
    expected["documents"] -= 2
    assert {"bad_gzip", "not_warc", "truncated", "non_html", "not_response"} <= set(expected)

    monkeypatch.setenv("KILN_STATE_DIR", str(tmp_path / "state"))
    config = {"raw_crawl": {"snapshots": {"drop": {"kind": "warc_dir", "path": str(folder)}}},
              "storage": {"root": str(tmp_path / "storage")}}
    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(config))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(SNAPSHOTS.name, ["drop"])
    result = dg.materialize([raw_crawl, documents], partition_key="drop", instance=instance,
                            resources={"kiln": KilnResource(config_path=str(tmp_path / "pipeline.yaml"))})
    assert result.success
    table = result.asset_materializations_for_node("documents")[0].metadata["skipped_records"].value
    lines = table.splitlines()
    assert lines[:2] == ["| reason | records |", "|---|---|"]
    listed = [tuple(cell.strip() for cell in line.strip("|").split("|")) for line in lines[2:]]
    assert {reason: int(n) for reason, n in listed} == {k: v for k, v in expected.items() if k != "documents"}
    assert [int(n) for _, n in listed] == sorted((int(n) for _, n in listed), reverse=True)
    published = next((tmp_path / "storage" / "documents" / "drop").glob("*/_SUCCESS")).parent
    ids = pq.read_table(published / "data", columns=["doc_id"]).column("doc_id").to_pylist()
    assert len(ids) == len(set(ids)) == expected["documents"]


# --- the sample crawl ------------------------------------------------------------------------

def test_sample_crawl_extracts_what_its_labels_say(sample):
    paths, labels = sample
    docs, counts = [], Counter()
    for path in paths:
        d, c = _extract(path, domain_buckets=SAMPLE_DOMAIN_BUCKETS)
        docs += d
        counts += c
    by_url = {d["url"]: d for d in docs}
    assert set(by_url) == {u for u, v in labels.items() if v["kind"] in DOC_KINDS}
    assert counts["non_200"] == 2 and counts["non_html"] == 2 and counts["revisit"] == 1
    assert counts["corrupt"] == 1 and counts["truncated"] == 1
    assert counts["not_response"] == len(labels) + len(paths)  # requests + warcinfo
    for url, doc in by_url.items():
        label = labels[url]
        assert doc["bucket"] == label["bucket"]
        if label["lang"] == "ru":
            assert _script_share(doc["text"], "[\u0400-\u04ff]") > 0.9
        if label["lang"] == "zh":
            assert _script_share(doc["text"], "[\u4e00-\u9fff]") > 0.9
        assert not MOJIBAKE.search(doc["text"]), url
    charsets = Counter((labels[u]["charset"], d["charset"]) for u, d in by_url.items())
    assert charsets[("windows-1251", "cp1251")] >= 3 and charsets[("gbk", "gbk")] >= 3
    assert charsets[("iso-8859-1", "cp1252")] == 1
    # the gzip-encoded and chunked pages come out as clean prose too
    assert all(not d["text"].startswith(("\x1f", "400\r")) for d in docs)


def test_doc_ids_are_stable_and_snapshot_scoped(sample):
    path = sample[0][1]
    first, _ = _extract(path, snapshot="2024-10")
    second, _ = _extract(path, snapshot="2024-10")
    other, _ = _extract(path, snapshot="2024-11")
    assert [d["doc_id"] for d in first] == [d["doc_id"] for d in second]
    assert len({d["doc_id"] for d in first}) == len(first)
    assert not {d["doc_id"] for d in first} & {d["doc_id"] for d in other}
    assert all(re.fullmatch(r"[0-9a-f]{20}", d["doc_id"]) for d in first)


def test_limits(sample):
    path = sample[0][0]
    all_docs, _ = _extract(path)
    docs, counts = _extract(path, max_bytes=2_500)
    assert counts["too_large"] > 50 and docs
    assert counts["too_large"] + len(docs) == len(all_docs)
    docs, counts = _extract(path, min_text_chars=100_000)
    assert not docs and counts["empty_text"] > 100


def test_unknown_or_missing_extractor(sample):
    with pytest.raises(ValueError):
        list(extract_warc(sample[0][0], "S", extractor="lynx"))
    if importlib.util.find_spec("trafilatura") is None:
        with pytest.raises(ImportError, match="pip install trafilatura"):
            list(extract_warc(sample[0][0], "S", extractor="trafilatura"))


def test_bucket_rules_match_domain_and_subdomains():
    resolve = bucket_resolver({"reference.test": "reference", "docs.reference.test": "docs", "wiki.org": "wiki"}, "web")
    assert resolve("docs.reference.test") == "docs"
    assert resolve("api.docs.reference.test") == "docs"
    assert resolve("reference.test") == "reference"
    assert resolve("notreference.test") == "web"
    assert resolve("en.wiki.org") == "wiki"
    assert resolve("") == "web"


def test_warc_dates_normalise_to_utc():
    assert normalise_warc_date("2024-05-18T01:58:10Z") == "2024-05-18T01:58:10Z"
    assert normalise_warc_date("2024-05-18T03:58:10+02:00") == "2024-05-18T01:58:10Z"
    assert normalise_warc_date("2024-05-18T01:58:10.250Z") == "2024-05-18T01:58:10.250000Z"
    assert normalise_warc_date("2008-10-294T05:21:46-0700") == "2008-10-294T05:21:46-0700"  # kept as written


# --- the Spark stage ---------------------------------------------------------------------------

def test_spark_stage_matches_plain_loop(spark, sample):
    paths, _ = sample
    expected, expected_counts = [], Counter()
    for path in paths:
        docs, counts = _extract(path, snapshot="2024-10", domain_buckets=SAMPLE_DOMAIN_BUCKETS)
        expected += docs
        expected_counts += counts
    df, counts = extract_documents(spark, paths, "2024-10", domain_buckets=SAMPLE_DOMAIN_BUCKETS)
    assert df.columns == list(DOCUMENT_COLUMNS)
    assert {f.dataType.simpleString() for f in df.schema.fields} == {"string"}
    rows = sorted((r.asDict() for r in df.collect()), key=lambda r: r["doc_id"])
    assert rows == sorted(expected, key=lambda r: r["doc_id"])
    assert counts == dict(expected_counts)
    assert df.rdd.getNumPartitions() == len(paths)


def test_spark_stage_on_bad_and_no_files(spark, tmp_path):
    (tmp_path / "garbage.warc.gz").write_bytes(b"\x1f\x8b\x08\x00 nope" * 10)
    df, counts = extract_documents(spark, [str(tmp_path / "garbage.warc.gz")], "S")
    assert counts == {"documents": 0, "not_warc": 1} and df.count() == 0
    df, counts = extract_documents(spark, [], "S")
    assert counts == {"documents": 0} and df.columns == list(DOCUMENT_COLUMNS)
