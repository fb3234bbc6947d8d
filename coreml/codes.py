"""Weight codes computed here in numpy, for the Core ML constexpr ops that decode them.

    code = affine_blocks(w, nbits=4, block=32)         # constexpr_blockwise_shift_scale
    code = kmeans_tiles(w, nbits=4, tile=(32, 32))      # constexpr_lut_to_dense
    code = gptq_affine(w, hessian, nbits=4, block=32)   # the same op, GPTQ-chosen codes
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

KMEANS_ITERATIONS = 40  # past 40, a t(4)-tailed test matrix's error moves by < 0.2%
# Lloyd stops once no centre moves by more than this fraction of the widest group's range:
# far below the fp16 rounding (2**-11 relative) the LUT is stored with.
KMEANS_TOLERANCE = 1e-5


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
        out = self.data.astype(self.scale.dtype)
        if self.offset is not None:
            out = out - np.repeat(self.offset.astype(self.scale.dtype), self.block, axis=1)
        return (out * np.repeat(self.scale, self.block, axis=1)).astype(np.float32)

    def bits(self) -> int:
        """Storage in bits: the codes plus every scale and offset."""
        params = self.scale.size * self.scale.itemsize * 8
        if self.offset is not None:
            params += self.offset.size * (self.offset.itemsize * 8 if self.offset.dtype.kind == "f" else self.nbits)
        return self.data.size * self.nbits + params


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


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(rows, cols // block, block)


def affine_blocks(w: np.ndarray, nbits: int, block: int, dtype=np.float16) -> ShiftScale:
    """Min/max affine codes per block (mlx-lm's `q4 g32` grid): unsigned data, float offset.

    With a float offset the grid's lowest level is the block's minimum and its highest the
    maximum, so a weight that already lies on a per-block affine grid of 2**nbits levels
    (GGUF Q4_1, mlx q4) is carried up to the rounding of scale and offset to `dtype`.
    """
    wb = _blocks(np.asarray(w, np.float32), block)
    lo, hi = wb.min(axis=2), wb.max(axis=2)
    levels = (1 << nbits) - 1
    scale = ((hi - lo) / levels).astype(dtype)
    scale = np.where(scale == 0, np.ones_like(scale), scale)  # a constant block: any scale, offset carries it
    offset = (-lo / scale.astype(np.float32)).astype(dtype)
    return _fit_data(wb, scale, offset, nbits, signed=False)


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


def gptq_affine(w: np.ndarray, hessian: np.ndarray, nbits: int, block: int, dtype=np.float16,
                damp: float = GPTQ_DAMP) -> ShiftScale:
    """Min/max affine codes per block, chosen column by column by GPTQ (Frantar et al., ICLR
    2023): each column's rounding error, divided by its pivot of the inverse Hessian's
    Cholesky factor, is taken off the columns not yet coded, so the layer's output error on
    inputs with second moments `hessian` (E[x x^T], [cols, cols]) is minimised rather than
    the weights' own. A block's scale and offset are fitted (as `affine_blocks` fits them)
    to the error-updated weights when its first column is reached, then rounded to `dtype`;
    every error fed back is that of the value the op decodes.
    """
    w = np.asarray(w)
    rows, cols = w.shape
    h = np.array(hessian, np.float64)
    dead = np.diag(h) == 0  # an input that is always zero: its column codes as anything
    h[dead, dead] = 1.0
    h += damp * np.mean(np.diag(h)) * np.eye(cols)
    upper = np.linalg.cholesky(np.linalg.inv(h)).T  # inv(h) = upper^T upper
    data = np.empty((rows, cols), np.uint8)
    scale = np.empty((rows, cols // block), dtype)
    offset = np.empty((rows, cols // block), dtype)
    # Rows are coded independently (the feedback runs along a row), so they go through in
    # blocks: a 262k-row head's float64 copy would be 1.3 GB, and each column's update as much again.
    step = max(1, GPTQ_ROW_BYTES // (8 * cols))
    for first in range(0, rows, step):
        rows_here = slice(first, first + step)
        _gptq_rows(w[rows_here], dead, upper, nbits, block, dtype, data[rows_here], scale[rows_here], offset[rows_here])
    return ShiftScale(data, scale, offset, nbits, signed=False)


def _gptq_rows(w: np.ndarray, dead: np.ndarray, upper: np.ndarray, nbits: int, block: int, dtype,
               data: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> None:
    """`gptq_affine` of some rows of the weight, written into their rows of `data`, `scale`, `offset`."""
    weight = np.array(w, np.float64)  # the feedback sums many small corrections
    weight[:, dead] = 0.0
    cols = weight.shape[1]
    levels = (1 << nbits) - 1
    batch = block * max(1, GPTQ_BATCH // block)
    for start in range(0, cols, batch):
        end = min(start + batch, cols)
        part = weight[:, start:end].copy()
        errors = np.zeros_like(part)
        for j in range(end - start):
            column = start + j
            if column % block == 0:
                g = column // block
                lo, hi = part[:, j:j + block].min(axis=1), part[:, j:j + block].max(axis=1)
                scale[:, g] = ((hi - lo) / levels).astype(dtype)
                scale[scale[:, g] == 0, g] = 1
                offset[:, g] = (-lo / scale[:, g].astype(np.float32)).astype(dtype)
            q = np.clip(np.rint(part[:, j] / scale[:, g].astype(np.float64) + offset[:, g]), 0, levels)
            data[:, column] = q
            decoded = ((q.astype(dtype) - offset[:, g]) * scale[:, g]).astype(np.float64)  # as `decode` computes
            error = (part[:, j] - decoded) / upper[column, column]
            part[:, j + 1:] -= np.outer(error, upper[column, column + 1:end])
            errors[:, j] = error
        weight[:, end:] -= errors @ upper[start:end, end:]


def kmeans_tiles(w: np.ndarray, nbits: int, tile: tuple[int, int], importance: np.ndarray | None = None,
                 dtype=np.float16) -> Palette:
    """One LUT per tile of `tile` = (rows, columns), by weighted k-means over the tile's values.

    iOS18 `constexpr_lut_to_dense` blocks its LUTs on both axes. (32, all columns) is the
    grouped-channel palette coremltools makes; docs/COMPRESSION.md shows why a LUT that
    spans all columns cannot follow how the weights' range changes along a row, and what
    smaller tiles buy for their fp16 LUTs.
    """
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    tr, tc = tile
    gr, gc = rows // tr, cols // tc

    def to_tiles(a):
        return a.reshape(gr, tr, gc, tc).transpose(0, 2, 1, 3).reshape(gr * gc, tr * tc)

    weights = None if importance is None else to_tiles(_broadcast(importance, w))
    flat = _kmeans_rows(to_tiles(w), nbits, 1, weights, dtype, KMEANS_ITERATIONS)
    indices = flat.indices.reshape(gr, gc, tr, tc).transpose(0, 2, 1, 3).reshape(rows, cols)
    return Palette(np.ascontiguousarray(indices), flat.lut.reshape(gr, gc, 1 << nbits), nbits)


def _kmeans_rows(w: np.ndarray, nbits: int, group: int, importance: np.ndarray | None,
                 dtype, iterations: int) -> Palette:
    """Weighted 1-D k-means (Lloyd) per group of `group` rows, all groups at once.

    In one dimension a cluster is a run of the sorted values, so each iteration needs only
    the cut points (where the sorted values cross the midpoints between centres) and
    prefix sums of weight and weight x value: O(k log n) per group, not O(n). Centres
    start evenly spaced between each group's minimum and maximum (a start that reaches
    the tails, where the weights that matter most lie). The LUT is rounded to `dtype`
    before the final assignment, so the indices pick the nearest entries of the stored LUT.
    """
    w = np.asarray(w, np.float32)
    rows, cols = w.shape
    k = 1 << nbits
    values = w.reshape(rows // group, group * cols).astype(np.float64)
    weights = np.ones_like(values) if importance is None else _broadcast(importance, w).reshape(values.shape)
    order = np.argsort(values, axis=1)
    sorted_v = np.take_along_axis(values, order, axis=1)
    sorted_w = np.take_along_axis(weights, order, axis=1)
    zero = np.zeros((len(values), 1))
    cum_w = np.hstack([zero, np.cumsum(sorted_w, axis=1)])
    cum_wv = np.hstack([zero, np.cumsum(sorted_w * sorted_v, axis=1)])
    lo, hi = sorted_v[:, :1], sorted_v[:, -1:]
    centres = lo + (hi - lo) * (np.arange(k) + 0.5) / k
    # Centres are weighted means of a row's values, so they stay within its [lo, hi]: one
    # offset per row, fixed for all iterations, lays every row out on one sorted axis.
    shift = np.arange(len(values))[:, None] * 4 * (np.abs(values).max() + 1.0)
    flat = (sorted_v + shift).ravel()
    n = values.shape[1]
    first, last = np.zeros_like(lo, dtype=np.int64), np.full(lo.shape, n, dtype=np.int64)
    starts = np.arange(len(values))[:, None] * n
    for _ in range(iterations):
        mids = (centres[:, 1:] + centres[:, :-1]) / 2
        cuts = np.hstack([first, np.searchsorted(flat, (mids + shift).ravel()).reshape(mids.shape) - starts, last])
        mass = np.diff(np.take_along_axis(cum_w, cuts, axis=1), axis=1)
        total = np.diff(np.take_along_axis(cum_wv, cuts, axis=1), axis=1)
        moved = np.where(mass > 0, total / np.where(mass > 0, mass, 1), centres)
        moved.sort(axis=1)
        settled = np.abs(moved - centres).max() <= KMEANS_TOLERANCE * (hi - lo).max()
        centres = moved
        if settled:
            break
    lut = centres.astype(dtype)
    stored = lut.astype(np.float64)
    mids = (stored[:, 1:] + stored[:, :-1]) / 2
    nearest = np.searchsorted((mids + shift).ravel(), (values + shift).ravel()).reshape(values.shape)
    indices = (nearest - np.arange(len(values))[:, None] * (k - 1)).reshape(rows, cols).astype(np.uint8)
    return Palette(indices, lut[:, None, :], nbits)


def _broadcast(importance: np.ndarray, w: np.ndarray) -> np.ndarray:
    importance = np.asarray(importance, np.float64)
    return np.broadcast_to(importance if importance.ndim == 2 else importance[None, :], w.shape)
