import json
import random
from collections import Counter
from pathlib import Path

import pytest
from fastwarc.warc import ArchiveIterator

from engine.documents import extract_main_text
from engine.sample_crawl import KINDS, MIN_PAGES, SAMPLE_DOMAIN_BUCKETS, generate_sample_crawl, jaccard


@pytest.fixture(scope="module")
def crawl(tmp_path_factory):
    out = tmp_path_factory.mktemp("sample")
    summary = generate_sample_crawl(str(out))
    labels = json.loads((out / "labels.json").read_text(encoding="utf-8"))
    return out, summary, labels


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def _html_payloads(out: Path, names, labels) -> dict[str, bytes]:
    """Decoded HTML of every page that should become a document."""
    wanted = {u for u, v in labels.items() if v["kind"] in ("good", "spam", "boilerplate", "exact_dup", "near_dup")}
    payloads = {}
    for name in names:
        for rec in ArchiveIterator(str(out / name), parse_http=True, auto_decode="all"):
            url = rec.headers.get("WARC-Target-URI")
            if str(rec.record_type) == "response" and url in wanted:
                payloads[url] = rec.reader.read()
    assert set(payloads) == wanted
    return payloads


def test_same_arguments_give_identical_bytes(crawl, tmp_path):
    out, summary, _ = crawl
    again = generate_sample_crawl(str(tmp_path / "again"))
    assert _files(tmp_path / "again") == _files(out)
    assert {k: v for k, v in again.items() if k != "out_dir"} == {k: v for k, v in summary.items() if k != "out_dir"}


def test_other_seed_gives_other_crawl(crawl, tmp_path):
    out, _, _ = crawl
    generate_sample_crawl(str(tmp_path / "seed1"), seed=1)
    assert _files(tmp_path / "seed1")["sample-00000.warc.gz"] != _files(out)["sample-00000.warc.gz"]


def test_files_and_summary(crawl):
    out, summary, labels = crawl
    assert summary["warc_files"] == ["sample-00000.warc.gz", "sample-00001.warc.gz"]
    assert sorted(p.name for p in out.iterdir()) == ["labels.json", *summary["warc_files"]]
    assert summary["num_pages"] == len(labels) == 300
    assert summary["kinds"] == dict(sorted(Counter(v["kind"] for v in labels.values()).items()))
    assert summary["domain_buckets"] == SAMPLE_DOMAIN_BUCKETS


def test_every_kind_is_present(crawl):
    _, summary, labels = crawl
    kinds = Counter(v["kind"] for v in labels.values())
    assert set(kinds) == set(KINDS)
    for kind in ("boilerplate", "spam", "exact_dup", "near_dup"):
        assert kinds[kind] >= 10, kind
    assert kinds["good"] >= 200


def test_languages_and_buckets(crawl):
    _, _, labels = crawl
    langs = Counter(v["lang"] for v in labels.values() if v["kind"] == "good")
    assert len([lang for lang, n in langs.items() if n >= 15]) >= 4
    assert {"en", "de", "fr", "es", "ru", "zh"} <= set(langs)
    buckets = Counter(v["bucket"] for v in labels.values())
    assert buckets["reference"] >= 30 and buckets["web"] >= 200
    for url, label in labels.items():
        host = url.split("/")[2]
        assert (label["bucket"] == "reference") == (host == "docs.reference.test"), url
    charsets = Counter(v["charset"] for v in labels.values())
    assert charsets["windows-1251"] >= 3 and charsets["gbk"] >= 3 and charsets["iso-8859-1"] >= 1


def test_duplicate_labels_point_at_good_pages(crawl):
    _, _, labels = crawl
    for url, label in labels.items():
        if label["kind"] in ("exact_dup", "near_dup", "revisit"):
            assert labels[label["dup_of"]]["kind"] == "good", url
        else:
            assert label["dup_of"] is None, url


def test_fastwarc_reads_every_record(crawl):
    out, summary, labels = crawl
    types = Counter()
    statuses = Counter()
    truncated = garbled = 0
    for name in summary["warc_files"]:
        for rec in ArchiveIterator(str(out / name), parse_http=True):
            kind = str(rec.record_type)
            types[kind] += 1
            if kind == "response":
                status = rec.http_headers.status_code
                statuses[status] += 1
                garbled += status is None
                truncated += len(rec.reader.read()) < rec.content_length
    n = len(labels)
    assert types["warcinfo"] == len(summary["warc_files"])
    assert types["request"] == n
    assert types["response"] + types["revisit"] == n and types["revisit"] == 1
    assert statuses[404] == 1 and statuses[301] == 1
    assert garbled == 1 and truncated == 1


def test_non_html_payloads_are_real_files(crawl):
    out, summary, labels = crawl
    expected = {url for url, label in labels.items() if label["kind"] == "non_html"}
    seen = {}
    for name in summary["warc_files"]:
        for rec in ArchiveIterator(str(out / name), parse_http=True):
            url = rec.headers.get("WARC-Target-URI")
            if url in expected and str(rec.record_type) == "response":
                seen[rec.http_content_type] = rec.reader.read()
    assert seen["application/pdf"].startswith(b"%PDF-") and seen["application/pdf"].rstrip().endswith(b"%%EOF")
    assert seen["image/png"].startswith(b"\x89PNG\r\n\x1a\n")


def test_duplicates_hold_on_extracted_text(crawl):
    out, summary, labels = crawl
    payloads = _html_payloads(out, summary["warc_files"], labels)
    for url, label in labels.items():
        if label["kind"] == "exact_dup":
            assert payloads[url] == payloads[label["dup_of"]]
        elif label["kind"] == "near_dup":
            copy = extract_main_text(payloads[url].decode("utf-8"))
            original = extract_main_text(payloads[label["dup_of"]].decode("utf-8"))
            assert 0.8 <= jaccard(copy, original) < 1.0, url


def test_distinct_pages_are_not_near_duplicates(crawl):
    out, summary, labels = crawl
    payloads = _html_payloads(out, summary["warc_files"], labels)
    english = sorted(u for u, v in labels.items() if v["kind"] in ("good", "spam", "boilerplate") and v["lang"] == "en")
    texts = {u: extract_main_text(payloads[u].decode("utf-8")) for u in english}
    rng = random.Random(0)
    for _ in range(400):
        a, b = rng.sample(english, 2)
        assert jaccard(texts[a], texts[b]) < 0.6, (a, b)


def test_english_prose_length(crawl):
    out, summary, labels = crawl
    payloads = _html_payloads(out, summary["warc_files"], labels)
    web_prose = [u for u, v in labels.items() if v["kind"] == "good" and v["lang"] == "en" and v["bucket"] == "web"]
    words = [len(extract_main_text(payloads[u].decode("utf-8")).split()) for u in web_prose]
    assert min(words) >= 200 and max(words) <= 600


def test_size_limits():
    with pytest.raises(ValueError):
        generate_sample_crawl("/nonexistent-never-written", num_pages=MIN_PAGES - 1)


def test_small_crawl_keeps_every_kind(tmp_path):
    summary = generate_sample_crawl(str(tmp_path), seed=3, num_pages=MIN_PAGES, num_files=3)
    assert summary["num_pages"] == MIN_PAGES
    assert set(summary["kinds"]) == set(KINDS)
    assert len(summary["langs"]) >= 4
    assert len(summary["warc_files"]) == 3
