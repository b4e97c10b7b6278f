"""Deduplication benchmark: quality against brute-force Jaccard, speed against datasketch
(and text-dedup's MinHash script where it is importable).

    python tests/benchmarks/bench_dedup.py [--quick] [--sizes 25000,50000,100000]
    python tests/benchmarks/bench_dedup.py --bucket-ab 100000 [--quick]
    KILN_TEXT_DEDUP_PYTHON=/tmp/td/bin/python python tests/benchmarks/bench_dedup.py ...

Data: real text (Pride and Prejudice, tinyshakespeare, the Scrapinghub AEB article bodies)
cut into ~300-word documents of a few paragraphs; larger sets add documents made of
sentences sampled from the same text. Planted duplicates are edited copies: word
insertions, deletions, substitutions, boilerplate lines added, paragraphs reordered,
case/whitespace-only copies, and edits of edits (chains), with strengths spread so true
Jaccard covers roughly 0.3-1.0.

Quality (labelled set, every pair): true Jaccard J of the shingle sets (engine.minhash
definition, 32-bit shingle hashes) for all pairs via a sparse product. Predicted pairs are
all pairs inside one duplicate cluster (what deduplication acts on):
  precision_08    = predicted pairs with J >= 0.8 / predicted pairs
  recall_08       = predicted pairs with J >= 0.8 / pairs with J >= 0.8
  precision_05_08 = predicted pairs with 0.5 <= J < 0.8 / predicted pairs with J < 0.8
                    (the band on its own: of what was merged below 0.8, the share that is at
                    least a loose duplicate; null when nothing below 0.8 was merged)
  recall_05_08    = predicted pairs with 0.5 <= J < 0.8 / pairs with 0.5 <= J < 0.8
Kiln's default (candidate edges verified on exact shingle Jaccard >= 0.8; the full run adds
no verification and signature-estimated verification) is shown beside datasketch
MinHashLSH with the same bands x rows on the same signatures, union-find (no verification,
so it must match Kiln's no_verify row exactly).

Speed: each side runs in its own process from a Parquet file of texts, timed from texts in
memory to clusters; peak RSS is the process tree's (Spark: driver, JVM, Python workers)
sampled from /proc. Kiln: Spark local[2] computing signatures with the function
`quality_signals` calls per Arrow batch (engine.signals._minhash_bytes, with the
quality_signals section of workflows/pipeline.yaml) in mapInPandas, then `deduplicate`
with the pipeline's dedup section. `docs_per_s` EXCLUDES the Spark session start
(`kiln_session_start_s`, reported separately), reading the texts into memory (the baselines
exclude it too) and, in full runs, a 200-document warm-up (`kiln_warmup_s`);
`docs_per_s_with_session_start` divides by session start + warm-up + run instead.
Baseline: one process, MinHash.bulk (datasketch's default scheme, its fastest) on the same
shingles, MinHashLSH insert + query, union-find. Wall clock on a shared machine also counts
waiting for a core, so process-tree CPU seconds are reported too (cpu_docs_per_s); the
JSON's docs_per_s and ratio are wall clock.

text-dedup (optional, `textdedup` in the JSON): text-dedup 0.4.0's `text_dedup.minhash`
(datasets + multiprocessing, num_proc 2 like Kiln's local[2]; 112 permutations, 14 x 8
bands, 5-grams, min_length 0, its own tokenisation, sha1 and seed, no verification), run
offline (HF_DATASETS_OFFLINE=1) on the same Parquet files by the interpreter in
$KILN_TEXT_DEDUP_PYTHON, else this one if it imports text_dedup; otherwise skipped with the
reason printed. It installs from PyPI into its own venv (python3.11 -m venv /tmp/td &&
/tmp/td/bin/pip install text-dedup==0.4.0, ~30 s, 80 packages) but not next to Kiln's pins:
it requires urllib3<=2.0 (Kiln: urllib3>=2.0; pip: ResolutionImpossible, 2.0.0 is not on the
index) and pulls pandas 3, onnxruntime and Sphinx, so it is no `bench` extra. Its seconds are
its own timers' MinHashing + Clustering + Filtering (texts already in its Arrow cache, like
the others); its Loading (Parquet -> Arrow cache) and Saving are in textdedup_total_s.

--bucket-ab DOCS: candidate buckets as engine.dedup builds them (Window min over
partitionBy(band, band_hash)) against two groupBy(band, band_hash) forms (collect_list +
explode; min/count joined back), same edges asserted, interleaved repeats, medians.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("KILN_SHARED_DATA", REPO.parent / "shared" / "data"))

from engine.minhash import compute_signatures, shingle_hashes, shingles  # noqa: E402

DOC_WORDS = 300
BOILERPLATE = [
    "Share this article on Facebook Twitter LinkedIn and Email",
    "Sign up for our newsletter to get the latest stories delivered to your inbox",
    "Home News Sport Business Culture Opinion Travel Video Podcasts",
    "Copyright 2024 All rights reserved Privacy Policy Terms of Use Cookie Settings",
    "Advertisement Continue reading the main story below",
    "Related articles you might also like from our editors",
    "Accept cookies We use cookies to improve your experience on our site",
    "Follow us on Instagram and YouTube for more updates every day",
]


# ----------------------------------------------------------------------------- data


def load_paragraphs() -> list[list[str]]:
    """Paragraph streams, one per source, in reading order."""
    pp = (SHARED / "prose" / "gutenberg_pride_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    pp = pp[pp.find("Chapter 1") : pp.find("End of the Project Gutenberg")]
    shakespeare = (SHARED / "prose" / "tinyshakespeare" / "data_tinyshakespeare_input.txt").read_text()
    aeb = json.loads((SHARED / "extraction" / "scrapinghub_aeb" / "ground-truth.json").read_text())
    streams = [
        [" ".join(p.split()) for p in pp.split("\n\n")],
        [" ".join(p.split()) for p in shakespeare.split("\n\n")],
        [" ".join(p.split()) for a in aeb.values() for p in a["articleBody"].split("\n")],
    ]
    return [[p for p in s if p] for s in streams]


def window_docs(streams: list[list[str]]) -> list[str]:
    """Consecutive, non-overlapping ~300-word documents of whole paragraphs (long ones split)."""
    docs = []
    for stream in streams:
        current, count = [], 0
        for para in stream:
            words = para.split()
            while words:
                take = words[: DOC_WORDS - count]
                words = words[len(take) :]
                current.append(" ".join(take))
                count += len(take)
                if count >= DOC_WORDS:
                    docs.append("\n".join(current))
                    current, count = [], 0
    return docs


def sentence_docs(streams: list[list[str]], n: int, rng: random.Random) -> list[str]:
    """Documents of sentences sampled from all sources, 3-5 paragraphs of ~300 words."""
    sentences = [s for stream in streams for p in stream for s in re.split(r"(?<=[.!?])\s+", p) if len(s.split()) >= 4]
    docs = []
    for _ in range(n):
        paras, words = [[]], 0
        breaks = sorted(rng.sample(range(40, DOC_WORDS - 20), rng.randint(2, 4)))
        while words < DOC_WORDS:
            s = rng.choice(sentences)
            paras[-1].append(s)
            words += len(s.split())
            if breaks and words >= breaks[0]:
                breaks.pop(0)
                paras.append([])
        docs.append("\n".join(" ".join(p) for p in paras if p))
    return docs


def edit(text: str, rng: random.Random, vocab: list[str]) -> str:
    """One to three random edits of random strength."""
    paras = [p.split() for p in text.split("\n")]
    for _ in range(rng.choice([1, 1, 2, 3])):
        kind = rng.choice(["insert", "delete", "substitute", "boilerplate", "reorder"])
        strength = rng.randint(1, 22)
        if kind == "reorder" and len(paras) > 1:
            rng.shuffle(paras)
        elif kind == "boilerplate":
            lines = [rng.choice(BOILERPLATE).split() for _ in range(max(1, strength // 3))]
            paras = lines + paras if rng.random() < 0.5 else paras + lines
        else:
            for _ in range(strength):
                para = rng.choice([p for p in paras if p] or [paras[0]])
                pos = rng.randrange(len(para) + 1)
                if kind == "insert":
                    para[pos:pos] = rng.sample(vocab, rng.randint(1, 3))
                elif kind == "delete" and para:
                    del para[pos : pos + rng.randint(1, 4)]
                elif para:
                    para[min(pos, len(para) - 1)] = rng.choice(vocab)
    return "\n".join(" ".join(p) for p in paras if p)


def planted_set(bases: list[str], dup_fraction: float, rng: random.Random) -> list[str]:
    """Bases plus edited copies; variants of variants make chains."""
    vocab = sorted({w for b in bases[:200] for w in b.split()})
    docs = list(bases)
    for base in rng.sample(bases, int(len(bases) * dup_fraction)):
        source = base
        for _ in range(rng.choice([1, 1, 2, 3])):
            if rng.random() < 0.1:
                variant = "  ".join(source.upper().split(" "))  # exact after normalisation
            else:
                variant = edit(source, rng, vocab)
            docs.append(variant)
            if rng.random() < 0.3:
                source = variant
    rng.shuffle(docs)
    return docs


def write_docs(texts: list[str], out_dir: Path, seed: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "doc_id": [f"{i:020x}" for i in range(len(texts))],
            "text": texts,
            "classifier_score": rng.random(len(texts)),
        }
    )
    parts = 4  # several files so Spark reads with both cores
    step = -(-len(texts) // parts)
    for p in range(parts):
        pq.write_table(table.slice(p * step, step), out_dir / f"part-{p:05d}.parquet")


def read_docs(data_dir: Path):
    import pyarrow.parquet as pq

    return pq.read_table(data_dir).sort_by("doc_id")


# ----------------------------------------------------------------------------- measurement


def _process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    tree, stack = [], [root]
    while stack:
        pid = stack.pop()
        tree.append(pid)
        stack.extend(children.get(pid, []))
    return tree


def _tree_rss_bytes(root: int) -> int:
    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for pid in _process_tree(root):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * page
        except OSError:
            pass
    return total


def tree_cpu_seconds(root: int | None = None) -> float:
    """User + system CPU of a process tree, reaped children included. On a shared machine
    this measures work done, where wall time also counts waiting for a core."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for pid in _process_tree(root or os.getpid()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15])  # utime stime cutime cstime
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def run_worker(args: list[str], command: list[str] | None = None, env: dict | None = None) -> tuple[dict, float]:
    """Run this script as a worker (or `command`); return the JSON of its last stdout line and
    the process tree's peak RSS (MiB)."""
    proc = subprocess.Popen(
        command or [sys.executable, __file__, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env,
    )
    peak = 0
    done = threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _tree_rss_bytes(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"worker {command or args} failed:\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1]), peak / 2**20


def kiln_worker(data_dir: Path, out_dir: Path, variants: list[str], warm_up: bool) -> dict:
    import pandas as pd

    from engine.dedup import deduplicate
    from engine.signals import SignalResources, _minhash_bytes
    from engine.spark import get_spark
    from workflows.config import load_config

    pipeline = load_config()
    qs = pipeline.quality_signals
    # The code path of quality_signals: signals_for_batch calls _minhash_bytes(texts, resources)
    # on each Arrow batch; only the language/classifier signals are left out.
    resources = SignalResources(lid_model_path="", num_perm=qs.num_perm, ngram=qs.ngram, minhash_seed=qs.minhash_seed)
    configs = {
        "default": pipeline.dedup,  # verification on exact shingle Jaccard >= 0.8
        "no_verify": pipeline.dedup.model_copy(update={"verify_jaccard": False}),
        "verify_signature": pipeline.dedup.model_copy(update={"verify_method": "signature"}),
    }

    t_session = time.perf_counter()
    spark = get_spark("local[2]", {"spark.ui.showConsoleProgress": "false"})
    session_start = time.perf_counter() - t_session

    def signatures(batches):
        for pdf in batches:
            texts = [t if isinstance(t, str) else "" for t in pdf["text"].tolist()]  # as signals_for_batch
            yield pd.DataFrame({"doc_id": pdf["doc_id"], "minhash": _minhash_bytes(texts, resources)})

    def run(docs, cfg):
        sigs = docs.select("doc_id", "text").mapInPandas(signatures, "doc_id string, minhash binary").localCheckpoint()
        t_sig = time.perf_counter()
        kept, dups, stats = deduplicate(spark, docs, sigs, cfg)
        return dups, stats, t_sig

    t_read = time.perf_counter()
    docs = spark.read.parquet(str(data_dir)).localCheckpoint()  # texts in memory, like the baselines
    n_docs = docs.count()
    t_ready = time.perf_counter()
    if warm_up:  # JIT and Python workers; a long-running pipeline pays this once
        run(docs.limit(200).localCheckpoint(), configs["default"])
    result = {"docs": n_docs, "session_start_seconds": session_start, "read_seconds": t_ready - t_read,
              "warmup_seconds": time.perf_counter() - t_ready, "variants": {}}
    for name in variants:
        cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
        dups, stats, t_sig = run(docs, configs[name])
        t1, cpu1 = time.perf_counter(), tree_cpu_seconds()
        dups.write.mode("overwrite").parquet(str(out_dir / name))
        result["variants"][name] = {"seconds": t1 - t0, "signature_seconds": t_sig - t0, "cpu_seconds": cpu1 - cpu0, "stats": stats}
    return result


def datasketch_worker(data_dir: Path) -> dict:
    from datasketch import MinHash, MinHashLSH

    table = read_docs(data_dir)
    texts = table.column("text").to_pylist()
    ids = table.column("doc_id").to_pylist()
    cpu0, t0 = tree_cpu_seconds(), time.perf_counter()
    minhashes = MinHash.bulk((shingles(t) for t in texts), num_perm=112)
    t_sig = time.perf_counter()
    lsh = MinHashLSH(num_perm=112, params=(14, 8))
    with lsh.insertion_session() as session:
        for key, m in zip(ids, minhashes):
            session.insert(key, m)
    parent = {k: k for k in ids}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for key, m in zip(ids, minhashes):
        for other in lsh.query(m):
            ra, rb = find(key), find(other)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    roots = {find(k) for k in ids}
    t1, cpu1 = time.perf_counter(), tree_cpu_seconds()
    return {
        "docs": len(ids),
        "seconds": t1 - t0,
        "signature_seconds": t_sig - t0,
        "cpu_seconds": cpu1 - cpu0,
        "clusters_incl_singletons": len(roots),
    }


# text-dedup's MinHash script, run by an interpreter that has text_dedup; its Timer is
# patched only to read the phase times it already measures, and its union-find is read back
# so its clusters can be scored like the others.
TEXT_DEDUP_RUNNER = r"""
import json, pickle, sys, time
from text_dedup import minhash as td
timers = []
class RecordingTimer(td.Timer):
    def __init__(self):
        super().__init__()
        timers.append(self)
td.Timer = RecordingTimer
data, out, num_proc = sys.argv[1:4]
t0 = time.perf_counter()
td.main.main(["--path", "parquet", "--data_files", data + "/*.parquet", "--split", "train",
              "--cache_dir", out + "/cache", "--output", out + "/kept", "--column", "text",
              "--idx_column", "doc_id", "--num_perm", "112", "--b", "14", "--r", "8", "--ngram", "5",
              "--min_length", "0", "--num_proc", num_proc, "--debug"], standalone_mode=False)
wall = time.perf_counter() - t0
with open(out + "/kept/uf.pkl", "rb") as f:
    uf = pickle.load(f)
groups = {}
for key in list(uf.parent):
    groups.setdefault(uf.find(key), []).append(key)
print(json.dumps({"wall_seconds": wall, "phases": timers[-1].elapsed_times,
                  "clusters": [sorted(g) for g in groups.values() if len(g) > 1]}))
"""


def text_dedup_python() -> tuple[str | None, str]:
    """(interpreter, '') when text_dedup is installed there, else (None, why not). A find_spec
    probe, not an import: importing datasets costs seconds that --quick cannot spare."""
    env_python = os.environ.get("KILN_TEXT_DEDUP_PYTHON")
    python = env_python or sys.executable
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('text_dedup') is None)"
    try:
        found = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"KILN_TEXT_DEDUP_PYTHON={python}: {exc}"
    if found:
        return python, ""
    where = f"KILN_TEXT_DEDUP_PYTHON={python}" if env_python else "this interpreter (set KILN_TEXT_DEDUP_PYTHON)"
    return None, f"text_dedup is not installed for {where}"


def run_text_dedup(python: str, data_dir: Path, work: Path, num_proc: int = 2) -> tuple[dict, float]:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(work / "hf"),
           "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    run, rss = run_worker([], [python, "-c", TEXT_DEDUP_RUNNER, str(data_dir), str(work), str(num_proc)], env=env)
    phases = run["phases"]
    run["seconds"] = phases["MinHashing"] + phases["Clustering"] + phases["Filtering"]
    run["total_seconds"] = phases["Total"]
    return run, rss


def bucket_ab_worker(n_docs: int, repeats: int) -> dict:
    """Candidate buckets three ways on the same band rows: engine.dedup's Window min over
    partitionBy(band, band_hash), groupBy + collect_list + explode, and groupBy min/count
    joined back onto the band rows. Asserts identical edges; medians of interleaved repeats."""
    import pandas as pd
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    from engine.dedup import DedupConfig, _band_fn
    from engine.minhash import signatures_to_bytes
    from engine.spark import get_spark

    spark = get_spark("local[2]", {"spark.ui.showConsoleProgress": "false"})
    rng = np.random.default_rng(0)
    sig = rng.integers(0, 2**32, size=(n_docs, 112), dtype=np.uint64).astype(np.uint32)
    dup, src = rng.choice(n_docs, n_docs // 10, replace=False), rng.choice(n_docs, n_docs // 10)
    shared = np.repeat(rng.random((n_docs // 10, 14)) < 0.5, 8, axis=1)  # ~half the bands of 10% of docs
    sig[dup] = np.where(shared, sig[src], sig[dup])
    ids = [f"{i:020x}" for i in range(n_docs)]
    sigs = spark.createDataFrame(pd.DataFrame({"doc_id": ids, "minhash": signatures_to_bytes(sig)})).repartition(4)
    sigs = sigs.localCheckpoint(eager=True)
    banded = lambda: sigs.mapInPandas(_band_fn(DedupConfig()), "doc_id string, band int, band_hash long")  # noqa: E731
    edge = lambda df, root: df.where(F.col("doc_id") != F.col(root)).select(  # noqa: E731
        F.col("doc_id").alias("src"), F.col(root).alias("dst")).distinct()

    def window():
        return edge(banded().withColumn("root", F.min("doc_id").over(Window.partitionBy("band", "band_hash"))), "root")

    def groupby_collect():
        b = banded().groupBy("band", "band_hash").agg(F.min("doc_id").alias("root"), F.collect_list("doc_id").alias("m"))
        return edge(b.where(F.size("m") > 1).select(F.explode("m").alias("doc_id"), "root"), "root")

    def groupby_join():
        b = banded().groupBy("band", "band_hash").agg(F.min("doc_id").alias("root"), F.count("*").alias("c"))
        return edge(banded().join(b.where(F.col("c") > 1).drop("c"), ["band", "band_hash"]), "root")

    variants = [window, groupby_collect, groupby_join]
    reference = sorted(map(tuple, window().collect()))
    for f in variants[1:]:
        assert sorted(map(tuple, f().collect())) == reference, f.__name__
    times = {f.__name__: [] for f in variants}
    for _ in range(repeats):
        for f in variants:
            t0 = time.perf_counter()
            f().localCheckpoint(eager=True)
            times[f.__name__].append(time.perf_counter() - t0)
    medians = {k: float(np.median(v)) for k, v in times.items()}
    return {"benchmark": "bench_dedup_buckets", "docs": n_docs, "edges": len(reference), "repeats": repeats,
            "median_s": {k: round(v, 2) for k, v in medians.items()},
            "ratio_vs_window": {k: round(v / medians["window"], 2) for k, v in medians.items()}}


# ----------------------------------------------------------------------------- quality


def true_pair_jaccard(texts: list[str]):
    """Upper-triangle pairs (i, j) with J > 0 and their Jaccard, from a sparse product."""
    from scipy import sparse

    hashes, offsets = shingle_hashes(texts)
    doc = np.repeat(np.arange(len(texts)), np.diff(offsets))
    codes = np.unique((doc.astype(np.int64) << 32) | hashes.astype(np.int64))  # sets, not lists
    rows, cols = codes >> 32, codes & 0xFFFFFFFF
    _, col = np.unique(cols, return_inverse=True)
    x = sparse.csr_matrix((np.ones(len(codes), dtype=np.int32), (rows, col.ravel())), shape=(len(texts), col.max() + 1))
    sizes = np.asarray(x.sum(axis=1)).ravel()
    inter = sparse.triu(x @ x.T, k=1).tocoo()
    jac = inter.data / (sizes[inter.row] + sizes[inter.col] - inter.data)
    return inter.row.astype(np.int64), inter.col.astype(np.int64), jac


def cluster_pairs(clusters: list[list[int]], n: int) -> np.ndarray:
    codes = []
    for members in clusters:
        m = np.array(sorted(members), dtype=np.int64)
        i, j = np.triu_indices(len(m), k=1)
        codes.append(m[i] * n + m[j])
    return np.unique(np.concatenate(codes)) if codes else np.empty(0, dtype=np.int64)


def pair_metrics(pred: np.ndarray, rows, cols, jac, n: int) -> dict:
    codes = rows * n + cols
    hi = codes[jac >= 0.8]
    mid = codes[(jac >= 0.5) & (jac < 0.8)]
    hit_hi = np.isin(pred, hi).sum()
    hit_mid = np.isin(pred, mid).sum()
    return {
        "predicted_pairs": int(len(pred)),
        "pairs_08": int(len(hi)),
        "pairs_05_08": int(len(mid)),
        "precision_08": float(hit_hi / len(pred)) if len(pred) else 1.0,
        "recall_08": float(hit_hi / len(hi)) if len(hi) else 1.0,
        # Band precision: of the merged pairs below 0.8, the share in [0.5, 0.8).
        "predicted_pairs_below_08": int(len(pred) - hit_hi),
        "precision_05_08": float(hit_mid / (len(pred) - hit_hi)) if len(pred) > hit_hi else None,
        "recall_05_08": float(hit_mid / len(mid)) if len(mid) else 1.0,
    }


def kiln_clusters(dups_dir: Path, index: dict[str, int]) -> list[list[int]]:
    import pyarrow.parquet as pq

    table = pq.read_table(dups_dir).to_pydict()
    members: dict[str, set[int]] = {}
    for doc_id, cluster, kept in zip(table["doc_id"], table["cluster_id"], table["kept_doc_id"]):
        members.setdefault(cluster, {index[kept]}).add(index[doc_id])
    return [sorted(m) for m in members.values()]


def datasketch_reference_clusters(sig: np.ndarray, bands: int = 14, rows: int = 8) -> list[list[int]]:
    import inspect

    from datasketch import MinHash, MinHashLSH

    legacy = {"scheme": "legacy"} if "scheme" in inspect.signature(MinHash.__init__).parameters else {}
    lsh = MinHashLSH(num_perm=sig.shape[1], params=(bands, rows))
    sketches = [MinHash(num_perm=sig.shape[1], hashvalues=row.astype(np.uint64), **legacy) for row in sig]
    for i, m in enumerate(sketches):
        lsh.insert(i, m)
    parent = list(range(len(sig)))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, m in enumerate(sketches):
        for j in lsh.query(m):
            ri, rj = find(i), find(j)
            if ri != rj:
                parent[max(ri, rj)] = min(ri, rj)
    groups: dict[int, list[int]] = {}
    for i in range(len(sig)):
        groups.setdefault(find(i), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


# ----------------------------------------------------------------------------- main


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, about a minute")
    parser.add_argument("--sizes", default="25000,50000,100000",
                        help="speed-run sizes, comma-separated (full mode; default 25000,50000,100000)")
    parser.add_argument("--worker", choices=["kiln", "datasketch"], help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variants", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bucket-ab", type=int, metavar="DOCS",
                        help="only compare candidate-bucket implementations (Window vs groupBy) on DOCS documents")
    args = parser.parse_args()
    if args.bucket_ab:
        print(json.dumps(bucket_ab_worker(args.bucket_ab, repeats=1 if args.quick else 3)))
        return
    if args.worker == "kiln":
        print(json.dumps(kiln_worker(args.data, args.out, args.variants.split(","), warm_up=not args.cold)))
        return
    if args.worker == "datasketch":
        print(json.dumps(datasketch_worker(args.data)))
        return

    t_bench = time.perf_counter()
    rng = random.Random(20240601)
    streams = load_paragraphs()
    windows = window_docs(streams)
    quality_bases = 400 if args.quick else 2400
    sizes = [] if args.quick else [int(x) for x in args.sizes.split(",") if x]
    variants = ["default"] if args.quick else ["default", "no_verify", "verify_signature"]
    td_python, td_reason = text_dedup_python()
    if td_python is None:
        print(f"text-dedup baseline skipped: {td_reason}")

    with tempfile.TemporaryDirectory(prefix="bench_dedup_") as tmp:
        tmp = Path(tmp)
        # --- quality on the labelled set
        bases = rng.sample(windows, min(quality_bases, len(windows)))
        bases += sentence_docs(streams, quality_bases - len(bases), rng)
        texts = planted_set(bases, dup_fraction=0.4, rng=rng)
        write_docs(texts, tmp / "quality", seed=1)
        n = len(texts)
        index = {f"{i:020x}": i for i in range(n)}

        # Quick mode skips the warm-up, so its Kiln timing is cold and overhead-dominated.
        kiln, kiln_rss = run_worker(
            ["--worker", "kiln", "--data", str(tmp / "quality"), "--out", str(tmp / "dups"), "--variants", ",".join(variants)]
            + (["--cold"] if args.quick else [])
        )
        t0 = time.perf_counter()
        sig = compute_signatures(texts)
        sig_rate = n / (time.perf_counter() - t0)
        rows, cols, jac = true_pair_jaccard(texts)
        reference = pair_metrics(cluster_pairs(datasketch_reference_clusters(sig), n), rows, cols, jac, n)
        quality = {
            name: pair_metrics(cluster_pairs(kiln_clusters(tmp / "dups" / name, index), n), rows, cols, jac, n)
            for name in variants
        }
        methods = [("datasketch MinHashLSH (ref)", reference, None)]
        methods += [(f"kiln {k}", v, kiln["variants"][k]["seconds"]) for k, v in quality.items()]
        td_quality = td_quality_run = None
        if td_python:
            try:
                td_quality_run, td_quality_rss = run_text_dedup(td_python, tmp / "quality", tmp / "td_quality")
            except (RuntimeError, KeyError, ValueError) as exc:  # installed but broken: a reason, not a crash
                td_python, td_reason = None, f"text-dedup failed: {str(exc)[-300:]}"
                print(f"text-dedup baseline skipped: {td_reason}")
        if td_python:
            td_clusters = [[index[d] for d in c] for c in td_quality_run["clusters"]]
            td_quality = pair_metrics(cluster_pairs(td_clusters, n), rows, cols, jac, n)
            methods.append(("text-dedup minhash", td_quality, td_quality_run["seconds"]))
        print(f"quality set: {n} docs, {len(jac)} pairs with J > 0, single-core compute_signatures {sig_rate:,.0f} docs/s")
        print("P@.5-.8: share of merged pairs below J 0.8 that have J >= 0.5")
        print(f"{'method':28s} {'pairs':>7s} {'P@0.8':>7s} {'R@0.8':>7s} {'P@.5-.8':>8s} {'R@.5-.8':>8s} {'seconds':>8s}")
        for name, m, secs in methods:
            print(
                f"{name:28s} {m['predicted_pairs']:7d} {m['precision_08']:7.3f} {m['recall_08']:7.3f} "
                f"{fmt(m['precision_05_08'], '8.3f'):>8s} {m['recall_05_08']:8.3f} {fmt(secs, '8.1f'):>8s}"
            )
        print(f"truth: {reference['pairs_08']} pairs J>=0.8, {reference['pairs_05_08']} pairs 0.5<=J<0.8")

        # --- speed: (kiln run, kiln RSS, datasketch run, its RSS, text-dedup run or None, its RSS)
        speed = {}

        def kiln_row(run):
            return run["variants"]["default"] | {k: run[k] for k in ("session_start_seconds", "warmup_seconds")}

        if args.quick:
            base_run, base_rss = run_worker(["--worker", "datasketch", "--data", str(tmp / "quality")])
            speed[n] = (kiln_row(kiln), kiln_rss, base_run, base_rss, td_quality_run, td_quality_rss if td_python else 0)
        for size in sizes:
            pool = rng.sample(windows, len(windows)) + sentence_docs(streams, int(size / 1.2) - len(windows), rng)
            docs = planted_set(pool, dup_fraction=0.1, rng=rng)[:size]
            write_docs(docs, tmp / f"speed{size}", seed=size)
            k_run, k_rss = run_worker(["--worker", "kiln", "--data", str(tmp / f"speed{size}"), "--out", str(tmp / f"sdups{size}")])
            b_run, b_rss = run_worker(["--worker", "datasketch", "--data", str(tmp / f"speed{size}")])
            t_run, t_rss = None, 0
            if td_python:
                try:
                    t_run, t_rss = run_text_dedup(td_python, tmp / f"speed{size}", tmp / f"td{size}")
                except (RuntimeError, KeyError, ValueError) as exc:
                    print(f"text-dedup failed at {size} docs: {str(exc)[-300:]}")
            speed[size] = (kiln_row(k_run), k_rss, b_run, b_rss, t_run, t_rss)

        print("kiln s: signatures + dedup, wall clock after Spark session start ('start') and warm-up, neither counted;")
        print("cpu: process-tree CPU seconds; text-dedup s: its MinHashing + Clustering + Filtering phases")
        print(
            f"{'docs':>8s} {'start':>6s} {'kiln s':>7s} {'(sigs)':>7s} {'cpu s':>7s} {'docs/s':>7s} {'RSS MB':>7s} | "
            f"{'datasketch s':>12s} {'(sigs)':>7s} {'cpu s':>7s} {'docs/s':>7s} {'RSS MB':>7s} | "
            f"{'text-dedup s':>12s} {'RSS MB':>7s} | KB/doc kiln, datasketch"
        )
        for size, (k, k_rss, b, b_rss, t, t_rss) in speed.items():
            print(
                f"{size:8d} {k['session_start_seconds']:6.1f} {k['seconds']:7.1f} {k['signature_seconds']:7.1f} "
                f"{k['cpu_seconds']:7.1f} {size / k['seconds']:7.0f} {k_rss:7.0f} | {b['seconds']:12.1f} "
                f"{b['signature_seconds']:7.1f} {b['cpu_seconds']:7.1f} {size / b['seconds']:7.0f} {b_rss:7.0f} | "
                f"{fmt(t and t['seconds'], '12.1f'):>12s} {fmt(t and t_rss, '7.0f'):>7s} | "
                f"{k_rss * 1024 / size:6.1f}, {b_rss * 1024 / size:6.1f}"
            )

    largest = max(speed)
    k, k_rss, b, b_rss, t, t_rss = speed[largest]
    default = quality["default"]
    with_start = k["session_start_seconds"] + k["warmup_seconds"] + k["seconds"]
    summary = {
        "benchmark": "bench_dedup",
        "precision_08": round(default["precision_08"], 4),
        "recall_08": round(default["recall_08"], 4),
        "precision_05_08": None if default["precision_05_08"] is None else round(default["precision_05_08"], 4),
        "recall_05_08": round(default["recall_05_08"], 4),
        "docs_per_s": round(largest / k["seconds"], 1),
        "docs_per_s_includes_session_start": False,
        "kiln_session_start_s": round(k["session_start_seconds"], 2),
        "kiln_warmup_s": round(k["warmup_seconds"], 2),
        "docs_per_s_with_session_start": round(largest / with_start, 1),
        "baseline_docs_per_s": round(largest / b["seconds"], 1),
        "ratio": round(b["seconds"] / k["seconds"], 3),
        "cpu_docs_per_s": round(largest / k["cpu_seconds"], 1),
        "baseline_cpu_docs_per_s": round(largest / b["cpu_seconds"], 1),
        "peak_rss_mb": {f"kiln_{s}": round(v[1]) for s, v in speed.items()}
        | {f"datasketch_{s}": round(v[3]) for s, v in speed.items()}
        | {f"textdedup_{s}": round(v[5]) for s, v in speed.items() if v[4]},
        # The memory curve: peak RSS per document at each size (flat or falling = no per-doc growth).
        "peak_rss_kb_per_doc": {f"kiln_{s}": round(v[1] * 1024 / s, 1) for s, v in speed.items()}
        | {f"datasketch_{s}": round(v[3] * 1024 / s, 1) for s, v in speed.items()}
        | {f"textdedup_{s}": round(v[5] * 1024 / s, 1) for s, v in speed.items() if v[4]},
        "docs": largest,
        "quality_docs": n,
        "reference_datasketch": {k2: reference[k2] if reference[k2] is None else round(reference[k2], 4)
                                 for k2 in ("precision_08", "recall_08", "precision_05_08", "recall_05_08")},
        "textdedup": {"skipped": td_reason or "failed at this size (printed above)"} if t is None else {
            "docs_per_s": round(largest / t["seconds"], 1),
            "ratio": round(t["seconds"] / k["seconds"], 3),  # > 1: Kiln faster
            "total_s": round(t["total_seconds"], 2),
            **{k2: td_quality[k2] if td_quality[k2] is None else round(td_quality[k2], 4)
               for k2 in ("precision_08", "recall_08", "precision_05_08", "recall_05_08")},
        },
        "single_core_signature_docs_per_s": round(sig_rate, 1),
        "bench_wall_s": round(time.perf_counter() - t_bench, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
