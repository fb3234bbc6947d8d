"""fp16 packages of the default fixture (`cmfdeploy coreml --precision fp16`): what the saved
program is typed as, what the manifest records and `verify_package` checks against it (a lie
is refused), the runners' fp16 caches, and the transform a conversion traces instead of the
reference. Their numerics against the fp16 reference are the gates' (not here).
"""

import json
import re
import shutil

import numpy as np
import pytest
import torch

from coreml.convert import export_coreml
from coreml.crosscheck import STORAGE_OPS
from coreml.kinds import KINDS
from coreml.kinds.export import Conversion, ScheduleMismatch, reference_for_export
from coreml.kinds.schedules import CheckSchedule
from coreml.manifest import verify_package
from coreml.mil.loader import load_program
from coreml.precisions import FP16, FP32, POSITIONAL_REASON, UnknownPrecision, precision
from coreml.runner import open_package_backend
from manifests.identity import sha256_file
from _coreml_models import doubled_final_norm
from _survey_models import cloze_slice
from pipeline.ground.errors import IdentityError
from pipeline.ground.models.numerics import model_logits_bound
from pipeline.ground.reference import load_reference

FLOAT_INTERFACE = {"logits", "key_cache", "value_cache", "new_key_cache", "new_value_cache"}


@pytest.fixture(scope="module")
def fp16_packages(fixture_bundle, tmp_path_factory):
    """chunk_kv and stateful at fp16, with a (stand-in) preflight report bound by sha256."""
    root = tmp_path_factory.mktemp("fp16")
    report = root / "preflight.json"
    report.write_text(json.dumps({"stand_in": "a report the conversion binds, not read"}))
    conversion = Conversion("fp16", preflight=str(report))
    manifests = export_coreml(fixture_bundle, root / "packages", kinds=("chunk_kv", "stateful"), conversion=conversion)
    return root / "packages", manifests, report


def _copy(manifest, tmp_path):
    copy = tmp_path / manifest.path.name
    shutil.copytree(manifest.path, copy)
    return copy


def _rewrite(package, change):
    path = package / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_precisions_are_registered_units():
    assert precision("fp32") is FP32 and precision("fp16") is FP16
    assert (FP16.compute_precision, FP16.float_dtype, FP16.compute_units) == ("float16", "float16", "CPU_AND_NE")
    assert FP16.default_budget == "ppl=0.5%,top1=0.99" and FP16.unit_roundoff == 2.0**-11
    assert KINDS["chunk_kv"].cache_dtype(FP16) is np.float16 and KINDS["chunk_kv"].cache_dtype(FP32) is np.float32
    assert KINDS["stateful"].cache_dtype(FP32) is np.float16 and KINDS["stateless"].cache_dtype(FP16) is None
    with pytest.raises(UnknownPrecision, match=r"--precision: precision 'fp8' is not among \['fp32', 'fp16'\]"):
        precision("fp8")


@pytest.mark.parametrize("value", [65504.0, -65504.0, 65505.0, -7e4, 1e37, 1e38, -3e38, np.inf, -np.inf, np.nan])
def test_the_fp16_pass_keeps_float32_exactly_where_coremltools_own_check_does(value):
    """The conversion's fp16 pass is coremltools' `add_fp16_cast` with its constant overflow check
    done block by block (a whole-constant check held four copies of SmolLM2's tied table). The
    reference is coremltools' own check, on each edge of its rule (fp16's largest finite 65504,
    1e38 standing for an infinity, NaN), placed in the second block of a constant."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil.passes.defs.quantization import add_fp16_cast
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
    from coreml.precisions import BLOCKWISE_FP16_PASS, OVERFLOW_CHECK_BLOCK, overflows_fp16

    constant = np.zeros(OVERFLOW_CHECK_BLOCK + 5, np.float32)
    constant[OVERFLOW_CHECK_BLOCK + 3] = value

    @mb.program(input_specs=[mb.TensorSpec(shape=constant.shape)])
    def program(x):
        return mb.add(x=x, y=constant)

    (add,) = [op for op in program.functions["main"].operations if op.op_type == "add"]
    FP16.ct_convert_options()  # registers the pass
    expected = add_fp16_cast.fp16_overflow(add)
    assert PASS_REGISTRY[BLOCKWISE_FP16_PASS].fp16_overflow(add) == expected
    assert overflows_fp16(constant) == expected
    assert expected == (65504 < abs(value) < 1e38)


def test_every_activation_op_is_fp16_and_only_the_positional_prologue_float32(fp16_packages):
    root, manifests, _ = fp16_packages
    for kind, manifest in manifests.items():
        block = manifest["package"]
        assert (block["precision"], block["compute_precision"], block["compute_units"]) == ("fp16", "float16", "CPU_AND_NE")
        features = {f["name"]: f["dtype"] for f in block["inputs"] + block["outputs"] + block.get("states", [])}
        assert {name: dtype for name, dtype in features.items() if name in FLOAT_INTERFACE} == {
            name: "float16" for name in features if name in FLOAT_INTERFACE}
        assert features["input_ids"] == features["position"] == "int32"
        program = load_program(manifest.path / "model.mlpackage")
        for name, function in program.functions.items():
            fp32 = {op.type for op in function.block.operations for _, spec in op.outputs
                    if spec is not None and spec.dtype.name == "fp32" and op.type not in STORAGE_OPS}
            # RoPE and positions only: the ops named by the manifest's reason, and nothing on activations.
            assert fp32 <= {"add", "sub", "mul", "cumsum", "reduce_sum", "expand_dims", "concat", "cos", "sin",
                            "fill_like", "fill", "slice_by_index"}, (kind, name, fp32)
            assert {"cos", "sin"} <= fp32
            assert {op.type for op in function.block.operations for _, spec in op.outputs
                    if spec is not None and spec.dtype.name == "fp16"} >= {"linear", "matmul", "softmax", "rsqrt"}
        assert block["fp32_ops"]["reason"] == POSITIONAL_REASON
        assert set(block["fp32_ops"]["ops"]) == set(program.functions)
        # Weights are the reference's, rounded to fp16, and named.
        assert "model.embed_tokens.weight" in {n for names in block["weights"].values() for n in names}
        assert "checked_against" in manifest["checks"]
        verify_package(manifest.path)


def test_the_chunk_kv_runner_feeds_fp16_caches(fp16_packages):
    root, manifests, _ = fp16_packages
    backend = open_package_backend(manifests["chunk_kv"].path, backend="executor")
    ids = np.arange(5, 14, dtype=np.int32)
    logits, snapshot = backend.prefill(ids)
    assert snapshot.key_cache.dtype == np.float16 and snapshot.value_cache.dtype == np.float16
    assert logits.dtype == np.float32 and logits.shape == (9, manifests["chunk_kv"]["architecture"]["vocab_size"])
    assert np.isfinite(logits).all()
    # Chunks through the runner agree with one shot: both are the package's own fp16 arithmetic.
    chunked = backend.chunks.run_schedule(ids, [4, 1, 4])[0]
    assert np.array_equal(chunked.argmax(-1), logits.argmax(-1))


def test_the_manifest_binds_the_preflight_report(fp16_packages, tmp_path):
    root, manifests, report = fp16_packages
    record = manifests["chunk_kv"]["numerics"]["preflight"]
    assert record["sha256"] == sha256_file(report)
    assert (manifests["chunk_kv"].path / record["path"]).resolve() == report.resolve()
    package = tmp_path / "packages" / "chunk_kv"
    shutil.copytree(manifests["chunk_kv"].path, package)
    shutil.copyfile(report, tmp_path / "preflight.json")
    verify_package(package)
    (tmp_path / "preflight.json").write_text("{}")
    with pytest.raises(IdentityError, match=r"field 'numerics.preflight.sha256' is .*, but .*preflight.json has sha256"):
        verify_package(package)


@pytest.mark.parametrize("lie, message", [
    (lambda m: m["package"].update(compute_precision="float32", precision="fp32"),
     r"field 'package.compute_precision' is 'float32', but the program .* says 'float16'"),
    (lambda m: m["package"].update(precision="fp32"),
     r"field 'package.precision' is 'float32', but package.compute_precision"),
    (lambda m: m["package"]["fp32_ops"].update(ops={}),
     r"field 'package.fp32_ops.ops' is \{\}, but the program's float32 arithmetic ops"),
    (lambda m: m["package"]["outputs"][0].update(dtype="float32"),
     r"field 'package.outputs\[logits\].dtype' is 'float32', but the program .* says 'float16'"),
    (lambda m: m["package"].update(compute_units="NEURAL"),
     r"field 'package/compute_units': 'NEURAL' is not one of"),
], ids=["precision", "precision-name", "fp32-ops", "output-dtype", "units"])
def test_verify_refuses_a_manifest_that_lies_about_precision(fp16_packages, tmp_path, lie, message):
    package = _copy(fp16_packages[1]["chunk_kv"], tmp_path)
    _rewrite(package, lie)
    with pytest.raises(IdentityError, match=message):
        verify_package(package, hashes=False)


def test_an_fp32_package_cannot_claim_the_neural_engine(fixture_packages, tmp_path):
    package = tmp_path / "chunk_kv"
    shutil.copytree(fixture_packages / "chunk_kv", package)
    manifest = json.loads((package / "manifest.json").read_text())
    assert (manifest["package"]["precision"], manifest["package"]["compute_units"]) == ("fp32", "CPU_ONLY")
    assert manifest["package"]["fp32_ops"] == {} and "numerics" not in manifest
    _rewrite(package, lambda m: m["package"].update(compute_units="CPU_AND_NE"))
    with pytest.raises(IdentityError, match=r"'package.compute_units' is 'CPU_AND_NE', which a fp32 package cannot "
                                            r"run on; it may claim \['CPU_ONLY', 'CPU_AND_GPU'\]"):
        verify_package(package, hashes=False)


def test_the_conversion_traces_the_transform_it_is_handed(fixture_bundle, tmp_path):
    """A transform (`Conversion.transform`, how the fp16 preflight's mitigations reach the
    conversion) is what the package computes and what its manifest records; here one that
    doubles every logit, converted at FP32 so the package is held to FP32's bound."""
    record = {"final_norm": "doubled"}
    conversion = Conversion("fp32", transform="_coreml_models:doubled_final_norm", mitigations=record)
    manifest = export_coreml(fixture_bundle, tmp_path / "out", kinds=("chunk_kv",), conversion=conversion)["chunk_kv"]
    assert manifest["numerics"] == {"mitigations": {"transform": "_coreml_models:doubled_final_norm", "record": record}}
    model, args, _ = load_reference(fixture_bundle)
    doubled = doubled_final_norm(model, args, record)
    ids = np.arange(20, 36, dtype=np.int32)
    with torch.no_grad():
        reference = model(torch.from_numpy(ids).long()).numpy()
    logits = open_package_backend(manifest.path, backend="executor").logits(ids)
    # float32 package vs float32 transformed model: summation order only (doubling a weight scales
    # every later value by 2 exactly, so the doubled model's logits are 2 * reference bit for bit);
    # the reference's own logits are half of them, far outside that bound.
    bound = model_logits_bound(doubled, len(ids))
    assert np.abs(logits - 2 * reference).max() <= bound
    assert np.abs(logits - reference).max() > 100 * bound
    verify_package(manifest.path)


class _StatefulStandIn(torch.nn.Module):
    """A traced stateful function's stand-in: a subclass's forward over `graph`, holding the graph's
    own buffers (the check copies the eager graph's caches into them)."""

    def __init__(self, graph):
        super().__init__()
        self.inner = graph
        self.key_cache, self.value_cache = graph.key_cache, graph.value_cache  # the same tensors


def test_the_stateful_trace_check_refuses_a_function_that_ignores_position_or_computes_nan(fixture_bundle):
    """Below float32 the stateful functions are checked as traced, before conversion
    (`Stateful.check_traced`); one that writes every chunk at position 0 is refused, and so is one
    whose last chunk computes NaN."""
    ref = reference_for_export(fixture_bundle, conversion=Conversion("fp16"))
    kind = KINDS["stateful"]
    graph = kind.graph(ref)

    class ForgetsPosition(_StatefulStandIn):
        def forward(self, ids, position):
            return self.inner(ids, torch.zeros_like(position))

    errors = kind.check_traced(graph, ref, "prefill", (CheckSchedule((1, 3, 4)),))
    assert list(errors) == ["prefill[1,3,4]"] and errors["prefill[1,3,4]"] <= ref.tolerance
    with pytest.raises(ScheduleMismatch, match=r"traced stateful prefill on prefill\[1,3,4\] differs from the "
                                               r"fp16-cache torch graph by max \|Δ logit\| "):
        kind.check_traced(ForgetsPosition(graph), ref, "prefill", (CheckSchedule((1, 3, 4)),))

    class NaNInTheLastChunk(ForgetsPosition):
        def forward(self, ids, position):
            logits = self.inner(ids, position)
            return logits.masked_fill(position >= 4, float("nan"))

    # A NaN after finite chunks: a running max (Python's) would keep the finite value over it.
    with pytest.raises(ScheduleMismatch, match=r"max \|Δ logit\| nan"):
        kind.check_traced(NaNInTheLastChunk(graph), ref, "prefill", (CheckSchedule((1, 3, 4)),))


def test_the_stateful_trace_check_from_a_synthetic_prefix_refuses_a_function_that_forgets_it(fixture_bundle):
    """A schedule near the context's end starts the traced function and the eager graph from the
    same noise below it: the right function passes, and one that empties its state before each
    call passes from slot 0 (a fresh state is empty) but is refused from the prefix."""
    ref = reference_for_export(fixture_bundle, conversion=Conversion("fp16"))
    kind = KINDS["stateful"]
    graph = kind.graph(ref)
    at_end = CheckSchedule((3, 1), -4)
    name = f"prefill@{ref.context - 4}[3,1]"
    assert kind.check_traced(graph, ref, "prefill", (at_end,))[name] <= ref.tolerance

    class ForgetsItsState(_StatefulStandIn):
        def forward(self, ids, position):
            self.key_cache.zero_()
            self.value_cache.zero_()
            return self.inner(ids, position)

    # One chunk each: only what the state held before the schedule can tell.
    assert kind.check_traced(ForgetsItsState(graph), ref, "prefill", (CheckSchedule((4,)),))
    with pytest.raises(ScheduleMismatch, match=re.escape(f"on prefill@{ref.context - 4}[4] differs")):
        kind.check_traced(ForgetsItsState(graph), ref, "prefill", (CheckSchedule((4,), -4),))


@pytest.mark.parametrize("recipe, claims_ane", [("int4-b32", False), ("palette4-int8lut", True), ("palette6-gc32", True),
                                               ("int8-pc", True)])
def test_an_fp16_package_compresses_to_fp16_weights_and_stays_exact(fp16_packages, tmp_path, recipe, claims_ane):
    """A recipe's codes decode to the constant they replace, in its dtype: in an fp16 program an fp16
    weight (every linear reads its weight and bias in one dtype; an fp32 decode broke the program),
    an fp32 LUT rounded to fp16 where it is written. The gate's exactness part holds the compressed
    package to the fp16 reference of its own decoded weights, and per-block scales are the GPU's."""
    from conftest import FIXTURE_REFERENCE

    from coreml.ane import ane_report
    from coreml.recipes import compress_package
    from pipeline.stages.gates import align_package

    packages, _, _ = fp16_packages
    out = tmp_path / recipe
    compress_package(packages / "chunk_kv", recipe, out)
    verify_package(out)
    operations = load_program(out / "model.mlpackage").functions["main"].block.operations
    dtype_of = {name: spec.dtype.name for op in operations for name, spec in op.outputs if spec is not None}
    weights = {dtype_of[op.inputs["weight"][0].name] for op in operations if op.type == "linear"}
    assert weights == {"fp16"}
    assert ("ane" in ane_report(out / "model.mlpackage")["compute_units"]) == claims_ane
    # Exactness is the point here, so quality scores a CI-sized slice of the items.
    gate = align_package(out, FIXTURE_REFERENCE, tmp_path / "gate", budget="ppl=1000%,top1=0",
                         items=cloze_slice(tmp_path / "items.jsonl"))
    assert gate.report["summary"]["exact"], gate.report["summary"]


def test_hot_rows_are_refused_on_an_fp16_package_before_any_calibration(fp16_packages, tmp_path):
    """Its head sums two products, each rounded to fp16 apart in an fp16 program: a bound not derived."""
    from coreml.recipes import RecipePrecondition, compress_package

    packages, _, _ = fp16_packages
    with pytest.raises(RecipePrecondition, match="FP32 programs only.*float16"):
        compress_package(packages / "chunk_kv", "gptq-int4-b32-zp-hot", tmp_path / "hot", calibration_ids=np.arange(300))
    assert not (tmp_path / "hot").exists()


def test_a_compressed_fp16_package_is_held_to_the_compression_budget(fp16_packages, tmp_path):
    """fp16's default budget bounds fp16 rounding, which the uncompressed package answers for; a
    recipe's loss is held to the compression budget on every target (what an fp16 survey uses)."""
    from coreml.recipes import compress_package
    from manifests.identity import load_manifest
    from pipeline.stages.gates import default_budget
    from pipeline.stages.gates.budget import COMPRESSED_BUDGET

    packages, _, _ = fp16_packages
    compress_package(packages / "chunk_kv", "int8-pc", tmp_path / "int8-pc")
    assert default_budget(load_manifest(packages / "chunk_kv")) == "ppl=0.5%,top1=0.99"
    assert default_budget(load_manifest(tmp_path / "int8-pc")) == COMPRESSED_BUDGET == "ppl=2%,top1=0.95"
    assert default_budget(load_manifest(packages / "chunk_kv"), compressed=True) == COMPRESSED_BUDGET


def test_a_compressed_gemma3_package_with_a_residual_scale_is_gated_on_its_own_gains(tmp_path):
    """Gemma's residual scale moves into its post-norms' gains, which become plain gains
    fl(1 + w) x alpha: the package stores them so, and the gates' reference of a compressed
    package is rebuilt from them (`fp16.moved_gains`), not refused, and computes what the package
    computes, within the fp16 bound."""
    from _hf_models import save_hf_model

    from coreml.recipes.compress import compress_package
    from pipeline.ground.models.fp16 import Fp16Mitigations
    from pipeline.ground.models.numerics import fp16_logits_bound
    from pipeline.stages.bundle import export_bundle
    from pipeline.stages.gates.references import intended_references
    from pipeline.stages.importers.hf import import_hf
    from pipeline.stages.importers.quant_policy import QuantPolicy

    save_hf_model("gemma3", tmp_path / "hf", seed=12)
    import_hf(tmp_path / "hf", tmp_path / "m.cmf", policy=QuantPolicy("f32"))
    export_bundle(tmp_path / "m.cmf", tmp_path / "bundle")
    mitigations = Fp16Mitigations(residual_scale=0.125, rmsnorm="max_scaled")
    conversion = Conversion("fp16", transform="pipeline.ground.models.fp16:mitigated_from_record",
                            mitigations=mitigations.to_record())
    package = export_coreml(tmp_path / "bundle", tmp_path / "coreml", kinds=("chunk_kv",), context=32,
                            conversion=conversion)["chunk_kv"]
    out = compress_package(package.path, "int8-pc", tmp_path / "int8-pc")
    intended, _ = intended_references(out.path, out.data, tmp_path / "bundle")
    ids = (np.arange(24) * 5 + 3) % 128
    got = open_package_backend(out.path, backend="executor").logits(ids)
    want = intended.logits(ids)
    model = load_reference(tmp_path / "bundle")[0]
    assert np.isfinite(got).all() and np.abs(got - want).max() <= fp16_logits_bound(model, len(ids), probable=True)
