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

from collections.abc import Iterator
from dataclasses import dataclass, replace

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
    out = None
    for start, stop in row_blocks(rows, unit, bytes_per_row):
        block = np.asarray(decode(*block_args(start, stop)))
        if out is None:
            out = np.empty((rows, *block.shape[1:]), block.dtype)
        out[start:stop] = block
    return out


def row_blocks(rows: int, unit: int, bytes_per_row: int) -> Iterator[tuple[int, int]]:
    """[start, stop) over `rows` in blocks of whole `unit`s of rows, each about
    `DECODE_BLOCK_BYTES` of temporaries at `bytes_per_row`."""
    step = max(1, DECODE_BLOCK_BYTES // max(1, unit * bytes_per_row)) * unit
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


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
    """`lut[i // rows_per_group, j // cols_per_group][indices[i, j]]` (iOS18 grouped LUTs), times
    `row_scale[i]` where there is one (coremltools' palette with per-channel scale: an iOS18
    `constexpr_blockwise_shift_scale` of the LUT's output, its product rounded to the LUT's dtype)."""

    indices: np.ndarray  # [rows, cols] uint8
    lut: np.ndarray  # [row groups, column groups, 2**nbits] fp16 (or fp32)
    nbits: int
    row_scale: np.ndarray | None = None  # [rows, 1], the LUT's dtype

    def decode(self) -> np.ndarray:
        rows, cols = self.indices.shape
        i = (np.arange(rows) // (rows // self.lut.shape[0]))[:, None]
        j = (np.arange(cols) // (cols // self.lut.shape[1]))[None, :]
        return scaled_entries(self.lut[i, j, self.indices], self.row_scale, self.lut.dtype).astype(np.float32)

    def bits(self) -> int:
        return (self.indices.size * self.nbits + self.lut.size * self.lut.itemsize * 8
                + (0 if self.row_scale is None else self.row_scale.size * self.row_scale.itemsize * 8))


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


def code_arrays(code: ShiftScale | HotRows | Palette) -> tuple[dict[str, np.ndarray], dict]:
    """`code` as named arrays and a JSON record (`code_from_arrays` gives it back), for `coreml.cache`."""
    if isinstance(code, Palette):
        scaled = {} if code.row_scale is None else {"row_scale": code.row_scale}
        return {"indices": code.indices, "lut": code.lut, **scaled}, {"kind": "palette", "nbits": code.nbits}
    if isinstance(code, HotRows):
        parts = {"table": code_arrays(code.table), "residual": code_arrays(code.residual)}
        arrays = {f"{part}.{name}": a for part, (named, _) in parts.items() for name, a in named.items()}
        return {**arrays, "slot": code.slot}, {"kind": "hot_rows", **{part: r for part, (_, r) in parts.items()}}
    arrays = {"data": code.data, "scale": code.scale, **({"offset": code.offset} if code.offset is not None else {})}
    return arrays, {"kind": "shift_scale", "nbits": code.nbits, "signed": code.signed}


def code_from_arrays(arrays: dict[str, np.ndarray], record: dict) -> ShiftScale | HotRows | Palette:
    if record["kind"] == "palette":
        return Palette(arrays["indices"], arrays["lut"], record["nbits"], arrays.get("row_scale"))
    if record["kind"] == "hot_rows":
        parts = {part: code_from_arrays({k.split(".", 1)[1]: a for k, a in arrays.items() if k.startswith(f"{part}.")},
                                        record[part]) for part in ("table", "residual")}
        return HotRows(parts["table"], parts["residual"], arrays["slot"])
    return ShiftScale(arrays["data"], arrays["scale"], arrays.get("offset"), record["nbits"], record["signed"])


def decoded_blocks(code) -> Iterator[np.ndarray]:
    """`code.decode()` (float32) a block of whole rows at a time, each block's rows the whole
    decoding's to the bit (each row decodes from its own parameters alone), its temporaries one
    block's (`DECODE_BLOCK_BYTES`): a ShiftScale's rows, a Palette's whole groups of rows. Another
    code decodes at once; a plain array is its own decoding."""
    if isinstance(code, ShiftScale):
        (rows, cols), unit = code.data.shape, 1
        cut = lambda start, stop: replace(code, data=code.data[start:stop], scale=code.scale[start:stop],
                                          offset=None if code.offset is None else code.offset[start:stop])
    elif isinstance(code, Palette):
        rows, cols = code.indices.shape
        unit = rows // code.lut.shape[0]
        cut = lambda start, stop: replace(code, indices=code.indices[start:stop], lut=code.lut[start // unit:stop // unit],
                                          row_scale=None if code.row_scale is None else code.row_scale[start:stop])
    else:
        yield code.decode() if hasattr(code, "decode") else np.asarray(code, np.float32)
        return
    for start, stop in row_blocks(rows, unit, 5 * 4 * cols):
        yield cut(start, stop).decode()


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
    factor = GptqFactor.of(hessian, damp, act_order)
    data = np.empty((rows, cols), np.uint8)
    scale = np.empty((rows, cols // block), dtype)
    offset = np.empty((rows, cols // block), np.uint8 if integer_offset else dtype)
    fit = _searched_parameters if search_range else _min_max_parameters
    levels = (1 << nbits) - 1
    for rows_here in factor.row_blocks(rows, cols):
        weight = factor.live(w[rows_here])
        data_here, scale_here, offset_here = data[rows_here], scale[rows_here], offset[rows_here]
        if act_order:
            for g in range(cols // block):
                scale_here[:, g], offset_here[:, g] = fit(weight[:, g * block:(g + 1) * block], nbits, dtype,
                                                          integer_offset)

        def code_column(column: int, pending: np.ndarray) -> np.ndarray:
            g = column // block
            if not act_order and column % block == 0:
                scale_here[:, g], offset_here[:, g] = fit(pending[:, :block], nbits, dtype, integer_offset)
            data_here[:, column], decoded = _to_grid(pending[:, 0], scale_here[:, g], offset_here[:, g], levels, dtype)
            return decoded

        factor.feedback(weight, code_column, block * max(1, GPTQ_BATCH // block))
    return ShiftScale(data, scale, offset, nbits, signed=False)


@dataclass(frozen=True)
class GptqFactor:
    """What GPTQ's column loop needs of a Hessian, whatever grid it codes to: the damped
    Hessian, the inputs that are always zero, the coding order, and the upper Cholesky factor
    of the damped inverse in that order (inv(h) = upper^T upper)."""

    hessian: np.ndarray  # float64 [cols, cols], damped, a dead input's diagonal 1
    dead: np.ndarray  # bool [cols]: an input that is always zero, whose column codes as anything
    order: np.ndarray  # columns in coding order
    upper: np.ndarray

    @classmethod
    def of(cls, hessian: np.ndarray, damp: float = GPTQ_DAMP, act_order: bool = False) -> "GptqFactor":
        h = np.array(hessian, np.float64)
        cols = len(h)
        dead = np.diag(h) == 0
        h[dead, dead] = 1.0
        h += damp * np.mean(np.diag(h)) * np.eye(cols)
        order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(cols)
        return cls(h, dead, order, np.linalg.cholesky(np.linalg.inv(h[np.ix_(order, order)])).T)

    def row_blocks(self, rows: int, cols: int, unit: int = 1):
        """Slices of whole `unit`s of rows, GPTQ_ROW_BYTES of float64 weight at a time: rows are
        coded independently (the feedback runs along a row), and a 262k-row head's float64 copy
        would be 1.3 GB, each column's update as much again."""
        step = max(1, GPTQ_ROW_BYTES // (8 * cols * unit)) * unit
        return [slice(first, min(rows, first + step)) for first in range(0, rows, step)]

    def live(self, w: np.ndarray) -> np.ndarray:
        """Rows of the weight as GPTQ updates them: float64 (the feedback sums many small
        corrections), the dead inputs' columns zero."""
        weight = np.array(w, np.float64)
        weight[:, self.dead] = 0.0
        return weight

    def feedback(self, weight: np.ndarray, code_column, batch: int) -> None:
        """GPTQ's loop over `weight`'s columns (a `live` copy, left as it is) in coding order:
        `code_column(column, pending)` codes the weight's own column `column` from `pending`, the
        error-updated values of the batch's columns from that one on in coding order, and returns
        what the op decodes for it; the error, over its pivot, is taken off the columns after it
        (rank-1 within the batch of `batch` columns, one GEMM for the rest)."""
        order, upper = self.order, self.upper
        weight = weight[:, order]
        cols = weight.shape[1]
        for start in range(0, cols, batch):
            end = min(start + batch, cols)
            part = weight[:, start:end].copy()
            errors = np.zeros_like(part)
            for j in range(end - start):
                k = start + j
                error = (part[:, j] - code_column(order[k], part[:, j:])) / upper[k, k]
                part[:, j + 1:] -= np.outer(error, upper[k, k + 1:end])
                errors[:, j] = error
            weight[:, end:] -= errors @ upper[start:end, end:]

    def output_errors(self, weight: np.ndarray, decoded: np.ndarray) -> np.ndarray:
        """Each row's (w - w_hat) H (w - w_hat)^T, the output error GPTQ minimises, on the damped H."""
        e = weight - decoded
        return np.einsum("ij,ij->i", e @ self.hessian, e)


# A palette's LUT refit (`gptq_palette`): preconditioned conjugate-gradient steps on each band's
# least squares. Plain CG needed 32 steps: in float32 products it loses its directions'
# conjugacy, and on rows of ranges 30x apart (a row-scaled palette, or rows as unequal as a
# table's) 16 steps stopped 4.6e-5 relative above the least squares' error. Entries whose weights
# read inputs of unequal energy converge at unequal rates, which Jacobi's preconditioner evens
# out: on correlated inputs with channels 100x apart (as real layers' are), 16 preconditioned
# steps ended 6e-5 (6 bits in 16 rows) and 5e-4 (4 bits in 32 x 32 tiles) relative above the
# optimum, where 32 plain steps ended 7e-4 and 1.6e-3 above it; tests/test_palette_gptq.py holds
# the optimum to 48 x 2^-24, which 16 such steps meet and 12 do not. The bands step together
# (one product with H for all), so a step saved is a product saved: a 1536 x 576 weight's 6-bit
# palette took 3.9 s where 32 plain steps took 5.1-6.8 s, at 0.1% less output error.
PALETTE_REFIT_STEPS = 16


def gptq_palette(w: np.ndarray, hessian: np.ndarray, nbits: int, group: tuple[int, int], dtype=np.float16,
                 damp: float = GPTQ_DAMP, act_order: bool = True, rounds: int = 2, refit: bool = True,
                 row_scale: bool = False) -> Palette:
    """One LUT of 2**nbits entries per `group` = (rows, columns) of the weight, its codes chosen
    by GPTQ with the LUT as the grid (`GptqFactor.feedback`), so the layer's output error on
    inputs with second moments `hessian` is minimised rather than the weights' own.

    Each band of `group[0]` rows is coded on its own (its LUTs and codes depend on its rows
    alone): the LUTs start as k-means weighted by H_jj (`kmeans_tiles`, SKM's diagonal); then,
    `rounds` times, GPTQ assigns every weight an entry of the stored LUTs, column by column
    with the error feedback, and the LUTs' entries are refitted to that assignment by least
    squares on the full H (`_refit_luts`; not with `refit` False), rounded to `dtype`. Of every
    (LUT, codes) pair made on the way, the k-means palette's nearest codes included, each band
    keeps the one of least output error (w - w_hat) H (w - w_hat)^T on its rows: a refit cannot
    undo what GPTQ bought, and the result never errs more than the weighted k-means palette on
    any band.
    `act_order`: columns coded by descending H_jj (the LUT is fitted before any feedback, so
    the order costs nothing in fit).
    `row_scale`: each row's entries are scaled by its own max |w| (`row_scales`), so rows of
    different ranges share one LUT of the normalised values; the k-means start weighs each
    normalised value by H_jj times its row's scale squared, and GPTQ and the refit code to the
    scaled entries, the output error of the weights as the package decodes them."""
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    k = 1 << nbits
    factor = GptqFactor.of(hessian, damp, act_order)
    importance = np.diag(factor.hessian)
    indices = np.empty((rows, cols), np.uint8)
    luts = np.empty((rows // group[0], cols // group[1], k), dtype)
    scales = np.empty((rows, 1), dtype) if row_scale else None
    for rows_here in factor.row_blocks(rows, cols, group[0]):
        weight = factor.live(w[rows_here])
        palette = kmeans_tiles(weight.astype(np.float32), nbits, group, importance, dtype, row_scale=row_scale)
        scale = palette.row_scale
        best, best_errors = palette, _band_errors(factor, weight, palette, group[0])
        for _ in range(rounds):
            assigned = Palette(_palette_feedback(factor, weight, palette.lut, group, scale), palette.lut, nbits, scale)
            if not refit:
                best, best_errors = _better(factor, weight, group[0], best, best_errors, assigned)
                break  # assigned to the same LUTs again, the same codes
            refitted = Palette(assigned.indices, _refit_luts(factor.hessian, weight, assigned, group).astype(dtype),
                               nbits, scale)
            for made in (assigned, refitted):
                best, best_errors = _better(factor, weight, group[0], best, best_errors, made)
            palette = refitted  # the next round assigns to the refitted LUTs
        indices[rows_here], luts[rows_here.start // group[0]:rows_here.stop // group[0]] = best.indices, best.lut
        if scales is not None:
            scales[rows_here] = scale
    return Palette(indices, luts, nbits, scales)


def row_scales(w: np.ndarray, dtype) -> np.ndarray:
    """[rows, 1] each row's max |w| in `dtype`, 1 for a row of zeros (coremltools' per-channel
    scale of a palette, `enable_per_channel_scale`)."""
    scale = np.abs(np.asarray(w)).max(axis=1, keepdims=True).astype(dtype)
    scale[scale == 0] = 1
    return scale


def scaled_entries(entries: np.ndarray, scale: np.ndarray | None, dtype) -> np.ndarray:
    """`entries` (each row's LUT entries, [rows, ...]) times the row's `scale`, in `dtype`, as the
    package decodes them: the product of two `dtype` values is exact in float32, then rounded
    once to `dtype`, as `constexpr_blockwise_shift_scale` multiplies in the scale's dtype."""
    if scale is None:
        return entries
    shape = scale.shape + (1,) * (entries.ndim - scale.ndim)
    return (entries.astype(np.float32) * scale.astype(np.float32).reshape(shape)).astype(dtype)


def _better(factor: GptqFactor, weight: np.ndarray, band: int, best: Palette, best_errors: np.ndarray,
            made: Palette) -> tuple[Palette, np.ndarray]:
    """Per band of `band` rows, `made` where it errs less than `best`, and the errors kept."""
    errors = _band_errors(factor, weight, made, band)
    better = errors < best_errors
    return (Palette(np.where(np.repeat(better, band)[:, None], made.indices, best.indices),
                    np.where(better[:, None, None], made.lut, best.lut), made.nbits, made.row_scale),
            np.minimum(errors, best_errors))


def _band_errors(factor: GptqFactor, weight: np.ndarray, palette: Palette, band: int) -> np.ndarray:
    """Each band of `band` rows' output error under `palette` (a code of those rows)."""
    return factor.output_errors(weight, palette.decode().astype(np.float64)).reshape(-1, band).sum(axis=1)


def _palette_feedback(factor: GptqFactor, weight: np.ndarray, lut: np.ndarray, group: tuple[int, int],
                      scale: np.ndarray | None = None) -> np.ndarray:
    """uint8 codes of `weight`'s rows into `lut` (their bands' LUTs, [bands, column groups, entries],
    each row's entries times its `scale` where there is one) by GPTQ: each error-updated value
    takes its LUT's nearest entry (the lowest on a tie)."""
    rows = len(weight)
    band = np.arange(rows) // group[0]
    entries = scaled_entries(lut[band], scale, lut.dtype).astype(np.float64)  # [rows, column groups, entries]
    indices = np.empty(weight.shape, np.uint8)

    def code_column(column: int, pending: np.ndarray) -> np.ndarray:
        here = entries[:, column // group[1]]
        q = np.abs(pending[:, :1] - here).argmin(axis=1)
        indices[:, column] = q
        return here[np.arange(rows), q]

    factor.feedback(weight, code_column, GPTQ_BATCH)
    return indices


def _refit_luts(hessian: np.ndarray, weight: np.ndarray, palette: Palette, group: tuple[int, int]) -> np.ndarray:
    """float64 LUTs of least output error tr((W - W_hat) H (W - W_hat)^T) for `palette`'s codes,
    from its LUTs, by PALETTE_REFIT_STEPS preconditioned conjugate-gradient steps on each band's
    normal equations.

    W_hat is linear in the entries: W_hat = A(c), each weight reading the entry its code names
    (times its row's scale, where the palette has them: the product's rounding is left out of
    the fit, and the kept palette is chosen on its output error as decoded), and the gradient
    A^T((W - A(c)) H) sums (W - W_hat) H over the weights that read each entry.
    Bands share no entry, so each is its own system, solved side by side (step sizes per band);
    an entry no weight reads has a zero row and stays as it is. Each step costs one product
    with H, as GPTQ's own updates do; forming each band's normal matrix would cost the
    columns squared times the entries per row over the band's rows."""
    rows, cols = weight.shape
    bands, column_groups, k = palette.lut.shape
    slot = (((np.arange(rows) // group[0])[:, None] * column_groups + np.arange(cols) // group[1]) * k
            + palette.indices).ravel()

    scale = None if palette.row_scale is None else palette.row_scale.astype(np.float64)

    def normal(lut_flat: np.ndarray, target: np.ndarray | None = None) -> np.ndarray:
        """A^T((target - A(c)) H) per band, or A^T(A(c) H) without a target."""
        product = lut_flat.ravel()[slot].reshape(rows, cols)
        if scale is not None:
            product = product * scale
        if target is not None:
            product = target - product
        gradient = product.astype(np.float32) @ hessian
        if scale is not None:
            gradient = gradient * scale
        return np.bincount(slot, gradient.ravel(), bands * column_groups * k).reshape(bands, -1)

    # Jacobi's preconditioner: the normal matrix's diagonal without its cross terms, each entry's
    # sum of scale^2 H_jj over the weights that read it. Entries span H_jj's range (channels 1e3
    # apart in a real layer's inputs) times their rows' scales squared, which plain CG pays for
    # in steps; an entry no weight reads keeps a zero residual and a zero inverse.
    squares = np.ones((rows, 1)) if scale is None else scale * scale
    diagonal = np.bincount(slot, (squares * np.diag(hessian)[None, :]).ravel(), bands * column_groups * k)
    inverse = np.divide(1.0, diagonal, out=np.zeros_like(diagonal), where=diagonal > 0).reshape(bands, -1)
    # The products in float32: twice as fast, and their rounding (2^-24 relative a term) is far
    # below the fp16 rounding (2^-11) of the entries they find.
    hessian = hessian.astype(np.float32)
    lut = palette.lut.astype(np.float64).reshape(bands, -1)
    residual = normal(lut, weight)
    preconditioned = inverse * residual
    direction = preconditioned.copy()
    norm = (residual * preconditioned).sum(axis=1)
    for _ in range(PALETTE_REFIT_STEPS):
        curved = normal(direction)
        curvature = (direction * curved).sum(axis=1)
        step = np.divide(norm, curvature, out=np.zeros_like(norm), where=curvature > 0)
        lut += step[:, None] * direction
        residual -= step[:, None] * curved
        preconditioned = inverse * residual
        new_norm = (residual * preconditioned).sum(axis=1)
        direction = (preconditioned + np.divide(new_norm, norm, out=np.zeros_like(norm), where=norm > 0)[:, None]
                     * direction)
        norm = new_norm
    return lut.reshape(palette.lut.shape)



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
                 dtype=np.float16, cache: "ResultCache | None" = None, row_scale: bool = False) -> Palette:
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

    `row_scale`: the LUTs are of the rows divided by their scales (`row_scales`), each value's
    importance times its row's scale squared (its error as decoded).
    """
    if row_scale:
        scale = row_scales(w, dtype)
        s = scale.astype(np.float64)
        weighted = None if importance is None else _broadcast(importance, w) * s * s
        normalised = (np.asarray(w, np.float64) / s).astype(np.float32)
        return replace(kmeans_tiles(normalised, nbits, tile, weighted, dtype, cache), row_scale=scale)
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
