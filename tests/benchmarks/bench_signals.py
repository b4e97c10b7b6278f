"""Signals throughput benchmark: Kiln's quality_signals next to datatrove's filters, per core.

    python tests/benchmarks/bench_signals.py [--quick]

Needs datatrove (a benchmark-only dependency): pip install -e '.[bench]'.

Documents: real pages (the dolma, resiliparse and Common Crawl WARC excerpts and the bundled
sample crawl, extracted with engine.documents.extract_warc as the documents stage does) and the
CCNet head documents; the full run repeats the set to get ~4x as many documents.

Kiln (`docs_per_s_per_core`, the headline): the quality_signals stage as it runs, on Spark
local[2]: the documents read from Parquet, `compute_signals` (mapInPandas over Arrow batches) and
the sorted Parquet write, wall clock divided by the 2 cores, after a warm-up run that starts the
Python workers and loads the models. The stage's defaults: lid.176 language ID,
Gopher/C4/FineWeb statistics with C4's per-line facts, PII counts, a fastText quality classifier
(trained here on the same pages, as the quality_classifier stage would), and 112-permutation
MinHash signatures. `function_docs_per_s_per_core` is `signals_for_batch` alone (the function
each Spark task runs on its batch), in CPU seconds of this process.
datatrove: LanguageFilter, GopherRepetitionFilter, GopherQualityFilter, C4QualityFilter
(FineWeb's settings: filter_no_terminal_punct=False) and FineWebQualityFilter, each called on
every document, since Kiln also computes every statistic of every document so that thresholds
can change later. A datatrove pipeline stops at the first filter that drops a document; that
variant is reported too (`datatrove_pipeline_docs_per_s_per_core`).

Per core: datatrove and the function figure are CPU seconds of this process (one core each,
fastText predicts on one thread), the best of several alternating rounds; the stage is wall
clock / cores, best of its timed runs, so other work on a shared machine lowers it (and `ratio`,
stage vs datatrove) where it does not lower the CPU figures: compare figures of one quiet run.

Changes needed to run datatrove 0.10 here, offline:
- datatrove tokenises English with spaCy (not installed here). The filters take a WordTokenizer
  instead of a language code; `OfflineNLTKTokenizer` below is NLTK's `word_tokenize` without its
  data files: the Treebank word tokenizer (pure regex) over sentences from an untrained
  PunktSentenceTokenizer (NLTK's punkt English model is a download). That is the tokenisation
  FineWeb was built with (datatrove's NLTK tokenizer), minus punkt's trained abbreviation list.
- LanguageFilter downloads lid.176.bin on first use; here its model is set to the same
  lid.176.ftz file Kiln uses (`FT176LID._model`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("KILN_SHARED_DATA", REPO.parent / "shared" / "data"))

from engine.classifier import train_quality_classifier  # noqa: E402
from engine.documents import extract_warc  # noqa: E402
from engine.filters import FilterConfig  # noqa: E402
from engine.langid import ensure_lid_model, load_fasttext_model  # noqa: E402
from engine.sample_crawl import generate_sample_crawl  # noqa: E402
from engine.signals import SignalResources, signals_for_batch  # noqa: E402
from workflows.config import PipelineConfig  # noqa: E402


def load_documents(tmp: Path) -> pd.DataFrame:
    warcs = sorted((SHARED / "warc").glob("*/*.warc.gz")) + sorted((SHARED / "warc").glob("*/*.warc"))
    generate_sample_crawl(str(tmp / "sample"), seed=0, num_pages=300, num_files=1)
    warcs += sorted((tmp / "sample").rglob("*.warc.gz"))
    rows = []
    for path in warcs:
        rows += [{"url": r["url"], "text": r["text"]} for r in extract_warc(str(path), "bench") if "text" in r]
    for path in sorted((SHARED / "quality" / "ccnet_head_docs").glob("*.jsonl")):
        rows += [{"url": None, "text": json.loads(line)["text"]} for line in path.read_text().splitlines()]
    frame = pd.DataFrame(rows)
    frame.insert(0, "doc_id", [f"d{i:06d}" for i in range(len(frame))])
    return frame


def require_datatrove():
    try:
        import datatrove  # noqa: F401
        from datatrove.utils.word_tokenizers import WordTokenizer
    except ImportError:
        raise SystemExit("bench_signals needs datatrove, a benchmark-only dependency: pip install -e '.[bench]'") from None
    return WordTokenizer


def datatrove_filters(lid_path: str, languages: list[str]):
    WordTokenizer = require_datatrove()
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
        LanguageFilter,
    )
    from datatrove.utils.word_tokenizers import strip_strings
    from nltk.tokenize import NLTKWordTokenizer
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    class OfflineNLTKTokenizer(WordTokenizer):
        """nltk.word_tokenize (Treebank words over punkt sentences) without NLTK data files."""

        def __init__(self):
            super().__init__("en")
            self._words = NLTKWordTokenizer()
            self._sentences = PunktSentenceTokenizer()  # untrained: no abbreviation list

        def word_tokenize(self, text: str) -> list[str]:
            return strip_strings([t for s in self._sentences.tokenize(text) for t in self._words.tokenize(s)])

        def sent_tokenize(self, text: str) -> list[str]:
            return strip_strings(self._sentences.tokenize(text))

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return list(self._sentences.span_tokenize(text))

    tokenizer = OfflineNLTKTokenizer()
    language = LanguageFilter(languages=languages, language_threshold=0.65)
    language.model._model = load_fasttext_model(lid_path)  # instead of downloading lid.176.bin
    return [
        language,
        GopherRepetitionFilter(language=tokenizer),
        GopherQualityFilter(language=tokenizer),
        C4QualityFilter(filter_no_terminal_punct=False, language=tokenizer),
        FineWebQualityFilter(language=tokenizer),
    ]


def run_datatrove(filters, texts: list[str], stop_at_first: bool) -> int:
    from datatrove.data import Document

    kept = 0
    for i, text in enumerate(texts):
        passed = True
        for f in filters:
            # C4QualityFilter rewrites the text of documents it keeps: each filter gets the page.
            result = f.filter(Document(text=text, id=str(i)))
            ok = result if isinstance(result, bool) else result[0]
            passed = passed and bool(ok)
            if stop_at_first and not passed:
                break
        kept += passed
    return kept


def timed(fn) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


def spark_stage_rate(docs: pd.DataFrame, lid_path: str, classifier_path: str, cfg, tmp: Path,
                     rounds: int) -> tuple[float, float, int]:
    """(docs/s per core, best wall seconds, cores) of the quality_signals stage's Spark work: the
    documents read from Parquet (one file per core, as `documents` writes one per WARC file),
    compute_signals and the sorted Parquet write, as the stage runs them."""
    from engine.signals import compute_signals
    from engine.spark import get_spark, write_parquet_sorted

    spark = get_spark("local[2]")
    cores = spark.sparkContext.defaultParallelism
    write_parquet_sorted(spark.createDataFrame(docs), str(tmp / "documents"), "doc_id", num_files=cores)

    def run(source: str, out: str):
        signals = compute_signals(spark, spark.read.parquet(source), lid_model_path=lid_path,
                                  classifier_model_path=classifier_path, badword_paths=[], url_blocklist=[],
                                  num_perm=cfg.num_perm, ngram=cfg.ngram, minhash_seed=cfg.minhash_seed)
        write_parquet_sorted(signals, out, "doc_id", num_files=cores)

    # Warm-up on a slice: Python workers start and load the models, the JVM compiles the query path.
    write_parquet_sorted(spark.createDataFrame(docs.head(64)), str(tmp / "warmup-docs"), "doc_id", num_files=cores)
    run(str(tmp / "warmup-docs"), str(tmp / "warmup"))
    best = min(timed(lambda i=i: run(str(tmp / "documents"), str(tmp / f"signals-{i}")))[1] for i in range(rounds))
    return len(docs) / best / cores, best, cores


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one copy of the pages, fewer rounds (about a minute)")
    args = parser.parse_args()
    require_datatrove()
    signals_cfg = PipelineConfig().quality_signals
    languages = FilterConfig().languages
    with tempfile.TemporaryDirectory(prefix="bench-signals-") as tmp_name:
        tmp = Path(tmp_name)
        docs = load_documents(tmp)
        if not args.quick:
            docs = pd.concat([docs] * 4, ignore_index=True)
            docs["doc_id"] = [f"d{i:06d}" for i in range(len(docs))]
        texts = docs["text"].tolist()

        lid_path = ensure_lid_model(str(REPO / ".kiln" / "models"))
        half = len(texts) // 2
        classifier_path = str(tmp / "quality.bin")
        train_quality_classifier(texts[:half], texts[half:], classifier_path, epoch=2)
        resources = SignalResources.from_config(
            lid_model_path=lid_path, classifier_model_path=classifier_path, num_perm=signals_cfg.num_perm,
            ngram=signals_cfg.ngram, minhash_seed=signals_cfg.minhash_seed,
        )
        filters = datatrove_filters(lid_path, languages)

        # Warm up: models loaded, regexes compiled, caches filled on both sides.
        signals_for_batch(docs.head(20), resources)
        run_datatrove(filters, texts[:20], stop_at_first=False)

        best = {"kiln": float("inf"), "datatrove": float("inf"), "datatrove_pipeline": float("inf")}
        kept = {}
        for _ in range(2 if args.quick else 3):
            best["kiln"] = min(best["kiln"], timed(lambda: signals_for_batch(docs, resources))[0])
            best["datatrove"] = min(best["datatrove"], timed(
                lambda: kept.__setitem__("all", run_datatrove(filters, texts, stop_at_first=False)))[0])
            best["datatrove_pipeline"] = min(best["datatrove_pipeline"], timed(
                lambda: kept.__setitem__("pipeline", run_datatrove(filters, texts, stop_at_first=True)))[0])
        rates = {name: len(texts) / seconds for name, seconds in best.items()}
        stage_rate, stage_wall, cores = spark_stage_rate(docs, lid_path, classifier_path, signals_cfg, tmp,
                                                         rounds=1 if args.quick else 2)
        result = {
            "benchmark": "bench_signals",
            "docs_per_s_per_core": round(stage_rate, 1),
            "datatrove_docs_per_s_per_core": round(rates["datatrove"], 1),
            "ratio": round(stage_rate / rates["datatrove"], 3),
            "function_docs_per_s_per_core": round(rates["kiln"], 1),
            "function_ratio": round(rates["kiln"] / rates["datatrove"], 3),
            "datatrove_pipeline_docs_per_s_per_core": round(rates["datatrove_pipeline"], 1),
            "stage_wall_s": round(stage_wall, 2),
            "stage_cores": cores,
            "documents": len(texts),
            "mean_chars": round(sum(map(len, texts)) / len(texts)),
            "datatrove_kept": kept["all"],
            "quick": args.quick,
        }
    print(f"{len(texts)} documents, mean {result['mean_chars']} characters; CPU seconds, best of rounds: "
          + ", ".join(f"{k} {v:.2f}s" for k, v in best.items())
          + f"; quality_signals stage on Spark local[{cores}]: {stage_wall:.2f}s wall")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
