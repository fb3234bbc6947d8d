"""CMF weight matrices onto MLX quantized kernels: one table of handlers keyed by CMF dtype.

Every handler turns the payload planes of one 2-D tensor (`DType.parts`, zero-copy views
over the mmap) into a `Linear`: row blocks in MLX's affine layout (uint32 words, element j
at bits j*b.., one scale and bias per group of 32, `w = code * scale + bias`), plus the
few extras some dtypes need (a column field folded into the activations, an output
permutation, a sparse overlay). The weights stay packed; nothing is expanded to float32
except where a kernel cannot take the tensor, and the load report names each such tensor.

Each handler is exact: its effective weights (`dense`) are the CMF decoder's output, bit
for bit where the arithmetic allows it. The exceptions are the ladder dtypes q4tp/q2tp,
whose float32 rung times a code is rounded twice by `code * scale + bias` instead of once
by `(code - k) * scale` (a relative 2^-20 at most), and overlay deltas (q1s/q1t) whose
`value - base` does not fit float32.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from pipeline.ground.cmf import CmfFile, DType
from pipeline.ground.cmf.dtypes import GROUP, ladder, q2tp_scales, tile_rungs, vbit_row_bytes
from pipeline.ground.errors import UnsupportedModel

Shape = tuple[int, int]

DENSE_DTYPES = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Packed:
    """Rows in MLX's affine layout. Scales and biases are float32 like the activations, one
    per 32 weights even where a row shares one scale (q8_row): resident bytes are about 1.33x
    (q4) and 1.25x (q8) the CMF payload, bought for speed. On SmolLM2, float16 scales decode
    6-20% slower and prefill 2x slower; group 64/128 for q8_row saves 11% but MLX's CPU
    kernel runs its matmuls 8-16% slower (1536x576 and the 49152x576 head)."""

    w: mx.array
    scales: mx.array
    biases: mx.array
    bits: int

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.scales.nbytes + self.biases.nbytes


@dataclass(frozen=True)
class Sparse:
    """Overlay entries: the weight at (rows[i], cols[i]) is the base value plus delta[i].

    `row_ptr` (host) indexes the entries by row, sorted, for embedding lookups."""

    rows: mx.array
    cols: mx.array
    delta: mx.array
    row_ptr: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.cols.nbytes + self.delta.nbytes


@dataclass(frozen=True)
class Linear:
    """One [out, in] weight matrix as MLX runs it: `y = x @ W.T`.

    `blocks` hold consecutive rows of a row permutation of W (`order[i]` = position of row
    i among the concatenated blocks; None = identity). `col`/`row` (q8_2f) scale the inputs
    before and the outputs after the matmul. `fallback` says why a tensor is dense."""

    dtype: str
    shape: Shape
    blocks: tuple[Packed | mx.array, ...]
    order: mx.array | None = None
    col: mx.array | None = None
    row: mx.array | None = None
    sparse: Sparse | None = None
    fallback: str | None = None
    bias: mx.array | None = None

    @property
    def nbytes(self) -> int:
        extras = [a for a in (self.order, self.col, self.row, self.bias) if a is not None]
        total = sum(b.nbytes for b in self.blocks) + sum(a.nbytes for a in extras)
        return total + (self.sparse.nbytes if self.sparse is not None else 0)


# ---------------------------------------------------------------- building blocks


def _packed(codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> Packed:
    """codes: the little-endian bit streams of the rows, bytes in row order; scales [rows, in/32]."""
    rows = scales.shape[0]
    return Packed(
        mx.array(np.ascontiguousarray(codes).reshape(rows, -1).view(np.uint32)),
        mx.array(scales.astype(np.float32)),
        mx.array(biases.astype(np.float32)),
        bits,
    )


def _row_groups(scales: np.ndarray, rows: int) -> np.ndarray:
    return np.asarray(scales, dtype=np.float32).reshape(rows, -1)


def _sparse(rows: np.ndarray, cols: np.ndarray, delta: np.ndarray, shape: Shape) -> Sparse:
    """Sorted by row; a position listed twice keeps its last entry, as the decoders' assignment does."""
    n_rows, n_cols = shape
    flat = rows.astype(np.int64) * n_cols + cols
    last = flat.size - 1 - np.unique(flat[::-1], return_index=True)[1]
    keep = np.sort(last)
    keep = keep[np.argsort(rows[keep], kind="stable")]
    rows, cols, delta = rows[keep], cols[keep], delta[keep]
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n_rows))])
    return Sparse(
        mx.array(rows.astype(np.int32)), mx.array(cols.astype(np.int32)), mx.array(delta.astype(np.float32)), row_ptr
    )


# ---------------------------------------------------------------- handlers, one per dtype


def _dense(p, shape, decode):
    return Linear("", shape, (mx.array(decode()),))


def _q4(p, shape, decode):
    """q4_block / q4_tiled: nibbles are already MLX's 4-bit order; w = q*s - 8s."""
    out, _ = shape
    s = _row_groups(p["scales"], out)
    return Linear("", shape, (_packed(p["nibbles"], s, -8 * s, 4),))


def _q4tp(p, shape, decode):
    out, _ = shape
    gpr = p["nibbles"].shape[1]
    s = np.take_along_axis(ladder(p["lo"], p["step"]), tile_rungs(p["codes"], gpr).astype(np.intp), axis=1)
    return Linear("", shape, (_packed(p["nibbles"], s, -8 * s, 4),))


def _q2tp(p, shape, decode):
    """2-bit fields are LSB-first like MLX's; rung 0 gives scale 0, an exactly-zero group."""
    gpr = p["plane"].shape[1]
    s = q2tp_scales(ladder(p["lo"], p["step"]), tile_rungs(p["codes"], gpr)).astype(np.float32)
    return Linear("", shape, (_packed(p["plane"], s, np.float32(-1.5) * s, 2),))


def _unsigned(q: np.ndarray) -> np.ndarray:
    """int8 -> uint8 code q + 128 (flipping the sign bit), bias -128 * scale undoes it."""
    return q.view(np.uint8) ^ np.uint8(0x80)


def _q8_row(p, shape, decode):
    out, in_ = shape
    s = np.repeat(_row_groups(p["scale"], out), in_ // GROUP, axis=1)
    return Linear("", shape, (_packed(_unsigned(p["q"]), s, -128 * s, 8),))


def _q8_2f(p, shape, decode):
    """W = row ⊙ Q ⊙ col: Q runs as exact integers, col scales x before and row scales y after."""
    out, in_ = shape
    ones = np.ones((out, in_ // GROUP), np.float32)
    return Linear(
        "",
        shape,
        (_packed(_unsigned(p["q"]), ones, -128 * ones, 8),),
        col=mx.array(p["col"].astype(np.float32)),
        row=mx.array(p["row"].astype(np.float32)),
    )


def _msb_to_lsb_codes(rows_bytes: np.ndarray, bits: int) -> np.ndarray:
    """Big-endian (MSB-first) b-bit code streams -> MLX's LSB-first streams, bytes [rows, in*b/8]."""
    n = rows_bytes.shape[0]
    stream = np.unpackbits(rows_bytes, axis=1, bitorder="big").reshape(n, -1, bits)
    return np.packbits(stream[:, :, ::-1].reshape(n, -1), axis=1, bitorder="little")


def _vbit(p, shape, decode):
    """Rows bucketed by width (3/4/5/6/8 are native), one block per width, outputs un-permuted."""
    out, in_ = shape
    bits = np.asarray(p["bits"])
    starts = np.concatenate([[0], np.cumsum(vbit_row_bytes(bits, in_))[:-1]])
    blocks, members = [], []
    for b in np.unique(bits):
        b = int(b)
        sel = np.flatnonzero(bits == b)
        raw = p["packed"][starts[sel][:, None] + np.arange(in_ * b // 8)]
        s = _row_groups(p["scales"][sel], sel.size)
        blocks.append(_packed(_msb_to_lsb_codes(raw, b), s, -float(2 ** (b - 1) - 1) * s, b))
        members.append(sel)
    position = np.argsort(np.concatenate(members)).astype(np.int32)
    identity = np.array_equal(position, np.arange(out))
    return Linear("", shape, tuple(blocks), order=None if identity else mx.array(position))


def _q1(p, shape, decode):
    """bit ? +s : -s is 1-bit affine with scale 2s and bias -s."""
    out, _ = shape
    s = _row_groups(p["scales"], out)
    return Linear("", shape, (_packed(p["signs"], 2 * s, -s, 1),))


def _q1s(p, shape, decode):
    out, in_ = shape
    lin = _q1(p, shape, decode)
    index = p["index"].astype(np.int64)
    rows, cols = np.divmod(index, in_)
    sign = (p["signs"].reshape(-1)[index // 8] >> (index % 8).astype(np.uint8)) & 1
    base = np.where(sign == 1, 1, -1) * p["scales"].astype(np.float32)[index // GROUP]
    delta = p["value"].astype(np.float32) - base
    return Linear("", shape, lin.blocks, sparse=_sparse(rows, cols, delta, shape))


# byte -> its five base-3 codes remapped to MLX 2-bit codes with scale s, bias -s:
# base-3 0 (zero) -> 1, 1 (+s) -> 2, 2 (-s) -> 0.
_TERN_TO_2BIT = np.array([1, 2, 0], np.uint8)[(np.arange(256)[:, None] // 3 ** np.arange(5)) % 3]


def _q1t(p, shape, decode):
    out, in_ = shape
    codes = _TERN_TO_2BIT[p["codes"]].reshape(-1, 35)[:, :GROUP].reshape(out, in_ // 4, 4)
    plane = codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)
    s = _row_groups(p["scales"], out)
    rows = np.repeat(np.arange(out), np.diff(p["row_ptr"].astype(np.int64)))
    cols = p["col"].astype(np.int64)
    base = (codes.reshape(out, in_)[rows, cols].astype(np.float32) - 1) * s[rows, cols // GROUP]
    delta = p["value"].astype(np.float32) - base
    return Linear("", shape, (_packed(plane, s, -s, 2),), sparse=_sparse(rows, cols, delta, shape))


Handler = Callable[[dict, Shape, Callable[[], np.ndarray]], Linear]

HANDLERS: dict[str, Handler] = {
    "f32": _dense,
    "f16": _dense,
    "bf16": _dense,
    "q8_row": _q8_row,
    "q8_2f": _q8_2f,
    "q4_block": _q4,
    "q4_tiled": _q4,
    "q4tp": _q4tp,
    "q2tp": _q2tp,
    "vbit": _vbit,
    "vbit_ro": _vbit,
    "q1": _q1,
    "q1s": _q1s,
    "q1t": _q1t,
}


def kernel_refusal(dtype: str, shape: tuple[int, ...]) -> str | None:
    """Why MLX's grouped kernels cannot take this tensor (it then runs dense), or None."""
    if dtype in DENSE_DTYPES:
        return None
    if shape[1] % GROUP:
        return f"in = {shape[1]} is not a multiple of {GROUP}: groups would span rows"
    return None


def linear_from_payload(dtype: DType, buf: np.ndarray, shape: tuple[int, ...], where: str) -> Linear:
    """A payload (uint8, normally an mmap view) as a Linear; a shape the kernels cannot take runs
    on exact decoded weights. `where` names the file and tensor in errors."""
    if dtype.name not in HANDLERS:
        raise UnsupportedModel(f"{where}: dtype {dtype.name} is not a weight dtype")
    if len(shape) != 2:
        raise UnsupportedModel(f"{where}: shape {tuple(shape)} is not a matrix")
    shape = (int(shape[0]), int(shape[1]))
    reason = kernel_refusal(dtype.name, shape)
    if reason is None:
        lin = HANDLERS[dtype.name](dtype.parts(buf, shape, where), shape, lambda: dtype.decode(buf, shape, where))
        return replace(lin, dtype=dtype.name)
    return Linear(dtype.name, shape, (mx.array(dtype.decode(buf, shape, where)),), fallback=reason)


def load_linear(cmf: CmfFile, name: str) -> Linear:
    info = cmf.info(name)
    return linear_from_payload(info.dtype, cmf.raw(name), info.shape, f"{cmf.path.name}: tensor '{name}'")


# ---------------------------------------------------------------- running a Linear


def _block_mm(block: Packed | mx.array, x: mx.array) -> mx.array:
    if isinstance(block, Packed):
        return mx.quantized_matmul(x, block.w, block.scales, block.biases, transpose=True, group_size=GROUP,
                                   bits=block.bits)
    return x @ block.T


def _dequantize(block: Packed | mx.array) -> mx.array:
    if isinstance(block, Packed):
        return mx.dequantize(block.w, block.scales, block.biases, group_size=GROUP, bits=block.bits)
    return block


def matmul(lin: Linear, x: mx.array) -> mx.array:
    """x [..., in] float32 -> x @ W.T [..., out] on the quantized kernels."""
    xin = x * lin.col if lin.col is not None else x
    ys = [_block_mm(b, xin) for b in lin.blocks]
    y = ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=-1)
    if lin.order is not None:
        y = mx.take(y, lin.order, axis=-1)
    if lin.row is not None:
        y = y * lin.row
    if lin.sparse is not None:
        sp = lin.sparse
        flat = x.reshape(-1, lin.shape[1])
        contrib = (mx.take(flat, sp.cols, axis=1) * sp.delta).T
        extra = mx.zeros((lin.shape[0], flat.shape[0]), mx.float32).at[sp.rows].add(contrib)
        y = y + extra.T.reshape(y.shape)
    return y if lin.bias is None else y + lin.bias


def expanded_matmul(lin: Linear, x: mx.array) -> mx.array:
    """matmul through a transient float32 copy of W and numpy's BLAS GEMM.

    For many rows of x this is far faster than MLX's CPU quantized kernel (serial, one row
    at a time) and its float32 GEMM (reference BLAS); the resident weights stay packed and
    the expansion is freed when the call returns."""
    w = dense(lin)
    mx.eval(x, w)
    y = mx.array(np.asarray(x) @ np.asarray(w).T)
    return y if lin.bias is None else y + lin.bias


def dense(lin: Linear) -> mx.array:
    """The effective weights float32 [out, in] (transient: for prefill GEMMs and tests)."""
    blocks = [_dequantize(b) for b in lin.blocks]
    w = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0)
    if lin.order is not None:
        w = mx.take(w, lin.order, axis=0)
    if lin.row is not None:
        # (q * row) * col, the decoder's order of roundings.
        w = (w * lin.row[:, None]) * lin.col
    if lin.sparse is not None:
        sp = lin.sparse
        w = w.at[sp.rows, sp.cols].add(sp.delta)
    return w


def lookup(lin: Linear, ids: np.ndarray | mx.array) -> mx.array:
    """Rows `ids` [n] of the effective weights, float32 [n, in]: embeddings dequantize only
    these rows. Device ids of a plain one-block matrix are gathered on the device."""
    plain = len(lin.blocks) == 1 and all(x is None for x in (lin.order, lin.row, lin.sparse))
    if isinstance(ids, mx.array) and plain:
        block = lin.blocks[0]
        if isinstance(block, Packed):
            return _dequantize(Packed(block.w[ids], block.scales[ids], block.biases[ids], block.bits))
        return block[ids]
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    pos = np.asarray(lin.order)[ids] if lin.order is not None else ids
    sizes = np.array([b.w.shape[0] if isinstance(b, Packed) else b.shape[0] for b in lin.blocks])
    ends = np.cumsum(sizes)
    which = np.searchsorted(ends, pos, side="right")
    parts, where = [], []
    for k in np.unique(which):
        sel = np.flatnonzero(which == k)
        local = mx.array((pos[sel] - (ends[k] - sizes[k])).astype(np.int32))
        block = lin.blocks[k]
        if isinstance(block, Packed):
            block = Packed(block.w[local], block.scales[local], block.biases[local], block.bits)
            parts.append(_dequantize(block))
        else:
            parts.append(block[local])
        where.append(sel)
    rows = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    if len(parts) > 1:
        rows = mx.take(rows, mx.array(np.argsort(np.concatenate(where)).astype(np.int32)), axis=0)
    if lin.row is not None:
        rows = (rows * lin.row[mx.array(ids.astype(np.int32))][:, None]) * lin.col
    if lin.sparse is not None:
        sp = lin.sparse
        start, count = sp.row_ptr[ids], np.diff(sp.row_ptr)[ids]
        out_row = np.repeat(np.arange(ids.size), count)
        entry = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count) + np.repeat(start, count)
        if entry.size:
            e = mx.array(entry.astype(np.int32))
            rows = rows.at[mx.array(out_row.astype(np.int32)), sp.cols[e]].add(sp.delta[e])
    return rows


# ---------------------------------------------------------------- load report


@dataclass
class LoadReport:
    """What a load produced: tensors per CMF dtype, their bytes in the CMF (payload) and on
    MLX (resident, packed), and the dense fallbacks."""

    tensors: Counter = field(default_factory=Counter)
    payload_bytes: int = 0
    packed_bytes: int = 0
    fallbacks: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, dtype: str, payload: int, nbytes: int, fallback: str | None = None) -> None:
        self.tensors[dtype] += 1
        self.payload_bytes += payload
        self.packed_bytes += nbytes
        if fallback:
            self.fallbacks[name] = fallback

    def add_linear(self, name: str, payload: int, lin: Linear) -> None:
        self.add(name, lin.dtype, payload, lin.nbytes, lin.fallback)

    def format(self) -> str:
        per = ", ".join(f"{k} {v}" for k, v in sorted(self.tensors.items()))
        lines = [f"tensors: {per}; CMF payload {self.payload_bytes / 2**20:.1f} MiB, "
                 f"resident on MLX {self.packed_bytes / 2**20:.1f} MiB"]
        lines += [f"dense fallback: {name}: {why}" for name, why in self.fallbacks.items()]
        return "\n".join(lines)
