"""coreml.codes: the numpy codes behind the recipes, against independent constructions."""

import numpy as np
import pytest

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


@pytest.mark.parametrize("offset_kind", ["none", "integer", "fp16"])
def test_shift_scale_is_numpys_float16_arithmetic_bit_for_bit(offset_kind):
    """`(data - offset) * scale` in float16 as numpy's own float16 ops give it, over every scale
    bit pattern (subnormals, infinities and NaNs included): the same float32 op and rounding,
    so equal on every machine."""
    rng = np.random.default_rng(5)
    scale = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(-1, 1)
    data = rng.integers(0, 256, (scale.shape[0], 8)).astype(np.uint8)
    offset = {"none": None, "integer": rng.integers(0, 256, scale.shape).astype(np.uint8),
              "fp16": rng.integers(0, 1 << 16, scale.shape).astype(np.uint16).view(np.float16)}[offset_kind]
    with np.errstate(all="ignore"):
        want = data.astype(np.float16) if offset is None else data.astype(np.float16) - offset.astype(np.float16)
        want = want * scale
        got = codes.shift_scale(data, offset, scale)
    assert got.dtype == np.float16
    assert np.all((got.view(np.uint16) == want.view(np.uint16)) | (np.isnan(got) & np.isnan(want)))


def test_fp32_affine_codes_are_nearest_grid_points():
    w = np.random.default_rng(1).normal(0, 1, (32, 64)).astype(np.float32)
    code = codes.affine_blocks(w, 4, 32, np.float32)
    step = np.repeat(code.scale, 32, 1)
    assert np.all(np.abs(code.decode() - w) <= step / 2 * (1 + 1e-5))  # rounding to the nearest level
    assert code.bits() == 32 * 64 * 4 + 2 * 32 * 2 * 32  # codes + fp32 scale and offset per block


def test_an_integer_offset_is_a_level_and_every_weight_stays_within_half_a_step():
    """An integer offset (GPTQ's zero point: 4 bits a block where an fp16 one takes 16) is a
    level of the grid, so the grid's ends lie off the block's (0-widened) minimum and maximum
    by up to half a step. Each weight then decodes within half a step of itself, plus the
    fp16 rounding of the scale carried over at most 15 steps and the op's fp16 product of at
    most 15 steps: s (1/2 + 31 eps16)."""
    w = np.random.default_rng(4).normal(0.3, 1, (48, 128)).astype(np.float32)
    w[:, :32] = np.abs(w[:, :32])  # a block all above 0: its range is widened down to 0
    code = codes.affine_blocks(w, 4, 32, integer_offset=True)
    assert code.offset.dtype == np.uint8 and code.offset.max() <= 15 and code.data.max() <= 15
    assert np.all(code.offset[:, 0] == 0)
    step = np.repeat(code.scale.astype(np.float32), 32, 1)
    assert np.all(np.abs(code.decode() - w) <= step * (0.5 + 31 * EPS16))
    assert code.bits() == 48 * 128 * 4 + 48 * 4 * (16 + 4)
    assert code.bits() < codes.affine_blocks(w, 4, 32).bits()


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


def test_kmeans_codes_are_the_search_of_each_value_among_the_stored_lut_midpoints():
    # The codes are read off each tile's sorted values (`_nearest_in_sorted`); numpy's own search
    # of every value among the midpoints of its tile's stored LUT is the independent answer.
    rng = np.random.default_rng(2)
    w = (np.round(rng.standard_normal((64, 96)) * 16) / 8).astype(np.float32)
    tiles = w.reshape(2, 32 * 96).astype(np.float64)
    for nbits in (2, 4, 6):
        palette = codes.kmeans_tiles(w, nbits, (32, 96))
        stored = palette.lut.astype(np.float64)[:, 0]
        mids = (stored[:, 1:] + stored[:, :-1]) / 2
        want = np.stack([np.searchsorted(m, t) for m, t in zip(mids, tiles)])
        np.testing.assert_array_equal(palette.indices.reshape(2, -1), want)


def test_the_cut_search_is_numpys_search_row_by_row_ties_and_signed_zeros_included():
    # `_SortedRows` counts float32 values below (at or below) float64 queries through integer keys,
    # `_nearest_in_sorted` turns its cuts into codes: both against np.searchsorted on each row, with
    # queries on values exactly, between neighbouring float32 values, on -0.0 and +0.0, repeated,
    # and beyond both ends; rows searched together must answer as each alone.
    rng = np.random.default_rng(11)
    low = np.float32([[0.1], [-0.3], [1.7], [5.0]])
    high = np.nextafter(low, np.float32(np.inf))  # its neighbour: no float32 between the two
    rows = np.sort(np.concatenate([np.round(rng.standard_normal((4, 40)) * 4) / 4, np.array([[-0.0, 0.0]] * 4),
                                   low, high], axis=1).astype(np.float32), axis=1)
    values = rows.astype(np.float64)
    step = high.astype(np.float64) - low.astype(np.float64)
    between = [low + step / 4, low + 3 * step / 4]  # rounding to float32 would take them to low, high
    queries = np.sort(np.concatenate([values[:, ::7], *between, np.zeros((4, 1)), -np.zeros((4, 1)),
                                      np.full((4, 1), -1e9), np.full((4, 1), 1e9)], axis=1), axis=1)
    search = codes._SortedRows(values)
    for side in ("left", "right"):
        want = np.stack([np.searchsorted(r, q, side) for r, q in zip(values, queries)])
        np.testing.assert_array_equal(search.count(queries, side), want)
        np.testing.assert_array_equal(codes._SortedRows(values[1:2]).count(queries[1:2], side), want[1:2])
    order = np.stack([rng.permutation(rows.shape[1]) for _ in range(4)])
    shuffled = np.empty_like(values)
    np.put_along_axis(shuffled, order, values, axis=1)  # row i's sorted values sit at order[i]
    got = codes._nearest_in_sorted(search, order, queries[:, 1:-1])
    want = np.stack([np.searchsorted(q, v) for q, v in zip(queries[:, 1:-1], shuffled)])
    np.testing.assert_array_equal(got, want)


def test_kmeans_tiles_in_bands_of_tile_rows_give_the_codes_of_all_tiles_at_once(monkeypatch):
    # Each tile's LUT is its own values' k-means and every search and sum runs along its own row
    # (`_SortedRows`), so the memory bound (bands of tile rows, KMEANS_BLOCK_VALUES values
    # at a time) cannot change a bit on any machine: one band of all 20 tile rows against bands
    # of one and of three (the last one short), weighted and not.
    rng = np.random.default_rng(5)
    w = (rng.standard_t(4, (640, 96)) * 0.05).astype(np.float32)
    importance = rng.random(96)
    whole = [codes.kmeans_tiles(w, 4, (32, 32)), codes.kmeans_tiles(w, 6, (32, 32), importance)]
    for values in (32 * 96, 3 * 32 * 96):
        monkeypatch.setattr(codes, "KMEANS_BLOCK_VALUES", values)
        banded = [codes.kmeans_tiles(w, 4, (32, 32)), codes.kmeans_tiles(w, 6, (32, 32), importance)]
        for a, b in zip(whole, banded):
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_array_equal(a.lut, b.lut)


def test_kmeans_centres_found_in_a_cache_give_each_lut_dtype_its_codes_afresh(tmp_path, monkeypatch):
    # The centres are stored before their rounding to the LUT's dtype, so an fp32 LUT made from an
    # fp16 palette's centres is the one made from nothing, bit for bit on every machine (the same
    # float64 centres, rounded and searched the same way); another weight, bit width or weighting
    # is another entry.
    from coreml.cache import ResultCache

    rng = np.random.default_rng(6)
    w = (rng.standard_t(4, (64, 96)) * 0.05).astype(np.float32)
    importance = rng.random(96)
    afresh = {dtype: codes.kmeans_tiles(w, 4, (32, 32), dtype=dtype) for dtype in (np.float16, np.float32)}
    cache = ResultCache(tmp_path)
    first = codes.kmeans_tiles(w, 4, (32, 32), dtype=np.float16, cache=cache)
    lloyd = codes._kmeans_rows
    monkeypatch.setattr(codes, "_kmeans_rows", lambda *args: lloyd(*args[:4], 0, args[5]) if args[5] is not None
                        else pytest.fail("the centres were computed again"))
    shared = codes.kmeans_tiles(w, 4, (32, 32), dtype=np.float32, cache=cache)
    for got, want in ((first, afresh[np.float16]), (shared, afresh[np.float32])):
        np.testing.assert_array_equal(got.indices, want.indices)
        np.testing.assert_array_equal(got.lut, want.lut)
        assert got.lut.dtype == want.lut.dtype
    assert len([e for e in tmp_path.iterdir() if e.is_dir()]) == 1
    monkeypatch.setattr(codes, "_kmeans_rows", lloyd)
    for other in ((w, 6, None), (w, 4, importance), (w[::-1].copy(), 4, None)):
        codes.kmeans_tiles(other[0], other[1], (32, 32), other[2], cache=cache)
    assert len([e for e in tmp_path.iterdir() if e.is_dir()]) == 4


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


@pytest.mark.parametrize("integer_offset, search_range, act_order",
                         [(False, False, False), (True, False, False), (True, True, False), (True, False, True),
                          (True, True, True)])
def test_gptq_lowers_the_output_error_on_correlated_inputs_below_the_plain_fit(integer_offset, search_range, act_order):
    """GPTQ minimises the layer's output error, not the weights' own: on inputs whose columns
    are correlated (as a real layer's are) it must beat the per-weight nearest rounding of
    the same grid, while each weight stays on its block's grid (float or integer offsets,
    min/max or searched ranges, columns in order or by descending H_jj)."""
    rng = np.random.default_rng(1)
    rows, cols = 96, 192
    x = rng.normal(size=(1024, cols)) @ rng.normal(size=(cols, cols)) * 0.1 + rng.normal(size=cols)
    hessian = x.T @ x / len(x)
    w = (rng.standard_t(4, size=(rows, cols)) * 0.02).astype(np.float32)
    gptq = codes.gptq_affine(w, hessian, 4, 32, integer_offset=integer_offset, search_range=search_range,
                             act_order=act_order)
    plain = codes.affine_blocks(w, 4, 32, integer_offset=integer_offset)
    assert _output_error(gptq, w, hessian) < _output_error(plain, w, hessian)
    assert gptq.data.max() <= 15 and gptq.scale.dtype == np.float16 and gptq.offset.shape == (rows, cols // 32)
    assert gptq.offset.dtype == plain.offset.dtype and (not integer_offset or gptq.offset.max() <= 15)
    assert gptq.bits() == plain.bits()  # the same storage: codes plus fp16 scale and offset per 32


def test_act_order_fits_every_block_to_the_weights_before_any_feedback():
    """With act_order a block's columns are not coded together, so its grid is fitted once to
    the weights as they are (static groups), and every code is a level of that grid."""
    rng = np.random.default_rng(5)
    rows, cols = 24, 128
    x = rng.normal(size=(512, cols)) * rng.uniform(0.1, 3, cols)  # inputs of unequal energy: a real order
    hessian = x.T @ x / len(x)
    w = (rng.standard_t(4, size=(rows, cols)) * 0.02).astype(np.float32)
    for integer_offset in (False, True):
        gptq = codes.gptq_affine(w, hessian, 4, 32, integer_offset=integer_offset, act_order=True)
        static = codes.affine_blocks(w.astype(np.float64), 4, 32, integer_offset=integer_offset)
        assert np.array_equal(gptq.scale, static.scale) and np.array_equal(gptq.offset, static.offset)
        assert not np.array_equal(gptq.data, static.data)  # the codes are GPTQ's, not the nearest levels


def test_a_searched_range_errs_no_more_than_min_max_on_any_block():
    """The search includes the min/max range itself (a shrink of 1), so each block's chosen
    grid errs (in RANGE_NORM) no more than min/max's does, and on t(3) tails less on some."""
    rng = np.random.default_rng(6)
    values = rng.standard_t(3, size=(200, 32))
    for integer_offset in (False, True):
        fits = {f: f(values, 4, np.float16, integer_offset) for f in (codes._min_max_parameters, codes._searched_parameters)}

        def error(scale, offset):
            q = np.clip(np.rint(values / scale.astype(np.float64)[:, None] + offset[:, None]), 0, 15)
            decoded = (q.astype(np.float16) - offset[:, None].astype(np.float16)) * scale[:, None]
            return (np.abs(decoded.astype(np.float64) - values) ** codes.RANGE_NORM).sum(axis=1)

        min_max, searched = (error(*fits[f]) for f in (codes._min_max_parameters, codes._searched_parameters))
        assert np.all(searched <= min_max) and np.any(searched < min_max)


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
