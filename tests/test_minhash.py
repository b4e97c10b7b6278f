import hashlib
import inspect
import unicodedata

import numpy as np
import pytest
from datasketch import MinHash
from datasketch.lsh import _optimal_param

from engine import minhash as mh
from engine.minhash import (
    compute_signatures,
    exact_hash,
    normalise_for_exact,
    optimal_bands,
    sha1_hash32_batch,
    shingles,
    signatures_from_bytes,
    signatures_to_bytes,
)

# datasketch >= 2.0 defaults to "affine32"; Kiln's signatures use the legacy scheme.
LEGACY = {"scheme": "legacy"} if "scheme" in inspect.signature(MinHash.__init__).parameters else {}

EDGE_CASES = [
    "",
    "!!! ... ???",
    "two words",
    "Hello, World! This is a test of the shingles; with punctuation -- and CAPS.",
    "Ça va très bien, merci — 東京は大きい都市です and snake_case words here",
    "e\u0301 composed vs decomposed \u00e9 accents in a longer line of text",
    "averyveryveryverylongwordthatgoesonandonforeverandeverandkeepsgoing " * 3 + "tail words a b c",
    "x" * 300 + " then several ordinary words after it",
    "line one\nline two\ttabbed\r\nwindows line with\u00a0nbsp and more words",
    "a lone surrogate \ud800 from lenient decoding does not raise here",
]


def prose_paragraphs(shared_data, min_words=60, limit=40):
    text = (shared_data / "prose" / "gutenberg_pride_prejudice" / "1342-0.txt").read_text(encoding="utf-8-sig")
    paras = [" ".join(p.split()) for p in text.split("\n\n")]
    return [p for p in paras if len(p.split()) >= min_words][:limit]


def datasketch_signature(text, num_perm=112, ngram=5, seed=1):
    m = MinHash(num_perm=num_perm, seed=seed, **LEGACY)
    m.update_batch(shingles(text, ngram))
    return m.hashvalues.astype(np.uint32)


def test_shingle_definition():
    assert shingles("Hello, World!") == [b"hello world"]
    assert shingles("") == [b""]
    assert shingles("?!") == [b""]
    assert shingles("A b C d E f", ngram=5) == [b"a b c d e", b"b c d e f"]
    assert shingles("Ünïcode_words stay — together", ngram=2) == [b"\xc3\xbcn\xc3\xafcode_words stay", b"stay together"]


@pytest.mark.parametrize("num_perm,ngram,seed", [(112, 5, 1), (64, 3, 7), (128, 1, 42)])
def test_signatures_equal_datasketch(shared_data, num_perm, ngram, seed):
    texts = EDGE_CASES + prose_paragraphs(shared_data, limit=25)
    sig = compute_signatures(texts, num_perm=num_perm, ngram=ngram, seed=seed)
    assert sig.dtype == np.uint32 and sig.shape == (len(texts), num_perm)
    for text, row in zip(texts, sig):
        np.testing.assert_array_equal(row, datasketch_signature(text, num_perm, ngram, seed), err_msg=text[:40])


def test_default_signature_parameters():
    params = inspect.signature(compute_signatures).parameters
    assert [params[k].default for k in ("num_perm", "ngram", "seed")] == [112, 5, 1]


def test_batching_and_chunking_do_not_change_signatures(shared_data, monkeypatch):
    long_doc = " ".join(prose_paragraphs(shared_data, limit=40))  # thousands of shingles
    texts = [long_doc] + EDGE_CASES + prose_paragraphs(shared_data, limit=10)
    expected = compute_signatures(texts)
    monkeypatch.setattr(mh, "_DOC_BATCH", 3)
    monkeypatch.setattr(mh, "_PERM_CHUNK", 37)
    monkeypatch.setattr(mh, "_SHA1_CHUNK", 101)
    np.testing.assert_array_equal(compute_signatures(texts), expected)
    np.testing.assert_array_equal(compute_signatures(texts[:1])[0], datasketch_signature(long_doc))


def test_vectorised_sha1_matches_hashlib():
    rng = np.random.default_rng(0)
    # Every padding case of 1-4 blocks, plus lengths that take the hashlib fallback.
    lengths = list(range(0, 260)) + [300, 1000, 5000]
    data = [bytes(rng.integers(0, 256, size=n, dtype=np.uint8)) for n in lengths]
    buf = np.frombuffer(b"".join(data), dtype=np.uint8)
    lens = np.array(lengths, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    expected = [int.from_bytes(hashlib.sha1(d).digest()[:4], "little") for d in data]
    np.testing.assert_array_equal(sha1_hash32_batch(buf, starts, lens), np.array(expected, dtype=np.uint32))


def test_permutation_fold_is_exact_in_the_rare_subtract_case():
    p = (1 << 61) - 1
    h = np.array([5, 7, 123456789, 0xFFFFFFFF], dtype=np.uint32)
    # a=1 and b chosen so that a*h+b hits x & p == p-2 with x >> 61 == 2 (x mod p == 0),
    # x & p == p-1 with one high bit set, and x == p exactly: the fold's corner cases.
    targets = [(1 << 62) + p - 2, (1 << 61) + p - 1, p, (1 << 63) + (1 << 62) + p - 6]
    a = np.ones(len(targets), dtype=np.uint64)
    b = np.array([(t - 5) % (1 << 64) for t in targets], dtype=np.uint64)
    a = np.concatenate((a, mh.permutations(60, 3)[0]))
    b = np.concatenate((b, mh.permutations(60, 3)[1]))
    seg = np.array([0, 1, 3])  # segments {h0}, {h1, h2}, {h3}
    scratch = tuple(np.empty((len(a), len(h)), dtype=t) for t in (np.uint64, np.uint64, np.uint32))
    got = mh._segment_minima(h, seg, a, b, scratch)
    expected = np.minimum.reduceat(mh._permute_reference(h, a, b), seg, axis=1)
    np.testing.assert_array_equal(got, expected)
    assert got[0, 0] == 0 and got[2, 0] == 0
    # The fast path alone gets these wrong, which is why the fix-up exists.
    assert not np.array_equal(scratch[2], mh._permute_reference(h, a, b))


def test_ascii_fast_path_matches_regex_normalisation():
    import re

    samples = ["".join(chr(c) for c in range(128)) * 2, "Hello,\tWorld!\x1c\x1fx_y--z  ", "", "  ...  "]
    for text in samples:
        assert mh.normalise_for_shingles(text) == re.sub(r"\W+", " ", text.lower()).strip()


def test_signature_bytes_round_trip():
    sig = compute_signatures(["some text here", "other text entirely different"], num_perm=16)
    encoded = signatures_to_bytes(sig)
    assert all(len(v) == 64 for v in encoded)
    assert np.frombuffer(encoded[0], dtype="<u4")[3] == sig[0, 3]
    np.testing.assert_array_equal(signatures_from_bytes(encoded, 16), sig)
    with pytest.raises(ValueError):
        signatures_from_bytes(encoded, 32)


@pytest.mark.parametrize("threshold,num_perm", [(0.5, 112), (0.8, 112), (0.9, 128), (0.72, 64)])
def test_optimal_bands_matches_datasketch(threshold, num_perm):
    assert optimal_bands(threshold, num_perm) == _optimal_param(threshold, num_perm, 0.5, 0.5)


def test_exact_normalisation_switches():
    decomposed = unicodedata.normalize("NFD", "Café Straße")
    assert normalise_for_exact(decomposed) == normalise_for_exact("CAFÉ  STRASSE\n") == "café strasse"
    assert exact_hash(decomposed) == exact_hash(" café\tstrasse ")
    assert exact_hash(decomposed, nfc=False) != exact_hash("café strasse", nfc=False)
    assert exact_hash("A b", casefold=False) != exact_hash("a b", casefold=False)
    assert exact_hash("a  b", collapse_whitespace=False) != exact_hash("a b", collapse_whitespace=False)
    assert len(exact_hash("x")) == 32


def test_whitespace_collapse_matches_regex_definition():
    import re

    spaces = "".join(chr(c) for c in range(0x3100) if chr(c).isspace())
    assert re.fullmatch(r"\s+", spaces)
    text = f"a{spaces}b\x1cc  d\u3000e\u200bf"
    assert normalise_for_exact(text, nfc=False, casefold=False) == re.sub(r"\s+", " ", text).strip()
