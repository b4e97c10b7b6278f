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

Samples and lm-evaluation-harness runs use the exported `LlamaForCausalLM` (transformers) with
the export's SentencePiece model; contexts get EOS in front for the same reason as cloze items.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
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
