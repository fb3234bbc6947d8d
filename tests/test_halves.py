"""float16 <-> float32 through torch gives numpy's bits: both are IEEE conversions (widening
exact, narrowing to nearest even), so equality holds by construction on every machine."""

import numpy as np

from pipeline.ground.halves import as_dtype

EVERY_HALF = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)


def _same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bits, a NaN anywhere matching a NaN (only a NaN's payload may differ)."""
    nan = np.isnan(want)
    return (got.dtype == want.dtype and np.array_equal(np.isnan(got), nan)
            and np.array_equal(got[~nan].view(f"u{got.itemsize}"), want[~nan].view(f"u{want.itemsize}")))


def test_every_half_widens_to_numpys_float32():
    assert _same_bits(as_dtype(EVERY_HALF, np.float32), EVERY_HALF.astype(np.float32))


def test_narrowing_rounds_as_numpy_at_every_tie_and_overflow():
    """Every half, the midpoints between neighbouring halves (the ties), a float32 step either
    side of each, random float32 bit patterns, and values around fp16's overflow threshold."""
    finite = EVERY_HALF[np.isfinite(EVERY_HALF)].astype(np.float32)
    finite = np.unique(finite)
    ties = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
    near = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    random_bits = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    overflow = np.float32([65504, 65519.99, 65520, 65536, 1e30, -65520, np.inf, -np.inf, np.nan])
    values = np.concatenate([finite, near, random_bits.view(np.float32), overflow])
    with np.errstate(over="ignore", invalid="ignore"):
        assert _same_bits(as_dtype(values, np.float16), values.astype(np.float16))


def test_small_strided_and_read_only_arrays_convert_as_numpy():
    base = np.linspace(-3, 3, 1 << 15, dtype=np.float32).reshape(128, 256)
    read_only = base.copy()
    read_only.flags.writeable = False
    for value in (base[:, ::2], base.T, base[:3, :3], read_only):
        assert _same_bits(as_dtype(value, np.float16), value.astype(np.float16))
        half = value.astype(np.float16)
        assert _same_bits(as_dtype(half, np.float32), half.astype(np.float32))
        assert as_dtype(half, np.float32).shape == value.shape
    assert as_dtype(base, np.float32) is base
