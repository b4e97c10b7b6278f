"""Extraction benchmark: quality against hand-made article bodies, a golden check against
Common Crawl's own WET text, and throughput of the `documents` Spark stage.

    python tests/benchmarks/bench_extraction.py [--quick]

Quality: the Scrapinghub Article Extraction Benchmark (181 real news/blog pages, ground-truth
article bodies). Every extractor goes through `engine.documents.extract_main_text`, the call the
pipeline makes. Per page: token precision/recall/F1 (`engine.boilerplate.token_prf`: lower-cased
\\w+ tokens as multisets); reported: the mean over pages of each (`f1` = mean per-page F1, so a
page is a page however long), plus the benchmark's own metric (`f1_aeb`: 4-gram shingles,
per-page normalised, F1 of mean precision and mean recall; repo evaluate.py). Cost: CPU ms per
page (process time; the machine is shared, so wall time also counts other people's work).
Extractors: kiln (default), kiln without its trafilatura fallback, resiliparse, trafilatura.
--quick scores every third page.

Golden: whirlwind.warc.gz (one CC-MAIN-2024-22 capture) against whirlwind.warc.wet, the text CC
extracted from the same record. The WET keeps every visible line (menus, language lists,
footer), so a main-text extractor's recall against it is low by design; `whirlwind_similarity`
is the token F1, `whirlwind_precision` the share of Kiln's tokens that CC's text also has (the
floor tests/test_extraction.py asserts).

Throughput: a corpus of WARC files (one gzip member per response record, as Common Crawl writes
them) cycling through real HTML: the benchmark pages and every HTML response in the shared WARC
files. 20,000 records in 8 files (--quick: 800 in 4). Kiln: the whole `documents` stage on
Spark local[2], `engine.documents.documents_stage` as assets/documents.py calls it (extraction,
duplicate doc_ids, the sorted Parquet write, the per-bucket counts), after a warm-up that starts
the JVM and one Python worker per core; docs/s divided by the 2 cores (`docs_per_s_per_core`).
Its extraction part alone (`extract_documents`, timed inside the same run) is
`extract_docs_per_s_per_core`. Loop: `extract_warc` over the same files in one process, no
write. ratio = the stage per core / loop (`extract_ratio`: the extraction part / loop). Parallel loop: the same loop in 2 processes at once (no Spark); its per-core rate over the
single loop (`parallel_scaling`) is what two cores of this machine give at best, and
`ratio_vs_parallel_loop` is Spark's own share of the gap. On a shared machine other jobs take cores from both sides unevenly, so the same ratio is
also given in CPU time (`cpu_ratio`: documents per CPU-second of the JVM and its Python workers
vs. of the loop), which measures Spark's own overhead. trafilatura: the same loop with
extractor="trafilatura" over one pass through the page pool (every third page with --quick),
next to Kiln's loop over the same records (`speedup_vs_trafilatura`, wall and CPU).
--quick is a smoke run: on 800 records Spark's fixed cost (task start-up, JIT) dominates the
ratio, which only means something at the full size.
"""
from __future__ import annotations

import argparse
import difflib
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("KILN_SHARED_DATA", REPO.parent / "shared" / "data"))
AEB = SHARED / "extraction" / "scrapinghub_aeb"
WARC_DIR = SHARED / "warc"
WHIRLWIND = WARC_DIR / "cc_whirlwind"

import engine.documents as documents_engine  # noqa: E402
from engine.boilerplate import token_prf  # noqa: E402
from engine.documents import (  # noqa: E402
    HTML_MIME_TYPES,
    _decode_html,
    documents_stage,
    extract_main_text,
    extract_warc,
)

EXTRACTORS = ("kiln", "kiln_no_fallback", "resiliparse", "trafilatura")
_TOKEN = re.compile(r"\w+")


# ----------------------------------------------------------------------------- quality


def load_aeb(step: int) -> list[tuple[str, str, str]]:
    """(page id, html, ground-truth body) for every `step`-th page in id order."""
    truth = json.loads((AEB / "ground-truth.json").read_text(encoding="utf-8"))
    pages = []
    for key in sorted(truth)[::step]:
        raw = gzip.decompress((AEB / "html" / f"{key}.html.gz").read_bytes())
        html, _ = _decode_html(raw, "text/html")
        pages.append((key, html, truth[key].get("articleBody") or ""))
    return pages


def _extract(html: str, extractor: str) -> str:
    if extractor == "kiln_no_fallback":
        from engine.boilerplate import extract_kiln

        return extract_kiln(html, fallback=False)
    return extract_main_text(html, extractor)


def _aeb_shingle_counts(reference: str, candidate: str, n: int = 4) -> tuple[float, float, float]:
    """(tp, fp, fn) over 4-token shingles, normalised per page, as the AEB's evaluate.py does."""
    def shingles(text):
        tokens = _TOKEN.findall(text)
        return Counter(tuple(tokens[i:i + n]) for i in range(max(1, len(tokens) - n + 1)) if tokens[i:i + n])

    ref, cand = shingles(reference), shingles(candidate)
    tp = sum((ref & cand).values())
    fp, fn = sum((cand - ref).values()), sum((ref - cand).values())
    total = tp + fp + fn
    return (tp / total, fp / total, fn / total) if total else (0.0, 0.0, 0.0)


def _aeb_f1(counts: list[tuple[float, float, float]]) -> float:
    def ratio(a, b):
        return 1.0 if b == 0 else a / b
    precision = statistics.mean(ratio(tp, tp + fp) if fp or fn else 1.0 for tp, fp, fn in counts if tp + fp > 0)
    recall = statistics.mean(ratio(tp, tp + fn) if fp or fn else 1.0 for tp, fp, fn in counts if tp + fn > 0)
    return 2 * precision * recall / (precision + recall)


def score_extractor(pages, extractor: str) -> dict:
    prf, shingle_counts = [], []
    cpu = wall = 0.0
    for _, html, truth in pages:
        c0, w0 = time.process_time(), time.perf_counter()
        text = _extract(html, extractor)
        cpu += time.process_time() - c0
        wall += time.perf_counter() - w0
        prf.append(token_prf(truth, text))
        shingle_counts.append(_aeb_shingle_counts(truth, text))
    return {
        "f1": statistics.mean(f for _, _, f in prf),
        "precision": statistics.mean(p for p, _, _ in prf),
        "recall": statistics.mean(r for _, r, _ in prf),
        "f1_aeb": _aeb_f1(shingle_counts),
        "cpu_ms_per_page": 1000 * cpu / len(pages),
        "wall_ms_per_page": 1000 * wall / len(pages),
    }


# ----------------------------------------------------------------------------- golden


def whirlwind_golden() -> dict:
    (wet,) = [r for r in extract_warc(str(WHIRLWIND / "whirlwind.warc.wet"), "S") if "doc_id" in r]
    (kiln,) = [r for r in extract_warc(str(WHIRLWIND / "whirlwind.warc.gz"), "S") if "doc_id" in r]
    precision, recall, f1 = token_prf(wet["text"], kiln["text"])
    ordered = difflib.SequenceMatcher(None, _TOKEN.findall(wet["text"].lower()),
                                      _TOKEN.findall(kiln["text"].lower()), autojunk=False).ratio()
    return {"whirlwind_similarity": f1, "whirlwind_precision": precision, "whirlwind_recall": recall,
            "whirlwind_difflib_ratio": ordered}


# ----------------------------------------------------------------------------- throughput


def html_pool() -> list[tuple[str, bytes]]:
    """(Content-Type, payload) of real pages: the AEB pages and the shared WARCs' HTML responses."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType

    pool = [("text/html; charset=utf-8", gzip.decompress(p.read_bytes())) for p in sorted((AEB / "html").glob("*.html.gz"))]
    for path in sorted(WARC_DIR.rglob("*.warc*")):
        if ".wet" in path.name or ".wat" in path.name:
            continue
        with open(path, "rb") as stream:
            try:
                for rec in ArchiveIterator(stream, record_types=WarcRecordType.response, parse_http=True,
                                           auto_decode="all", quirks_mode=True):
                    if not rec.is_http or rec.http_headers.status_code != 200:
                        continue
                    content_type = rec.http_headers.get("Content-Type") or ""
                    if content_type.split(";")[0].strip().lower() in HTML_MIME_TYPES:
                        pool.append((content_type, rec.reader.read()))
            except Exception:  # the deliberately damaged test files: keep what came before the damage
                continue
    # Deterministic mix, so every file holds every kind of page.
    pool.sort(key=lambda item: uuid.uuid5(uuid.NAMESPACE_URL, item[1][:4096].hex()).hex)
    return pool


def _record(index: int, content_type: str, payload: bytes) -> bytes:
    url = f"https://bench-{index % 997}.example/page/{index}"
    http = (f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n\r\n"
            .encode("latin-1") + payload)
    head = ("WARC/1.0\r\nWARC-Type: response\r\n"
            f"WARC-Record-ID: <urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, url)}>\r\n"
            f"WARC-Target-URI: {url}\r\nWARC-Date: 2024-05-18T01:58:10Z\r\n"
            f"Content-Type: application/http; msgtype=response\r\nContent-Length: {len(http)}\r\n\r\n").encode("latin-1")
    return gzip.compress(head + http + b"\r\n\r\n", compresslevel=1, mtime=0)


def write_corpus(pool, out_dir: str, records: int, files: int, prefix: str = "bench") -> list[str]:
    paths = [os.path.join(out_dir, f"{prefix}-{i:03d}.warc.gz") for i in range(files)]
    handles = [open(p, "wb") for p in paths]
    for i in range(records):
        content_type, payload = pool[i % len(pool)]
        handles[i % files].write(_record(i, content_type, payload))
    for handle in handles:
        handle.close()
    return paths


def _tree_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process's descendants that are still
    alive: the Spark JVM and its Python workers."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[tuple[int, float]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        children.setdefault(int(fields[1]), []).append((int(entry), (int(fields[11]) + int(fields[12])) / tick))

    def walk(pid: int) -> float:
        return sum(cpu + walk(child) for child, cpu in children.get(pid, []))

    return walk(os.getpid())


def loop_rates(paths: list[str], extractor: str = "kiln") -> dict:
    wall0, cpu0, docs = time.perf_counter(), time.process_time(), 0
    for path in paths:
        docs += sum("doc_id" in row for row in extract_warc(path, "BENCH", extractor=extractor))
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"docs": docs, "docs_per_s": docs / wall, "docs_per_cpu_s": docs / cpu}


def _count_docs(path: str) -> int:
    return sum("doc_id" in row for row in extract_warc(path, "BENCH", extractor="kiln"))


def parallel_loop_rates(paths: list[str], cores: int) -> dict:
    """The plain loop in `cores` processes at once, files shared out like Spark's tasks: what
    the machine gives per core with no framework at all (cores of a VM need not be independent)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        pool.map(_count_docs, paths[:cores])  # start the workers and import the extractors
        wall0 = time.perf_counter()
        docs = sum(pool.map(_count_docs, paths, chunksize=1))
        wall = time.perf_counter() - wall0
    return {"docs": docs, "docs_per_s": docs / wall, "docs_per_s_per_core": docs / wall / cores}


def spark_rates(paths: list[str], warmup: str, cores: int, out_dir: str) -> dict:
    """The `documents` stage end to end, and (timed inside it) its extract_documents part."""
    from engine.spark import get_spark

    spark = get_spark(f"local[{cores}]")
    # Start the JVM and one Python worker per core before the clock does (the same warm-up file
    # twice also takes the duplicate-doc_id path once).
    documents_stage(spark, [warmup] * cores, os.path.join(out_dir, "warmup"), "WARMUP")
    spark.catalog.clearCache()
    extract = documents_engine.extract_documents
    marks = {}

    def timed_extract(*args, **kwargs):
        result = extract(*args, **kwargs)  # returns once the files are read and counted
        marks["extracted"] = time.perf_counter(), _tree_cpu_seconds() + time.process_time()
        return result

    documents_engine.extract_documents = timed_extract
    try:
        wall0, cpu0 = time.perf_counter(), _tree_cpu_seconds() + time.process_time()
        result = documents_stage(spark, paths, os.path.join(out_dir, "documents"), "BENCH")
        wall, cpu = time.perf_counter() - wall0, _tree_cpu_seconds() + time.process_time() - cpu0
    finally:
        documents_engine.extract_documents = extract
    spark.catalog.clearCache()
    docs = result["rows"]
    extract_wall, extract_cpu = marks["extracted"][0] - wall0, marks["extracted"][1] - cpu0
    return {"docs": docs, "docs_per_s": docs / wall, "docs_per_s_per_core": docs / wall / cores,
            "docs_per_cpu_s": docs / cpu, "wall_s": wall,
            "extract_docs_per_s_per_core": docs / extract_wall / cores, "extract_docs_per_cpu_s": docs / extract_cpu,
            "skipped": {k: v for k, v in result["counts"].items() if k != "documents"}}


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    step = 3 if args.quick else 1
    records, files, cores = (800, 4, 2) if args.quick else (20_000, 8, 2)
    result = {"benchmark": "bench_extraction", "quick": args.quick, "loadavg_1m": os.getloadavg()[0]}

    pages = load_aeb(step)
    print(f"quality: {len(pages)} AEB pages", flush=True)
    for extractor in EXTRACTORS:  # imports and first-call set-up are not per-page cost
        for _, html, _ in pages[:3]:
            _extract(html, extractor)
    scores = {}
    for extractor in EXTRACTORS:
        scores[extractor] = score_extractor(pages, extractor)
        s = scores[extractor]
        print(f"  {extractor:<17} F1 {s['f1']:.4f} (P {s['precision']:.4f} R {s['recall']:.4f})  "
              f"AEB-F1 {s['f1_aeb']:.4f}  {s['cpu_ms_per_page']:6.1f} ms/page CPU  "
              f"{s['wall_ms_per_page']:6.1f} ms/page wall", flush=True)

    golden = whirlwind_golden()
    print("golden (whirlwind vs CC WET): " + ", ".join(f"{k} {v:.3f}" for k, v in golden.items()), flush=True)

    pool = html_pool()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-extraction-") as tmp:
        paths = write_corpus(pool, tmp, records, files)
        warmup = write_corpus(pool[:20], tmp, 20, 1, prefix="warmup")[0]
        sample = pool[::step]
        traf_paths = write_corpus(sample, tmp, len(sample), 1, prefix="trafilatura")
        size_mb = sum(os.path.getsize(p) for p in paths) / 2**20
        print(f"throughput: {records} records in {files} files ({size_mb:.0f} MiB gzip), pool of {len(pool)} pages",
              flush=True)
        spark = spark_rates(paths, warmup, cores, tmp)
        print(f"  kiln, documents stage on Spark local[{cores}] (with its Parquet write): {spark['docs']} docs, "
              f"{spark['docs_per_s']:.1f} docs/s = {spark['docs_per_s_per_core']:.1f} docs/s per core; "
              f"{spark['docs_per_cpu_s']:.1f} docs per CPU-s (JVM and workers); extract_documents part alone "
              f"{spark['extract_docs_per_s_per_core']:.1f} docs/s per core", flush=True)
        loop = loop_rates(paths)
        print(f"  kiln, one-process loop: {loop['docs']} docs, {loop['docs_per_s']:.1f} docs/s; "
              f"{loop['docs_per_cpu_s']:.1f} docs per CPU-s", flush=True)
        parallel = parallel_loop_rates(paths, cores)
        print(f"  kiln, plain loop in {cores} processes (no Spark): {parallel['docs_per_s']:.1f} docs/s = "
              f"{parallel['docs_per_s_per_core']:.1f} docs/s per core", flush=True)
        traf = loop_rates(traf_paths, "trafilatura")
        kiln_same = loop_rates(traf_paths, "kiln")
        print(f"  trafilatura loop over {traf['docs']} pages: {traf['docs_per_s']:.1f} docs/s "
              f"({traf['docs_per_cpu_s']:.1f} per CPU-s); kiln loop on them: {kiln_same['docs_per_s']:.1f} docs/s "
              f"({kiln_same['docs_per_cpu_s']:.1f} per CPU-s)", flush=True)

    kiln_q, traf_q = scores["kiln"], scores["trafilatura"]
    result.update({
        "aeb_pages": len(pages),
        "f1": kiln_q["f1"],
        "f1_trafilatura": traf_q["f1"],
        "f1_gap_vs_trafilatura": kiln_q["f1"] - traf_q["f1"],
        "f1_aeb": kiln_q["f1_aeb"],
        "f1_aeb_trafilatura": traf_q["f1_aeb"],
        "extractors": {name: {k: round(v, 4) for k, v in s.items()} for name, s in scores.items()},
        **golden,
        "records": records,
        "documents": spark["docs"],
        # The documents stage with its Parquet write, per core; and its extraction part alone.
        "docs_per_s_per_core": spark["docs_per_s_per_core"],
        "extract_docs_per_s_per_core": spark["extract_docs_per_s_per_core"],
        "stage_wall_s": spark["wall_s"],
        "loop_docs_per_s": loop["docs_per_s"],
        "ratio": spark["docs_per_s_per_core"] / loop["docs_per_s"],
        "extract_ratio": spark["extract_docs_per_s_per_core"] / loop["docs_per_s"],
        # Per-core rate of the same loop run in `cores` processes: the machine's own scaling, so
        # ratio_vs_parallel_loop is Spark's share of the gap and parallel_scaling the hardware's.
        "parallel_loop_docs_per_s_per_core": parallel["docs_per_s_per_core"],
        "parallel_scaling": parallel["docs_per_s_per_core"] / loop["docs_per_s"],
        "ratio_vs_parallel_loop": spark["docs_per_s_per_core"] / parallel["docs_per_s_per_core"],
        # The same comparison in CPU time, which other people's jobs on a shared machine do not skew.
        "spark_docs_per_cpu_s": spark["docs_per_cpu_s"],
        "loop_docs_per_cpu_s": loop["docs_per_cpu_s"],
        "cpu_ratio": spark["docs_per_cpu_s"] / loop["docs_per_cpu_s"],
        "trafilatura_docs_per_s": traf["docs_per_s"],
        "trafilatura_docs_per_cpu_s": traf["docs_per_cpu_s"],
        "kiln_loop_docs_per_s_on_trafilatura_pages": kiln_same["docs_per_s"],
        "speedup_vs_trafilatura": kiln_same["docs_per_s"] / traf["docs_per_s"],
        "cpu_speedup_vs_trafilatura": kiln_same["docs_per_cpu_s"] / traf["docs_per_cpu_s"],
        "per_core_speedup_vs_trafilatura": spark["docs_per_s_per_core"] / traf["docs_per_s"],
        "loadavg_1m_end": os.getloadavg()[0],
    })
    if spark["skipped"].get("duplicate_record"):
        raise SystemExit(f"every benchmark record has its own id, yet the stage dropped {spark['skipped']}")
    if spark["docs"] != loop["docs"]:
        raise SystemExit(f"Spark stage and loop disagree: {spark['docs']} vs {loop['docs']} documents")
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()}))


if __name__ == "__main__":
    main()
