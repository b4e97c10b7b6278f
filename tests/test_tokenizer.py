import random

import numpy as np
import pytest
import sentencepiece as spm
from pydantic import ValidationError

from engine.tokenizer import (
    BOS_ID, EOS_ID, PAD_ID, UNK_ID, TokenizerConfig, sample_bucket_texts, train_tokenizer,
)

SMALL = dict(vocab_size=1024, sample_chars_per_bucket=60_000)


def prose_buckets(shared_data, docs_per_bucket=80):
    """Two small buckets of documents cut from the shared prose files."""
    prose = shared_data / "prose"
    plays = (prose / "tinyshakespeare" / "data_tinyshakespeare_input.txt").read_text(encoding="utf-8").split("\n\n")
    novel = (prose / "gutenberg_pride_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    novel = novel.replace("\r\n", "\n").split("\n\n")[40:]  # past the Gutenberg header
    group = lambda parts, k: ["\n".join(p.strip() for p in parts[i:i + k]) for i in range(0, len(parts), k)]
    return {"shakespeare": group(plays, 8)[:docs_per_bucket], "austen": group(novel, 4)[:docs_per_bucket]}


@pytest.fixture(scope="module")
def corpus(shared_data):
    return prose_buckets(shared_data)


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    meta = train_tokenizer(corpus, str(out), TokenizerConfig(**SMALL, user_defined_symbols=["<|endoftext|>"]))
    return out, meta, spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))


def test_writes_contract_files_and_special_ids(trained):
    out, meta, sp = trained
    assert sorted(p.name for p in out.iterdir()) == ["token_bytes.npy", "tokenizer.model", "tokenizer.vocab"]
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (UNK_ID, BOS_ID, EOS_ID, PAD_ID)
    assert meta["vocab_size"] == sp.get_piece_size() == 1024
    vocab_lines = (out / "tokenizer.vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == 1024 and vocab_lines[EOS_ID].startswith("</s>\t")
    token_bytes = np.load(out / "token_bytes.npy")
    assert token_bytes.dtype == np.int32 and token_bytes.shape == (1024,)
    assert token_bytes[[UNK_ID, BOS_ID, EOS_ID, PAD_ID]].tolist() == [0, 0, 0, 0]
    byte_ids = [i for i in range(sp.get_piece_size()) if sp.is_byte(i)]
    assert len(byte_ids) == 256 == meta["byte_pieces"] and set(token_bytes[byte_ids].tolist()) == {1}


@pytest.mark.parametrize("text", [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "  leading spaces,\tTabs and\nnew lines\n\n",
    "Digits 1234567890 and “curly quotes” — naïve café, 日本語, emoji 🎉",
    "ROMEO:\nBut, soft! what light through yonder window breaks?",
])
def test_token_bytes_sum_to_decoded_utf8_length(trained, text):
    out, _, sp = trained
    token_bytes = np.load(out / "token_bytes.npy")
    ids = sp.encode(text)
    assert sp.decode(ids) == text  # identity normalisation, no dummy prefix: lossless
    assert int(token_bytes[ids].sum()) == len(text.encode("utf-8"))
    assert UNK_ID not in ids  # byte fallback covers unseen characters


def test_token_bytes_on_corpus_documents(trained, corpus):
    out, _, sp = trained
    token_bytes = np.load(out / "token_bytes.npy")
    for texts in corpus.values():
        for text in texts[:20]:
            ids = sp.encode(text)
            assert int(token_bytes[ids].sum()) == len(sp.decode(ids).encode("utf-8")) == len(text.encode("utf-8"))


def test_user_defined_symbol_is_one_token(trained):
    _, _, sp = trained
    ids = sp.encode("end<|endoftext|>start")
    assert sp.piece_to_id("<|endoftext|>") in ids


def test_fertility_and_balanced_sample_in_metadata(trained):
    _, meta, _ = trained
    assert set(meta["buckets"]) == {"austen", "shakespeare"}
    for stats in meta["buckets"].values():
        assert stats["chars"] == SMALL["sample_chars_per_bucket"]  # both buckets are larger than the sample
        assert 1.0 < stats["tokens_per_word"] < 4.0
        assert stats["tokens"] > stats["words"]


def test_training_is_byte_identical_on_rerun_and_input_order(corpus, trained, tmp_path):
    out, meta, _ = trained
    shuffled = {b: random.Random(7).sample(texts, len(texts)) for b, texts in reversed(list(corpus.items()))}
    again = train_tokenizer(shuffled, str(tmp_path), TokenizerConfig(**SMALL, user_defined_symbols=["<|endoftext|>"]))
    for name in ["tokenizer.model", "tokenizer.vocab", "token_bytes.npy"]:
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name
    assert again["model_sha256"] == meta["model_sha256"]


def test_unigram_is_deterministic_too(corpus, tmp_path):
    cfg = TokenizerConfig(model_type="unigram", vocab_size=800, sample_chars_per_bucket=30_000)
    first = train_tokenizer(corpus, str(tmp_path / "a"), cfg)
    second = train_tokenizer(corpus, str(tmp_path / "b"), cfg)
    assert first["model_sha256"] == second["model_sha256"]
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "a" / "tokenizer.model"))
    text = corpus["austen"][3]
    assert sp.decode(sp.encode(text)) == text


def test_seed_changes_the_sample():
    texts = {"web": [f"document number {i} " * 50 for i in range(200)]}
    a = sample_bucket_texts(texts, TokenizerConfig(sample_chars_per_bucket=5_000, seed=0))
    b = sample_bucket_texts(texts, TokenizerConfig(sample_chars_per_bucket=5_000, seed=1))
    assert sum(map(len, a["web"])) == 5_000 and a != b


@pytest.mark.parametrize("bad", [
    dict(model_type="wordpiece"),
    dict(vocab_size=200),
    dict(character_coverage=0.0),
    dict(user_defined_symbols=["</s>"]),
    dict(user_defined_symbols=["<x>", "<x>"]),
    dict(unknown_field=1),
])
def test_config_rejects_invalid_values(bad):
    with pytest.raises(ValidationError):
        TokenizerConfig(**bad)


def test_no_text_is_an_error(tmp_path):
    with pytest.raises(ValueError):
        train_tokenizer({"web": ["", "   "]}, str(tmp_path), TokenizerConfig())
