"""hash64 (spec §8) against the spec's vectors and a loop-based reference written from the spec text."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ground.cmf.hash64 import hash64

MASK = (1 << 64) - 1


def ref_fmix64(x):
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK
    x ^= x >> 33
    return x


def ref_hash64(b: bytes) -> int:
    acc = 0
    for i in range(0, len(b), 8):
        w = int.from_bytes(b[i : i + 8].ljust(8, b"\0"), "little")
        acc ^= ref_fmix64(w) ^ ((i // 8) * 0x9E3779B97F4A7C15 & MASK)
    return ref_fmix64(acc ^ len(b))


@pytest.mark.parametrize(
    "data, want",
    [
        (b"", 0x0),
        (b"CMF", 0xB59AA39A074033EC),
        (b"0123456789abcdef", 0x30D401310062EA9F),
        (bytes(range(256)), 0x9955BB876C0706BF),
    ],
)
def test_spec_vectors(data, want):
    assert hash64(data) == want
    assert ref_hash64(data) == want


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_matches_reference(data):
    assert hash64(data) == ref_hash64(data)


@settings(max_examples=30, deadline=None)
@given(st.binary(min_size=1, max_size=2000), st.integers(1, 7), st.integers(0, 7))
def test_index_term_is_global_across_chunks(data, chunk_words, skip):
    """Tiny chunks force many chunk boundaries (and unaligned starts via `skip`)."""
    view = np.frombuffer(data, np.uint8)[skip:]
    assert hash64(view, chunk_words=chunk_words) == ref_hash64(view.tobytes())


def test_buffer_kinds_hash_the_same_bytes():
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, 1001, dtype=np.uint8)
    want = ref_hash64(raw.tobytes())
    assert hash64(raw) == want
    assert hash64(raw.tobytes()) == want
    assert hash64(memoryview(raw.tobytes())) == want
    assert hash64(bytearray(raw.tobytes())) == want
    assert hash64(raw[:1000].view("<f4")) == ref_hash64(raw[:1000].tobytes())
    with pytest.raises(ValueError, match="contiguous"):
        hash64(raw[::2])


def test_memmap_zero_copy(tmp_path):
    path = tmp_path / "blob"
    data = np.random.default_rng(1).integers(0, 256, 3 * 8 * 1024 + 5, dtype=np.uint8)
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    assert hash64(mm[3:]) == ref_hash64(data[3:].tobytes())
