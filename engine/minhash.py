"""MinHash signatures, LSH parameters and exact-duplicate hashing.

Shingling (the definition every stage and the benchmark share):
  1. `normalise_for_shingles`: `str.lower()`, then every run of non-word characters
     (regex `\\W+`, Unicode-aware, so accented letters, digits, CJK and `_` are word
     characters) becomes one space, and the ends are stripped.
  2. Words are the space-separated pieces. A shingle is the UTF-8 encoding (lone
     surrogates passed through) of `ngram`
     consecutive words joined by one space. A document with fewer than `ngram` words has
     exactly one shingle, its whole normalised text (`b""` when it has no words).

Hashing and permutations follow datasketch's "legacy" scheme (the only one before
datasketch 2.0, whose default is now "affine32"): h = first 4 bytes of SHA-1 read
little-endian (`sha1_hash32`), permutation k maps h to ((a_k*h + b_k) mod 2^64 mod (2^61-1))
& 0xFFFFFFFF, and (a_k, b_k) are drawn from `np.random.RandomState(seed)` in datasketch's
order. So `compute_signatures([t])[0]` equals
`datasketch.MinHash(num_perm, seed, scheme="legacy")` updated with `shingles(t)`.

Speed: Python's per-shingle `hashlib.sha1` call dominates datasketch's cost, so SHA-1 is
computed here with NumPy over all shingles of a batch at once (shingles are byte ranges of
one buffer, never Python objects), and the permutation step uses the Mersenne-prime fold
instead of a 64-bit division.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from functools import lru_cache

import numpy as np

MERSENNE_PRIME = (1 << 61) - 1
MAX_HASH = (1 << 32) - 1
_NON_WORD = re.compile(r"\W+")
_ASCII_NON_WORD_TO_SPACE = {c: " " for c in range(128) if not re.match(r"\w", chr(c))}

# SHA-1 round constants and initial state (FIPS 180-4).
_SHA1_K = (0x5A827999, 0x6ED9EBA1, 0x8F1BBCDC, 0xCA62C1D6)
_SHA1_IV = (0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0)
# Indexed by clip(bytes left for this word + 1, 0, 5): 0 = past the end (word is zero),
# 1..4 = the message ends inside this word after 0..3 bytes (keep those, then 0x80),
# 5 = the word is all message.
_WORD_BYTE_OFFSETS = (4 * np.arange(16))[:, None]
_KEEP_BYTES = np.array([0, 0, 0xFF000000, 0xFFFF0000, 0xFFFFFF00, 0xFFFFFFFF], dtype=np.uint32)
_END_MARK = np.array([0, 0x80000000, 0x00800000, 0x00008000, 0x00000080, 0], dtype=np.uint32)
# Shingles needing more 64-byte blocks than this are hashed with hashlib: vectorising
# a handful of giant "words" (base64 blobs, minified code) is not worth a loop per block.
_MAX_VECTOR_BLOCKS = 4
# Shingles per vectorised SHA-1 call: arrays of this many uint32 stay in L2 cache.
_SHA1_CHUNK = 16384
# Shingle columns per permutation chunk: a (num_perm, 2048) uint64 scratch stays in cache.
_PERM_CHUNK = 2048
# Documents per tokenisation batch: bounds the byte buffer and shingle index arrays.
_DOC_BATCH = 2048


# ----------------------------------------------------------------------------- shingles


def normalise_for_shingles(text: str) -> str:
    """Lowercase and reduce every run of non-word characters to one space."""
    if text.isascii():
        # Same result as the regex for ASCII (word chars [A-Za-z0-9_]), several times faster.
        return " ".join(text.lower().translate(_ASCII_NON_WORD_TO_SPACE).split())
    return _NON_WORD.sub(" ", text.lower()).strip()


def shingles(text: str, ngram: int = 5) -> list[bytes]:
    """The shingle list of one document (reference implementation; may repeat shingles)."""
    words = normalise_for_shingles(text).split(" ") if text else []
    words = [w for w in words if w]
    if len(words) < ngram:
        return [" ".join(words).encode("utf-8", "surrogatepass")]
    return [" ".join(words[i : i + ngram]).encode("utf-8", "surrogatepass") for i in range(len(words) - ngram + 1)]


def _shingle_spans(texts: list[str], ngram: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Locate every shingle of `texts` as a byte range of one buffer.

    Returns (buffer, starts, lengths, doc_offsets): shingles of document d are
    `doc_offsets[d]:doc_offsets[d+1]` in `starts`/`lengths`.
    """
    # "\n" never occurs in normalised text, so it marks document boundaries.
    # surrogatepass: lone surrogates from lenient decoding hash instead of raising.
    joined = "\n".join(normalise_for_shingles(t) for t in texts).encode("utf-8", "surrogatepass")
    buf = np.frombuffer(joined, dtype=np.uint8)
    is_word = (buf != 0x20) & (buf != 0x0A)
    prev_word = np.concatenate(([False], is_word[:-1]))
    next_word = np.concatenate((is_word[1:], [False]))
    word_starts = np.flatnonzero(is_word & ~prev_word)
    word_ends = np.flatnonzero(is_word & ~next_word) + 1
    newlines = np.flatnonzero(buf == 0x0A)
    word_doc = np.searchsorted(newlines, word_starts)
    words_per_doc = np.bincount(word_doc, minlength=len(texts))
    first_word = np.concatenate(([0], np.cumsum(words_per_doc)[:-1]))

    shingles_per_doc = np.maximum(words_per_doc - ngram + 1, 1)
    doc_offsets = np.concatenate(([0], np.cumsum(shingles_per_doc)))
    total = int(doc_offsets[-1])
    doc_of = np.repeat(np.arange(len(texts)), shingles_per_doc)
    j = np.arange(total) - doc_offsets[:-1][doc_of]
    first = first_word[doc_of] + j
    # Short documents: one shingle from their first to their last word.
    last = first_word[doc_of] + np.minimum(j + ngram, words_per_doc[doc_of]) - 1
    has_words = words_per_doc[doc_of] > 0
    starts = np.where(has_words, word_starts[np.minimum(first, len(word_starts) - 1)] if len(word_starts) else 0, 0)
    ends = np.where(has_words, word_ends[np.clip(last, 0, max(len(word_ends) - 1, 0))] if len(word_ends) else 0, 0)
    return buf, starts.astype(np.int64), (ends - starts).astype(np.int64), doc_offsets


# ----------------------------------------------------------------------------- SHA-1


def _rotl(x: np.ndarray, k: int, tmp: np.ndarray) -> None:
    """In-place 32-bit rotate left."""
    np.right_shift(x, 32 - k, out=tmp)
    np.left_shift(x, k, out=x)
    np.bitwise_or(x, tmp, out=x)


def _sha1_compress(state: np.ndarray, w: np.ndarray) -> None:
    """One SHA-1 block for every column: state (5, m) updated in place, w (16, m) consumed."""
    a, b, c, d, e = (s.copy() for s in state)
    f = np.empty_like(a)
    tmp = np.empty_like(a)
    for i in range(80):
        if i < 16:
            wi = w[i]
        else:
            # w[i] = rotl1(w[i-3] ^ w[i-8] ^ w[i-14] ^ w[i-16]) in a 16-slot ring.
            wi = w[i % 16]
            np.bitwise_xor(wi, w[(i - 3) % 16], out=wi)
            np.bitwise_xor(wi, w[(i - 8) % 16], out=wi)
            np.bitwise_xor(wi, w[(i - 14) % 16], out=wi)
            _rotl(wi, 1, tmp)
        if i < 20:
            np.bitwise_xor(c, d, out=f)
            np.bitwise_and(f, b, out=f)
            np.bitwise_xor(f, d, out=f)
        elif 40 <= i < 60:
            np.bitwise_or(b, c, out=f)
            np.bitwise_and(f, d, out=f)
            np.bitwise_and(b, c, out=tmp)
            np.bitwise_or(f, tmp, out=f)
        else:
            np.bitwise_xor(b, c, out=f)
            np.bitwise_xor(f, d, out=f)
        # new a = rotl5(a) + f + e + k + w; built in e's buffer. The two halves of a
        # rotation occupy disjoint bits, so they can be added instead of or-ed.
        e += f
        e += wi
        e += np.uint32(_SHA1_K[i // 20])
        np.left_shift(a, 5, out=tmp)
        e += tmp
        np.right_shift(a, 27, out=tmp)
        e += tmp
        _rotl(b, 30, tmp)
        a, b, c, d, e = e, a, b, c, d
    state[0] += a
    state[1] += b
    state[2] += c
    state[3] += d
    state[4] += e


def _sha1_first_words(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """First big-endian digest word of SHA-1 for each byte range (all of at most
    `_MAX_VECTOR_BLOCKS` blocks)."""
    m = len(starts)
    padded = np.concatenate((buf, np.zeros(64 * _MAX_VECTOR_BLOCKS + 64, dtype=np.uint8)))
    windows = np.lib.stride_tricks.sliding_window_view(padded, 64)
    n_blocks = (lengths + 8) // 64 + 1
    state = np.empty((5, m), dtype=np.uint32)
    state[:] = np.array(_SHA1_IV, dtype=np.uint32)[:, None]
    for block in range(int(n_blocks.max(initial=0))):
        idx = np.flatnonzero(n_blocks > block)
        remaining = lengths[idx] - 64 * block
        raw = windows[starts[idx] + 64 * block]  # (k, 64) copy of the block's bytes
        words = np.ascontiguousarray(raw.view(">u4").T, dtype=np.uint32)
        # Per word: how many message bytes it holds decides which bytes survive and
        # where the 0x80 terminator goes (masking 16 words beats masking 64 bytes).
        case = np.clip(remaining[None, :] - _WORD_BYTE_OFFSETS + 1, 0, 5)
        words &= _KEEP_BYTES[case]
        words |= _END_MARK[case]
        last = n_blocks[idx] == block + 1
        # Message length in bits as a 64-bit big-endian trailer (shingles are < 512 MiB).
        words[14, last] = 0
        words[15, last] = (lengths[idx][last] * 8).astype(np.uint32)
        sub = state[:, idx] if len(idx) < m else state
        _sha1_compress(sub, words)
        if len(idx) < m:
            state[:, idx] = sub
    return state[0]


def sha1_hash32_batch(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """datasketch's `sha1_hash32` (first 4 digest bytes, little-endian) of every byte
    range `buf[starts[i]:starts[i] + lengths[i]]`, as uint32."""
    out = np.empty(len(starts), dtype=np.uint32)
    n_blocks = (lengths + 8) // 64 + 1
    vector = np.flatnonzero(n_blocks <= _MAX_VECTOR_BLOCKS)
    for lo in range(0, len(vector), _SHA1_CHUNK):
        sel = vector[lo : lo + _SHA1_CHUNK]
        # Digest bytes 0..3 are H0 big-endian; read little-endian that is H0 byte-swapped.
        out[sel] = _sha1_first_words(buf, starts[sel], lengths[sel]).byteswap()
    raw = buf.tobytes()
    for i in np.flatnonzero(n_blocks > _MAX_VECTOR_BLOCKS):
        s = int(starts[i])
        out[i] = int.from_bytes(hashlib.sha1(raw[s : s + int(lengths[i])]).digest()[:4], "little")
    return out


def shingle_hashes(texts: list[str], ngram: int = 5) -> tuple[np.ndarray, np.ndarray]:
    """sha1_hash32 of every shingle of every text: (hashes uint32, doc_offsets)."""
    buf, starts, lengths, doc_offsets = _shingle_spans(texts, ngram)
    return sha1_hash32_batch(buf, starts, lengths), doc_offsets


# ----------------------------------------------------------------------------- permutations


@lru_cache(maxsize=16)
def permutations(num_perm: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) as uint64 arrays, drawn exactly like datasketch's legacy-scheme MinHash."""
    gen = np.random.RandomState(seed)
    pairs = [
        (gen.randint(1, MERSENNE_PRIME, dtype=np.uint64), gen.randint(0, MERSENNE_PRIME, dtype=np.uint64))
        for _ in range(num_perm)
    ]
    a, b = np.array(pairs, dtype=np.uint64).T
    a.setflags(write=False)
    b.setflags(write=False)
    return a, b


def _permute_reference(h: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """datasketch's formula verbatim, (num_perm, len(h)) uint32; used for rare exact fix-ups."""
    x = a[:, None] * h.astype(np.uint64)[None, :] + b[:, None]
    return ((x % np.uint64(MERSENNE_PRIME)) & np.uint64(MAX_HASH)).astype(np.uint32)


def _permute_into(h: np.ndarray, a: np.ndarray, b: np.ndarray, x: np.ndarray, hi: np.ndarray, out: np.ndarray) -> bool:
    """out[k, i] = permutation k of h[i] (scratch x, hi: (num_perm, len(h)) uint64).

    x mod p for p = 2^61-1 is (x & p) + (x >> 61), minus p when that reaches p. The low 32
    bits of (x & p) equal those of x, so low32(x + (x >> 61)) is the answer except in the
    subtract case (bits 3..60 of x all set, probability 2^-58), where it comes out as
    0xFFFFFFFF or as 0..6 instead of one more. Returns False when the chunk holds a
    0xFFFFFFFF, the caller's cue to redo it exactly; values 0..6 surface in the minimum.
    """
    np.multiply(a[:, None], h.astype(np.uint64)[None, :], out=x)
    x += b[:, None]
    np.right_shift(x, np.uint64(61), out=hi)
    x += hi
    np.copyto(out, x, casting="unsafe")  # truncation to the low 32 bits
    return out.max(initial=0) != MAX_HASH


def _segment_minima(h: np.ndarray, seg_starts: np.ndarray, a: np.ndarray, b: np.ndarray, scratch) -> np.ndarray:
    """(num_perm, len(seg_starts)) minima of the permuted hashes over each segment of h."""
    x, hi, out = scratch
    exact = _permute_into(h, a, b, x, hi, out)
    mins = np.minimum.reduceat(out, seg_starts, axis=1)
    if not exact or mins.min(initial=MAX_HASH) < 7:
        # Possible fold corner case (or a genuinely tiny value, p ~ 2^-29): redo exactly.
        mins = np.minimum.reduceat(_permute_reference(h, a, b), seg_starts, axis=1)
    return mins


def compute_signatures(texts: list[str], num_perm: int = 112, ngram: int = 5, seed: int = 1) -> np.ndarray:
    """MinHash signatures of `texts`: uint32 array (len(texts), num_perm).

    Row i equals datasketch's legacy-scheme MinHash(num_perm, seed) of `shingles(texts[i],
    ngram)`; see the module docstring for the exact definition.
    """
    if num_perm < 1 or ngram < 1:
        raise ValueError("num_perm and ngram must be positive")
    a, b = permutations(num_perm, seed)
    sig = np.full((len(texts), num_perm), MAX_HASH, dtype=np.uint32)
    x = np.empty((num_perm, _PERM_CHUNK), dtype=np.uint64)
    hi = np.empty_like(x)
    perm = np.empty((num_perm, _PERM_CHUNK), dtype=np.uint32)
    for doc_lo in range(0, len(texts), _DOC_BATCH):
        batch = texts[doc_lo : doc_lo + _DOC_BATCH]
        hashes, doc_offsets = shingle_hashes(batch, ngram)
        shingle_doc = np.repeat(np.arange(len(batch)), np.diff(doc_offsets))
        for lo in range(0, len(hashes), _PERM_CHUNK):
            hi_idx = min(lo + _PERM_CHUNK, len(hashes))
            n = hi_idx - lo
            # Segments: the chunk start plus every document start inside the chunk; a
            # document split across chunks is folded in with np.minimum.
            seg = np.unique(np.concatenate(([lo], doc_offsets[(doc_offsets > lo) & (doc_offsets < hi_idx)])))
            mins = _segment_minima(hashes[lo:hi_idx], seg - lo, a, b, (x[:, :n], hi[:, :n], perm[:, :n]))
            docs = doc_lo + shingle_doc[seg]
            sig[docs] = np.minimum(sig[docs], mins.T)
    return sig


def signatures_to_bytes(sig: np.ndarray) -> list[bytes]:
    """Rows as the `minhash` column encoding: little-endian uint32 × num_perm."""
    le = np.ascontiguousarray(sig, dtype="<u4")
    return [row.tobytes() for row in le]


def signatures_from_bytes(values, num_perm: int | None = None) -> np.ndarray:
    """Inverse of `signatures_to_bytes` for a sequence of equal-length byte strings."""
    values = list(values)
    if not values:
        return np.empty((0, num_perm or 0), dtype=np.uint32)
    width = len(values[0]) // 4
    if num_perm is not None and width != num_perm:
        raise ValueError(f"minhash has {width} values, expected {num_perm}")
    flat = np.frombuffer(b"".join(values), dtype="<u4")
    if flat.size != width * len(values):
        raise ValueError("minhash values have different lengths")
    return flat.reshape(len(values), width).astype(np.uint32)


# ----------------------------------------------------------------------------- LSH parameters


@lru_cache(maxsize=64)
def optimal_bands(
    threshold: float, num_perm: int, false_positive_weight: float = 0.5, false_negative_weight: float = 0.5
) -> tuple[int, int]:
    """(bands, rows) minimising the weighted false positive/negative areas of the LSH
    S-curve around `threshold`, exactly as datasketch's `MinHashLSH` chooses them."""
    from scipy.integrate import quad

    if not 0.0 < threshold < 1.0:
        raise ValueError("threshold must be in (0, 1)")
    best, best_error = (0, 0), float("inf")
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            fp, _ = quad(lambda s: 1 - (1 - s ** float(rows)) ** float(bands), 0.0, threshold)
            fn, _ = quad(lambda s: 1 - (1 - (1 - s ** float(rows)) ** float(bands)), threshold, 1.0)
            error = fp * false_positive_weight + fn * false_negative_weight
            if error < best_error:
                best, best_error = (bands, rows), error
    return best


# ----------------------------------------------------------------------------- exact duplicates

def normalise_for_exact(text: str, *, nfc: bool = True, casefold: bool = True, collapse_whitespace: bool = True) -> str:
    """Text as compared for exact duplicates: NFC, case-folded, whitespace runs -> one space,
    ends stripped (each step switchable)."""
    if nfc:
        text = unicodedata.normalize("NFC", text)
    if casefold:
        text = text.casefold()
    if collapse_whitespace:
        # str.split() uses the same Unicode whitespace as regex \s, at a quarter of the cost.
        text = " ".join(text.split())
    return text


def exact_hash(text: str, *, nfc: bool = True, casefold: bool = True, collapse_whitespace: bool = True) -> str:
    """128-bit BLAKE2b hex of the normalised text (collisions are negligible at web scale)."""
    normalised = normalise_for_exact(text, nfc=nfc, casefold=casefold, collapse_whitespace=collapse_whitespace)
    return hashlib.blake2b(normalised.encode("utf-8"), digest_size=16).hexdigest()
