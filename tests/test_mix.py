import hashlib
import json
import os
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm
from pydantic import ValidationError

from engine.decontam import GSM8K_FIELDS, DecontamConfig, EvalSetConfig
from engine.mix import MixConfig, build_mixture, load_rows, trace_sequence, validation_doc_ids
from engine.paths import REPO_ROOT
from engine.tokenize import read_doc_index, read_indexed_dataset, tokenize_documents
from engine.tokenizer import EOS_ID, TokenizerConfig, train_tokenizer

DOC_SCHEMA = "doc_id string, bucket string, text string"
SEQ_LEN = 64
WEIGHTS = {"austen": 0.3, "shakespeare": 0.7}
PLANTED_DOC = "planted-gsm8k-doc"


def prose_buckets(shared_data, docs_per_bucket):
    prose = shared_data / "prose"
    plays = (prose / "tinyshakespeare" / "data_tinyshakespeare_input.txt").read_text(encoding="utf-8").split("\n\n")
    novel = (prose / "gutenberg_pride_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    novel = novel.replace("\r\n", "\n").split("\n\n")[40:]
    group = lambda parts, k: ["\n".join(p.strip() for p in parts[i:i + k]) for i in range(0, len(parts), k)]
    return {"shakespeare": group(plays, 6)[:docs_per_bucket], "austen": group(novel, 3)[:docs_per_bucket]}


@pytest.fixture(scope="module")
def snapshots(shared_data):
    """Two snapshots of 50 documents per bucket; snapshot B carries a planted GSM8K question."""
    buckets = prose_buckets(shared_data, docs_per_bucket=100)
    question = json.loads((shared_data / "decontam" / "gsm8k_test" / "grade_school_math_data_test.jsonl")
                          .read_text(encoding="utf-8").splitlines()[7])["question"]
    snaps = {"A": [], "B": []}
    for bucket, texts in buckets.items():
        for i, text in enumerate(texts):
            snap = "A" if i % 2 == 0 else "B"
            snaps[snap].append((hashlib.sha1(f"{snap}\x00{bucket}\x00{i}".encode()).hexdigest()[:20], bucket, text))
    snaps["B"].append((PLANTED_DOC, "shakespeare", buckets["shakespeare"][0] + "\n" + question + "\nThus ends the tale."))
    return snaps


@pytest.fixture(scope="module")
def env(spark, snapshots, tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    texts = {}
    for rows in snapshots.values():
        for _, bucket, text in rows:
            texts.setdefault(bucket, []).append(text)
    train_tokenizer(texts, str(root / "tok"), TokenizerConfig(vocab_size=1024, sample_chars_per_bucket=50_000))
    dirs = []
    for snap, rows in snapshots.items():
        out = root / f"tokenized-{snap}"
        tokenize_documents(spark, spark.createDataFrame(rows, DOC_SCHEMA), str(root / "tok" / "tokenizer.model"),
                           str(out), num_shards=2, eos_id=EOS_ID)
        dirs.append(str(out))
    doc_texts = {doc_id: text for rows in snapshots.values() for doc_id, _, text in rows}
    return {"root": root, "dirs": dirs, "doc_texts": doc_texts, "tok": root / "tok",
            "sp": spm.SentencePieceProcessor(model_file=str(root / "tok" / "tokenizer.model"))}


def mix(env, out, cfg, **kwargs):
    return build_mixture(kwargs.pop("dirs", env["dirs"]), str(out), cfg, vocab_size=1024, eos_id=EOS_ID,
                         token_bytes_path=str(env["tok"] / "token_bytes.npy"), **kwargs)


@pytest.fixture(scope="module")
def mixed(env):
    out = env["root"] / "mixed"
    cfg = MixConfig(bucket_weights=WEIGHTS, total_tokens=30_000, seq_len=SEQ_LEN, seed=3, val_fraction=0.05)
    return out, mix(env, out, cfg)


def doc_lookup(env):
    """doc_id -> (bucket, token array) over all tokenized snapshots."""
    docs = {}
    for folder in env["dirs"]:
        shards = {}
        for doc in read_doc_index(folder).to_pylist():
            shard = shards.setdefault(doc["shard"], read_indexed_dataset(f"{folder}/shard-{doc['shard']:05d}.bin"))
            docs[doc["doc_id"]] = (doc["bucket"], np.asarray(shard[doc["shard_doc"]]))
    return docs


def piece_bytes(sp):
    out = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):
            out.append(bytes([int(piece[3:5], 16)]))
        elif sp.is_control(i) or sp.is_unknown(i):
            out.append(b"")
        else:
            out.append(piece.replace("\u2581", " ").encode("utf-8"))
    return out


def test_manifest_follows_the_contract(mixed):
    out, manifest = mixed
    assert json.loads((out / "manifest.json").read_text()) == manifest
    n = 30_000 // (SEQ_LEN + 1)
    assert manifest["dtype"] == "uint16" and manifest["seq_len"] == SEQ_LEN
    assert manifest["vocab_size"] == 1024 and manifest["eos_id"] == EOS_ID
    assert manifest["train"]["file"] == "train.bin" and manifest["train"]["num_sequences"] == n
    assert (out / "train.bin").stat().st_size == n * (SEQ_LEN + 1) * 2
    assert manifest["token_bytes_file"] == "token_bytes.npy"
    assert (out / "token_bytes.npy").read_bytes() == (out.parent / "tok" / "token_bytes.npy").read_bytes()
    token_bytes = np.load(out / "token_bytes.npy")
    for bucket in WEIGHTS:
        val = manifest["validation"][bucket]
        rows = load_rows(str(out), val["file"])
        assert val["file"] == f"val_{bucket}.bin" and rows.shape == (val["num_sequences"], SEQ_LEN + 1)
        assert val["num_sequences"] >= 1 and val["num_tokens"] == rows.size
        assert val["num_bytes"] == int(token_bytes[rows].sum())
        stats = manifest["buckets"][bucket]
        assert set(stats) >= {"tokens_available", "tokens_sampled", "epochs", "target_share", "realised_share"}
        assert stats["target_share"] == WEIGHTS[bucket]
    assert manifest["decontam"] == {"enabled": False} and manifest["warnings"] == []


def test_realised_shares_within_one_percent(mixed, env):
    out, manifest = mixed
    docs = doc_lookup(env)
    spans = pq.read_table(out / "train_spans.parquet").to_pandas()
    spans["bucket"] = spans["doc_id"].map(lambda d: docs[d][0])
    total = manifest["train"]["num_sequences"] * (SEQ_LEN + 1)
    assert spans["length"].sum() == total
    for bucket, weight in WEIGHTS.items():
        share = spans.loc[spans["bucket"] == bucket, "length"].sum() / total
        assert abs(share - weight) < 0.01
        assert manifest["buckets"][bucket]["realised_share"] == pytest.approx(share)
        assert manifest["buckets"][bucket]["tokens_sampled"] == spans.loc[spans["bucket"] == bucket, "length"].sum()


def test_every_token_traces_to_its_document(mixed, env, snapshots):
    out, _ = mixed
    docs, pieces = doc_lookup(env), piece_bytes(env["sp"])
    texts = {doc_id: text.encode("utf-8") for rows in snapshots.values() for doc_id, _, text in rows}
    rows = load_rows(str(out))
    spans = pq.read_table(out / "train_spans.parquet").to_pandas()
    for seq_index, group in spans.groupby("seq_index"):
        group = group.sort_values("seq_offset")
        starts = group["seq_offset"].to_numpy()
        assert starts[0] == 0 and (starts[1:] == (starts + group["length"].to_numpy())[:-1]).all()
        assert group["length"].sum() == SEQ_LEN + 1
        for span in group.itertuples():
            tokens = rows[seq_index, span.seq_offset:span.seq_offset + span.length]
            source = docs[span.doc_id][1][span.doc_token_start:span.doc_token_start + span.length]
            assert (tokens == source).all()
            decoded = b"".join(pieces[t] for t in tokens.tolist())
            assert decoded in texts[span.doc_id]


def test_trace_sequence_rebuilds_the_row(mixed, env):
    out, manifest = mixed
    rows = load_rows(str(out))
    for seq_index in [0, manifest["train"]["num_sequences"] - 1]:
        spans = trace_sequence(str(out), seq_index)
        assert sum((s["tokens"] for s in spans), []) == rows[seq_index].tolist()
        assert all(set(s) >= {"doc_id", "doc_token_start", "length", "tokens"} for s in spans)
    with pytest.raises(IndexError):
        trace_sequence(str(out), manifest["train"]["num_sequences"])


def test_validation_documents_never_in_train(mixed, env):
    out, _ = mixed
    val_ids = set(validation_doc_ids(str(out)))
    train_ids = set(pq.read_table(out / "train_spans.parquet").column("doc_id").to_pylist())
    assert val_ids and not val_ids & train_ids
    docs = doc_lookup(env)
    val_spans = pq.read_table(out / "val_spans.parquet").to_pandas()
    for bucket in WEIGHTS:
        rows = load_rows(str(out), f"val_{bucket}.bin")
        for span in val_spans[val_spans["bucket"] == bucket].itertuples():
            assert docs[span.doc_id][0] == bucket
            source = docs[span.doc_id][1][span.doc_token_start:span.doc_token_start + span.length]
            assert (rows[span.seq_index, span.seq_offset:span.seq_offset + span.length] == source).all()


def test_mix_is_deterministic_and_ignores_folder_order(mixed, env, tmp_path):
    out, manifest = mixed
    again = mix(env, tmp_path / "again", MixConfig(**manifest["config"]), dirs=list(reversed(env["dirs"])))
    assert again == manifest
    for path in sorted(out.iterdir()):
        assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes(), path.name
    other_seed = mix(env, tmp_path / "seed", MixConfig(**{**manifest["config"], "seed": 4}))
    assert other_seed["train"] == manifest["train"]
    assert (tmp_path / "seed" / "train.bin").read_bytes() != (out / "train.bin").read_bytes()


def test_held_out_documents_stay_held_out_when_a_snapshot_is_added(env, tmp_path):
    cfg = MixConfig(bucket_weights=WEIGHTS, total_tokens=20_000, seq_len=SEQ_LEN, val_fraction=0.2)
    mix(env, tmp_path / "one", cfg, dirs=env["dirs"][:1])
    mix(env, tmp_path / "both", cfg)
    held_out_before = set(validation_doc_ids(str(tmp_path / "one")))
    trained_after = set(pq.read_table(tmp_path / "both" / "train_spans.parquet").column("doc_id").to_pylist())
    assert held_out_before and not held_out_before & trained_after


def test_small_bucket_is_repeated_and_counted_as_epochs(env, tmp_path):
    cfg = MixConfig(bucket_weights={"austen": 0.9, "shakespeare": 0.1}, total_tokens=90_000, seq_len=SEQ_LEN,
                    max_epochs_warn=1.5)
    with pytest.warns(UserWarning, match="austen"):
        manifest = mix(env, tmp_path, cfg)
    austen = manifest["buckets"]["austen"]
    assert austen["epochs"] == pytest.approx(austen["tokens_sampled"] / austen["tokens_available"])
    assert austen["epochs"] > 1.5 and abs(austen["realised_share"] - 0.9) < 0.01
    assert any("'austen' is repeated" in w for w in manifest["warnings"])
    assert manifest["buckets"]["shakespeare"]["epochs"] < 1
    spans = pq.read_table(tmp_path / "train_spans.parquet").to_pandas()
    starts = spans[spans["doc_token_start"] == 0].groupby("doc_id").size()
    assert starts.max() >= 2  # whole documents appear once per epoch


def test_planted_gsm8k_document_is_removed(env, shared_data, tmp_path, monkeypatch):
    # A relative path, as in pipeline.yaml, resolved against the repository root and not the cwd.
    relative = os.path.relpath(shared_data / "decontam" / "gsm8k_test" / "grade_school_math_data_test.jsonl", REPO_ROOT)
    gsm8k = EvalSetConfig(name="gsm8k", fields=GSM8K_FIELDS, path=relative)
    monkeypatch.chdir(tmp_path)
    ids, texts = list(env["doc_texts"]), list(env["doc_texts"].values())
    half = len(ids) // 2  # texts spread over two Parquet files, as with several deduplicated snapshots
    pq.write_table(pa.table({"doc_id": ids[:half], "text": texts[:half]}), tmp_path / "texts-a.parquet")
    pq.write_table(pa.table({"doc_id": ids[half:], "text": texts[half:]}), tmp_path / "texts-b.parquet")
    base = dict(bucket_weights=WEIGHTS, total_tokens=120_000, seq_len=SEQ_LEN, val_fraction=0.0, min_val_docs_per_bucket=0)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny buckets are repeated and have no validation here
        removed = mix(env, tmp_path / "remove", MixConfig(**base, decontam=DecontamConfig(eval_sets=[gsm8k])),
                      doc_texts=[str(tmp_path / "texts-a.parquet"), str(tmp_path / "texts-b.parquet")])
        flagged = mix(env, tmp_path / "flag", MixConfig(**base, decontam=DecontamConfig(eval_sets=[gsm8k], mode="flag")),
                      doc_texts=env["doc_texts"])
    report = removed["decontam"]
    assert report["contaminated_doc_ids"] == [PLANTED_DOC] and report["documents_removed"] == 1
    assert report["eval_sets"]["gsm8k"]["examples"][0]["item"] == "7"
    assert report["documents_without_text"] == 0
    removed_ids = set(pq.read_table(tmp_path / "remove" / "train_spans.parquet").column("doc_id").to_pylist())
    flagged_ids = set(pq.read_table(tmp_path / "flag" / "train_spans.parquet").column("doc_id").to_pylist())
    assert PLANTED_DOC not in removed_ids and PLANTED_DOC in flagged_ids
    assert flagged["decontam"]["documents_contaminated"] == 1 and flagged["decontam"]["documents_removed"] == 0
    assert report["eval_sets"]["gsm8k"]["documents_removed"] == 1 and report["eval_sets"]["gsm8k"]["documents_flagged"] == 0
    assert flagged["decontam"]["eval_sets"]["gsm8k"]["documents_flagged"] == 1

    # The Dagster metadata of mixed_shards, built from the stage's manifest.
    from assets.mixed_shards import decontam_metadata

    question = json.loads((shared_data / "decontam" / "gsm8k_test" / "grade_school_math_data_test.jsonl")
                          .read_text(encoding="utf-8").splitlines()[7])["question"]
    manifest = json.loads((tmp_path / "remove" / "manifest.json").read_text())
    shown = decontam_metadata(manifest, DecontamConfig())
    table = shown["decontamination"].value
    assert "mode `remove`, 13-grams: 1 of " in table
    assert ("| eval_set | items | items_too_short | items_matched | documents_matched | documents_removed | "
            "documents_flagged |") in table
    assert "| gsm8k | 1319 | 0 | 1 | 1 | 1 | 0 |" in table
    examples = shown["decontamination_examples"].value
    assert f"| gsm8k | 7 | {PLANTED_DOC} |" in examples and " ".join(question.split()[:8]) in examples
    # How much is shown is config (mix.decontam), not the manifest: a span cut short ends in "...".
    short = decontam_metadata(manifest, DecontamConfig(shown_span_chars=20))["decontamination_examples"].value
    span = manifest["decontam"]["eval_sets"]["gsm8k"]["examples"][0]["span"].replace("\n", " ")  # as a table cell
    assert len(span) > 20 and f"| {span[:20]}... |" in short and span[:21] not in short
    none_shown = decontam_metadata(manifest, DecontamConfig(examples_shown=0))["decontamination_examples"].value
    assert PLANTED_DOC not in none_shown
    flagged_table = decontam_metadata(flagged, DecontamConfig())["decontamination"].value
    assert "mode `flag`" in flagged_table and "| gsm8k | 1319 | 0 | 1 | 1 | 0 | 1 |" in flagged_table
    assert "off" in decontam_metadata({"decontam": {"enabled": False}}, DecontamConfig())["decontamination"].value


def test_decontam_without_texts_is_an_error(env, shared_data, tmp_path):
    gsm8k = EvalSetConfig(name="gsm8k", fields=GSM8K_FIELDS,
                          path=str(shared_data / "decontam" / "gsm8k_test" / "grade_school_math_data_test.jsonl"))
    with pytest.raises(ValueError, match="doc_texts"):
        mix(env, tmp_path, MixConfig(bucket_weights=WEIGHTS, total_tokens=1_000, seq_len=SEQ_LEN,
                                     decontam=DecontamConfig(eval_sets=[gsm8k])))


def test_weighted_bucket_without_documents_is_an_error(env, tmp_path):
    with pytest.raises(ValueError, match="code"):
        mix(env, tmp_path, MixConfig(bucket_weights={"code": 0.5, "austen": 0.5}, total_tokens=1_000, seq_len=SEQ_LEN))


@pytest.mark.parametrize("bad", [
    dict(bucket_weights={"a": 0.5, "b": 0.4}),
    dict(bucket_weights={"a": 1.5, "b": -0.5}),
    dict(bucket_weights={"a/b": 1.0}),
    dict(bucket_weights={}),
    dict(total_tokens=10, seq_len=64),
    dict(val_fraction=0.6),
    dict(max_epochs_warn=0),
])
def test_config_rejects_invalid_values(bad):
    with pytest.raises(ValidationError):
        MixConfig(**bad)
