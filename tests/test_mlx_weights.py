"""Every MLX dtype handler against the CMF decoder (pipeline.ground.cmf): the effective weights the
kernels run are the decoder's output, and quantized matmuls equal x @ decode(W).T.

Payloads come from two independent sources: the encoders of pipeline.ground.cmf.dtypes on random
weights, and the conformance vectors' dtype_* files (random but valid payloads that reach
every code value)."""

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from pipeline.ground.cmf import DTYPES, dtype_by_name, open_cmf
from pipeline.ground.cmf.dtypes import GROUP, ladder, q2tp_scales, tile_rungs
from pipeline.ground.errors import UnsupportedModel
from mlx_runtime.weights import HANDLERS, Packed, dense, linear_from_payload, load_linear, lookup, matmul

CONFORMANCE = Path("/work/shared/cmf-conformance")
ENCODED = [dt.name for dt in DTYPES.values() if dt.encode is not None]
U32 = 2.0**-24  # float32 unit roundoff
# The ladder dtypes run code * t + bias where the decoder runs (code - k) * t. With the same
# rung t (both take pipeline.ground.cmf.dtypes.ladder's bits), q4tp's -8t is exact and code * t
# (code <= 15) and the sum round once each: at |code - 8| = 1 that is (9 + 1) u of |w|, plus
# the decoder's own u, 11u; q2tp's -1.5t, 3t, the sum and the decoder's product give 5u. Both
# are under 16u = 2^-20 relative, and zeros stay exact zeros.
LADDER = {"q4tp", "q2tp"}
# The code offset k of w = (code - k) * t.
LADDER_OFFSET = {"q4tp": 8.0, "q2tp": 1.5}
# Spec §3.2: decoders agree on q4tp/q2tp to rtol 1e-5, not bitwise. Float32 exp2 differs by an
# ulp between libraries (numpy's own SIMD exp2 here, libm elsewhere) and a rung is exp2(lo)
# times up to 30 multiplies by exp2(step), so one ulp of exp2(step) compounds to ~30 ulps at
# the top rung: the conformance producer's rungs sit up to ~4e-6 from ours on this machine.
LADDER_RTOL = 1e-5
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


def magnitude(lin) -> np.ndarray:
    """[out, in] terms whose sum bounds what a kernel adds up: MLX's CPU kernel sums
    x * (q s + b), its Metal kernel s * (x . q) and b * sum(x) apart, so q |s| + |b| counts
    (codes are unsigned), then |row|, |col| and the overlay's |delta|."""
    def absolute(block):
        return replace(block, scales=mx.abs(block.scales), biases=mx.abs(block.biases)) if isinstance(block, Packed) \
            else mx.abs(block)

    sparse = None if lin.sparse is None else replace(lin.sparse, delta=mx.abs(lin.sparse.delta))
    absolute_lin = replace(lin, blocks=tuple(absolute(b) for b in lin.blocks), sparse=sparse,
                           col=None if lin.col is None else mx.abs(lin.col),
                           row=None if lin.row is None else mx.abs(lin.row))
    return np.array(dense(absolute_lin)).astype(np.float64)


def assert_matmul(lin, want_w: np.ndarray, seed: int = 0) -> None:
    """Quantized kernels vs a float64 product with the effective weights, within float32
    accumulation error: K terms summed in any order (blocking, FMA and vector width only move
    it inside), products, the per-group affine and q8_2f's scalings rounded too, err at most
    gamma_{K+4} * |x| @ magnitude.T (gamma_n = n u / (1 - n u))."""
    k = want_w.shape[1]
    x = np.random.default_rng(seed).standard_normal((5, k)).astype(np.float32)
    got = np.array(matmul(lin, mx.array(x)))
    ref = x.astype(np.float64) @ want_w.T.astype(np.float64)
    gamma = (k + 4) * U32 / (1 - (k + 4) * U32)
    assert np.all(np.abs(got - ref) <= gamma * (np.abs(x).astype(np.float64) @ magnitude(lin).T) + 1e-30)


def unpack_codes(block: Packed, rows: int) -> np.ndarray:
    """Integer codes [rows, in] from MLX's words: element j at bits j*b.. of the row's stream."""
    bits = np.unpackbits(np.array(block.w).view(np.uint8), bitorder="little").reshape(rows, -1, block.bits)
    return (bits.astype(np.int64) << np.arange(block.bits)).sum(-1)


def assert_ladder_matches_conformance(lin, want: np.ndarray, dtype: str, parts: dict) -> None:
    """Codes and scales exact, values within the ladder's float error, against another decoder."""
    rows, cols = lin.shape
    (block,) = lin.blocks
    assert block.scales.dtype == mx.float32 and block.biases.dtype == mx.float32
    s = np.array(block.scales)
    # Scales bitwise: the spec's ladder (one exp2, repeated float32 multiplies) at each tile's rung.
    gpr = cols // GROUP
    t = ladder(parts["lo"], parts["step"])
    rung = tile_rungs(parts["codes"], gpr)
    want_s = np.take_along_axis(t, rung.astype(np.intp), axis=1) if dtype == "q4tp" else q2tp_scales(t, rung)
    np.testing.assert_array_equal(s.view(np.uint32), want_s.view(np.uint32))
    k = LADDER_OFFSET[dtype]
    scale = np.repeat(s, GROUP, axis=1)
    codes = unpack_codes(block, rows)
    live = scale > 0
    assert np.all(want[~live] == 0)  # q2tp rung 0: an exactly-zero group
    # Codes exact: want / scale is (code - k) * (1 +- 1e-5), |code - k| <= 8, so rint recovers code.
    np.testing.assert_array_equal(codes[live], np.rint(want[live].astype(np.float64) / scale[live] + k))
    # Scales against the other decoder's rungs: want = fl((code - k) * t'), so want / (code - k)
    # is t' within u, and t' is within the spec's rtol of ours. A wrong rung is off by exp2(step).
    nz = live & (codes != k)
    implied = want[nz].astype(np.float64) / (codes[nz] - k)
    assert np.all(np.abs(scale[nz] - implied) <= (LADDER_RTOL + 2 * U32) * np.abs(implied))


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
    got = np.array(dense(lin))
    assert_same_weights(got, want, dtype)
    assert_matmul(lin, got)
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
        got = np.array(dense(lin))
        # Against this package's decoder (same ladder bits): bitwise, or 2^-20 for ladders.
        assert_same_weights(got, cmf.decode(name), dtype)
        if dtype in LADDER:
            assert_ladder_matches_conformance(lin, want, dtype, cmf.info(name).dtype.parts(cmf.raw(name), lin.shape, name))
            # Against the conformance values: the spec's rtol between decoders plus the 2^-20 above.
            assert np.all(np.abs(got - want) <= (LADDER_RTOL + 2.0**-20 * (1 + LADDER_RTOL)) * np.abs(want))
            assert np.array_equal(got == 0, want == 0)
        else:
            assert_same_weights(got, want, dtype)
        assert_matmul(lin, got)
