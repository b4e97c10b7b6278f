import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from engine.dedup import DedupConfig, connected_components, deduplicate, example_pairs_markdown
from engine.minhash import compute_signatures, optimal_bands, shingles, signatures_to_bytes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS_SCHEMA = "doc_id string, url string, text string, classifier_score double"


def jaccard(a: str, b: str) -> float:
    sa, sb = set(shingles(a)), set(shingles(b))
    return len(sa & sb) / len(sa | sb)


def long_paragraphs(shared_data, count):
    text = (shared_data / "prose" / "gutenberg_pride_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    start, end = text.find("Chapter 1"), text.find("End of the Project Gutenberg")
    paras = [" ".join(p.split()) for p in text[start:end].split("\n\n")]
    return [p for p in paras if len(p.split()) >= 150][:count]


def replace_words(text, positions, word="zebra"):
    words = text.split()
    for p in positions:
        words[p] = word
    return " ".join(words)


def signature_rows(docs):
    sig = compute_signatures([d[2] for d in docs])
    return list(zip([d[0] for d in docs], signatures_to_bytes(sig)))


def frames(spark, docs, sig_rows=None):
    docs_df = spark.createDataFrame(docs, DOCS_SCHEMA)
    sigs_df = spark.createDataFrame(sig_rows if sig_rows is not None else signature_rows(docs), "doc_id string, minhash binary")
    return docs_df, sigs_df


def collect_dups(dups):
    return sorted(tuple(r) for r in dups.select("doc_id", "cluster_id", "kept_doc_id", "reason").collect())


def build_scenario(paras):
    """Docs (doc_id, url, text, score) and the expected removals {doc_id: (kept_doc_id, reason)}."""
    rng = random.Random(7)
    docs, expected = [], {}

    def add(doc_id, text, score):
        docs.append((doc_id, f"https://example.org/{doc_id}", text, score))

    for i, p in enumerate(paras[:20]):  # unrelated originals: all must survive
        add(f"u{i:02d}", p, round(rng.random(), 3))
    p = paras[20]
    # Exact: case, whitespace and Unicode-composition variants; best score wins.
    add("e1", p, 0.5)
    add("e2", "  " + p.upper().replace(" ", "\n"), 0.9)
    add("e3", p.replace(" ", "  "), None)
    expected.update({"e1": ("e2", "exact"), "e3": ("e2", "exact")})
    # Near: two words replaced, a sentence inserted, boilerplate appended, paragraphs swapped.
    q, r, s, t = paras[21], paras[22], paras[23], paras[24]
    add("n1", q, 0.6)
    add("n2", replace_words(q, [30, 100]), 0.7)
    expected["n1"] = ("n2", "near")
    add("n3", r, 0.8)
    words = r.split()
    add("n4", " ".join(words[:70] + "and so it was , said she .".split() + words[70:]), 0.1)
    expected["n4"] = ("n3", "near")
    add("n5", s, 0.2)
    add("n6", s + " Share this article on Facebook and Twitter. Subscribe to our newsletter.", 0.2)
    expected["n6"] = ("n5", "near")  # equal scores: smallest doc_id
    add("n7", t + "\n" + paras[25], 0.3)
    add("n8", paras[25] + "\n" + t, 0.4)
    expected["n7"] = ("n8", "near")
    # Transitive chain: c1 ~ c2 ~ c3 with edits on different halves (c1 vs c3 further apart),
    # and an exact copy of c3 whose kept document is the chain's survivor.
    base = paras[26]
    c2 = replace_words(base, [10, 40])
    c3 = replace_words(c2, [110, 140], word="giraffe")
    add("c1", base, 0.3)
    add("c2", c2, 0.95)
    add("c3", c3, 0.99)
    add("c4", c3.lower(), 0.1)
    expected.update({"c1": ("c3", "near"), "c2": ("c3", "near"), "c4": ("c3", "exact")})
    return docs, expected


@pytest.fixture(scope="module")
def scenario(spark, shared_data):
    docs, expected = build_scenario(long_paragraphs(shared_data, 30))
    docs_df, sigs_df = frames(spark, docs)
    kept, dups, stats = deduplicate(spark, docs_df, sigs_df, DedupConfig())
    return docs, expected, kept, dups, stats


def test_scenario_edits_are_near_duplicates_by_jaccard(shared_data):
    docs, _ = build_scenario(long_paragraphs(shared_data, 30))
    text = {d[0]: d[2] for d in docs}
    for a, b in [("n1", "n2"), ("n3", "n4"), ("n5", "n6"), ("c1", "c2"), ("c2", "c3")]:
        assert jaccard(text[a], text[b]) >= 0.85, (a, b)
    assert jaccard(text["c1"], text["c3"]) < jaccard(text["c1"], text["c2"])
    assert max(jaccard(text["u00"], text[f"u{i:02d}"]) for i in range(1, 20)) < 0.1


def test_exact_and_near_duplicates_found_and_unrelated_kept(scenario):
    docs, expected, kept, dups, stats = scenario
    removed = {r[0]: (r[2], r[3]) for r in collect_dups(dups)}
    assert removed == expected
    kept_ids = {r["doc_id"] for r in kept.select("doc_id").collect()}
    assert kept_ids == {d[0] for d in docs} - set(expected)
    assert all(f"u{i:02d}" in kept_ids for i in range(20))
    assert stats["exact_removed"] == 3 and stats["near_removed"] == 6
    assert stats["kept_docs"] == len(kept_ids) and stats["input_docs"] == len(docs)


def test_clusters_and_stats(scenario):
    _, _, _, dups, stats = scenario
    rows = collect_dups(dups)
    cluster = {r[0]: r[1] for r in rows}
    # cluster_id is the smallest doc_id in the cluster, kept and exact members included.
    assert cluster["e1"] == cluster["e3"] == "e1"
    assert cluster["c1"] == cluster["c2"] == cluster["c4"] == "c1"
    assert cluster["n7"] == "n7"
    assert stats["clusters"] == 6 and stats["largest_cluster"] == 4
    assert stats["cluster_size_histogram"] == {"2": 4, "3": 1, "4": 1}
    # Every pair shown side by side is a real (removed, kept) row of the duplicates table.
    shown = {(p["reason"], p["removed"]["doc_id"], p["kept"]["doc_id"]) for p in stats["example_pairs_shown"]}
    table = {(r["reason"], r["doc_id"], r["kept_doc_id"]) for r in dups.collect()}
    assert shown <= table and {reason for reason, _, _ in shown} == {"exact", "near"}


def flat(text, chars=300):
    return " ".join(text.split())[:chars]


def test_example_pairs_side_by_side(scenario):
    docs, _, _, _, stats = scenario
    text = {d[0]: d[2] for d in docs}
    shown = stats["example_pairs_shown"]
    # One pair per cluster, largest clusters first, then cluster_id; near pairs before exact.
    assert [(p["reason"], p["removed"]["doc_id"], p["kept"]["doc_id"]) for p in shown] == [
        ("near", "c1", "c3"), ("near", "n1", "n2"), ("near", "n4", "n3"), ("exact", "c4", "c3"), ("exact", "e1", "e2"),
    ]
    for p in shown:
        expected_j = round(jaccard(text[p["kept"]["doc_id"]], text[p["removed"]["doc_id"]]), 4) if p["reason"] == "near" else None
        assert p["jaccard"] == expected_j
        assert p["kept"]["url"] == f"https://example.org/{p['kept']['doc_id']}"
    md = example_pairs_markdown(shown)
    # Both texts of the planted pair n1/n2 (two words replaced) appear, flattened, side by side.
    assert flat(text["n1"]) != flat(text["n2"])
    assert f"| text | {flat(text['n2'])}… | {flat(text['n1'])}… |" in md
    assert "| url | https://example.org/n2 | https://example.org/n1 |" in md
    assert f"shingle Jaccard {jaccard(text['n1'], text['n2']):.3f}" in md
    assert "| doc_id | `c3` | `c1` |" in md and "| doc_id | `e2` | `e1` |" in md


def test_example_pairs_markdown_escapes_crawl_text(spark):
    docs = [("p1", "https://x.org/a|b", "alpha | beta\ngamma <b>bold</b> " * 20, 0.9),
            ("p2", None, "ALPHA |  beta gamma <b>bold</b> " * 20, 0.1)]
    docs_df, sigs_df = frames(spark, docs)
    _, _, stats = deduplicate(spark, docs_df, sigs_df, DedupConfig(near=False, example_chars=40))
    md = example_pairs_markdown(stats["example_pairs_shown"])
    kept = r"alpha \| beta gamma &lt;b>bold&lt;/b> alpha \| b…"
    removed = r"ALPHA \| beta gamma &lt;b>bold&lt;/b> ALPHA \| b…"
    assert f"| text | {kept} | {removed} |" in md
    assert r"| url | https://x.org/a\|b |  |" in md
    rows = [line for line in md.splitlines() if line.startswith("|")]
    # Every row has exactly 3 cells: no `|` or newline from the text leaks into the table.
    assert len(rows) == 5 and all(len(re.split(r"(?<!\\)\|", r)) == 5 for r in rows)
    assert stats["example_pairs_shown"][0]["jaccard"] is None


def test_asset_metadata_histogram_and_examples(scenario):
    from assets.deduplicated import dedup_metadata

    docs, _, _, _, stats = scenario
    meta = dedup_metadata(stats)
    table = meta["cluster_sizes"].value
    assert table.splitlines() == [
        "| cluster_size | clusters |", "|---|---|", "| 2 | 4 |", "| 3 | 1 |", "| 4 | 1 |",
    ]
    assert meta["cluster_size_histogram"].value == {"2": 4, "3": 1, "4": 1}
    assert meta["example_pairs"].value == example_pairs_markdown(stats["example_pairs_shown"])
    text = {d[0]: d[2] for d in docs}
    assert flat(text["n3"]) in meta["example_pairs"].value and flat(text["n4"]) in meta["example_pairs"].value


def test_kept_df_passes_columns_through(scenario):
    docs, _, kept, dups, _ = scenario
    assert kept.columns == ["doc_id", "url", "text", "classifier_score"]
    by_id = {d[0]: d for d in docs}
    for row in kept.collect():
        assert tuple(row) == by_id[row["doc_id"]]
    assert dups.columns == ["doc_id", "cluster_id", "kept_doc_id", "reason"]
    kept_ids = {r["doc_id"] for r in kept.select("doc_id").collect()}
    assert {r["kept_doc_id"] for r in dups.collect()} <= kept_ids


def test_keep_rule_signal_then_doc_id(spark):
    text = "the same words in every one of these documents, give or take case"
    scores = {"k1": 0.2, "k2": 0.9, "k3": 0.9, "k4": None, "k5": float("nan")}
    docs = [(d, None, text.upper() if d == "k5" else text, s) for d, s in scores.items()]
    docs_df, sigs_df = frames(spark, docs)
    kept_of = lambda cfg, df=docs_df: sorted(r["doc_id"] for r in deduplicate(spark, df, sigs_df, cfg)[0].collect())
    assert kept_of(DedupConfig()) == ["k2"]  # tie at 0.9 -> smaller doc_id; null/NaN never win
    # The rule is shared with the near stage (covered by the scenario); exact-only is faster.
    assert kept_of(DedupConfig(near=False, keep_signal_descending=False)) == ["k1"]
    assert kept_of(DedupConfig(near=False, keep_signal="missing_column")) == ["k1"]
    assert kept_of(DedupConfig(near=False), docs_df.drop("classifier_score")) == ["k1"]


def crafted_signatures(rng, n_docs, shared_bands):
    """Random signatures where docs (i, j, band) in shared_bands agree on that band only."""
    sig = rng.integers(0, 2**32, size=(n_docs, 112), dtype=np.uint64).astype(np.uint32)
    for i, j, band in shared_bands:
        sig[j, band * 8 : band * 8 + 8] = sig[i, band * 8 : band * 8 + 8]
    return sig


def test_transitive_chain_collapses_into_one_cluster(spark):
    rng = np.random.default_rng(3)
    ids = [f"t{n:02d}" for n in rng.permutation(24)]  # chain order unrelated to id order
    chain = ids[:20]
    shared = [(k, k + 1, k % 14) for k in range(19)]
    sig = crafted_signatures(rng, 24, shared)
    docs = [(d, None, f"document number {d} " * 3, float(k)) for k, d in enumerate(ids)]
    docs_df, sigs_df = frames(spark, docs, list(zip(ids, signatures_to_bytes(sig))))
    # Crafted signatures do not match the placeholder texts: test LSH + components alone.
    kept, dups, stats = deduplicate(spark, docs_df, sigs_df, DedupConfig(verify_jaccard=False))
    rows = collect_dups(dups)
    assert {r[0] for r in rows} == set(chain[:-1])
    assert {r[2] for r in rows} == {chain[-1]}  # highest score in the chain
    assert {r[1] for r in rows} == {min(chain)}
    assert stats["cc_iterations"] >= 1 and stats["largest_cluster"] == 20


def test_verification_drops_weak_candidates(spark, shared_data):
    paras = long_paragraphs(shared_data, 4)
    docs = [
        ("v1", None, paras[0], 0.5),
        ("v2", None, paras[1], 0.4),  # shares one band with v1 by construction, text unrelated
        ("v3", None, paras[2], 0.5),
        ("v4", None, replace_words(paras[2], [50]), 0.4),  # real near duplicate of v3
    ]
    sig = compute_signatures([d[2] for d in docs])
    sig[1, :8] = sig[0, :8]
    docs_df, sigs_df = frames(spark, docs, list(zip([d[0] for d in docs], signatures_to_bytes(sig))))
    removed = lambda cfg: sorted(r[0] for r in collect_dups(deduplicate(spark, docs_df, sigs_df, cfg)[1]))
    assert removed(DedupConfig(verify_jaccard=False)) == ["v2", "v4"]
    assert removed(DedupConfig(verify_jaccard=True, verify_method="signature")) == ["v4"]
    assert removed(DedupConfig(verify_jaccard=True, verify_method="shingles")) == ["v4"]


def test_documents_without_signatures_still_get_exact_dedup(spark):
    docs = [("s1", None, "Identical text here", 1.0), ("s2", None, "identical   TEXT here", 2.0), ("s3", None, "other", 0.0)]
    docs_df, sigs_df = frames(spark, docs, signature_rows(docs)[2:])
    kept, dups, stats = deduplicate(spark, docs_df, sigs_df, DedupConfig())
    assert collect_dups(dups) == [("s1", "s1", "s2", "exact")]
    assert stats["near_removed"] == 0


def union_find_components(nodes, edges):
    parent = {n: n for n in nodes}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {n: min((m for m in nodes if find(m) == find(n))) for n in nodes}


def test_connected_components_match_union_find(spark):
    rng = random.Random(11)
    nodes = [f"n{i:04d}" for i in range(400)]
    edges = [tuple(rng.sample(nodes, 2)) for _ in range(250)]
    path = rng.sample(nodes, 60)  # a long path with random ids needs several rounds
    edges += list(zip(path, path[1:]))
    df = spark.createDataFrame(edges, "src string, dst string")
    labels, iterations = connected_components(df, max_iterations=40)
    got = {r["doc_id"]: r["root"] for r in labels.collect()}
    in_edges = sorted({n for e in edges for n in e})
    assert len(got) == len(in_edges) == labels.count()
    assert got == union_find_components(in_edges, edges)
    assert 1 <= iterations <= 40
    with pytest.raises(RuntimeError, match="did not converge"):
        connected_components(df, max_iterations=1)


def test_config_validation():
    cfg = DedupConfig()
    assert (cfg.bands, cfg.rows, cfg.num_perm) == (14, 8, 112)
    assert (cfg.verify_jaccard, cfg.verify_method, cfg.verify_threshold) == (True, "shingles", 0.8)
    derived = DedupConfig(threshold=0.7)
    assert (derived.bands, derived.rows) == optimal_bands(0.7, 112)
    assert derived.verify_threshold == 0.7  # follows threshold unless given
    assert DedupConfig(threshold=0.7, verify_threshold=0.9).verify_threshold == 0.9
    with pytest.raises(ValidationError):
        DedupConfig(bands=15, rows=8)  # 120 > 112 values
    with pytest.raises(ValidationError):
        DedupConfig(threshold=0.8, bands=10)
    with pytest.raises(ValidationError):
        DedupConfig(verify_threshold=1.5)
    with pytest.raises(ValidationError):
        DedupConfig(max_cc_iterations=0)
    with pytest.raises(ValidationError):
        DedupConfig(unknown_field=1)
    from workflows.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"dedup\.example_near_pairs.*\n.*dedup\.example_chars"):
        parse_config({"dedup": {"example_near_pairs": -1, "example_chars": 5}})


SUBPROCESS_RUN = """
import json, sys
from engine.spark import get_spark
from engine.dedup import DedupConfig, deduplicate
spark = get_spark("local[1]", {"spark.sql.shuffle.partitions": "3"})
docs = spark.read.parquet(sys.argv[1] + "/docs")
sigs = spark.read.parquet(sys.argv[1] + "/sigs")
kept, dups, stats = deduplicate(spark, docs, sigs, DedupConfig())
out = {"kept": sorted(r["doc_id"] for r in kept.select("doc_id").collect()),
       "dups": sorted(list(r) for r in dups.collect()), "stats": stats}
with open(sys.argv[1] + "/result.json", "w") as f:
    json.dump(out, f)
"""


def planted_corpus(shared_data, n_bases=160):
    """The scenario plus ~250 documents: 200-word windows of the novel and edited, exact and
    chained copies of them (seeded), so partitioning has many clusters to disagree on."""
    docs, _ = build_scenario(long_paragraphs(shared_data, 30))
    text = (shared_data / "prose" / "gutenberg_pride_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    words = text[text.find("Chapter 1") :].split()
    rng = random.Random(5)
    for i in range(n_bases):
        base = " ".join(words[i * 200 : (i + 1) * 200])
        docs.append((f"w{i:03d}a", None, base, round(rng.random(), 2)))
        if i % 2 == 0:  # near copies of every other window; some of them chained
            copy = replace_words(base, rng.sample(range(200), rng.randint(1, 6)), word=rng.choice(["zebra", "lion"]))
            docs.append((f"w{i:03d}b", None, copy, round(rng.random(), 2)))
            if i % 6 == 0:
                docs.append((f"w{i:03d}c", None, replace_words(copy, rng.sample(range(200), 3), word="okapi"), 0.5))
        if i % 7 == 0:
            docs.append((f"w{i:03d}d", None, base.upper(), 0.5))  # exact after normalisation, score tie
    return docs


@pytest.mark.slow
def test_kept_set_independent_of_partitioning_and_cores(spark, shared_data, tmp_path):
    docs = planted_corpus(shared_data)
    docs_df, sigs_df = frames(spark, docs)
    kept, dups, stats = deduplicate(spark, docs_df, sigs_df, DedupConfig())
    expected_kept = sorted(r["doc_id"] for r in kept.select("doc_id").collect())
    expected_dups = collect_dups(dups)
    assert len(docs) > 250 and stats["near_removed"] >= 80 and stats["exact_removed"] >= 20  # the test has teeth
    # Same session, different partitioning and row order of both inputs.
    shuffled_docs = docs_df.repartition(7).sortWithinPartitions("text")
    k2, d2, s2 = deduplicate(spark, shuffled_docs, sigs_df.coalesce(1), DedupConfig())
    assert sorted(r["doc_id"] for r in k2.select("doc_id").collect()) == expected_kept
    assert collect_dups(d2) == expected_dups
    assert s2 == stats  # histogram and example pairs included
    # A separate local[1] process with 3 shuffle partitions.
    docs_df.repartition(3).write.parquet(str(tmp_path / "docs"))
    sigs_df.repartition(2).write.parquet(str(tmp_path / "sigs"))
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", SUBPROCESS_RUN, str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["kept"] == expected_kept
    assert [tuple(r) for r in result["dups"]] == expected_dups
    assert result["stats"] == json.loads(json.dumps(stats))
