"""float16 <-> float32 conversion at the speed of the CPU's conversion instructions.

numpy 2.4 widens float16 one value at a time: 158 ms for Gemma 3's stacked K/V cache (4.7 M
entries), against 4.7 ms through torch, whose conversion runs in SIMD (F16C, AVX-512 or NEON);
narrowing is 16 ms against 0.8 ms. An fp16 program on the executor converts its whole state or
cache several times a step, so this was a quarter of a stateful package's single-token step.

Both are IEEE conversions, so the bits are numpy's by construction: widening is exact, and
narrowing rounds to nearest even, overflowing to inf, on every machine (tests/test_halves.py
checks every half and the midpoints between neighbours). Only a NaN's payload may differ.
"""

import warnings

import numpy as np

_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)
# Below this many values numpy's loop costs less than handing the array to torch.
_TORCH_FROM = 1 << 13
# Values converted per torch call: under torch's GRAIN_SIZE (32768), so each runs on the calling
# thread. A larger conversion is split over torch's intra-op threads, and on a machine whose
# cores other processes hold, each such call waits for a thread to be scheduled: 1.3-7.8 ms
# for 47k values (a layer's cache-sized operand) against 0.04 ms on the calling thread, which
# made the conversions half of an fp16 package's scoring time. A multiple of 16 (SIMD width).
_CHUNK = (1 << 15) - 16


def as_dtype(value: np.ndarray, dtype) -> np.ndarray:
    """`value.astype(dtype, copy=False)`, with float16 <-> float32 done by torch where it is large."""
    dtype = np.dtype(dtype)
    if value.dtype == dtype or {value.dtype, dtype} != {_F16, _F32} or value.size < _TORCH_FROM:
        return value.astype(dtype, copy=False)
    import torch

    source = np.ascontiguousarray(value).reshape(-1)
    out = np.empty(value.shape, dtype)
    flat = out.reshape(-1)
    with warnings.catch_warnings():
        # A read-only map (a package's constants) is only read here; torch warns of writes it never makes.
        warnings.simplefilter("ignore", UserWarning)
        for start in range(0, source.size, _CHUNK):
            torch.from_numpy(flat[start:start + _CHUNK]).copy_(torch.from_numpy(source[start:start + _CHUNK]))
    return out
