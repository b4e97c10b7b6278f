"""Keep/drop decisions on quality_signals, with the first rule that fired per document.

The rules are numpy comparisons over the stored signals, one Arrow batch at a time (no model,
no text parsing); only the kept documents' text is touched again, to remove C4's lines (from
the stored per-line facts `c4_lines`) and to redact PII. Defaults are the published values:
Gopher (Rae et al. 2021, Table A1), C4 (Raffel et al. 2020) and FineWeb (Penedo et al. 2024),
as datatrove implements them.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from engine import signals as S
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

    # C4 line removal (datatrove C4QualityFilter with FineWeb's settings), applied to the kept text.
    # The word-count, long-word and terminal-punctuation rules skip unsegmented_languages.
    c4_remove_long_word_lines: bool = Field(
        True, description=f"C4: remove lines with a word longer than {S.C4_MAX_WORD_LENGTH} characters (max_word_length)."
    )
    c4_remove_no_terminal_punct_lines: bool = Field(
        False,
        description="C4: remove lines that do not end in . ? ! \" ' (or end in '...'). C4 did; FineWeb did not "
        "(filter_no_terminal_punct=False): it also removes headings, list items and captions of good pages.",
    )
    c4_min_words_per_line: int | None = Field(
        S.C4_MIN_WORDS_PER_LINE, ge=1, le=S.C4_LINE_COUNT_MAX,
        description="C4: remove lines with fewer whitespace-separated words (blank lines too); None keeps them.",
    )
    c4_remove_javascript_lines: bool = Field(True, description="C4: remove lines mentioning 'javascript'.")
    c4_remove_policy_lines: bool = Field(
        True, description="C4: remove lines with 'terms of use', 'privacy policy' or cookie notices ('uses cookies', ...)."
    )
    c4_remove_citations: bool = Field(
        True, description="C4: remove Wikipedia-style citation markers ([1], [edit], [citation needed]) from lines."
    )
    # C4 page rules, on the lines left after line removal
    c4_min_sentences: int | None = Field(
        5, ge=0, description="C4: minimum number of sentences in the lines left after C4's line removal."
    )
    c4_drop_lorem_ipsum: bool = Field(
        True, description="C4: reject pages with 'lorem ipsum' in a line that passes the long-word, punctuation and word-count rules."
    )
    c4_drop_curly_bracket: bool = Field(
        True, description="C4: reject pages with '{' in a line that passes those rules and does not mention javascript."
    )

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
    field: str = ""  # the FilterConfig field that sets it (named in each rejection's detail)


MISSING_SIGNALS = "missing_signals"  # no quality_signals row: rejected before any rule of rules(cfg)
LANGUAGE_NOT_ALLOWED = "language_not_allowed"
# Rules without a numeric threshold: their rejections have null value and threshold, and say
# why in `detail` only.
NON_THRESHOLD_RULES = (MISSING_SIGNALS, LANGUAGE_NOT_ALLOWED)


# How a threshold rule's value compares with its threshold when the rule fires.
_OPS = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal}


def rules(cfg: FilterConfig) -> list[Rule]:
    """The active rules in evaluation order (FineWeb's pipeline order: URL, language, Gopher
    repetition, Gopher quality, C4, FineWeb; then content and classifier)."""
    out: list[Rule] = []

    def add(name, signal, op, field, scope="all", switch=False):
        """A rule whose threshold is the config `field` (None: off); a `switch` field turns on a
        rule that fires on a count of at least 1."""
        threshold = (1 if getattr(cfg, field) else None) if switch else getattr(cfg, field)
        if threshold is not None:
            out.append(Rule(name, signal, op, float(threshold), scope, field))

    add("url_blocklisted", "url_blocklisted", "ge", "drop_url_blocklisted", switch=True)
    # Not a threshold rule: fires when `language` is not in cfg.languages.
    out.append(Rule(LANGUAGE_NOT_ALLOWED, "language", "not_in", math.nan, "all", "languages"))
    add("language_score", "language_score", "lt", "min_language_score")

    add("dup_para_frac", "dup_para_frac", "gt", "max_dup_para_frac")
    add("dup_para_char_frac", "dup_para_char_frac", "gt", "max_dup_para_char_frac")
    add("dup_line_frac", "dup_line_frac", "gt", "max_dup_line_frac")
    add("dup_line_char_frac", "dup_line_char_frac", "gt", "max_dup_line_char_frac")
    for n in (2, 3, 4):
        add(f"top_{n}gram_char_frac", f"top_{n}gram_char_frac", "gt", f"max_top_{n}gram_char_frac")
    for n in range(5, 11):
        add(f"dup_{n}gram_char_frac", f"dup_{n}gram_char_frac", "gt", f"max_dup_{n}gram_char_frac")

    add("min_words", "word_count", "lt", "min_words")
    add("max_words", "word_count", "gt", "max_words")
    add("min_mean_word_length", "mean_word_length", "lt", "min_mean_word_length", "segmented")
    add("max_mean_word_length", "mean_word_length", "gt", "max_mean_word_length", "segmented")
    add("symbol_word_ratio", "symbol_word_ratio", "gt", "max_symbol_word_ratio")
    add("bullet_lines_frac", "bullet_lines_frac", "gt", "max_bullet_lines_frac")
    add("ellipsis_lines_frac", "ellipsis_lines_frac", "gt", "max_ellipsis_lines_frac")
    add("alpha_words_frac", "alpha_words_frac", "lt", "min_alpha_words_frac")
    add("stop_word_count", "stop_word_count", "lt", "min_stop_words", "stop_words")

    # C4's page rules read the lines left after C4's line removal (c4_line_outcome).
    add("c4_lorem_ipsum", "c4_lorem_ipsum_lines", "ge", "c4_drop_lorem_ipsum", "segmented", switch=True)
    add("c4_curly_bracket", "c4_curly_bracket_lines", "ge", "c4_drop_curly_bracket", "segmented", switch=True)
    add("c4_min_sentences", "c4_sentence_count", "lt", "c4_min_sentences", "segmented")

    add("line_punct_ratio", "line_punct_ratio", "le", "min_line_punct_ratio")
    add("short_line_ratio", "short_line_ratio", "ge", "max_short_line_ratio")
    add("char_dup_ratio", "char_dup_ratio", "ge", "max_char_dup_ratio")
    add("list_ratio", "list_ratio", "gt", "max_list_ratio")
    add("list_lines_frac", "list_lines_frac", "gt", "max_list_lines_frac")

    add("badword_ratio", "badword_ratio", "gt", "max_badword_ratio")
    add("classifier_score", "classifier_score", "lt", "min_classifier_score")
    return out


def _column(pdf: pd.DataFrame, signal: str) -> np.ndarray:
    """A signal as float64; NaN and null are both missing (NaN)."""
    column = pdf[signal]
    try:
        return column.astype("float64").to_numpy()
    except (TypeError, ValueError):
        return pd.to_numeric(column, errors="coerce").astype("float64").to_numpy()


def _fire_mask(rule: Rule, values: np.ndarray, language: np.ndarray, cfg: FilterConfig) -> np.ndarray:
    """Where threshold `rule` fires on its own, its scope applied. A missing value never fires,
    except for the classifier rule: an unscored document cannot pass a classifier threshold."""
    with np.errstate(invalid="ignore"):
        fires = _OPS[rule.op](values, rule.threshold)
    if rule.name == "classifier_score":
        fires |= np.isnan(values)
    if rule.scope == "segmented" and cfg.unsegmented_languages:
        fires &= pd.notna(language) & ~np.isin(language, cfg.unsegmented_languages)
    elif rule.scope == "stop_words":
        fires &= pd.notna(language) & np.isin(language, cfg.stop_word_languages)
    return fires


# --------------------------------------------------------------------------------------------
# C4 line removal, from the stored per-line facts (engine/signals.py c4_signals)

# Why a line was removed, in datatrove's order (the first that applies); "blank" is a line with
# no words, which C4 removes through its words-per-line rule.
C4_LINE_REASONS = ("too_long_word", "no_terminal_punct", "blank", "too_few_words", "javascript", "policy")
# The C4 page signals that filtered recomputes on the lines left after line removal.
C4_PAGE_SIGNALS = ("c4_sentence_count", "c4_lorem_ipsum_lines", "c4_curly_bracket_lines")


def c4_line_removal_active(cfg: FilterConfig) -> bool:
    """Does any C4 line rule change the kept text?"""
    return bool(cfg.c4_remove_long_word_lines or cfg.c4_remove_no_terminal_punct_lines or cfg.c4_min_words_per_line
                or cfg.c4_remove_javascript_lines or cfg.c4_remove_policy_lines or cfg.c4_remove_citations)


def _needs_c4_lines(cfg: FilterConfig) -> bool:
    return c4_line_removal_active(cfg) or any(r.signal in C4_PAGE_SIGNALS for r in rules(cfg))


@dataclass(frozen=True)
class C4LineOutcome:
    """C4's line removal over a batch: per line (all documents' lines in a row) and per document."""

    starts: np.ndarray  # (documents + 1,): document i's lines are starts[i]:starts[i + 1]
    keep: np.ndarray  # bool per line
    reason: np.ndarray  # per line: index into C4_LINE_REASONS, -1 where kept
    citation: np.ndarray  # bool per kept line: citation markers are removed from it
    page: dict  # C4_PAGE_SIGNALS -> int64 per document, on the lines left
    line_doc: np.ndarray  # per line: the index of its document

    def removed_lines(self) -> np.ndarray:
        """Lines removed per document."""
        return np.bincount(self.line_doc[~self.keep], minlength=len(self.starts) - 1)

    def document_counts(self, documents: np.ndarray) -> dict[str, np.ndarray]:
        """Per document (int64): lines in, lines removed per reason, kept lines with citations
        removed; zero where `documents` (bool per document) is False."""
        n = len(self.starts) - 1
        line_doc = self.line_doc
        on = documents[line_doc]
        counts = {"c4_lines_in": np.bincount(line_doc[on], minlength=n)}
        for i, name in enumerate(C4_LINE_REASONS):
            counts[f"c4_lines_removed_{name}"] = np.bincount(line_doc[on & (self.reason == i)], minlength=n)
        counts["c4_lines_citations_removed"] = np.bincount(line_doc[on & self.citation], minlength=n)
        return {k: v.astype(np.int64) for k, v in counts.items()}


C4_COUNT_COLUMNS = ("c4_lines_in", *(f"c4_lines_removed_{r}" for r in C4_LINE_REASONS), "c4_lines_citations_removed")


def c4_line_outcome(c4_lines, language, cfg: FilterConfig) -> C4LineOutcome:
    """Which lines C4 removes under `cfg`, and C4's page signals on the lines left.

    `c4_lines`: the stored per-line facts of each document (bytes; None = no lines), `language`:
    each document's language. Vectorised over all lines of the batch, in datatrove's order:
    too long a word, no terminal punctuation, too few words, then "lorem ipsum" is counted,
    javascript lines go, "{" is counted, policy lines go, and the sentences left are summed.
    The word-based and punctuation rules skip unsegmented languages, as C4's page rules do.
    """
    blobs = [bytes(b) if b is not None else b"" for b in c4_lines]
    n_docs = len(blobs)
    lines_per_doc = np.fromiter(map(len, blobs), dtype=np.int64, count=n_docs) // 3
    starts = np.concatenate(([0], np.cumsum(lines_per_doc))).astype(np.int64)
    buffer = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    line_doc = np.repeat(np.arange(n_docs), lines_per_doc)
    # Each blob is three planes (flags, words, sentences) of its document's line count.
    position = np.arange(starts[-1]) - starts[:-1][line_doc]
    base = 3 * starts[:-1][line_doc] + position
    per_line = lines_per_doc[line_doc]
    flags, words, sentences = buffer[base], buffer[base + per_line], buffer[base + 2 * per_line]

    language = np.asarray(language, dtype=object)
    segmented = ~np.isin(language, cfg.unsegmented_languages) if cfg.unsegmented_languages else np.ones(n_docs, bool)
    segmented_line = segmented[line_doc]
    keep = np.ones(len(flags), dtype=bool)
    reason = np.full(len(flags), -1, dtype=np.int8)

    def remove(mask: np.ndarray, why: str) -> None:
        hit = keep & mask
        reason[hit] = C4_LINE_REASONS.index(why)
        keep[hit] = False

    def has(bit: int) -> np.ndarray:
        return (flags & bit).astype(bool)

    if cfg.c4_remove_long_word_lines:
        remove(segmented_line & has(S.C4_TOO_LONG_WORD), "too_long_word")
    if cfg.c4_remove_no_terminal_punct_lines:
        ends = has(S.C4_END_PUNCT) if cfg.c4_remove_citations else has(S.C4_END_PUNCT_RAW)
        remove(segmented_line & ~ends, "no_terminal_punct")
    if cfg.c4_min_words_per_line is not None:
        short = segmented_line & (words < cfg.c4_min_words_per_line)
        remove(short & (words == 0), "blank")
        remove(short, "too_few_words")
    lorem = np.bincount(line_doc[keep & has(S.C4_LOREM_IPSUM)], minlength=n_docs)
    if cfg.c4_remove_javascript_lines:
        remove(has(S.C4_JAVASCRIPT), "javascript")
    curly = np.bincount(line_doc[keep & has(S.C4_CURLY_BRACKET)], minlength=n_docs)
    if cfg.c4_remove_policy_lines:
        remove(has(S.C4_POLICY), "policy")
    sentence_count = np.bincount(line_doc, weights=np.where(keep, sentences, 0), minlength=n_docs)
    citation = keep & has(S.C4_CITATION) if cfg.c4_remove_citations else np.zeros(len(flags), bool)
    page = {
        "c4_sentence_count": sentence_count.astype(np.int64),
        "c4_lorem_ipsum_lines": lorem.astype(np.int64),
        "c4_curly_bracket_lines": curly.astype(np.int64),
    }
    return C4LineOutcome(starts, keep, reason, citation, page, line_doc)


# Of the PII patterns only phone numbers may span a line break (their separators include \s), so a
# line removal can only create a match where a line ending in a digit or ")" meets one starting
# with a digit or "(".
_DIGITS_JOINED = re.compile(r"[\d)]\n[\d(]")


def remove_c4_lines(text: str, keep: np.ndarray, cfg: FilterConfig) -> str:
    """The text C4 keeps: kept lines stripped (citation markers removed) and joined with "\n"."""
    lines = text.splitlines()
    if len(lines) != len(keep):
        raise ValueError(f"c4_lines has {len(keep)} lines but the document text has {len(lines)}: "
                         "quality_signals and documents are not from the same documents artifact")
    out = []
    for line, kept in zip(lines, keep.tolist()):
        if kept:
            line = line.strip()
            if cfg.c4_remove_citations and "[" in line:
                line = S.C4_CITATION_RE.sub("", line)
            out.append(line)
    return "\n".join(out).strip()


def with_c4_page_signals(pdf: pd.DataFrame, cfg: FilterConfig) -> tuple[pd.DataFrame, C4LineOutcome | None]:
    """`pdf` with C4_PAGE_SIGNALS recomputed for `cfg` from its `c4_lines` (when it has them)."""
    if "c4_lines" not in pdf.columns:
        return pdf, None
    language = pdf["language"].to_numpy(dtype=object) if "language" in pdf.columns else np.full(len(pdf), None, dtype=object)
    outcome = c4_line_outcome(pdf["c4_lines"].tolist(), language, cfg)
    pdf = pdf.copy()
    for name, values in outcome.page.items():
        pdf[name] = values
    return pdf, outcome


# --------------------------------------------------------------------------------------------
# First rule fired, and why


def _number(value: float) -> str:
    return f"{value:.4g}" if not float(value).is_integer() else str(int(value))


_ASCII_OPS = {"lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def rule_detail(rule: str, value: float, threshold: float, *, cfg: FilterConfig, language=None,
                language_score: float = math.nan, spec: Rule | None) -> str:
    """One self-explanatory line per rejection: the signal, its value, and the setting it broke.
    `spec`: the Rule named `rule` (None only for MISSING_SIGNALS, which is no rule of rules(cfg))."""
    if rule == MISSING_SIGNALS:
        return "no quality_signals row for this doc_id"
    if rule == LANGUAGE_NOT_ALLOWED:
        score = f" (score {language_score:.2f})" if language_score == language_score else ""
        shown = repr(language) if language is not None else "unknown"
        return f"language {shown}{score} not in languages [{', '.join(cfg.languages)}]"
    if rule == "url_blocklisted":
        return "URL matches quality_signals.url_blocklist (drop_url_blocklisted)"
    if rule in ("c4_lorem_ipsum", "c4_curly_bracket"):
        what = "'lorem ipsum'" if rule == "c4_lorem_ipsum" else "'{'"
        return f"{_number(value)} line(s) with {what} left after C4 line removal ({spec.field})"
    if value != value:  # NaN: only the classifier rule fires on a missing value
        return f"no {spec.signal} (document not scored); {spec.field} {_number(threshold)}"
    after = " after C4 line removal" if spec.signal in C4_PAGE_SIGNALS else ""
    return f"{spec.signal} {_number(value)}{after} {_ASCII_OPS[spec.op]} {spec.field} {_number(threshold)}"


def first_rule_fired(
    pdf: pd.DataFrame, cfg: FilterConfig
) -> tuple[list[str | None], np.ndarray, np.ndarray, list[str | None]]:
    """(rule, value, threshold, detail) per row of a signals batch: the first rule that fires, in
    `rules(cfg)` order, or None with NaN value and threshold and no detail when the document is kept.

    Rows whose `_has_signals` column is null (a left join found no signals) are rejected as
    "missing_signals". The rules in NON_THRESHOLD_RULES have NaN value and threshold; `detail`
    says in words why every rejected row went. Vectorised over the batch: each rule is one numpy
    comparison on undecided rows; only rejected rows get a detail string.
    """
    n = len(pdf)
    fired = np.full(n, -1, dtype=np.int64)
    value = np.full(n, np.nan)
    threshold = np.full(n, np.nan)
    language = pdf["language"].to_numpy(dtype=object) if "language" in pdf.columns else np.full(n, None, dtype=object)
    names = [MISSING_SIGNALS]
    specs: list[Rule | None] = [None]
    undecided = np.ones(n, dtype=bool)
    if "_has_signals" in pdf.columns:
        missing = pdf["_has_signals"].isna().to_numpy()
        fired[missing] = 0
        undecided &= ~missing
    for rule in rules(cfg):
        if not undecided.any():
            break
        names.append(rule.name)
        specs.append(rule)
        if rule.op == "not_in":  # language_not_allowed: value and threshold stay NaN (null), `detail` says why
            hit = pd.notna(language) & ~np.isin(language, cfg.languages) & undecided
        else:
            values = _column(pdf, rule.signal)
            hit = _fire_mask(rule, values, language, cfg) & undecided
            value[hit] = values[hit]
            threshold[hit] = rule.threshold
        fired[hit] = len(names) - 1
        undecided &= ~hit
    scores = _column(pdf, "language_score") if "language_score" in pdf.columns else np.full(n, np.nan)
    rule_names: list[str | None] = []
    detail: list[str | None] = []
    for i, index in enumerate(fired.tolist()):
        if index < 0:
            rule_names.append(None)
            detail.append(None)
        else:
            rule_names.append(names[index])
            detail.append(rule_detail(names[index], value[i], threshold[i], cfg=cfg, language=language[i],
                                      language_score=scores[i], spec=specs[index]))
    return rule_names, value, threshold, detail


# Signals carried into filtered/kept: what dedup and mixing need downstream.
KEPT_SIGNALS = ("language", "language_score", "classifier_score", "minhash")
_PII_COLUMNS = ("pii_email", "pii_phone", "pii_ip", "pii_card")


def decide(signals_df: DataFrame, documents_df: DataFrame, cfg: FilterConfig) -> DataFrame:
    """Every document once: its columns, the carried signals, `rule`, `value`, `threshold` and
    `detail` (all null when kept), and C4_COUNT_COLUMNS (lines in and removed per reason; zero
    for rejected documents). Kept documents' text has C4's lines removed, then PII replaced by
    <EMAIL>/<PHONE>/<IP>/<CARD>.

    One join and one mapInPandas pass (`first_rule_fired` on each Arrow batch): the rules are a
    few numpy comparisons per batch, while the same rules as one Spark expression took Spark
    seconds of analysis and code generation in every query that used it. C4's page signals are
    recomputed per batch from the stored `c4_lines` (the lines left depend on the line settings
    here). PII redaction runs only on texts the signals found PII in, or where a line removal
    made digits meet across a line break.
    """
    available = set(signals_df.columns)
    for rule in rules(cfg):
        if rule.signal not in available:
            raise ValueError(f"signals have no column {rule.signal!r} needed by rule {rule.name!r}")
    c4 = _needs_c4_lines(cfg)
    if c4 and "c4_lines" not in available:
        raise ValueError("signals have no column 'c4_lines' needed by C4's line removal and page rules: "
                         "re-materialize quality_signals")
    line_removal = c4 and c4_line_removal_active(cfg)
    carried = [name for name in KEPT_SIGNALS if name in available and name not in documents_df.columns]
    needed = {r.signal for r in rules(cfg)} | {"language", "language_score"} | set(carried) | (set(_PII_COLUMNS) & available)
    if c4:
        needed.add("c4_lines")
    signals = signals_df.select("doc_id", *sorted(c for c in needed if c in available)).withColumn("_has_signals", F.lit(True))
    joined = documents_df.join(signals, on="doc_id", how="left")
    pii_columns = [c for c in _PII_COLUMNS if c in available]
    output_schema = T.StructType(
        [*documents_df.schema.fields, *[signals_df.schema[c] for c in carried],
         T.StructField("rule", T.StringType()), T.StructField("value", T.DoubleType()),
         T.StructField("threshold", T.DoubleType()), T.StructField("detail", T.StringType()),
         *[T.StructField(c, T.LongType()) for c in C4_COUNT_COLUMNS]]
    )
    output_columns = output_schema.fieldNames()

    def run(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for batch in batches:
            batch, outcome = with_c4_page_signals(batch, cfg) if c4 else (batch, None)
            rule, value, threshold, detail = first_rule_fired(batch, cfg)
            kept = np.array([r is None for r in rule], dtype=bool)
            # No PII columns in the signals: every kept text is checked.
            pii = batch[pii_columns].fillna(0).to_numpy().sum(axis=1) > 0 if pii_columns else np.ones(len(batch), bool)
            rewrite = kept & pii
            if line_removal:
                # C4's text: every kept document is rewritten (lines stripped and joined with \n).
                texts = batch["text"].tolist()
                removed = outcome.removed_lines()
                for i in np.flatnonzero(kept).tolist():
                    if isinstance(texts[i], str):
                        texts[i] = remove_c4_lines(texts[i], outcome.keep[outcome.starts[i]:outcome.starts[i + 1]], cfg)
                        # Lines that a removed line separated now touch: where digits meet across
                        # the join, a phone number the signals did not see may have formed.
                        if removed[i] and _DIGITS_JOINED.search(texts[i]):
                            rewrite[i] = True
                batch["text"] = texts
            if rewrite.any():
                batch.loc[rewrite, "text"] = [redact_pii(t)[0] if isinstance(t, str) else t for t in batch.loc[rewrite, "text"]]
            batch["rule"], batch["value"], batch["threshold"], batch["detail"] = rule, value, threshold, detail  # NaN arrives as null
            counts = outcome.document_counts(kept) if outcome is not None else {}
            for name in C4_COUNT_COLUMNS:
                batch[name] = counts.get(name, np.zeros(len(batch), dtype=np.int64))
            yield batch[output_columns]

    return joined.mapInPandas(run, output_schema)


def split_decisions(decided: DataFrame, documents_columns: list[str]) -> tuple[DataFrame, DataFrame]:
    """(kept_df, rejected_df) of a `decide` frame; see apply_filters."""
    carried = [c for c in KEPT_SIGNALS if c in decided.columns and c not in documents_columns]
    kept_df = decided.where(F.col("rule").isNull()).select(*documents_columns, *carried)
    bucket = F.col("bucket") if "bucket" in documents_columns else F.lit(None).cast("string")
    url = F.col("url") if "url" in documents_columns else F.lit(None).cast("string")
    rejected_df = decided.where(F.col("rule").isNotNull()).select(
        "doc_id", url.alias("url"), bucket.alias("bucket"), "rule", "value", "threshold", "detail"
    )
    return kept_df, rejected_df


def apply_filters(signals_df: DataFrame, documents_df: DataFrame, cfg: FilterConfig) -> tuple[DataFrame, DataFrame]:
    """(kept_df, rejected_df).

    kept_df: documents columns, text with C4's lines removed and PII replaced by
    <EMAIL>/<PHONE>/<IP>/<CARD>, plus language, language_score, classifier_score and minhash
    (when present in the signals).
    rejected_df: doc_id, url, bucket, rule, value, threshold, detail (first rule that fired;
    documents without signals are rejected as "missing_signals"). Both are computed from one
    `decide` frame: persist it (as the filtered stage does) to run the rules once for both.
    """
    return split_decisions(decide(signals_df, documents_df, cfg), list(documents_df.columns))


def c4_line_counts(decided: DataFrame) -> dict[str, int]:
    """Lines of the kept documents: in, removed per C4 reason, with citations removed (one
    aggregation over a `decide` frame; persist it first)."""
    row = decided.agg(*[F.sum(c).alias(c) for c in C4_COUNT_COLUMNS]).collect()[0]
    return {c: int(row[c] or 0) for c in C4_COUNT_COLUMNS}


def rule_counts(rejected_df: DataFrame) -> dict[str, int]:
    """Rejections per rule, most frequent first."""
    rows = rejected_df.groupBy("rule").count().collect()
    return dict(sorted(((r["rule"], int(r["count"])) for r in rows), key=lambda kv: (-kv[1], kv[0])))


def rule_counts_parquet(rejected_dir: str) -> dict[str, int]:
    """rule_counts of a written `rejected` folder, read on the driver: one dictionary-encoded
    column, milliseconds where a Spark aggregation costs a job and its query compilation."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    counts = pc.value_counts(pq.read_table(rejected_dir, columns=["rule"]).column("rule").combine_chunks())
    pairs = ((str(item["values"]), int(item["counts"])) for item in counts.to_pylist() if item["values"] is not None)
    return dict(sorted(pairs, key=lambda kv: (-kv[1], kv[0])))


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


_FINE_BINS_PER_BIN = 10  # histogram resolution behind the reported quantiles


def signal_report(signals_df: DataFrame, cfg: FilterConfig, bins: int = 20) -> dict:
    """Distribution of every signal a threshold rule reads, and where each threshold cuts it.

    Returns {"documents": n, "signals": {signal: {min, max, p5, p50, p95, counts}},
    "rules": [{rule, signal, op, threshold, scope, beyond, cut_bin}]}: `counts` is an
    equal-width histogram from min to max, `beyond` the documents the rule alone would remove
    (its scope applied; earlier rules ignored), `cut_bin` the bin boundary the threshold falls on.
    min, max and `beyond` are exact; quantiles are the lower edge of the bin they fall in on a
    10x finer histogram (at most (max - min) / (10 * bins) below the true value). NaN and null
    values are missing and counted nowhere.

    C4's page signals are recomputed from `c4_lines` for the config's line settings, as in `decide`.
    Two Spark passes over only the columns it needs, each a mapInPandas whose partitions return
    small partial results (bounds and rule counts, then histograms) merged on the driver: wide
    Spark aggregates over ~35 columns cost seconds of query compilation whatever the data size.
    """
    active = [r for r in rules(cfg) if r.op in _OPS and r.signal in signals_df.columns and r.signal != "url_blocklisted"]
    signals = sorted({r.signal for r in active})
    has_language = "language" in signals_df.columns
    # C4's page signals as `decide` sees them: recomputed for these line settings.
    c4 = "c4_lines" in signals_df.columns and any(s in C4_PAGE_SIGNALS for s in signals)
    frame = signals_df.select(*signals, *(["language"] if has_language else []), *(["c4_lines"] if c4 else []))
    fine = bins * _FINE_BINS_PER_BIN

    def bounds(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        n, low, high = 0, {}, {}
        fired = [0] * len(active)
        for pdf in batches:
            pdf = with_c4_page_signals(pdf, cfg)[0] if c4 else pdf
            n += len(pdf)
            language = pdf["language"].to_numpy(dtype=object) if has_language else np.full(len(pdf), None, dtype=object)
            columns = {s: _column(pdf, s) for s in signals}
            for s, x in columns.items():
                x = x[~np.isnan(x)]
                if x.size:
                    low[s] = min(low.get(s, math.inf), float(x.min()))
                    high[s] = max(high.get(s, -math.inf), float(x.max()))
            for i, rule in enumerate(active):
                fired[i] += int(_fire_mask(rule, columns[rule.signal], language, cfg).sum())
        yield pd.DataFrame({"stats": [json.dumps({"n": n, "low": low, "high": high, "fired": fired})]})

    n, low, high, fired = 0, {}, {}, [0] * len(active)
    for row in frame.mapInPandas(bounds, "stats string").collect():
        part = json.loads(row["stats"])
        n += part["n"]
        fired = [a + b for a, b in zip(fired, part["fired"])]
        for s, v in part["low"].items():
            low[s] = min(low.get(s, math.inf), v)
        for s, v in part["high"].items():
            high[s] = max(high.get(s, -math.inf), v)

    def histograms(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        counts = {s: np.zeros(fine, dtype=np.int64) for s in low}
        for pdf in batches:
            pdf = with_c4_page_signals(pdf, cfg)[0] if c4 else pdf
            for s in counts:
                x = _column(pdf, s)
                x = x[~np.isnan(x)]
                width = (high[s] - low[s]) / fine if high[s] > low[s] else 1.0
                index = np.minimum(np.floor((x - low[s]) / width), fine - 1).astype(np.int64)
                counts[s] += np.bincount(index, minlength=fine)
        yield pd.DataFrame({"stats": [json.dumps({s: c.tolist() for s, c in counts.items()})]})

    fine_counts = {s: np.zeros(fine, dtype=np.int64) for s in low}
    if low:
        for row in frame.mapInPandas(histograms, "stats string").collect():
            for s, c in json.loads(row["stats"]).items():
                fine_counts[s] += np.asarray(c, dtype=np.int64)

    def quantile(s: str, q: float) -> float | None:
        if s not in low:
            return None
        if high[s] <= low[s]:
            return low[s]
        cumulative = np.cumsum(fine_counts[s])
        index = int(np.searchsorted(cumulative, q * cumulative[-1]))
        return low[s] + index * (high[s] - low[s]) / fine  # the fine bin's lower edge: exact for spikes at min

    report: dict = {"documents": n, "signals": {}, "rules": []}
    for s in signals:
        report["signals"][s] = {
            "min": low.get(s),
            "max": high.get(s),
            "p5": quantile(s, 0.05),
            "p50": quantile(s, 0.5),
            "p95": quantile(s, 0.95),
            "counts": fine_counts[s].reshape(bins, _FINE_BINS_PER_BIN).sum(axis=1).tolist() if s in low else [0] * bins,
        }
    for i, rule in enumerate(active):
        report["rules"].append({
            "rule": rule.name,
            "signal": rule.signal,
            "op": rule.op,
            "threshold": rule.threshold,
            "scope": rule.scope,
            "beyond": fired[i],
            "cut_bin": _cut_position(rule.threshold, low[rule.signal], high[rule.signal], bins) if rule.signal in low else None,
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
