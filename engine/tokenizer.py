"""Train the SentencePiece tokenizer on a bucket-balanced sample of the corpus.

Output folder (docs/CONTRACTS.md, `tokenizer`): `tokenizer.model`, `tokenizer.vocab`,
`token_bytes.npy`, `training_manifest.json` (config, sample sizes and hashes, fertility) and,
when transformers is importable, `hf/`: the same tokenizer for `AutoTokenizer.from_pretrained`.

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
import json
import logging
import os
import shutil
from typing import TYPE_CHECKING, Iterable, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
SPECIAL_PIECES = ("<unk>", "<s>", "</s>", "<pad>")
WHITESPACE_PIECE = "\u2581"  # SentencePiece's visible space "▁"
NUM_BYTE_PIECES = 256
TRAINING_MANIFEST = "training_manifest.json"
HF_DIR = "hf"
UNKNOWN_LANGUAGE = "unknown"

log = logging.getLogger(__name__)


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


def _sample_indices(texts_by_bucket: dict[str, list[str]], cfg: TokenizerConfig) -> dict[str, list[tuple[int, str]]]:
    """(input position, possibly cut text) of each sampled document, per bucket."""
    sample: dict[str, list[tuple[int, str]]] = {}
    for bucket in sorted(texts_by_bucket):
        texts = texts_by_bucket[bucket]
        order = sorted((i for i, t in enumerate(texts) if t and t.strip()),
                       key=lambda i: (_stable_key(cfg.seed, texts[i]), texts[i]))
        chosen, budget = [], cfg.sample_chars_per_bucket
        for i in order:
            if budget <= 0:
                break
            chosen.append((i, texts[i][:budget]))
            budget -= len(chosen[-1][1])
        sample[bucket] = chosen
    return sample


def sample_bucket_texts(texts_by_bucket: dict[str, list[str]], cfg: TokenizerConfig) -> dict[str, list[str]]:
    """Up to `sample_chars_per_bucket` characters per bucket, whole documents in a seeded order.

    Ordering by a seeded hash of the text makes the sample independent of the input order
    (the same as sorting the input and shuffling it with the seed). The last document is cut
    so every bucket contributes the same amount when it has enough text.
    """
    return {bucket: [text for _, text in chosen] for bucket, chosen in _sample_indices(texts_by_bucket, cfg).items()}


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


class _HashingIterator:
    """Passes sentences through and hashes them, so the manifest names the exact training input."""

    def __init__(self, sentences: Iterable[str]):
        self._sentences = iter(sentences)
        self.digest = hashlib.sha256()
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        sentence = next(self._sentences)
        self.digest.update(sentence.encode("utf-8", "surrogatepass") + b"\n")
        self.count += 1
        return sentence


def select_sample(docs: "DataFrame", buckets: list[str], cfg: TokenizerConfig) -> tuple[dict, dict]:
    """(texts, languages) per bucket: documents in a seeded hash order until the bucket's
    character budget is met, the same budget for every bucket (small buckets give all they have).

    The order is xxhash64 of (seed, doc_id): a deterministic random sample, independent of
    partitioning, that a different `tokenizer.seed` reshuffles. Rows are streamed to the driver
    until the budget is met instead of collecting the whole bucket. train_tokenizer then orders
    and cuts this pre-selection with the same seed.
    """
    from pyspark.sql import functions as F

    # deduplicated/kept carries quality_signals' `language` (filters keep it for dedup), so the
    # per-language fertility needs no join; older artifacts without it report "unknown".
    language = F.col("language") if "language" in docs.columns else F.lit(None).cast("string")
    order = F.xxhash64(F.lit(cfg.seed).cast("long"), F.col("doc_id"))
    texts_by_bucket: dict[str, list[str]] = {}
    languages_by_bucket: dict[str, list[str | None]] = {}
    for bucket in buckets:
        rows = (docs.where(F.col("bucket") == bucket).orderBy(order, "doc_id")
                .select("text", language.alias("language")))
        texts, languages, chars = [], [], 0
        for row in rows.toLocalIterator():
            texts.append(row["text"])
            languages.append(row["language"])
            chars += len(row["text"] or "")
            if chars >= cfg.sample_chars_per_bucket:
                break
        texts_by_bucket[bucket] = texts
        languages_by_bucket[bucket] = languages
    return texts_by_bucket, languages_by_bucket


def train_tokenizer(texts_by_bucket: dict[str, list[str]], out_dir: str, cfg: TokenizerConfig | None = None, *,
                    languages_by_bucket: dict[str, list[str | None]] | None = None, export_hf: bool = True) -> dict:
    """Train on a bucket-balanced sample and write the `tokenizer` folder; returns metadata.

    `languages_by_bucket` (optional) gives the language of each input text, parallel to
    `texts_by_bucket`; fertility is then also reported per bucket and language.
    Metadata: config, special ids, vocab size, sha256 of tokenizer.model and of the training
    sentences, per-bucket (and per-language) sample size and fertility (tokens per
    whitespace word and UTF-8 bytes per token, measured on the sample itself), and the status
    of the `hf/` export. Everything but the export status is also written to
    `training_manifest.json`.
    The model bytes are identical on a rerun with the same input and config: SentencePiece
    training is deterministic for both model types, and the model is written through
    `model_writer` so no output path ends up inside the proto's trainer spec.
    """
    import sentencepiece as spm

    cfg = cfg or TokenizerConfig()
    chosen = _sample_indices(texts_by_bucket, cfg)
    sample = {bucket: [text for _, text in docs] for bucket, docs in chosen.items()}
    if not any(sample.values()):
        raise ValueError("no non-blank text to train the tokenizer on")
    for bucket, languages in (languages_by_bucket or {}).items():
        if len(languages) != len(texts_by_bucket.get(bucket, ())):
            raise ValueError(f"languages_by_bucket[{bucket!r}] is not parallel to texts_by_bucket[{bucket!r}]")

    model_buffer = io.BytesIO()
    sentences = _HashingIterator(iter_sentences(sample, cfg.max_sentence_chars))
    trainer_options = dict(
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
    )
    spm.SentencePieceTrainer.train(sentence_iterator=sentences, model_writer=model_buffer, minloglevel=2,
                                   **trainer_options)
    model_bytes = model_buffer.getvalue()

    os.makedirs(out_dir, exist_ok=True)
    model_path = os.path.join(out_dir, "tokenizer.model")
    with open(model_path, "wb") as f:
        f.write(model_bytes)
    processor = spm.SentencePieceProcessor(model_proto=model_bytes)
    with open(os.path.join(out_dir, "tokenizer.vocab"), "w", encoding="utf-8") as f:
        for i in range(processor.get_piece_size()):
            f.write(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n")
    token_bytes = compute_token_bytes(processor)
    np.save(os.path.join(out_dir, "token_bytes.npy"), token_bytes)

    by_language: dict[str, dict[str, list[str]]] = {}
    if languages_by_bucket is not None:
        for bucket, docs in chosen.items():
            languages = languages_by_bucket.get(bucket) or [None] * len(texts_by_bucket[bucket])
            for i, text in docs:
                by_language.setdefault(bucket, {}).setdefault(languages[i] or UNKNOWN_LANGUAGE, []).append(text)

    meta = {
        "config": cfg.model_dump(mode="json"),
        "vocab_size": processor.get_piece_size(),
        "special_ids": {"unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID},
        "model_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "byte_pieces": sum(processor.is_byte(i) for i in range(processor.get_piece_size())),
        "buckets": {bucket: _fertility(processor, texts) for bucket, texts in sample.items()},
        "languages": {bucket: {lang: _fertility(processor, texts) for lang, texts in sorted(langs.items())}
                      for bucket, langs in sorted(by_language.items())},
        "sample": {
            "sentences": sentences.count,
            "sentences_sha256": sentences.digest.hexdigest(),
            "documents_offered": {bucket: len(texts) for bucket, texts in sorted(texts_by_bucket.items())},
        },
        "trainer_options": {k: v for k, v in trainer_options.items() if k != "num_threads"},
        "sentencepiece_version": spm.__version__,
    }
    # Deterministic (no timings, no paths): it is part of the tokenizer's content hash.
    with open(os.path.join(out_dir, TRAINING_MANIFEST), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.write("\n")
    if export_hf:
        sentences_for_check = [s for s in iter_sentences(sample, cfg.max_sentence_chars)][:256]
        meta["hf_export"] = export_hf_tokenizer(model_path, os.path.join(out_dir, HF_DIR), model_type=cfg.model_type,
                                                byte_fallback=cfg.byte_fallback,
                                                user_defined_symbols=cfg.user_defined_symbols,
                                                check_texts=sentences_for_check)
    return meta


# --- Hugging Face export -------------------------------------------------------------------

def _bpe_merges(vocab: dict[str, int], skip: set[str]) -> list[tuple[str, str]]:
    """Merge list of a SentencePiece BPE vocabulary: every split of a piece into two vocabulary
    pieces, ranked by the id of the merged piece (SentencePiece orders BPE pieces by merge
    score), ties by the ids of the halves. Same ranking as transformers' SentencePiece converter.
    """
    merges = []
    for piece, piece_id in vocab.items():
        if piece in skip:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab and left not in skip and right not in skip:
                merges.append((piece_id, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def export_hf_tokenizer(model_path: str, out_dir: str, *, model_type: str = "bpe", byte_fallback: bool,
                        user_defined_symbols: Iterable[str] = (), check_texts: Iterable[str] = ()) -> dict:
    """Write `out_dir` as a Hugging Face tokenizer of the SentencePiece model.

    Built from the processor's pieces (no protobuf parsing: the sentencepiece_model_pb2 of this
    environment does not load with the installed protobuf runtime). BPE models with byte fallback
    become a Llama-style `transformers.LlamaTokenizer(vocab=..., merges=...)`; BPE models without
    it and unigram models (pieces with their scores) a `tokenizers` BPE/Unigram model in the same
    Metaspace/ByteFallback pipeline. `byte_fallback` is the model's setting (TokenizerConfig.byte_fallback):
    without it SentencePiece emits one `<unk>` per run of unknown characters, which
    `tokenizers` does only with byte_fallback=False and fuse_unk (LlamaTokenizer always rebuilds
    its BPE with byte fallback and no unk token, so it would drop such characters silently).
    All are saved with `save_pretrained`, plus `tokenizer.model`
    and `special_tokens_map.json`, and set to encode like SentencePiece does here: no prefix space
    (our model has add_dummy_prefix=False, identity normalisation), no BOS or EOS added (documents
    were tokenized without BOS, EOS is appended by the pipeline), and `split_special_tokens` so
    the text "</s>" is plain text, as it is to SentencePiece. (One known difference for unigram:
    a literal control or byte piece such as "</s>" or "<0x41>" inside the text is one token to
    the HF Unigram model, which cannot exclude pieces from its lattice as SentencePiece does;
    transformers' own SentencePiece converter behaves the same. `mismatches` counts it.)
    Returns a status dict; when transformers is missing (or too old, < 5, whose LlamaTokenizer
    is built only from a model file) the export is skipped with a log line.
    """
    try:
        import inspect

        import sentencepiece as spm
        import transformers
        from transformers import AutoTokenizer, LlamaTokenizer
    except ImportError as error:
        log.info("hf/ tokenizer export skipped: transformers is not importable (%s)", error)
        return {"exported": False, "reason": f"transformers not importable: {error}"}
    if "vocab" not in inspect.signature(LlamaTokenizer.__init__).parameters:
        reason = f"transformers {transformers.__version__} has no LlamaTokenizer(vocab=, merges=) (needs >= 5)"
        log.info("hf/ tokenizer export skipped: %s", reason)
        return {"exported": False, "reason": reason}

    processor = spm.SentencePieceProcessor(model_file=model_path)
    user_defined = list(user_defined_symbols)
    specials = dict(unk_token=SPECIAL_PIECES[UNK_ID], bos_token=SPECIAL_PIECES[BOS_ID],
                    eos_token=SPECIAL_PIECES[EOS_ID], pad_token=SPECIAL_PIECES[PAD_ID])
    if model_type == "bpe" and byte_fallback:
        tokenizer = _llama_bpe_tokenizer(processor, specials, user_defined)
    elif model_type == "bpe":
        tokenizer = _bpe_unk_tokenizer(processor, specials, user_defined)
    else:
        tokenizer = _unigram_tokenizer(processor, specials, byte_fallback)
    if user_defined:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(s, normalized=False, special=False) for s in user_defined])
    shutil.rmtree(out_dir, ignore_errors=True)
    tokenizer.save_pretrained(out_dir)
    shutil.copyfile(model_path, os.path.join(out_dir, "tokenizer.model"))
    # Keys transformers 4.x reads (5.x keeps them in tokenizer.json), so older readers agree.
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(add_bos_token=False, add_eos_token=False, legacy=False, add_prefix_space=False,
                  split_special_tokens=True, tokenizer_class=type(tokenizer).__name__)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(specials, f, indent=2, sort_keys=True)
        f.write("\n")

    # Read it back the way users will and compare with SentencePiece on the given texts.
    reloaded = AutoTokenizer.from_pretrained(out_dir)
    texts = list(check_texts)
    mismatches = [t for t in texts if reloaded.encode(t, add_special_tokens=True) != processor.encode(t)]
    if mismatches:
        log.warning("hf/ tokenizer encodes %d of %d check texts differently from SentencePiece, e.g. %r",
                    len(mismatches), len(texts), mismatches[0][:80])
    return {
        "exported": True,
        "tokenizer_class": type(tokenizer).__name__,
        "transformers_version": transformers.__version__,
        "files": sorted(os.listdir(out_dir)),
        "byte_fallback": byte_fallback,
        "checked_texts": len(texts),
        "mismatches": len(mismatches),
    }


def _bpe_vocab_and_merges(processor, user_defined: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    size = processor.get_piece_size()
    vocab = {processor.id_to_piece(i): i for i in range(size)}
    # Control pieces and user-defined symbols are whole pieces, never merged into or out of.
    whole = {processor.id_to_piece(i) for i in range(size) if processor.is_control(i) or processor.is_unknown(i)}
    return vocab, _bpe_merges(vocab, whole | set(user_defined))


def _llama_bpe_tokenizer(processor, specials: dict[str, str], user_defined: list[str]):
    from transformers import LlamaTokenizer

    vocab, merges = _bpe_vocab_and_merges(processor, user_defined)
    return LlamaTokenizer(
        vocab=vocab, merges=merges, **specials,
        add_prefix_space=False, legacy=False, add_bos_token=False, add_eos_token=False,
        split_special_tokens=True,
    )


def _backend_tokenizer(model, specials: dict[str, str]):
    """`model` in the Llama pipeline (Metaspace without prefix, ByteFallback decoder), wrapped."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials, split_special_tokens=True)


def _bpe_unk_tokenizer(processor, specials: dict[str, str], user_defined: list[str]):
    """BPE without byte fallback: a run of unknown characters is one <unk>, as in SentencePiece."""
    from tokenizers import models

    vocab, merges = _bpe_vocab_and_merges(processor, user_defined)
    return _backend_tokenizer(models.BPE(vocab, merges, unk_token=SPECIAL_PIECES[UNK_ID], fuse_unk=True,
                                         byte_fallback=False), specials)


def _unigram_tokenizer(processor, specials: dict[str, str], byte_fallback: bool):
    from tokenizers import models

    size = processor.get_piece_size()
    pieces = [(processor.id_to_piece(i), processor.get_score(i)) for i in range(size)]
    return _backend_tokenizer(models.Unigram(pieces, unk_id=UNK_ID, byte_fallback=byte_fallback), specials)
