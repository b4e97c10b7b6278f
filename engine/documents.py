"""WARC/WET files -> `documents` rows (docs/CONTRACTS.md).

`extract_warc` streams one file with FastWARC and yields a document dict per usable HTML
response (or WET conversion record) and a `{"skip_reason": ...}` dict per record it drops, so
callers can account for every record. `extract_documents` runs it as a Spark stage, one task
per file.

Skip reasons: not_response (warcinfo/request/metadata/...), revisit, non_200, non_html,
too_large, truncated, decode_error, extract_error, empty_text, corrupt (framing or HTTP head
FastWARC cannot parse), bad_gzip (a compressed member that fails to inflate), not_warc (e.g. an
ARC file), and in the Spark stage duplicate_record (a second record with a doc_id already taken).
After `corrupt`/`bad_gzip` the reader resynchronises on the next record start, so one flipped
bit does not cost the rest of the file; that holds for the first member too.

doc_id: sha1(snapshot, WARC-Record-ID) (a WET record's WARC-Refers-To: the response it was made
from); a record without an id falls back to its URL plus the SHA-1 of its payload. doc_ids are
unique within a snapshot: when records share one (the .warc.gz and .wet of one capture in one
folder, a record written twice), the stage keeps the first by (response before resource before
WET conversion, WARC file name, position in the file) and counts the others.
"""
from __future__ import annotations

import base64
import codecs
import hashlib
import importlib.util
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import urlsplit

DOCUMENT_COLUMNS = (
    "doc_id", "url", "domain", "snapshot", "warc_file", "warc_record_id",
    "fetch_time", "charset", "bucket", "text",
)
DOCUMENTS_DDL = ", ".join(f"{name} string" for name in DOCUMENT_COLUMNS)

# kiln: resiliparse plus boilerplate rules, trafilatura on pages it is unsure about
# (engine/boilerplate.py); the other two are the libraries alone.
EXTRACTORS = ("kiln", "resiliparse", "trafilatura")
DEFAULT_EXTRACTOR = "kiln"
HTML_MIME_TYPES = {"text/html", "application/xhtml+xml"}
# Responses that declare no useful type are sniffed; anything else declared is trusted.
SNIFF_MIME_TYPES = {"", "application/octet-stream", "unk", "unknown", "application/unknown"}

_SCAN_CHUNK = 1 << 20
_ARROW_BATCH_ROWS = 256  # rows per Arrow batch out of a Spark task; bounds worker memory
_HTML_SNIFF = re.compile(rb"^\s*(?:<!--.*?-->\s*)*<(?:!doctype\s+html|html|head|body|meta|title)\b", re.I | re.S)
_CHARSET_PARAM = re.compile(r"charset\s*=\s*[\"']?([A-Za-z0-9_.:\-]+)", re.I)
_SINGLE_BYTE = {"cp1252", "iso8859-1", "latin-1", "ascii"}
# Which record of a repeated doc_id the stage keeps: the response (the source), then a resource,
# then a WET conversion (text someone else extracted).
_KIND_RANK = {"http": 0, "resource": 1, "conversion": 2}
# Repeated doc_ids up to this many are broadcast to the join that drops the extra copies (so the
# documents' text is not shuffled); beyond it Spark plans the join itself. An engine constant, not a
# `documents` setting: it picks a plan, never the rows (so it must stay out of the code_version),
# and only caps the broadcast table (doc_id and keep key, ~100 bytes a row: ~20 MB).
_BROADCAST_DUPLICATES = 200_000


def doc_id_for(snapshot: str, record_id: str) -> str:
    return hashlib.sha1(f"{snapshot}\x00{record_id}".encode("utf-8")).hexdigest()[:20]


def payload_key(url: str, payload: bytes) -> str:
    """What a record without WARC-Record-ID is keyed by: URL plus the SHA-1 of its payload, in
    WARC-Payload-Digest's notation (computed, not read: the header may be missing or wrong)."""
    return f"{url}\x00sha1:{base64.b32encode(hashlib.sha1(payload).digest()).decode('ascii')}"


# ---------------------------------------------------------------------------------------------
# Reading: record framing, triage and resynchronisation
# ---------------------------------------------------------------------------------------------

@dataclass
class _Candidate:
    """A record that may become a document; everything below is plain bytes/str."""

    kind: str  # "http" (response with HTTP envelope), "resource" or "conversion" (WET)
    record_id: str
    url: str
    warc_date: str
    headers: dict[str, str]  # HTTP headers (lower-cased names); empty for resource/conversion
    content_type: str  # full Content-Type (HTTP for responses, WARC header otherwise)
    body: bytes
    truncated: bool
    offset: int = 0  # where the record starts in its file (the tie-break among repeated doc_ids)


def _header(rec, name: str) -> str:
    return (rec.headers.get(name) or "").strip()


def _is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _starts_with_warc(path: str, gz: bool) -> bool | None:
    """True for WARC/WET, False for something else (ARC, text), None for an empty file."""
    with open(path, "rb") as f:
        head = f.read(64 << 10)
    if not head:
        return None
    if gz:
        try:
            head = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, 64)
        except zlib.error:
            return False
    return head.lstrip(b"\r\n").startswith(b"WARC/")


def _first_intact_record(path: str, gz: bool) -> tuple[int | None, bool]:
    """(offset, gzip?) of the first intact record after a damaged start, or (None, gz).

    Looks for a gzip member that inflates to `WARC/` and for a plain `WARC/1.` line, so a file
    whose first member is garbled (its gzip magic included) still yields the records after it.
    An ARC or text file has neither and stays not_warc."""
    with open(path, "rb") as f:
        for packed in (gz, not gz):
            hit = _find_next_record(f, 1, packed)
            if hit is not None:
                return hit, packed
    return None, gz


def _find_next_record(f, pos: int, gz: bool) -> int | None:
    """Offset of the next plausible record start at or after `pos`, or None at end of file.

    Gzip: a member header whose inflated start is `WARC/`. Plain: `WARC/1.` at a line start.
    """
    needle = b"\x1f\x8b\x08" if gz else b"\nWARC/1."
    while True:
        f.seek(pos)
        window = f.read(_SCAN_CHUNK + (64 << 10))
        if len(window) < len(needle):
            return None
        searched = 0
        while True:
            hit = window.find(needle, searched, _SCAN_CHUNK + len(needle))
            if hit < 0:
                break
            if not gz:
                return pos + hit + 1
            try:
                start = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(window[hit:hit + 4096], 16)
            except zlib.error:
                start = b""
            if start.startswith(b"WARC/"):
                return pos + hit
            searched = hit + 1
        if len(window) <= _SCAN_CHUNK:
            return None
        pos += _SCAN_CHUNK


def _gzip_tail_complete(f, pos: int) -> bool:
    """Whether the gzip members from `pos` to EOF are all complete. FastWARC silently stops at
    a member cut inside its header, which is how a crawler that died mid-write leaves a file."""
    f.seek(pos)
    inflater, pending = zlib.decompressobj(16 + zlib.MAX_WBITS), False
    try:
        while chunk := f.read(1 << 20):
            while chunk:
                inflater.decompress(chunk)
                pending = not inflater.eof
                chunk = inflater.unused_data if inflater.eof else b""
                if inflater.eof:
                    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    except zlib.error:
        return True  # trailing junk is not a cut record; nothing more to say about it
    return not pending


def _triage(rec, max_bytes: int) -> _Candidate | str:
    """Classify a record and read its payload only when it may become a document."""
    rtype = str(rec.record_type)
    if rtype == "revisit":
        return "revisit"
    if rtype not in ("response", "resource", "conversion"):
        return "not_response"
    if rtype == "response" and rec.is_http:
        status = rec.http_headers.status_code
        if status is None:
            return "corrupt"  # garbled status line: the HTTP head cannot be trusted
        if status != 200:
            return "non_200"
        headers = {k.lower(): v for k, v in rec.http_headers.to_tuples()}
        content_type = headers.get("content-type", "")
        kind = "http"
    elif rtype == "response":
        return "non_html"  # e.g. dns: records
    else:
        headers = {}
        content_type = _header(rec, "Content-Type")
        kind = rtype
    mime = content_type.split(";")[0].strip().lower()
    # WET conversion records are text already; everything else must be (or sniff as) HTML.
    if kind != "conversion" and mime not in HTML_MIME_TYPES and mime not in SNIFF_MIME_TYPES:
        return "non_html"
    if rec.content_length > max_bytes:
        return "too_large"
    body = rec.reader.read()
    if kind != "conversion" and mime in SNIFF_MIME_TYPES and not _HTML_SNIFF.match(body[:2048]):
        return "non_html"
    target = _header(rec, "WARC-Target-URI")
    # Some writers (wget) wrap the URI in <>; CC and warcio tolerate it, so do we.
    url = target[1:-1].strip() if target.startswith("<") and target.endswith(">") else target
    record_id = _header(rec, "WARC-Record-ID")
    if kind == "conversion":
        # The contract keys documents by the *response* record; WET points at it.
        record_id = _header(rec, "WARC-Refers-To") or record_id
    return _Candidate(
        kind=kind,
        record_id=record_id,
        url=url,
        warc_date=_header(rec, "WARC-Date"),
        headers=headers,
        content_type=content_type,
        body=body,
        truncated=len(body) < rec.content_length or bool(_header(rec, "WARC-Truncated")),
        offset=rec.stream_pos,
    )


def _scan_records(path: str, max_bytes: int) -> Iterator[_Candidate | str]:
    """Yield a `_Candidate` or a skip reason per record; never raises on bad content."""
    gz = _is_gzip(path)
    looks_like_warc = _starts_with_warc(path, gz)
    if looks_like_warc is None:
        return
    start: int | None = 0
    if not looks_like_warc:
        # A damaged first member must not cost the intact members after it.
        start, gz = _first_intact_record(path, gz)
        if start is None:
            yield "not_warc"
            return
        yield "bad_gzip" if gz else "corrupt"
    from fastwarc.warc import ArchiveIterator

    in_damage = False  # one count per damaged region, however often resync lands inside it
    while start is not None:
        with open(path, "rb") as f:
            f.seek(start)
            last_pos, last_truncated = None, False
            try:
                # quirks_mode: tolerate old writers (ClueWeb's LF-only HTTP heads); it also
                # makes FastWARC skip a record with a garbled version line on its own.
                for rec in ArchiveIterator(f, parse_http=True, quirks_mode=True, auto_decode="none"):
                    last_pos = rec.stream_pos
                    item = _triage(rec, max_bytes)
                    in_damage = False
                    last_truncated = isinstance(item, _Candidate) and item.truncated
                    yield item
                if gz and not last_truncated and not _gzip_tail_complete(f, last_pos if last_pos is not None else start):
                    yield "truncated"
                return
            except Exception as exc:  # FastWARC raises OSError/ValueError for broken input
                if not in_damage:
                    message = str(exc).lower()
                    yield "bad_gzip" if gz and ("gzip" in message or "decompress" in message) else "corrupt"
                in_damage = True
            # Always move strictly forward so a broken member cannot loop.
            start = _find_next_record(f, (last_pos if last_pos is not None else start) + 1, gz)


# ---------------------------------------------------------------------------------------------
# Payload decoding: transfer/content encodings, then charset
# ---------------------------------------------------------------------------------------------

class _Skip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _dechunk(body: bytes) -> tuple[bytes, bool] | None:
    """Undo HTTP chunking; None if the body is not actually chunked (writers often store it
    de-chunked yet keep the header). Returns (payload, complete)."""
    out = []
    pos = 0
    while True:
        eol = body.find(b"\r\n", pos)
        if eol < 0 or eol - pos > 32:
            return (b"".join(out), False) if out else None
        size_field = body[pos:eol].split(b";")[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            return (b"".join(out), False) if out else None
        if size == 0:
            return b"".join(out), True
        chunk = body[eol + 2:eol + 2 + size]
        out.append(chunk)
        if len(chunk) < size:
            return b"".join(out), False
        pos = eol + 2 + size + 2


def _inflate(body: bytes, wbits: int, max_bytes: int) -> tuple[bytes, bool]:
    inflater = zlib.decompressobj(wbits)
    data = inflater.decompress(body, max_bytes + 1)
    if len(data) > max_bytes:
        raise _Skip("too_large")
    return data, inflater.eof


def _decode_content(body: bytes, encoding: str, max_bytes: int) -> tuple[bytes, bool]:
    """Undo Content-Encoding. Returns (payload, complete). Crawlers frequently store the
    decoded body but keep the header, so the body is only inflated when it looks encoded."""
    encoding = encoding.strip().lower()
    try:
        if encoding in ("gzip", "x-gzip") and body[:2] == b"\x1f\x8b":
            return _inflate(body, 16 + zlib.MAX_WBITS, max_bytes)
        if encoding == "deflate" and body[:1] in (b"\x78", b"\x08", b"\x18", b"\x28", b"\x38", b"\x48", b"\x58", b"\x68"):
            return _inflate(body, zlib.MAX_WBITS, max_bytes)
        if encoding in ("br", "zstd") and not _HTML_SNIFF.match(body[:2048]):
            import io

            from fastwarc.stream_io import BrotliReader, ZstdReader

            reader = (BrotliReader if encoding == "br" else ZstdReader)(io.BytesIO(body))
            data = reader.read(max_bytes + 1)
            if len(data) > max_bytes:
                raise _Skip("too_large")
            return data, True
    except (zlib.error, OSError, ValueError) as exc:
        raise _Skip("decode_error") from exc
    return body, True


def _codec(name: str | None) -> str | None:
    """Map a declared label to the codec browsers use (gb2312 -> gbk, latin1 -> cp1252)."""
    if not name:
        return None
    from resiliparse.parse.encoding import map_encoding_to_html5

    mapped = map_encoding_to_html5(name.strip().strip("\"'"), fallback_utf8=False)
    if not mapped:
        return None
    try:
        return codecs.lookup(mapped).name
    except LookupError:
        return None


def _decode_html(body: bytes, http_content_type: str) -> tuple[str, str]:
    """Bytes -> (str, charset used): HTTP charset, then <meta> charset, then detection.

    A candidate is accepted when at most 0.5% of its characters are replacement characters;
    otherwise the least damaged candidate wins, and more than 5% damage is a decode error.
    """
    from resiliparse.parse.encoding import detect_encoding

    head = body[:64 << 10]
    match = _CHARSET_PARAM.search(http_content_type or "")
    declared = _codec(match.group(1)) if match else None
    meta_or_detected = _codec(detect_encoding(head, from_html_meta=True))
    detected = _codec(detect_encoding(head))
    candidates = []
    for name in (declared, meta_or_detected, detected, "utf-8", "cp1252"):
        if name and name not in candidates:
            candidates.append(name)
    # A "latin-1" label on bytes that are valid non-ASCII UTF-8 is almost always a server
    # default, not the truth (valid multi-byte UTF-8 sequences are rare in real Latin text).
    if candidates[0] in _SINGLE_BYTE and not body.isascii():
        try:
            return body.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            pass
    best = None
    for name in candidates:
        try:
            text = body.decode(name, errors="replace")
        except LookupError:
            continue
        damage = text.count("\ufffd") / max(len(text), 1)
        if damage <= 0.005:
            return text.lstrip("\ufeff"), name
        if best is None or damage < best[0]:
            best = (damage, text, name)
    if best is None or best[0] > 0.05:
        raise _Skip("decode_error")
    return best[1].lstrip("\ufeff"), best[2]


# ---------------------------------------------------------------------------------------------
# Main-text extraction
# ---------------------------------------------------------------------------------------------

def _check_extractor(extractor: str) -> None:
    if extractor not in EXTRACTORS:
        raise ValueError(f"unknown extractor {extractor!r}; choose one of {EXTRACTORS}")
    if extractor in ("kiln", "trafilatura") and importlib.util.find_spec("trafilatura") is None:
        raise ImportError(f"extractor={extractor!r} needs trafilatura: pip install trafilatura")


def _normalise_lines(text: str) -> str:
    """One paragraph per line, no blank or padded lines (stray BOMs count as padding)."""
    lines = (line.replace("\ufeff", "").strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line)


def extract_main_text(html: str, extractor: str = "resiliparse") -> str:
    """Main text of one page, one paragraph per line.

    The pipeline passes its configured extractor (default `DEFAULT_EXTRACTOR`, "kiln"); a bare
    call stays the plain resiliparse extraction, which the sample-crawl tests measure pages by
    (kiln reduces pages that are all boilerplate to a shared menu line).
    """
    if extractor == "kiln":
        from engine.boilerplate import extract_kiln

        return _normalise_lines(extract_kiln(html))
    if extractor == "trafilatura":
        import trafilatura

        return _normalise_lines(trafilatura.extract(html, include_comments=False) or "")
    from resiliparse.extract.html2text import extract_plain_text
    from resiliparse.parse.html import HTMLTree

    tree = HTMLTree.parse(html)
    text = extract_plain_text(tree, main_content=True, alt_texts=False, links=False, form_fields=False)
    return _normalise_lines(text)


# ---------------------------------------------------------------------------------------------
# Per-record row building
# ---------------------------------------------------------------------------------------------

def normalise_warc_date(value: str) -> str:
    """WARC-Date as ISO 8601 UTC ("...Z"); an unparseable value is kept verbatim."""
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    parsed = parsed.astimezone(timezone.utc)
    spec = "microseconds" if parsed.microsecond else "seconds"
    return parsed.replace(tzinfo=None).isoformat(timespec=spec) + "Z"


def domain_of(url: str) -> str:
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return ""
    return host.lower().rstrip(".")


def bucket_resolver(domain_buckets: dict[str, str] | None, default_bucket: str):
    """domain -> bucket; a rule matches the domain itself and its subdomains, longest wins."""
    rules = sorted(((d.lower().strip("."), b) for d, b in (domain_buckets or {}).items()),
                   key=lambda rule: -len(rule[0]))

    def resolve(domain: str) -> str:
        for suffix, bucket in rules:
            if domain == suffix or domain.endswith("." + suffix):
                return bucket
        return default_bucket

    return resolve


def _text_of(cand: _Candidate, extractor: str, max_bytes: int) -> tuple[str, str]:
    """Candidate -> (text, charset). Raises _Skip with the reason to count."""
    if cand.truncated:
        raise _Skip("truncated")
    if cand.kind == "conversion":
        return cand.body.decode("utf-8", errors="replace"), "utf-8"
    body = cand.body
    if "chunked" in cand.headers.get("transfer-encoding", "").lower():
        dechunked = _dechunk(body)
        if dechunked is not None:
            body, complete = dechunked
            if not complete:
                raise _Skip("truncated")
    for encoding in reversed(cand.headers.get("content-encoding", "").split(",")):
        if encoding.strip() and encoding.strip().lower() != "identity":
            body, complete = _decode_content(body, encoding, max_bytes)
            if not complete:
                raise _Skip("truncated")
    html, charset = _decode_html(body, cand.content_type)
    try:
        text = extract_main_text(html, extractor)
    except Exception as exc:  # a parser crash on one page must not lose the file
        raise _Skip("extract_error") from exc
    return text, charset


def extract_warc(
    path: str,
    snapshot: str,
    *,
    domain_buckets: dict[str, str] | None = None,
    default_bucket: str = "web",
    extractor: str = DEFAULT_EXTRACTOR,
    max_bytes: int = 10_000_000,
    min_text_chars: int = 1,
    ranking: bool = False,
) -> Iterator[dict]:
    """Yield a `documents` row per extracted page and `{"skip_reason": r}` per dropped record.

    Handles .warc/.warc.gz/.wet/.wet.gz. Damaged content never raises; a missing file does
    (that is a configuration error, not bad data). `ranking` adds `_rank` and `_offset` to each
    row, what `extract_documents` orders repeated doc_ids by.
    """
    _check_extractor(extractor)
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    warc_file = os.path.basename(path)
    bucket_of = bucket_resolver(domain_buckets, default_bucket)
    for item in _scan_records(path, max_bytes):
        if isinstance(item, str):
            yield {"skip_reason": item}
            continue
        try:
            text, charset = _text_of(item, extractor, max_bytes)
        except _Skip as skip:
            yield {"skip_reason": skip.reason}
            continue
        if len(text.strip()) < max(min_text_chars, 1):
            yield {"skip_reason": "empty_text"}
            continue
        domain = domain_of(item.url)
        row = {
            "doc_id": doc_id_for(snapshot, item.record_id or payload_key(item.url, item.body)),
            "url": item.url,
            "domain": domain,
            "snapshot": snapshot,
            "warc_file": warc_file,
            "warc_record_id": item.record_id,
            "fetch_time": normalise_warc_date(item.warc_date),
            "charset": charset,
            "bucket": bucket_of(domain),
            "text": text,
        }
        if ranking:
            row["_rank"], row["_offset"] = _KIND_RANK[item.kind], item.offset
        yield row


def count_skips(rows) -> Counter:
    """Skip-reason counts of an `extract_warc` stream, plus `documents`."""
    counts = Counter()
    for row in rows:
        counts[row.get("skip_reason", "documents")] += 1
    return counts


# ---------------------------------------------------------------------------------------------
# Spark stage
# ---------------------------------------------------------------------------------------------

def extract_documents(spark, warc_paths: list[str], snapshot: str, **kwargs):
    """Run `extract_warc` over `warc_paths`, one Spark task per file.

    Returns (documents DataFrame with the contract columns, counts) where counts maps each
    skip reason to its number of records and `documents` to the number of rows. Files are
    read once: per-file skip counts travel as extra rows of the same output, which is persisted
    (memory and disk) so the counts and the returned DataFrame share one pass; it stays cached
    for the session (`spark.catalog.clearCache()` releases it).

    doc_ids come out unique: of records sharing one, the first by (kind rank, warc_file, index
    in `warc_paths`, offset) stays and the rest are counted as `duplicate_record`.
    """
    import pyarrow as pa
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    _check_extractor(kwargs.get("extractor", DEFAULT_EXTRACTOR))
    paths = list(warc_paths)
    raw_ddl = f"{DOCUMENTS_DDL}, skip_reason string, skip_count long, _rank int, _file int, _offset long"
    if not paths:
        return spark.createDataFrame([], DOCUMENTS_DDL), {"documents": 0}

    schema = pa.schema([(name, pa.string()) for name in DOCUMENT_COLUMNS]
                       + [("skip_reason", pa.string()), ("skip_count", pa.int64()),
                          ("_rank", pa.int32()), ("_file", pa.int32()), ("_offset", pa.int64())])

    def extract_partition(batches):
        for batch in batches:
            for index in batch.column("id").to_pylist():
                skips = Counter()
                rows = []
                for row in extract_warc(paths[index], snapshot, ranking=True, **kwargs):
                    if "skip_reason" in row:
                        skips[row["skip_reason"]] += 1
                        continue
                    rows.append({**row, "skip_reason": None, "skip_count": 1, "_file": index})
                    if len(rows) >= _ARROW_BATCH_ROWS:
                        yield pa.RecordBatch.from_pylist(rows, schema=schema)
                        rows = []
                rows.extend({"skip_reason": reason, "skip_count": n} for reason, n in sorted(skips.items()))
                if rows:
                    yield pa.RecordBatch.from_pylist(rows, schema=schema)

    # spark.range splits evenly, so n ids in n partitions gives exactly one file per task.
    raw = (
        spark.range(0, len(paths), 1, numPartitions=len(paths))
        .mapInArrow(extract_partition, raw_ddl)
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    counts = {"documents": 0}
    for row in raw.groupBy("skip_reason").agg(F.sum("skip_count").alias("n")).collect():
        counts[row["skip_reason"] or "documents"] = int(row["n"])
    documents = raw.where(F.col("skip_reason").isNull())
    # Repeated doc_ids: only the keys are shuffled to find them and the record each keeps.
    order = F.struct("_rank", "warc_file", "_file", "_offset")
    repeated = (documents.groupBy("doc_id").agg(F.count(F.lit(1)).alias("_n"), F.min(order).alias("_keep"))
                .where(F.col("_n") > 1))
    found = repeated.agg(F.count(F.lit(1)).alias("ids"), F.sum(F.col("_n") - 1).alias("extra")).first()
    if found["extra"]:
        counts["duplicate_record"] = int(found["extra"])
        counts["documents"] -= int(found["extra"])
        keep = repeated.select("doc_id", "_keep")
        if found["ids"] <= _BROADCAST_DUPLICATES:
            keep = F.broadcast(keep)
        documents = (documents.join(keep, "doc_id", "left")
                     .where(F.col("_keep").isNull() | (order == F.col("_keep"))))
    return documents.select(*DOCUMENT_COLUMNS), counts


def documents_stage(spark, warc_paths: list[str], out_dir: str, snapshot: str, **kwargs) -> dict:
    """The `documents` stage's work: `extract_documents`, then the Parquet write (one file per
    WARC file, rows by doc_id) and the per-bucket counts. Returns rows, counts, per_bucket."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from engine.spark import write_parquet_sorted

    docs, counts = extract_documents(spark, warc_paths, snapshot, **kwargs)
    rows = write_parquet_sorted(docs, out_dir, "doc_id", num_files=max(len(warc_paths), 1))
    # Counted from the written files (the bucket column only): counting `docs` again would
    # re-run the duplicate doc_id aggregate and join.
    buckets = pc.value_counts(pq.read_table(out_dir, columns=["bucket"]).column("bucket"))
    per_bucket = {b["values"].as_py(): b["counts"].as_py() for b in buckets}
    return {"rows": rows, "counts": counts, "per_bucket": per_bucket}
