"""Kiln's main-text extractor: resiliparse plus boilerplate rules, trafilatura when unsure.

Why not just one library: on the Scrapinghub article benchmark (181 pages, token F1, CPU time;
tests/benchmarks/bench_extraction.py) resiliparse's main-content mode takes 2.5 ms a page but
keeps captions, headlines, newsletter boxes and widget text (F1 0.915, precision 0.87);
trafilatura is precise (F1 0.958) but takes 29 ms. Kiln keeps resiliparse's C parser and
extractor and adds three cheap steps, for F1 0.964 at 4 ms a page:

1. Element rules (`SKIP_SELECTORS`): CSS selectors for containers that are boilerplate on any
   site (captions, share bars, newsletter and cookie boxes, related-story widgets, headers and
   footers, the page's <h1> headline). They are handed to resiliparse, which skips the matched
   subtrees while it walks the DOM, so they cost one selector match per element (in C).
   Class names are matched as substrings (`share` catches `share-bar`, `sharing`), so every
   rule carries a guard: never the page skeleton (html/body/main/article), never an element
   that holds the headline or a run of four paragraphs (the article itself, whatever its
   wrapper happens to be called).
2. Line rules (`clean_lines`): drop lines that are a UI label alone ("Advertisement",
   "Share", "Read more"), short copyright notices, and label-like fragments (a few words, no
   sentence punctuation) at the very start or end of the text, where bylines, dates and menus
   survive; the same fragments in the middle are subheadings and stay.
3. Fallback: when the fast path finds almost no text on a page that has plenty of it (the
   main-content heuristics or a rule misfired), trafilatura extracts that page instead. It is
   a safety net, not a quality lever: sending more pages to trafilatura by a confidence score
   (main/visible text ratio, text length) bought at most +0.0004 F1 on the benchmark, for 9%
   of the pages at 7x their cost, and lost F1 at other thresholds. About 1-2% of the pages in
   the shared WARC files take the fallback, none of the benchmark's articles.

Changing a rule changes the `documents` output: bump STAGE_CODE_VERSIONS["documents"] in
workflows/config.py with it, so Dagster sees the stage as changed.

Deliberately not done: dropping repeated lines inside a page (interviews repeat their
questions, lists repeat labels; the dedup stage handles repeats across pages), and
link-density rules (resiliparse's main-content mode already drops link lists).
"""
from __future__ import annotations

import re

# --- 1. element rules ---------------------------------------------------------------------------

# Boilerplate vocabulary, matched case-insensitively as a substring of the class attribute
# (a few also of the id). Grouped by what they remove.
_BOILERPLATE_CLASS_WORDS = (
    "caption", "credit", "gallery",  # figure captions, photo credits, slideshows
    "widget", "promo", "advert", "sponsor",  # sidebar widgets, ads, promoted links
    "share", "social",  # share bars, follow-us boxes
    "related", "recommend", "popular",  # "related stories", "most popular" teasers
    "newsletter", "subscribe", "signup",  # sign-up boxes
    "cookie", "consent",  # cookie and GDPR banners
    "breadcrumb", "author", "byline",  # navigation trail, author boxes and bylines
    "modal", "popup",  # overlays
    "header", "footer",  # page and article headers (title, date) and footers
)
_BOILERPLATE_ID_WORDS = ("related", "cookie")

# What a rule may never remove: the page skeleton, any subheading (a class like
# "section-header" on an <h2>), and any element holding the headline or a run of four
# paragraphs, which is the article whatever its wrapper is called.
_GUARD = ":not(html,body,main,article,h2,h3,h4,h5,h6):not(:has(h1,p+p+p+p))"


def _skip_selectors() -> list[str]:
    rules = [f"[class*={word} i]" for word in _BOILERPLATE_CLASS_WORDS]
    rules += [f"[id*={word} i]" for word in _BOILERPLATE_ID_WORDS]
    rules += ["header", "figcaption"]
    # The headline is metadata, not body text (trafilatura and FineWeb drop it too). An <h1>
    # left open by broken markup can swallow the page: keep those.
    headline = "h1:not(:has(p+p))"
    # One selector list: resiliparse matches it once per element.
    return [",".join([*(rule + _GUARD for rule in rules), headline])]


SKIP_SELECTORS = _skip_selectors()

# --- 2. line rules ------------------------------------------------------------------------------

# A whole line that is only a UI label. Anchored at both ends: a sentence that merely
# mentions "cookies" or "comments" is never matched.
_UI_LABEL_LINE = re.compile(
    r"^\W*(?:advertisements?|advert|ad|sponsored(?: content)?|"
    r"share(?: this)?(?: (?:article|story|post|page))?(?: on \w+)?|tweet|e-?mail|print|"
    r"\d* ?comments?|leave a (?:comment|reply)|related(?: (?:articles|stories|posts|content|news))?|"
    r"tags?|topics|filed under|menu|close|loading(?: comments)?(?:\W+)?|skip to (?:main )?content|"
    r"read more|continue reading(?: below)?|see more|show more|subscribe(?: now)?|sign up|log ?in|"
    r"sign in|cookie settings|accept(?: all)?(?: cookies)?|back to top|top stories|more stories|"
    r"you may also like|recommended(?: for you)?|most (?:read|popular)|trending(?: now)?|follow us)\W*$",
    re.I,
)
# A notice, not prose about copyright: the sign, "Copyright 2019" / "Copyright (c)", or the formula.
_COPYRIGHT = re.compile(r"©|\bcopyright\s*(?:\(c\)|\d{4})|\ball rights reserved\b", re.I)
_SENTENCE_END = re.compile(r"[.!?…:;\"'”’»)\]。！？]\s*$")
_WORD = re.compile(r"\w+")
_MAX_COPYRIGHT_WORDS = 20  # a long paragraph mentioning copyright is content, not a notice
_MAX_NOTICE_CHARS = 200  # no UI label or notice of under 20 words is longer
_MAX_EDGE_FRAGMENT_WORDS = 4
_MAX_EDGE_FRAGMENT_CHARS = 40  # also bounds unspaced scripts (CJK), where a line is one "word"


def _is_edge_fragment(line: str) -> bool:
    """A few words without sentence punctuation: a byline, date, tag list or menu item."""
    return (len(line) <= _MAX_EDGE_FRAGMENT_CHARS and len(_WORD.findall(line)) <= _MAX_EDGE_FRAGMENT_WORDS
            and not _SENTENCE_END.search(line))


def clean_lines(text: str) -> str:
    """Drop UI-label lines, short copyright notices and label-like fragments at both ends."""
    lines = []
    for line in text.splitlines():
        line = line.replace("\ufeff", "").strip()
        if not line:
            continue
        # Paragraphs are long; only short lines can be labels or notices (skip the regexes).
        if len(line) <= _MAX_NOTICE_CHARS and (
            _UI_LABEL_LINE.match(line)
            or (_COPYRIGHT.search(line) and len(_WORD.findall(line)) < _MAX_COPYRIGHT_WORDS)
        ):
            continue
        lines.append(line)
    start, end = 0, len(lines)
    while start < end and _is_edge_fragment(lines[start]):
        start += 1
    while end > start and _is_edge_fragment(lines[end - 1]):
        end -= 1
    return "\n".join(lines[start:end])


# --- 3. extraction with fallback ----------------------------------------------------------------

# Unsure = the fast path kept under FALLBACK_MAX_CHARS characters although the page shows at
# least FALLBACK_MIN_PAGE_CHARS characters of text: its main content was probably missed.
FALLBACK_MAX_CHARS = 200
FALLBACK_MIN_PAGE_CHARS = 2000


def fast_main_text(tree) -> str:
    """Resiliparse main-content text with Kiln's element rules, then its line rules."""
    from resiliparse.extract.html2text import extract_plain_text

    text = extract_plain_text(
        tree, main_content=True, alt_texts=False, links=False, form_fields=False,
        comments=False, post_meta=False, skip_elements=SKIP_SELECTORS,
    )
    return clean_lines(text)


def is_unsure(text: str, tree) -> bool:
    """Whether the fast path's `text` probably missed the main content of the page `tree`."""
    if len(text) >= FALLBACK_MAX_CHARS:
        return False
    from resiliparse.extract.html2text import extract_plain_text

    # Only for the rare short result: all visible text (no scripts, styles or markup).
    return len(extract_plain_text(tree, alt_texts=False)) >= FALLBACK_MIN_PAGE_CHARS


def extract_kiln(html: str, fallback: bool = True) -> str:
    """Main text of one HTML page, one paragraph per line."""
    from resiliparse.parse.html import HTMLTree

    tree = HTMLTree.parse(html)
    text = fast_main_text(tree)
    if fallback and is_unsure(text, tree):
        import trafilatura

        rescued = clean_lines(trafilatura.extract(html, include_comments=False) or "")
        if len(rescued) > len(text):
            return rescued
    return text


# --- scoring (tests and tests/benchmarks/bench_extraction.py) -----------------------------------

def token_prf(reference: str, candidate: str) -> tuple[float, float, float]:
    """Token-level (precision, recall, F1) of `candidate` against `reference`: lower-cased
    `\\w+` tokens compared as multisets, so order and whitespace do not count but repeats do."""
    from collections import Counter

    ref = Counter(_WORD.findall(reference.lower()))
    cand = Counter(_WORD.findall(candidate.lower()))
    overlap = sum((ref & cand).values())
    precision = overlap / max(sum(cand.values()), 1)
    recall = overlap / max(sum(ref.values()), 1)
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1
