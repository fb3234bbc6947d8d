"""Every MLX dtype handler against the CMF decoder (pipeline.cmf): the effective weights the
kernels run are the decoder's output, and quantized matmuls equal x @ decode(W).T.

Payloads come from two independent sources: the encoders of pipeline.cmf.dtypes on random
weights, and the conformance vectors' dtype_* files (random but valid payloads that reach
every code value)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from pipeline.cmf import DTYPES, dtype_by_name, open_cmf
from pipeline.errors import UnsupportedModel
from mlx_runtime.weights import HANDLERS, Packed, dense, linear_from_payload, load_linear, lookup, matmul

CONFORMANCE = Path("/work/shared/cmf-conformance")
ENCODED = [dt.name for dt in DTYPES.values() if dt.encode is not None]
# The ladder dtypes run (code * t) + bias: two float32 roundings where the decoder's
# (code - k) * t has one, so they agree to 2^-20 relative (and zeros stay exact zeros).
LADDER = {"q4tp", "q2tp"}
NATIVE_BITS = {"q8_row": {8}, "q8_2f": {8}, "q4_block": {4}, "q4_tiled": {4}, "q4tp": {4}, "q2tp": {2},
               "q1": {1}, "q1s": {1}, "q1t": {2}, "vbit": {3, 4, 5, 6, 8}, "vbit_ro": {3, 4, 5, 6, 8}}


def weights(rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows whose amplitudes spread over four decades, plus an all-zero and a tiny row."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    w *= np.logspace(-2, 1, rows, dtype=np.float32)[rng.permutation(rows)][:, None]
    w[3] = 0
    w[5] *= 1e-6
    return w


def assert_same_weights(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    if dtype in LADDER:
        assert np.all(np.abs(got - want) <= 2.0**-20 * np.abs(want))
        assert np.array_equal(got == 0, want == 0)
    else:
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def assert_matmul(lin, want_w: np.ndarray, seed: int = 0) -> None:
    """Quantized kernels vs a float64 product with the decoded weights, within float32
    accumulation error (bounded by eps * in * |x| @ |W|.T)."""
    x = np.random.default_rng(seed).standard_normal((5, want_w.shape[1])).astype(np.float32)
    got = np.array(matmul(lin, mx.array(x)))
    ref = x.astype(np.float64) @ want_w.T.astype(np.float64)
    bound = 4 * np.finfo(np.float32).eps * want_w.shape[1] ** 0.5 * (np.abs(x) @ np.abs(want_w).T)
    assert np.all(np.abs(got - ref) <= bound + 1e-30)


@pytest.mark.parametrize("dtype", ENCODED)
@pytest.mark.parametrize("shape", [(40, 96), (17, 64)])
def test_handler_matches_decoder_on_encoded_weights(dtype, shape):
    dt = dtype_by_name(dtype)
    w = weights(*shape, seed=shape[0])
    buf = dt.encode(w)
    want = dt.decode(buf, shape)
    lin = linear_from_payload(dt, buf, shape, "test")
    assert lin.fallback is None
    if dtype in NATIVE_BITS:
        # Never expanded: the resident blocks are packed at the dtype's native width.
        assert {b.bits for b in lin.blocks if isinstance(b, Packed)} <= NATIVE_BITS[dtype]
        assert all(isinstance(b, Packed) for b in lin.blocks)
    assert_same_weights(np.array(dense(lin)), want, dtype)
    assert_matmul(lin, want)
    ids = np.array([shape[0] - 1, 0, 3, 5, 0])
    assert_same_weights(np.array(lookup(lin, ids)), want[ids], dtype)


def test_vbit_buckets_every_width_and_unpermutes():
    dt = dtype_by_name("vbit_ro")
    shape = (23, 64)
    bits = np.array([3, 4, 5, 6, 8])[np.random.default_rng(1).integers(0, 5, shape[0])]
    buf = dt.encode(weights(*shape, seed=2), bits=bits)
    lin = linear_from_payload(dt, buf, shape, "test")
    assert sorted(b.bits for b in lin.blocks) == sorted(set(bits.tolist()))
    assert lin.order is not None
    want = dt.decode(buf, shape)
    assert_same_weights(np.array(dense(lin)), want, "vbit_ro")
    assert_matmul(lin, want)


def test_in_not_multiple_of_32_falls_back_to_exact_dense():
    dt = dtype_by_name("q4_block")
    shape = (33, 31)
    buf = dt.encode(weights(*shape, seed=3))
    lin = linear_from_payload(dt, buf, shape, "test")
    assert "multiple of 32" in lin.fallback
    assert_same_weights(np.array(dense(lin)), dt.decode(buf, shape), "q4_block")


def test_non_weight_dtype_and_shape_are_refused():
    with pytest.raises(UnsupportedModel, match="u8"):
        linear_from_payload(dtype_by_name("u8"), np.zeros(64, np.uint8), (2, 32), "m.cmf: tensor 't'")
    with pytest.raises(UnsupportedModel, match=r"m.cmf: tensor 't'.*\(64,\)"):
        linear_from_payload(dtype_by_name("f32"), np.zeros(256, np.uint8), (64,), "m.cmf: tensor 't'")


def conformance_cases():
    for meta_path in sorted(CONFORMANCE.glob("dtype_*.json")):
        meta = json.loads(meta_path.read_text())
        for t in meta["tensors"]:
            if t["decodable"] and len(t["shape"]) == 2 and t["dtype"] in HANDLERS and t["shape"][1] % 32 == 0:
                yield pytest.param(meta["open"], t["name"], t["npz_key"], id=f"{meta['case']}:{t['name']}")


@pytest.mark.parametrize("file, name, key", list(conformance_cases()))
def test_handler_matches_conformance_vectors(file, name, key):
    with open_cmf(CONFORMANCE / file) as cmf:
        lin = load_linear(cmf, name)
        dtype = cmf.info(name).dtype.name
        want = np.load(CONFORMANCE / file.replace(".cmf", ".expected.npz"), allow_pickle=False)[key]
        assert lin.fallback is None
        assert_same_weights(np.array(dense(lin)), want, dtype)
        assert_matmul(lin, want)
