"""Exact and near-duplicate removal over Spark DataFrames.

Stages (all deterministic: every choice is a minimum under a total order, so the result
does not depend on partitioning, partition order or the number of cores):

1. Exact: hash of `normalise_for_exact(text)`; in each hash group the best document by
   the keep rule survives ("representative"), the rest are removed with reason `exact`.
2. Near, over representatives only: LSH band hashes of the stored MinHash signatures,
   documents sharing a (band, band_hash) bucket get star edges to the bucket's smallest
   doc_id, edges are verified by Jaccard (exact on shingles by default), then connected
   components (large-star / small-star with plain DataFrame ops). In each component the
   best document survives, the rest are removed with reason `near`.

Buckets are a Window min over partitionBy(band, band_hash), not a groupBy: both shuffle on
(band, band_hash) and give the same edges, but groupBy needs either collect_list + explode
(sort-based object aggregation, 1.7-2.2x slower) or a join back onto the band rows (a second
shuffle that recomputes the band hashes, 1.5-1.6x slower): `bench_dedup.py --bucket-ab`.

Verification checks each star edge (member, bucket minimum), not every pair of a bucket:
a member similar to another member but not to the minimum keeps its place only through
another band. tests/benchmarks/bench_dedup.py measures what that costs.

Keep rule: higher `keep_signal` first (lower when `keep_signal_descending=False`), missing
or NaN signal last, then the smallest doc_id. doc_id must be unique.

duplicates_df has one row per removed document: doc_id, cluster_id, kept_doc_id, reason.
kept_doc_id is always a surviving document (an exact duplicate of a document that was
itself removed as a near duplicate points at the survivor of that near cluster), and
cluster_id is the smallest doc_id of all documents (exact and near) in the cluster.

stats["example_pairs_shown"]: a few (removed, kept) pairs with url, the start of both texts
and, for near pairs, their true shingle Jaccard (example_pairs_markdown renders them). One
pair per cluster (its smallest removed doc_id), largest clusters first, then smallest
cluster_id: deterministic, like everything else here.
"""
from __future__ import annotations

import re
from typing import Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from engine.minhash import exact_hash, optimal_bands, shingle_hashes, signatures_from_bytes


class DedupConfig(BaseModel):
    """Deduplication parameters (defaults tuned for 112-permutation signatures)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_perm: int = Field(112, ge=1, le=4096, description="Values per stored signature.")
    bands: int = Field(14, ge=1, le=4096, description="LSH bands; 14x8 puts the S-curve midpoint at J~0.72.")
    rows: int = Field(8, ge=1, le=4096, description="Signature values per band.")
    threshold: float | None = Field(
        None, gt=0.0, lt=1.0, description="If set, bands/rows are derived like datasketch's MinHashLSH."
    )
    exact: bool = Field(True, description="Run the exact-duplicate stage.")
    near: bool = Field(True, description="Run the near-duplicate (MinHash LSH) stage.")
    exact_nfc: bool = Field(True, description="Exact stage: Unicode NFC before hashing.")
    exact_casefold: bool = Field(True, description="Exact stage: case-fold before hashing.")
    exact_collapse_whitespace: bool = Field(True, description="Exact stage: whitespace runs -> one space, strip.")
    # Measured by tests/benchmarks/bench_dedup.py (4,073 labelled docs, pairs J >= 0.8):
    # no verification P 0.56 / R 0.995 (14x8 bands alone merge from J ~0.7 up),
    # signature estimate P 0.90 / R 0.96, exact shingles P 0.96 / R 0.994.
    verify_jaccard: bool = Field(True, description="Drop candidate edges whose Jaccard is below verify_threshold.")
    verify_threshold: float = Field(
        0.8, ge=0.0, le=1.0, description="Minimum Jaccard of a verified edge (defaults to threshold when that is set)."
    )
    verify_method: Literal["signature", "shingles"] = Field(
        "shingles",
        description="'shingles': exact Jaccard of the shingle-hash sets (ships both texts per candidate edge); "
        "'signature': estimate from the stored signatures, cheaper but its ~0.04 standard error at J=0.8 "
        "costs recall near the threshold.",
    )
    ngram: int = Field(5, ge=1, le=64, description="Shingle size, for verify_method='shingles'.")
    keep_signal: str = Field("classifier_score", min_length=1, description="Column ranking documents to keep.")
    keep_signal_descending: bool = Field(True, description="True: higher keep_signal is better.")
    max_cc_iterations: int = Field(40, ge=1, le=1000, description="Large-star/small-star rounds before giving up.")
    example_near_pairs: int = Field(
        3, ge=0, le=50, description="Near pairs shown side by side (texts, Jaccard) in the asset's metadata."
    )
    example_exact_pairs: int = Field(2, ge=0, le=50, description="Exact pairs shown side by side in the asset's metadata.")
    example_chars: int = Field(300, ge=20, le=5000, description="Characters of each text shown in an example pair.")

    @model_validator(mode="before")
    @classmethod
    def _derive_bands(cls, data):
        if isinstance(data, dict) and data.get("threshold") is not None:
            if "bands" in data or "rows" in data:
                raise ValueError("give either threshold or bands/rows, not both")
            threshold = float(data["threshold"])
            if 0.0 < threshold < 1.0:
                bands, rows = optimal_bands(threshold, int(data.get("num_perm", 112)))
                data = {"verify_threshold": threshold, **data, "bands": bands, "rows": rows}
        return data

    @model_validator(mode="after")
    def _check_bands(self):
        if self.bands * self.rows > self.num_perm:
            raise ValueError(f"bands*rows = {self.bands * self.rows} exceeds num_perm = {self.num_perm}")
        return self


# ----------------------------------------------------------------------------- helpers


def _materialise(df: DataFrame) -> DataFrame:
    """Compute once and cut the lineage (reliable checkpoint when a checkpoint dir is set)."""
    if df.sparkSession.sparkContext.getCheckpointDir():
        return df.checkpoint(eager=True)
    return df.localCheckpoint(eager=True)


def _keep_order(cfg: DedupConfig, has_signal: bool) -> list[Column]:
    """Best document first; doc_id makes the order total."""
    order = []
    if has_signal:
        order.append(F.col("_keep").desc_nulls_last() if cfg.keep_signal_descending else F.col("_keep").asc_nulls_last())
    order.append(F.col("doc_id").asc())
    return order


def _keep_column(docs_df: DataFrame, cfg: DedupConfig) -> tuple[Column, bool]:
    if cfg.keep_signal not in docs_df.columns:
        return F.lit(None).cast("double"), False
    value = F.col(cfg.keep_signal).cast("double")
    # Spark orders NaN above every number; a NaN score must not win.
    return F.when(F.isnan(value), F.lit(None).cast("double")).otherwise(value), True


def _exact_hash_fn(cfg: DedupConfig):
    options = dict(nfc=cfg.exact_nfc, casefold=cfg.exact_casefold, collapse_whitespace=cfg.exact_collapse_whitespace)

    def fn(batches):
        for pdf in batches:
            hashes = [exact_hash(t if t is not None else "", **options) for t in pdf["text"]]
            yield pd.DataFrame({"doc_id": pdf["doc_id"], "_keep": pdf["_keep"], "exact_hash": hashes})

    return fn


def band_hashes(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) int64 hash of each band's `rows` values.

    FNV-1a style mixing of the 32-bit values then the MurmurHash3 64-bit finaliser; two
    different bands collide with probability ~2^-64, which would only add a candidate edge.
    """
    if signatures.shape[1] < bands * rows:
        raise ValueError(f"signatures have {signatures.shape[1]} values, bands*rows needs {bands * rows}")
    x = signatures[:, : bands * rows].reshape(len(signatures), bands, rows).astype(np.uint64)
    h = np.full((len(signatures), bands), 0xCBF29CE484222325, dtype=np.uint64)
    prime = np.uint64(0x100000001B3)
    for r in range(rows):
        h ^= x[:, :, r]
        h *= prime
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return h.view(np.int64)


def _band_fn(cfg: DedupConfig):
    bands, rows, num_perm = cfg.bands, cfg.rows, cfg.num_perm

    def fn(batches):
        for pdf in batches:
            sig = signatures_from_bytes(pdf["minhash"], num_perm)
            h = band_hashes(sig, bands, rows)
            yield pd.DataFrame(
                {
                    "doc_id": np.repeat(pdf["doc_id"].to_numpy(), bands),
                    "band": np.tile(np.arange(bands, dtype=np.int32), len(pdf)),
                    "band_hash": h.ravel(),
                }
            )

    return fn


def _signature_jaccard_fn(num_perm: int):
    def fn(batches):
        for pdf in batches:
            a = signatures_from_bytes(pdf["sig_src"], num_perm)
            b = signatures_from_bytes(pdf["sig_dst"], num_perm)
            yield pd.DataFrame({"src": pdf["src"], "dst": pdf["dst"], "jaccard": (a == b).mean(axis=1)})

    return fn


def _shingle_sets(texts: list[str], ngram: int) -> list[np.ndarray]:
    """Each text's distinct shingle hashes, sorted, as little-endian uint32."""
    hashes, offsets = shingle_hashes(texts, ngram)
    return [np.unique(hashes[offsets[i] : offsets[i + 1]]).astype("<u4") for i in range(len(texts))]


def _set_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard of two sets of distinct shingle hashes (1.0 for two empty sets)."""
    inter = len(np.intersect1d(a, b, assume_unique=True))
    union = len(a) + len(b) - inter
    return inter / union if union else 1.0


def _shingle_set_fn(ngram: int):
    """Each document's distinct shingle hashes, sorted, as little-endian uint32 bytes."""

    def fn(batches):
        for pdf in batches:
            sets = [s.tobytes() for s in _shingle_sets(list(pdf["text"].fillna("")), ngram)]
            yield pd.DataFrame({"doc_id": pdf["doc_id"], "shingles": sets})

    return fn


def _set_jaccard_fn(batches):
    for pdf in batches:
        jac = np.empty(len(pdf))
        for i, (a, b) in enumerate(zip(pdf["set_src"], pdf["set_dst"])):
            jac[i] = _set_jaccard(np.frombuffer(a, dtype="<u4"), np.frombuffer(b, dtype="<u4"))
        yield pd.DataFrame({"src": pdf["src"], "dst": pdf["dst"], "jaccard": jac})


# ----------------------------------------------------------------------------- connected components


def _large_star(edges: DataFrame) -> DataFrame:
    """Every node links its larger neighbours to the minimum of its closed neighbourhood."""
    sym = edges.select(F.col("src").alias("u"), F.col("dst").alias("v")).unionByName(
        edges.select(F.col("dst").alias("u"), F.col("src").alias("v"))
    )
    m = F.least(F.min("v").over(Window.partitionBy("u")), F.col("u"))
    return (
        sym.withColumn("m", m)
        .where(F.col("v") > F.col("u"))
        .select(F.col("v").alias("src"), F.col("m").alias("dst"))
        .distinct()
    )


def _small_star(edges: DataFrame) -> DataFrame:
    """Every node links itself and its smaller neighbours to the smallest of them."""
    oriented = edges.select(F.greatest("src", "dst").alias("u"), F.least("src", "dst").alias("v"))
    oriented = oriented.withColumn("m", F.min("v").over(Window.partitionBy("u")))
    smaller = oriented.where(F.col("v") != F.col("m")).select(F.col("v").alias("src"), F.col("m").alias("dst"))
    itself = oriented.select(F.col("u").alias("src"), F.col("m").alias("dst"))
    return smaller.unionByName(itself).distinct()


def _is_star_forest(edges: DataFrame) -> bool:
    """Each src has one dst and no dst is itself a src: then dst is the component root.
    One aggregation over both endpoints answers both questions in a single job."""
    roles = edges.select(F.col("src").alias("node"), F.lit(1).alias("child"), F.lit(0).alias("parent")).unionByName(
        edges.select(F.col("dst").alias("node"), F.lit(0).alias("child"), F.lit(1).alias("parent"))
    )
    per_node = roles.groupBy("node").agg(F.sum("child").alias("parents"), F.max("parent").alias("is_parent"))
    bad = per_node.where((F.col("parents") > 1) | ((F.col("parents") >= 1) & (F.col("is_parent") == 1)))
    return bad.limit(1).count() == 0


def connected_components(edges: DataFrame, max_iterations: int = 40) -> tuple[DataFrame, int]:
    """Components of the undirected graph `edges` (src, dst: string node ids).

    Returns ((doc_id, root) for every node in an edge, roots included, where root is the
    smallest node id of the component; iterations used). Large-star/small-star (Kiveris et
    al., 2014) converges in O(log^2 n) rounds; both steps preserve connectivity, so once the
    edge set is a forest of stars pointing at smaller ids the star centres are the roots.
    """
    current = _materialise(
        edges.where(F.col("src") != F.col("dst"))
        .select(F.greatest("src", "dst").alias("src"), F.least("src", "dst").alias("dst"))
        .distinct()
    )
    iterations = 0
    while not _is_star_forest(current):
        if iterations >= max_iterations:
            raise RuntimeError(f"connected components did not converge in {max_iterations} iterations")
        current = _materialise(_small_star(_large_star(current)))
        iterations += 1
    roots = current.select(F.col("dst").alias("doc_id"), F.col("dst").alias("root")).distinct()
    labels = current.select(F.col("src").alias("doc_id"), F.col("dst").alias("root")).unionByName(roots)
    return labels, iterations


# ----------------------------------------------------------------------------- deduplicate

_DUPLICATES_SCHEMA = "doc_id string, cluster_id string, kept_doc_id string, reason string"


def deduplicate(
    spark: SparkSession, docs_df: DataFrame, signatures_df: DataFrame, cfg: DedupConfig | None = None
) -> tuple[DataFrame, DataFrame, dict]:
    """Remove exact and near duplicates.

    docs_df: doc_id, text, cfg.keep_signal (optional; without it the smallest doc_id wins)
    and any other columns, which kept_df passes through unchanged. signatures_df: doc_id,
    minhash (little-endian uint32 x num_perm); documents without a signature only take part
    in the exact stage. Returns (kept_df, duplicates_df, stats).
    """
    cfg = cfg or DedupConfig()
    keep, has_signal = _keep_column(docs_df, cfg)
    order = _keep_order(cfg, has_signal)
    base = docs_df.select("doc_id", "text", keep.alias("_keep"))

    # --- exact stage: representatives are the best document of each normalised-text group.
    if cfg.exact:
        hashed = base.mapInPandas(_exact_hash_fn(cfg), "doc_id string, _keep double, exact_hash string")
        group = Window.partitionBy("exact_hash")
        ranked = Window.partitionBy("exact_hash").orderBy(*order)
        exact = _materialise(
            hashed.select(
                "doc_id",
                "_keep",
                F.row_number().over(ranked).alias("rank"),
                F.first("doc_id").over(ranked).alias("rep"),
                F.min("doc_id").over(group).alias("group_min"),
            )
        )
    else:
        exact = _materialise(
            base.select(
                "doc_id", "_keep", F.lit(1).alias("rank"), F.col("doc_id").alias("rep"), F.col("doc_id").alias("group_min")
            )
        )
    reps = exact.where(F.col("rank") == 1).select("doc_id", "_keep", "group_min")
    exact_removed = exact.where(F.col("rank") > 1).select("doc_id", "rep", "group_min")

    stats: dict = {"input_docs": exact.count(), "bands": cfg.bands, "rows": cfg.rows}

    # --- near stage over representatives.
    if cfg.near:
        rep_sigs = (
            signatures_df.select("doc_id", "minhash")
            .where(F.col("minhash").isNotNull())
            .join(reps.select("doc_id"), "doc_id", "left_semi")
        )
        banded = rep_sigs.mapInPandas(_band_fn(cfg), "doc_id string, band int, band_hash long")
        # A Window, not groupBy + collect_list/join: same edges, one shuffle, measured faster
        # (module docstring). Star edges member -> bucket minimum, not all pairs.
        bucket_min = F.min("doc_id").over(Window.partitionBy("band", "band_hash"))
        candidates = _materialise(
            banded.withColumn("root", bucket_min)
            .where(F.col("doc_id") != F.col("root"))
            .select(F.col("doc_id").alias("src"), F.col("root").alias("dst"))
            .distinct()
        )
        stats["candidate_edges"] = candidates.count()
        if cfg.verify_jaccard:
            candidates = _materialise(_verify(candidates, rep_sigs, docs_df, cfg))
            stats["verified_edges"] = candidates.count()
        labels, stats["cc_iterations"] = connected_components(candidates, cfg.max_cc_iterations)

        in_component = Window.partitionBy("root")
        ranked = Window.partitionBy("root").orderBy(*order)
        members = _materialise(
            labels.join(reps, "doc_id").select(
                "doc_id",
                F.row_number().over(ranked).alias("rank"),
                F.first("doc_id").over(ranked).alias("kept_doc_id"),
                F.min("group_min").over(in_component).alias("cluster_id"),
            )
        )
        near_removed = members.where(F.col("rank") > 1).select(
            "doc_id", "cluster_id", "kept_doc_id", F.lit("near").alias("reason")
        )
        rep_outcome = members.select(F.col("doc_id").alias("rep"), "kept_doc_id", "cluster_id")
    else:
        near_removed = spark.createDataFrame([], _DUPLICATES_SCHEMA)
        rep_outcome = spark.createDataFrame([], "rep string, kept_doc_id string, cluster_id string")

    exact_rows = exact_removed.join(rep_outcome, "rep", "left").select(
        "doc_id",
        F.coalesce("cluster_id", "group_min").alias("cluster_id"),
        F.coalesce("kept_doc_id", "rep").alias("kept_doc_id"),
        F.lit("exact").alias("reason"),
    )
    duplicates = _materialise(exact_rows.unionByName(near_removed))
    kept_df = docs_df.join(duplicates.select("doc_id"), "doc_id", "left_anti")

    stats.update(_stats(duplicates))
    stats["kept_docs"] = stats["input_docs"] - stats["exact_removed"] - stats["near_removed"]
    stats["example_pairs_shown"] = example_pairs(docs_df, duplicates, cfg)
    return kept_df, duplicates, stats


def _verify(candidates: DataFrame, rep_sigs: DataFrame, docs_df: DataFrame, cfg: DedupConfig) -> DataFrame:
    schema = "src string, dst string, jaccard double"
    if cfg.verify_method == "signature":
        pairs = candidates.join(rep_sigs.select(F.col("doc_id").alias("src"), F.col("minhash").alias("sig_src")), "src").join(
            rep_sigs.select(F.col("doc_id").alias("dst"), F.col("minhash").alias("sig_dst")), "dst"
        )
        scored = pairs.select("src", "dst", "sig_src", "sig_dst").mapInPandas(_signature_jaccard_fn(cfg.num_perm), schema)
    else:
        # Shingle each candidate document once (not once per edge end); only those texts move.
        nodes = candidates.select(F.col("src").alias("doc_id")).unionByName(candidates.select(F.col("dst").alias("doc_id")))
        sets = _materialise(
            docs_df.select("doc_id", "text")
            .join(nodes.distinct(), "doc_id", "left_semi")
            .mapInPandas(_shingle_set_fn(cfg.ngram), "doc_id string, shingles binary")
        )
        pairs = candidates.join(sets.select(F.col("doc_id").alias("src"), F.col("shingles").alias("set_src")), "src").join(
            sets.select(F.col("doc_id").alias("dst"), F.col("shingles").alias("set_dst")), "dst"
        )
        scored = pairs.select("src", "dst", "set_src", "set_dst").mapInPandas(_set_jaccard_fn, schema)
    return scored.where(F.col("jaccard") >= cfg.verify_threshold).select("src", "dst")


def _stats(duplicates: DataFrame) -> dict:
    per_cluster = duplicates.groupBy("cluster_id").agg(
        (F.count("*") + 1).alias("size"), F.sum((F.col("reason") == "exact").cast("long")).alias("exact")
    )
    by_size = (
        per_cluster.groupBy("size").agg(F.count("*").alias("clusters"), F.sum("exact").alias("exact")).collect()
    )
    # Exact sizes as string keys (JSON-friendly, int()-parsable); a corpus of N documents
    # has at most sqrt(2N) distinct cluster sizes, so the histogram stays small.
    histogram = {str(r["size"]): int(r["clusters"]) for r in sorted(by_size, key=lambda r: r["size"])}
    removed = sum(r["clusters"] * (r["size"] - 1) for r in by_size)
    exact_removed = sum(r["exact"] for r in by_size)
    return {
        "exact_removed": int(exact_removed),
        "near_removed": int(removed - exact_removed),
        "clusters": int(sum(r["clusters"] for r in by_size)),
        "largest_cluster": int(max((r["size"] for r in by_size), default=0)),
        "cluster_size_histogram": histogram,
    }


# ----------------------------------------------------------------------------- example pairs


def example_pairs(docs_df: DataFrame, duplicates: DataFrame, cfg: DedupConfig) -> list[dict]:
    """Up to cfg.example_near_pairs near and cfg.example_exact_pairs exact (removed, kept)
    pairs with url, the first cfg.example_chars characters of both texts (whitespace runs,
    newlines included, flattened to one space) and, for near pairs, the true shingle
    Jaccard (cfg.ngram shingles, as verification uses). Near pairs first."""
    limits = {"near": cfg.example_near_pairs, "exact": cfg.example_exact_pairs}
    if not any(limits.values()):
        return []
    sizes = duplicates.groupBy("cluster_id").agg((F.count("*") + 1).alias("cluster_size"))
    # One pair per (cluster, reason), so three chain members do not fill every slot.
    per_cluster = duplicates.groupBy("cluster_id", "reason").agg(F.min(F.struct("doc_id", "kept_doc_id")).alias("p"))
    order = Window.partitionBy("reason").orderBy(F.col("cluster_size").desc(), F.col("cluster_id"))
    limit = F.when(F.col("reason") == "near", limits["near"]).otherwise(limits["exact"])
    rows = (
        per_cluster.join(sizes, "cluster_id")
        .withColumn("n", F.row_number().over(order))
        .where(F.col("n") <= limit)
        .select("reason", "n", "cluster_id", "cluster_size", "p.doc_id", "p.kept_doc_id")
        .collect()
    )
    if not rows:
        return []
    ids = sorted({r["doc_id"] for r in rows} | {r["kept_doc_id"] for r in rows})
    url = F.col("url").cast("string") if "url" in docs_df.columns else F.lit(None).cast("string")
    found = docs_df.where(F.col("doc_id").isin(ids)).select("doc_id", url.alias("url"), "text").collect()
    docs = {r["doc_id"]: (r["url"], r["text"] or "") for r in found}

    def side(doc_id: str) -> dict:
        doc_url, text = docs.get(doc_id, (None, ""))
        flat = " ".join(text.split())
        cut = flat[: cfg.example_chars]
        return {"doc_id": doc_id, "url": doc_url, "text": cut + ("…" if len(flat) > len(cut) else "")}

    pairs = []
    for r in sorted(rows, key=lambda r: (r["reason"] != "near", r["n"])):
        pair = {"reason": r["reason"], "cluster_id": r["cluster_id"], "cluster_size": int(r["cluster_size"]),
                "kept": side(r["kept_doc_id"]), "removed": side(r["doc_id"]), "jaccard": None}
        if r["reason"] == "near":
            pair["jaccard"] = round(_text_jaccard(docs[r["kept_doc_id"]][1], docs[r["doc_id"]][1], cfg.ngram), 4)
        pairs.append(pair)
    return pairs


def _text_jaccard(a: str, b: str, ngram: int) -> float:
    return _set_jaccard(*_shingle_sets([a, b], ngram))


def _md_cell(value) -> str:
    # Text is untrusted crawl content: `|` would end the cell, `<` could open raw HTML in the UI.
    text = "" if value is None else str(value)
    return re.sub(r"\s+", " ", text).replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;")


def example_pairs_markdown(pairs: list[dict]) -> str:
    """Each pair as a heading line and a kept-vs-removed markdown table."""
    if not pairs:
        return "_(no duplicates)_"
    blocks = []
    for p in pairs:
        head = f"**{p['reason']}** · cluster `{p['cluster_id']}` ({p['cluster_size']} documents)"
        if p["jaccard"] is not None:
            head += f" · shingle Jaccard {p['jaccard']:.3f}"
        kept, removed = p["kept"], p["removed"]
        blocks.append(
            "\n".join(
                [
                    head,
                    "",
                    "| | kept | removed |",
                    "|---|---|---|",
                    f"| doc_id | `{_md_cell(kept['doc_id'])}` | `{_md_cell(removed['doc_id'])}` |",
                    f"| url | {_md_cell(kept['url'])} | {_md_cell(removed['url'])} |",
                    f"| text | {_md_cell(kept['text'])} | {_md_cell(removed['text'])} |",
                ]
            )
        )
    return "\n\n".join(blocks)
