"""Evaluation of a trained model: held-out perplexity and bits per byte, cloze accuracy, samples,
and lm-evaluation-harness tasks through the Hugging Face export.

Bits per byte = total NLL (nats) / ln 2 / total UTF-8 bytes of the predicted tokens, with bytes per
token from `token_bytes.npy` (control tokens count 0 bytes, byte-fallback tokens 1). Unlike
perplexity it does not depend on the tokenizer, so models with different vocabularies compare.

Cloze accuracy (LAMBADA-style, built automatically and deterministically from held-out text):
  1. Documents: the held-out documents of each bucket (never in training), as (doc_id, bucket, text).
  2. Candidates: every sentence-final word of a document, i.e. a run of 3 or more letters that
     is preceded by one plain space and followed (after optional closing quotes or brackets) by
     `.`, `!` or `?` and then whitespace or the end of the text. The passage is the document up to
     and including that word, so its target is always the passage's final word; passages with
     fewer than `min_context_words` words before the target are skipped.
  3. Tokens: context = the passage without its last word (and without the space before it),
     target = " " + word, both encoded with the run's SentencePiece model (no dummy prefix,
     so encode(context + target) = encode(context) + target tokens; a candidate where that
     split does not hold is skipped). A passage that starts at its document's start gets EOS in
     front, as every document had in training; a context too long for the model keeps its last
     tokens.
  4. Selection: per bucket, candidates are ordered by blake2b(seed, doc_id, character offset) and
     the first `items_per_bucket` are taken, so the item set depends only on the documents and
     the seed, not on file order.
  5. Scoring: the model must produce every target token by greedy decoding. Greedy decoding
     reproduces the target exactly iff, with the context plus the target fed in one forward
     pass, the argmax at each target position is that target token; one pass per item is used.
     Accuracy = exact matches / items; the summed target log-probability is kept as well.

Samples use the exported `LlamaForCausalLM` (transformers) with the export's SentencePiece model;
prompts get EOS in front for the same reason as cloze items. lm-evaluation-harness runs its own
`hf` model on the export folder (which carries the Hugging Face tokenizer), see run_lm_eval.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import yaml
import torch
import torch.nn.functional as F
from torch import nn

from training.data import load_manifest, validation_batches, validation_buckets


def load_token_bytes(mixed_shards_dir: str | Path) -> np.ndarray:
    manifest = load_manifest(mixed_shards_dir)
    token_bytes = np.load(Path(mixed_shards_dir) / manifest.get("token_bytes_file", "token_bytes.npy"))
    return token_bytes.astype(np.int64)


def summarize(total_nll_nats: float, total_tokens: int, total_bytes: int) -> dict:
    """Metrics from summed NLL; bits_per_byte is None when the targets hold no bytes."""
    loss = total_nll_nats / total_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_byte": total_nll_nats / math.log(2) / total_bytes if total_bytes else None,
        "tokens": total_tokens,
        "bytes": total_bytes,
    }


@torch.no_grad()
def evaluate(model: nn.Module, mixed_shards_dir: str | Path, max_sequences_per_bucket: int | None = 256,
             batch_size: int = 8, buckets: list[str] | None = None) -> dict[str, dict]:
    """{bucket: {"loss", "perplexity", "bits_per_byte", "tokens", "bytes"}} over `val_<bucket>.bin`.

    Reads the first `max_sequences_per_bucket` rows of each split in file order and sums the NLL
    in float64, so the same model gives the same numbers on every call.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    token_bytes = torch.from_numpy(load_token_bytes(mixed_shards_dir))
    results = {}
    try:
        for bucket in buckets or validation_buckets(mixed_shards_dir):
            total_nll, total_tokens, total_bytes = 0.0, 0, 0
            for inputs, targets in validation_batches(mixed_shards_dir, bucket, batch_size,
                                                      max_sequences_per_bucket):
                logits = model(inputs.to(device))
                nll = F.cross_entropy(logits.float().flatten(0, 1), targets.to(device).flatten(),
                                      reduction="none")
                total_nll += float(nll.double().sum())
                total_tokens += targets.numel()
                total_bytes += int(token_bytes[targets].sum())
            if total_tokens == 0:
                continue
            results[bucket] = summarize(total_nll, total_tokens, total_bytes)
    finally:
        model.train(was_training)
    return results


# --- cloze accuracy (construction documented in the module docstring) -------------------------

# A sentence-final word: 3+ letters after one space, then optional closing quotes/brackets and
# . ! or ? followed by whitespace or the end of the text.
_SENTENCE_FINAL_WORD = re.compile(r"(?<= )([^\W\d_]{3,})[\"'\u201d\u2019)\]]*[.!?](?=\s|$)")
_WORD_START = re.compile(r"\S+")


@dataclass(frozen=True)
class ClozeItem:
    bucket: str
    doc_id: str
    offset: int  # character offset of the target word in its document
    word: str
    context_ids: tuple[int, ...]
    target_ids: tuple[int, ...]
    context_tail: str  # the last characters of the context, for reports

    def row(self) -> dict:
        return {"bucket": self.bucket, "doc_id": self.doc_id, "offset": self.offset, "word": self.word,
                "context_tokens": len(self.context_ids), "target_ids": list(self.target_ids),
                "context_tail": self.context_tail}


def cloze_candidates(text: str, min_context_words: int) -> list[tuple[int, str]]:
    """(character offset, word) of every sentence-final word with enough words before it."""
    word_starts = [m.start() for m in _WORD_START.finditer(text)]
    found = []
    for match in _SENTENCE_FINAL_WORD.finditer(text):
        start = match.start(1)
        if bisect.bisect_left(word_starts, start) >= min_context_words:
            found.append((start, match.group(1)))
    return found


def _cloze_key(seed: int, doc_id: str, offset: int) -> bytes:
    return hashlib.blake2b(f"{seed}\x00{doc_id}\x00{offset}".encode("utf-8", "surrogatepass"), digest_size=8).digest()


def _cloze_item(bucket: str, doc_id: str, text: str, offset: int, word: str, encode: Callable[[str], list[int]],
                max_tokens: int, eos_id: int | None) -> ClozeItem | None:
    context = text[:offset - 1]  # without the one space before the word: it belongs to the target
    full = list(encode(text[:offset + len(word)]))
    context_ids = list(encode(context))
    if full[:len(context_ids)] != context_ids or len(full) == len(context_ids):
        return None  # the tokenizer merged across the context/target boundary
    target_ids = full[len(context_ids):]
    if eos_id is not None:
        context_ids = [eos_id] + context_ids
    budget = max_tokens - len(target_ids)
    if budget < 1:
        return None
    return ClozeItem(bucket, doc_id, offset, word, tuple(context_ids[-budget:]), tuple(target_ids),
                     context[-160:])


def build_cloze_items(documents: Iterable[tuple[str, str, str]], encode: Callable[[str], list[int]], *,
                      items_per_bucket: int, seed: int, max_tokens: int, eos_id: int | None,
                      min_context_words: int = 20) -> dict[str, list[ClozeItem]]:
    """{bucket: items} from (doc_id, bucket, text) documents; see the module docstring.

    `max_tokens` bounds context + target tokens (the model's context length).
    """
    candidates: dict[str, list[tuple[bytes, str, int, str]]] = {}
    texts: dict[str, str] = {}
    for doc_id, bucket, text in documents:
        texts[doc_id] = text or ""
        for offset, word in cloze_candidates(texts[doc_id], min_context_words):
            candidates.setdefault(bucket, []).append((_cloze_key(seed, doc_id, offset), doc_id, offset, word))
    items: dict[str, list[ClozeItem]] = {}
    for bucket in sorted(candidates):
        chosen: list[ClozeItem] = []
        for _, doc_id, offset, word in sorted(candidates[bucket]):
            if len(chosen) >= items_per_bucket:
                break
            item = _cloze_item(bucket, doc_id, texts[doc_id], offset, word, encode, max_tokens, eos_id)
            if item is not None:
                chosen.append(item)
        items[bucket] = chosen
    return items


@torch.no_grad()
def score_cloze(model: nn.Module, items: list[ClozeItem], batch_size: int = 16) -> list[dict]:
    """Per item: `correct` (greedy decoding yields every target token), `target_logprob` (nats),
    `greedy_ids` (what greedy decoding emits, up to and including its first wrong token)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    results = []
    try:
        for begin in range(0, len(items), batch_size):
            batch = items[begin:begin + batch_size]
            rows = [list(item.context_ids) + list(item.target_ids[:-1]) for item in batch]
            inputs = torch.zeros((len(rows), max(map(len, rows))), dtype=torch.long)
            for i, row in enumerate(rows):  # right padding: a causal model never looks at it
                inputs[i, :len(row)] = torch.tensor(row)
            logprobs = torch.log_softmax(model(inputs.to(device)).float(), dim=-1).cpu()
            for i, item in enumerate(batch):
                start, n = len(item.context_ids) - 1, len(item.target_ids)
                scores = logprobs[i, start:start + n]
                target = torch.tensor(item.target_ids)
                greedy = scores.argmax(-1)
                wrong = (greedy != target).nonzero()
                emitted = n if len(wrong) == 0 else int(wrong[0]) + 1
                results.append({
                    "correct": len(wrong) == 0,
                    "target_logprob": float(scores.gather(1, target[:, None]).double().sum()),
                    "greedy_ids": greedy[:emitted].tolist(),
                })
    finally:
        model.train(was_training)
    return results


def summarize_cloze(scored: list[dict]) -> dict:
    n = len(scored)
    correct = sum(r["correct"] for r in scored)
    return {
        "items": n,
        "correct": correct,
        "accuracy": correct / n if n else None,
        "mean_target_logprob": sum(r["target_logprob"] for r in scored) / n if n else None,
    }


# --- samples through the Hugging Face export ----------------------------------------------------

def load_hf_export(export_dir: str | Path):
    """(transformers LlamaForCausalLM, SentencePieceProcessor) of an export folder."""
    import sentencepiece as spm
    from transformers import LlamaForCausalLM

    export_dir = Path(export_dir)
    model = LlamaForCausalLM.from_pretrained(export_dir).eval()
    return model, spm.SentencePieceProcessor(model_file=str(export_dir / "tokenizer.model"))


def _decode_until_eos(sp, ids: list[int], eos_id: int | None) -> tuple[str, bool]:
    ended = eos_id is not None and eos_id in ids
    return sp.decode(ids[:ids.index(eos_id)] if ended else ids), ended


def _prompt_ids(sp, text: str, eos_id: int | None, limit: int) -> list[int]:
    ids = ([eos_id] if eos_id is not None else []) + sp.encode(text)
    return ids[-(limit - 1):]  # leave room for at least one new token


@torch.no_grad()
def generate_samples(model, sp, prompts: list[str], *, max_new_tokens: int, seed: int,
                     temperature: float = 0.8, top_k: int = 40) -> list[dict]:
    """Greedy decoding and one sampled decoding (seed `seed + i` for prompt i) per prompt.

    The sampling RNG is forked, so the caller's torch RNG state is left as it was.
    """
    eos_id = model.config.eos_token_id
    pad_id = sp.pad_id() if sp.pad_id() >= 0 else eos_id
    limit = model.config.max_position_embeddings
    samples = []
    for i, prompt in enumerate(prompts):
        ids = _prompt_ids(sp, prompt, eos_id, limit)
        input_ids = torch.tensor([ids])
        common = dict(attention_mask=torch.ones_like(input_ids), eos_token_id=eos_id, pad_token_id=pad_id,
                      max_new_tokens=max(1, min(max_new_tokens, limit - len(ids))))
        greedy = model.generate(input_ids, do_sample=False, **common)[0, len(ids):].tolist()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + i)
            sampled = model.generate(input_ids, do_sample=True, temperature=temperature, top_k=top_k or None,
                                     top_p=1.0, **common)[0, len(ids):].tolist()
        greedy_text, greedy_ended = _decode_until_eos(sp, greedy, eos_id)
        sampled_text, sampled_ended = _decode_until_eos(sp, sampled, eos_id)
        samples.append({"prompt": prompt, "seed": seed + i, "greedy": greedy_text, "greedy_ended": greedy_ended,
                        "sampled": sampled_text, "sampled_ended": sampled_ended,
                        "greedy_tokens": len(greedy), "sampled_tokens": len(sampled)})
    return samples


# --- lm-evaluation-harness (optional: the [eval] extra) ----------------------------------------

def lm_eval_version() -> str | None:
    """The installed lm_eval version, or None when it cannot be imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return "unknown"


def lm_eval_unavailable() -> str | None:
    """Why lm_eval's `hf` model cannot run here, or None when it can."""
    if lm_eval_version() is None:
        return "lm_eval is not importable; install the optional extra: pip install -e '.[eval]'"
    try:
        import lm_eval.models.huggingface  # noqa: F401  (needs accelerate: lm_eval's [hf] extra)
    except ImportError as error:
        return (f"lm_eval's hf model is not importable ({error}); install the optional extra: "
                f"pip install -e '.[eval]' (lm-eval[hf])")
    return None


def _prepare_lm_eval_tasks(task_dir: Path, into: Path) -> None:
    """Copy the task folder, making relative `dataset_kwargs.data_files` paths absolute.

    lm_eval resolves data files against the working directory; task folders name them
    relative to the YAML so that a task folder works wherever it is checked out.
    """
    shutil.copytree(task_dir, into, dirs_exist_ok=True)
    for path in sorted(into.rglob("*.yaml")):
        try:
            config = yaml.safe_load(path.read_text())
        except yaml.YAMLError:  # e.g. `!function` tags: used as is
            continue
        data_files = (config or {}).get("dataset_kwargs", {}).get("data_files") if isinstance(config, dict) else None
        if data_files is None:
            continue
        source_dir = task_dir / path.parent.relative_to(into)

        def absolute(value):
            if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
                return str((source_dir / value).resolve())
            if isinstance(value, list):
                return [absolute(v) for v in value]
            if isinstance(value, dict):
                return {k: absolute(v) for k, v in value.items()}
            return value

        config["dataset_kwargs"]["data_files"] = absolute(data_files)
        path.write_text(yaml.safe_dump(config, sort_keys=False))


def lm_eval_runtime(device: str, dtype: str) -> tuple[str, str]:
    """evaluation.lm_eval_device / lm_eval_dtype with "auto" resolved: the first GPU when there is
    one, else the CPU; bfloat16 on a GPU that supports it, else float32 (CPUs run bf16 matmuls
    slowly, and fp32 keeps CPU results exact run to run)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        on_gpu = device.startswith("cuda") and torch.cuda.is_available()
        dtype = "bfloat16" if on_gpu and torch.cuda.is_bf16_supported() else "float32"
    return device, dtype


def run_lm_eval(export_dir: str | Path, task_dir: str | Path, tasks: list[str], *, device: str, dtype: str,
                batch_size: int, limit: int | None = None, seed: int = 0) -> dict:
    """Run lm-evaluation-harness tasks from a local folder, offline, on the HF export, through
    lm_eval's own `hf` model (`pretrained=<export_dir>`), as users run it.

    The export holds the Hugging Face tokenizer, so lm_eval tokenizes exactly like SentencePiece.
    `device`, `dtype` ("auto" allowed, see lm_eval_runtime) and `batch_size` are evaluation config
    fields. One model argument beyond those: `prefix_token_id` = EOS, the token lm_eval puts in
    front of a text it scores from its start (rolling log-likelihood, empty contexts). Its default
    is BOS, which Kiln's models never saw: documents are packed with EOS between them, so EOS is
    what a document start looks like in training. The same command line works by hand:
    `lm_eval --model hf --model_args pretrained=DIR,prefix_token_id=<eos> --include_path TASKS ...`.

    Returns {"status": "ok", "version", "model_args", "tasks": {task: {metric: value}},
    "higher_is_better", "samples": {task: n}} or {"status": "skipped", "reason"} when lm_eval
    (with its hf model) is not importable.
    """
    # Offline before the first import of datasets / huggingface_hub: task data are local files.
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    reason = lm_eval_unavailable()
    if reason is not None:
        return {"status": "skipped", "reason": reason}
    import lm_eval
    from lm_eval.tasks import TaskManager

    export_dir, task_dir = Path(export_dir).resolve(), Path(task_dir)
    if not task_dir.is_dir():
        raise FileNotFoundError(f"lm_eval task folder {task_dir} does not exist")
    if not (export_dir / "tokenizer.json").exists():
        return {"status": "skipped", "reason": f"{export_dir} has no Hugging Face tokenizer (tokenizer.json): its "
                                               "tokenizer artifact has no hf/ folder (transformers was missing)"}
    eos_id = json.loads((export_dir / "config.json").read_text()).get("eos_token_id")
    device, dtype = lm_eval_runtime(device, dtype)
    # The resolved values go into the results (model_args), so a report says what it ran on.
    model_args = {"pretrained": str(export_dir), "dtype": dtype, "device": device, "batch_size": batch_size,
                  **({"prefix_token_id": eos_id} if eos_id is not None else {})}
    with tempfile.TemporaryDirectory(prefix="kiln-lm-eval-") as tmp:
        _prepare_lm_eval_tasks(task_dir, Path(tmp) / "tasks")
        manager = TaskManager(include_path=str(Path(tmp) / "tasks"), include_defaults=False)
        output = lm_eval.simple_evaluate(
            model="hf", model_args=model_args, tasks=list(tasks), task_manager=manager, limit=limit,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            bootstrap_iters=0, log_samples=False,
        )
    results, higher = output["results"], output.get("higher_is_better", {})
    return {
        "status": "ok",
        "version": lm_eval_version(),
        "model": "hf",
        "model_args": {k: v for k, v in model_args.items() if k != "pretrained"},
        "tasks": {
            task: {key.split(",")[0]: value for key, value in sorted(values.items())
                   if key.split(",")[0] in higher.get(task, {}) and isinstance(value, (int, float))}
            for task, values in sorted(results.items())
        },
        "higher_is_better": {task: dict(sorted(values.items())) for task, values in sorted(higher.items())},
        "samples": {task: int(n.get("effective", 0)) for task, n in sorted(output.get("n-samples", {}).items())},
    }


# --- everything for one checkpoint --------------------------------------------------------------

def evaluate_checkpoint(export_dir: str | Path, mixed_shards_dir: str | Path,
                        documents: list[tuple[str, str, str]], *, init_seed: int,
                        max_sequences_per_bucket: int | None = 64, cloze_items_per_bucket: int = 64,
                        cloze_min_context_words: int = 20, prompts: Iterable[str] = (),
                        sample_max_new_tokens: int = 48, sample_temperature: float = 0.8, sample_top_k: int = 40,
                        seed: int = 0, lm_eval_task_dir: str | Path | None = None,
                        lm_eval_tasks: Iterable[str] = (), lm_eval_limit: int | None = None,
                        lm_eval_device: str, lm_eval_dtype: str, lm_eval_batch_size: int,
                        log: Callable[[str], None] = print) -> dict:
    """Every number of the evaluation report for the exported model and its step-0 model.

    `documents` are the held-out (doc_id, bucket, text) the cloze items are built from. The
    result holds nothing that varies between runs (no timings), so two evaluations of the
    same checkpoint compare equal.
    """
    import sentencepiece as spm

    from training.export import load_exported
    from training.model import build_model, weights_fingerprint

    export_dir = Path(export_dir)
    trained, cfg = load_exported(export_dir)
    # build_model with the training seed reproduces the exact weights training started from.
    initial = build_model(cfg, init_seed).eval()
    log("evaluating held-out bits per byte and perplexity")
    metrics = {
        "trained": evaluate(trained, mixed_shards_dir, max_sequences_per_bucket=max_sequences_per_bucket),
        "initial": evaluate(initial, mixed_shards_dir, max_sequences_per_bucket=max_sequences_per_bucket),
        "initial_fingerprint": weights_fingerprint(initial),
    }
    sp = spm.SentencePieceProcessor(model_file=str(export_dir / "tokenizer.model"))
    items = build_cloze_items(documents, sp.encode, items_per_bucket=cloze_items_per_bucket, seed=seed,
                              max_tokens=cfg.max_seq_len, eos_id=cfg.eos_id, min_context_words=cloze_min_context_words)
    metrics["cloze"] = {}
    for bucket in sorted(set(metrics["trained"]) | set(items)):
        bucket_items = items.get(bucket, [])
        log(f"cloze [{bucket}]: {len(bucket_items)} items")
        scored = {"trained": score_cloze(trained, bucket_items), "initial": score_cloze(initial, bucket_items)}
        metrics["cloze"][bucket] = {
            "trained": summarize_cloze(scored["trained"]),
            "initial": summarize_cloze(scored["initial"]),
            "items": [item.row() | {"correct": t["correct"], "target_logprob": t["target_logprob"],
                                    "greedy": sp.decode(t["greedy_ids"]), "initial_correct": s["correct"]}
                      for item, t, s in zip(bucket_items, scored["trained"], scored["initial"])],
        }
    hf_model, hf_sp = load_hf_export(export_dir)
    log(f"decoding {len(prompts)} prompts through the HF export")
    metrics["samples"] = generate_samples(hf_model, hf_sp, list(prompts), max_new_tokens=sample_max_new_tokens,
                                          seed=seed, temperature=sample_temperature, top_k=sample_top_k)
    if lm_eval_task_dir and lm_eval_tasks:
        log(f"running lm_eval tasks {list(lm_eval_tasks)} from {lm_eval_task_dir}")
        metrics["lm_eval"] = run_lm_eval(export_dir, lm_eval_task_dir, list(lm_eval_tasks), device=lm_eval_device,
                                         dtype=lm_eval_dtype, batch_size=lm_eval_batch_size, limit=lm_eval_limit,
                                         seed=seed)
    else:
        metrics["lm_eval"] = {"status": "skipped",
                              "reason": "no lm_eval task configured (evaluation.lm_eval_task_dir / lm_eval_tasks)"}
    return metrics
