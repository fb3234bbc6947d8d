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
    # The op's semantics changed between opsets (iOS17's reshape zeros, its gather/scatter index
    # rules): the executor passes `opset`, the iOS version of the function's opset (17 for CoreML7).
    opset: bool = False


OPS: dict[str, OpDef] = {}


def op(*names: str, lists: tuple[str, ...] = (), moves: bool = False, opset: bool = False):
    def register(fn):
        for name in names:
            OPS[name] = OpDef(fn, frozenset(lists), moves, opset)
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
op("cosh")(lambda x: np.cosh(x))
op("sinh")(lambda x: np.sinh(x))
op("tan")(lambda x: np.tan(x))
op("relu6")(lambda x: np.minimum(np.maximum(x, 0), 6))
op("softsign")(lambda x: x / (1.0 + np.abs(x)))
op("elu")(lambda x, alpha=1.0: np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0))))
op("leaky_relu")(lambda x, alpha=0.01: np.where(x < 0, alpha * x, x))
op("thresholded_relu")(lambda x, alpha=1.0: np.where(x < alpha, np.zeros((), x.dtype), x))
op("clamped_relu")(lambda x, alpha, beta: np.minimum(np.where(x >= 0, x, alpha * x), beta))
op("linear_activation")(lambda x, alpha, beta=0.0: alpha * x + beta)
op("scaled_tanh")(lambda x, alpha=1.0, beta=1.0: alpha * np.tanh(beta * x))
op("sigmoid_hard")(lambda x, alpha=0.2, beta=0.5: np.minimum(np.maximum(alpha * x + beta, 0), 1))


def _per_channel(a, rank):
    """A [C] parameter shaped to broadcast along axis 1 (the channel) of a rank-`rank` tensor."""
    return np.reshape(a, (1, -1) + (1,) * (rank - 2))


@op("prelu")
def prelu(x, alpha):
    return np.maximum(x, 0) + np.minimum(x, 0) * _per_channel(alpha, x.ndim)


@op("softplus_parametric")
def softplus_parametric(x, alpha, beta):
    return _per_channel(alpha, x.ndim) * np.logaddexp(0, x * _per_channel(beta, x.ndim))


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
op("reduce_l1_norm")(_reduction(lambda x, axis, keepdims: np.sum(np.abs(x), axis=axis, keepdims=keepdims)))
op("reduce_log_sum")(_reduction(lambda x, axis, keepdims: np.log(np.sum(x, axis=axis, keepdims=keepdims))))


def _arg_reduction(fn):
    # iOS17 added `output_dtype` (int32 by default, or uint16 and others); earlier opsets give int32.
    def reduce(x, axis=-1, keep_dims=False, output_dtype="int32"):
        out = fn(x, axis=int(axis))
        out = np.expand_dims(out, int(axis)) if keep_dims else out
        return out.astype(DTYPE_BY_NAME[str(output_dtype)].numpy)

    return reduce


op("reduce_argmax")(_arg_reduction(np.argmax))
op("reduce_argmin")(_arg_reduction(np.argmin))


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


@op("layer_norm")
def layer_norm(x, axes=None, gamma=None, beta=None, epsilon=1e-5):
    # gamma and beta have the shape of x's normalized axes, in their order in x.
    axes = tuple(range(x.ndim)) if axes is None else _axes(axes, x.ndim)
    centred = x - np.mean(x, axis=axes, keepdims=True)
    out = centred / np.sqrt(np.mean(centred * centred, axis=axes, keepdims=True) + epsilon)
    shape = [n if i in axes else 1 for i, n in enumerate(x.shape)]
    if gamma is not None:
        out = out * np.reshape(gamma, shape)
    return out if beta is None else out + np.reshape(beta, shape)


def _sort_order(x, axis, ascending):
    """Indices sorting x along `axis`; ties keep index order, as a stable sort gives them."""
    keys = x if ascending else -x.astype(np.float64 if x.dtype.kind in "iub" else x.dtype)  # unsigned: no wrap
    return np.argsort(keys, axis=axis, kind="stable")


@op("argsort")
def argsort(x, axis=-1, ascending=False):
    return _sort_order(x, int(axis) % x.ndim, ascending).astype(np.int32)


@op("topk")
def topk(x, k=1, axis=-1, ascending=False, sort=True, return_indices=True, output_indices_dtype="int32"):
    # iOS16 added sort (unsorted results may come in any order: these are sorted) and
    # return_indices, iOS17 output_indices_dtype and k = -1 for all.
    axis = int(axis) % x.ndim
    order = _sort_order(x, axis, ascending)
    k = x.shape[axis] if int(k) == -1 else int(k)
    indices = np.take(order, np.arange(k), axis=axis)
    values = np.take_along_axis(x, indices, axis=axis)
    if not return_indices:
        return values
    return values, indices.astype(DTYPE_BY_NAME[str(output_indices_dtype)].numpy)


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


@op("einsum", lists=("values",))
def einsum(values, equation):
    # MIL's einsum multiplies two rank-3 or rank-4 tensors over axes -1 and -3 (or their
    # equivalent equations), broadcasting the batch axes (-2, -4) as coremltools' value inference does.
    x, y = (_f32(v) for v in values)
    if x.ndim not in (3, 4) or x.ndim != y.ndim:
        raise MilError(f"einsum: operands of ranks {x.ndim} and {y.ndim}, MIL takes two of rank 3 or 4")
    batch = [a for a in (-2, -4) if -a <= x.ndim]
    xs, ys = list(x.shape), list(y.shape)
    for a in batch:
        xs[a] = ys[a] = max(x.shape[a], y.shape[a])
    return np.einsum(str(equation), np.broadcast_to(x, xs), np.broadcast_to(y, ys))


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


@op("pad", moves=True)
def pad(x, pad, mode="constant", constant_val=0.0):
    # `pad` holds (before, after) pairs for the last len(pad) / 2 axes.
    pairs = np.asarray(pad, dtype=np.int64).reshape(-1, 2)
    pairs = np.concatenate([np.zeros((x.ndim - len(pairs), 2), np.int64), pairs])
    mode = str(mode)
    if mode == "constant":
        return np.pad(x, pairs, "constant", constant_values=np.asarray(constant_val, x.dtype))
    if mode not in ("reflect", "replicate"):
        raise MilError(f"pad: mode {mode!r} is not one of constant, reflect, replicate")
    return np.pad(x, pairs, "edge" if mode == "replicate" else "reflect")


op("fill")(lambda shape, value=0.0: np.full([int(s) for s in shape], value))
op("fill_like")(lambda ref_tensor, value=0.0: np.full(np.shape(ref_tensor), value))


@op("range_1d")
def range_1d(end, start, step):
    return np.arange(start, end, step)


@op("reshape", moves=True, opset=True)
def reshape(x, shape, opset):
    shape = [int(s) for s in shape]
    if opset >= 17:
        # A 0 copies the input dimension at the same place counted from the right, or is 1
        # where the input has no dimension there (iOS17's reshape: [1, 0, -1, 0] of [2, 50]
        # is [1, 1, 2, 50]).
        offset = x.ndim - len(shape)
        shape = [(x.shape[i + offset] if i + offset >= 0 else 1) if s == 0 else s for i, s in enumerate(shape)]
    elif len(shape) == x.ndim:  # iOS15/16: 0 copies the input dimension only when ranks agree
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return np.reshape(x, shape)


@op("reverse", moves=True)
def reverse(x, axes=None):
    return np.flip(x, axis=None if axes is None else _axes(axes, x.ndim))


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


# slice_by_index's and slice_update's operands that say which part (`index_slices`).
SLICE_KEYS = ("begin", "end", "stride", "begin_mask", "end_mask", "squeeze_mask")


def index_slices(shape, begin, end, stride, begin_mask, end_mask, squeeze_mask):
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
    slices, squeeze_axes = index_slices(x.shape, begin, end, stride, begin_mask, end_mask, squeeze_mask)
    return np.squeeze(x[slices], axis=squeeze_axes)


@op("slice_update", moves=True)
def slice_update(x, update, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    slices, _ = index_slices(x.shape, begin, end, stride, begin_mask, end_mask, squeeze_mask)
    out = x.copy()
    target = out[slices]
    out[slices] = np.reshape(update, target.shape)
    return out


@op("slice_by_size", moves=True)
def slice_by_size(x, begin, size):
    return x[tuple(slice(int(b), None if s == -1 else int(b) + int(s)) for b, s in zip(begin, size))]


# ---- gather / scatter ------------------------------------------------------------------------
# Index rules by opset (coremltools' ops/defs iOS15 and iOS17 scatter_gather.py):
# - iOS15/16: an index may be negative, -D <= v < D, and counts from the end.
# - iOS17+: `validate_indices=True` makes an index outside [0, D) a runtime error. Otherwise an
#   out-of-bound index is undefined (memory safe). Gathers keep counting a negative one from the
#   end, as the iOS17 gather's `indices` still documents -D <= v < D. Scatters define indices as
#   non-negative only, and Core ML does not count from the end there (coremltools'
#   iOS17 TestScatter.test_ios17_invalid_indices asserts the wrapped result is *not* produced),
#   so an update at an out-of-bound index is dropped.
def _wrap(indices, size):
    indices = np.asarray(indices, dtype=np.int64)
    return np.where(indices < 0, indices + size, indices)


def _validated(name, indices, size, opset, validate):
    """`indices` as int64, checked where iOS17's `validate_indices` asks (`size`: per last axis if an array)."""
    indices = np.asarray(indices, dtype=np.int64)
    if opset >= 17 and validate and np.any((indices < 0) | (indices >= size)):
        raise MilError(f"{name}: an index is outside [0, {size}) and validate_indices is set")
    return indices


def _gather_index(name, indices, size, opset, validate):
    return _wrap(_validated(name, indices, size, opset, validate), size)


@op("gather", moves=True, opset=True)
def gather(x, indices, opset, axis=0, batch_dims=0, validate_indices=False):
    axis, b = int(axis) % x.ndim, int(batch_dims)
    indices = _gather_index("gather", indices, x.shape[axis], opset, validate_indices)
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


@op("gather_along_axis", moves=True, opset=True)
def gather_along_axis(x, indices, opset, axis=0, validate_indices=False):
    axis = int(axis) % x.ndim
    indices = _gather_index("gather_along_axis", indices, x.shape[axis], opset, validate_indices)
    return np.take_along_axis(x, indices, axis=axis)


@op("gather_nd", moves=True, opset=True)
def gather_nd(x, indices, opset, batch_dims=0, validate_indices=False):
    b = int(batch_dims)
    k = indices.shape[-1]
    sizes = np.array(x.shape[b : b + k], dtype=np.int64)
    indices = _gather_index("gather_nd", indices, sizes, opset, validate_indices)
    idx = tuple(indices[..., i] for i in range(k))
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


def _scatter_index(name, indices, size, opset, validate):
    """(indices, which of them are applied): iOS15/16 count negatives from the end; iOS17+
    drops an update at an index outside [0, size)."""
    if opset < 17:
        indices = _wrap(indices, size)
        return indices, np.ones(indices.shape, bool)
    indices = _validated(name, indices, size, opset, validate)
    return indices, (indices >= 0) & (indices < size)


def _applied(index, updates, kept):
    """The index arrays (broadcasting to updates' shape) and updates where `kept` is true."""
    updates = np.asarray(updates)
    if kept.all():
        return index, updates
    kept = np.broadcast_to(kept, updates.shape)
    return tuple(np.broadcast_to(i, updates.shape)[kept] for i in index), updates[kept]


def _scatter_into(data, index, updates, mode):
    if mode != "update" and mode not in _SCATTER_UFUNCS:
        raise MilError(f"scatter: mode {mode!r} is not one of update, {', '.join(_SCATTER_UFUNCS)}")
    out = np.array(data, copy=True)
    if mode == "update":
        out[index] = updates
    else:
        _SCATTER_UFUNCS[mode].at(out, index, updates.astype(out.dtype))
    return out


@op("scatter", opset=True)
def scatter(data, indices, updates, opset, axis=0, mode="add", validate_indices=False):
    # indices is 1-D; updates is data's shape with `axis` resized to len(indices).
    axis = int(axis) % data.ndim
    indices, kept = _scatter_index("scatter", indices, data.shape[axis], opset, validate_indices)
    along = (-1,) + (1,) * (updates.ndim - axis - 1)
    index = list(np.indices(updates.shape, sparse=True))
    index[axis] = indices.reshape(along)
    return _scatter_into(data, *_applied(tuple(index), updates, kept.reshape(along)), str(mode))


@op("scatter_along_axis", opset=True)
def scatter_along_axis(data, indices, updates, opset, axis=0, mode="add", validate_indices=False):
    axis = int(axis) % data.ndim
    indices, kept = _scatter_index("scatter_along_axis", indices, data.shape[axis], opset, validate_indices)
    index = list(np.indices(updates.shape, sparse=True))
    index[axis] = indices
    return _scatter_into(data, *_applied(tuple(index), updates, kept), str(mode))


@op("scatter_nd", opset=True)
def scatter_nd(data, indices, updates, opset, mode="add", validate_indices=False):
    # indices is (*K, k); updates is K + data.shape[k:]: updates[K] goes to data[indices[K]].
    k = indices.shape[-1]
    sizes = np.array(data.shape[:k], dtype=np.int64)
    indices, kept = _scatter_index("scatter_nd", indices, sizes, opset, validate_indices)
    kept = kept.all(axis=-1)
    updates = np.asarray(updates)
    if not kept.all():
        indices, updates = indices[kept], updates[kept]
    return _scatter_into(data, tuple(indices[..., i] for i in range(k)), updates, str(mode))


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
