"""hash64, the CMF v2 non-cryptographic integrity hash (spec §8).

Every 8-byte little-endian word is mixed independently and the results are
XOR-folded, so the hash vectorises: words are processed a chunk at a time with
wrapping numpy uint64 arithmetic into preallocated scratch arrays. Hashing a
1 GB mmap'd tensor therefore touches each page once and never holds more than
two chunk-sized scratch buffers.
"""

import numpy as np

_M1 = 0xFF51AFD7ED558CCD
_M2 = 0xC4CEB9FE1A85EC53
_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1

# Small enough that the scratch arrays stay cache-resident across the ~12
# in-place passes over each chunk; large enough that per-call overhead is noise.
CHUNK_WORDS = 1 << 17


def _fmix64_int(x: int) -> int:
    x ^= x >> 33
    x = (x * _M1) & _MASK
    x ^= x >> 33
    x = (x * _M2) & _MASK
    x ^= x >> 33
    return x


def _fmix64_into(w: np.ndarray, x: np.ndarray, tmp: np.ndarray) -> None:
    """x = fmix64(w); the first step reads w (possibly an unaligned mmap view) directly."""
    m1, m2, s = np.uint64(_M1), np.uint64(_M2), np.uint64(33)
    np.right_shift(w, s, out=tmp)
    np.bitwise_xor(w, tmp, out=x)
    np.multiply(x, m1, out=x)
    np.right_shift(x, s, out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, m2, out=x)
    np.right_shift(x, s, out=tmp)
    np.bitwise_xor(x, tmp, out=x)


def _as_u8(data) -> np.ndarray:
    """Zero-copy uint8 view of any C-contiguous buffer (bytes, memoryview, ndarray, mmap)."""
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            raise ValueError(f"hash64 needs a C-contiguous buffer, got strides {data.strides}")
        return data.reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


def hash64(data, chunk_words: int = CHUNK_WORDS) -> int:
    """hash64 of the bytes of `data` (bytes, bytearray, memoryview, mmap or contiguous ndarray).

    `chunk_words` bounds the scratch memory (two uint64 arrays of that length).
    """
    buf = _as_u8(data)
    n = buf.size
    n_words = n // 8
    words = buf[: n_words * 8].view("<u8")

    chunk = min(chunk_words, max(n_words, 1))
    x = np.empty(chunk, dtype=np.uint64)
    tmp = np.empty(chunk, dtype=np.uint64)
    # i * GOLDEN for i in 0..chunk-1; a chunk starting at word `base` adds base * GOLDEN
    # (mod 2^64), which keeps the index term global across chunks.
    index_term = np.arange(chunk, dtype=np.uint64) * np.uint64(_GOLDEN)

    acc = 0
    with np.errstate(over="ignore"):
        for base in range(0, n_words, chunk):
            m = min(chunk, n_words - base)
            xs, ts = x[:m], tmp[:m]
            _fmix64_into(words[base : base + m], xs, ts)
            np.add(index_term[:m], np.uint64((base * _GOLDEN) & _MASK), out=ts)
            np.bitwise_xor(xs, ts, out=xs)
            acc ^= int(np.bitwise_xor.reduce(xs))

    tail = bytes(buf[n_words * 8 :])
    if tail:
        w = int.from_bytes(tail, "little")
        acc ^= _fmix64_int(w) ^ ((n_words * _GOLDEN) & _MASK)
    return _fmix64_int(acc ^ n)
