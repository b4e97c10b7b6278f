"""Keep/drop decisions on quality_signals, with the first rule that fired per document.

The rules are plain Spark column expressions over the signals (no model, no text parsing);
only the kept documents' text is touched again, to redact PII. Defaults are the published
values: Gopher (Rae et al. 2021, Table A1), C4 (Raffel et al. 2020) and FineWeb (Penedo et al.
2024), as datatrove implements them.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Iterator

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from engine.signals import redact_pii

# Written without spaces between words: word-length and C4 line rules do not apply to them.
DEFAULT_UNSEGMENTED_LANGUAGES = ["zh", "ja", "th", "lo", "km", "my", "bo", "wuu", "yue"]

_FRACTION = dict(ge=0.0, le=1.0)  # constraints of every share-of-something field


class FilterConfig(BaseModel):
    """Thresholds of the quality filters. A threshold of None switches its rule off."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # Language
    languages: list[str] = Field(
        default_factory=lambda: ["en", "de", "fr", "es", "zh", "ru", "ja"],
        min_length=1,
        description="lid.176 codes of the languages kept; every other language is rejected.",
    )
    min_language_score: float | None = Field(
        0.65, **_FRACTION, description="Minimum lid.176 probability of the detected language (FineWeb: 0.65)."
    )
    unsegmented_languages: list[str] = Field(
        default_factory=lambda: list(DEFAULT_UNSEGMENTED_LANGUAGES),
        description="Languages written without spaces (each CJK character is a token): mean word "
        "length and C4's sentence rule are skipped for them.",
    )
    stop_word_languages: list[str] = Field(
        default_factory=lambda: ["en"], description="Languages the (English) Gopher stop-word rule applies to."
    )
    drop_url_blocklisted: bool = Field(True, description="Reject documents whose URL is on the blocklist.")

    # Gopher quality
    min_words: int | None = Field(50, ge=0, description="Gopher: minimum number of words.")
    max_words: int | None = Field(100_000, ge=1, description="Gopher: maximum number of words.")
    min_mean_word_length: float | None = Field(3.0, ge=0, le=100, description="Gopher: minimum mean word length (characters).")
    max_mean_word_length: float | None = Field(10.0, ge=0, le=100, description="Gopher: maximum mean word length (characters).")
    max_symbol_word_ratio: float | None = Field(
        0.1, ge=0, le=10, description="Gopher: maximum '#' or ellipsis count per word."
    )
    max_bullet_lines_frac: float | None = Field(0.9, **_FRACTION, description="Gopher: maximum share of lines starting with a bullet.")
    max_ellipsis_lines_frac: float | None = Field(0.3, **_FRACTION, description="Gopher: maximum share of lines ending with an ellipsis.")
    min_alpha_words_frac: float | None = Field(
        0.8, **_FRACTION, description="Gopher: minimum share of words containing an alphabetic character."
    )
    min_stop_words: int | None = Field(2, ge=0, description="Gopher: minimum count of English stop words (stop_word_languages only).")

    # Gopher repetition
    max_dup_line_frac: float | None = Field(0.3, **_FRACTION, description="Gopher: maximum share of duplicated lines.")
    max_dup_para_frac: float | None = Field(0.3, **_FRACTION, description="Gopher: maximum share of duplicated paragraphs.")
    max_dup_line_char_frac: float | None = Field(0.2, **_FRACTION, description="Gopher: maximum share of characters in duplicated lines.")
    max_dup_para_char_frac: float | None = Field(0.2, **_FRACTION, description="Gopher: maximum share of characters in duplicated paragraphs.")
    max_top_2gram_char_frac: float | None = Field(0.20, **_FRACTION, description="Gopher: maximum character share of the most frequent word 2-gram.")
    max_top_3gram_char_frac: float | None = Field(0.18, **_FRACTION, description="Gopher: maximum character share of the most frequent word 3-gram.")
    max_top_4gram_char_frac: float | None = Field(0.16, **_FRACTION, description="Gopher: maximum character share of the most frequent word 4-gram.")
    max_dup_5gram_char_frac: float | None = Field(0.15, **_FRACTION, description="Gopher: maximum character share of duplicated word 5-grams.")
    max_dup_6gram_char_frac: float | None = Field(0.14, **_FRACTION, description="Gopher: maximum character share of duplicated word 6-grams.")
    max_dup_7gram_char_frac: float | None = Field(0.13, **_FRACTION, description="Gopher: maximum character share of duplicated word 7-grams.")
    max_dup_8gram_char_frac: float | None = Field(0.12, **_FRACTION, description="Gopher: maximum character share of duplicated word 8-grams.")
    max_dup_9gram_char_frac: float | None = Field(0.11, **_FRACTION, description="Gopher: maximum character share of duplicated word 9-grams.")
    max_dup_10gram_char_frac: float | None = Field(0.10, **_FRACTION, description="Gopher: maximum character share of duplicated word 10-grams.")

    # C4
    c4_min_sentences: int | None = Field(
        5, ge=0, description="C4: minimum sentences in lines that end in terminal punctuation and have >= 3 words."
    )
    c4_drop_lorem_ipsum: bool = Field(True, description="C4: reject pages with 'lorem ipsum' in a kept line.")
    c4_drop_curly_bracket: bool = Field(True, description="C4: reject pages with '{' in a kept line.")

    # FineWeb
    min_line_punct_ratio: float | None = Field(
        0.12, **_FRACTION, description="FineWeb: rejected when the share of lines ending in terminal punctuation is <= this."
    )
    max_short_line_ratio: float | None = Field(
        0.67, **_FRACTION, description="FineWeb: rejected when the share of lines of <= 30 characters is >= this."
    )
    max_char_dup_ratio: float | None = Field(
        0.01, **_FRACTION, description="FineWeb: rejected when the share of characters in duplicated lines is >= this."
    )
    max_list_ratio: float | None = Field(
        0.3, ge=0, le=10, description="FineWeb: rejected when newlines per word is > this."
    )
    max_list_lines_frac: float | None = Field(
        None, **_FRACTION, description="Reject when more than this share of lines start with a bullet or a number (off by default)."
    )

    # Content
    max_badword_ratio: float | None = Field(
        0.01,
        **_FRACTION,
        description="Maximum share of words on the bad-word lists. C4 drops pages with any listed word, which "
        "removes disproportionately much text by and about minorities (Dodge et al. 2021); a ratio keeps "
        "pages that merely mention one.",
    )
    min_classifier_score: float | None = Field(
        None, **_FRACTION, description="Minimum quality-classifier probability; None = classifier not used."
    )

    # Check on the outcome
    min_keep_rate: float = Field(0.05, **_FRACTION, description="A run keeping less than this share of documents fails its check.")
    max_keep_rate: float = Field(0.99, **_FRACTION, description="A run keeping more than this share of documents fails its check.")

    @model_validator(mode="after")
    def _ranges_ordered(self) -> "FilterConfig":
        pairs = [
            ("min_words", "max_words"),
            ("min_mean_word_length", "max_mean_word_length"),
            ("min_keep_rate", "max_keep_rate"),
        ]
        for low, high in pairs:
            a, b = getattr(self, low), getattr(self, high)
            if a is not None and b is not None and a > b:
                raise ValueError(f"{low} ({a}) must not exceed {high} ({b})")
        return self

    def fingerprint(self) -> str:
        """Stable short hash of the settings (e.g. for a Dagster code_version)."""
        payload = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Rules


@dataclass(frozen=True)
class Rule:
    name: str
    signal: str
    op: str  # how the value compares with the threshold when the rule FIRES ("not_in": language list)
    threshold: float
    scope: str = "all"  # "all" | "segmented" (not unsegmented_languages) | "stop_words"


_OPS = {
    "lt": lambda c, t: c < t,
    "le": lambda c, t: c <= t,
    "gt": lambda c, t: c > t,
    "ge": lambda c, t: c >= t,
}


def rules(cfg: FilterConfig) -> list[Rule]:
    """The active rules in evaluation order (FineWeb's pipeline order: URL, language, Gopher
    repetition, Gopher quality, C4, FineWeb; then content and classifier)."""
    out: list[Rule] = []

    def add(name, signal, op, threshold, scope="all"):
        if threshold is not None:
            out.append(Rule(name, signal, op, float(threshold), scope))

    add("url_blocklisted", "url_blocklisted", "ge", 1.0 if cfg.drop_url_blocklisted else None)
    # Not a threshold rule: fires when `language` is not in cfg.languages (value: its score).
    out.append(Rule("language_not_allowed", "language_score", "not_in", math.nan))
    add("language_score", "language_score", "lt", cfg.min_language_score)

    add("dup_para_frac", "dup_para_frac", "gt", cfg.max_dup_para_frac)
    add("dup_para_char_frac", "dup_para_char_frac", "gt", cfg.max_dup_para_char_frac)
    add("dup_line_frac", "dup_line_frac", "gt", cfg.max_dup_line_frac)
    add("dup_line_char_frac", "dup_line_char_frac", "gt", cfg.max_dup_line_char_frac)
    for n in (2, 3, 4):
        add(f"top_{n}gram_char_frac", f"top_{n}gram_char_frac", "gt", getattr(cfg, f"max_top_{n}gram_char_frac"))
    for n in range(5, 11):
        add(f"dup_{n}gram_char_frac", f"dup_{n}gram_char_frac", "gt", getattr(cfg, f"max_dup_{n}gram_char_frac"))

    add("min_words", "word_count", "lt", cfg.min_words)
    add("max_words", "word_count", "gt", cfg.max_words)
    add("min_mean_word_length", "mean_word_length", "lt", cfg.min_mean_word_length, "segmented")
    add("max_mean_word_length", "mean_word_length", "gt", cfg.max_mean_word_length, "segmented")
    add("symbol_word_ratio", "symbol_word_ratio", "gt", cfg.max_symbol_word_ratio)
    add("bullet_lines_frac", "bullet_lines_frac", "gt", cfg.max_bullet_lines_frac)
    add("ellipsis_lines_frac", "ellipsis_lines_frac", "gt", cfg.max_ellipsis_lines_frac)
    add("alpha_words_frac", "alpha_words_frac", "lt", cfg.min_alpha_words_frac)
    add("stop_word_count", "stop_word_count", "lt", cfg.min_stop_words, "stop_words")

    add("c4_lorem_ipsum", "c4_lorem_ipsum_lines", "ge", 1 if cfg.c4_drop_lorem_ipsum else None, "segmented")
    add("c4_curly_bracket", "c4_curly_bracket_lines", "ge", 1 if cfg.c4_drop_curly_bracket else None, "segmented")
    add("c4_min_sentences", "c4_sentence_count", "lt", cfg.c4_min_sentences, "segmented")

    add("line_punct_ratio", "line_punct_ratio", "le", cfg.min_line_punct_ratio)
    add("short_line_ratio", "short_line_ratio", "ge", cfg.max_short_line_ratio)
    add("char_dup_ratio", "char_dup_ratio", "ge", cfg.max_char_dup_ratio)
    add("list_ratio", "list_ratio", "gt", cfg.max_list_ratio)
    add("list_lines_frac", "list_lines_frac", "gt", cfg.max_list_lines_frac)

    add("badword_ratio", "badword_ratio", "gt", cfg.max_badword_ratio)
    add("classifier_score", "classifier_score", "lt", cfg.min_classifier_score)
    return out


def _value(signal: str) -> Column:
    column = F.col(signal).cast("double")
    return F.when(F.isnan(column), F.lit(None).cast("double")).otherwise(column)  # NaN = missing


def _scopes(cfg: FilterConfig) -> dict[str, Column]:
    """Which documents each rule scope applies to (by detected language)."""
    language = F.col("language")
    segmented = ~language.isin(cfg.unsegmented_languages) if cfg.unsegmented_languages else F.lit(True)
    return {"all": F.lit(True), "segmented": segmented, "stop_words": language.isin(cfg.stop_word_languages)}


def _rejection(cfg: FilterConfig, available: set[str]) -> Column:
    """Struct(rule, value, threshold) of the first rule that fires, null when none does."""
    language = F.col("language")
    scopes = _scopes(cfg)

    def reject(name: str, value: Column, threshold: float | None) -> Column:
        return F.struct(
            F.lit(name).alias("rule"),
            value.alias("value"),
            F.lit(threshold).cast("double").alias("threshold"),
        )

    branches = [F.when(F.col("_has_signals").isNull(), reject("missing_signals", F.lit(None).cast("double"), None))]
    for rule in rules(cfg):
        if rule.name == "language_not_allowed":
            branches.append(F.when(~language.isin(cfg.languages), reject(rule.name, _value(rule.signal), None)))
            continue
        if rule.signal not in available:
            raise ValueError(f"signals have no column {rule.signal!r} needed by rule {rule.name!r}")
        value = _value(rule.signal)
        fires = _OPS[rule.op](value, F.lit(rule.threshold))
        if rule.name == "classifier_score":
            fires = fires | value.isNull()  # an unscored document cannot pass a classifier threshold
        branches.append(F.when(scopes[rule.scope] & F.coalesce(fires, F.lit(False)), reject(rule.name, value, rule.threshold)))
    return F.coalesce(*branches)


# Signals carried into filtered/kept: what dedup and mixing need downstream.
KEPT_SIGNALS = ("language", "language_score", "classifier_score", "minhash")


def apply_filters(signals_df: DataFrame, documents_df: DataFrame, cfg: FilterConfig) -> tuple[DataFrame, DataFrame]:
    """(kept_df, rejected_df).

    kept_df: documents columns, text with PII replaced by <EMAIL>/<PHONE>/<IP>/<CARD>, plus
    language, language_score, classifier_score and minhash (when present in the signals).
    rejected_df: doc_id, url, bucket, rule, value, threshold (first rule that fired; documents
    without signals are rejected as "missing_signals").
    """
    available = set(signals_df.columns)
    signals = signals_df.withColumn("_has_signals", F.lit(True))
    joined = documents_df.join(signals, on="doc_id", how="left").withColumn("_rejection", _rejection(cfg, available))

    bucket = F.col("bucket") if "bucket" in documents_df.columns else F.lit(None).cast("string")
    url = F.col("url") if "url" in documents_df.columns else F.lit(None).cast("string")
    rejected_df = joined.where(F.col("_rejection").isNotNull()).select(
        "doc_id",
        url.alias("url"),
        bucket.alias("bucket"),
        F.col("_rejection.rule").alias("rule"),
        F.col("_rejection.value").alias("value"),
        F.col("_rejection.threshold").alias("threshold"),
    )

    carried = [name for name in KEPT_SIGNALS if name in available and name not in documents_df.columns]
    pii_columns = [c for c in ("pii_email", "pii_phone", "pii_ip", "pii_card") if c in available]
    pii_total = sum((F.coalesce(F.col(c), F.lit(0)) for c in pii_columns), F.lit(0)) if pii_columns else F.lit(1)
    kept = joined.where(F.col("_rejection").isNull()).select(
        *documents_df.columns, *carried, pii_total.cast("long").alias("_pii")
    )
    output_schema = kept.drop("_pii").schema

    def redact(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for batch in batches:
            # Only documents the signals found PII in are rewritten.
            has_pii = batch["_pii"].to_numpy() > 0
            if has_pii.any():
                batch.loc[has_pii, "text"] = [redact_pii(t)[0] if isinstance(t, str) else t for t in batch.loc[has_pii, "text"]]
            yield batch.drop(columns="_pii")

    kept_df = kept.mapInPandas(redact, output_schema)
    return kept_df, rejected_df


def rule_counts(rejected_df: DataFrame) -> dict[str, int]:
    """Rejections per rule, most frequent first."""
    rows = rejected_df.groupBy("rule").count().collect()
    return dict(sorted(((r["rule"], int(r["count"])) for r in rows), key=lambda kv: (-kv[1], kv[0])))


def check_keep_rate(n_kept: int, n_total: int, cfg: FilterConfig) -> dict:
    """Is the share of kept documents inside [min_keep_rate, max_keep_rate]?"""
    keep_rate = n_kept / n_total if n_total else 0.0
    return {
        "passed": bool(n_total) and cfg.min_keep_rate <= keep_rate <= cfg.max_keep_rate,
        "keep_rate": keep_rate,
        "n_kept": n_kept,
        "n_total": n_total,
        "min_keep_rate": cfg.min_keep_rate,
        "max_keep_rate": cfg.max_keep_rate,
    }


# --------------------------------------------------------------------------------------------
# Reports for asset metadata

_BARS = " ▁▂▃▄▅▆▇█"
_CUT = "┃"  # where a threshold falls inside a histogram
_SYMBOLS = {"lt": "<", "le": "≤", "gt": ">", "ge": "≥"}


def _sparkline(counts: list[int]) -> str:
    top = max(counts) if counts else 0
    if not top:
        return ""
    return "".join(_BARS[math.ceil(c / top * (len(_BARS) - 1))] for c in counts)


def _cut_position(threshold: float, low: float, high: float, bins: int) -> int:
    """Bin boundary (0..bins) nearest the threshold, on the histogram's linear axis."""
    if high <= low:
        return 0 if threshold <= low else bins
    return min(max(round((threshold - low) / (high - low) * bins), 0), bins)


def signal_report(signals_df: DataFrame, cfg: FilterConfig, bins: int = 20) -> dict:
    """Distribution of every signal a threshold rule reads, and where each threshold cuts it.

    Returns {"documents": n, "signals": {signal: {min, max, p5, p50, p95, counts}},
    "rules": [{rule, signal, op, threshold, scope, beyond, cut_bin}]}: `counts` is an
    equal-width histogram from min to max, `beyond` the documents the rule alone would remove
    (its scope applied; earlier rules ignored), `cut_bin` the bin boundary the threshold falls on.
    Two Spark passes whatever the number of signals: bounds, quantiles and threshold counts,
    then one grouped count of (signal, bin) pairs. Reads only the signal columns it needs.
    """
    active = [r for r in rules(cfg) if r.op in _OPS and r.signal in signals_df.columns and r.signal != "url_blocklisted"]
    signals = sorted({r.signal for r in active})
    report: dict = {"documents": 0, "signals": {}, "rules": []}
    if not signals:
        report["documents"] = signals_df.count()
        return report
    scopes = _scopes(cfg) if "language" in signals_df.columns else {}
    values = {s: _value(s) for s in signals}

    def fires(rule: Rule) -> Column:
        hit = _OPS[rule.op](values[rule.signal], F.lit(rule.threshold))
        return scopes.get(rule.scope, F.lit(True)) & F.coalesce(hit, F.lit(False))

    stats = signals_df.agg(
        F.count(F.lit(1)).alias("_n"),
        *[F.min(values[s]).alias(f"{s}__min") for s in signals],
        *[F.max(values[s]).alias(f"{s}__max") for s in signals],
        *[F.percentile_approx(values[s], [0.05, 0.5, 0.95], 1000).alias(f"{s}__q") for s in signals],
        *[F.sum(F.when(fires(rule), 1).otherwise(0)).alias(f"_fires{i}") for i, rule in enumerate(active)],
    ).collect()[0]
    report["documents"] = int(stats["_n"])

    bin_structs = []
    for s in signals:
        low, high = stats[f"{s}__min"], stats[f"{s}__max"]
        if low is None:  # no document has a value
            continue
        width = (high - low) / bins if high > low else 1.0
        index = F.least(F.floor((values[s] - F.lit(low)) / F.lit(width)), F.lit(bins - 1)).cast("int")
        bin_structs.append(F.struct(F.lit(s).alias("signal"), index.alias("bin")))
    histograms: dict[str, list[int]] = {s: [0] * bins for s in signals}
    if bin_structs:
        pairs = signals_df.select(F.explode(F.array(*bin_structs)).alias("b")).where(F.col("b.bin").isNotNull())
        for row in pairs.groupBy("b.signal", "b.bin").count().collect():
            histograms[row["signal"]][row["bin"]] = int(row["count"])

    for s in signals:
        q = stats[f"{s}__q"] or [None, None, None]
        report["signals"][s] = {
            "min": stats[f"{s}__min"],
            "max": stats[f"{s}__max"],
            "p5": q[0],
            "p50": q[1],
            "p95": q[2],
            "counts": histograms[s],
        }
    for i, rule in enumerate(active):
        low, high = stats[f"{rule.signal}__min"], stats[f"{rule.signal}__max"]
        report["rules"].append({
            "rule": rule.name,
            "signal": rule.signal,
            "op": rule.op,
            "threshold": rule.threshold,
            "scope": rule.scope,
            "beyond": int(stats[f"_fires{i}"] or 0),
            "cut_bin": None if low is None else _cut_position(rule.threshold, low, high, bins),
        })
    return report


def signal_report_markdown(
    signals_df: DataFrame,
    cfg: FilterConfig,
    rejected_df: DataFrame | None = None,
    bins: int = 20,
    report: dict | None = None,
) -> str:
    """Markdown of `signal_report`: one row per threshold rule with the signal's quantiles, the
    documents beyond the threshold, and a histogram (min → max) with ┃ where the threshold cuts
    it; plus rejections per first rule fired when `rejected_df` is given."""
    report = report if report is not None else signal_report(signals_df, cfg, bins)
    total = report["documents"]
    lines: list[str] = []

    def fmt(v) -> str:
        return "-" if v is None else f"{v:.3g}"

    if report["rules"]:
        lines += [
            f"Documents: {total}",
            "",
            "| rule | signal | fires when | p5 | p50 | p95 | beyond threshold | histogram (min → max, ┃ = threshold) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for rule in report["rules"]:
            sig = report["signals"][rule["signal"]]
            histogram = ""
            if sig["min"] is not None:
                bars = _sparkline(sig["counts"])
                cut = rule["cut_bin"]
                histogram = f"{sig['min']:.3g} `{bars[:cut]}{_CUT}{bars[cut:]}` {sig['max']:.3g}"
            share = f"{rule['beyond'] / total:.1%}" if total else "-"
            scope = "" if rule["scope"] == "all" else f" ({rule['scope']} only)"
            lines.append(
                f"| {rule['rule']}{scope} | {rule['signal']} | {_SYMBOLS[rule['op']]} {rule['threshold']:g} "
                f"| {fmt(sig['p5'])} | {fmt(sig['p50'])} | {fmt(sig['p95'])} | {rule['beyond']} ({share}) | {histogram} |"
            )
    if rejected_df is not None:
        counts = rule_counts(rejected_df)
        lines += ["", "| first rule fired | documents |", "|---|---|"]
        lines += [f"| {rule} | {count} |" for rule, count in counts.items()]
    return "\n".join(lines)
