"""coreml.codes: the numpy codes behind the recipes, against independent constructions."""

import numpy as np

from coreml import codes

EPS16 = 2.0 ** -11  # fp16's unit roundoff


def _q4_1_grid(rng, rows=64, cols=128):
    """A GGUF Q4_1-style weight: codes 0..15 per 32, fp16 step d and minimum m per block."""
    d = rng.uniform(0.001, 0.05, (rows, cols // 32)).astype(np.float16)
    m = (-8 * d.astype(np.float32) + rng.normal(0, 0.01, d.shape)).astype(np.float16)
    q = rng.integers(0, 16, (rows, cols))
    q[:, ::32], q[:, 1::32] = 0, 15  # every block reaches both ends of its grid
    w = q * np.repeat(d.astype(np.float32), 32, 1) + np.repeat(m.astype(np.float32), 32, 1)
    return w.astype(np.float32), d, m


def test_affine_blocks_carry_a_q4_1_grid_up_to_fp16_rounding():
    w, d, m = _q4_1_grid(np.random.default_rng(0))
    got = codes.affine_blocks(w, 4, 32).decode()
    # scale = (15 d) / 15 = d exactly (15 d is exact in fp32); offset = fp16(-m / d) errs by at
    # most |m| eps16 once multiplied by d; the op's fp16 (q - offset) and (x * scale) each round
    # by eps16 relative to at most |m| + 15 d.
    bound = EPS16 * np.repeat(np.abs(m.astype(np.float32)) + 2 * (np.abs(m.astype(np.float32)) + 15 * d), 32, 1)
    assert np.all(np.abs(got - w) <= bound)
    # symmetric absmax int4 on the same grid errs by up to half its step: far more
    sym = codes.symmetric_blocks(w, 4, 32).decode()
    assert np.abs(sym - w).max() > 10 * bound.max()


def test_fp32_affine_codes_are_nearest_grid_points():
    w = np.random.default_rng(1).normal(0, 1, (32, 64)).astype(np.float32)
    code = codes.affine_blocks(w, 4, 32, np.float32)
    step = np.repeat(code.scale, 32, 1)
    assert np.all(np.abs(code.decode() - w) <= step / 2 * (1 + 1e-5))  # rounding to the nearest level
    assert code.bits() == 32 * 64 * 4 + 2 * 32 * 2 * 32  # codes + fp32 scale and offset per block


def test_kmeans_tiles_pick_the_nearest_stored_entry_and_beat_a_uniform_lut():
    rng = np.random.default_rng(2)
    w = (rng.standard_t(4, (64, 96)) * 0.1).astype(np.float32)
    palette = codes.kmeans_tiles(w, 4, (32, 32))
    assert palette.lut.shape == (2, 3, 16) and palette.lut.dtype == np.float16
    tile = (np.arange(64)[:, None] // 32, np.arange(96)[None, :] // 32)
    lut = palette.lut.astype(np.float32)[tile[0], tile[1]]  # [64, 96, 16]
    np.testing.assert_array_equal(np.abs(palette.decode() - w), np.abs(lut - w[..., None]).min(-1))
    # Lloyd iterations never raise the error of their start, 16 levels evenly over each tile's range
    tiles = w.reshape(2, 32, 3, 32).transpose(0, 2, 1, 3).reshape(6, -1)
    lo, hi = tiles.min(1, keepdims=True), tiles.max(1, keepdims=True)
    start = lo + (hi - lo) * (np.arange(16) + 0.5) / 16
    uniform = np.abs(tiles[..., None] - start[:, None, :]).min(-1)
    assert np.linalg.norm(palette.decode() - w) < np.linalg.norm(uniform)


def test_importance_pulls_the_lut_towards_the_weights_that_matter():
    rng = np.random.default_rng(3)
    w = rng.normal(0, 1, (32, 64)).astype(np.float32)
    w[:, :4] = 3 + 0.3 * w[:, :4]  # a cluster of their own that an unweighted LUT spends little on
    importance = np.ones(64)
    importance[:4] = 1e4  # four input columns carry almost all of the output error
    plain, weighted = codes.kmeans_tiles(w, 2, (32, 64)), codes.kmeans_tiles(w, 2, (32, 64), importance)

    def error(p, cols):
        return np.linalg.norm(p.decode()[:, cols] - w[:, cols])

    assert error(weighted, slice(0, 4)) < error(plain, slice(0, 4))
    assert error(weighted, slice(4, None)) > error(plain, slice(4, None))


def _output_error(code, w, hessian) -> float:
    """E||(W_hat - W) x||^2 over inputs with second moments `hessian`: tr(E H E^T)."""
    e = code.decode().astype(np.float64) - w
    return float(np.einsum("ij,jk,ik->", e, hessian, e))


def test_gptq_lowers_the_output_error_on_correlated_inputs_below_the_plain_fit():
    """GPTQ minimises the layer's output error, not the weights' own: on inputs whose columns
    are correlated (as a real layer's are) it must beat the per-weight nearest rounding of
    the same grid, while each weight stays on its block's grid."""
    rng = np.random.default_rng(1)
    rows, cols = 96, 192
    x = rng.normal(size=(1024, cols)) @ rng.normal(size=(cols, cols)) * 0.1 + rng.normal(size=cols)
    hessian = x.T @ x / len(x)
    w = (rng.standard_t(4, size=(rows, cols)) * 0.02).astype(np.float32)
    gptq, plain = codes.gptq_affine(w, hessian, 4, 32), codes.affine_blocks(w, 4, 32)
    assert _output_error(gptq, w, hessian) < _output_error(plain, w, hessian)
    assert gptq.data.max() <= 15 and gptq.scale.dtype == np.float16 and gptq.offset.shape == (rows, cols // 32)
    assert gptq.bits() == plain.bits()  # the same storage: codes plus fp16 scale and offset per 32


def test_gptq_codes_rows_in_blocks_each_as_on_its_own(monkeypatch):
    """GPTQ's feedback runs along a row, so rows are coded a block at a time (a 262k-row head
    whole would take 1.3 GB of float64 and as much per column update): each block's codes are
    those of the same rows coded alone, the same operations on the same values."""
    rng = np.random.default_rng(2)
    rows, cols = 20, 64
    x = rng.normal(size=(256, cols)) @ rng.normal(size=(cols, cols)) * 0.1
    hessian = x.T @ x / len(x)
    w = (rng.standard_t(4, size=(rows, cols)) * 0.02).astype(np.float32)
    monkeypatch.setattr(codes, "GPTQ_ROW_BYTES", 7 * 8 * cols)  # 7 rows a block: 7, 7, 6
    whole = codes.gptq_affine(w, hessian, 4, 32)
    for first in (0, 7, 14):
        alone = codes.gptq_affine(w[first:first + 7], hessian, 4, 32)
        for part in ("data", "scale", "offset"):
            assert np.array_equal(getattr(whole, part)[first:first + 7], getattr(alone, part)), part
