"""Per-document quality signals: numbers only, no keep/drop decisions (engine/filters.py decides).

Definitions follow the published heuristics as datatrove implements them:
- Gopher quality and repetition: Rae et al. 2021, Table A1 (datatrove GopherQualityFilter /
  GopherRepetitionFilter),
- C4: Raffel et al. 2020 and tfds `c4_utils.clean_page` (datatrove C4QualityFilter),
- FineWeb: Penedo et al. 2024 (datatrove FineWebQualityFilter).
datatrove tokenises with NLTK; NLTK needs data files that are not on PyPI, so `tokenize_words`
is a regex approximation of it (words, numbers, and each punctuation mark as its own token).
Chinese/Japanese characters are one token each, so word and n-gram counts stay meaningful for
text written without spaces.
"""
from __future__ import annotations

import os
import re
import threading
from collections import Counter
from dataclasses import dataclass
from operator import methodcaller
from typing import Iterable, Iterator, Sequence
from urllib.parse import urlsplit

import numpy as np
import pandas as pd

# --------------------------------------------------------------------------------------------
# Tokenisation

# Han, kana and CJK compatibility ranges: scripts written without spaces between words.
_CJK = "\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
_TOKEN_RE = re.compile(
    rf"[{_CJK}]"  # one CJK character = one token
    r"|\.\.\."  # NLTK keeps an ellipsis together
    rf"|[^\W{_CJK}]+(?:[-'’.][^\W{_CJK}]+)*"  # words, numbers, hyphenated words, contractions
    r"|[^\w\s]"  # every other punctuation mark or symbol on its own
)
# The word alternatives of _TOKEN_RE alone: tokens with a letter or digit ("words" to Gopher).
_WORD_RE = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+(?:[-'’.][^\W{_CJK}]+)*")
_HAS_ALPHA = re.compile(r"[^\W\d_]")


def tokenize_words(text: str) -> list[str]:
    """Words and punctuation tokens, in order (an NLTK word_tokenize approximation)."""
    return _TOKEN_RE.findall(text)


# --------------------------------------------------------------------------------------------
# Gopher quality (datatrove GopherQualityFilter)

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
_BULLETS = ("•", "-")
_ELLIPSES = ("...", "…")
_starts_with_bullet = methodcaller("startswith", _BULLETS)
_ends_with_ellipsis = methodcaller("endswith", _ELLIPSES)


def gopher_quality_signals(text: str, words: list[str]) -> dict[str, float]:
    # Gopher's "words" exclude tokens made only of punctuation/symbols; ratios "per word" use
    # that count as denominator (as the datatrove version used for FineWeb does; later
    # datatrove versions divide by all tokens, which fails ~a third of ordinary English prose).
    real_words = _WORD_RE.findall(text)
    n_words = len(real_words)
    lines = text.splitlines()
    n_lines = len(lines)
    hashes = text.count("#")
    ellipses = text.count("...") + text.count("…")
    return {
        "word_count": n_words,
        "mean_word_length": (sum(map(len, real_words)) / n_words) if n_words else 0.0,
        # Gopher: "symbol-to-word ratio ... for either the hash symbol or the ellipsis".
        "symbol_word_ratio": (max(hashes, ellipses) / n_words) if n_words else float(hashes + ellipses > 0),
        "bullet_lines_frac": (sum(map(_starts_with_bullet, map(str.lstrip, lines))) / n_lines) if n_lines else 0.0,
        "ellipsis_lines_frac": (sum(map(_ends_with_ellipsis, map(str.rstrip, lines))) / n_lines) if n_lines else 0.0,
        "alpha_words_frac": (sum(map(bool, map(_HAS_ALPHA.search, real_words))) / n_words) if n_words else 0.0,
        # Lower-cased so a sentence-initial "The" counts too.
        "stop_word_count": sum(map(STOP_WORDS.__contains__, map(str.lower, words))),
    }


# --------------------------------------------------------------------------------------------
# Gopher repetition (datatrove GopherRepetitionFilter)

TOP_NGRAM_SIZES = (2, 3, 4)
DUP_NGRAM_SIZES = (5, 6, 7, 8, 9, 10)
_PARAGRAPH_SPLIT = re.compile(r"\n{2,}")
_LINE_SPLIT = re.compile(r"\n+")
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
_HASH_MUL2 = np.uint64(0xBF58476D1CE4E5B9)


def find_duplicates(items: Iterable[str]) -> tuple[int, int]:
    """(number of elements seen before, total characters of those repeats)."""
    seen: set[str] = set()
    dup_elements = dup_chars = 0
    for item in items:
        if item in seen:
            dup_elements += 1
            dup_chars += len(item)
        else:
            seen.add(item)
    return dup_elements, dup_chars


def _ngram_hashes(words: list[str], max_n: int) -> dict[int, np.ndarray]:
    """64-bit hashes of every word n-gram, n = 1..max_n (collisions ~ n_grams**2 / 2**64)."""
    ids = np.fromiter(map(hash, words), dtype=np.int64, count=len(words)).view(np.uint64)
    out = {1: ids}
    current = ids
    with np.errstate(over="ignore"):
        for n in range(2, max_n + 1):
            m = len(words) - n + 1
            if m <= 0:
                break
            mixed = (current[:m] * _HASH_MUL) ^ (ids[n - 1 : n - 1 + m] * _HASH_MUL2)
            current = mixed ^ (mixed >> np.uint64(31))
            out[n] = current
    return out


def _duplicate_ngram_chars(keys: np.ndarray, prefix: np.ndarray, n: int) -> int | None:
    """datatrove's find_all_duplicate on n-gram hashes: walk left to right; an n-gram seen at an
    earlier visited position counts its characters (without spaces) and its n words are
    skipped. Returns None when no n-gram occurs twice.

    Only positions whose n-gram occurred before need Python work: such a position is a
    duplicate iff one of the earlier occurrences was visited (not inside a skipped span).
    """
    m = keys.size
    order = np.argsort(keys, kind="stable")
    same = keys[order[1:]] == keys[order[:-1]]
    if not same.any():
        return None
    previous = np.full(m, -1, dtype=np.int64)
    previous[order[1:][same]] = order[:-1][same]
    previous_list = previous.tolist()
    visited = bytearray(b"\x01") * m
    repeated_chars = 0
    for i in np.flatnonzero(previous >= 0).tolist():
        if not visited[i]:
            continue
        j = previous_list[i]
        while j >= 0 and not visited[j]:
            j = previous_list[j]
        if j >= 0:
            repeated_chars += int(prefix[i + n] - prefix[i])
            end = min(i + n, m)
            visited[i + 1 : end] = bytes(end - i - 1)
    return repeated_chars


def gopher_repetition_signals(text: str, words: list[str]) -> dict[str, float]:
    n_chars = len(text)
    signals: dict[str, float] = {}

    paragraphs = _PARAGRAPH_SPLIT.split(text.strip())
    para_dups, para_dup_chars = find_duplicates(paragraphs)
    lines = _LINE_SPLIT.split(text)
    line_dups, line_dup_chars = find_duplicates(lines)
    signals["dup_para_frac"] = para_dups / len(paragraphs)
    signals["dup_para_char_frac"] = para_dup_chars / n_chars if n_chars else 0.0
    signals["dup_line_frac"] = line_dups / len(lines)
    signals["dup_line_char_frac"] = line_dup_chars / n_chars if n_chars else 0.0

    for n in TOP_NGRAM_SIZES:
        signals[f"top_{n}gram_char_frac"] = 0.0
    for n in DUP_NGRAM_SIZES:
        signals[f"dup_{n}gram_char_frac"] = 0.0
    if not words or not n_chars:
        return signals

    lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
    prefix = np.concatenate(([0], np.cumsum(lengths)))
    hashes = _ngram_hashes(words, max(DUP_NGRAM_SIZES))

    for n in TOP_NGRAM_SIZES:
        keys = hashes.get(n)
        if keys is None:
            continue
        _, first_index, counts = np.unique(keys, return_index=True, return_counts=True)
        top_count = counts.max()
        # Counter.most_common(1) returns the earliest n-gram among equally frequent ones.
        start = int(first_index[counts == top_count].min())
        # datatrove measures the n-gram joined with spaces.
        ngram_chars = int(prefix[start + n] - prefix[start]) + n - 1
        signals[f"top_{n}gram_char_frac"] = float(top_count) * ngram_chars / n_chars

    for n in DUP_NGRAM_SIZES:
        keys = hashes.get(n)
        if keys is None:
            break
        repeated_chars = _duplicate_ngram_chars(keys, prefix, n)
        if repeated_chars is None:
            break  # no n-gram repeats, so no longer one does either
        signals[f"dup_{n}gram_char_frac"] = repeated_chars / n_chars
    return signals


# --------------------------------------------------------------------------------------------
# C4 (tfds c4_utils.clean_page, datatrove C4QualityFilter)
#
# C4 removes lines (too long a word, no terminal punctuation, too few words, "javascript",
# policy/cookie boilerplate) and then judges the page on the lines left ("lorem ipsum" or "{"
# drops it, and so do fewer than 5 sentences). Which lines go is a filters setting, so this
# stage stores per-line facts (`c4_lines`) from which engine/filters.py removes the lines and
# recomputes the page rules for any setting, without reading the page again. The scalar C4
# columns are those page rules under the published settings as FineWeb ran them
# (filter_no_terminal_punct=False): the FilterConfig defaults.

C4_END_PUNCTUATION = (".", "?", "!", '"', "'")
C4_POLICY_SUBSTRINGS = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
C4_MIN_WORDS_PER_LINE = 3  # published min_words_per_line
C4_MAX_WORD_LENGTH = 1000  # published max_word_length: longer "words" are markup or encoded data
C4_LINE_COUNT_MAX = 255  # per-line word and sentence counts are stored as one byte each
C4_CITATION_RE = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s|$)")

# Bits of a line's flags byte in `c4_lines`.
C4_TOO_LONG_WORD = 1  # a whitespace-separated word longer than C4_MAX_WORD_LENGTH
C4_END_PUNCT = 2  # ends in terminal punctuation (not "...") once citation markers are removed
C4_END_PUNCT_RAW = 4  # the same with citation markers left in
C4_JAVASCRIPT = 8
C4_POLICY = 16
C4_LOREM_IPSUM = 32
C4_CURLY_BRACKET = 64
C4_CITATION = 128  # has a citation marker ([1], [edit], [citation needed])


def c4_signals(text: str) -> dict:
    """C4's per-line facts and its page rules under the default (FineWeb) settings.

    `c4_lines` holds, for the lines of text.splitlines(), three byte planes of equal length:
    flags (C4_* bits), words (len(line.split()), capped at 255) and sentences (0 for a blank
    line, else at least 1, capped at 255). Lines are stripped first, and lower-cased matching
    and sentences use the line without citation markers, as datatrove does.
    """
    lines = text.splitlines()
    n_lines = len(lines)
    flags = bytearray(n_lines)
    word_counts = bytearray(n_lines)
    sentence_counts = bytearray(n_lines)
    nonempty = terminal = javascript = policy = lorem = curly = sentences = 0
    text_lower = text.lower()
    # Most pages have none of these anywhere; skip the per-line searches then.
    any_javascript = "javascript" in text_lower
    any_policy = any(p in text_lower for p in C4_POLICY_SUBSTRINGS)
    any_lorem = "lorem ipsum" in text_lower
    any_keyword = any_javascript or any_policy or any_lorem
    any_citation = "[" in text
    any_curly = "{" in text
    for i, raw_line in enumerate(lines):
        line = raw_line.strip()
        if not line:
            continue
        nonempty += 1
        words = line.split()
        n_words = len(words)
        f = 0
        if len(line) > C4_MAX_WORD_LENGTH and any(len(w) > C4_MAX_WORD_LENGTH for w in words):
            f |= C4_TOO_LONG_WORD
        if line.endswith(C4_END_PUNCTUATION) and not line.endswith("..."):
            f |= C4_END_PUNCT_RAW
        if any_citation and "[" in line:
            cleaned = C4_CITATION_RE.sub("", line)
            if cleaned != line:
                f |= C4_CITATION
                line = cleaned
        if line.endswith(C4_END_PUNCTUATION) and not line.endswith("..."):
            f |= C4_END_PUNCT
        if any_keyword:
            lowered = line.lower()
            if any_javascript and "javascript" in lowered:
                f |= C4_JAVASCRIPT
            if any_policy and any(p in lowered for p in C4_POLICY_SUBSTRINGS):
                f |= C4_POLICY
            if any_lorem and "lorem ipsum" in lowered:
                f |= C4_LOREM_IPSUM
        if any_curly and "{" in line:
            f |= C4_CURLY_BRACKET
        # NLTK's punkt would split sentences; count sentence-final punctuation instead.
        n_sentences = len(_SENTENCE_END.findall(line)) if ("." in line or "!" in line or "?" in line) else 0
        n_sentences = max(1, n_sentences) if line else 0  # a line of citation markers only has none
        flags[i] = f
        word_counts[i] = min(n_words, C4_LINE_COUNT_MAX)
        sentence_counts[i] = min(n_sentences, C4_LINE_COUNT_MAX)

        terminal += bool(f & C4_END_PUNCT)
        javascript += bool(f & C4_JAVASCRIPT)
        policy += bool(f & C4_POLICY)
        # The page rules under the default settings, in datatrove's order (C4QualityFilter.filter):
        # too long a word, too few words, lorem ipsum, javascript, "{", policy, then sentences.
        if f & C4_TOO_LONG_WORD or n_words < C4_MIN_WORDS_PER_LINE:
            continue
        lorem += bool(f & C4_LOREM_IPSUM)
        if f & C4_JAVASCRIPT:
            continue
        curly += bool(f & C4_CURLY_BRACKET)
        if f & C4_POLICY:
            continue
        sentences += n_sentences
    return {
        "c4_terminal_punct_frac": terminal / nonempty if nonempty else 0.0,
        "c4_sentence_count": sentences,
        "c4_javascript_lines": javascript,
        "c4_policy_lines": policy,
        "c4_lorem_ipsum_lines": lorem,
        "c4_curly_bracket_lines": curly,
        "c4_lines": bytes(flags + word_counts + sentence_counts),
    }


# --------------------------------------------------------------------------------------------
# FineWeb (datatrove FineWebQualityFilter)

# FineWeb's stop characters, plus full-width CJK ones so Chinese/Japanese prose is not
# mistaken for a list of fragments.
FINEWEB_STOP_CHARS = (".", "'", '"', "!", "?", "。", "！", "？")
FINEWEB_SHORT_LINE_CHARS = 30
_LIST_MARKER = re.compile(r"^\s*(?:[-*•·▪●◦–—>]|\d{1,3}[.)]|[a-zA-Z][.)])\s")


def fineweb_signals(text: str, n_tokens: int) -> dict[str, float]:
    lines = text.split("\n")
    n_lines = len(lines)
    nonempty = [line for line in lines if line.strip()]
    chars_without_newlines = len(text) - text.count("\n")
    return {
        "line_punct_ratio": sum(line.endswith(FINEWEB_STOP_CHARS) for line in lines) / n_lines,
        "short_line_ratio": sum(len(line) <= FINEWEB_SHORT_LINE_CHARS for line in lines) / n_lines,
        "char_dup_ratio": (find_duplicates(nonempty)[1] / chars_without_newlines) if chars_without_newlines else 0.0,
        # FineWeb's "list_ratio": newlines per word (> 0.3 means list-like pages).
        "list_ratio": text.count("\n") / max(n_tokens, 1),
        # Share of non-empty lines that start with a bullet or an enumeration marker.
        "list_lines_frac": (sum(bool(_LIST_MARKER.match(line)) for line in nonempty) / len(nonempty)) if nonempty else 0.0,
    }


# --------------------------------------------------------------------------------------------
# Bad words

_BADWORD_TOKEN = re.compile(r"[^\W_]+|[^\w\s]")


class BadwordMatcher:
    """Counts whole-word (or whole-phrase) occurrences of list entries, case-insensitively.

    Text and entries are cut into the same tokens (letter/digit runs and single symbols), so
    "g-spot", "s&m", "2 girls 1 cup" and emoji entries match only as complete tokens: "ass"
    does not match inside "class".
    """

    def __init__(self, entries: Iterable[str]):
        by_first: dict[str, set[tuple[str, ...]]] = {}
        for entry in entries:
            tokens = tuple(_BADWORD_TOKEN.findall(entry.strip().lower()))
            if tokens:
                by_first.setdefault(tokens[0], set()).add(tokens)
        # Longest phrase first, so "2 girls 1 cup" is counted once, not also as "2".
        self._by_first = {k: sorted(v, key=len, reverse=True) for k, v in by_first.items()}
        self._first_tokens = frozenset(self._by_first)
        self._phrase_starts = frozenset(k for k, v in self._by_first.items() if any(len(p) > 1 for p in v))

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_first.values())

    def count(self, text: str) -> int:
        if not self._first_tokens:
            return 0
        tokens = _BADWORD_TOKEN.findall(text.lower())
        present = self._first_tokens.intersection(tokens)
        if not present:
            return 0
        if self._phrase_starts.isdisjoint(present):
            # Only single-token entries can match: plain counting, in C.
            counts = Counter(tokens)
            return sum(counts[token] for token in present)
        found = 0
        next_free = 0  # a matched phrase's tokens are not matched again
        for i in [i for i, token in enumerate(tokens) if token in present]:
            if i < next_free:
                continue
            for phrase in self._by_first[tokens[i]]:
                if len(phrase) == 1 or tuple(tokens[i : i + len(phrase)]) == phrase:
                    found += 1
                    next_free = i + len(phrase)
                    break
        return found


def read_wordlists(paths: Sequence[str]) -> list[str]:
    """Entries of one-entry-per-line files; blank lines and '#' comments skipped."""
    entries: list[str] = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                line = line.strip()
                if line and not line.startswith("#"):
                    entries.append(line)
    return entries


# --------------------------------------------------------------------------------------------
# URL blocklist


def _host_and_rest(url: str) -> tuple[str, str]:
    url = url.strip().strip("<>").strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    rest = parts.path or ""
    if parts.query:
        rest += "?" + parts.query
    return host, rest


class UrlBlocklist:
    """Entries are domains (block the host and its subdomains) or URL prefixes (with a path).

    Schemes are ignored; '#' starts a comment.
    """

    def __init__(self, entries: Iterable[str]):
        self.domains: set[str] = set()
        self.prefixes: list[str] = []
        for entry in entries:
            entry = entry.split("#", 1)[0].strip().lower()
            if not entry:
                continue
            host, rest = _host_and_rest(entry)
            if rest.strip("/"):
                self.prefixes.append(host + rest)
            elif host:
                self.domains.add(host)

    def __len__(self) -> int:
        return len(self.domains) + len(self.prefixes)

    def is_blocked(self, url: str | None) -> bool:
        if not url or not len(self):
            return False
        try:
            host, rest = _host_and_rest(url)
        except ValueError:
            return False
        labels = host.split(".")
        if any(".".join(labels[i:]) in self.domains for i in range(len(labels))):
            return True
        location = host + rest.lower()
        return any(location.startswith(prefix) for prefix in self.prefixes)


def read_url_blocklist(paths: Sequence[str]) -> list[str]:
    return read_wordlists(paths)


# --------------------------------------------------------------------------------------------
# PII

PII_KINDS = ("email", "card", "ip", "phone")  # redaction order: most specific first
PII_PLACEHOLDERS = {"email": "<EMAIL>", "phone": "<PHONE>", "ip": "<IP>", "card": "<CARD>"}

_EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9-]+\.)+[A-Za-z]{2,24}(?![\w-])")
_CARD = re.compile(r"(?<![\d-])[2-6](?:[ -]?\d){12,18}(?![\d-])")
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# A leading (?=...) lets the regex engine skip most positions cheaply.
_IPV4 = re.compile(rf"(?=\d)(?<![\d.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\.?\d)")
_PHONE = re.compile(
    r"(?=[\d+(])(?<![\w+])(?:"
    r"\+\d{1,3}[\s.-]?(?:\(\d{1,4}\)[\s.-]?)?\d{1,4}(?:[\s.-]?\d{2,4}){1,4}"  # international, +CC ...
    r"|(?:1[\s.-]?)?\(\d{3}\)[\s.-]?\d{3}[\s.-]?\d{4}"  # (206) 543-9196
    r"|(?:1[\s.-])?\d{3}[.-]\d{3}[.-]\d{4}"  # 206-543-9196
    r"|\(0\d{1,4}\)[\s-]?\d{3,4}[\s-]?\d{3,4}"  # (0512) 5511 1066
    r"|0\d{1,4}[\s-]\d{6,8}"  # 0512-55111066 (trunk prefix + area code)
    r"|1[3-9]\d{9}"  # Chinese mobile numbers
    r")(?!\w)"
)


def luhn_valid(digits: str) -> bool:
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = ord(char) - 48
        if position % 2:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def _card_digits_ok(match: re.Match) -> bool:
    digits = re.sub(r"\D", "", match.group(0))
    return 13 <= len(digits) <= 19 and luhn_valid(digits)


def _phone_digits_ok(match: re.Match) -> bool:
    return 7 <= sum(c.isdigit() for c in match.group(0)) <= 15


_PII_PATTERNS = {
    "email": (_EMAIL, None),
    "card": (_CARD, _card_digits_ok),
    "ip": (_IPV4, None),
    "phone": (_PHONE, _phone_digits_ok),
}
_HAS_DIGITS = re.compile(r"\d{3}")


def redact_pii(text: str) -> tuple[str, dict[str, int]]:
    """Replace e-mails, Luhn-valid card numbers, IPv4 addresses and phone numbers with typed
    placeholders; returns the new text and how many of each were replaced."""
    counts = dict.fromkeys(PII_KINDS, 0)
    if not text:
        return text, counts
    # Cheap pre-checks: every pattern needs an "@" or a run of digits.
    kinds = [k for k in PII_KINDS if (k == "email" and "@" in text) or (k != "email" and _HAS_DIGITS.search(text))]
    for kind in kinds:
        pattern, accept = _PII_PATTERNS[kind]
        placeholder = PII_PLACEHOLDERS[kind]

        def substitute(match: re.Match, accept=accept, kind=kind, placeholder=placeholder) -> str:
            if accept is not None and not accept(match):
                return match.group(0)
            counts[kind] += 1
            return placeholder

        text = pattern.sub(substitute, text)
    return text, counts


def pii_counts(text: str) -> dict[str, int]:
    return redact_pii(text)[1]


# --------------------------------------------------------------------------------------------
# All signals of one document


def text_signals(text: str | None, badwords: BadwordMatcher | None = None) -> dict[str, float]:
    """Every text-only signal of one document (no models, no URL), and its per-line `c4_lines`."""
    text = text or ""
    words = tokenize_words(text)
    signals: dict[str, float] = {"char_count": len(text), "line_count": len(text.splitlines())}
    signals.update(gopher_quality_signals(text, words))
    signals.update(gopher_repetition_signals(text, words))
    signals.update(c4_signals(text))
    signals.update(fineweb_signals(text, len(words)))
    bad = badwords.count(text) if badwords is not None else 0
    signals["badword_count"] = bad
    signals["badword_ratio"] = bad / signals["word_count"] if signals["word_count"] else float(bad > 0)
    counts = pii_counts(text)
    for kind in ("email", "phone", "ip", "card"):
        signals[f"pii_{kind}"] = counts[kind]
    return signals


# Output columns of compute_signals, in order, with their Spark SQL types.
SIGNAL_COLUMNS: list[tuple[str, str]] = (
    [("language", "string"), ("language_score", "double")]
    + [("char_count", "long"), ("line_count", "long")]
    + [
        ("word_count", "long"),
        ("mean_word_length", "double"),
        ("symbol_word_ratio", "double"),
        ("bullet_lines_frac", "double"),
        ("ellipsis_lines_frac", "double"),
        ("alpha_words_frac", "double"),
        ("stop_word_count", "long"),
    ]
    + [
        ("dup_line_frac", "double"),
        ("dup_para_frac", "double"),
        ("dup_line_char_frac", "double"),
        ("dup_para_char_frac", "double"),
    ]
    + [(f"top_{n}gram_char_frac", "double") for n in TOP_NGRAM_SIZES]
    + [(f"dup_{n}gram_char_frac", "double") for n in DUP_NGRAM_SIZES]
    + [
        ("c4_terminal_punct_frac", "double"),
        ("c4_sentence_count", "long"),
        ("c4_javascript_lines", "long"),
        ("c4_policy_lines", "long"),
        ("c4_lorem_ipsum_lines", "long"),
        ("c4_curly_bracket_lines", "long"),
    ]
    + [
        ("line_punct_ratio", "double"),
        ("short_line_ratio", "double"),
        ("char_dup_ratio", "double"),
        ("list_ratio", "double"),
        ("list_lines_frac", "double"),
    ]
    + [("badword_count", "long"), ("badword_ratio", "double"), ("url_blocklisted", "boolean")]
    + [("classifier_score", "double")]
    + [("pii_email", "long"), ("pii_phone", "long"), ("pii_ip", "long"), ("pii_card", "long")]
)
SIGNAL_NAMES = [name for name, _ in SIGNAL_COLUMNS]
# Signals that need a model or the URL; all others come from text_signals.
_CONTEXT_SIGNALS = {"language", "language_score", "url_blocklisted", "classifier_score"}
TEXT_SIGNAL_NAMES = [name for name in SIGNAL_NAMES if name not in _CONTEXT_SIGNALS]
# Per-line facts, not one number per document: what filtered needs to remove lines (c4_signals).
LINE_SIGNAL_COLUMNS: list[tuple[str, str]] = [("c4_lines", "binary")]
LINE_SIGNAL_NAMES = [name for name, _ in LINE_SIGNAL_COLUMNS]


def signals_ddl(with_minhash: bool = True) -> str:
    columns = [("doc_id", "string"), *SIGNAL_COLUMNS, *LINE_SIGNAL_COLUMNS]
    if with_minhash:
        columns.append(("minhash", "binary"))
    return ", ".join(f"{name} {kind}" for name, kind in columns)


# --------------------------------------------------------------------------------------------
# Batches


@dataclass(frozen=True)
class SignalResources:
    """What a worker needs to compute signals; small enough to ship in a Spark closure.

    Models travel as paths (each worker loads them once); word lists and the URL blocklist
    travel as their entries, so executors need no access to the driver's files.
    """

    lid_model_path: str
    classifier_model_path: str | None = None
    badwords: tuple[str, ...] = ()
    url_blocklist: tuple[str, ...] = ()
    num_perm: int = 112
    ngram: int = 5
    minhash_seed: int = 1
    with_minhash: bool = True

    @classmethod
    def from_config(
        cls,
        *,
        lid_model_path: str,
        classifier_model_path: str | None = None,
        badword_paths: Sequence[str] = (),
        url_blocklist: Sequence[str] = (),
        num_perm: int = 112,
        ngram: int = 5,
        minhash_seed: int = 1,
        with_minhash: bool = True,
    ) -> "SignalResources":
        return cls(
            lid_model_path=lid_model_path,
            classifier_model_path=classifier_model_path,
            badwords=tuple(read_wordlists(badword_paths)),
            url_blocklist=tuple(url_blocklist),
            num_perm=num_perm,
            ngram=ngram,
            minhash_seed=minhash_seed,
            with_minhash=with_minhash,
        )


_MATCHER_CACHE: dict[tuple, tuple[BadwordMatcher, UrlBlocklist]] = {}
_MATCHER_LOCK = threading.Lock()


def _matchers(resources: SignalResources) -> tuple[BadwordMatcher, UrlBlocklist]:
    key = (resources.badwords, resources.url_blocklist)
    cached = _MATCHER_CACHE.get(key)
    if cached is None:
        with _MATCHER_LOCK:
            if len(_MATCHER_CACHE) > 8:  # word lists change rarely; don't grow without bound
                _MATCHER_CACHE.clear()
            cached = _MATCHER_CACHE[key] = (BadwordMatcher(resources.badwords), UrlBlocklist(resources.url_blocklist))
    return cached


def _minhash_bytes(texts: list[str], resources: SignalResources) -> list[bytes]:
    try:
        from engine.minhash import compute_signatures
    except ImportError as exc:  # written by the dedup stage; say so instead of a bare ImportError
        raise ImportError("engine.minhash.compute_signatures is needed for the minhash column") from exc
    if not texts:
        return []
    signatures = compute_signatures(texts, num_perm=resources.num_perm, ngram=resources.ngram, seed=resources.minhash_seed)
    signatures = np.ascontiguousarray(signatures, dtype="<u4")
    return [row.tobytes() for row in signatures]


def signals_for_batch(pdf: pd.DataFrame, resources: SignalResources) -> pd.DataFrame:
    """Signals of one batch of documents (columns doc_id, text, and url if present)."""
    from engine.langid import LanguageIdentifier

    texts = [t if isinstance(t, str) else "" for t in pdf["text"].tolist()]
    urls = pdf["url"].tolist() if "url" in pdf.columns else [None] * len(texts)
    badwords, blocklist = _matchers(resources)

    rows = [text_signals(text, badwords) for text in texts]
    out = pd.DataFrame.from_records(rows, columns=[*TEXT_SIGNAL_NAMES, *LINE_SIGNAL_NAMES])
    out.insert(0, "doc_id", pdf["doc_id"].astype(str).to_numpy())

    languages, scores = LanguageIdentifier(resources.lid_model_path).predict(texts)
    out["language"] = languages
    out["language_score"] = scores
    out["url_blocklisted"] = [blocklist.is_blocked(u) for u in urls]
    if resources.classifier_model_path:
        from engine.classifier import score as classifier_score

        out["classifier_score"] = classifier_score(texts, resources.classifier_model_path)
    else:
        out["classifier_score"] = np.nan

    types = dict(SIGNAL_COLUMNS)
    for name in SIGNAL_NAMES:
        if types[name] == "long":
            out[name] = out[name].astype("int64")
        elif types[name] == "double":
            out[name] = out[name].astype("float64")
        elif types[name] == "boolean":
            out[name] = out[name].astype("bool")
    columns = ["doc_id", *SIGNAL_NAMES, *LINE_SIGNAL_NAMES]
    if resources.with_minhash:
        out["minhash"] = _minhash_bytes(texts, resources)
        columns.append("minhash")
    return out[columns]


def compute_signals_pandas(
    pdf: pd.DataFrame,
    *,
    lid_model_path: str,
    classifier_model_path: str | None = None,
    badword_paths: Sequence[str] = (),
    url_blocklist: Sequence[str] = (),
    num_perm: int = 112,
    ngram: int = 5,
    minhash_seed: int = 1,
    with_minhash: bool = True,
) -> pd.DataFrame:
    """compute_signals without Spark: one pandas frame in (doc_id, text[, url]), signals out."""
    resources = SignalResources.from_config(
        lid_model_path=lid_model_path,
        classifier_model_path=classifier_model_path,
        badword_paths=badword_paths,
        url_blocklist=url_blocklist,
        num_perm=num_perm,
        ngram=ngram,
        minhash_seed=minhash_seed,
        with_minhash=with_minhash,
    )
    return signals_for_batch(pdf, resources)


def compute_signals(
    spark,
    documents_df,
    *,
    lid_model_path: str,
    classifier_model_path: str | None,
    badword_paths: list[str],
    url_blocklist: list[str],
    num_perm: int = 112,
    ngram: int = 5,
    minhash_seed: int = 1,
    with_minhash: bool = True,
):
    """quality_signals for a documents DataFrame: doc_id, one column per signal, c4_lines, minhash.

    Runs `signals_for_batch` on Arrow batches with mapInPandas; models are loaded once per
    Python worker (module-level caches keyed by path), never per row or per batch.
    Model paths must be readable on every executor.
    """
    for path in (lid_model_path, classifier_model_path):
        if path and not os.path.isfile(path):
            raise FileNotFoundError(f"model not found: {path}")
    resources = SignalResources.from_config(
        lid_model_path=lid_model_path,
        classifier_model_path=classifier_model_path,
        badword_paths=badword_paths,
        url_blocklist=url_blocklist,
        num_perm=num_perm,
        ngram=ngram,
        minhash_seed=minhash_seed,
        with_minhash=with_minhash,
    )
    columns = ["doc_id", "text"] + (["url"] if "url" in documents_df.columns else [])

    def run(batches: Iterator[pd.DataFrame]) -> Iterator[pd.DataFrame]:
        for batch in batches:
            yield signals_for_batch(batch, resources)

    return documents_df.select(*columns).mapInPandas(run, signals_ddl(with_minhash))
