"""The bundled sample crawl: a small WARC set with labelled page kinds, built offline.

`generate_sample_crawl` writes `sample-00000.warc.gz ...` (one gzip member per record, WARC/1.0)
and `labels.json` (url -> {"kind", "lang", "dup_of", "bucket", "charset"}). The bytes depend only
on the arguments (and the Python version, which ships the reference text): dates and record ids
derive from the seed, never from the clock or uuid4.

What it holds, so the pipeline's filters have something real to catch:
- good English prose on blog/news domains (bucket `web`) and reference pages made from the
  Python manual in `pydoc_data` on `docs.reference.test` (bucket `reference`);
- German, French, Spanish, Russian and Chinese prose (some in windows-1251 / GBK / ISO-8859-1);
- navigation/boilerplate pages, keyword-spam pages, exact duplicates (same body, other URL) and
  near duplicates (small edits, word-5-gram Jaccard >= 0.8 with their original);
- a PDF and a PNG response, a 404 and a 301, a revisit record, a response with a garbled HTTP
  head and a truncated final record; request records precede responses, a warcinfo heads each
  file; one page is gzip Content-Encoded and one chunked.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import html
import json
import os
import random
import re
import struct
import uuid
import zlib
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

SAMPLE_DOMAIN_BUCKETS = {"docs.reference.test": "reference"}
KINDS = ("good", "boilerplate", "spam", "exact_dup", "near_dup", "non_html", "non_200", "revisit", "malformed")
MIN_PAGES = 24  # one page of every kind and language, plus a few plain web pages
MAX_PAGES = 500  # the hand-written pools and the manual run out of distinct text beyond this

# Records that exist once whatever the size; everything else scales with num_pages.
_FIXED_KINDS = {"non_html": 2, "non_200": 2, "revisit": 1, "malformed": 2}
_SHARES = {
    "reference": 0.13, "boilerplate": 0.07, "spam": 0.07, "exact_dup": 0.05, "near_dup": 0.05,
    "de": 0.057, "fr": 0.057, "es": 0.057, "ru": 0.057, "zh": 0.057,
}
_DISTINCT_MAX_JACCARD = 0.5  # pages not labelled as duplicates stay far below near-dup range
_NEAR_DUP_MIN_JACCARD = 0.8
_USER_AGENT = "KilnSampleBot/1.0 (+https://kiln.example/bot)"


@dataclass
class Page:
    url: str
    kind: str
    lang: str | None
    bucket: str
    body: bytes = b""
    charset: str | None = "utf-8"
    content_type: str = "text/html"
    status: int = 200
    http_charset: bool = True  # declare the charset in the HTTP Content-Type
    extra_headers: list[tuple[str, str]] = field(default_factory=list)
    dup_of: str | None = None
    record: str = "response"  # response | revisit | garbled_http | truncated
    text: str = ""  # the main text as generated, for duplicate checks


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------

def _rng(seed: int, stream: str) -> random.Random:
    """Independent deterministic stream per component (str seeds hash via SHA-512)."""
    return random.Random(f"kiln-sample:{seed}:{stream}")


def _shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i:i + n]) for i in range(max(len(words) - n + 1, 1))}


def _set_jaccard(sa: set, sb: set) -> float:
    return len(sa & sb) / max(len(sa | sb), 1)


def jaccard(a: str, b: str) -> float:
    """Word-5-gram Jaccard similarity, the measure the duplicate labels are defined by."""
    return _set_jaccard(_shingles(a), _shingles(b))


def _is_distinct(text: str, existing: list[set]) -> bool:
    """True (and `text` remembered) when it is no near duplicate of anything in `existing`."""
    shingles = _shingles(text)
    if any(_set_jaccard(shingles, other) > _DISTINCT_MAX_JACCARD for other in existing):
        return False
    existing.append(shingles)
    return True


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60] or "page"


def _bucket(url: str) -> str:
    host = url.split("/")[2]
    for suffix, bucket in SAMPLE_DOMAIN_BUCKETS.items():
        if host == suffix or host.endswith("." + suffix):
            return bucket
    return "web"


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _paragraphs(rng: random.Random, sentences: list[str], low: int = 3, high: int = 5, joiner: str = " ") -> list[str]:
    paras, i = [], 0
    while i < len(sentences):
        size = rng.randint(low, high)
        paras.append(joiner.join(sentences[i:i + size]))
        i += size
    return paras


def _pick_distinct(make, existing: list[set], tries: int = 60) -> tuple:
    """Call `make()` until its text (last item) is no near duplicate of an earlier page."""
    for _ in range(tries):
        candidate = make()
        if _is_distinct(candidate[-1], existing):
            return candidate
    raise RuntimeError("sample crawl: text pool too small to keep pages distinct")


# ---------------------------------------------------------------------------------------------
# HTML templates
# ---------------------------------------------------------------------------------------------

def _html_page(*, lang: str, title: str, site: str, nav: list[str], body_html: str, footer: str,
               aside: list[str] = (), meta_charset: str | None = "utf-8", extra_head: str = "") -> str:
    meta = f'<meta charset="{meta_charset}">\n' if meta_charset else ""
    nav_html = "".join(f'<li><a href="/{_slug(item)}/">{_esc(item)}</a></li>' for item in nav)
    aside_html = ""
    if aside:
        links = "".join(f'<li><a href="/{_slug(item)}.html">{_esc(item)}</a></li>' for item in aside)
        aside_html = f'<aside class="related"><h3>Related</h3><ul>{links}</ul></aside>\n'
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="{lang}">\n<head>\n{meta}<title>{_esc(title)} | {_esc(site)}</title>\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<link rel="stylesheet" href="/static/site.css">\n{extra_head}</head>\n<body>\n'
        f'<header class="site-header"><a class="brand" href="/">{_esc(site)}</a>\n'
        f'<nav><ul>{nav_html}</ul></nav></header>\n'
        f"<main>\n{body_html}\n</main>\n{aside_html}"
        f'<footer class="site-footer"><p>{footer}</p>'
        '<p><a href="/privacy/">Privacy</a> | <a href="/terms/">Terms</a> | <a href="/feed.xml">RSS</a></p></footer>\n'
        "</body>\n</html>\n"
    )


def _article(title: str, byline: str, paragraphs: list[str]) -> str:
    paras = "\n".join(f"<p>{_esc(p)}</p>" for p in paragraphs)
    return f'<article>\n<h1>{_esc(title)}</h1>\n<p class="byline">{_esc(byline)}</p>\n{paras}\n</article>'


# ---------------------------------------------------------------------------------------------
# Page builders, one per kind
# ---------------------------------------------------------------------------------------------

def _english_pages(seed: int, n: int) -> list[Page]:
    rng = _rng(seed, "english")
    pages: list[Page] = []
    texts_by_topic: dict[str, list[set]] = {}
    for i in range(n):
        topic = ENGLISH_TOPICS[i % len(ENGLISH_TOPICS)]
        domain, site, authors, titles, pool = topic

        def make():
            picked = rng.sample(pool, rng.randint(12, 16))
            while sum(len(s.split()) for s in picked) < 200:
                picked.append(rng.choice([s for s in pool if s not in picked]))
            paras = _paragraphs(rng, picked)
            title = rng.choice(titles)
            return title, paras, title + "\n" + "\n".join(paras)

        title, paras, _ = _pick_distinct(make, texts_by_topic.setdefault(domain, []))
        day = datetime(2023, 1, 1) + timedelta(days=rng.randrange(420))
        url = f"https://{domain}/{day:%Y/%m}/{_slug(title)}-{i:03d}.html"
        others = [t for t in titles if t != title]
        byline = f"By {rng.choice(authors)} on {day:%B %d, %Y}"
        text = "\n".join([title, byline, *paras])  # what main-content extraction should return
        doc = _html_page(
            lang="en", title=title, site=site, nav=["Home", "Archive", "About", "Contact"],
            body_html=_article(title, byline, paras),
            footer=f"&copy; {day.year} {_esc(site)}. All rights reserved.",
            aside=rng.sample(others, 3),
        )
        pages.append(Page(url=url, kind="good", lang="en", bucket=_bucket(url), body=doc.encode("utf-8"), text=text))
    return pages


def _pydoc_chunks() -> list[tuple[str, int, str, list[tuple[str, str]]]]:
    """Split the manual's topics into (topic, part, title, blocks) of roughly 200-600 words."""
    from pydoc_data.topics import topics

    chunks = []
    for name in sorted(topics):
        blocks: list[tuple[str, str]] = []
        title = name
        for raw in re.split(r"\n\s*\n", topics[name]):
            lines = raw.rstrip().split("\n")
            if not raw.strip():
                continue
            if len(lines) >= 2 and re.fullmatch(r"[*=\-]{3,}", lines[-1].strip()):
                heading = " ".join(line.strip() for line in lines[:-1])
                title = heading if not blocks else title
                blocks.append(("h2", heading))
            elif all(line.startswith("   ") for line in lines if line.strip()):
                if lines[0].strip().startswith("+-"):
                    continue  # ASCII grid tables read as noise once flattened to text
                blocks.append(("pre", "\n".join(line[3:] for line in lines)))
            else:
                blocks.append(("p", " ".join(line.strip() for line in lines)))
        part, current, words = 1, [], 0
        for block in blocks:
            size = len(block[1].split())
            if current and words + size > 600:
                if words >= 200:
                    chunks.append((name, part, title, current))
                    part += 1
                current, words = [], 0
            current.append(block)
            words += size
        if words >= 200:
            chunks.append((name, part, title, current))
    return chunks


def _reference_pages(seed: int, n: int) -> list[Page]:
    rng = _rng(seed, "reference")
    chunks = _pydoc_chunks()
    # Several manual topics repeat each other's sections, so keep only mutually distinct chunks.
    order = rng.sample(range(len(chunks)), len(chunks))
    picked, seen = [], []
    for index in order:
        if _is_distinct("\n".join(content for _, content in chunks[index][3]), seen):
            picked.append(index)
        if len(picked) == n:
            break
    if len(picked) < n:
        raise ValueError(f"only {len(picked)} distinct reference chunks available, {n} requested")
    toc = sorted({name for name, *_ in chunks})
    pages = []
    for index in sorted(picked):
        name, part, title, blocks = chunks[index]
        body = []
        for tag, content in blocks:
            if tag == "pre":
                body.append(f"<pre><code>{_esc(content)}</code></pre>")
            else:
                body.append(f"<{tag}>{_esc(content)}</{tag}>")
        page_title = title if part == 1 else f"{title} (part {part})"
        crumbs = '<p class="breadcrumb"><a href="/">Docs</a> &raquo; <a href="/reference/">Language reference</a></p>'
        doc = _html_page(
            lang="en", title=page_title, site="Reference Manual", nav=["Docs", "Reference", "Library", "Glossary", "Search"],
            body_html=f'{crumbs}\n<div class="document" role="main">\n<h1>{_esc(page_title)}</h1>\n' + "\n".join(body) + "\n</div>",
            footer="&copy; The Reference Project contributors. Built from the Python manual.",
            aside=rng.sample(toc, 6),
        )
        suffix = "" if part == 1 else f"-{part}"
        url = f"https://docs.reference.test/reference/{name}{suffix}.html"
        text = "\n".join(content for _, content in blocks)
        pages.append(Page(url=url, kind="good", lang="en", bucket=_bucket(url), body=doc.encode("utf-8"), text=text))
    return pages


def _foreign_pages(seed: int, lang: str, n: int) -> list[Page]:
    rng = _rng(seed, f"lang-{lang}")
    spec = FOREIGN[lang]
    pages: list[Page] = []
    seen: list[set] = []
    joiner = "" if lang == "zh" else " "
    for i in range(n):
        def make():
            picked = rng.sample(spec["pool"], rng.randint(9, 13))
            paras = _paragraphs(rng, picked, 3, 4, joiner)
            title = rng.choice(spec["titles"])
            # Chinese has no spaces: compare character 5-grams instead of word 5-grams.
            compare = " ".join(picked) if lang != "zh" else " ".join("".join(picked))
            return title, paras, compare

        title, paras, _ = _pick_distinct(make, seen)
        domain = spec["domains"][i % len(spec["domains"])]
        url = f"https://{domain}/{spec['section']}/{i:03d}-{hashlib.sha1(title.encode()).hexdigest()[:8]}.html"
        # Legacy charsets the way real sites serve them: in the header and/or only in <meta>.
        charset, http_charset = "utf-8", True
        if spec.get("legacy") and i % 3 == 0:
            charset = spec["legacy"]
            http_charset = i % 2 == 0
        if lang == "de" and i == 1:
            charset, http_charset = "iso-8859-1", True
        doc = _html_page(
            lang=lang, title=title, site=spec["site"], nav=spec["nav"],
            body_html=_article(title, spec["byline"], paras), footer=spec["footer"],
            meta_charset=charset,
        )
        pages.append(Page(url=url, kind="good", lang=lang, bucket=_bucket(url), body=doc.encode(charset),
                          charset=charset, http_charset=http_charset, text="\n".join([title, *paras])))
    return pages


def _spam_pages(seed: int, n: int) -> list[Page]:
    rng = _rng(seed, "spam")
    pages, seen = [], []
    for i in range(n):
        def make():
            phrases = rng.sample(SPAM_PHRASES, 4)
            if i % 3 == 0:
                phrases[-1] = rng.choice(SPAM_ADULT)
            lines = []
            for _ in range(rng.randint(6, 10)):
                line = " ".join(rng.choice(phrases) for _ in range(rng.randint(3, 6)))
                lines.append(line + rng.choice(["!!!", "!", " >>>", " $$$", ""]))
            title = " | ".join(p.title() for p in phrases[:3])
            return title, phrases, lines, title + "\n" + "\n".join(lines)

        title, phrases, lines, text = _pick_distinct(make, seen)
        domain = SPAM_DOMAINS[i % len(SPAM_DOMAINS)]
        links = "".join(f'<li><a href="/go/{_slug(p)}-{k}">{_esc(p)}</a></li>' for k, p in enumerate(phrases * 3))
        body = (f"<h1>{_esc(title)}</h1>\n" + "\n".join(f"<p><b>{_esc(line)}</b></p>" for line in lines)
                + f'\n<ul class="links">{links}</ul>\n<p>{_esc(rng.choice(SPAM_CTA))}</p>')
        keywords = ", ".join(phrases)
        doc = _html_page(lang="en", title=title, site=domain, nav=phrases, body_html=body,
                         footer=_esc(keywords), extra_head=f'<meta name="keywords" content="{_esc(keywords)}">\n')
        url = f"http://{domain}/{_slug(phrases[0])}-{i:03d}.html"
        pages.append(Page(url=url, kind="spam", lang="en", bucket=_bucket(url), body=doc.encode("utf-8"), text=text))
    return pages


def _boilerplate_pages(seed: int, n: int) -> list[Page]:
    rng = _rng(seed, "boilerplate")
    pages, seen = [], []
    for i in range(n):
        def make():
            menu = rng.sample(BOILERPLATE_MENU, 8)
            lines = [rng.choice(BOILERPLATE_COOKIES)] + rng.sample(BOILERPLATE_LINES, 6)
            cats = [f"{c} ({rng.randint(1, 99)})" for c in rng.sample(BOILERPLATE_CATEGORIES, 6)]
            return menu, lines, cats, "\n".join(menu + lines + cats)

        menu, lines, cats, text = _pick_distinct(make, seen)
        domain = BOILERPLATE_DOMAINS[i % len(BOILERPLATE_DOMAINS)]
        body = (
            '<div class="cookie-banner"><p>' + _esc(lines[0]) + '</p><button>Accept</button> <button>Decline</button></div>\n'
            + '<p class="toolbar">Home | About | Contact | Login | Register</p>\n'
            + '<ul class="categories">' + "".join(f'<li><a href="/c/{_slug(c)}">{_esc(c)}</a></li>' for c in cats) + "</ul>\n"
            + "".join(f"<div class=\"widget\">{_esc(line)}</div>\n" for line in lines[1:])
        )
        doc = _html_page(lang="en", title=menu[0], site=domain, nav=menu, body_html=body,
                         footer=f"&copy; 2024 {_esc(domain)} | Sitemap | Imprint | Careers | Press")
        url = f"https://{domain}/{_slug(menu[0])}/index-{i:03d}.html"
        pages.append(Page(url=url, kind="boilerplate", lang="en", bucket=_bucket(url), body=doc.encode("utf-8"), text=text))
    return pages


def _exact_dups(originals: list[Page]) -> list[Page]:
    """Same body bytes on another URL (a tracking parameter or a mirror host)."""
    dups = []
    for k, orig in enumerate(originals):
        if k % 2 == 0:
            url = orig.url + "?utm_source=newsletter&utm_medium=email"
        else:
            url = "https://mirror.example.net/" + orig.url.split("/", 3)[3]
        dups.append(Page(url=url, kind="exact_dup", lang=orig.lang, bucket=_bucket(url), body=orig.body,
                         charset=orig.charset, http_charset=orig.http_charset, dup_of=orig.url, text=orig.text))
    return dups


def _near_dups(seed: int, originals: list[Page]) -> list[Page]:
    """A syndicated copy: other site chrome, one sentence swapped or dropped, a word or two added."""
    rng = _rng(seed, "near_dup")
    by_domain = {topic[0]: topic for topic in ENGLISH_TOPICS}
    dups = []
    for k, orig in enumerate(originals):
        domain = orig.url.split("/")[2]
        site, pool = by_domain[domain][1], by_domain[domain][4]
        title, byline, paras = _article_parts(orig)
        for _ in range(40):
            edited = [p for p in paras]
            target = rng.randrange(len(edited))
            sentences = re.split(r"(?<=[.!?])\s+", edited[target])
            fresh = [s for s in pool if s not in orig.text]
            if rng.random() < 0.5 and fresh:
                sentences[rng.randrange(len(sentences))] = rng.choice(fresh)
            elif len(sentences) > 1:
                del sentences[rng.randrange(len(sentences))]
            words = sentences[0].split(" ")
            words.insert(rng.randrange(1, len(words)), rng.choice(NEAR_DUP_INSERTS))
            sentences[0] = " ".join(words)
            edited[target] = " ".join(sentences)
            text = "\n".join([title, byline, *edited])
            # A margin over the floor: extraction may keep a stray line of either page's chrome.
            if jaccard(text, orig.text) >= _NEAR_DUP_MIN_JACCARD + 0.03:
                break
        else:
            raise RuntimeError("could not make a near duplicate above the Jaccard floor")
        host = NEAR_DUP_DOMAINS[k % len(NEAR_DUP_DOMAINS)]
        url = f"https://{host}/syndicated/{_slug(title)}-{k:03d}.html"
        doc = _html_page(
            lang="en", title=title, site=host, nav=["Front page", "Topics", "Newsletter", "Subscribe"],
            body_html=_article(title, byline, edited),
            footer=f"Originally published by {_esc(site)}. Republished with permission.",
        )
        dups.append(Page(url=url, kind="near_dup", lang="en", bucket=_bucket(url), body=doc.encode("utf-8"),
                         dup_of=orig.url, text=text))
    return dups


def _article_parts(page: Page) -> tuple[str, str, list[str]]:
    lines = page.text.split("\n")
    return lines[0], lines[1], lines[2:]


def _tiny_pdf() -> bytes:
    stream = b"BT /F1 18 Tf 72 720 Td (Annual report 2023) Tj ET"
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, obj in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + obj + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % off for off in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def _tiny_png() -> bytes:
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    # 8x8 RGB: each scanline is a filter byte plus 8 pixels.
    rows = b"".join(b"\x00" + b"".join(bytes([(x * 30) % 256, (y * 30) % 256, 120]) for x in range(8)) for y in range(8))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b""))


def _special_pages(seed: int, good: list[Page]) -> list[Page]:
    rng = _rng(seed, "special")
    pages = [
        Page(url="https://news.example.com/files/annual-report-2023.pdf", kind="non_html", lang=None,
             bucket="web", body=_tiny_pdf(), charset=None, content_type="application/pdf"),
        Page(url="https://blog-garden.example.org/images/tomato-trellis.png", kind="non_html", lang=None,
             bucket="web", body=_tiny_png(), charset=None, content_type="image/png"),
        Page(url="https://news.example.com/2024/02/council-budget-vote-removed.html", kind="non_200", lang=None,
             bucket="web", status=404,
             body=b"<!DOCTYPE html><html><head><title>404 Not Found</title></head><body><h1>Not Found</h1>"
                  b"<p>The requested URL was not found on this server.</p></body></html>\n"),
        Page(url="http://blog-cycling.example.org/old-archive/", kind="non_200", lang=None, bucket="web",
             status=301, extra_headers=[("Location", "https://blog-cycling.example.org/archive/")],
             body=b'<html><body>Moved <a href="https://blog-cycling.example.org/archive/">here</a>.</body></html>\n'),
    ]
    # A plain original, so the revisit's payload digest equals the one stored with it.
    original = rng.choice([p for p in good if p.lang == "en" and p.bucket == "web" and not p.extra_headers])
    pages.append(Page(url=original.url + "?print=1", kind="revisit", lang=None, bucket=original.bucket,
                      body=original.body, dup_of=original.url, record="revisit"))
    pages.append(Page(url="https://forum.example.net/thread/4412-broken-upload", kind="malformed", lang=None,
                      bucket="web", record="garbled_http",
                      body=b"<html><body><p>This record's HTTP head is garbage.</p></body></html>\n"))
    late = rng.choice(ENGLISH_TOPICS)
    late_text = " ".join(rng.sample(late[4], 14))
    doc = _html_page(lang="en", title="Late edition", site=late[1], nav=["Home"], body_html=_article(
        "Late edition", "By the night desk", [late_text]), footer="&copy; 2024")
    pages.append(Page(url=f"https://{late[0]}/late-edition-cut-off.html", kind="malformed", lang=None,
                      bucket="web", record="truncated", body=doc.encode("utf-8")))
    return pages


# ---------------------------------------------------------------------------------------------
# WARC writing
# ---------------------------------------------------------------------------------------------

def _digest(data: bytes) -> str:
    return "sha1:" + base64.b32encode(hashlib.sha1(data).digest()).decode("ascii")


def _record_id(seed: int, *parts: str) -> str:
    digest = hashlib.sha1("\x00".join([str(seed), *parts]).encode("utf-8")).digest()
    return f"<urn:uuid:{uuid.UUID(bytes=digest[:16], version=5)}>"


def _warc_record(headers: list[tuple[str, str]], block: bytes, payload: bytes | None = None) -> bytes:
    lines = ["WARC/1.0", *[f"{k}: {v}" for k, v in headers]]
    lines.append(f"WARC-Block-Digest: {_digest(block)}")
    if payload is not None:
        lines.append(f"WARC-Payload-Digest: {_digest(payload)}")
    lines.append(f"Content-Length: {len(block)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8")
    return gzip.compress(head + block + b"\r\n\r\n", compresslevel=6, mtime=0)


_REASONS = {200: "OK", 301: "Moved Permanently", 404: "Not Found"}


def _http_response(page: Page, date: datetime) -> tuple[bytes, bytes]:
    """(HTTP block, payload as sent on the wire)."""
    content_type = page.content_type
    if page.charset and page.content_type == "text/html" and page.http_charset:
        content_type += f"; charset={page.charset}"
    payload = page.body
    headers = [("Date", date.strftime("%a, %d %b %Y %H:%M:%S GMT")), ("Server", "nginx"),
               ("Content-Type", content_type), *page.extra_headers]
    for name, value in page.extra_headers:
        if name == "Content-Encoding" and value == "gzip":
            payload = gzip.compress(payload, mtime=0)
    if ("Transfer-Encoding", "chunked") in page.extra_headers:
        pieces = [payload[i:i + 1024] for i in range(0, len(payload), 1024)]
        payload = b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in pieces) + b"0\r\n\r\n"
    else:
        headers.append(("Content-Length", str(len(payload))))
    head = f"HTTP/1.1 {page.status} {_REASONS[page.status]}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1") + payload, payload


def _records_for(page: Page, seed: int, date: datetime, warcinfo_id: str) -> list[bytes]:
    stamp = date.strftime("%Y-%m-%dT%H:%M:%SZ")
    host = page.url.split("/")[2]
    path = "/" + page.url.split("/", 3)[3] if page.url.count("/") >= 3 else "/"
    response_id = _record_id(seed, "response", page.url)
    request = (f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: {_USER_AGENT}\r\n"
               "Accept: text/html,application/xhtml+xml;q=0.9,*/*;q=0.8\r\nAccept-Encoding: gzip\r\n\r\n").encode("latin-1")
    common = [("WARC-Target-URI", page.url), ("WARC-Date", stamp), ("WARC-Warcinfo-ID", warcinfo_id)]
    records = [_warc_record(
        [("WARC-Type", "request"), ("WARC-Record-ID", _record_id(seed, "request", page.url)), *common,
         ("WARC-Concurrent-To", response_id), ("Content-Type", "application/http; msgtype=request")], request)]
    if page.record == "revisit":
        block, payload = _http_response(page, date)
        head = block[:block.index(b"\r\n\r\n") + 4]
        original_date = (date - timedelta(days=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
        records.append(_warc_record(
            [("WARC-Type", "revisit"), ("WARC-Record-ID", response_id), *common,
             ("WARC-Profile", "http://netpreserve.org/warc/1.0/revisit/identical-payload-digest"),
             ("WARC-Refers-To-Target-URI", page.dup_of), ("WARC-Refers-To-Date", original_date),
             ("WARC-Payload-Digest", _digest(payload)), ("Content-Type", "application/http; msgtype=response")],
            head))
        return records
    block, payload = _http_response(page, date)
    if page.record == "garbled_http":
        block = b"\x00\x13HTTP/1.1 2\xff0 \xfe\xfe\r\nContent-Type text/html\r\nX-Broken\r\n\r\n" + page.body
    response = _warc_record(
        [("WARC-Type", "response"), ("WARC-Record-ID", response_id), *common, ("WARC-IP-Address", "192.0.2.10"),
         ("Content-Type", "application/http; msgtype=response")], block, payload)
    if page.record == "truncated":
        response = response[: len(response) * 3 // 5]  # the writer died mid-record
    records.append(response)
    return records


def _warcinfo(seed: int, name: str, date: datetime) -> tuple[str, bytes]:
    record_id = _record_id(seed, "warcinfo", name)
    fields = (f"software: kiln-sample-crawl/1.0\r\nformat: WARC File Format 1.0\r\nisPartOf: KILN-SAMPLE-{seed}\r\n"
              f"description: deterministic sample crawl for the Kiln pipeline\r\nrobots: classic\r\n").encode("utf-8")
    return record_id, _warc_record(
        [("WARC-Type", "warcinfo"), ("WARC-Record-ID", record_id), ("WARC-Date", date.strftime("%Y-%m-%dT%H:%M:%SZ")),
         ("WARC-Filename", name), ("Content-Type", "application/warc-fields")], fields)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def _plan(num_pages: int) -> dict[str, int]:
    rest = num_pages - sum(_FIXED_KINDS.values())
    counts = {name: max(1, round(rest * share)) for name, share in _SHARES.items()}
    counts["web"] = rest - sum(counts.values())
    # Duplicates need originals, and a few web pages must stay unduplicated.
    if counts["web"] < counts["exact_dup"] + counts["near_dup"] + 2:
        raise ValueError(f"num_pages={num_pages} is too small; use at least {MIN_PAGES}")
    return counts


def generate_sample_crawl(out_dir: str, seed: int = 0, num_pages: int = 300, num_files: int = 2) -> dict:
    """Write the sample crawl into `out_dir`; return a summary (files, counts per label)."""
    if not MIN_PAGES <= num_pages <= MAX_PAGES:
        raise ValueError(f"num_pages must be between {MIN_PAGES} and {MAX_PAGES}")
    if num_files < 1:
        raise ValueError("num_files must be >= 1")
    plan = _plan(num_pages)
    web = _english_pages(seed, plan["web"])
    pages = web + _reference_pages(seed, plan["reference"])
    for lang in FOREIGN:
        pages += _foreign_pages(seed, lang, plan[lang])
    rng = _rng(seed, "plan")
    originals = rng.sample(web, plan["exact_dup"] + plan["near_dup"])
    exact_originals = originals[: plan["exact_dup"]]
    near_originals = originals[plan["exact_dup"]:]
    # Transfer quirks real crawls carry; the extractor must undo them.
    rest = [p for p in web if p not in originals]
    rest[0].extra_headers.append(("Content-Encoding", "gzip"))
    rest[1].extra_headers.append(("Transfer-Encoding", "chunked"))
    pages += _exact_dups(exact_originals) + _near_dups(seed, near_originals)
    pages += _spam_pages(seed, plan["spam"]) + _boilerplate_pages(seed, plan["boilerplate"])
    pages += _special_pages(seed, web)
    urls = [p.url for p in pages]
    if len(set(urls)) != len(urls):
        raise RuntimeError("sample crawl produced duplicate URLs")

    os.makedirs(out_dir, exist_ok=True)
    base = datetime(2024, 3, 1, tzinfo=timezone.utc) + timedelta(hours=seed % 8760)
    truncated = [p for p in pages if p.record == "truncated"]
    ordered = sorted((p for p in pages if p.record != "truncated"), key=lambda p: p.url)
    files: list[list[Page]] = [[] for _ in range(num_files)]
    for page in ordered:
        files[int(hashlib.sha1(page.url.encode("utf-8")).hexdigest()[:8], 16) % num_files].append(page)
    files[-1].extend(truncated)  # a crawler that died while writing its last record
    dates = {p.url: base + timedelta(seconds=17 * i) for i, p in enumerate(ordered + truncated)}

    names = []
    for index, file_pages in enumerate(files):
        name = f"sample-{index:05d}.warc.gz"
        warcinfo_id, warcinfo = _warcinfo(seed, name, base)
        with open(os.path.join(out_dir, name), "wb") as out:
            out.write(warcinfo)
            for page in file_pages:
                for record in _records_for(page, seed, dates[page.url], warcinfo_id):
                    out.write(record)
        names.append(name)

    labels = {
        p.url: {"kind": p.kind, "lang": p.lang, "dup_of": p.dup_of, "bucket": p.bucket,
                "charset": p.charset if p.content_type == "text/html" else None}
        for p in sorted(pages, key=lambda p: p.url)
    }
    with open(os.path.join(out_dir, "labels.json"), "w", encoding="utf-8") as f:
        json.dump(labels, f, indent=1, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    return {
        "out_dir": out_dir,
        "warc_files": names,
        "labels_file": "labels.json",
        "num_pages": len(pages),
        "kinds": dict(sorted(Counter(p.kind for p in pages).items())),
        "langs": dict(sorted(Counter(p.lang for p in pages if p.lang).items())),
        "buckets": dict(sorted(Counter(p.bucket for p in pages).items())),
        "domain_buckets": dict(SAMPLE_DOMAIN_BUCKETS),
        "seed": seed,
    }


# ---------------------------------------------------------------------------------------------
# Text pools (original prose written for this sample)
# ---------------------------------------------------------------------------------------------

_GARDEN = [
    "Our allotment sits at the edge of town, between the railway embankment and a row of old pear trees.",
    "Every spring I promise myself that I will sow fewer tomatoes, and every spring I fail.",
    "The soil here is heavy clay, so we dig in a barrow of compost for each bed before planting anything.",
    "Runner beans need a sturdy frame, because a summer storm can flatten a weak one in a single night.",
    "I learned the hard way that slugs prefer lettuce seedlings to almost anything else in the garden.",
    "A thick mulch of straw keeps the strawberries clean and saves a surprising amount of watering.",
    "Our neighbour on the next plot grows dahlias the size of dinner plates and shares the tubers every autumn.",
    "Crop rotation sounds complicated, but it simply means that potatoes never go back into the same bed two years running.",
    "The first ripe tomato of the season is always eaten standing up, still warm from the sun.",
    "We collect rainwater from the shed roof in three blue barrels, which last about ten days in a dry spell.",
    "Comfrey leaves, soaked in water for a few weeks, make a smelly but excellent liquid feed.",
    "Onion sets went in late this year, yet they caught up quickly once the weather turned mild.",
    "Birds took every single cherry last summer, so this year the tree wears a net from May onward.",
    "Garlic likes a cold snap, which is why we plant the cloves in October and forget about them until June.",
    "The committee asks every plot holder to keep paths clear and to cut the grass along their boundary.",
    "Courgettes are generous to a fault; by August we leave bags of them on the gate for anyone to take.",
    "A small pond in the corner has brought frogs, and the frogs have brought a welcome drop in slugs.",
    "Leeks are planted into deep holes made with an old spade handle and then watered in without firming the soil.",
    "Green manure such as clover protects bare ground over winter and adds nitrogen when it is dug in.",
    "My grandmother kept a notebook of sowing dates, and I still follow her timings for broad beans.",
    "Blight arrived in late July, and we lifted the potatoes early to save what we could.",
    "Raspberry canes that fruited this year should be cut to the ground once the harvest is over.",
    "The shed smells of twine, creosote and apples stored in newspaper on the top shelf.",
    "Children from the local school visit on Fridays to plant sunflowers and hunt for worms.",
    "Sweet peas are grown purely for the scent, and a jar on the kitchen table lasts almost a week.",
    "Parsnips are slow to germinate, so we mark each row with radishes that come up in days.",
    "A cold frame made from an old window lets us start salad leaves a full month earlier.",
    "Pruning the apple tree in winter opens the centre to light and air, which keeps disease away.",
    "When the frost finally comes, the last green tomatoes ripen slowly on the windowsill indoors.",
    "There is no better way to spend a quiet Sunday morning than weeding with a flask of tea nearby.",
]

_CYCLING = [
    "I started commuting by bicycle three years ago, mostly because the bus was always late.",
    "The route into the city follows the river for six kilometres before climbing a short, steep hill.",
    "A good set of mudguards makes the difference between arriving at work dry and arriving soaked.",
    "Most punctures happen in the first week after rain, when small flints wash onto the road.",
    "Checking tyre pressure once a week takes two minutes and makes the bike feel noticeably faster.",
    "The chain should be cleaned and oiled regularly, especially after riding through winter grit.",
    "Our cycling club meets every Saturday at eight in front of the old market hall.",
    "Riding in a group teaches you to signal clearly, hold a steady line and call out potholes.",
    "Lights are not optional in November, when it is dark on both the morning and evening ride.",
    "The new protected lane on Station Road has made the worst junction in town feel almost relaxed.",
    "A basic toolkit fits in a saddle bag: tyre levers, a spare tube, a mini pump and a multi tool.",
    "Gear cables stretch over time, so a quarter turn of the barrel adjuster often cures noisy shifting.",
    "On long rides I eat a little every half hour, long before I actually feel hungry.",
    "Headwinds are the cyclist's hills on flat land, and there is no way to coast down them.",
    "The old steel frame I bought second hand is heavier than carbon, but it is comfortable and nearly indestructible.",
    "Brake pads wear quickly in wet weather, and it pays to check them before a long descent.",
    "Last summer we rode the coast road over four days, staying in small guesthouses along the way.",
    "A bell is still the most polite way to let walkers know you are coming up behind them.",
    "Winter tyres with a little more tread give extra confidence on wet leaves and frosty mornings.",
    "Learning to fix a puncture at the roadside is the single most useful skill a new rider can learn.",
    "The council counted over two thousand bicycles crossing the river bridge on a typical weekday.",
    "I keep a spreadsheet of every ride, which is mostly an excuse to look at graphs on rainy evenings.",
    "Cargo bikes have become a common sight, carrying children, shopping and even the occasional dog.",
    "A proper bike fit cured the knee pain that I had blamed on age for years.",
    "The hardest part of any winter ride is leaving the warm house; after ten minutes it feels wonderful.",
    "Secure parking matters, because a cheap lock is an invitation rather than a deterrent.",
    "Hill repeats are dull but effective, and the same climb slowly becomes a little less painful.",
    "Every spring the club runs a workshop where experienced members help beginners service their bikes.",
    "Commuting by bike saves money on fuel and parking, but the real gain is arriving at work awake.",
    "After a long ride, a bowl of soup and a warm shower feel like the best reward in the world.",
]

_KITCHEN = [
    "Good bread needs only four ingredients: flour, water, salt and time.",
    "My sourdough starter is seven years old and lives in a jar at the back of the fridge.",
    "Feeding the starter the night before baking makes it lively and ready to raise the dough.",
    "A long, slow rise in a cool kitchen develops far more flavour than a quick warm one.",
    "Weighing ingredients instead of using cups is the easiest way to get consistent results.",
    "Stretching and folding the dough every half hour builds strength without any kneading at all.",
    "A heavy cast iron pot with a lid traps steam and gives the loaf a crisp, blistered crust.",
    "The hardest part of baking bread is waiting for it to cool before cutting the first slice.",
    "Soup is the most forgiving dish in the kitchen, and it rescues tired vegetables from the bottom drawer.",
    "Roasting tomatoes with garlic and olive oil concentrates their flavour for a rich winter sauce.",
    "Fresh herbs should be added at the end of cooking, while dried herbs need time to soften.",
    "A sharp knife is safer than a blunt one, because it goes where you guide it instead of slipping.",
    "We cook a large pot of beans on Sunday and use them in salads, stews and soups all week.",
    "Salting aubergine slices for half an hour draws out moisture and stops them soaking up oil.",
    "Pancakes taste better when the batter rests for a while, so I mix it before making coffee.",
    "My grandmother measured flour by the handful and never once wrote down a recipe.",
    "Toasting spices in a dry pan for a minute wakes up their aroma before they go into a curry.",
    "A squeeze of lemon at the end brightens almost any dish that tastes flat or heavy.",
    "Homemade stock is easy: simmer vegetable trimmings and bones gently for a few hours, then strain.",
    "Rye flour absorbs more water than wheat, so rye doughs feel sticky and should not be over-floured.",
    "Crusty rolls freeze well and can be refreshed in a hot oven for five minutes.",
    "We bake a simple apple cake whenever the tree in the garden drops more fruit than we can eat.",
    "Caramelising onions properly takes at least forty minutes over a low flame, whatever recipes claim.",
    "A kitchen scale, a bench scraper and a good oven thermometer are worth more than any gadget.",
    "Letting meat rest after roasting keeps the juices inside instead of on the cutting board.",
    "Pickling is an old way to preserve a glut of cucumbers, and a jar makes a welcome gift.",
    "I keep a notebook of every loaf, noting the flour, the hydration and how long each rise took.",
    "Cooking with children is messy, but they eat vegetables more happily when they helped prepare them.",
    "A pinch of salt in sweet baking does not make it salty; it simply makes the flavours clearer.",
    "On cold evenings a slice of warm bread with butter and a bowl of soup is all anyone needs.",
]

_NEWS = [
    "The town council voted on Tuesday to extend the opening hours of the central library.",
    "Residents had collected more than four hundred signatures asking for evening access during exam season.",
    "The library will now stay open until eight on weekdays, starting from the first of next month.",
    "Work on the new pedestrian bridge over the canal is expected to finish before the summer festival.",
    "Engineers said the delay was caused by unexpected foundations from a Victorian warehouse.",
    "The weekly farmers market will move to the station square while the old market hall is repaired.",
    "Local bus routes seven and twelve will run every fifteen minutes instead of every half hour.",
    "A volunteer group planted two hundred trees along the ring road as part of a city greening scheme.",
    "The primary school on Hill Street received funding to replace its leaking roof during the holidays.",
    "Police thanked residents for their patience after a burst water main closed the high street overnight.",
    "The council's budget for the coming year includes more money for road repairs and street lighting.",
    "Opposition members argued that the increase in parking charges would hurt small shops in the centre.",
    "A public meeting about the proposed housing development drew more than three hundred people.",
    "Many speakers supported new homes but asked for a doctor's surgery and a school to be built first.",
    "The museum reopened its local history gallery with a display of photographs from the last century.",
    "Visitors can see how the harbour looked before the fishing fleet moved to the larger port.",
    "The river reached its highest level in a decade after heavy rain, but the new flood barriers held.",
    "Emergency services advised drivers to avoid the valley road until the water had gone down.",
    "The youth football club celebrated its fiftieth anniversary with a match against former players.",
    "A new recycling centre on the industrial estate will accept electrical goods and garden waste.",
    "Shopkeepers reported a busy weekend as the annual food festival returned to the riverside.",
    "The hospital trust confirmed that the minor injuries unit will remain open at weekends.",
    "Council officers will survey cycle parking at the station after complaints about overcrowded racks.",
    "The community choir raised enough money at its spring concert to buy a new piano for the hall.",
    "Traffic lights at the north junction will be replaced with a roundabout later this year.",
    "Several residents wrote to the newspaper to praise the cleaners who work through the night after events.",
    "The mayor said the town needed to balance growth with protecting green spaces that people value.",
    "A consultation on the future of the bus station will open online and in the library next week.",
    "The theatre announced a winter season of classic plays alongside new work by local writers.",
    "Councillors agreed to review the decision in six months once the first figures are available.",
]

_STARS = [
    "The best time to look at the night sky is on a moonless evening, well away from street lights.",
    "It takes about twenty minutes for your eyes to adapt fully to the dark, so be patient.",
    "A red torch preserves night vision, because the eye is far less sensitive to red light.",
    "Binoculars are an excellent first instrument and show craters on the Moon and the moons of Jupiter.",
    "Saturn's rings are visible in a small telescope, and the first sight of them is unforgettable.",
    "The Andromeda galaxy is the most distant object most people can see without any optical aid.",
    "Light from Andromeda set out more than two million years ago, long before the first humans walked the Earth.",
    "Meteor showers happen when the Earth passes through dust left behind by a comet.",
    "The Perseids peak in the middle of August and can produce dozens of meteors an hour.",
    "Lying on a blanket and looking straight up is the most comfortable way to watch a meteor shower.",
    "Our astronomy society runs open evenings in the park whenever the forecast promises clear skies.",
    "Beginners often expect colourful nebulae, but through the eyepiece most of them look like faint grey clouds.",
    "Photographs collect light for minutes or hours, which is why they reveal colour the eye cannot see.",
    "The planet Venus is so bright near sunset that it is often mistaken for an aircraft.",
    "A star chart or a planisphere helps you learn the constellations one season at a time.",
    "The International Space Station crosses the sky in a few minutes and shines brighter than any star.",
    "Dew on the lens can end an observing session early unless the telescope has a heater strip.",
    "The Moon is most interesting near first quarter, when shadows along the terminator show its mountains.",
    "Light pollution has hidden the Milky Way from most people who live in towns and cities.",
    "Some villages now use shielded street lamps that point light downward and keep the sky dark.",
    "Jupiter's four largest moons change position from night to night, a dance Galileo first recorded.",
    "Double stars are rewarding targets, and a few show striking colour contrasts between the pair.",
    "A solar filter must always cover the front of a telescope before it is pointed anywhere near the Sun.",
    "Keeping an observing log helps you notice how much your skill improves over a single year.",
    "The winter sky is crisp and full of bright stars, but dressing warmly is essential.",
    "Orion's belt points down toward Sirius, the brightest star in the night sky.",
    "A total lunar eclipse turns the Moon a deep copper colour as sunlight bends through our atmosphere.",
    "Variable stars change their brightness, and amateur observers still contribute useful measurements.",
    "Setting up the telescope before dark saves a lot of fumbling with cold fingers later.",
    "Standing under a truly dark sky is a humbling reminder of how small our world really is.",
]

_WORKSHOP = [
    "The workshop is a converted garage with a sturdy bench along the back wall.",
    "Every project starts with a drawing, even if it is only a rough sketch on the back of an envelope.",
    "Measure twice and cut once is an old saying because it saves both wood and temper.",
    "A sharp chisel cuts cleanly, while a dull one crushes the fibres and leaves a ragged edge.",
    "I sharpen my plane irons on water stones and finish them with a leather strop.",
    "Oak is hard and handsome but heavy, while pine is forgiving and cheap for practice pieces.",
    "Wood moves with the seasons, so tabletops must be fixed in a way that lets them expand and shrink.",
    "Dovetail joints look difficult, yet they mostly require patience and careful marking out.",
    "Clamps are the tools you can never have enough of, no matter how many hang on the wall.",
    "Glue should squeeze out in a thin bead along the joint, which shows the surfaces are fully covered.",
    "Sanding through the grits in order gives a smooth surface without visible scratches.",
    "A coat of oil brings out the grain and is easy to repair when the piece gets marked.",
    "Dust extraction is not a luxury, because fine dust is bad for the lungs over many years.",
    "Safety glasses and ear defenders stay on the hook by the door so that I never forget them.",
    "The first chair I made wobbled badly, and I kept it as a reminder of what not to do.",
    "Reclaimed timber from old floorboards has a warmth that new wood takes decades to develop.",
    "Before fixing a dripping tap, turn off the water supply and put a plug in the sink.",
    "Most squeaky floorboards can be silenced by screwing them down firmly into the joist below.",
    "Filling a hole in plaster is easier with two thin layers of filler than with one thick one.",
    "Painting a door goes faster when it is taken off its hinges and laid flat on trestles.",
    "A spirit level and a long straight edge reveal how few walls in an old house are truly flat.",
    "Hand tools are quieter and more pleasant to use than machines, though rarely faster.",
    "The bench vice was my grandfather's, and its jaws still close as smoothly as ever.",
    "Pilot holes stop screws from splitting the wood, especially close to the end of a board.",
    "Keeping the workshop tidy is dull, but it saves hours of searching for the one tool you need.",
    "A simple bookshelf is an ideal first project because it teaches cutting, joining and finishing.",
    "Rust on cast iron tables can be kept away with a thin coat of paste wax.",
    "Local evening classes are a good way to learn joinery from people with decades of experience.",
    "Finishing a piece of furniture that will be used every day is a quiet kind of satisfaction.",
    "At the end of each session I sweep the floor, oil the tools and switch off the lights.",
]

ENGLISH_TOPICS = [
    ("blog-garden.example.org", "The Allotment Diary", ["Margaret Ellis", "Tom Reid"],
     ["Notes from the allotment", "What we learned this season", "A wet week on the plot", "Sowing, weeding and waiting",
      "The tomato problem", "Autumn jobs in the garden", "Small wins on the vegetable beds"], _GARDEN),
    ("blog-cycling.example.org", "Two Wheels to Work", ["Sam Okafor", "Priya Natarajan"],
     ["Commuting through the winter", "Lessons from a year on the bike", "Keeping the bike running", "Club ride report",
      "Why I ride to work", "Small repairs that save big trouble", "A weekend on the coast road"], _CYCLING),
    ("blog-kitchen.example.org", "Flour and Water", ["Elena Rossi", "David Hart"],
     ["Bread for beginners", "Notes on slow cooking", "What my grandmother knew", "Weeknight soups and stews",
      "Baking through the seasons", "The patient kitchen", "Simple food, done well"], _KITCHEN),
    ("news.example.com", "Riverside Gazette", ["Gazette reporter", "Local news desk", "Hannah Byrne"],
     ["Council approves longer library hours", "Town news in brief", "Week in review", "Residents debate the future of the centre",
      "Roads, rivers and repairs", "What the council decided", "Community news roundup"], _NEWS),
    ("blog-stargazing.example.org", "Dark Sky Notes", ["Ravi Menon", "Claire Dubois"],
     ["Getting started with stargazing", "A night under dark skies", "What to look for this season", "Binoculars before telescopes",
      "Notes from the observing field", "Meteors, moons and planets", "Learning the night sky"], _STARS),
    ("blog-workshop.example.org", "Sawdust Sundays", ["Peter Lang", "Aisha Karim"],
     ["Lessons from the workshop", "Small repairs around the house", "Learning to cut dovetails", "Tools worth owning",
      "Finishing touches", "A bookshelf for beginners", "Notes from the bench"], _WORKSHOP),
]

NEAR_DUP_INSERTS = ["honestly", "really", "of course", "as always", "once again", "in fact", "again"]
NEAR_DUP_DOMAINS = ["aggregator.example.com", "news-digest.example.net", "reposts.example.info"]

_DE = [
    "Am Samstagmorgen ist der Wochenmarkt auf dem Rathausplatz immer gut besucht.",
    "Die Bauern aus dem Umland verkaufen dort Gemüse, Käse, Eier und frisches Brot.",
    "Im Herbst duftet der ganze Platz nach gebrannten Mandeln und heißem Apfelsaft.",
    "Die Stadtbibliothek hat ihre Öffnungszeiten verlängert und bietet jetzt auch Kurse für Senioren an.",
    "Viele Menschen fahren inzwischen mit dem Fahrrad zur Arbeit, weil die neuen Radwege sicherer sind.",
    "Nach dem langen Winter freuen sich alle über die ersten warmen Tage im Biergarten am Fluss.",
    "Der Wetterdienst warnt für das Wochenende vor starken Gewittern und örtlichem Hagel.",
    "Im Gebirge liegt noch Schnee, doch in den Tälern blühen bereits die Obstbäume.",
    "Unsere Großmutter backt jeden Sonntag einen Kuchen mit Äpfeln aus dem eigenen Garten.",
    "Eine gute Suppe braucht Zeit, frisches Gemüse und eine kräftige Brühe.",
    "Die Wanderung zum Aussichtsturm dauert etwa zwei Stunden und ist auch für Kinder geeignet.",
    "Von oben sieht man bei klarem Wetter bis zu den Alpen am Horizont.",
    "Forscher der Universität untersuchen, wie sich der Klimawandel auf die heimischen Wälder auswirkt.",
    "Besonders die Fichten leiden unter den trockenen Sommern der letzten Jahre.",
    "Das städtische Museum zeigt eine Ausstellung über die Geschichte der Eisenbahn in der Region.",
    "Alte Fotografien erzählen vom Alltag der Arbeiter, die die ersten Strecken gebaut haben.",
    "Im Sommer finden auf der Freilichtbühne Theateraufführungen und Konzerte statt.",
    "Die Karten sind meist schnell ausverkauft, deshalb lohnt es sich, früh zu bestellen.",
    "Der Zug nach Hamburg hatte heute wegen einer Signalstörung fast eine Stunde Verspätung.",
    "Viele Pendler nutzen die Wartezeit, um zu lesen oder E-Mails zu beantworten.",
    "Im Kindergarten lernen die Kleinen spielerisch, wie man Müll richtig trennt.",
    "Ein Spaziergang im Stadtpark ist die beste Erholung nach einem langen Arbeitstag.",
    "Der Bäcker an der Ecke öffnet schon um sechs Uhr, und vor der Tür bildet sich oft eine Schlange.",
    "Die Gemeinde plant, das alte Schwimmbad zu sanieren und im nächsten Jahr wieder zu eröffnen.",
    "Am Abend sitzen die Nachbarn oft gemeinsam auf der Bank vor dem Haus und erzählen.",
    "Wer die Stadt wirklich kennenlernen möchte, sollte sich Zeit nehmen und zu Fuß gehen.",
]

_FR = [
    "Le marché du dimanche s'installe sur la place de l'église dès sept heures du matin.",
    "On y trouve des fromages de la région, des légumes de saison et du pain encore chaud.",
    "Au printemps, les terrasses des cafés se remplissent dès que le soleil apparaît.",
    "La bibliothèque municipale propose désormais des ateliers d'écriture pour les adolescents.",
    "Beaucoup d'habitants prennent le vélo pour aller travailler depuis l'ouverture des nouvelles pistes cyclables.",
    "Les prévisions annoncent de fortes pluies sur la côte atlantique pour la fin de la semaine.",
    "Dans les Alpes, les stations de ski espèrent encore quelques chutes de neige avant les vacances.",
    "Ma grand-mère prépare chaque hiver une soupe à l'oignon qui réchauffe toute la famille.",
    "Une bonne tarte aux pommes demande une pâte croustillante et des fruits bien mûrs.",
    "Le sentier qui mène au phare longe la falaise et offre une vue magnifique sur la mer.",
    "Il faut compter environ trois heures de marche, pauses comprises.",
    "Des chercheurs étudient l'effet de la sécheresse sur les vignes de la vallée du Rhône.",
    "Les vendanges ont commencé plus tôt que d'habitude à cause des fortes chaleurs de l'été.",
    "Le musée d'histoire locale présente une exposition sur les anciens métiers du port.",
    "Des photographies en noir et blanc montrent les pêcheurs réparant leurs filets sur le quai.",
    "Chaque été, le festival de théâtre attire des milliers de visiteurs dans les rues de la vieille ville.",
    "Les billets pour les spectacles les plus populaires se vendent en quelques heures.",
    "Le train pour Lyon a été retardé de quarante minutes en raison d'un incident technique.",
    "Les voyageurs ont profité de l'attente pour lire ou prendre un café en gare.",
    "À l'école, les enfants apprennent à trier les déchets et à économiser l'eau.",
    "Une promenade au jardin public est le meilleur moyen de se détendre après une longue journée.",
    "La boulangerie du quartier ouvre à six heures, et une file se forme souvent devant la porte.",
    "La mairie prévoit de rénover la piscine municipale et de la rouvrir l'année prochaine.",
    "Le soir, les voisins se retrouvent sur la place pour discuter en profitant de la fraîcheur.",
    "Pour découvrir vraiment une ville, rien ne vaut une longue promenade à pied sans but précis.",
    "Les petits commerces du centre-ville comptent sur la fidélité de leurs clients pour survivre.",
]

_ES = [
    "El mercado del sábado ocupa toda la plaza mayor desde primera hora de la mañana.",
    "Los agricultores de la comarca venden fruta, verdura, queso y pan recién hecho.",
    "En primavera, las terrazas de los bares se llenan en cuanto sale el sol.",
    "La biblioteca municipal ha ampliado su horario y ofrece cursos de informática para mayores.",
    "Cada vez más vecinos van al trabajo en bicicleta gracias a los nuevos carriles protegidos.",
    "La agencia de meteorología prevé tormentas fuertes en el norte durante el fin de semana.",
    "En la sierra todavía queda nieve, pero en los valles ya florecen los almendros.",
    "Mi abuela prepara cada domingo un cocido que reúne a toda la familia alrededor de la mesa.",
    "Una buena tortilla de patatas necesita paciencia, fuego lento y huevos frescos.",
    "La ruta hasta el mirador dura unas dos horas y es apta para toda la familia.",
    "Desde arriba, en los días claros, se puede ver el mar en el horizonte.",
    "Investigadores de la universidad estudian cómo afecta la sequía a los olivares de la región.",
    "La cosecha de aceitunas de este año ha sido menor de lo esperado por la falta de lluvia.",
    "El museo de la ciudad presenta una exposición sobre la historia del ferrocarril en la provincia.",
    "Las fotografías antiguas muestran a los trabajadores que construyeron la primera línea.",
    "En verano, el teatro al aire libre organiza conciertos y obras clásicas casi todas las noches.",
    "Las entradas suelen agotarse pronto, así que conviene comprarlas con antelación.",
    "El tren a Madrid salió hoy con casi una hora de retraso por una avería en la vía.",
    "Muchos pasajeros aprovecharon la espera para leer o tomar un café en la estación.",
    "En el colegio, los niños aprenden a separar la basura y a cuidar el agua.",
    "Un paseo por el parque es el mejor descanso después de una larga jornada de trabajo.",
    "La panadería de la esquina abre a las seis, y a menudo se forma una cola en la puerta.",
    "El ayuntamiento planea renovar la piscina municipal y reabrirla el próximo verano.",
    "Por la noche, los vecinos sacan sillas a la calle y charlan mientras refresca.",
    "Quien quiera conocer de verdad una ciudad debe recorrerla a pie y sin prisas.",
    "Los pequeños comercios del centro dependen de la fidelidad de sus clientes de siempre.",
]

_RU = [
    "По субботам на центральной площади работает рынок, и с утра там много людей.",
    "Фермеры из соседних деревень продают овощи, мёд, творог и свежий хлеб.",
    "Осенью весь город пахнет яблоками и дымом от костров на дачах.",
    "Городская библиотека продлила часы работы и открыла курсы компьютерной грамотности для пенсионеров.",
    "Всё больше жителей ездят на работу на велосипеде, потому что новые дорожки стали безопаснее.",
    "Синоптики обещают в выходные сильные грозы и порывистый ветер.",
    "В горах ещё лежит снег, а в долинах уже цветут яблони и вишни.",
    "Моя бабушка каждое воскресенье печёт пироги с капустой и с яблоками.",
    "Хороший борщ требует времени, свежих овощей и крепкого бульона.",
    "Дорога к смотровой площадке занимает около двух часов и подходит даже для детей.",
    "В ясную погоду сверху видно реку и дальние леса до самого горизонта.",
    "Учёные университета изучают, как засуха влияет на леса нашего края.",
    "Особенно страдают ели, которым не хватает влаги в жаркие летние месяцы.",
    "Краеведческий музей открыл выставку об истории железной дороги в регионе.",
    "Старые фотографии рассказывают о жизни рабочих, которые строили первые пути.",
    "Летом в парке проходят концерты и спектакли под открытым небом.",
    "Билеты на самые популярные представления раскупают за несколько часов.",
    "Поезд в Москву сегодня опоздал почти на час из-за неисправности на линии.",
    "Многие пассажиры читали книги или пили чай в ожидании отправления.",
    "В детском саду малыши учатся сортировать мусор и беречь воду.",
    "Прогулка по городскому парку лучше всего помогает отдохнуть после работы.",
    "Пекарня на углу открывается в шесть утра, и у дверей часто стоит очередь.",
    "Администрация города планирует отремонтировать старый бассейн и открыть его в следующем году.",
    "По вечерам соседи собираются во дворе и неторопливо беседуют на скамейке.",
    "Чтобы по-настоящему узнать город, нужно не спешить и много ходить пешком.",
    "Небольшие магазины в центре держатся благодаря постоянным покупателям.",
]

_ZH = [
    "每到周末，城市中心的广场上都会有热闹的集市。",
    "附近村子的农民带来新鲜的蔬菜、水果、鸡蛋和自家做的馒头。",
    "秋天的时候，街道两旁的银杏树变成一片金黄，非常好看。",
    "市图书馆延长了开放时间，还为老年人开设了电脑学习班。",
    "越来越多的人骑自行车上班，因为新修的自行车道更加安全。",
    "气象台预报，本周末北方地区将有大风和雷阵雨。",
    "山上还有积雪，可是山下的桃花已经开了。",
    "我的奶奶每个星期天都会包饺子，全家人围坐在一起吃饭。",
    "做一碗好汤需要时间、新鲜的材料和足够的耐心。",
    "从山脚走到观景台大约需要两个小时，小朋友也可以轻松完成。",
    "天气晴朗的时候，站在山顶可以看到远处的河流和田野。",
    "大学的研究人员正在研究干旱对当地森林的影响。",
    "由于夏天越来越热，一些树木因为缺水而生长缓慢。",
    "市博物馆正在举办一个关于本地铁路历史的展览。",
    "老照片记录了当年工人们修建第一条铁路时的生活。",
    "夏天的晚上，公园里经常有免费的音乐会和戏剧演出。",
    "最受欢迎的演出门票往往几个小时就卖完了。",
    "今天开往上海的火车因为信号故障晚点了将近一个小时。",
    "很多乘客利用等车的时间看书或者喝茶。",
    "在幼儿园里，孩子们通过游戏学习怎样给垃圾分类。",
    "下班以后在公园里散散步，是最好的放松方式。",
    "街角的面包店早上六点就开门了，门口常常排着长队。",
    "政府计划翻修老游泳馆，并在明年重新对市民开放。",
    "傍晚的时候，邻居们喜欢坐在楼下的长椅上聊天。",
    "想要真正了解一座城市，最好的办法就是慢慢地步行。",
    "市中心的小商店依靠老顾客的支持才能继续经营下去。",
]

FOREIGN = {
    "de": {"pool": _DE, "domains": ["nachrichten.example.de", "blog.example.de"], "section": "artikel",
           "site": "Stadtleben", "nav": ["Startseite", "Lokales", "Kultur", "Kontakt"],
           "byline": "Von der Lokalredaktion", "footer": "&copy; 2024 Stadtleben. Alle Rechte vorbehalten.",
           "titles": ["Neues aus der Stadt", "Ein Wochenende in der Region", "Alltag und Kultur", "Notizen aus dem Viertel",
                      "Was diese Woche passiert ist", "Unterwegs in der Heimat"]},
    "fr": {"pool": _FR, "domains": ["journal.example.fr", "carnet.example.fr"], "section": "actualites",
           "site": "La Gazette du Quartier", "nav": ["Accueil", "Actualités", "Culture", "Contact"],
           "byline": "Par la rédaction", "footer": "&copy; 2024 La Gazette du Quartier. Tous droits réservés.",
           "titles": ["Nouvelles de la ville", "Un week-end dans la région", "Vie quotidienne et culture", "Carnet du quartier",
                      "Ce qui s'est passé cette semaine", "Promenades et découvertes"]},
    "es": {"pool": _ES, "domains": ["diario.example.es", "cronica.example.es"], "section": "noticias",
           "site": "Crónica Local", "nav": ["Inicio", "Noticias", "Cultura", "Contacto"],
           "byline": "Por la redacción", "footer": "&copy; 2024 Crónica Local. Todos los derechos reservados.",
           "titles": ["Noticias de la ciudad", "Un fin de semana en la comarca", "Vida cotidiana y cultura", "Apuntes del barrio",
                      "Lo que pasó esta semana", "Paseos y descubrimientos"]},
    "ru": {"pool": _RU, "domains": ["novosti.example.ru", "gorod.example.ru"], "section": "stati",
           "site": "Городские новости", "nav": ["Главная", "Новости", "Культура", "Контакты"],
           "byline": "Редакция", "footer": "&copy; 2024 Городские новости. Все права защищены.",
           "titles": ["Новости города", "Выходные в нашем крае", "Жизнь и культура", "Заметки о районе",
                      "Что произошло за неделю", "Прогулки по городу"], "legacy": "windows-1251"},
    "zh": {"pool": _ZH, "domains": ["xinwen.example.cn", "shenghuo.example.cn"], "section": "wenzhang",
           "site": "城市生活", "nav": ["首页", "新闻", "文化", "联系我们"],
           "byline": "本报记者", "footer": "&copy; 2024 城市生活 版权所有",
           "titles": ["城市新闻", "周末去哪儿", "生活与文化", "街坊小记", "本周要闻", "漫步城市"], "legacy": "gbk"},
}

SPAM_PHRASES = [
    "cheap casino bonus", "win now", "free spins today", "best online slots", "payday loans fast",
    "cheap replica watches", "buy followers cheap", "weight loss pills", "no deposit bonus", "instant cash prize",
    "crypto doubling guaranteed", "lowest price guaranteed", "click here now", "limited offer", "miracle diet",
    "jackpot winner", "earn money from home", "discount pharmacy online", "vip casino club", "bet and win big",
    "lucky spin wheel", "mega jackpot slots", "free gift cards", "work from home riches", "best forex signals",
    "cheap flights deal", "hot deals today", "100% free bonus", "claim your reward", "fast loans no credit check",
]
SPAM_ADULT = ["xxx hot singles", "adult xxx videos", "sexy singles chat", "porn free tonight"]
SPAM_CTA = [
    "Click here to claim your free bonus before it expires!!!",
    "Sign up now and win big, no questions asked!",
    "Only today: double your money or your money back!!!",
    "Register in 30 seconds and start winning immediately!",
]
SPAM_DOMAINS = ["best-casino-bonus.example.biz", "cheap-pills-online.example.info", "win-big-now.example.net",
                "free-spins-club.example.biz", "loans-fast.example.info"]

BOILERPLATE_MENU = [
    "Home", "About us", "Contact", "Products", "Services", "Blog", "Careers", "Support", "FAQ", "Shop",
    "Login", "Register", "Newsletter", "Press", "Partners", "Events", "Downloads", "Sitemap", "Help", "Account",
]
BOILERPLATE_COOKIES = [
    "We use cookies to improve your experience. By continuing you accept our cookie policy.",
    "This website uses cookies. Accept all | Reject all | Settings",
    "Cookies help us deliver our services. Learn more | OK",
]
BOILERPLATE_LINES = [
    "Home | About | Contact", "Login | Register | Forgot password?", "Follow us on social media",
    "Subscribe to our newsletter", "Share: Facebook | Twitter | Email", "Back to top",
    "Page 1 of 12 | Next >", "Terms of use | Privacy policy | Imprint", "Search this site",
    "Your cart is empty", "Free shipping on orders over 50", "Choose your language: EN | DE | FR",
    "Skip to main content", "Read more >>", "Loading...", "Posted in Uncategorized", "Tags: news, update, info",
    "All rights reserved.", "Welcome to our portal.", "Opening hours: Mon-Fri 9-17",
]
BOILERPLATE_CATEGORIES = [
    "News", "Events", "Offers", "Downloads", "Archive", "Gallery", "Videos", "Jobs", "Partners",
    "Reviews", "Guides", "Updates", "Community", "Projects", "Media",
]
BOILERPLATE_DOMAINS = ["portal.example.net", "www.example-shop.com", "intranet.example.org", "directory.example.com"]
