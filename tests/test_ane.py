"""The static Neural Engine check (`coreml.ane`) on small programs: each check passes on one
and fails on another, and the compute units follow from the verdicts."""

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from coreml.ane import HW_LIMIT, ane_report
from coreml.manifest import save_model


def _save(prog, tmp_path, name, precision=ct.precision.FLOAT16, inputs=None):
    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                       compute_precision=precision, inputs=inputs)
    path = tmp_path / f"{name}.mlpackage"
    save_model(model, path)
    return path


def _linear(rows: int, cols: int = 8, shape=(1, 4, 8)):
    weight = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)

    @mb.program(input_specs=[mb.TensorSpec(shape=shape)], opset_version=ct.target.iOS18)
    def prog(x):
        return mb.softmax(x=mb.linear(x=x, weight=weight), axis=-1)

    return prog


def _checks(path, function="main") -> dict[str, dict]:
    report = ane_report(path)
    return {c["check"]: c for c in report["functions"][function]["checks"]}, report["compute_units"]


def test_an_fp16_program_of_fixed_shapes_may_claim_the_neural_engine(tmp_path):
    checks, units = _checks(_save(_linear(16), tmp_path, "fp16"))
    assert {name: c["verdict"] for name, c in checks.items()} == {
        "fp16_compute": "pass", "fixed_shapes": "pass", "dimension_limits": "pass", "weight_compression": "pass",
        "no_input_output_alias": "pass"}
    assert units == ["cpu", "gpu", "ane"]


def test_a_float32_program_stays_on_cpu_and_gpu(tmp_path):
    checks, units = _checks(_save(_linear(16), tmp_path, "fp32", ct.precision.FLOAT32))
    assert checks["fp16_compute"]["verdict"] == "fail"
    assert "computes in float32" in checks["fp16_compute"]["detail"]
    assert units == ["cpu", "gpu"]


def _positional_program():
    """A fresh program each time: ct.convert rewrites the one it is given."""
    weight = np.ones((8, 8), np.float32)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 8)), mb.TensorSpec(shape=(1,), dtype=types.int32)],
                opset_version=ct.target.iOS18)
    def prog(x, position):
        angle = mb.mul(x=mb.cast(x=position, dtype="fp32"), y=np.float32(0.5))  # positional
        h = mb.linear(x=x, weight=weight)
        return mb.add(x=h, y=mb.cos(x=angle))

    return prog


def test_float32_arithmetic_on_activations_fails_but_a_positional_prologue_passes(tmp_path):
    def keep(op):  # float32: the positional cos, and (for the failing case) the linear too
        return op.op_type not in ("mul", "cos") + (("linear",) if keep.activations else ())

    for activations, verdict in ((False, "pass"), (True, "fail")):
        keep.activations = activations
        path = _save(_positional_program(), tmp_path, f"mixed-{activations}",
                     ct.transform.FP16ComputePrecision(op_selector=keep))
        check = _checks(path)[0]["fp16_compute"]
        assert check["verdict"] == verdict, check
        if activations:
            assert "float32 arithmetic on activations: linear" in check["detail"]
        else:
            assert "positional prologue (2 ops: cos, mul)" in check["detail"]


def test_a_flexible_range_fails_and_enumerated_shapes_pass(tmp_path):
    import torch

    traced = torch.jit.trace(torch.nn.ReLU().eval(), torch.zeros(1, 4, 8))
    ranged = [ct.TensorType("x", shape=(1, ct.RangeDim(1, 64, default=4), 8))]
    enumerated = [ct.TensorType("x", shape=ct.EnumeratedShapes(shapes=[(1, 1, 8), (1, 4, 8), (1, 64, 8)],
                                                                default=(1, 4, 8)))]
    check = _checks(_save(traced, tmp_path, "ranged", inputs=ranged))[0]["fixed_shapes"]
    assert check["verdict"] == "fail" and check["detail"] == "input 'x' takes a range [[1, 64]]"
    check = _checks(_save(traced, tmp_path, "enumerated", inputs=enumerated))[0]["fixed_shapes"]
    assert check["verdict"] == "pass" and "enumerated (x)" in check["detail"]


def test_a_head_wider_than_the_limit_fails_until_split(tmp_path):
    checks, units = _checks(_save(_linear(HW_LIMIT + 8), tmp_path, "wide"))
    assert checks["dimension_limits"]["verdict"] == "fail"
    assert f"axis 0 = {HW_LIMIT + 8} > {HW_LIMIT} (H)" in checks["dimension_limits"]["detail"]  # the weight
    assert f"axis 2 = {HW_LIMIT + 8} > {HW_LIMIT} (W)" in checks["dimension_limits"]["detail"]  # the output
    assert units == ["cpu", "gpu"]
    assert _checks(_save(_linear(HW_LIMIT), tmp_path, "at-limit"))[0]["dimension_limits"]["verdict"] == "pass"


@pytest.mark.parametrize("config, verdict, detail", [
    ("palette", "pass", "constexpr_lut_to_dense"),
    ("per_channel", "pass", "constexpr_blockwise_shift_scale"),
    ("per_block", "fail", "per-block scale [64, 2] of data [64, 64] (per-block quantization is the GPU's)"),
])
def test_palettes_and_per_channel_codes_pass_per_block_fails(tmp_path, config, verdict, detail):
    import coremltools.optimize.coreml as cto

    op_config = {
        "palette": cto.OpPalettizerConfig(mode="uniform", nbits=4, weight_threshold=0),
        "per_channel": cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel",
                                                   weight_threshold=0),
        "per_block": cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block",
                                                 block_size=32, weight_threshold=0),
    }[config]
    model = ct.models.MLModel(str(_save(_linear(64, 64, (1, 4, 64)), tmp_path, "dense")), skip_model_load=True)
    optimize = cto.palettize_weights if config == "palette" else cto.linear_quantize_weights
    compressed = optimize(model, cto.OptimizationConfig(global_config=op_config))
    path = tmp_path / f"{config}.mlpackage"
    save_model(compressed, path)
    check = _checks(path)[0]["weight_compression"]
    assert check["verdict"] == verdict and detail in check["detail"], check


def test_an_input_returned_as_an_output_fails(tmp_path):
    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 8)), mb.TensorSpec(shape=(1, 8))], opset_version=ct.target.iOS18)
    def prog(x, y):
        return mb.add(x=x, y=y), y

    path = _save(prog, tmp_path, "alias")
    check = _checks(path)[0]["no_input_output_alias"]
    assert check["verdict"] == "fail" and "is input 'y' itself" in check["detail"], check


def _lookup(computed_indices: bool):
    """A gather of a [HW_LIMIT + 8, 8] table: by the int input itself (the token lookup), or by
    indices computed from a float input's values."""
    table = np.random.default_rng(1).standard_normal((HW_LIMIT + 8, 8)).astype(np.float32)

    @mb.program(input_specs=[mb.TensorSpec(shape=(1, 4), dtype=types.int32), mb.TensorSpec(shape=(1, 4, 8))],
                opset_version=ct.target.iOS18)
    def prog(ids, x):
        indices = mb.reduce_argmax(x=x, axis=-1) if computed_indices else mb.slice_by_index(x=ids, begin=[0, 0], end=[1, 4])
        return mb.add(x=mb.gather(x=table, indices=indices, axis=0), y=x)

    return prog


def test_the_token_lookups_wide_table_is_named_and_any_other_wide_gather_fails(tmp_path):
    check = _checks(_save(_lookup(False), tmp_path, "lookup"))[0]["dimension_limits"]
    assert check["verdict"] == "pass", check
    assert f"the token lookup's table is past them (const -> " in check["detail"]
    assert f"[{HW_LIMIT + 8}, 8]: axis 0 = {HW_LIMIT + 8} > {HW_LIMIT} (H))" in check["detail"]
    check = _checks(_save(_lookup(True), tmp_path, "computed"))[0]["dimension_limits"]
    assert check["verdict"] == "fail", check
    assert "(a gather table whose indices an activation reaches)" in check["detail"]
