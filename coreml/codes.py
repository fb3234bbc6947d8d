"""Weight codes computed here in numpy, for the Core ML constexpr ops that decode them.

    code = affine_blocks(w, nbits=4, block=32)         # constexpr_blockwise_shift_scale
    code = kmeans_tiles(w, nbits=4, tile=(32, 32))      # constexpr_lut_to_dense
    code = gptq_affine(w, hessian, nbits=4, block=32)   # the same op, GPTQ-chosen codes
    code = hot_rows(code, w, hot_ids)                   # + an int8 residual of the rows text uses most
    w_hat = code.decode()                               # what the op gives back, in float32

A `ShiftScale` is `scale * (data - offset)` per block along the input axis; a `Palette` is
one look-up table per tile of rows x columns. Both carry their parameters in the dtype the
package stores (fp16 scales, offsets and LUTs) and `decode` does the op's own arithmetic
on exactly those values, so a package written from a code decompresses to `decode()`.

`importance` (same shape as the weight, or one value per input column) weights the
errors the fits minimise: activation second moments from calibration text turn the
plain fits into sensitivity-weighted ones (SKM, AWQ-style weighted min/max).
"""

from dataclasses import dataclass

import numpy as np

from coreml.cache import ResultCache, content_key
from pipeline.ground.halves import as_dtype

KMEANS_ITERATIONS = 40  # past 40, a t(4)-tailed test matrix's error moves by < 0.2%
# A group's Lloyd iterations stop once none of its centres moves by more than this fraction
# of its range: far below the fp16 rounding (2**-11 relative) the LUT is stored with.
KMEANS_TOLERANCE = 1e-5
# Values whose tiles run k-means together.
KMEANS_BLOCK_VALUES = 1 << 22


@dataclass(frozen=True)
class ShiftScale:
    """`scale * (data - offset)`, one (scale, offset) per block of `block` input columns."""

    data: np.ndarray  # [rows, cols] integer codes (uint8 holding uint4/uint8, or int8)
    scale: np.ndarray  # [rows, cols // block] fp16 (or fp32)
    offset: np.ndarray | None  # same shape as scale, fp16/fp32, or integer like data; None: 0
    nbits: int
    signed: bool

    @property
    def block(self) -> int:
        return self.data.shape[1] // self.scale.shape[1]

    def decode(self) -> np.ndarray:
        """float32, a block of rows at a time (`in_row_blocks`): made whole, the repeated scale and
        offset and each step of `shift_scale` are five arrays of the weight's size (0.5 GB for
        SmolLM2's embedding, the largest memory of a `mixed` survey worker)."""
        def rows(start: int, stop: int) -> tuple:
            offset = None if self.offset is None else np.repeat(self.offset[start:stop], self.block, axis=1)
            return self.data[start:stop], offset, np.repeat(self.scale[start:stop], self.block, axis=1)

        return in_row_blocks(lambda *parts: shift_scale(*parts).astype(np.float32, copy=False), len(self.data), 1,
                             5 * 4 * self.data.shape[1], rows)

    def bits(self) -> int:
        """Storage in bits: the codes plus every scale and offset."""
        params = self.scale.size * self.scale.itemsize * 8
        if self.offset is not None:
            params += self.offset.size * (self.offset.itemsize * 8 if self.offset.dtype.kind == "f" else self.nbits)
        return self.data.size * self.nbits + params


# Bytes of full-size temporaries a decoding may make at a time (`in_row_blocks`).
DECODE_BLOCK_BYTES = 64 << 20


def in_row_blocks(decode, rows: int, unit: int, bytes_per_row: int, block_args) -> np.ndarray:
    """`decode(*block_args(start, stop))` over rows [start, stop) a block of whole `unit`s of rows
    at a time, written into one array: each block's rows are the same elementwise decoding of
    the same values, so the result is the whole decoding's to the bit, while the decoding's
    full-size temporaries (`bytes_per_row` a row) are one block's."""
    step = max(1, DECODE_BLOCK_BYTES // max(1, unit * bytes_per_row)) * unit
    out = None
    for start in range(0, rows, step):
        block = np.asarray(decode(*block_args(start, min(rows, start + step))))
        if out is None:
            out = np.empty((rows, *block.shape[1:]), block.dtype)
        out[start:start + len(block)] = block
    return out


def shift_scale(data: np.ndarray, offset: np.ndarray | None, scale: np.ndarray) -> np.ndarray:
    """`(data - offset) * scale` (offset None: 0) in the scale's dtype, each op's result rounded
    to it, as numpy computes it in float16: numpy's float16 loops convert each operand to float32,
    compute there and round the result to float16, one value at a time. The same float32 ops
    with the conversions of `pipeline.ground.halves` give the same bits (both round to nearest
    even) at a fraction of the cost: numpy's conversions were half of GPTQ's range search on
    Gemma 3. Integer data and offsets of at most 8 bits are exact in float16."""
    dtype = scale.dtype
    out = data.astype(np.float32)
    if offset is not None:
        out = as_dtype(as_dtype(out - as_dtype(offset.astype(dtype), np.float32), dtype), np.float32)
    return as_dtype(out * as_dtype(scale, np.float32), dtype)


@dataclass(frozen=True)
class Palette:
    """`lut[i // rows_per_group, j // cols_per_group][indices[i, j]]` (iOS18 grouped LUTs)."""

    indices: np.ndarray  # [rows, cols] uint8
    lut: np.ndarray  # [row groups, column groups, 2**nbits] fp16 (or fp32)
    nbits: int

    def decode(self) -> np.ndarray:
        rows, cols = self.indices.shape
        i = (np.arange(rows) // (rows // self.lut.shape[0]))[:, None]
        j = (np.arange(cols) // (cols // self.lut.shape[1]))[None, :]
        return self.lut[i, j, self.indices].astype(np.float32)

    def bits(self) -> int:
        return self.indices.size * self.nbits + self.lut.size * self.lut.itemsize * 8


@dataclass(frozen=True)
class HotRows:
    """A table's code plus a code of what it misses on its most used rows: row i decodes to
    `table[i] + residual[slot[i]]`, where residual row 0 is zero (slot 0: a cold row, as the
    table codes it) and slot k > 0 is the k-th hot row. The package adds the two where the
    table is read (`coreml.recipes.emit.emit_hot_rows`), never as one dense matrix."""

    table: ShiftScale
    residual: ShiftScale  # [hot rows + 1, cols], row 0 zero
    slot: np.ndarray  # [rows] uint16

    @property
    def hot_ids(self) -> np.ndarray:
        """The hot rows' ids in slot order."""
        hot = np.flatnonzero(self.slot)
        return hot[np.argsort(self.slot[hot])]

    def decode(self) -> np.ndarray:
        return with_hot_rows(self.table.decode(), self.residual.decode(), self.slot)

    def bits(self) -> int:
        """The table's and the residual's codes, the slot map, and the hot ids (int32) the head scatters to."""
        return self.table.bits() + self.residual.bits() + self.slot.size * self.slot.itemsize * 8 + 32 * len(self.hot_ids)


def with_hot_rows(table: np.ndarray, residual: np.ndarray, slot: np.ndarray) -> np.ndarray:
    """`table` (decoded, written in place) as a hot-rows package reads it: each hot row plus its
    residual row (`slot`: 0 cold, k the k-th hot row)."""
    rows = np.flatnonzero(slot)
    table[rows] += residual[slot[rows]]
    return table


def code_arrays(code: ShiftScale | HotRows) -> tuple[dict[str, np.ndarray], dict]:
    """`code` as named arrays and a JSON record (`code_from_arrays` gives it back), for `coreml.cache`."""
    if isinstance(code, HotRows):
        parts = {"table": code_arrays(code.table), "residual": code_arrays(code.residual)}
        arrays = {f"{part}.{name}": a for part, (named, _) in parts.items() for name, a in named.items()}
        return {**arrays, "slot": code.slot}, {"kind": "hot_rows", **{part: r for part, (_, r) in parts.items()}}
    arrays = {"data": code.data, "scale": code.scale, **({"offset": code.offset} if code.offset is not None else {})}
    return arrays, {"kind": "shift_scale", "nbits": code.nbits, "signed": code.signed}


def code_from_arrays(arrays: dict[str, np.ndarray], record: dict) -> ShiftScale | HotRows:
    if record["kind"] == "hot_rows":
        parts = {part: code_from_arrays({k.split(".", 1)[1]: a for k, a in arrays.items() if k.startswith(f"{part}.")},
                                        record[part]) for part in ("table", "residual")}
        return HotRows(parts["table"], parts["residual"], arrays["slot"])
    return ShiftScale(arrays["data"], arrays["scale"], arrays.get("offset"), record["nbits"], record["signed"])


def rows_of(code: ShiftScale, ids: np.ndarray) -> ShiftScale:
    """The code of rows `ids` alone (a block code's parameters are per row)."""
    return ShiftScale(code.data[ids], code.scale[ids], None if code.offset is None else code.offset[ids],
                      code.nbits, code.signed)


def hot_rows(table: ShiftScale, w: np.ndarray, hot_ids: np.ndarray, nbits: int = 8, block: int = 32,
             dtype=np.float16) -> HotRows:
    """`table` (a code of `w`) with the rows `hot_ids` corrected by a symmetric `nbits` code per
    `block` of what the table misses there, `w[hot] - table[hot]`: about half a step of the
    table's grid wide, so its 8-bit code errs by 1/254 of that, far under Q8_0's error on the row."""
    hot_ids = np.asarray(hot_ids, dtype=np.int64)
    if len(hot_ids) >= np.iinfo(np.uint16).max or len(np.unique(hot_ids)) != len(hot_ids):
        raise ValueError(f"hot rows: {len(hot_ids)} ids, distinct and fewer than 65535 expected")
    missed = np.asarray(w[hot_ids], np.float32) - rows_of(table, hot_ids).decode()
    residual = symmetric_blocks(np.concatenate([np.zeros((1, w.shape[1]), np.float32), missed]), nbits, block, dtype)
    slot = np.zeros(w.shape[0], np.uint16)
    slot[hot_ids] = np.arange(1, len(hot_ids) + 1)
    return HotRows(table, residual, slot)


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(rows, cols // block, block)


def affine_blocks(w: np.ndarray, nbits: int, block: int, dtype=np.float16, integer_offset: bool = False) -> ShiftScale:
    """Min/max affine codes per block (mlx-lm's `q4 g32` grid): unsigned data, a float offset
    (or an integer one: `_affine_parameters`).

    With a float offset the grid's lowest level is the block's minimum and its highest the
    maximum, so a weight that already lies on a per-block affine grid of 2**nbits levels
    (GGUF Q4_1, mlx q4) is carried up to the rounding of scale and offset to `dtype`.
    """
    wb = _blocks(np.asarray(w, np.float32), block)
    scale, offset = _affine_parameters(wb.min(axis=2), wb.max(axis=2), nbits, dtype, integer_offset)
    return _fit_data(wb, scale, offset, nbits, signed=False)


def _affine_parameters(lo: np.ndarray, hi: np.ndarray, nbits: int, dtype, integer_offset: bool):
    """(scale in `dtype`, offset) of the grid of 2**nbits levels from `lo` to `hi`, per block.

    A float offset puts the lowest level on `lo` exactly. An integer offset (GPTQ's zero
    point, stored in the codes' own dtype: `nbits` a block where a float one takes 16) must be
    a level, so the range is widened to hold 0 (zero in [0, levels]) and the grid is then
    off `lo` by up to half a step; what it buys is 12 bits a block.
    """
    levels = (1 << nbits) - 1
    if integer_offset:
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    scale = ((hi - lo) / levels).astype(dtype)
    scale = np.where(scale == 0, np.ones_like(scale), scale)  # a constant block: any scale, offset carries it
    zero = -lo / scale.astype(np.float32)
    return scale, (np.clip(np.rint(zero), 0, levels).astype(np.uint8) if integer_offset else zero.astype(dtype))


def symmetric_blocks(w: np.ndarray, nbits: int, block: int, dtype=np.float16) -> ShiftScale:
    """Absmax symmetric codes per block: signed data in [-2**(n-1), 2**(n-1) - 1], no offset."""
    wb = _blocks(np.asarray(w, np.float32), block)
    scale = (np.abs(wb).max(axis=2) / ((1 << (nbits - 1)) - 1)).astype(dtype)
    scale = np.where(scale == 0, np.ones_like(scale), scale)
    return _fit_data(wb, scale, None, nbits, signed=True)


def _fit_data(wb: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, nbits: int, signed: bool) -> ShiftScale:
    """The nearest code per weight for the (already rounded) block parameters."""
    s = scale.astype(np.float32)[..., None]
    z = 0.0 if offset is None else offset.astype(np.float32)[..., None]
    lo, hi = (-(1 << (nbits - 1)), (1 << (nbits - 1)) - 1) if signed else (0, (1 << nbits) - 1)
    q = np.clip(np.rint(wb / s + z), lo, hi)
    data = q.astype(np.int8 if signed else np.uint8).reshape(wb.shape[0], -1)
    return ShiftScale(data, scale, offset, nbits, signed)


# GPTQ's damping: a fraction of the Hessian's mean diagonal added to it, so that inputs the
# calibration text never excites keep a finite inverse (Frantar et al. use 1%).
GPTQ_DAMP = 0.01
# Columns coded between two updates of the columns after them (the paper's lazy batch).
# One quantization block: the rank-1 updates stay inside the block being coded and the rest
# is one GEMM per block; the same codes as the paper's 128, 1.4-2x faster on SmolLM2's shapes
# (the elementwise updates, not the GEMM, are what costs).
GPTQ_BATCH = 32
# Bytes of float64 weight rows GPTQ codes at a time (`gptq_affine`).
GPTQ_ROW_BYTES = 64 << 20
# A searched range (`gptq_affine(search_range=True)`): the shrinks of a block's [min, max]
# tried, and the norm of the rounding error they are judged by, as GPTQ's reference
# implementation searches (its `mse` option, which goes on down to 0.2 in steps of 0.01).
RANGE_SHRINKS = np.linspace(1.0, 0.5, 26)
RANGE_NORM = 2.4


def gptq_affine(w: np.ndarray, hessian: np.ndarray, nbits: int, block: int, dtype=np.float16,
                damp: float = GPTQ_DAMP, integer_offset: bool = False, search_range: bool = False,
                act_order: bool = False) -> ShiftScale:
    """Min/max affine codes per block, chosen column by column by GPTQ (Frantar et al., ICLR
    2023): each column's rounding error, divided by its pivot of the inverse Hessian's
    Cholesky factor, is taken off the columns not yet coded, so the layer's output error on
    inputs with second moments `hessian` (E[x x^T], [cols, cols]) is minimised rather than
    the weights' own. A block's scale and offset are fitted (as `affine_blocks` fits them)
    to the error-updated weights when its first column is reached, then rounded to `dtype`
    (the offset to a level with `integer_offset`; over the block's searched range with
    `search_range`, `_searched_parameters`); every error fed back is that of the value the op
    decodes.

    `act_order`: columns are coded by descending H_jj (the inputs with the most energy first,
    while the most columns are left to take their error), with static groups: every block's
    grid is fitted to the weights before any feedback, since a block's columns are no longer
    coded together (GPTQ's reference implementation, `--act-order --static-groups`).
    """
    w = np.asarray(w)
    rows, cols = w.shape
    h = np.array(hessian, np.float64)
    dead = np.diag(h) == 0  # an input that is always zero: its column codes as anything
    h[dead, dead] = 1.0
    h += damp * np.mean(np.diag(h)) * np.eye(cols)
    order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(cols)
    upper = np.linalg.cholesky(np.linalg.inv(h[np.ix_(order, order)])).T  # inv(h) = upper^T upper, in coding order
    data = np.empty((rows, cols), np.uint8)
    scale = np.empty((rows, cols // block), dtype)
    offset = np.empty((rows, cols // block), np.uint8 if integer_offset else dtype)
    fit = _searched_parameters if search_range else _min_max_parameters
    # Rows are coded independently (the feedback runs along a row), so they go through in
    # blocks: a 262k-row head's float64 copy would be 1.3 GB, and each column's update as much again.
    step = max(1, GPTQ_ROW_BYTES // (8 * cols))
    for first in range(0, rows, step):
        rows_here = slice(first, first + step)
        _gptq_rows(w[rows_here], dead, order, upper, nbits, block, dtype, integer_offset, fit, act_order,
                   data[rows_here], scale[rows_here], offset[rows_here])
    return ShiftScale(data, scale, offset, nbits, signed=False)


def _gptq_rows(w: np.ndarray, dead: np.ndarray, order: np.ndarray, upper: np.ndarray, nbits: int, block: int,
               dtype, integer_offset: bool, fit, static_groups: bool,
               data: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> None:
    """`gptq_affine` of some rows of the weight, written into their rows of `data`, `scale`, `offset`."""
    weight = np.array(w, np.float64)  # the feedback sums many small corrections
    weight[:, dead] = 0.0
    cols = weight.shape[1]
    levels = (1 << nbits) - 1
    if static_groups:
        for g in range(cols // block):
            scale[:, g], offset[:, g] = fit(weight[:, g * block:(g + 1) * block], nbits, dtype, integer_offset)
    weight = weight[:, order]
    batch = block * max(1, GPTQ_BATCH // block)
    for start in range(0, cols, batch):
        end = min(start + batch, cols)
        part = weight[:, start:end].copy()
        errors = np.zeros_like(part)
        for j in range(end - start):
            k, column = start + j, order[start + j]  # k-th coded, the weight's own column
            g = column // block
            if not static_groups and column % block == 0:
                scale[:, g], offset[:, g] = fit(part[:, j:j + block], nbits, dtype, integer_offset)
            q, decoded = _to_grid(part[:, j], scale[:, g], offset[:, g], levels, dtype)
            data[:, column] = q
            error = (part[:, j] - decoded) / upper[k, k]
            part[:, j + 1:] -= np.outer(error, upper[k, k + 1:end])
            errors[:, j] = error
        weight[:, end:] -= errors @ upper[start:end, end:]


def _to_grid(values: np.ndarray, scale: np.ndarray, offset: np.ndarray, levels: int, dtype):
    """(codes, decoded values in float64) of `values` on the grid `scale * (q - offset)`: the
    nearest level, and what the op decodes from it (its fp16 arithmetic where `dtype` is fp16)."""
    q = np.clip(np.rint(values / scale.astype(np.float64) + offset), 0, levels)
    return q, shift_scale(q, offset, scale.astype(dtype)).astype(np.float64)


def _min_max_parameters(values: np.ndarray, nbits: int, dtype, integer_offset: bool):
    return _affine_parameters(values.min(axis=1), values.max(axis=1), nbits, dtype, integer_offset)


def _searched_parameters(values: np.ndarray, nbits: int, dtype, integer_offset: bool):
    """Per row of `values` [rows, block], the grid over [p min, p max] for the shrink p of
    RANGE_SHRINKS whose decoded values err least (in RANGE_NORM): a few outliers no longer
    stretch the step of every other weight in the block."""
    lo, hi = values.min(axis=1), values.max(axis=1)
    levels = (1 << nbits) - 1
    best = np.full(len(values), np.inf)
    scale, offset = _affine_parameters(lo, hi, nbits, dtype, integer_offset)
    for shrink in RANGE_SHRINKS:
        s, z = _affine_parameters(lo * shrink, hi * shrink, nbits, dtype, integer_offset)
        _, decoded = _to_grid(values, s[:, None], z[:, None], levels, dtype)
        error = (np.abs(decoded - values) ** RANGE_NORM).sum(axis=1)
        better = error < best
        scale[better], offset[better], best[better] = s[better], z[better], error[better]
    return scale, offset


def kmeans_tiles(w: np.ndarray, nbits: int, tile: tuple[int, int], importance: np.ndarray | None = None,
                 dtype=np.float16, cache: "ResultCache | None" = None) -> Palette:
    """One LUT per tile of `tile` = (rows, columns), by weighted k-means over the tile's values.

    iOS18 `constexpr_lut_to_dense` blocks its LUTs on both axes. (32, all columns) is the
    grouped-channel palette coremltools makes; docs/COMPRESSION.md shows why a LUT that
    spans all columns cannot follow how the weights' range changes along a row, and what
    smaller tiles buy for their fp16 LUTs.

    `cache` (a survey's `coreml.cache.ResultCache`): the centres the Lloyd iterations settle
    on are found there, or stored, by the weight, bits, tile and importance, not by the LUT's
    dtype, which only rounds them afterwards: palette4-int8lut's fp32 LUT then costs the final
    assignment alone where palette4-gc32 has run (Gemma 3, one thread: 52.9 -> 23.9 s). The
    codes are those computed afresh, bit for bit.
    """
    if cache is None:
        return _kmeans_tiles(w, nbits, tile, importance, dtype)[0]
    made = {}

    def make():
        made["palette"], centres = _kmeans_tiles(w, nbits, tile, importance, dtype)
        return {"centres": centres}, {}

    key = content_key("kmeans centres", nbits, list(tile), np.asarray(w, np.float32),
                      "unweighted" if importance is None else np.asarray(importance, np.float64))
    centres = cache.arrays(key, make)[0]["centres"]
    return made["palette"] if made else _kmeans_tiles(w, nbits, tile, importance, dtype, centres)[0]


def _kmeans_tiles(w: np.ndarray, nbits: int, tile: tuple[int, int], importance: np.ndarray | None, dtype,
                  settled: np.ndarray | None = None) -> tuple[Palette, np.ndarray]:
    """(`kmeans_tiles`' palette, the float64 centres of every tile before their rounding to
    `dtype`, [tiles, 2**nbits]); `settled`: those centres, from an earlier run of these tiles,
    taken as they are."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    tr, tc = tile
    gr, gc = rows // tr, cols // tc
    importance = None if importance is None else _broadcast(importance, w)
    indices = np.empty((rows, cols), np.uint8)
    luts = np.empty((gr, gc, 1 << nbits), dtype)
    centres = np.empty((gr * gc, 1 << nbits)) if settled is None else settled  # a cache's map: read only
    # A tile's LUT depends on its own values only, so bands of tile rows go through k-means
    # apart, KMEANS_BLOCK_VALUES values at a time: the same codes in bounded memory (about 80
    # bytes a value of working arrays: 13 GB at once for Gemma 3's 168M-value embedding).
    band = max(1, KMEANS_BLOCK_VALUES // (tr * cols))
    for start in range(0, gr, band):
        lines = slice(start * tr, min(start + band, gr) * tr)
        n = (lines.stop - lines.start) // tr

        def to_tiles(a):
            return a[lines].reshape(n, tr, gc, tc).transpose(0, 2, 1, 3).reshape(n * gc, tr * tc)

        tiles = slice(start * gc, (start + n) * gc)
        flat, band_centres = _kmeans_rows(to_tiles(w), None if importance is None else to_tiles(importance), nbits,
                                          dtype, KMEANS_ITERATIONS, None if settled is None else settled[tiles])
        indices[lines] = flat.reshape(n, gc, tr, tc).transpose(0, 2, 1, 3).reshape(n * tr, cols)
        luts[start:start + n] = band_centres.astype(dtype).reshape(n, gc, -1)
        if settled is None:
            centres[tiles] = band_centres
    return Palette(indices, luts, nbits), centres


def _kmeans_rows(values: np.ndarray, weights: np.ndarray | None, nbits: int, dtype, iterations: int,
                 settled: np.ndarray | None = None):
    """(indices into the LUT, the float64 centres the LUT rounds to `dtype`) of each row of
    `values` by weighted Lloyd iterations; `settled`: each row's centres from an earlier run,
    kept as they are (the indices alone are computed).

    In one dimension a cluster is a run of the sorted values, so each iteration needs only
    the cut points (where the sorted values cross the midpoints between centres) and
    prefix sums of weight and weight x value: O(k log n) per row, not O(n). Centres
    start evenly spaced between each row's minimum and maximum (a start that reaches
    the tails, where the weights that matter most lie); a row stops once its own centres
    settle. The LUT is rounded to `dtype` before the final assignment, so the indices pick
    the nearest entries of the stored LUT.
    """
    if values.dtype != np.float32:
        raise TypeError(f"k-means codes float32 weights (the cut search counts in float32), not {values.dtype}")
    values = values.astype(np.float64)
    weights = np.ones_like(values) if weights is None else np.asarray(weights, np.float64)
    k = 1 << nbits
    order = np.argsort(values, axis=1)
    sorted_v = np.take_along_axis(values, order, axis=1)
    sorted_w = np.take_along_axis(weights, order, axis=1)
    del values, weights
    search = _SortedRows(sorted_v)
    zero = np.zeros((len(sorted_v), 1))
    cum_w = np.hstack([zero, np.cumsum(sorted_w, axis=1)])
    cum_wv = np.hstack([zero, np.cumsum(sorted_w * sorted_v, axis=1)])
    del sorted_w
    lo, hi = sorted_v[:, :1], sorted_v[:, -1:]
    centres = lo + (hi - lo) * (np.arange(k) + 0.5) / k if settled is None else np.asarray(settled, np.float64)
    n = sorted_v.shape[1]
    first, last = np.zeros_like(lo, dtype=np.int64), np.full(lo.shape, n, dtype=np.int64)
    moving = np.ones(len(sorted_v), bool)
    for _ in range(iterations if settled is None else 0):
        mids = (centres[:, 1:] + centres[:, :-1]) / 2
        cuts = np.hstack([first, search.count(mids, "left"), last])
        mass = np.diff(np.take_along_axis(cum_w, cuts, axis=1), axis=1)
        total = np.diff(np.take_along_axis(cum_wv, cuts, axis=1), axis=1)
        moved = np.where(mass > 0, total / np.where(mass > 0, mass, 1), centres)
        moved.sort(axis=1)
        moved[~moving] = centres[~moving]
        moving &= np.abs(moved - centres).max(axis=1) > KMEANS_TOLERANCE * (hi - lo)[:, 0]
        centres = moved
        if not moving.any():
            break
    stored = centres.astype(dtype).astype(np.float64)
    return _nearest_in_sorted(search, order, (stored[:, 1:] + stored[:, :-1]) / 2), centres


def _nearest_in_sorted(search: "_SortedRows", order: np.ndarray, mids: np.ndarray) -> np.ndarray:
    """uint8 codes of each row's values, `np.searchsorted(mids[i], value)` (a value on a midpoint
    takes the lower entry), read off the row's sorted values instead of searching for each: the
    values past a midpoint are those after the count of values at or below it, so a row's codes in
    sorted order are a cumulative count of those cuts, put back in place by `order`. A bisection
    for every value cost 40 % of a palette's k-means."""
    rows, n = order.shape
    cuts = search.count(mids, "right")
    steps = np.zeros((rows, n + 1), np.uint8)
    np.add.at(steps, (np.arange(rows)[:, None], cuts), 1)
    codes = np.empty((rows, n), np.uint8)
    np.put_along_axis(codes, order, np.cumsum(steps[:, :n], axis=1, dtype=np.uint8), axis=1)
    return codes


class _SortedRows:
    """Rows of ascending float32 values, searched for many queries a row at once: `count(queries,
    side)` is `np.searchsorted(row i, queries[i], side)` for every row i.

    One search of one array: each value becomes an order-preserving integer key with its row
    number above it, so the rows lie one after another in a single ascending array. A query, in
    float64, counts the float32 values below (or at or below) it, which are those below its
    float32 ceiling (at or below its float32 floor): no float32 lies between a query and those.
    A row's count comes from its own keys alone, whatever rows it is searched with. A bisection of
    every row at once in numpy (`ascending[rows, middle] < queries`, 16 steps for a 64k-value
    tile) was 12 % of a Gemma 3 survey's time."""

    def __init__(self, ascending: np.ndarray):
        rows, self.n = ascending.shape
        self.offsets = np.arange(rows, dtype=np.int64)[:, None] << 32
        self.keys = (self.offsets | _order_keys(ascending.astype(np.float32))).ravel()

    def count(self, queries: np.ndarray, side: str) -> np.ndarray:
        nearest = queries.astype(np.float32)
        if side == "left":  # the ceiling: v < q exactly when v < ceil(q), for float32 v
            bound = np.where(nearest < queries, np.nextafter(nearest, np.float32(np.inf)), nearest)
        else:  # the floor: v <= q exactly when v <= floor(q)
            bound = np.where(nearest > queries, np.nextafter(nearest, np.float32(-np.inf)), nearest)
        found = np.searchsorted(self.keys, (self.offsets | _order_keys(bound)).ravel(), side=side)
        return found.reshape(queries.shape) - (self.offsets >> 32) * self.n


def _order_keys(x: np.ndarray) -> np.ndarray:
    """int64 keys in [0, 2^32) that order float32 `x` (no NaN) as its values: -0.0 is 0.0."""
    bits = (x + np.float32(0)).view(np.uint32)  # -0.0 + 0.0 is +0.0
    return np.where(bits >> 31, ~bits, bits | np.uint32(1 << 31)).astype(np.int64)


def _broadcast(importance: np.ndarray, w: np.ndarray) -> np.ndarray:
    importance = np.asarray(importance, np.float64)
    return np.broadcast_to(importance if importance.ndim == 2 else importance[None, :], w.shape)
