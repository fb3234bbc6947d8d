"""Per-op semantics of the MIL executor against torch, numpy, coremltools and the MIL docs.

The tricky ops are checked directly on their op functions; a program built with the MIL
builder then runs the rarer ops (scaled_dot_product_attention, band_part, gather_nd,
scatter_nd, split, constexpr_cast on an fp16 const, ...) end to end from a saved package.
"""

import numpy as np
import pytest
import torch

from pipeline.ground.models.numerics import U32, assert_within_sums, gamma
from coreml.manifest import save_model
from coreml.mil import MilError
from coreml.mil.loader import DTYPE_BY_NAME, unpack_subbyte
from coreml.mil.ops import OPS


def run(op_type, opset=18, **kwargs):
    """Op `op_type` of `kwargs`, as in a program of iOS `opset` where its semantics depend on it."""
    if OPS[op_type].opset:
        kwargs["opset"] = opset
    return OPS[op_type].fn(**kwargs)


rng = np.random.default_rng(0)
X = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)


# ---- slice_by_index: begin/end/stride/masks/squeeze, against coremltools' own slice solver -------
SLICES = [
    dict(begin=[0, 0, 0, 0], end=[2, 3, 4, 5]),
    dict(begin=[1, -2, 1, 0], end=[2, 3, -1, 5], stride=[1, 1, 2, 2]),
    dict(begin=[0, 2, 3, 4], end=[0, 0, 0, 0], stride=[1, -1, -1, -2], begin_mask=[True, False, False, False],
         end_mask=[True, True, True, True]),
    dict(begin=[1, 0, -1, 0], end=[0, 3, 0, 5], squeeze_mask=[True, False, True, False]),
    dict(begin=[5, 9, 0, -9], end=[9, 9, 100, 100], begin_mask=[True, False, False, False]),
    dict(begin=[-1, -1, -1, -1], end=[0, 0, 0, 0], squeeze_mask=[True, True, True, True]),
]


@pytest.mark.parametrize("spec", SLICES)
def test_slice_by_index_matches_coremltools_solver(spec):
    from coremltools.converters.mil.mil.ops.defs._utils import solve_slice_by_index_slice

    full = {k: spec.get(k) for k in ("stride", "begin_mask", "end_mask", "squeeze_mask")}
    slices = solve_slice_by_index_slice(X.shape, spec["begin"], spec["end"], list(full["stride"] or [1] * 4),
                                        full["begin_mask"], full["end_mask"], full["squeeze_mask"])
    squeeze = tuple(i for i, s in enumerate(full["squeeze_mask"] or []) if s)
    expected = np.squeeze(X[slices], axis=squeeze)
    args = {k: np.array(v) for k, v in spec.items()}
    out = run("slice_by_index", x=X, **args)
    assert out.shape == expected.shape
    np.testing.assert_array_equal(out, expected)


def test_slice_update_writes_exactly_the_sliced_region():
    spec = dict(begin=np.array([0, 1, 0, 4]), end=np.array([2, 3, 4, 0]), stride=np.array([1, 1, 2, -2]),
                end_mask=np.array([False, False, False, True]))
    region = run("slice_by_index", x=X, **spec)
    update = np.full(region.shape, 7.0, np.float32)
    out = run("slice_update", x=X, update=update, **spec)
    expected = X.copy()  # torch has no negative steps; numpy's basic slicing is the reference
    expected[0:2, 1:3, 0:4:2, 4::-2] = 7.0
    np.testing.assert_array_equal(out, expected)
    # squeezed axis: the update has the squeezed shape
    out = run("slice_update", x=X, update=np.ones((2, 4, 5), np.float32), begin=np.array([0, -1, 0, 0]),
              end=np.array([0, 0, 0, 0]), squeeze_mask=np.array([False, True, False, False]),
              begin_mask=np.array([True, False, True, True]), end_mask=np.array([True, False, True, True]))
    expected = X.copy()
    expected[:, -1] = 1.0
    np.testing.assert_array_equal(out, expected)


def test_slice_by_size_minus_one_runs_to_the_end():
    out = run("slice_by_size", x=X, begin=np.array([1, 0, 2, 1]), size=np.array([-1, 2, -1, 3]))
    np.testing.assert_array_equal(out, X[1:, 0:2, 2:, 1:4])


# ---- gathers ------------------------------------------------------------------------------------
def test_gather_along_axis_matches_torch_gather_including_negative_indices():
    idx = rng.integers(-4, 4, size=(2, 3, 6, 5)).astype(np.int32)
    out = run("gather_along_axis", x=X, indices=idx, axis=2)
    ref = torch.gather(torch.from_numpy(X), 2, torch.from_numpy(np.where(idx < 0, idx + 4, idx)).long())
    np.testing.assert_array_equal(out, ref.numpy())


@pytest.mark.parametrize("axis,batch_dims", [(0, 0), (2, 0), (1, 1), (2, 1), (3, 2)])
def test_gather_matches_coremltools_value_inference(axis, batch_dims):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function

    idx_shape = X.shape[:batch_dims] + (2, 3)
    idx = rng.integers(0, X.shape[axis], size=idx_shape).astype(np.int32)
    with Function({}, opset_version=ct.target.iOS18):
        expected = mb.gather(x=X, indices=idx, axis=axis, batch_dims=batch_dims).val
    np.testing.assert_array_equal(run("gather", x=X, indices=idx, axis=axis, batch_dims=batch_dims), expected)


def test_gather_nd_with_and_without_batch_dims():
    idx = np.array([[[1, 2], [0, -1]], [[0, 0], [1, 1]]], np.int32)  # (2, 2, K=2)
    out = run("gather_nd", x=X, indices=idx)
    expected = np.stack([np.stack([X[i, j % 3] for i, j in pair]) for pair in idx])
    np.testing.assert_array_equal(out, expected)
    idx_b = np.array([[[2, 1]], [[0, 3]]], np.int32)  # batch_dims=1: per-batch (K=2) indices
    out = run("gather_nd", x=X, indices=idx_b, batch_dims=1)
    np.testing.assert_array_equal(out, np.stack([X[0, 2, 1][None], X[1, 0, 3][None]]))


# ---- scatters: every mode, against torch ----------------------------------------------------------
DATA = rng.standard_normal((4, 6)).astype(np.float32)
TORCH_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


@pytest.mark.parametrize("mode", ["update", "add", "mul", "max", "min", "sub", "div"])
def test_scatter_along_axis_modes(mode):
    idx = np.array([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]], np.int32)  # distinct per column for "update"
    upd = rng.standard_normal((2, 6)).astype(np.float32) + 2
    out = run("scatter_along_axis", data=DATA, indices=idx[:, :6] % 4, updates=upd, axis=0, mode=mode)
    t_data, t_idx, t_upd = torch.from_numpy(DATA), torch.from_numpy(idx % 4).long(), torch.from_numpy(upd)
    if mode == "update":
        ref = t_data.scatter(0, t_idx, t_upd)
    elif mode == "sub":
        ref = t_data.scatter_reduce(0, t_idx, -t_upd, "sum")
    elif mode == "div":
        ref = t_data.scatter_reduce(0, t_idx, 1 / t_upd, "prod")
    else:
        ref = t_data.scatter_reduce(0, t_idx, t_upd, TORCH_REDUCE[mode])
    # No index repeats within a column: one IEEE operation per element (two for div's 1/u then
    # product against one division), each within u relative; 1e-6 is 16u.
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-6, atol=1e-6)


def test_scatter_accumulates_duplicate_indices_along_an_axis():
    idx = np.array([1, 3, 1], np.int32)
    upd = rng.standard_normal((4, 3)).astype(np.float32)
    out = run("scatter", data=DATA, indices=idx, updates=upd, axis=1, mode="add")
    ref = torch.from_numpy(DATA).index_add(1, torch.from_numpy(idx).long(), torch.from_numpy(upd))
    magnitude = torch.from_numpy(np.abs(DATA)).index_add(1, torch.from_numpy(idx).long(), torch.from_numpy(np.abs(upd)))
    assert_within_sums(out, ref.numpy(), magnitude.numpy(), 3)  # data + two updates, in either order
    out = run("scatter", data=DATA, indices=np.array([-1, 0], np.int32), updates=upd[:, :2], axis=1, mode="update",
              opset=16)  # iOS15/16 count a negative index from the end
    expected = DATA.copy()
    expected[:, [5, 0]] = upd[:, :2]
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("mode", ["update", "add"])
def test_scatter_nd_matches_torch_index_put(mode):
    idx = np.array([[0, 1], [3, 5], [0, 1]], np.int32) if mode == "add" else np.array([[0, 1], [3, 5]], np.int32)
    upd = rng.standard_normal(len(idx)).astype(np.float32)
    out = run("scatter_nd", data=DATA, indices=idx, updates=upd, mode=mode)
    ref = torch.from_numpy(DATA.copy()).index_put_(
        (torch.from_numpy(idx[:, 0]).long(), torch.from_numpy(idx[:, 1]).long()), torch.from_numpy(upd), accumulate=mode == "add"
    )
    magnitude = torch.from_numpy(np.abs(DATA)).index_put_(
        (torch.from_numpy(idx[:, 0]).long(), torch.from_numpy(idx[:, 1]).long()), torch.from_numpy(np.abs(upd)), accumulate=True
    )
    assert_within_sums(out, ref.numpy(), magnitude.numpy(), len(idx) + 1)
    rows = run("scatter_nd", data=DATA, indices=np.array([[2]], np.int32), updates=np.ones((1, 6), np.float32), mode="update")
    np.testing.assert_array_equal(rows[2], 1.0)


def test_scatter_rejects_an_unknown_mode():
    with pytest.raises(MilError, match="mode 'xor'"):
        run("scatter_nd", data=DATA, indices=np.array([[0, 0]], np.int32), updates=np.ones(1, np.float32), mode="xor")


# ---- attention and masks --------------------------------------------------------------------------
@pytest.mark.parametrize("lower,upper", [(-1, 0), (0, -1), (0, 0), (1, 2), (-1, -1), (2, -1)])
def test_band_part_matches_torch_triangles(lower, upper):
    x = torch.from_numpy(X)
    keep = torch.ones(4, 5, dtype=torch.bool)
    if lower >= 0:
        keep &= torch.ones(4, 5, dtype=torch.bool).triu(-lower)
    if upper >= 0:
        keep &= torch.ones(4, 5, dtype=torch.bool).tril(upper)
    np.testing.assert_array_equal(run("band_part", x=X, lower=lower, upper=upper), (x * keep).numpy())


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_softmax_axis_matches_torch(axis):
    x = X * 30  # large logits: the max-subtraction matters
    # Each side: exp within a few ulps (Sleef, numpy SIMD, libm: <= 4u), a sum of <= 4 terms
    # and a division, ~10u of each probability; 20u = 1.2e-6 apart < rtol. atol: underflowed tails.
    np.testing.assert_allclose(run("softmax", x=x, axis=axis), torch.softmax(torch.from_numpy(x), dim=axis).numpy(),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_scaled_dot_product_attention_matches_torch(mask_kind):
    q, k, v = (rng.standard_normal((1, 2, n, 8)).astype(np.float32) for n in (3, 5, 5))
    mask = {None: None, "bool": rng.random((3, 5)) > 0.3, "float": rng.standard_normal((3, 5)).astype(np.float32)}[mask_kind]
    if mask_kind == "bool":
        mask[:, 0] = True  # every query attends somewhere
    out = run("scaled_dot_product_attention", query=q, key=k, value=v, attn_mask=mask)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=None if mask is None else torch.from_numpy(mask)
    )
    # A score (dot of 8, scaled, plus a float mask) errs by gamma_10 of its |terms|; softmax
    # turns score errors ds into probability errors of at most 2 p max|ds|, plus its own ~10u
    # (exp, sum, division); p @ V adds gamma_6. All relative to sum_j p_j |v_j|, both sides.
    scores = np.abs(q) @ np.abs(k).swapaxes(-1, -2) / np.sqrt(8) + (np.abs(mask) if mask_kind == "float" else 0)
    ds = gamma(10) * scores.max()
    p = torch.softmax(torch.from_numpy(q @ k.swapaxes(-1, -2) / np.sqrt(8)
                                      + (0 if mask is None else np.where(mask, 0, -np.inf) if mask_kind == "bool" else mask)),
                      dim=-1).numpy()
    bound = 2 * (2 * ds + 10 * U32 + gamma(6)) * (p @ np.abs(v))
    assert np.all(np.abs(out - ref.numpy()) <= bound)


# ---- elementwise, casts, selects ------------------------------------------------------------------
def test_cast_rounding_follows_numpy_and_torch():
    x = np.array([0.5, 1.5, -1.7, 2.9999, 65519.0, 1e-8, 1.0009765625 + 2**-12], np.float32)
    np.testing.assert_array_equal(run("cast", x=x, dtype="fp16"), torch.from_numpy(x).half().numpy())  # RNE
    np.testing.assert_array_equal(run("cast", x=x, dtype="int32"), torch.from_numpy(x).int().numpy())  # truncation
    np.testing.assert_array_equal(run("cast", x=np.array([0.0, -0.0, 2.0, np.nan]), dtype="bool"), [False, False, True, True])
    assert run("cast", x=np.array([1, 0], np.int32), dtype="fp16").dtype == np.float16


def test_select_broadcasts_like_torch_where():
    cond = rng.random((3, 1, 5)) > 0.5
    a = rng.standard_normal((1, 4, 5)).astype(np.float32)
    b = np.float32(-3.0)
    ref = torch.where(torch.from_numpy(cond), torch.from_numpy(a), torch.tensor(b))
    np.testing.assert_array_equal(run("select", cond=cond, a=a, b=b), ref.numpy())


@pytest.mark.parametrize("mode,torch_mode", [("EXACT", "none"), ("TANH_APPROXIMATION", "tanh")])
def test_gelu_modes_match_torch(mode, torch_mode):
    x = np.linspace(-6, 6, 101, dtype=np.float32)
    ref = torch.nn.functional.gelu(torch.from_numpy(x), approximate=torch_mode).numpy()
    # erf/tanh within a few ulps and <= 6 roundings a side (~10u = 6e-7 of |x|). Where 1 + tanh
    # (or 1 + erf) cancels, the error is absolute instead: the float32 op's tanh within 4 ulps of
    # a value near -1 (2^-24 each) and the sum's rounding, times 0.5|x| <= 3 here, is at most
    # 3 * 5 * 2^-24 = 9e-7 on any CPU whose tanh keeps to 4 ulps, within the atol.
    got = run("gelu", x=x, mode=mode)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert got.dtype == np.float32


def test_unary_math_against_torch():
    x = np.abs(X) + 0.1
    t = torch.from_numpy(x)
    # Each library's sqrt is correctly rounded and its exp/erf within a few ulps; sigmoid and silu
    # add <= 3 roundings: <= 8u = 5e-7 a side, so 2e-6 (34u) holds on any kernels.
    for op_type, ref in [("rsqrt", torch.rsqrt(t)), ("sqrt", t.sqrt()), ("sigmoid", t.sigmoid()),
                         ("silu", torch.nn.functional.silu(t)), ("erf", torch.erf(t - 1))]:
        got = run(op_type, x=x - 1 if op_type == "erf" else x, **({"epsilon": 0.0} if op_type == "rsqrt" else {}))
        np.testing.assert_allclose(got, ref.numpy(), rtol=2e-6, atol=1e-7, err_msg=op_type)
    np.testing.assert_allclose(run("rsqrt", x=x), 1 / np.sqrt(x + 1e-12), rtol=1e-6)  # default epsilon


@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_matches_torch(exclusive, reverse):
    t = torch.from_numpy(X)
    ref = t.flip(2).cumsum(2).flip(2) if reverse else t.cumsum(2)
    if exclusive:
        ref = ref - t
    out = run("cumsum", x=X, axis=2, exclusive=exclusive, reverse=reverse)
    # Any prefix sums at most the whole axis's |x|; torch's exclusive form subtracts once more.
    assert_within_sums(out, ref.numpy(), np.abs(X).sum(2, keepdims=True), X.shape[2] + 1)
    ints = np.array([[1, 0, 1, 1]], np.int32)
    assert run("cumsum", x=ints, axis=-1, exclusive=exclusive).tolist() == [[0, 1, 1, 2] if exclusive else [1, 1, 2, 3]]


def test_reductions_and_matmul_against_torch():
    t = torch.from_numpy(X)
    # Sums of signed terms: bounded by gamma_n of the absolute terms' sum, never relative to
    # the (possibly cancelled) result.
    a = np.abs(X)
    assert_within_sums(run("reduce_mean", x=X, axes=np.array([-1]), keep_dims=True), t.mean(-1, keepdim=True).numpy(),
                       a.mean(-1, keepdims=True), 5 + 1)  # and the division
    assert_within_sums(run("reduce_sum", x=X, axes=np.array([0, 2])), t.sum((0, 2)).numpy(), a.sum((0, 2)), 2 * 4)
    assert_within_sums(run("reduce_sum", x=X), t.sum().numpy(), a.sum(), X.size)
    y = rng.standard_normal((2, 3, 6, 5)).astype(np.float32)
    assert_within_sums(run("matmul", x=X, y=y, transpose_y=True), (t @ torch.from_numpy(y).transpose(-1, -2)).numpy(),
                       a @ np.abs(y).swapaxes(-1, -2), 5 + 1)
    w, bias = rng.standard_normal((7, 5)).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    assert_within_sums(run("linear", x=X, weight=w, bias=bias),
                       torch.nn.functional.linear(t, torch.from_numpy(w), torch.from_numpy(bias)).numpy(),
                       a @ np.abs(w).T + np.abs(bias), 5 + 2)
    assert run("matmul", x=X.astype(np.float16), y=y.astype(np.float16), transpose_y=True).dtype == np.float32


def test_shape_ops():
    x3 = X.reshape(6, 4, 5)  # 0 copies the input dim only when the ranks agree (MIL reshape)
    np.testing.assert_array_equal(run("reshape", x=x3, shape=np.array([0, -1, 2])), x3.reshape(6, 10, 2))
    assert run("reshape", x=X, shape=np.array([0, 3, 0, 5])).shape == (2, 3, 4, 5)
    assert run("expand_dims", x=X, axes=np.array([0, -1])).shape == (1, 2, 3, 4, 5, 1)
    assert run("squeeze", x=X[:1, :, :1], axes=np.array([0, 2])).shape == (3, 5)
    assert run("shape", x=X).dtype == np.int32
    np.testing.assert_array_equal(run("tile", x=X, reps=np.array([1, 2, 1, 1])), torch.from_numpy(X).repeat(1, 2, 1, 1).numpy())
    # One K/V head tiled over the query heads: a view of it, the same values (moved, never summed:
    # equal on every machine).
    one_head = X[:, :1]
    tiled = run("tile", x=one_head, reps=np.array([1, 4, 1, 1]))
    np.testing.assert_array_equal(tiled, torch.from_numpy(one_head).repeat(1, 4, 1, 1).numpy())
    assert np.shares_memory(tiled, one_head) and not tiled.flags.writeable
    np.testing.assert_array_equal(run("range_1d", end=np.int32(7), start=np.int32(1), step=np.int32(2)), [1, 3, 5])
    parts = run("split", x=X, axis=3, split_sizes=np.array([2, 3]))
    np.testing.assert_array_equal(parts[1], X[..., 2:])
    assert len(run("split", x=X, axis=1, num_splits=3)) == 3


def test_concat_interleave_follows_the_mil_docs():
    in1 = np.array([[1, 2], [3, 4], [5, 6]])
    in2 = np.array([[7, 8], [9, 10], [11, 12]])
    np.testing.assert_array_equal(run("concat", values=(in1, in2), axis=0, interleave=True),
                                  [[1, 2], [7, 8], [3, 4], [9, 10], [5, 6], [11, 12]])
    np.testing.assert_array_equal(run("concat", values=(np.int32(3), np.array([4], np.int32)), axis=0), [3, 4])


# ---- compression ops, against coremltools' decompress and the documented examples -----------------
@pytest.mark.parametrize("nbits,signed", [(1, False), (2, False), (3, False), (4, False), (6, False), (4, True)])
def test_subbyte_unpack_inverts_coremltools_packing(nbits, signed):
    from coremltools.optimize._utils import pack_elements_into_bits

    lo, hi = (-(2 ** (nbits - 1)), 2 ** (nbits - 1)) if signed else (0, 2**nbits)
    for count in (1, 5, 37, 1003):  # partial bytes and partial 3-byte words at the end
        values = rng.integers(lo, hi, size=count).astype(np.int8 if signed else np.uint8)
        packed = pack_elements_into_bits(values, nbits)
        np.testing.assert_array_equal(unpack_subbyte(packed, nbits, count, signed), values)


def test_blockwise_shift_scale_matches_an_explicit_loop():
    data = rng.integers(-8, 8, size=(4, 6)).astype(np.int8)
    scale = rng.random((2, 3)).astype(np.float16)
    offset = rng.integers(-2, 2, size=(2, 3)).astype(np.int8)
    out = run("constexpr_blockwise_shift_scale", data=data, scale=scale, offset=offset)
    expected = np.empty((4, 6), np.float16)
    for i in range(4):
        for j in range(6):
            expected[i, j] = scale[i // 2, j // 2] * (np.float16(data[i, j]) - np.float16(offset[i // 2, j // 2]))
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("vector_axis", [None, 0, 1, -1])
def test_lut_to_dense_matches_coremltools_decompress(vector_axis):
    from coremltools.optimize._utils import lut_to_dense

    vec = 1 if vector_axis is None else 3
    indices = rng.integers(0, 4, size=(4, 6)).astype(np.uint8)
    lut = rng.standard_normal((2, 3, 4, vec)).astype(np.float32)  # 2x3 groups of 2x2 indices
    out = run("constexpr_lut_to_dense", indices=indices, lut=lut, vector_axis=vector_axis)
    np.testing.assert_array_equal(out, lut_to_dense(indices, lut, vector_axis))


def test_lut_to_dense_documented_example():
    indices = np.array([2, 3, 3, 0, 1, 0, 3, 0, 2, 1, 0, 3], np.uint8).reshape(6, 2)
    lut = np.array([1.0, 5.0, 9.0, 13.0, 2.0, 10.0, 18.0, 26.0], np.float16).reshape(2, 1, 4, 1)
    np.testing.assert_array_equal(run("constexpr_lut_to_dense", indices=indices, lut=lut),
                                  [[9, 13], [13, 1], [5, 1], [26, 2], [18, 10], [2, 26]])


def test_sparse_and_affine_and_cast_constexprs():
    mask = (rng.random((3, 4)) > 0.5).astype(np.uint8)
    nonzero = rng.standard_normal(int(mask.sum())).astype(np.float32)
    dense = run("constexpr_sparse_to_dense", nonzero_data=nonzero, mask=mask)
    np.testing.assert_array_equal(dense[mask == 1], nonzero)
    assert np.all(dense[mask == 0] == 0)
    q = rng.integers(0, 255, size=(3, 4)).astype(np.uint8)
    zp, sc = np.array([128, 120, 100], np.uint8), np.array([0.1, 0.2, 0.3], np.float32)
    out = run("constexpr_affine_dequantize", quantized_data=q, zero_point=zp, scale=sc, axis=0)
    # (q - zp) is exact; one float32 product each side, correctly rounded: equal up to u.
    np.testing.assert_allclose(out, (q.astype(np.float32) - zp[:, None]) * sc[:, None], rtol=1e-6)
    half = rng.standard_normal(5).astype(np.float16)
    cast = run("constexpr_cast", source_val=half, output_dtype="fp32")
    assert cast.dtype == np.float32 and np.array_equal(cast, half.astype(np.float32))


def test_every_dtype_name_maps_to_numpy():
    assert DTYPE_BY_NAME["int4"].nbits == 4 and DTYPE_BY_NAME["fp16"].numpy == np.float16


# ---- a builder-made program with the ops torch conversions rarely emit, run from disk -----------
@pytest.fixture(scope="module")
def builder_package(tmp_path_factory):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    w16 = rng.standard_normal((8, 8)).astype(np.float16)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 2, 5, 8)), mb.TensorSpec(shape=(3, 2), dtype=types.int32)],
                opset_version=ct.target.iOS18)
    def prog(x, idx):
        h = mb.matmul(x=x, y=mb.constexpr_cast(source_val=w16, output_dtype="fp32"))
        causal = mb.band_part(x=mb.add(x=mb.mul(x=h, y=0.0), y=1.0), lower=-1, upper=0)  # ones, lower triangle
        mask = mb.cast(x=mb.slice_by_index(x=causal, begin=[0, 0, 0, 0], end=[1, 1, 5, 5]), dtype="bool")
        a = mb.scaled_dot_product_attention(query=h, key=x, value=h, attn_mask=mask)
        flat = mb.reshape(x=a, shape=[2, 5, 8])
        g = mb.gather_nd(x=flat, indices=idx)
        s = mb.scatter_nd(data=flat, indices=idx, updates=mb.mul(x=g, y=2.0), mode="add")
        p1, p2 = mb.split(x=s, split_sizes=[3, 5], axis=2)
        r = mb.reduce_sum(x=p1, axes=[-1], keep_dims=True)
        return mb.concat(values=[r, p2], axis=-1), mb.gelu(x=p1, mode="TANH_APPROXIMATION")

    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                       compute_precision=ct.precision.FLOAT32)
    path = tmp_path_factory.mktemp("builder") / "builder.mlpackage"
    save_model(model, path)
    return path, w16


def test_builder_program_matches_torch(builder_package):
    from coreml.mil import load_program
    from coreml.package import open_package

    path, w16 = builder_package
    ops = {op.type for op in load_program(path).functions["main"].block.operations}
    assert {"constexpr_cast", "scaled_dot_product_attention", "gather_nd", "scatter_nd", "split", "gelu"} <= ops
    pkg = open_package(path)
    x = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    # In range: an iOS17+ scatter's negative index is out of bounds (see test_ios17_scatter_*).
    idx = np.array([[0, 1], [1, 4], [0, 1]], np.int32)
    out = pkg.predict({"x": x, "idx": idx})

    t = torch.from_numpy(x)
    h = t @ torch.from_numpy(w16.astype(np.float32))
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    flat = torch.nn.functional.scaled_dot_product_attention(h, t, h, attn_mask=causal).reshape(2, 5, 8)
    rows, cols = torch.tensor([0, 1, 0]), torch.tensor([1, 4, 1])
    s = flat.clone().index_put_((rows, cols), flat[rows, cols] * 2, accumulate=True)
    expected_concat = torch.cat([s[..., :3].sum(-1, keepdim=True), s[..., 3:]], -1)
    expected_gelu = torch.nn.functional.gelu(s[..., :3], approximate="tanh")
    names = list(pkg.spec_outputs)
    # Two float32 evaluations, to first order: h = x @ w, the scores h . x and p @ h sum 8, 8
    # and 5 terms, the scatter adds one and the reduce 3 (29 in all), exp and tanh err by <= 4u
    # each. Every value is at most 9 max|h| <= 9 max(|x| @ |w|) (a is a mean of h's rows, s
    # adds twice a row, the reduce sums 3), and the softmax turns a relative error rel of the
    # scores into 2 max|score| rel of p: that gain multiplies the chain's relative error.
    magnitude = np.abs(x) @ np.abs(w16.astype(np.float32))
    gain = 1 + 2 * float((magnitude[..., :, None, :] * np.abs(x)[..., None, :, :]).sum(-1).max() / np.sqrt(8))
    bound = 2 * (gamma(29) + 8 * U32) * gain * 9 * float(magnitude.max())
    assert np.abs(out[names[0]] - expected_concat.numpy()).max() <= bound
    assert np.abs(out[names[1]] - expected_gelu.numpy()).max() <= 1.13 * bound


# ---- opset-dependent semantics and the ops added for coremltools' op tests ----------------------
def _saved(prog, target, tmp_path, name="prog", inputs=None):
    """`prog` converted to an fp32 ML Program of iOS `target`, saved, opened with the executor."""
    import coremltools as ct

    from coreml.package import open_package

    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=target, inputs=inputs,
                       compute_precision=ct.precision.FLOAT32)
    path = tmp_path / f"{name}.mlpackage"
    save_model(model, path)
    return open_package(path, backend="executor")


@pytest.mark.parametrize("output_dtype", ["int32", "uint16"])
@pytest.mark.parametrize("kind", ["reduce_argmax", "reduce_argmin"])
def test_ios17_arg_reductions_take_output_dtype(tmp_path, kind, output_dtype):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb

    @mb.program(input_specs=[mb.TensorSpec(shape=(3, 7))], opset_version=ct.target.iOS17)
    def prog(x):
        return getattr(mb, kind)(x=x, axis=1, keep_dims=True, output_dtype=output_dtype)

    pkg = _saved(prog, ct.target.iOS17, tmp_path)
    x = rng.standard_normal((3, 7)).astype(np.float32)
    out, = pkg.predict({"x": x}).values()
    ref = getattr(torch, kind.removeprefix("reduce_"))(torch.from_numpy(x), dim=1, keepdim=True)
    np.testing.assert_array_equal(out, ref.numpy())
    direct = run(kind, x=x, axis=1, output_dtype=output_dtype)
    assert direct.dtype == DTYPE_BY_NAME[output_dtype].numpy
    np.testing.assert_array_equal(direct, ref.numpy()[:, 0])


def test_an_output_of_unknown_rank_takes_the_rank_it_is_given(tmp_path):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    from coreml.mil import load_program

    from coremltools.converters.mil.mil import get_new_symbol

    # A shape of unknown length: fill's result has unknown rank.
    @mb.program(input_specs=[mb.TensorSpec(shape=(get_new_symbol(),), dtype=types.int32)],
                opset_version=ct.target.iOS18)
    def prog(shape):
        return mb.fill(shape=shape, value=2.5)

    pkg = _saved(prog, ct.target.iOS18, tmp_path,
                 inputs=[ct.TensorType(name="shape", shape=(ct.RangeDim(1, 4),), dtype=np.int32)])
    fill = next(op for op in load_program(pkg.mlpackage).functions["main"].block.operations if op.type == "fill")
    (_, spec), = fill.outputs
    assert not spec.rank_known and spec.shape == ()
    out, = pkg.predict({"shape": np.array([2, 1, 3], np.int32)}).values()
    np.testing.assert_array_equal(out, np.full((2, 1, 3), 2.5, np.float32))


def test_reshape_zeros_align_from_the_right_from_ios17_only():
    x = np.arange(100, dtype=np.float32).reshape(2, 50)
    # The iOS17 definition's own example: [1, 0, -1, 0] of [2, 50] is [1, 1, 2, 50].
    assert run("reshape", x=x, shape=np.array([1, 0, -1, 0]), opset=17).shape == (1, 1, 2, 50)
    assert run("reshape", x=x, shape=np.array([0, -1]), opset=17).shape == (2, 50)
    x3 = np.zeros((2, 3, 4), np.float32)
    assert run("reshape", x=x3, shape=np.array([0, 0, -1]), opset=17).shape == (2, 3, 4)
    assert run("reshape", x=x3, shape=np.array([-1, 0]), opset=17).shape == (6, 4)
    # iOS15/16: zeros copy dimensions only when the ranks agree (the builder rejects the rest).
    assert run("reshape", x=x3, shape=np.array([0, -1, 2]), opset=16).shape == (2, 6, 2)
    with pytest.raises(ValueError):
        run("reshape", x=x3, shape=np.array([-1, 0]), opset=16)


def test_the_executor_gives_reshape_its_programs_opset(tmp_path):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 50))], opset_version=ct.target.iOS17)
    def prog(x):
        return mb.reshape(x=x, shape=[1, 0, -1, 0])

    pkg = _saved(prog, ct.target.iOS17, tmp_path)
    assert pkg.executor.function.ios == 17
    x = rng.standard_normal((2, 50)).astype(np.float32)
    out, = pkg.predict({"x": x}).values()
    np.testing.assert_array_equal(out, x.reshape(1, 1, 2, 50))


SCATTER_DATA = np.array([[1, 2, 3], [4, 5, 6]], np.float32)
SCATTER_UPDATES = np.array([[5, 6, 7], [8, 9, 10]], np.float32)


def test_ios15_scatters_count_negative_indices_from_the_end():
    out = run("scatter", data=SCATTER_DATA, indices=np.array([-1, 0]), updates=SCATTER_UPDATES, opset=16)
    np.testing.assert_array_equal(out, [[9, 11, 13], [9, 11, 13]])
    out = run("scatter_nd", data=SCATTER_DATA, indices=np.array([[1, 0], [0, -1]]), updates=np.array([5.0, 10.0]),
              opset=15)
    np.testing.assert_array_equal(out, [[1, 2, 13], [9, 5, 6]])


def test_ios17_scatters_drop_out_of_bound_indices_unless_validated():
    # iOS17 scatter indices are non-negative; out of bounds is undefined without validate_indices
    # (coremltools' iOS17 TestScatter asserts Core ML does not give the wrapped result).
    out = run("scatter", data=SCATTER_DATA, indices=np.array([-1, 0]), updates=SCATTER_UPDATES, opset=17)
    np.testing.assert_array_equal(out, [[9, 11, 13], [4, 5, 6]])
    out = run("scatter", data=SCATTER_DATA, indices=np.array([10, 0]), updates=SCATTER_UPDATES, axis=0, opset=18)
    np.testing.assert_array_equal(out, [[9, 11, 13], [4, 5, 6]])
    idx = np.array([[-1, 0, 1], [1, 1, 0]])
    out = run("scatter_along_axis", data=SCATTER_DATA, indices=idx, updates=SCATTER_UPDATES, mode="add", opset=17)
    np.testing.assert_array_equal(out, [[1, 8, 13], [12, 14, 13]])  # wrapped, [1, 0] would be 17
    out = run("scatter_nd", data=SCATTER_DATA, indices=np.array([[1, 0], [0, 3]]), updates=np.array([5.0, 10.0]),
              opset=17)
    np.testing.assert_array_equal(out, [[1, 2, 3], [9, 5, 6]])


@pytest.mark.parametrize("indices", [[-1, 0], [2, 0]])
def test_ios17_validate_indices_makes_an_out_of_bound_index_an_error(indices):
    with pytest.raises(MilError, match="validate_indices"):
        run("scatter", data=SCATTER_DATA, indices=np.array(indices), updates=SCATTER_UPDATES, validate_indices=True,
            opset=17)
    with pytest.raises(MilError, match="validate_indices"):
        run("scatter_along_axis", data=SCATTER_DATA, indices=np.array([[indices[0], 0, 1], [1, 1, 0]]),
            updates=SCATTER_UPDATES, validate_indices=True, opset=17)
    with pytest.raises(MilError, match="validate_indices"):
        run("scatter_nd", data=SCATTER_DATA, indices=np.array([[indices[0], 0]]), updates=np.array([1.0]),
            validate_indices=True, opset=17)
    with pytest.raises(MilError, match="validate_indices"):
        run("gather", x=SCATTER_DATA, indices=np.array(indices), validate_indices=True, opset=17)
    with pytest.raises(MilError, match="validate_indices"):
        run("gather_along_axis", x=SCATTER_DATA, indices=np.array([[indices[0], 0, 1]]), validate_indices=True,
            opset=17)
    with pytest.raises(MilError, match="validate_indices"):
        run("gather_nd", x=SCATTER_DATA, indices=np.array([[indices[0], 0]]), validate_indices=True, opset=17)
    # Unvalidated, a gather still counts -D <= v < 0 from the end; iOS15/16 ignore validation.
    np.testing.assert_array_equal(run("gather", x=SCATTER_DATA, indices=np.array([-1, 0]), opset=17),
                                  SCATTER_DATA[[1, 0]])
    np.testing.assert_array_equal(run("gather", x=SCATTER_DATA, indices=np.array([-1, 0]), validate_indices=True,
                                      opset=16), SCATTER_DATA[[1, 0]])


def test_validated_scatter_fails_the_prediction_of_an_ios17_program(tmp_path):
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(input_specs=[mb.TensorSpec(shape=(2, 3)), mb.TensorSpec(shape=(2,), dtype=types.int32),
                             mb.TensorSpec(shape=(2, 3))], opset_version=ct.target.iOS17)
    def prog(data, indices, updates):
        return mb.scatter(data=data, indices=indices, updates=updates, validate_indices=True)

    pkg = _saved(prog, ct.target.iOS17, tmp_path)
    feed = {"data": SCATTER_DATA, "updates": SCATTER_UPDATES}
    out, = pkg.predict({**feed, "indices": np.array([1, 0], np.int32)}).values()
    np.testing.assert_array_equal(out, SCATTER_DATA + SCATTER_UPDATES[[1, 0]])
    with pytest.raises(MilError, match="op scatter.*validate_indices"):
        pkg.predict({**feed, "indices": np.array([-1, 0], np.int32)})


@pytest.mark.parametrize("axes", [[-1], [2, 3], [1, 3], [0, 1, 2, 3]])
def test_layer_norm_matches_torch(axes):
    axes_n = sorted(a % 4 for a in axes)
    gamma = rng.standard_normal([X.shape[a] for a in axes_n]).astype(np.float32)
    beta = rng.standard_normal(gamma.shape).astype(np.float32)
    out = run("layer_norm", x=X, axes=np.array(axes), gamma=gamma, beta=beta, epsilon=np.float32(1e-3))
    # torch normalizes trailing axes: move the normalized ones to the end and back.
    rest = [a for a in range(4) if a not in axes_n]
    t = torch.from_numpy(X).permute(*rest, *axes_n)
    ref = torch.nn.functional.layer_norm(t, gamma.shape, torch.from_numpy(gamma), torch.from_numpy(beta), eps=1e-3)
    ref = ref.permute(*np.argsort(rest + axes_n)).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    plain = torch.nn.functional.layer_norm(t, gamma.shape).permute(*np.argsort(rest + axes_n)).numpy()
    np.testing.assert_allclose(run("layer_norm", x=X, axes=np.array(axes)), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ascending", [False, True])
@pytest.mark.parametrize("axis", [-1, 1])
def test_topk_matches_torch(axis, ascending):
    values, indices = run("topk", x=X, k=3, axis=axis, ascending=ascending)
    ref = torch.topk(torch.from_numpy(X), 3, dim=axis, largest=not ascending, sorted=True)
    np.testing.assert_array_equal(values, ref.values.numpy())
    np.testing.assert_array_equal(indices, ref.indices.numpy())
    assert indices.dtype == np.int32


def test_topk_ios16_and_ios17_options():
    ties = np.array([[3, 1, 3, 2, 1]], np.uint8)
    values, indices = run("topk", x=ties, k=-1, output_indices_dtype="uint16")
    np.testing.assert_array_equal(values, [[3, 3, 2, 1, 1]])
    np.testing.assert_array_equal(indices, [[0, 2, 3, 1, 4]])  # ties in index order
    assert indices.dtype == np.uint16
    only = run("topk", x=X, k=2, return_indices=False)
    assert isinstance(only, np.ndarray)
    np.testing.assert_array_equal(only, torch.topk(torch.from_numpy(X), 2).values.numpy())
    np.testing.assert_array_equal(run("argsort", x=X, axis=2), torch.argsort(torch.from_numpy(X), 2, True).numpy())


@pytest.mark.parametrize("mode,torch_mode", [("constant", "constant"), ("reflect", "reflect"),
                                             ("replicate", "replicate")])
def test_pad_matches_torch(mode, torch_mode):
    pads = [1, 2, 0, 3]  # (before, after) of the last two axes, in MIL's order
    out = run("pad", x=X, pad=np.array(pads), mode=mode, constant_val=np.float32(0.5))
    # torch lists the pairs from the last axis backwards
    ref = torch.nn.functional.pad(torch.from_numpy(X), (0, 3, 1, 2), mode=torch_mode,
                                  **({"value": 0.5} if mode == "constant" else {}))
    np.testing.assert_array_equal(out, ref.numpy())


@pytest.mark.parametrize("equation", ["nchw,nwhu->nchu", "chw,whr->chr", "a b c d , a d c e -> a b c e"])
def test_einsum_matches_torch_with_batch_broadcasting(equation):
    if equation.replace(" ", "").index(",") == 4:  # batch axes n (-4) and h (-2) broadcast
        shapes, broadcast = [(2, 3, 1, 4), (1, 4, 5, 6)], [(2, 3, 5, 4), (2, 4, 5, 6)]
    else:  # batch axis h (-2) broadcasts
        shapes, broadcast = [(3, 1, 4), (4, 5, 6)], [(3, 5, 4), (4, 5, 6)]
    x, y = (rng.standard_normal(shape).astype(np.float32) for shape in shapes)
    out = run("einsum", values=(x, y), equation=equation)
    ref = torch.einsum(equation.replace(" ", ""), *(torch.from_numpy(np.broadcast_to(v, b).copy())
                                                    for v, b in zip((x, y), broadcast)))
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op_type,reference", [
    ("elu", lambda t: torch.nn.functional.elu(t, 0.7)),
    ("leaky_relu", lambda t: torch.nn.functional.leaky_relu(t, 0.7)),
    ("thresholded_relu", lambda t: torch.where(t < 0.7, 0.0, t)),
    ("relu6", torch.nn.functional.relu6),
    ("softsign", torch.nn.functional.softsign),
    ("cosh", torch.cosh),
    ("sinh", torch.sinh),
    ("tan", torch.tan),
])
def test_activations_match_torch(op_type, reference):
    kwargs = {"alpha": np.float32(0.7)} if op_type in ("elu", "leaky_relu", "thresholded_relu") else {}
    expected = reference(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(run(op_type, x=X, **kwargs), expected, rtol=1e-6, atol=1e-6)


def test_parametric_activations_follow_the_mil_definitions():
    a, b = np.float32(0.3), np.float32(1.5)
    t = torch.from_numpy(X)
    np.testing.assert_allclose(run("clamped_relu", x=X, alpha=a, beta=b),
                               torch.clamp(torch.where(t >= 0, t, a * t), max=float(b)).numpy(), rtol=1e-6)
    np.testing.assert_allclose(run("linear_activation", x=X, alpha=a, beta=b), (a * t + b).numpy(), rtol=1e-6)
    np.testing.assert_allclose(run("scaled_tanh", x=X, alpha=a, beta=b), (a * torch.tanh(b * t)).numpy(), rtol=1e-6)
    np.testing.assert_allclose(run("sigmoid_hard", x=X, alpha=a, beta=b), torch.clamp(a * t + b, 0, 1).numpy(),
                               rtol=1e-6)
    alpha = rng.uniform(0.1, 1, X.shape[1]).astype(np.float32)
    beta = rng.uniform(0.1, 1, X.shape[1]).astype(np.float32)
    np.testing.assert_allclose(run("prelu", x=X, alpha=alpha),
                               torch.nn.functional.prelu(t, torch.from_numpy(alpha)).numpy(), rtol=1e-6)
    per_channel = (1, -1, 1, 1)
    alpha_t, beta_t = torch.from_numpy(alpha.reshape(per_channel)), torch.from_numpy(beta.reshape(per_channel))
    ref = alpha_t * torch.nn.functional.softplus(t * beta_t)
    np.testing.assert_allclose(run("softplus_parametric", x=X, alpha=alpha, beta=beta), ref.numpy(), rtol=1e-5)


def test_reverse_and_the_added_reductions():
    np.testing.assert_array_equal(run("reverse", x=X, axes=np.array([0, -1])), X[::-1, :, :, ::-1])
    np.testing.assert_array_equal(run("reverse", x=X), X[::-1, ::-1, ::-1, ::-1])
    t = torch.from_numpy(X)
    np.testing.assert_allclose(run("reduce_l1_norm", x=X, axes=np.array([1, 2])), t.abs().sum((1, 2)).numpy(),
                               rtol=1e-6)
    np.testing.assert_allclose(run("reduce_log_sum", x=np.abs(X), axes=np.array([-1]), keep_dims=True),
                               t.abs().sum(-1, keepdim=True).log().numpy(), rtol=1e-6)
