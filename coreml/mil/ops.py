"""MIL operation semantics in numpy, one small function per op type.

Each function takes the op's inputs (and non-`name` attributes) as keyword arguments, already
decoded to numpy arrays or Python values, and returns an array (or a tuple for multi-output
ops). The executor casts every result to the dtype the program declares for that output, so
these functions compute in whatever precision numpy picks for the operands; fp16 operands of
matrix products are widened to fp32 first so BLAS does the work.

Semantics follow the MIL op reference (coremltools.converters.mil.mil.ops.defs, iOS15-iOS18).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from coreml.mil.errors import MilError
from coreml.mil.loader import DTYPE_BY_NAME, unpack_subbyte
from pipeline.ground.halves import as_dtype


@dataclass(frozen=True)
class OpDef:
    fn: Callable
    lists: frozenset[str]  # inputs that bind a variadic list of values (concat's `values`)
    # The op only moves values (slices, reshapes, joins, picks, a state's reads and writes) or
    # converts them (cast): it sums nothing, so an fp16 operand needs no widening and the
    # executor passes it as stored (a single-token step of an fp16 chunk-KV program otherwise
    # widens the whole stacked cache once per layer's slice: SmolLM2's 30 layers, 40 % of a
    # step; a stateful step widened its fp16 state before casting it, twice per cache).
    moves: bool = False


OPS: dict[str, OpDef] = {}


def op(*names: str, lists: tuple[str, ...] = (), moves: bool = False):
    def register(fn):
        for name in names:
            OPS[name] = OpDef(fn, frozenset(lists), moves)
        return fn

    return register


def _f32(x):
    """Matrix products in fp32: numpy has no BLAS path for fp16."""
    return x.astype(np.float32) if x.dtype == np.float16 else x


def _axes(axes, rank):
    return None if axes is None else tuple(int(a) % rank if rank else 0 for a in np.atleast_1d(axes))


# ---- elementwise binary (numpy broadcasting = MIL broadcasting) --------------------------------
op("add")(lambda x, y: np.add(x, y))
op("sub")(lambda x, y: np.subtract(x, y))
op("mul")(lambda x, y: np.multiply(x, y))
op("real_div")(lambda x, y: np.true_divide(x, y))
op("floor_div")(lambda x, y: np.floor_divide(x, y))
op("mod")(lambda x, y: np.mod(x, y))
op("pow")(lambda x, y: np.power(x, y))
op("maximum")(lambda x, y: np.maximum(x, y))
op("minimum")(lambda x, y: np.minimum(x, y))
op("equal")(lambda x, y: np.equal(x, y))
op("not_equal")(lambda x, y: np.not_equal(x, y))
op("greater")(lambda x, y: np.greater(x, y))
op("greater_equal")(lambda x, y: np.greater_equal(x, y))
op("less")(lambda x, y: np.less(x, y))
op("less_equal")(lambda x, y: np.less_equal(x, y))
op("logical_and")(lambda x, y: np.logical_and(x, y))
op("logical_or")(lambda x, y: np.logical_or(x, y))
op("logical_xor")(lambda x, y: np.logical_xor(x, y))

# ---- elementwise unary ----------------------------------------------------------------------
op("logical_not")(lambda x: np.logical_not(x))
op("abs")(lambda x: np.abs(x))
op("sign")(lambda x: np.sign(x))
op("ceil")(lambda x: np.ceil(x))
op("floor")(lambda x: np.floor(x))
op("round")(lambda x: np.round(x))  # MIL: halves to even, like numpy
op("exp")(lambda x: np.exp(x))
op("exp2")(lambda x: np.exp2(x))
op("log")(lambda x, epsilon=1e-45: np.log(x + np.asarray(epsilon, x.dtype)))
op("sqrt")(lambda x: np.sqrt(x))
op("rsqrt")(lambda x, epsilon=1e-12: 1.0 / np.sqrt(x + np.asarray(epsilon, x.dtype)))
op("inverse")(lambda x, epsilon=1e-4: 1.0 / (x + np.asarray(epsilon, x.dtype)))
op("square")(lambda x: np.square(x))
op("sin")(lambda x: np.sin(x))
op("cos")(lambda x: np.cos(x))
op("tanh")(lambda x: np.tanh(x))
op("relu")(lambda x: np.maximum(x, 0))
op("sigmoid")(lambda x: 1.0 / (1.0 + np.exp(-x)))
op("silu")(lambda x: x / (1.0 + np.exp(-x)))
op("softplus")(lambda x: np.logaddexp(0, x))
op("clip")(lambda x, alpha, beta: np.minimum(np.maximum(x, alpha), beta))
op("erf")(lambda x: _erf(x))
op("identity", moves=True)(lambda x: x)


def _erf(x):
    """erf via the Numerical Recipes erfc Chebyshev fit (relative error < 1.2e-7, fp32 exact enough)."""
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = np.polyval(_ERFC_COEFFS, t)
    erfc = t * np.exp(-z * z + poly)
    return (np.sign(x) * (1.0 - erfc)).astype(x.dtype)


# highest power first, for np.polyval
_ERFC_COEFFS = [0.17087277, -0.82215223, 1.48851587, -1.13520398, 0.27886807,
                -0.18628806, 0.09678418, 0.37409196, 1.00002368, -1.26551223]


@op("gelu")
def gelu(x, mode="EXACT"):
    if mode == "EXACT":
        return 0.5 * x * (1.0 + _erf(x / np.sqrt(np.asarray(2.0, x.dtype))))
    if mode == "TANH_APPROXIMATION":
        # In x's dtype, cubed by products as torch cubes it: a float64 constant would widen the
        # whole op to float64 (NEP 50) and x**3 is a pow per value, 50x the cost of the rest.
        return 0.5 * x * (1.0 + np.tanh(x.dtype.type(np.sqrt(2.0 / np.pi)) * (x + x.dtype.type(0.044715) * (x * x * x))))
    if mode == "SIGMOID_APPROXIMATION":
        return x / (1.0 + np.exp(-1.702 * x))
    raise MilError(f"gelu: mode {mode!r} is not one of EXACT, TANH_APPROXIMATION, SIGMOID_APPROXIMATION")


@op("cast", moves=True)
def cast(x, dtype):
    # Converted from the stored operand: fp16 to fp32 is exact, and to fp16 rounds the same value.
    return as_dtype(np.asarray(x), DTYPE_BY_NAME[str(dtype)].numpy)


@op("select")
def select(cond, a, b):
    return np.where(cond, a, b)


# ---- reductions ------------------------------------------------------------------------------
def _reduction(fn):
    def reduce(x, axes=None, keep_dims=False):
        return fn(x, axis=_axes(axes, x.ndim), keepdims=bool(keep_dims))

    return reduce


op("reduce_mean")(_reduction(np.mean))
op("reduce_sum")(_reduction(np.sum))
op("reduce_max")(_reduction(np.max))
op("reduce_min")(_reduction(np.min))
op("reduce_prod")(_reduction(np.prod))
op("reduce_sum_square")(_reduction(lambda x, axis, keepdims: np.sum(x * x, axis=axis, keepdims=keepdims)))
op("reduce_l2_norm")(_reduction(lambda x, axis, keepdims: np.sqrt(np.sum(x * x, axis=axis, keepdims=keepdims))))
op("reduce_log_sum_exp")(
    _reduction(lambda x, axis, keepdims: np.logaddexp.reduce(x, axis=axis, keepdims=keepdims))
)


@op("reduce_argmax")
def reduce_argmax(x, axis=-1, keep_dims=False):
    out = np.argmax(x, axis=int(axis))
    return np.expand_dims(out, int(axis)) if keep_dims else out


@op("reduce_argmin")
def reduce_argmin(x, axis=-1, keep_dims=False):
    out = np.argmin(x, axis=int(axis))
    return np.expand_dims(out, int(axis)) if keep_dims else out


@op("cumsum")
def cumsum(x, axis=0, exclusive=False, reverse=False):
    axis = int(axis)
    if reverse:
        x = np.flip(x, axis)
    out = np.cumsum(x, axis=axis)
    if exclusive:  # shift by one (not `out - x`, which is inexact for floats)
        zero = np.zeros_like(np.take(out, [0], axis=axis))
        out = np.concatenate([zero, np.take(out, np.arange(x.shape[axis] - 1), axis=axis)], axis=axis)
    return np.flip(out, axis) if reverse else out


@op("softmax")
def softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=int(axis), keepdims=True))
    return e / np.sum(e, axis=int(axis), keepdims=True)


# ---- linear algebra --------------------------------------------------------------------------
@op("linear")
def linear(x, weight, bias=None):
    y = _f32(x) @ _f32(weight).T
    return y if bias is None else y + bias


@op("matmul")
def matmul(x, y, transpose_x=False, transpose_y=False):
    x, y = _f32(x), _f32(y)
    if transpose_x and x.ndim > 1:
        x = np.swapaxes(x, -1, -2)
    if transpose_y and y.ndim > 1:
        y = np.swapaxes(y, -1, -2)
    return np.matmul(x, y)


@op("scaled_dot_product_attention")
def scaled_dot_product_attention(query, key, value, attn_mask=None):
    q, k, v = _f32(query), _f32(key), _f32(value)
    scores = q @ np.swapaxes(k, -1, -2) / np.sqrt(np.float32(q.shape[-1]))
    if attn_mask is not None:
        mask = np.where(attn_mask, 0.0, -np.inf) if attn_mask.dtype == np.bool_ else attn_mask
        scores = scores + mask.astype(np.float32)
    return softmax(scores, -1) @ v


@op("band_part")
def band_part(x, lower=-1, upper=-1):
    m = np.arange(x.shape[-2])[:, None]
    n = np.arange(x.shape[-1])[None, :]
    keep = ((lower < 0) | (m - n <= lower)) & ((upper < 0) | (n - m <= upper))
    return np.where(keep, x, np.zeros((), x.dtype))


# ---- shape and layout ------------------------------------------------------------------------
op("shape")(lambda x: np.array(np.shape(x), dtype=np.int32))
op("transpose", moves=True)(lambda x, perm: np.transpose(x, [int(p) for p in perm]))


@op("tile", moves=True)
def tile(x, reps):
    reps = [int(r) for r in reps]
    if len(reps) == x.ndim and all(r == 1 or n == 1 for r, n in zip(reps, x.shape)):
        # Repeating along axes of one element only (grouped-query attention's K/V over the query
        # heads of a model with one K/V head): the same values as np.tile, as a read-only view
        # whose products read the one copy (Gemma 3 at 1024 slots: 151 MB a single-token step copied).
        return np.broadcast_to(x, [n * r for n, r in zip(x.shape, reps)])
    return np.tile(x, reps)


op("fill")(lambda shape, value=0.0: np.full([int(s) for s in shape], value))
op("fill_like")(lambda ref_tensor, value=0.0: np.full(np.shape(ref_tensor), value))


@op("range_1d")
def range_1d(end, start, step):
    return np.arange(start, end, step)


@op("reshape", moves=True)
def reshape(x, shape):
    shape = [int(s) for s in shape]
    if len(shape) == x.ndim:  # 0 copies the input dimension only when ranks agree
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return np.reshape(x, shape)


@op("expand_dims", moves=True)
def expand_dims(x, axes):
    out_rank = x.ndim + len(axes)
    return np.expand_dims(x, tuple(int(a) % out_rank for a in axes))


@op("squeeze", moves=True)
def squeeze(x, axes=None):
    return np.squeeze(x, axis=_axes(axes, x.ndim))


@op("concat", lists=("values",), moves=True)
def concat(values, axis, interleave=False):
    # Saved programs concatenate rank-0 shape scalars into shape vectors; treat them as [1].
    values = [np.atleast_1d(v) for v in values]
    axis = int(axis) % values[0].ndim
    if not interleave:
        return np.concatenate(values, axis=axis)
    stacked = np.stack(values, axis=axis + 1)  # v0[0], v1[0], v0[1], v1[1], ...
    shape = list(values[0].shape)
    shape[axis] *= len(values)
    return stacked.reshape(shape)


@op("stack", lists=("values",), moves=True)
def stack(values, axis):
    return np.stack(values, axis=int(axis))


@op("split", moves=True)
def split(x, axis, num_splits=None, split_sizes=None):
    axis = int(axis)
    if split_sizes is None:
        return tuple(np.split(x, int(num_splits), axis=axis))
    return tuple(np.split(x, np.cumsum(split_sizes)[:-1], axis=axis))


def _index_slices(shape, begin, end, stride, begin_mask, end_mask, squeeze_mask):
    """MIL slice_by_index as Python slices (coremltools solve_slice_by_index_slice): masked
    begin/end become open ends; a squeezed axis takes the single element at `begin`."""
    rank = len(shape)
    stride = [1] * rank if stride is None else [int(s) for s in stride]
    no = [False] * rank
    begin_mask = no if begin_mask is None else begin_mask
    end_mask = no if end_mask is None else end_mask
    squeeze_mask = no if squeeze_mask is None else squeeze_mask
    slices = []
    for i in range(rank):
        b = None if begin_mask[i] else int(begin[i])
        if squeeze_mask[i]:
            slices.append(slice(b, None, np.iinfo(np.int32).max))
        else:
            slices.append(slice(b, None if end_mask[i] else int(end[i]), stride[i]))
    squeeze_axes = tuple(i for i in range(rank) if squeeze_mask[i])
    return tuple(slices), squeeze_axes


@op("slice_by_index", moves=True)
def slice_by_index(x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    slices, squeeze_axes = _index_slices(x.shape, begin, end, stride, begin_mask, end_mask, squeeze_mask)
    return np.squeeze(x[slices], axis=squeeze_axes)


@op("slice_update", moves=True)
def slice_update(x, update, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    slices, _ = _index_slices(x.shape, begin, end, stride, begin_mask, end_mask, squeeze_mask)
    out = x.copy()
    target = out[slices]
    out[slices] = np.reshape(update, target.shape)
    return out


@op("slice_by_size", moves=True)
def slice_by_size(x, begin, size):
    return x[tuple(slice(int(b), None if s == -1 else int(b) + int(s)) for b, s in zip(begin, size))]


# ---- gather / scatter ------------------------------------------------------------------------
def _wrap(indices, size):
    """MIL allows negative indices counted from the end."""
    indices = np.asarray(indices, dtype=np.int64)
    return np.where(indices < 0, indices + size, indices)


@op("gather", moves=True)
def gather(x, indices, axis=0, batch_dims=0, validate_indices=False):
    axis, b = int(axis) % x.ndim, int(batch_dims)
    indices = _wrap(indices, x.shape[axis])
    if b == 0:
        return np.take(x, indices, axis=axis)
    # Batched: flatten the leading batch dims, gather per batch row with one fancy index, then
    # restore MIL's order x.shape[:axis] + indices.shape[b:] + x.shape[axis+1:].
    batch = x.shape[:b]
    xf = np.moveaxis(x.reshape((-1,) + x.shape[b:]), axis - b + 1, 1)
    idx = indices.reshape((-1,) + indices.shape[b:])
    rows = np.arange(xf.shape[0]).reshape((-1,) + (1,) * (idx.ndim - 1))
    out = xf[rows, idx]  # (B, *I, *pre, *post)
    n_i, n_pre = idx.ndim - 1, axis - b
    order = [0] + list(range(1 + n_i, 1 + n_i + n_pre)) + list(range(1, 1 + n_i))
    order += list(range(1 + n_i + n_pre, out.ndim))
    out = np.transpose(out, order)
    return out.reshape(batch + out.shape[1:])


@op("gather_along_axis", moves=True)
def gather_along_axis(x, indices, axis=0, validate_indices=False):
    axis = int(axis) % x.ndim
    return np.take_along_axis(x, _wrap(indices, x.shape[axis]), axis=axis)


@op("gather_nd", moves=True)
def gather_nd(x, indices, batch_dims=0, validate_indices=False):
    b = int(batch_dims)
    k = indices.shape[-1]
    idx = tuple(_wrap(indices[..., i], x.shape[b + i]) for i in range(k))
    grids = np.indices(indices.shape[:b], sparse=True) if b else ()
    lead = tuple(g.reshape(g.shape + (1,) * (indices.ndim - 1 - b)) for g in grids)
    return x[lead + idx]


# Accumulating scatter modes; "update" is plain assignment (the last duplicate wins).
_SCATTER_UFUNCS = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": np.true_divide,
    "max": np.maximum,
    "min": np.minimum,
}


def _scatter_into(data, index, updates, mode):
    if mode != "update" and mode not in _SCATTER_UFUNCS:
        raise MilError(f"scatter: mode {mode!r} is not one of update, {', '.join(_SCATTER_UFUNCS)}")
    out = np.array(data, copy=True)
    if mode == "update":
        out[index] = updates
    else:
        _SCATTER_UFUNCS[mode].at(out, index, updates.astype(out.dtype))
    return out


@op("scatter")
def scatter(data, indices, updates, axis=0, mode="add", validate_indices=False):
    # indices is 1-D; updates is data's shape with `axis` resized to len(indices).
    axis = int(axis) % data.ndim
    index = list(np.indices(updates.shape, sparse=True))
    index[axis] = _wrap(indices, data.shape[axis]).reshape(index[axis].shape)
    return _scatter_into(data, tuple(index), updates, str(mode))


@op("scatter_along_axis")
def scatter_along_axis(data, indices, updates, axis=0, mode="add", validate_indices=False):
    axis = int(axis) % data.ndim
    index = list(np.indices(updates.shape, sparse=True))
    index[axis] = _wrap(indices, data.shape[axis])
    return _scatter_into(data, tuple(index), updates, str(mode))


@op("scatter_nd")
def scatter_nd(data, indices, updates, mode="add", validate_indices=False):
    k = indices.shape[-1]
    index = tuple(_wrap(indices[..., i], data.shape[i]) for i in range(k))
    return _scatter_into(data, index, updates, str(mode))


# ---- states ------------------------------------------------------------------------------------
@op("read_state", moves=True)
def read_state(input):  # noqa: A002 - MIL's parameter name
    return input.value


@op("write_state", moves=True)
def write_state(input, data):  # noqa: A002
    input.write(data)
    return ()


@op("coreml_update_state", moves=True)
def coreml_update_state(state, value):
    state.write(value)
    return value


# ---- compile-time decompression (constexpr_*) --------------------------------------------------
def _repeat_blocks(a, shape):
    """Expand per-block parameters to `shape` (block size = dim / parameter dim on each axis)."""
    for axis, (full, part) in enumerate(zip(shape, a.shape)):
        if full != part:
            if part == 0 or full % part:
                raise MilError(f"block parameter of shape {a.shape} does not tile data of shape {tuple(shape)}")
            a = np.repeat(a, full // part, axis=axis)
    return a


@op("constexpr_blockwise_shift_scale")
def constexpr_blockwise_shift_scale(data, scale, offset=None):
    out = data.astype(scale.dtype)  # in place below: two arrays of the weight's size at a time, not four
    if offset is not None:
        out -= _repeat_blocks(offset.astype(scale.dtype), data.shape)
    out *= _repeat_blocks(scale, data.shape)
    return out


@op("constexpr_lut_to_dense")
def constexpr_lut_to_dense(indices, lut, vector_axis=None, shape=None):
    if shape is not None:  # iOS16: flat LUT, indices packed into uint8 with nbits = log2(len(lut))
        nbits = int(np.log2(lut.size))
        count = int(np.prod(shape))
        return lut[unpack_subbyte(indices, nbits, count, signed=False)].reshape([int(s) for s in shape])
    # iOS18: lut is [*groups, 2**nbits, vector]; each group covers a block of the indices.
    rank = indices.ndim
    block = [indices.shape[i] // lut.shape[i] for i in range(rank)]
    group = tuple(
        (np.arange(indices.shape[i]) // block[i]).reshape((-1,) + (1,) * (rank - 1 - i)) for i in range(rank)
    )
    values = lut[group + (indices.astype(np.intp),)]  # indices.shape + (vector,)
    if lut.shape[-1] == 1:
        return values[..., 0]
    axis = int(vector_axis) % rank
    values = np.moveaxis(values, -1, axis + 1)  # put each vector right after its index along axis
    shape = list(indices.shape)
    shape[axis] *= lut.shape[-1]
    return values.reshape(shape)


@op("constexpr_sparse_to_dense")
def constexpr_sparse_to_dense(nonzero_data, mask, shape=None):
    if shape is not None:  # iOS16: mask is a flat uint8 bitmap, LSB first
        mask = unpack_subbyte(mask, 1, int(np.prod(shape)), signed=False).reshape([int(s) for s in shape])
    out = np.zeros(mask.shape, dtype=nonzero_data.dtype)
    out[mask != 0] = nonzero_data
    return out


@op("constexpr_affine_dequantize")
def constexpr_affine_dequantize(quantized_data, zero_point, scale, axis):
    axis = int(axis) % quantized_data.ndim
    view = [1] * quantized_data.ndim
    view[axis] = -1
    zp = np.reshape(zero_point, view) if np.ndim(zero_point) else zero_point
    sc = np.reshape(scale, view) if np.ndim(scale) else scale
    return ((quantized_data.astype(np.float32) - np.asarray(zp, np.float32)) * sc).astype(np.asarray(scale).dtype)


@op("constexpr_cast")
def constexpr_cast(source_val, output_dtype):
    return source_val.astype(DTYPE_BY_NAME[str(output_dtype)].numpy)
