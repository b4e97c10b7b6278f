import importlib.util
import re
from pathlib import Path

import pandas as pd
import pytest
from pydantic import ValidationError

from engine import signals as S
from engine.filters import (
    FilterConfig,
    apply_filters,
    check_keep_rate,
    rule_counts,
    rule_counts_parquet,
    rules,
    signal_report,
    signal_report_markdown,
)
from engine.langid import ensure_lid_model

REPO = Path(__file__).resolve().parents[1]
MODEL_CACHE = REPO / ".kiln" / "models"


# ---------------------------------------------------------------------------------------------
# Config


def test_defaults_are_the_published_values():
    cfg = FilterConfig()
    assert (cfg.min_words, cfg.max_words) == (50, 100_000)
    assert (cfg.min_mean_word_length, cfg.max_mean_word_length) == (3, 10)
    assert (cfg.max_symbol_word_ratio, cfg.max_bullet_lines_frac, cfg.max_ellipsis_lines_frac) == (0.1, 0.9, 0.3)
    assert (cfg.min_alpha_words_frac, cfg.min_stop_words) == (0.8, 2)
    assert (cfg.max_dup_line_frac, cfg.max_dup_para_frac, cfg.max_dup_line_char_frac, cfg.max_dup_para_char_frac) == (0.3, 0.3, 0.2, 0.2)
    assert [getattr(cfg, f"max_top_{n}gram_char_frac") for n in (2, 3, 4)] == [0.20, 0.18, 0.16]
    assert [getattr(cfg, f"max_dup_{n}gram_char_frac") for n in range(5, 11)] == [0.15, 0.14, 0.13, 0.12, 0.11, 0.10]
    assert (cfg.min_line_punct_ratio, cfg.max_short_line_ratio, cfg.max_char_dup_ratio, cfg.max_list_ratio) == (0.12, 0.67, 0.01, 0.3)
    assert cfg.c4_min_sentences == 5 and cfg.min_classifier_score is None
    assert "en" in cfg.languages and cfg.stop_word_languages == ["en"]
    for name, field in FilterConfig.model_fields.items():
        assert field.description, f"{name} has no description"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_dup_line_frac": 1.5}, "max_dup_line_frac"),
        ({"min_words": -1}, "min_words"),
        ({"min_language_score": -0.1}, "min_language_score"),
        ({"max_top_3gram_char_frac": 2}, "max_top_3gram_char_frac"),
        ({"min_keep_rate": 1.5}, "min_keep_rate"),
        ({"languages": []}, "languages"),
        ({"max_dup_lines": 0.1}, "max_dup_lines"),  # misspelt field
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as excinfo:
        FilterConfig(**kwargs)
    assert field in str(excinfo.value)
    assert any(field in error["loc"] for error in excinfo.value.errors())


def test_crossed_ranges_name_both_fields():
    with pytest.raises(ValidationError, match="min_words.*max_words"):
        FilterConfig(min_words=500, max_words=100)
    with pytest.raises(ValidationError, match="min_keep_rate.*max_keep_rate"):
        FilterConfig(min_keep_rate=0.9, max_keep_rate=0.5)


def test_assignment_is_validated():
    cfg = FilterConfig()
    with pytest.raises(ValidationError, match="max_char_dup_ratio"):
        cfg.max_char_dup_ratio = 3.0


def test_fingerprint_follows_settings():
    assert FilterConfig().fingerprint() == FilterConfig().fingerprint()
    assert FilterConfig(min_words=60).fingerprint() != FilterConfig().fingerprint()


def test_none_switches_a_rule_off():
    names = {rule.name for rule in rules(FilterConfig(min_words=None, max_badword_ratio=None))}
    assert "min_words" not in names and "badword_ratio" not in names and "max_words" in names
    assert "classifier_score" in {rule.name for rule in rules(FilterConfig(min_classifier_score=0.5))}


# ---------------------------------------------------------------------------------------------
# First rule fired, applicability, redaction


def _good_signals(doc_id: str, **overrides) -> dict:
    """Signals that pass every default rule."""
    row = {name: 0 for name, _ in S.SIGNAL_COLUMNS}
    row.update(
        doc_id=doc_id,
        language="en",
        language_score=0.95,
        char_count=3000,
        line_count=10,
        word_count=500,
        mean_word_length=4.8,
        alpha_words_frac=0.95,
        stop_word_count=40,
        c4_terminal_punct_frac=0.8,
        c4_sentence_count=20,
        line_punct_ratio=0.7,
        short_line_ratio=0.1,
        list_ratio=0.02,
        url_blocklisted=False,
        classifier_score=None,
    )
    row.update(overrides)
    return row


def _signals_df(spark, rows):
    frame = pd.DataFrame(rows)
    return spark.createDataFrame(frame[["doc_id", *S.SIGNAL_NAMES]], schema=S.signals_ddl(with_minhash=False))


def _documents_df(spark, doc_ids, texts=None):
    texts = texts or {}
    return spark.createDataFrame(
        pd.DataFrame(
            {
                "doc_id": doc_ids,
                "url": [f"http://{d}.example/" for d in doc_ids],
                "bucket": ["web"] * len(doc_ids),
                "text": [texts.get(d, f"text of {d}") for d in doc_ids],
            }
        )
    )


PII_TEXT = "Write to jane.doe@example.com or call 206-543-9196 from 10.0.0.1, card 4111 1111 1111 1111."


@pytest.fixture(scope="module")
def hand_made(spark):
    pii = S.pii_counts(PII_TEXT)
    rows = [
        _good_signals("ok", **{f"pii_{k}": v for k, v in pii.items()}),
        _good_signals("short", word_count=10),
        _good_signals("two_rules", word_count=10, dup_line_frac=0.5),  # repetition is checked first
        _good_signals("en_no_stop", stop_word_count=0),
        _good_signals("de_no_stop", language="de", stop_word_count=0),  # stop words: English only
        _good_signals("zh_chars", language="zh", mean_word_length=1.0, c4_sentence_count=0),
        _good_signals("dutch", language="nl", language_score=0.99),
        _good_signals("unsure", language_score=0.3),
        _good_signals("blocked", url_blocklisted=True, word_count=10, language="nl"),  # URL rule comes first
        _good_signals("punct_edge", line_punct_ratio=0.12),  # FineWeb rejects <= 0.12
        _good_signals("curly", c4_curly_bracket_lines=1),
        _good_signals("curly_ja", language="ja", c4_curly_bracket_lines=1),
        _good_signals("badwords", badword_ratio=0.05),
        _good_signals("nan_score", alpha_words_frac=float("nan")),  # missing value: rule skipped
    ]
    doc_ids = [r["doc_id"] for r in rows] + ["no_signals"]
    return _signals_df(spark, rows), _documents_df(spark, doc_ids, {"ok": PII_TEXT})


@pytest.fixture(scope="module")
def default_outcome(hand_made):
    signals_df, documents_df = hand_made
    kept_df, rejected_df = apply_filters(signals_df, documents_df, FilterConfig())
    kept = {r["doc_id"]: r for r in kept_df.collect()}
    rejected = {r["doc_id"]: r for r in rejected_df.collect()}
    return kept_df.columns, kept, rejected, rule_counts(rejected_df), rejected_df


def test_first_rule_value_and_threshold(hand_made, default_outcome):
    _, kept, rejected, counts, _ = default_outcome
    assert set(kept) == {"ok", "de_no_stop", "zh_chars", "curly_ja", "nan_score"}
    expected = {
        "short": ("min_words", 10, 50),
        "two_rules": ("dup_line_frac", 0.5, 0.3),
        "en_no_stop": ("stop_word_count", 0, 2),
        "unsure": ("language_score", 0.3, 0.65),
        "blocked": ("url_blocklisted", 1, 1),
        "punct_edge": ("line_punct_ratio", 0.12, 0.12),
        "curly": ("c4_curly_bracket", 1, 1),
        "badwords": ("badword_ratio", 0.05, 0.01),
    }
    for doc_id, (rule, value, threshold) in expected.items():
        row = rejected[doc_id]
        assert (row["rule"], row["value"], row["threshold"]) == (rule, pytest.approx(value), pytest.approx(threshold)), doc_id
        assert row["url"] == f"http://{doc_id}.example/" and row["bucket"] == "web"
    assert rejected["dutch"]["rule"] == "language_not_allowed" and rejected["dutch"]["threshold"] is None
    assert rejected["no_signals"]["rule"] == "missing_signals"
    assert len(kept) + len(rejected) == hand_made[1].count()
    assert counts["min_words"] == 1 and sum(counts.values()) == len(rejected)


def test_kept_text_is_redacted_and_carries_signals(hand_made, default_outcome):
    columns, kept, _, _, _ = default_outcome
    assert columns == [*hand_made[1].columns, "language", "language_score", "classifier_score"]
    assert kept["ok"]["text"] == "Write to <EMAIL> or call <PHONE> from <IP>, card <CARD>."
    assert kept["de_no_stop"]["text"] == "text of de_no_stop"


def test_rule_counts_of_written_rejections(default_outcome, tmp_path):
    from engine.spark import write_parquet_sorted

    _, _, _, counts, rejected_df = default_outcome
    write_parquet_sorted(rejected_df, str(tmp_path / "rejected"), "doc_id", num_files=2)
    assert rule_counts_parquet(str(tmp_path / "rejected")) == counts
    write_parquet_sorted(rejected_df.limit(0), str(tmp_path / "none"), "doc_id")
    assert rule_counts_parquet(str(tmp_path / "none")) == {}


def test_rules_can_be_relaxed_and_languages_changed(hand_made):
    signals_df, documents_df = hand_made
    cfg = FilterConfig(min_words=None, languages=["en", "de", "nl"], stop_word_languages=["en", "de"])
    kept_df, rejected_df = apply_filters(signals_df, documents_df, cfg)
    kept = {r["doc_id"] for r in kept_df.select("doc_id").collect()}
    rejected = {r["doc_id"]: r["rule"] for r in rejected_df.collect()}
    assert {"short", "dutch"} <= kept
    assert rejected["de_no_stop"] == "stop_word_count"
    assert rejected["zh_chars"] == "language_not_allowed"


def test_classifier_threshold(spark):
    rows = [
        _good_signals("good", classifier_score=0.8),
        _good_signals("bad", classifier_score=0.2),
        _good_signals("unscored", classifier_score=None),
    ]
    documents_df = _documents_df(spark, ["good", "bad", "unscored"])
    kept_df, rejected_df = apply_filters(_signals_df(spark, rows), documents_df, FilterConfig(min_classifier_score=0.5))
    assert [r["doc_id"] for r in kept_df.collect()] == ["good"]
    assert {r["doc_id"]: r["rule"] for r in rejected_df.collect()} == {"bad": "classifier_score", "unscored": "classifier_score"}
    kept_df, _ = apply_filters(_signals_df(spark, rows), documents_df, FilterConfig())
    assert kept_df.count() == 3  # no threshold: the score is only carried along


def test_keep_rate_check():
    cfg = FilterConfig(min_keep_rate=0.1, max_keep_rate=0.9)
    assert check_keep_rate(50, 100, cfg)["passed"]
    assert not check_keep_rate(5, 100, cfg)["passed"]
    assert not check_keep_rate(95, 100, cfg)["passed"]
    assert not check_keep_rate(0, 0, cfg)["passed"]


def test_signal_report_markdown(hand_made, default_outcome):
    signals_df = hand_made[0]
    report = signal_report_markdown(signals_df, FilterConfig(), default_outcome[4], bins=8)
    assert report.startswith(f"Documents: {signals_df.count()}")
    row = next(line for line in report.splitlines() if line.startswith("| min_words |"))
    assert "< 50" in row and "3 (" in row  # short, two_rules, blocked have 10 words
    assert "| dup_line_frac | 1 |" in report  # first-rule table


def test_signal_report_marks_where_thresholds_cut(hand_made):
    signals_df = hand_made[0]
    report = signal_report(signals_df, FilterConfig(), bins=8)
    by_rule = {r["rule"]: r for r in report["rules"]}
    words = report["signals"]["word_count"]
    assert (words["min"], words["max"]) == (10, 500) and sum(words["counts"]) == report["documents"]
    assert words["counts"][0] == 3 and words["counts"][-1] == report["documents"] - 3
    # 50 words sits 40/490 of the way from 10 to 500: boundary round(0.65) = 1 of 8
    assert by_rule["min_words"]["cut_bin"] == 1 and by_rule["min_words"]["beyond"] == 3
    # Scopes apply: only the English page lacks stop words; the Chinese page's short "words" are exempt.
    assert by_rule["stop_word_count"]["beyond"] == 1
    assert by_rule["min_mean_word_length"]["beyond"] == 0
    # A threshold beyond the observed range cuts at the edge.
    assert by_rule["max_words"]["cut_bin"] == 8 and by_rule["max_words"]["beyond"] == 0
    markdown = signal_report_markdown(signals_df, FilterConfig(), report=report)
    row = next(line for line in markdown.splitlines() if line.startswith("| min_words |"))
    assert row.endswith("| 10 `▃┃      █` 500 |"), row  # 3 short pages, then 11 long ones


# ---------------------------------------------------------------------------------------------
# Real pages: Chinese gambling/porn spam out, English prose in


def _warc_documents(path: Path) -> list[dict]:
    if importlib.util.find_spec("engine.documents") is not None:
        from engine.documents import extract_warc

        return [row for row in extract_warc(str(path), "test") if "text" in row]
    from fastwarc.warc import ArchiveIterator, WarcRecordType
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    rows = []
    with open(path, "rb") as handle:
        for record in ArchiveIterator(handle, record_types=WarcRecordType.response, parse_http=True):
            body = record.reader.read()
            text = extract_plain_text(bytes_to_str(body, detect_encoding(body)), main_content=True)
            text = "\n".join(line.strip() for line in text.splitlines() if line.strip())
            rows.append({"doc_id": record.record_id, "url": record.headers.get("WARC-Target-URI"), "bucket": "web", "text": text})
    return rows


@pytest.fixture(scope="module")
def warc_outcome(spark, shared_data):
    try:
        lid = ensure_lid_model(str(MODEL_CACHE))
    except RuntimeError as exc:
        pytest.skip(f"lid.176.ftz unavailable: {exc}")
    spam = _warc_documents(shared_data / "warc" / "resiliparse" / "tests_data_warcfile.warc.gz")
    prose = [row for path in sorted((shared_data / "warc" / "dolma").glob("*.warc.gz")) for row in _warc_documents(path)]
    rows = {row["doc_id"]: row for row in spam + prose}  # dolma has one page twice
    documents_df = spark.createDataFrame(pd.DataFrame(list(rows.values()))[["doc_id", "url", "bucket", "text"]])
    wordlist = shared_data / "quality" / "wordlists" / "baselines_mappers_banlists_ldnoobw.txt"
    signals_df = S.compute_signals(
        spark,
        documents_df,
        lid_model_path=lid,
        classifier_model_path=None,
        badword_paths=[str(wordlist)],
        url_blocklist=[],
        with_minhash=False,
    ).cache()
    kept_df, rejected_df = apply_filters(signals_df, documents_df, FilterConfig())
    languages = {r["doc_id"]: r["language"] for r in signals_df.select("doc_id", "language").collect()}
    kept = {r["doc_id"] for r in kept_df.select("doc_id").collect()}
    return spam, prose, languages, kept


def test_chinese_spam_removed(warc_outcome):
    spam, _, languages, kept = warc_outcome
    chinese = [row for row in spam if languages[row["doc_id"]] == "zh"]
    assert len(chinese) >= 8  # gambling, lottery and porn pages of the CC excerpt
    survivors = [row["url"] for row in chinese if row["doc_id"] in kept]
    assert not survivors


def test_english_prose_kept(warc_outcome):
    _, prose, _, kept = warc_outcome
    kept_urls = [row["url"] for row in prose if row["doc_id"] in kept]
    assert len(kept_urls) / len(prose) >= 0.5
    # Long-form articles and blog posts, one per site.
    for article in ("notes-on-mastodon", "topic-modeling-for-the-people", "creativecommons.org/mission", "commoncrawl.org/faq"):
        assert any(article in url for url in kept_urls), article
    # Home pages made mostly of repeated navigation are what goes.
    assert len(kept_urls) < len(prose)
    assert all(re.search(r"https?://", url) for url in kept_urls)
