"""The evaluation report: cloze items, samples, contamination audit, comparison, report files,
determinism, lm-evaluation-harness interop, a browser rendering of report.html, and the asset.

The fixture is a real small run: a SentencePiece tokenizer and a `mixed_shards` folder built
by the pipeline's own engines from a learnable toy grammar (one planted eval-set item), and a
tiny model trained on it in-process and exported like a checkpoint.
"""
import copy
import hashlib
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from conftest import skip_or_fail
from engine.decontam import DecontamConfig, EvalSetConfig
from engine.mix import MixConfig, build_mixture
from engine.report import (
    BETTER_COLOR, LOSS_COLOR, TRAINED_COLOR, WORSE_COLOR, build_report, check_finite, compare, contamination_audit,
    heldout_documents, key_metrics, report_numbers,
)
from engine.tokenize import DOC_INDEX_FILE, shard_prefix, token_dtype, write_indexed_dataset
from engine.tokenizer import BOS_ID, EOS_ID, TokenizerConfig, train_tokenizer
from training.data import TrainBatches
from training.evaluate import (
    build_cloze_items, evaluate_checkpoint, generate_samples, lm_eval_runtime, lm_eval_unavailable, load_hf_export,
    run_lm_eval, score_cloze,
)
from training.export import load_exported, save_export
from training.model import ModelConfig, build_model
from workflows.config import ConfigError, EvaluationConfig, parse_config

REPO = Path(__file__).resolve().parents[1]
LM_EVAL_TASKS = REPO / "tests" / "data" / "lm_eval_task"
SEQ_LEN = 64
INIT_SEED = 7
PROMPTS = ["The farmer keeps the bicycle in the", "Every evening my aunt read the"]
# lm_eval's device, dtype and batch size as the pipeline config's defaults set them.
LM_EVAL_RUNTIME = {name: getattr(EvaluationConfig(), f"lm_eval_{name}") for name in ("device", "dtype", "batch_size")}
PLANTED = "the lighthouse keeper counted eleven silver boats drifting past the northern harbour wall before dawn"

# A grammar whose last word follows from the object, so a tiny model can learn the cloze.
PLACE_OF = {"bicycle": "garage", "teapot": "kitchen", "shovel": "garden", "blanket": "bedroom",
            "ladder": "shed", "violin": "studio"}
TOPIC_OF = {"atlas": "mountains", "novel": "sailors", "diary": "winters", "poem": "rivers", "letter": "harvests"}
PEOPLE = ["the farmer", "my neighbour", "a child", "the cook", "our teacher", "my aunt"]
VERBS = ["keeps", "finds", "washes", "paints", "moves"]


def _documents(rng: np.random.Generator, bucket: str, n: int) -> list[str]:
    def sentence() -> str:
        who = str(rng.choice(PEOPLE))
        if bucket == "web":
            thing = str(rng.choice(sorted(PLACE_OF)))
            text = f"{who} {rng.choice(VERBS)} the {thing} in the {PLACE_OF[thing]}."
        else:
            book = str(rng.choice(sorted(TOPIC_OF)))
            text = f"every evening {who} read the {book} about {TOPIC_OF[book]}."
        return text[0].upper() + text[1:]

    return [" ".join(sentence() for _ in range(int(rng.integers(6, 12)))) for _ in range(n)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run faster on one thread than on contended ones; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Tokenizer, tokenized shard, mixed_shards (decontam in flag mode), texts, and a trained export."""
    root = tmp_path_factory.mktemp("eval")
    rng = np.random.default_rng(0)
    docs = {bucket: _documents(rng, bucket, n) for bucket, n in (("web", 160), ("books", 120))}
    docs["web"][5] += " " + PLANTED[0].upper() + PLANTED[1:] + "."
    rows = [(hashlib.sha1(f"{b}{i}".encode()).hexdigest()[:20], b, t) for b, texts in docs.items()
            for i, t in enumerate(texts)]
    train_tokenizer(docs, str(root / "tokenizer"), TokenizerConfig(vocab_size=384, sample_chars_per_bucket=200_000))
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(root / "tokenizer" / "tokenizer.model"))
    vocab = sp.get_piece_size()

    tokenized = root / "tokenized"
    tokenized.mkdir()
    encoded = [np.array(sp.encode(text) + [EOS_ID]) for _, _, text in rows]
    sizes = write_indexed_dataset(shard_prefix(str(tokenized), 0), encoded, token_dtype(vocab))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    pq.write_table(pa.table({
        "doc_id": [r[0] for r in rows], "bucket": [r[1] for r in rows],
        "shard": pa.array(np.zeros(len(rows), dtype=np.int32)), "shard_doc": pa.array(np.arange(len(rows))),
        "token_offset": pa.array(offsets.astype(np.int64)), "num_tokens": pa.array(sizes.astype(np.int64)),
    }), tokenized / DOC_INDEX_FILE)
    kept = root / "deduplicated" / "kept"
    kept.mkdir(parents=True)
    pq.write_table(pa.table({"doc_id": [r[0] for r in rows], "text": [r[2] for r in rows]}), kept / "part-0.parquet")

    eval_set = root / "eval_set.jsonl"
    eval_set.write_text("".join(json.dumps({"question": q}) + "\n" for q in [
        PLANTED, "how many apples are left when a basket of twelve loses five of them to hungry birds today",
        "a train leaves the station at noon and travels ninety miles an hour until it reaches the coast"]))
    decontam = DecontamConfig(eval_sets=[EvalSetConfig(name="toy", path=str(eval_set), fields=["question"])],
                              ngram=8, mode="flag")
    mixed = root / "mixed"
    manifest = build_mixture([str(tokenized)], str(mixed), MixConfig(
        bucket_weights={"web": 0.6, "books": 0.4}, total_tokens=60_000, seq_len=SEQ_LEN, val_fraction=0.1,
        decontam=decontam), vocab_size=vocab, eos_id=EOS_ID, token_bytes_path=str(root / "tokenizer" / "token_bytes.npy"),
        doc_texts=str(kept))

    cfg = ModelConfig(vocab_size=vocab, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=176,
                      max_seq_len=SEQ_LEN, eos_id=EOS_ID, bos_id=BOS_ID)
    torch.manual_seed(0)
    model = build_model(cfg, INIT_SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    batches = TrainBatches(mixed, micro_batch_size=16, seed=0)
    losses = []
    for step in range(1, 161):
        inputs, targets = batches.next_batch()
        loss = model(inputs, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append((step, loss.item()))
    export = root / "checkpoint" / "export"
    save_export(model.state_dict(), cfg, export, root / "tokenizer")
    return {"root": root, "mixed": mixed, "manifest": manifest, "kept": kept, "export": export, "sp": sp,
            "losses": losses, "rows": rows, "eval_set": eval_set}


@pytest.fixture(scope="module")
def documents(run) -> list[tuple[str, str, str]]:
    docs, missing = heldout_documents(run["mixed"], [run["kept"]])
    assert missing == 0
    return docs


def evaluate_run(run, documents, **overrides) -> dict:
    settings = dict(init_seed=INIT_SEED, max_sequences_per_bucket=16, cloze_items_per_bucket=24,
                    cloze_min_context_words=12, prompts=PROMPTS, sample_max_new_tokens=12, seed=3,
                    **{f"lm_eval_{name}": value for name, value in LM_EVAL_RUNTIME.items()})
    return evaluate_checkpoint(run["export"], run["mixed"], documents, **(settings | overrides), log=lambda _: None)


@pytest.fixture(scope="module")
def metrics(run, documents) -> dict:
    result = evaluate_run(run, documents)
    result["contamination"] = contamination_audit(run["manifest"]["decontam"], 0.5)
    return result


# --- cloze ---------------------------------------------------------------------------------

def test_heldout_documents_are_exactly_the_validation_documents(run, documents):
    spans = pq.read_table(run["mixed"] / "val_spans.parquet").to_pylist()
    assert sorted({(s["doc_id"], s["bucket"]) for s in spans}) == [(d, b) for d, b, _ in documents]
    train_ids = set(pq.read_table(run["mixed"] / "train_spans.parquet").column("doc_id").to_pylist())
    assert not train_ids & {d for d, _, _ in documents}
    text_of = {r[0]: r[2] for r in run["rows"]}
    assert all(text == text_of[doc_id] for doc_id, _, text in documents)


def test_cloze_items_end_passages_with_their_final_word(run, documents):
    sp = run["sp"]
    items = build_cloze_items(documents, sp.encode, items_per_bucket=10, seed=1, max_tokens=SEQ_LEN, eos_id=EOS_ID,
                              min_context_words=12)
    text_of = {d: t for d, _, t in documents}
    bucket_of = {d: b for d, b, _ in documents}
    assert set(items) == {"web", "books"} and all(len(v) == 10 for v in items.values())
    for bucket, bucket_items in items.items():
        assert len({(i.doc_id, i.offset) for i in bucket_items}) == 10
        for item in bucket_items:
            text = text_of[item.doc_id]
            assert bucket_of[item.doc_id] == bucket
            assert text[item.offset:item.offset + len(item.word)] == item.word and text[item.offset - 1] == " "
            assert text[item.offset + len(item.word)] == "."  # a sentence-final word
            assert len(text[:item.offset].split()) >= 12
            assert sp.decode(list(item.target_ids)) == " " + item.word
            context = list(item.context_ids)
            assert len(context) + len(item.target_ids) <= SEQ_LEN
            if context[0] == EOS_ID:  # the whole document prefix fits
                assert sp.decode(context[1:]) == text[:item.offset - 1]
            else:
                assert text[:item.offset - 1].endswith(sp.decode(context[1:]))
    # The choice depends on the documents and the seed only.
    again = build_cloze_items(list(reversed(documents)), sp.encode, items_per_bucket=10, seed=1, max_tokens=SEQ_LEN,
                              eos_id=EOS_ID, min_context_words=12)
    other = build_cloze_items(documents, sp.encode, items_per_bucket=10, seed=2, max_tokens=SEQ_LEN, eos_id=EOS_ID,
                              min_context_words=12)
    assert again == items and other != items


def test_cloze_exact_match_is_real_greedy_decoding_and_training_learns_it(run, documents):
    model, _ = load_exported(run["export"])
    hf_model, sp = load_hf_export(run["export"])
    items = build_cloze_items(documents, sp.encode, items_per_bucket=16, seed=0, max_tokens=SEQ_LEN, eos_id=EOS_ID,
                              min_context_words=12)["web"]
    scored = score_cloze(model, items, batch_size=5)
    for item, result in zip(items, scored):
        generated = hf_model.generate(torch.tensor([item.context_ids]), do_sample=False,
                                      max_new_tokens=len(item.target_ids), pad_token_id=EOS_ID)[0, len(item.context_ids):]
        assert result["correct"] == (generated.tolist() == list(item.target_ids))
        assert result["greedy_ids"] == generated.tolist()[:len(result["greedy_ids"])]
    initial = score_cloze(build_model(model.cfg, INIT_SEED), items)
    assert sum(r["correct"] for r in scored) > sum(r["correct"] for r in initial)


# --- samples, determinism --------------------------------------------------------------------

def test_samples_are_greedy_and_seeded(run):
    model, sp = load_hf_export(run["export"])
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = generate_samples(model, sp, PROMPTS, max_new_tokens=16, seed=5, temperature=1.0)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is untouched
    again = generate_samples(model, sp, PROMPTS, max_new_tokens=16, seed=5, temperature=1.0)
    reseeded = generate_samples(model, sp, PROMPTS, max_new_tokens=16, seed=6, temperature=1.0)
    assert first == again
    assert [s["greedy"] for s in reseeded] == [s["greedy"] for s in first]
    assert [s["sampled"] for s in reseeded] != [s["sampled"] for s in first]
    assert [s["seed"] for s in first] == [5, 6]
    assert all(0 < s["greedy_tokens"] <= 16 for s in first)
    # The trained model completes the grammar: the bicycle lives in the garage.
    assert first[0]["greedy"].startswith(" garage")


def test_export_tokenizer_loads_with_autotokenizer_and_encodes_like_sentencepiece(run, documents):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(run["export"])
    texts = [text for _, _, text in documents[:40]] + [PLANTED, "Ünïcödé 42 — ok?", "</s> stays text"]
    assert all(hf.encode(text) == run["sp"].encode(text) for text in texts)


def test_evaluating_the_same_checkpoint_twice_gives_identical_numbers(run, documents, metrics):
    again = evaluate_run(run, documents)
    again["contamination"] = contamination_audit(run["manifest"]["decontam"], 0.5)
    assert json.dumps(again, sort_keys=True) == json.dumps(metrics, sort_keys=True)


def test_trained_beats_step0_everywhere_and_metrics_are_finite(metrics):
    assert set(metrics["trained"]) == {"web", "books"}
    for bucket, m in metrics["trained"].items():
        assert m["bits_per_byte"] < metrics["initial"][bucket]["bits_per_byte"]
        assert m["perplexity"] < metrics["initial"][bucket]["perplexity"]
        cloze = metrics["cloze"][bucket]
        assert cloze["trained"]["items"] == 24 == len(cloze["items"])
        assert cloze["trained"]["accuracy"] > cloze["initial"]["accuracy"]
    assert check_finite(metrics, ["web", "books"]) == (True, {})
    broken = copy.deepcopy(metrics)
    broken["trained"]["web"]["bits_per_byte"] = float("nan")
    passed, problems = check_finite(broken, ["web", "books", "code"])
    assert not passed and set(problems) == {"web", "code"}
    assert metrics["lm_eval"]["status"] == "skipped" and "lm_eval_task_dir" in metrics["lm_eval"]["reason"]


# --- contamination audit, comparison ---------------------------------------------------------

def test_contamination_audit_counts_per_eval_set_and_limits_the_rate(run):
    decontam = run["manifest"]["decontam"]
    audit = contamination_audit(decontam, max_rate=0.5)
    toy = audit["eval_sets"]["toy"]
    assert audit["enabled"] and audit["mode"] == "flag"
    assert audit["documents_contaminated"] == 1 and audit["documents_left_in_training"] == 1
    assert toy["items"] == 3 and toy["items_matched"] == 1 and toy["items_left_in_training"] == 1
    assert toy["item_rate"] == pytest.approx(1 / 3) and audit["max_item_rate"] == pytest.approx(1 / 3)
    assert toy["examples"][0]["item"] == "0" and "lighthouse keeper" in toy["examples"][0]["span"].lower()
    assert audit["passed"] and not contamination_audit(decontam, max_rate=0.3)["passed"]
    removed = contamination_audit({**decontam, "mode": "remove", "documents_removed": 1}, max_rate=0.0)
    assert removed["passed"] and removed["max_item_rate"] == 0 and removed["eval_sets"]["toy"]["items_matched"] == 1
    off = contamination_audit({"enabled": False}, max_rate=0.0)
    assert off["passed"] and not off["enabled"] and "mix.decontam" in off["note"]


def _metrics(bpb: float, accuracy: float, acc: float = 0.5) -> dict:
    return {
        "trained": {"web": {"loss": 2.0, "perplexity": 7.389, "bits_per_byte": bpb, "tokens": 10, "bytes": 40}},
        "initial": {"web": {"loss": 5.0, "perplexity": 148.4, "bits_per_byte": 4.0, "tokens": 10, "bytes": 40}},
        "cloze": {"web": {"trained": {"items": 10, "correct": int(accuracy * 10), "accuracy": accuracy,
                                      "mean_target_logprob": -2.0},
                          "initial": {"items": 10, "correct": 0, "accuracy": 0.0, "mean_target_logprob": -9.0}}},
        "lm_eval": {"status": "ok", "tasks": {"toy": {"acc": acc}}, "higher_is_better": {"toy": {"acc": True}},
                    "samples": {"toy": 4}, "version": "x"},
    }


def test_comparison_arrows_follow_each_metrics_direction():
    rows = {(r["metric"], r["scope"]): r for r in compare(key_metrics(_metrics(1.5, 0.4, acc=0.25)),
                                                            key_metrics(_metrics(2.0, 0.6, acc=0.25)))}
    assert rows[("bits_per_byte", "web")]["verdict"] == "better" and rows[("bits_per_byte", "web")]["arrow"] == "▲"
    assert rows[("bits_per_byte", "web")]["delta"] == pytest.approx(-0.5)
    assert rows[("cloze_accuracy", "web")]["verdict"] == "worse" and rows[("cloze_accuracy", "web")]["arrow"] == "▼"
    assert rows[("lm_eval.acc", "toy")]["verdict"] == "unchanged" and rows[("loss", "web")]["arrow"] == "="
    worse = compare(key_metrics(_metrics(2.5, 0.6)), key_metrics(_metrics(2.0, 0.6)))
    assert {(r["metric"], r["verdict"]) for r in worse if r["metric"] == "bits_per_byte"} == {("bits_per_byte", "worse")}
    # A report from before cloze existed still compares per bucket.
    old = {"trained": {"web": {"loss": 2.0, "perplexity": 7.389, "bits_per_byte": 2.0}}, "initial": {}}
    assert {r["metric"] for r in compare(key_metrics(_metrics(1.5, 0.4)), key_metrics(old))} == {
        "bits_per_byte", "perplexity", "loss"}


# --- report files ----------------------------------------------------------------------------

def _report(run, metrics):
    previous = copy.deepcopy(metrics)
    for bucket in previous["trained"]:  # bits per byte got better since, perplexity worse
        previous["trained"][bucket]["bits_per_byte"] += 0.25
        previous["trained"][bucket]["perplexity"] *= 0.9
    comparison = compare(key_metrics(metrics), key_metrics(previous))
    return build_report(metrics, comparison=comparison, previous_version="0123456789abcdef",
                        loss_history=run["losses"], loss_source="MLflow run test", header=["Checkpoint `test`."])


def test_report_markdown_and_html_hold_every_section_and_embed_the_plots(run, metrics, tmp_path):
    from PIL import Image

    report = _report(run, metrics)
    assert set(report.figures) == {"bpb_by_bucket.png", "cloze_by_bucket.png", "deltas.png", "loss_curve.png"}
    for data in report.figures.values():
        with Image.open(__import__("io").BytesIO(data)) as image:
            assert image.format == "PNG" and image.size[0] >= 600
    for text in (report.markdown, report.html):
        for needle in ("bits per byte", "Cloze accuracy", "Contamination audit", "toy", "Compared with the previous",
                       "0123456789abcdef", "▲ better", "▼ worse", "Samples", PROMPTS[0], "lm-evaluation-harness",
                       "Training loss"):
            assert needle in text, needle
    assert report.html.count('src="data:image/png;base64,') == 4
    assert "http://" not in report.html and "https://" not in report.html  # self-contained
    assert "<script" not in report.html
    assert "Contamination audit" in report.summary and "Samples" not in report.summary
    paths = report.write(tmp_path)
    assert {p.name for p in paths} == {"report.md", "report.html", *report.figures}
    assert (tmp_path / "loss_curve.png").read_bytes() == report.figures["loss_curve.png"]
    numbers = report_numbers(metrics)
    assert numbers["cloze_items/web"] == 24 and numbers["contamination_max_item_rate"] == pytest.approx(1 / 3)
    assert numbers["bits_per_byte/web"] == metrics["trained"]["web"]["bits_per_byte"]
    assert all(math.isfinite(v) for v in numbers.values())


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_html_renders_its_plots_in_headless_chromium(run, metrics, tmp_path):
    from PIL import Image

    if _chromium() is None:
        skip_or_fail("browser", "headless Chromium not installed (Debian: apt-get install chromium)")

    page = tmp_path / "report.html"
    page.write_text(_report(run, metrics).html)
    shot = tmp_path / "shot.png"
    result = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1100,6000",
         f"--screenshot={shot}", page.as_uri()],
        capture_output=True, text=True, timeout=180)
    assert shot.exists(), result.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(np.int16)
    assert pixels.std() > 20  # not a blank page

    def count(color: str) -> int:
        rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
        return int((np.abs(pixels - rgb).max(axis=-1) <= 12).sum())

    # Each plot's own color is on screen: the base64 PNGs were decoded and drawn.
    assert count(TRAINED_COLOR) > 2000  # bits-per-byte and cloze bars
    assert count(LOSS_COLOR) > 300  # the loss curve
    assert count(BETTER_COLOR) > 300 and count(WORSE_COLOR) > 300  # the deltas plot


# --- lm-evaluation-harness -------------------------------------------------------------------

def test_lm_eval_step_skips_with_a_clear_reason_without_lm_eval(run, monkeypatch):
    import training.evaluate as evaluate

    monkeypatch.setattr(evaluate, "lm_eval_version", lambda: None)
    result = evaluate.run_lm_eval(run["export"], LM_EVAL_TASKS, ["kiln_tiny"], **LM_EVAL_RUNTIME)
    assert result["status"] == "skipped" and "[eval]" in result["reason"]


def test_lm_eval_runs_the_tiny_local_tasks_offline_and_folds_into_the_report(run, metrics):
    """lm_eval's own `hf` model on the export folder, as a user would run it (model=hf,
    pretrained=<export>); its tokenizer is the export's Hugging Face tokenizer."""
    reason = lm_eval_unavailable()
    if reason is not None:
        skip_or_fail("lm_eval", reason)
    result = run_lm_eval(run["export"], LM_EVAL_TASKS, ["kiln_tiny"], limit=6, seed=0, **LM_EVAL_RUNTIME)
    assert result["model"] == "hf" and result["model_args"]["prefix_token_id"] == EOS_ID
    # "auto" resolved to this host's device and dtype, and the results say which.
    device, dtype = lm_eval_runtime("auto", "auto")
    assert {k: result["model_args"][k] for k in ("device", "dtype", "batch_size")} == {
        "device": device, "dtype": dtype, "batch_size": LM_EVAL_RUNTIME["batch_size"]}
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"
    assert result["status"] == "ok"
    assert set(result["tasks"]) == {"kiln_tiny_choice", "kiln_tiny_lastword", "kiln_tiny_ppl"}
    assert result["samples"] == {"kiln_tiny_choice": 6, "kiln_tiny_lastword": 6, "kiln_tiny_ppl": 4}
    assert 0 <= result["tasks"]["kiln_tiny_choice"]["acc"] <= 1
    assert result["higher_is_better"]["kiln_tiny_ppl"]["bits_per_byte"] is False
    assert 0 < result["tasks"]["kiln_tiny_ppl"]["bits_per_byte"] < 20
    assert run_lm_eval(run["export"], LM_EVAL_TASKS, ["kiln_tiny"], limit=6, seed=0, **LM_EVAL_RUNTIME) == result
    report = build_report({**metrics, "lm_eval": result})
    assert "kiln_tiny_choice" in report.markdown and "Skipped" not in report.markdown.split("lm-evaluation-harness")[1]
    assert "lm_eval.acc/kiln_tiny_choice" in key_metrics({**metrics, "lm_eval": result})


def test_lm_eval_runtime_auto_picks_the_gpu_and_bf16_only_where_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lm_eval_runtime("auto", "auto") == ("cpu", "float32")
    assert lm_eval_runtime("cpu", "bfloat16") == ("cpu", "bfloat16")  # explicit values pass through
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert lm_eval_runtime("auto", "auto") == ("cuda", "bfloat16")
    assert lm_eval_runtime("cuda:1", "auto") == ("cuda:1", "bfloat16")
    assert lm_eval_runtime("cpu", "auto") == ("cpu", "float32")  # a GPU host told to use its CPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)  # e.g. a V100
    assert lm_eval_runtime("auto", "auto") == ("cuda", "float32")
    with pytest.raises(ConfigError, match="evaluation.lm_eval_device"):
        parse_config({"evaluation": {"lm_eval_device": "tpu"}})


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_training_loss_history_keeps_the_newest_value_of_a_redone_step(tmp_path, monkeypatch, store):
    """After a resume MLflow holds a step twice: the value logged before the kill and the redone
    one. The history keeps the newer by timestamp, whatever order the store returns them in: the
    SQL stores sort by timestamp, the file store returns them in the order they were logged."""
    import mlflow

    from engine.report import training_loss_history

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this flag
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}" if store == "sqlite" else (tmp_path / "mlruns").as_uri()
    client = mlflow.MlflowClient(tracking)
    run_id = client.create_run(client.create_experiment("kiln")).info.run_id
    for step in range(1, 6):
        client.log_metric(run_id, "loss", 10.0 - step, timestamp=2_000_000 + step, step=step)
    # Pre-kill values of steps 3-5, older, written last (as a store might return them).
    for step in range(3, 6):
        client.log_metric(run_id, "loss", 100.0 + step, timestamp=1_000_000 + step, step=step)
    client.log_metric(run_id, "loss", float("nan"), timestamp=3_000_000, step=6)  # newest value not finite
    client.log_metric(run_id, "loss", 4.0, timestamp=1_000_006, step=6)
    points, source = training_loss_history(tracking, run_id)
    assert points == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 5.0)] and source == f"MLflow run {run_id}"


# --- the Dagster asset -----------------------------------------------------------------------

def _publish(storage, asset, partition, source: Path, inputs: dict) -> str:
    staging = storage.new_staging_dir(asset, partition)
    shutil.copytree(source, staging, dirs_exist_ok=True)
    return storage.publish(staging, asset, partition, {"inputs": inputs}).data_version


@pytest.mark.slow
def test_asset_publishes_report_checks_mlflow_and_compares_with_the_previous_report(run, tmp_path, monkeypatch):
    import dagster as dg
    import mlflow

    from workflows.kiln import KilnResource
    from workflows.storage import open_storage

    state = tmp_path / "state"
    monkeypatch.setenv("KILN_STATE_DIR", str(state))
    tracking = f"sqlite:///{state / 'mlflow.db'}"
    state.mkdir()
    client = mlflow.MlflowClient(tracking)
    experiment = client.create_experiment("kiln", artifact_location=(state / "mlartifacts").as_uri())
    training_run = client.create_run(experiment, run_name="training").info.run_id
    for step, loss in run["losses"]:
        client.log_metric(training_run, "loss", loss, step=step)
    client.set_terminated(training_run)

    storage = open_storage(state / "storage")
    dedup = _publish(storage, "deduplicated", "sample", run["kept"].parent, {})
    tok = _publish(storage, "tokenizer", None, run["root"] / "tokenizer", {})
    _publish(storage, "mixed_shards", None, run["mixed"], {"deduplicated": {"sample": dedup}, "tokenizer": tok})
    ckpt = tmp_path / "ckpt"
    shutil.copytree(run["export"], ckpt / "export")
    (ckpt / "resolved_config.json").write_text(json.dumps({"seed": INIT_SEED}))
    # first_loss null: what result.json holds when no logged step was accepted; the header says n/a.
    (ckpt / "result.json").write_text(json.dumps({
        "first_loss": None, "final_loss": run["losses"][-1][1], "steps": len(run["losses"]),
        "tokens": 16 * SEQ_LEN * len(run["losses"]), "mlflow_run_id": training_run}))
    _publish(storage, "checkpoints", None, ckpt, {})

    def materialize(cloze_items: int, max_rate: float):
        config = yaml.safe_load((REPO / "workflows" / "pipeline.yaml").read_text())
        config["storage"] = {"root": str(state / "storage")}
        config["mlflow"] = {"tracking_uri": tracking, "experiment": "kiln"}
        config["evaluation"] = {"max_sequences_per_bucket": 8, "cloze_items_per_bucket": cloze_items,
                                "cloze_min_context_words": 12, "prompts": PROMPTS[:1], "sample_max_new_tokens": 8,
                                "max_contamination_rate": max_rate}
        path = tmp_path / f"pipeline-{cloze_items}-{max_rate}.yaml"
        path.write_text(yaml.safe_dump(config))
        from assets.eval_report import eval_report

        result = dg.materialize([eval_report], resources={"kiln": KilnResource(config_path=str(path))},
                                raise_on_error=False)
        checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
        # A failed blocking check fails the run; the report is published for inspection, not as latest.
        assert result.success == (checks["metrics_finite"] and checks["contamination_under_limit"])
        return result.asset_materializations_for_node("eval_report")[0].metadata, checks

    first, checks = materialize(cloze_items=6, max_rate=0.5)
    assert checks == {"metrics_finite": True, "contamination_under_limit": True, "beats_step0": True}
    assert first["previous_report"].value == ""
    second, checks = materialize(cloze_items=12, max_rate=0.1)  # the planted item (1 of 3) is now too many
    assert checks["contamination_under_limit"] is False and checks["metrics_finite"] is True
    version = second["data_version"].value
    assert second["previous_report"].value == first["data_version"].value != version
    assert first["marked_latest"].value is True and second["marked_latest"].value is False
    assert storage.latest("eval_report", None).data_version == first["data_version"].value
    assert storage.failed_checks("eval_report", None, version) == ["contamination_under_limit"]
    folder = state / "storage" / "eval_report" / "all" / version
    report = (folder / "report.md").read_text()
    assert "Compared with the previous report" in report and first["data_version"].value in report
    assert f"loss n/a → {run['losses'][-1][1]:.4f})" in report
    assert "cloze_items.jsonl" in os.listdir(folder) and (folder / "report.html").exists()
    assert "| cloze_accuracy |" in report and "**FAILED**" in report
    assert "Contamination audit" in second["report"].value
    assert second["bits_per_byte_web"].value == pytest.approx(first["bits_per_byte_web"].value)

    eval_run = client.get_run(second["mlflow_eval_run_id"].value)
    assert eval_run.data.tags["kiln.training_run_id"] == training_run == eval_run.data.tags["mlflow.parentRunId"]
    assert eval_run.data.metrics["bits_per_byte/web"] == pytest.approx(second["bits_per_byte_web"].value)
    assert {a.path for a in client.list_artifacts(eval_run.info.run_id)} >= {
        "report.html", "report.md", "metrics.json", "loss_curve.png", "bpb_by_bucket.png"}
    assert "MLflow run " + training_run in report
    assert client.get_run(training_run).data.tags["kiln.eval_run_id"] == eval_run.info.run_id

    # Evaluating the same checkpoint with the same settings again: same data version, same previous.
    third, _ = materialize(cloze_items=12, max_rate=0.1)
    assert third["data_version"].value == version
    assert third["previous_report"].value == first["data_version"].value


