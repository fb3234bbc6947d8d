"""The executor on fp16-typed programs: float32 inside each op, fp16 at its boundaries
(`coreml.mil.executor`'s accumulation model), against an independent float64 computation of
the same op on the same fp16 operands, rounded to fp16.

Bounds, per output element y (float64 reference y64, executor y16):
- a correctly rounded float32 op (add, mul, real_div, sqrt) rounded again to fp16 is the fp16
  rounding of the exact result (double rounding is innocuous when the wider format has at least
  2p + 2 bits: 24 >= 2 * 11 + 2), so these are equal bit for bit;
- any other op: the float32 result is within e of the exact one (e from its arithmetic, below),
  and the two fp16 roundings add at most one fp16 step at that magnitude:
  |y16 - fl16(y64)| <= e + spacing16(|y64| + e).
"""

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from coreml.manifest import save_model
from coreml.mil import ops as mil_ops
from coreml.package import open_package
from pipeline.ground.models.numerics import U32, gamma

SHAPE = (4, 1024)


def _package(tmp_path, name, build, specs):
    prog = mb.program(input_specs=[mb.TensorSpec(shape=s, dtype=types.fp16) for s in specs],
                      opset_version=ct.target.iOS18)(build)
    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                       compute_precision=ct.precision.FLOAT16)
    path = tmp_path / f"{name}.mlpackage"
    save_model(model, path)
    package = open_package(path, backend="executor")
    assert all(f.dtype.name == "fp16" for f in package.spec_inputs.values())
    return package


def _fp16(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float16)


def _step_bound(reference: np.ndarray, e) -> np.ndarray:
    """e plus one fp16 step at |reference| + e (the two roundings to fp16)."""
    magnitude = (np.abs(reference) + e).astype(np.float16).astype(np.float64)
    return e + np.spacing(magnitude.astype(np.float16)).astype(np.float64)


@pytest.mark.parametrize("name, build, exact", [
    ("add", lambda x, y: mb.add(x=x, y=y), np.add),
    ("mul", lambda x, y: mb.mul(x=x, y=y), np.multiply),
    ("real_div", lambda x, y: mb.real_div(x=x, y=y), np.divide),
    ("sqrt", lambda x, y: mb.sqrt(x=mb.abs(x=x)), lambda x, y: np.sqrt(np.abs(x))),
])
def test_correctly_rounded_ops_are_the_fp16_rounding_of_the_exact_result(tmp_path, name, build, exact):
    rng = np.random.default_rng(1)
    x, y = _fp16(rng, SHAPE, 3.0), _fp16(rng, SHAPE, 3.0)
    out = next(iter(_package(tmp_path, name, build, [SHAPE, SHAPE]).predict({"x": x, "y": y}).values()))
    assert out.dtype == np.float16
    expected = exact(x.astype(np.float64), y.astype(np.float64)).astype(np.float16)
    assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))


def test_a_sum_accumulates_in_float32_inside_the_op(tmp_path):
    """2048 and then 64 ones: fp16 accumulation would drop every one (2049 rounds back to 2048,
    fp16's step there being 2), float32 keeps them; 2112 is an fp16 value."""
    package = _package(tmp_path, "sum", lambda x: mb.reduce_sum(x=x, axes=[-1]), [(1, 65)])
    x = np.ones((1, 65), np.float16)
    x[0, 0] = 2048
    assert package.predict({"x": x})["reduce_sum_0"].tolist() == [2112.0]


def test_linear_is_a_float32_dot_rounded_once(tmp_path):
    rng = np.random.default_rng(2)
    weight = _fp16(rng, (16, SHAPE[1]), 0.05)
    x = _fp16(rng, SHAPE, 2.0)
    package = _package(tmp_path, "linear", lambda x: mb.linear(x=x, weight=weight), [SHAPE])
    out = next(iter(package.predict({"x": x}).values())).astype(np.float64)
    products = x.astype(np.float64) @ weight.astype(np.float64).T
    # A float32 dot of length K in any order errs by at most gamma_K * sum |x w| (numerics.gamma);
    # the float64 reference's own error is below gamma_K(2^-53) * the same sum, counted too.
    sums = np.abs(x.astype(np.float64)) @ np.abs(weight.astype(np.float64)).T
    e = (gamma(SHAPE[1]) + SHAPE[1] * 2.0**-53 / (1 - SHAPE[1] * 2.0**-53)) * sums
    reference = products.astype(np.float16).astype(np.float64)
    assert np.all(np.abs(out - reference) <= _step_bound(products, e))


def test_softmax_is_float32_inside_and_fp16_outside(tmp_path):
    rng = np.random.default_rng(3)
    x = _fp16(rng, SHAPE, 2.0)
    out = next(iter(_package(tmp_path, "softmax", lambda x: mb.softmax(x=x, axis=-1), [SHAPE])
                    .predict({"x": x}).values())).astype(np.float64)
    d = x.astype(np.float64) - x.astype(np.float64).max(-1, keepdims=True)
    p = np.exp(d) / np.exp(d).sum(-1, keepdims=True)
    # float32: x - max errs by u|d| (so exp by |d| u relative), exp itself by 2u (numpy's float32 exp
    # is within one ulp), the sum of K terms by gamma_K, the division by u: relative
    # gamma(K + 3 + max|d|) covers their sum to first order.
    e = gamma(SHAPE[1] + 3 + int(np.ceil(np.abs(d).max()))) * p
    assert np.all(np.abs(out - p.astype(np.float16).astype(np.float64)) <= _step_bound(p, e))


@pytest.mark.parametrize("name, build, exact, ulps", [
    ("exp", lambda x: mb.exp(x=x), np.exp, 2),  # numpy's float32 exp: within one float32 ulp, plus u for the input
    ("rsqrt", lambda x: mb.rsqrt(x=mb.abs(x=x), epsilon=1e-3), lambda x: 1 / np.sqrt(np.abs(x) + np.float64(np.float16(1e-3))), 3),
    ("silu", lambda x: mb.silu(x=x), lambda x: x / (1 + np.exp(-x)), 6),
])
def test_transcendental_ops_are_within_one_fp16_step(tmp_path, name, build, exact, ulps):
    """e = `ulps` float32 roundings of relative u each (the float32 steps each op takes: e.g. rsqrt
    adds epsilon, takes sqrt and divides), then the two fp16 roundings."""
    rng = np.random.default_rng(4)
    x = _fp16(rng, SHAPE, 2.0)
    out = next(iter(_package(tmp_path, name, build, [SHAPE]).predict({"x": x}).values())).astype(np.float64)
    y = exact(x.astype(np.float64))
    e = ulps * U32 * np.abs(y) / (1 - ulps * U32)
    assert np.all(np.abs(out - y.astype(np.float16).astype(np.float64)) <= _step_bound(y, e))


def test_no_op_function_sees_an_fp16_array(tmp_path, monkeypatch):
    """Every fp16 operand reaches the numpy functions widened to float32 (numpy's float16 loops
    round after every element, and its float16 matmul has no BLAS path)."""
    seen = []

    def spy(name, fn):
        def wrapped(**kwargs):
            seen.extend((name, key) for key, value in kwargs.items() for v in (value if isinstance(value, tuple) else (value,))
                        if isinstance(v, np.ndarray) and v.dtype == np.float16)
            return fn(**kwargs)
        return wrapped

    for name, definition in list(mil_ops.OPS.items()):
        monkeypatch.setitem(mil_ops.OPS, name, mil_ops.OpDef(spy(name, definition.fn), definition.lists))
    rng = np.random.default_rng(5)
    weight = _fp16(rng, (8, 8))

    def build(x):
        h = mb.linear(x=x, weight=weight)
        return mb.softmax(x=mb.mul(x=mb.matmul(x=h, y=h, transpose_y=True), y=np.float16(0.125)), axis=-1)

    package = _package(tmp_path, "spy", build, [(4, 8)])
    out = next(iter(package.predict({"x": _fp16(rng, (4, 8))}).values()))
    assert out.dtype == np.float16 and seen == []
