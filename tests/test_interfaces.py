"""Stateful packages in the interfaces Swift loaders assert (`cmfdeploy coreml --interface`,
coreml/interfaces.py, docs/INTERFACES.md): the default fixture converted in each, every saved
program read back and held to the names, dtypes and shapes the Swift source asserts, its logits
against the cmfdeploy package's for the same tokens (a prefill, then decodes) fed both as the
gates feed it and as the loader does, its gate, the cross-check's refusal of a manifest naming
another interface, and RELEASE.md's snippets in each.
"""

import json
import shutil

import coremltools as ct
import numpy as np
import pytest
from coremltools.proto import FeatureTypes_pb2

from _survey_models import cloze_slice, greedy_of_release_and_survey
from conftest import FIXTURE_REFERENCE
from coreml.convert import export_coreml
from coreml.interfaces import INTERFACES, InterfaceMismatch, UnknownInterface, loader_interface
from coreml.kinds.export import Conversion
from coreml.manifest import verify_package
from coreml.package import open_package
from coreml.runner import open_package_backend
from manifests.identity import MANIFEST_NAME, inventory, read_json, write_json
from pipeline.cli import main
from pipeline.ground.errors import IdentityError
from pipeline.stages.gates import align_package
from pipeline.stages.gates.exactness import NOISE_FACTOR
from pipeline.stages.release import prediction_lines, usage_markdown

CONTEXT = 128  # the fixture's
# The fixture's cache: (layers, batch, kv_heads, context, head_dim), both loaders' layout.
CACHE_SHAPE = [4, 1, 2, CONTEXT, 32]
FLOAT16, FLOAT32, INT32 = (FeatureTypes_pb2.ArrayFeatureType.FLOAT16, FeatureTypes_pb2.ArrayFeatureType.FLOAT32,
                           FeatureTypes_pb2.ArrayFeatureType.INT32)

# causal-lm: finnvoor/CoreMLPipelines at d0506042ff753509b88a8e2ff15429072602c0bb.
CAUSAL_LM_TOKENS = "input_ids"  # Sources/CoreMLPipelines/Models/CausalLMModel.swift:9 asserts it, :45 feeds it
CAUSAL_LM_MASK = "causal_mask"  # CausalLMModel.swift:10 asserts it, :46 feeds it, MLShapedArray<Float16> (:39)
CAUSAL_LM_LOGITS = "logits"  # CausalLMModel.swift:11 asserts it; :43-50 reads it as MLShapedArray<Float16>
# The state the sample makes with makeState() (CausalLMModel.swift:67-68), as its converter names
# it: coremlpipelinestools/CausalLM.py:105-106 and :153-162 (float16, (layers, batch, kv_heads, context, head_dim)).
CAUSAL_LM_STATES = ("key_cache", "value_cache")

# swift-transformers: tag 1.3.0, Sources/Models/LanguageModel.swift.
ST_TOKENS = "inputIds"  # Keys.inputIds (:139), its range read by contextRange (:92, :95-123)
ST_MASK = "causalMask"  # Keys.causalMask (:141), fed as Float16 zeros [1, 1, 1, tokenCount + 1] (:543-551)
ST_STATES = ("keyCache", "valueCache")  # Keys.keyCache/valueCache (:142-143), required by :269-277
ST_LOGITS = "logits"  # Keys.logits (:145), asserted at :554
ST_NAME_KEY = "co.huggingface.exporters.name"  # the one metadata key it reads (:227-238)


@pytest.fixture(scope="module")
def packages(fixture_bundle, fixture_stateful, tmp_path_factory):
    """interface -> its stateful package: swift-transformers at FP32 beside the session's
    cmfdeploy FP32 package, causal-lm (whose loader reads fp16 logits) at fp16 beside a
    cmfdeploy fp16 package."""
    root = tmp_path_factory.mktemp("interfaces")
    report = root / "preflight.json"
    report.write_text(json.dumps({"stand_in": "a report the conversion binds, not read"}))

    def convert(interface: str, precision: str):
        conversion = Conversion(precision, interface=interface, preflight=str(report) if precision == "fp16" else None)
        out = root / f"{interface}-{precision}"
        return export_coreml(fixture_bundle, out, kinds=("stateful",), conversion=conversion)["stateful"].path

    return {"cmfdeploy-fp32": fixture_stateful, "swift-transformers": convert("swift-transformers", "fp32"),
            "cmfdeploy-fp16": convert("cmfdeploy", "fp16"), "causal-lm": convert("causal-lm", "fp16")}


@pytest.fixture(scope="module")
def gates(packages, tmp_path_factory):
    """Each Swift interface's package through the alignment gate: name -> report."""
    root = tmp_path_factory.mktemp("interface-gates")
    items = cloze_slice(root / "items.jsonl")
    results = {name: align_package(packages[name], FIXTURE_REFERENCE, root / name, items=items)
               for name in ("swift-transformers", "causal-lm")}
    return {name: result.report for name, result in results.items()}


def _ranges(feature) -> list[tuple[int, int]]:
    return [(r.lowerBound, r.upperBound) for r in feature.type.multiArrayType.shapeRange.sizeRanges]


def _spec(package):
    return ct.utils.load_spec(str(package / "model.mlpackage"))


def test_interfaces_are_registered_units():
    assert list(INTERFACES) == ["cmfdeploy", "causal-lm", "swift-transformers"]
    assert loader_interface("swift-transformers").key_cache == ST_STATES[0]
    with pytest.raises(UnknownInterface, match=r"--interface: interface 'mlx' is not among \['cmfdeploy', "):
        loader_interface("mlx")


def test_the_causal_lm_package_has_what_the_causal_lm_model_sample_asserts(packages):
    spec = _spec(packages["causal-lm"])
    description = spec.description
    # One function: the sample runs the loaded model's default function for every call.
    assert list(description.functions) == [] and description.defaultFunctionName == ""
    inputs = {f.name: f for f in description.input}
    assert list(inputs) == [CAUSAL_LM_TOKENS, CAUSAL_LM_MASK]
    assert inputs[CAUSAL_LM_TOKENS].type.multiArrayType.dataType == INT32
    assert _ranges(inputs[CAUSAL_LM_TOKENS]) == [(1, 1), (1, CONTEXT)]
    assert inputs[CAUSAL_LM_MASK].type.multiArrayType.dataType == FLOAT16
    assert _ranges(inputs[CAUSAL_LM_MASK]) == [(1, 1), (1, 1), (1, CONTEXT), (1, CONTEXT)]
    assert [s.name for s in description.state] == list(CAUSAL_LM_STATES)
    for state in description.state:
        assert state.type.stateType.arrayType.dataType == FLOAT16
        assert list(state.type.stateType.arrayType.shape) == CACHE_SHAPE
    assert [(o.name, o.type.multiArrayType.dataType) for o in description.output] == [(CAUSAL_LM_LOGITS, FLOAT16)]
    assert dict(description.metadata.userDefined)["cmfdeploy.interface"] == "causal-lm"
    assert json.loads((packages["causal-lm"] / "manifest.json").read_text())["package"]["interface"] == "causal-lm"


def test_the_swift_transformers_package_has_what_language_model_reads(packages):
    description = _spec(packages["swift-transformers"]).description
    assert list(description.functions) == [] and description.defaultFunctionName == ""
    inputs = {f.name: f for f in description.input}
    assert list(inputs) == [ST_TOKENS, ST_MASK]
    assert inputs[ST_TOKENS].type.multiArrayType.dataType == INT32
    # A range whose ends differ by more than 1: LanguageModelWithStatefulKVCache's guard (:499-503).
    assert _ranges(inputs[ST_TOKENS]) == [(1, 1), (1, CONTEXT)]
    assert inputs[ST_MASK].type.multiArrayType.dataType == FLOAT16
    # 1.3 sends one row for every query and tokenCount + 1 columns: up to the context's plus one.
    assert _ranges(inputs[ST_MASK]) == [(1, 1), (1, 1), (1, CONTEXT), (1, CONTEXT + 1)]
    assert [s.name for s in description.state] == list(ST_STATES)
    assert all(list(s.type.stateType.arrayType.shape) == CACHE_SHAPE for s in description.state)
    # Read as an MLTensor of any float type; at FP32 the package's own float32.
    assert [(o.name, o.type.multiArrayType.dataType) for o in description.output] == [(ST_LOGITS, FLOAT32)]
    metadata = dict(description.metadata.userDefined)
    assert metadata[ST_NAME_KEY] == "botchan-llama-1m" and metadata["cmfdeploy.interface"] == "swift-transformers"


def _runner_logits(package, ids, prompt: int):
    """Logits of `ids` as the gates feed the package: a prefill of `prompt` tokens, then one
    token a call (StatefulRunner, the interface's inputs built from each position)."""
    return open_package_backend(package, backend="executor").chunks.run_schedule(
        ids, [prompt] + [1] * (len(ids) - prompt))[0]


def _causal_lm_sample_mask(size: int) -> np.ndarray:
    """MLTensor.causalMask(size:) of CoreMLPipelines (MLTensor+Extensions.swift:4-13):
    (bandPart(ones, lower: -1, upper: 0) - 1) * Float16.greatestFiniteMagnitude."""
    lower = np.tril(np.ones((size, size), np.float16))
    return ((lower - np.float16(1)) * np.finfo(np.float16).max)[None, None]


def _as_its_loader_feeds(name: str, package, ids, prompt: int):
    """Logits of `ids` fed as the Swift loader feeds them, on one state: the prompt in one call,
    then each next token alone (swift-transformers: LanguageModel.swift:524-551; causal-lm:
    TextGenerationPipeline.swift:172-177 and :200-204)."""
    model = open_package(package, backend="executor")
    state, rows = model.make_state(), []
    for end in [prompt] + list(range(prompt + 1, len(ids) + 1)):
        tokens = ids[None, :end] if end == prompt else ids[None, end - 1:end]
        if name == "swift-transformers":
            inputs = {ST_TOKENS: tokens, ST_MASK: np.zeros((1, 1, 1, end + 1), np.float16)}
        else:
            mask = _causal_lm_sample_mask(end) if end == prompt else np.zeros((1, 1, 1, end), np.float16)
            inputs = {CAUSAL_LM_TOKENS: tokens, CAUSAL_LM_MASK: mask}
        rows.append(model.predict(inputs, state=state)["logits"][0].astype(np.float32))
    return np.concatenate(rows)


@pytest.mark.parametrize("name, same_as", [("swift-transformers", "cmfdeploy-fp32"), ("causal-lm", "cmfdeploy-fp16")])
def test_each_interface_computes_the_cmfdeploy_packages_logits(packages, gates, name, same_as):
    """The same function in other names: its logits for a prompt, then decodes, are the cmfdeploy
    package's of its precision within its gate's exactness bound (FP32: bit for bit), whether
    fed as the gates feed it or as its Swift loader does."""
    ids = np.random.default_rng(7).integers(0, 1024, 24).astype(np.int32)
    want = _runner_logits(packages[same_as], ids, 9)
    bound = gates[name]["tolerance"]["atol"]
    assert np.abs(_runner_logits(packages[name], ids, 9) - want).max() <= bound
    assert np.abs(_as_its_loader_feeds(name, packages[name], ids, 9) - want).max() <= bound
    if name == "swift-transformers":
        assert np.array_equal(_runner_logits(packages[name], ids, 9), want)


def test_the_gates_hold_each_interface_to_the_same_reference_and_bound(gates, fixture_exact):
    fp32 = gates["swift-transformers"]
    assert fp32["passed"] and fp32["numerics"] == "fp32, fp16 K/V cache"
    tolerance = fp32["tolerance"]
    # FP32's bound, as the cmfdeploy stateful gate's (tests/test_align_stateful.py).
    assert tolerance["ceiling"] == fixture_exact.atol and tolerance["atol"] == NOISE_FACTOR * tolerance["noise"]
    assert fp32["summary"]["max_abs"] <= tolerance["atol"]
    assert {r["check"] for r in fp32["records"]} >= {"one_shot", "stateful"}
    assert all(i["passed"] for i in fp32["invariants"])
    fp16 = gates["causal-lm"]
    assert fp16["passed"] and fp16["summary"]["max_abs"] <= fp16["tolerance"]["atol"]


@pytest.mark.parametrize("claim", ["causal-lm", "cmfdeploy", "mlx"])
def test_the_crosscheck_refuses_a_manifest_naming_another_interface(packages, tmp_path, claim):
    package = tmp_path / "stateful"
    shutil.copytree(packages["swift-transformers"], package)
    manifest = json.loads((package / "manifest.json").read_text())
    manifest["package"]["interface"] = claim
    (package / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IdentityError, match=rf"{package / 'manifest.json'}: field 'package.interface' is {claim!r}, "
                                            r"but the program's cmfdeploy.interface .* says 'swift-transformers'"):
        verify_package(package, hashes=False)


def test_the_crosscheck_refuses_a_program_without_its_loaders_name(packages, tmp_path):
    """The manifest and the program agree on the interface, but the program lacks the metadata
    its loader reads: refused, naming the key."""
    package = tmp_path / "stateful"
    shutil.copytree(packages["swift-transformers"], package)
    spec = _spec(package)
    del spec.description.metadata.userDefined[ST_NAME_KEY]
    (package / "model.mlpackage" / "Data" / "com.apple.CoreML" / "model.mlmodel").write_bytes(spec.SerializeToString())
    manifest = read_json(package / MANIFEST_NAME)
    manifest["files"] = inventory(package)  # the identity chain holds: only the cross-check can tell
    write_json(package / MANIFEST_NAME, manifest)
    with pytest.raises(IdentityError, match=rf"field 'package.interface' is 'swift-transformers', whose loader reads "
                                            rf"the metadata key '{ST_NAME_KEY}', but the program .* has no value"):
        verify_package(package)


def test_a_conversion_refuses_an_interface_it_cannot_shape(fixture_bundle, tmp_path, capsys):
    with pytest.raises(InterfaceMismatch, match=r"conversion field 'interface' \(--interface\) is 'causal-lm', whose "
                                                r"loader reads float16 logits and no other, but .* float32"):
        export_coreml(fixture_bundle, tmp_path / "a", kinds=("stateful",), conversion=Conversion(interface="causal-lm"))
    with pytest.raises(InterfaceMismatch, match=r"is 'swift-transformers', which shapes the stateful kind; the "
                                                r"package kinds \['chunk_kv'\] do not include it"):
        export_coreml(fixture_bundle, tmp_path / "b", kinds=("chunk_kv",),
                      conversion=Conversion(interface="swift-transformers"))
    assert main(["coreml", str(fixture_bundle), "-o", str(tmp_path / "c"), "--interface", "mlx"]) == 1
    assert capsys.readouterr().err.startswith("UnknownInterface: --interface: interface 'mlx' is not among")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name, names", [("cmfdeploy-fp32", ("input_ids", "position")),
                                         ("swift-transformers", (ST_TOKENS, ST_MASK)),
                                         ("causal-lm", (CAUSAL_LM_TOKENS, CAUSAL_LM_MASK))])
def test_the_release_snippets_feed_each_interfaces_inputs(packages, name, names):
    interface = json.loads((packages[name] / "manifest.json").read_text())["package"]
    release = {"interface": interface, "model": "botchan-llama-1m", "recipe": "fp32", "survey": {"target": "gpu"},
               "packages": [{"role": "fp32", "path": "packages/fp32-stateful"},
                            {"role": "deployed", "path": "packages/fp32"}]}
    text = "\n".join(usage_markdown(release))
    assert f'inputs = {{"{names[0]}": np.array([ids], dtype=np.int32)}}' in text
    assert all(feature in text for feature in names)
    if name == "swift-transformers":
        assert "LanguageModelWithStatefulKVCache(model: model, tokenizer: tokenizer)" in text
    if name == "causal-lm":
        assert "CausalLMModel(model: model)" in text
    # The Python lines run as written, on the executor standing in for Core ML.
    ids = [int(i) for i in np.random.default_rng(3).integers(0, 1024, 11)]
    model = open_package(packages[name], backend="executor", function_name="prefill" if name.startswith("cmfdeploy")
                         else None)
    scope = {"np": np, "model": model, "ids": list(ids), "inputs": {names[0]: np.array([ids], dtype=np.int32)}}
    exec("\n".join(prediction_lines(interface)), scope)
    expected = open_package_backend(packages[name], backend="executor").logits(np.array(ids))[-1]
    assert np.array_equal(scope["logits"][0, -1].astype(np.float32), expected)


def test_a_release_in_the_swift_transformers_interface_ships_what_language_model_reads(packages, fixture_packages,
                                                                                        tmp_path_factory):
    """End to end: the survey's deployed recipe on the swift-transformers stateful package, gated,
    released; the shipped program still has what LanguageModel reads, and `generate` on the
    release continues a prompt as the surveyed package does."""
    from _survey_models import built_survey
    from pipeline.stages.deploy import deploy_package
    from pipeline.stages.release import make_release, verify_release

    root = tmp_path_factory.mktemp("interface-release")
    survey = built_survey(fixture_packages, root)
    gate = root / "gate-swift-transformers"
    assert align_package(packages["swift-transformers"], FIXTURE_REFERENCE, gate, items=survey.items).passed
    deployment = deploy_package(survey.path, packages["swift-transformers"], gate, root / "deployed",
                                fixtures_dir=FIXTURE_REFERENCE, items=survey.items)
    assert deployment.passed
    release = make_release(survey.path, root / "dist", packages=[(packages["swift-transformers"], gate)],
                           deployment=deployment.manifest.path)
    verify_release(release.path)
    shipped = release.path / next(e for e in release["packages"] if e["role"] == "shipped")["path"]
    description = _spec(shipped).description
    assert [f.name for f in description.input] == [ST_TOKENS, ST_MASK]
    assert [s.name for s in description.state] == list(ST_STATES)
    assert [o.name for o in description.output] == [ST_LOGITS]
    assert dict(description.metadata.userDefined)[ST_NAME_KEY] == "botchan-llama-1m"
    assert "LanguageModelWithStatefulKVCache(model: model, tokenizer: tokenizer)" in (
        release.path / "RELEASE.md").read_text()
    released, surveyed = greedy_of_release_and_survey(release, survey.path / "packages" / release["recipe"])
    assert released == surveyed


def test_a_release_in_the_causal_lm_interface_ships_what_the_causal_lm_model_sample_asserts(packages, fixture_bundle,
                                                                                            tmp_path_factory):
    """End to end at fp16 (the causal-lm loader reads fp16 logits): a Neural Engine survey of the fp16
    chunk-KV package of the same conversion, its deployed recipe on the causal-lm stateful package,
    gated, released; the shipped program still has what CausalLMModel asserts, RELEASE.md hands it
    to that sample, and `generate` on the release continues a prompt as the surveyed package does."""
    from pipeline.stages.deploy import deploy_package
    from pipeline.stages.release import make_release, verify_release
    from pipeline.stages.survey import run_survey

    root = tmp_path_factory.mktemp("causal-lm-release")
    items = cloze_slice(root / "items.jsonl")
    report = packages["causal-lm"].parent.parent / "preflight.json"  # the conversion the packages share
    chunk_kv = export_coreml(fixture_bundle, root / "coreml-fp16", kinds=("chunk_kv",),
                             conversion=Conversion("fp16", preflight=str(report)))["chunk_kv"].path
    assert align_package(chunk_kv, FIXTURE_REFERENCE, root / "gate-chunk_kv", items=items).passed
    survey = root / "survey-ane"
    record = run_survey(chunk_kv, root / "gate-chunk_kv", FIXTURE_REFERENCE, items, survey, recipes=("int8-pc",),
                        progress=False, target="ane")
    assert record["deployed"] == {**record["deployed"], "recipe": "int8-pc", "deployed_for": "ane"}
    gate = root / "gate-causal-lm"
    assert align_package(packages["causal-lm"], FIXTURE_REFERENCE, gate, items=items).passed
    deployment = deploy_package(survey, packages["causal-lm"], gate, root / "deployed", fixtures_dir=FIXTURE_REFERENCE,
                                items=items)
    assert deployment.passed
    release = make_release(survey, root / "dist", packages=[(packages["causal-lm"], gate)],
                           deployment=deployment.manifest.path)
    verify_release(release.path)
    shipped = release.path / next(e for e in release["packages"] if e["role"] == "shipped")["path"]
    description = _spec(shipped).description
    assert [f.name for f in description.input] == [CAUSAL_LM_TOKENS, CAUSAL_LM_MASK]
    assert [s.name for s in description.state] == list(CAUSAL_LM_STATES)
    assert [(o.name, o.type.multiArrayType.dataType) for o in description.output] == [(CAUSAL_LM_LOGITS, FLOAT16)]
    page = (release.path / "RELEASE.md").read_text()
    assert "CausalLMModel(model: model)" in page and "computeUnits = .cpuAndNeuralEngine" in page
    released, surveyed = greedy_of_release_and_survey(release, survey / "packages" / "int8-pc")
    assert released == surveyed
