"""Train the SentencePiece tokenizer on a bucket-balanced sample of the corpus.

Output folder (docs/CONTRACTS.md, `tokenizer`): `tokenizer.model`, `tokenizer.vocab`,
`token_bytes.npy`.

Special ids are fixed so every later stage can rely on them: unk=0, bos=1, eos=2, pad=3
(pad is a real control id rather than -1 so fine-tuning code can batch without a sentinel).
With byte_fallback on, `<unk>` is never produced for valid UTF-8 input.

The defaults make the tokenizer lossless on bytes: identity normalisation, no extra
whitespace removal and no dummy prefix, so the UTF-8 bytes of a decoded token sequence are
exactly the sum of `token_bytes` over its ids. That is what bits-per-byte evaluation and the
lineage checks in mix rely on.
"""
from __future__ import annotations

import hashlib
import io
import os
from typing import Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
SPECIAL_PIECES = ("<unk>", "<s>", "</s>", "<pad>")
WHITESPACE_PIECE = "\u2581"  # SentencePiece's visible space "▁"
NUM_BYTE_PIECES = 256


class TokenizerConfig(BaseModel):
    """How the tokenizer is trained. Defaults suit the small sample corpus used in tests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: Literal["bpe", "unigram"] = Field("bpe", description="SentencePiece model type.")
    vocab_size: int = Field(
        4096, ge=300, le=1_000_000,
        description="Total pieces incl. 4 special ids and 256 byte-fallback pieces.",
    )
    byte_fallback: bool = Field(True, description="Encode unseen characters as UTF-8 byte pieces instead of <unk>.")
    character_coverage: float = Field(
        0.9995, gt=0.0, le=1.0,
        description="Share of sample characters that get their own piece; the rare rest goes to bytes.",
    )
    user_defined_symbols: list[str] = Field(
        default_factory=list,
        description="Extra special tokens always kept whole (e.g. '<|endoftext|>' or chat markers).",
    )
    sample_chars_per_bucket: int = Field(
        2_000_000, ge=1_000,
        description="Characters of text sampled from each bucket, so small buckets count as much as big ones.",
    )
    max_sentence_chars: int = Field(
        4_096, ge=256,
        description="Paragraphs longer than this are cut at whitespace; SentencePiece silently drops longer sentences.",
    )
    split_digits: bool = Field(True, description="One piece per digit, as in LLaMA; helps arithmetic.")
    num_threads: int = Field(2, ge=1, le=64, description="SentencePiece trainer threads.")
    seed: int = Field(0, ge=0, description="Seed of the document sample.")

    @field_validator("user_defined_symbols")
    @classmethod
    def _symbols_are_distinct_and_not_reserved(cls, symbols: list[str]) -> list[str]:
        if any(not s for s in symbols):
            raise ValueError("user_defined_symbols must be non-empty strings")
        if len(set(symbols)) != len(symbols):
            raise ValueError("user_defined_symbols contains duplicates")
        reserved = set(SPECIAL_PIECES) & set(symbols)
        if reserved:
            raise ValueError(f"user_defined_symbols may not redefine {sorted(reserved)}")
        return symbols

    @model_validator(mode="after")
    def _vocab_fits_reserved_pieces(self) -> "TokenizerConfig":
        reserved = len(SPECIAL_PIECES) + len(self.user_defined_symbols)
        reserved += NUM_BYTE_PIECES if self.byte_fallback else 0
        if self.vocab_size < reserved + 32:
            raise ValueError(f"vocab_size {self.vocab_size} leaves too few learned pieces after {reserved} reserved")
        return self


def _stable_key(seed: int, text: str) -> bytes:
    return hashlib.blake2b(f"{seed}\x00{text}".encode("utf-8", "surrogatepass"), digest_size=8).digest()


def sample_bucket_texts(texts_by_bucket: dict[str, list[str]], cfg: TokenizerConfig) -> dict[str, list[str]]:
    """Up to `sample_chars_per_bucket` characters per bucket, whole documents in a seeded order.

    Ordering by a seeded hash of the text makes the sample independent of the input order
    (the same as sorting the input and shuffling it with the seed). The last document is cut
    so every bucket contributes the same amount when it has enough text.
    """
    sample: dict[str, list[str]] = {}
    for bucket in sorted(texts_by_bucket):
        texts = sorted((t for t in texts_by_bucket[bucket] if t and t.strip()), key=lambda t: (_stable_key(cfg.seed, t), t))
        chosen, budget = [], cfg.sample_chars_per_bucket
        for text in texts:
            if budget <= 0:
                break
            chosen.append(text[:budget])
            budget -= len(chosen[-1])
        sample[bucket] = chosen
    return sample


def _split_long(paragraph: str, limit: int) -> Iterator[str]:
    while len(paragraph) > limit:
        cut = paragraph.rfind(" ", limit // 2, limit)
        cut = limit if cut <= 0 else cut
        yield paragraph[:cut]
        paragraph = paragraph[cut:]
    if paragraph:
        yield paragraph


def iter_sentences(sample: dict[str, list[str]], max_chars: int) -> Iterator[str]:
    """Training sentences: one per non-blank paragraph, buckets in sorted order."""
    for bucket in sorted(sample):
        for text in sample[bucket]:
            for paragraph in text.split("\n"):
                if paragraph.strip():
                    yield from _split_long(paragraph, max_chars)


def compute_token_bytes(processor) -> np.ndarray:
    """int32[vocab]: UTF-8 bytes each id decodes to (control/unknown 0, byte pieces 1)."""
    size = processor.get_piece_size()
    out = np.zeros(size, dtype=np.int32)
    for i in range(size):
        if processor.is_control(i) or processor.is_unknown(i):
            continue
        if processor.is_byte(i):
            out[i] = 1
            continue
        out[i] = len(processor.id_to_piece(i).replace(WHITESPACE_PIECE, " ").encode("utf-8"))
    return out


def _fertility(processor, texts: list[str]) -> dict[str, float]:
    words = sum(len(t.split()) for t in texts)
    chars = sum(len(t) for t in texts)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    tokens = sum(len(ids) for ids in processor.encode(texts)) if texts else 0
    return {
        "documents": len(texts),
        "chars": chars,
        "words": words,
        "tokens": tokens,
        "tokens_per_word": tokens / words if words else 0.0,
        "bytes_per_token": nbytes / tokens if tokens else 0.0,
    }


def train_tokenizer(texts_by_bucket: dict[str, list[str]], out_dir: str, cfg: TokenizerConfig | None = None) -> dict:
    """Train on a bucket-balanced sample and write the `tokenizer` folder; returns metadata.

    Metadata: config, special ids, vocab size, sha256 of tokenizer.model, per-bucket sample
    size and fertility (tokens per whitespace word, measured on the sample itself).
    The model bytes are identical on a rerun with the same input and config: SentencePiece
    training is deterministic for both model types, and the model is written through
    `model_writer` so no output path ends up inside the proto's trainer spec.
    """
    import sentencepiece as spm

    cfg = cfg or TokenizerConfig()
    sample = sample_bucket_texts(texts_by_bucket, cfg)
    if not any(sample.values()):
        raise ValueError("no non-blank text to train the tokenizer on")

    model_buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter_sentences(sample, cfg.max_sentence_chars),
        model_writer=model_buffer,
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        byte_fallback=cfg.byte_fallback,
        character_coverage=cfg.character_coverage,
        user_defined_symbols=list(cfg.user_defined_symbols),
        split_digits=cfg.split_digits,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        max_sentence_length=cfg.max_sentence_chars * 4,  # SentencePiece counts bytes
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
        unk_piece=SPECIAL_PIECES[0], bos_piece=SPECIAL_PIECES[1], eos_piece=SPECIAL_PIECES[2], pad_piece=SPECIAL_PIECES[3],
        num_threads=cfg.num_threads,
        hard_vocab_limit=False,  # a small sample may not support the full vocab; still train
        minloglevel=2,
    )
    model_bytes = model_buffer.getvalue()

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(model_bytes)
    processor = spm.SentencePieceProcessor(model_proto=model_bytes)
    with open(os.path.join(out_dir, "tokenizer.vocab"), "w", encoding="utf-8") as f:
        for i in range(processor.get_piece_size()):
            f.write(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n")
    token_bytes = compute_token_bytes(processor)
    np.save(os.path.join(out_dir, "token_bytes.npy"), token_bytes)

    return {
        "config": cfg.model_dump(),
        "vocab_size": processor.get_piece_size(),
        "special_ids": {"unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID},
        "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "byte_pieces": sum(processor.is_byte(i) for i in range(processor.get_piece_size())),
        "buckets": {bucket: _fertility(processor, texts) for bucket, texts in sample.items()},
    }
