"""Compression recipes: compressed packages run through the MIL executor and match the
reference model rebuilt with the weights coremltools itself decompresses; selection records,
preconditions, the mixed-precision chooser, manifests and refusals.
"""

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import coremltools as ct
from coremltools.models.utils import _apply_graph_pass
from coremltools.proto import MIL_pb2
from coremltools.optimize.coreml._quantization_passes import WeightDecompressor
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _coreml_models import ARCH, VOCAB, make_bundle, random_weights
from pipeline.ground.models.numerics import U32, model_logits_bound
from coreml.convert import export_coreml
from coreml.manifest import verify_package
from coreml import codes
from coreml.package import open_package
import coreml.recipes.compress as compress_module
from coreml.recipes import (
    RECIPES,
    RecipePrecondition,
    UnknownRecipe,
    Weight,
    choose_mixed,
    compress_package,
    plan_selection,
)
from manifests.identity import sha256_file
from manifests.output import unfinished_output
from pipeline.ground.errors import IdentityError, OutputExists
from pipeline.ground.models import ModelArgs, build_model


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    bundle = make_bundle(root, seed=1)
    return export_coreml(bundle, root / "packages", kinds=("stateless",))["stateless"]


@pytest.fixture(scope="module")
def compressed(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("compressed")
    return {recipe: compress_package(source.path, recipe, out / recipe)
            for recipe in ("int4-b32", "int4-b32-emb8", "palette4-gc32", "palette6-gc32", "int8-b32-embfp16",
                           "palette4-int8lut")}


def _decompressed_weights(manifest) -> dict[str, np.ndarray]:
    """HF name -> the weight as coremltools decompresses it from the saved package.

    The pass `cto.decompress_weights` runs, stopped before it re-converts the whole program.
    """
    model = ct.models.MLModel(str(manifest.path / "model.mlpackage"), skip_model_load=True)
    program = _apply_graph_pass(model, WeightDecompressor(op_selector=lambda op: True), return_pymil_prog=True)
    values = {op.name: op.val.val for op in program.functions["main"].operations if op.op_type == "const"}
    weights = {}
    for entry in manifest["selection"]["weights"].values():
        if entry["compressed"]:
            value = np.asarray(values[entry["compressed_as"]], dtype=np.float32)
            if "hot_rows" in entry:  # the table's hot rows each plus their residual row
                slot = values[entry["hot_rows"]["slot"]].astype(np.int64)
                rows = np.flatnonzero(slot)
                value = value.copy()
                value[rows] += values[entry["hot_rows"]["residual"]][slot[rows]]
            for hf_name in entry["hf_names"]:
                weights[hf_name] = value
    return weights


@pytest.mark.parametrize("recipe", ["int4-b32", "int4-b32-emb8", "palette4-gc32", "palette6-gc32", "int8-b32-embfp16",
                                    "palette4-int8lut"])
def test_compressed_package_matches_the_reference_with_decompressed_weights(source, compressed, recipe):
    _assert_matches_the_reference_with_decompressed_weights(compressed[recipe])


def _assert_matches_the_reference_with_decompressed_weights(manifest):
    original = random_weights(seed=1)
    substituted = {**original, **_decompressed_weights(manifest)}
    changed = [n for n in original if not np.array_equal(original[n], substituted[n])]
    assert "model.embed_tokens.weight" in changed and "model.layers.3.mlp.down_proj.weight" in changed
    model = build_model(ModelArgs.from_header({"arch": manifest["architecture"]}), substituted)
    ids = np.random.default_rng(3).integers(0, VOCAB, 50).astype(np.int32)
    logits = open_package(manifest.path, backend="executor").predict({"input_ids": ids[None]})["logits"][0]
    with torch.no_grad():
        expected = model(torch.tensor(ids, dtype=torch.long)).numpy()
        original_logits = build_model(model.args, original)(torch.tensor(ids, dtype=torch.long)).numpy()
    # Float32 package vs float32 reference on the same decompressed weights, each side rounding
    # (q - zero) * scale (or a LUT entry) once: the derived bound (pipeline/ground/models/numerics.py).
    bound = model_logits_bound(model, len(ids), weight_rtol=2 * U32)
    assert np.abs(logits - expected).max() <= bound
    assert np.abs(logits - original_logits).max() > 10 * bound  # the compression is real


def test_selection_records_every_constant_and_why(compressed):
    selection = compressed["int4-b32"]["selection"]
    weights = selection["weights"]
    embedding = weights["model_model_embed_tokens_weight"]
    # fp16 scale and offset decode to fp16, widened by constexpr_cast to the program's fp32.
    assert embedding["compressed"] and embedding["chain"] == ["constexpr_blockwise_shift_scale", "constexpr_cast"]
    assert embedding["hf_names"] == ["model.embed_tokens.weight"] and embedding["consumers"] == ["gather", "linear"]
    # k/v projections are 32 x 64 = 2048 elements: at the threshold, so left as they are, and said so.
    below = selection["below_threshold"]
    assert "model_model_layers_0_self_attn_k_proj_weight" in below["non_scalar"]
    assert "model_model_layers_0_input_layernorm_weight" in below["non_scalar"]
    assert below["reason"].startswith("at most weight_threshold 2048")
    assert sum(e["compressed"] for e in weights.values()) == 1 + 4 * 5  # embedding; q, o, gate, up, down
    palette = compressed["palette4-gc32"]["selection"]["weights"]["model_model_layers_2_mlp_up_proj_weight"]
    assert palette["chain"] == ["constexpr_lut_to_dense", "constexpr_cast"] and "nbits=4" in palette["how"]
    assert "tile=[32, 32]" in palette["how"]
    joint = compressed["palette4-int8lut"]["selection"]["weights"]["model_model_layers_2_mlp_up_proj_weight"]
    assert joint["chain"] == ["constexpr_blockwise_shift_scale", "constexpr_lut_to_dense"]  # int8 LUT, then LUT
    cast = compressed["int8-b32-embfp16"]["selection"]["weights"]["model_model_embed_tokens_weight"]
    assert cast["chain"] == ["constexpr_cast"]
    int8 = compressed["int4-b32-emb8"]["selection"]["weights"]["model_model_embed_tokens_weight"]
    assert int8["chain"] == ["constexpr_blockwise_shift_scale", "constexpr_cast"] and "kind=symmetric,nbits=8" in int8["how"]


def test_manifest_binds_source_package_and_recipe(source, compressed):
    for recipe, manifest in compressed.items():
        assert verify_package(manifest.path).data == manifest.data
        assert manifest["format"] == "cmfdeploy.compressed/1" and manifest["status"] == "complete"
        assert manifest["source"]["manifest_sha256"] == sha256_file(source.path / "manifest.json")
        assert manifest["source"]["format"] == "cmfdeploy.coreml/1"
        assert manifest["recipe"] == {"name": recipe, "params": RECIPES[recipe].params_record()}
        assert manifest["base_size_bytes"] == source["package_bytes"]
        on_disk = sum(p.stat().st_size for p in (manifest.path / "model.mlpackage").rglob("*") if p.is_file())
        assert manifest["size_bytes"] == on_disk < source["package_bytes"]
        assert manifest["package"] == source["package"]
    sizes = {r: m["size_bytes"] for r, m in compressed.items()}
    assert sizes["int4-b32"] < sizes["int4-b32-emb8"] < sizes["int8-b32-embfp16"]


def _weight(name, shape, consumers=("linear",), hf=True):
    return Weight(name, (f"model.layers.0.mlp.{name}.weight",) if hf else (), shape, consumers, ())


def test_unmet_preconditions_are_raised_naming_the_weight():
    with pytest.raises(RecipePrecondition, match=r"down_proj .*input axis 48 not divisible by block_size 32"):
        plan_selection([_weight("down_proj", (64, 48))], RECIPES["int4-b32"].select)
    with pytest.raises(RecipePrecondition, match=r"up_proj .*output axis 80 not divisible by LUT tile 32"):
        plan_selection([_weight("up_proj", (80, 64))], RECIPES["palette4-gc32"].select)
    with pytest.raises(RecipePrecondition, match=r"axes unknown for ops \['conv'\]"):
        plan_selection([_weight("gate_proj", (64, 64), consumers=("conv",))], RECIPES["int8-b32"].select)


def test_a_large_constant_that_is_no_bundle_weight_is_left_and_recorded():
    plan = plan_selection([_weight("table", (128, 64), consumers=("gather",), hf=False)], RECIPES["int4-b32"].select)
    assert plan["steps"] == {}
    assert plan["record"]["weights"]["table"]["reason"].startswith("not a bundle weight")


def test_mixed_spends_the_budget_on_the_most_sensitive_layers():
    weights = [Weight(f"w{i}", (f"model.layers.{i}.mlp.up_proj.weight",), (64, 64), ("linear",), ()) for i in range(4)]
    sensitivity = {"layers.0": 1.0, "layers.1": 8.0, "layers.2": 2.0, "layers.3": 4.0}

    def measure(group, option):  # int8 error is a tenth of int4's
        return sensitivity[group] * (0.1 if option == "int8-b32" else 1.0)

    # int4-b32: 4-bit codes + fp16 scale and offset per 32; int8-b32: 8-bit codes + fp32 scale per 32.
    int4, int8 = 64 * 64 * 4 + 128 * 2 * 16, 64 * 64 * 8 + 128 * 32
    options = ("int4-b32", "int8-b32")
    chosen = choose_mixed(weights, measure, budget_bits=2 * int8 + 2 * int4, options=options)
    assert chosen["choices"] == {"layers.0": "int4-b32", "layers.1": "int8-b32", "layers.2": "int4-b32",
                                 "layers.3": "int8-b32"}
    assert chosen["estimated_bits"] == 2 * int8 + 2 * int4
    with pytest.raises(RecipePrecondition, match="over the budget"):
        choose_mixed(weights, measure, budget_bits=4 * int4 - 1, options=options)


def _quantized_dtypes(mlpackage, argument: str = "data"):
    """Output var of each constexpr_blockwise_shift_scale (and of a constexpr_cast of one) -> the MIL
    dtype of its `argument` (data, or offset)."""
    spec = ct.utils.load_spec(str(mlpackage))
    dtypes, outputs = {}, {}
    for op in spec.mlProgram.functions["main"].block_specializations["CoreML8"].operations:
        outputs.update({o.name: o for o in op.outputs})
        if op.type == "constexpr_blockwise_shift_scale":
            data = op.inputs[argument].arguments[0]
            value_type = data.value.type if data.HasField("value") else outputs[data.name].type
            dtypes[op.outputs[0].name] = MIL_pb2.DataType.Name(value_type.tensorType.dataType)
        if op.type == "constexpr_cast" and op.inputs["source_val"].arguments[0].name in dtypes:
            dtypes[op.outputs[0].name] = dtypes[op.inputs["source_val"].arguments[0].name]
    return dtypes


def test_gptq_zero_point_recipe_stores_uint4_offsets_and_matches_its_reference(source, tmp_path):
    """gptq-int4-b32-zp: codes and zero points both uint4 in the saved program (4 bits of offset
    a block where an fp16 one takes 16), and the package on the executor equal to the reference
    rebuilt with the weights coremltools itself decompresses."""
    ids = np.random.default_rng(9).integers(0, VOCAB, 128 * 16).astype(np.int64)
    manifest = compress_package(source.path, "gptq-int4-b32-zp", tmp_path / "zp", calibration_ids=ids)
    mlpackage = manifest.path / "model.mlpackage"
    data, offsets = _quantized_dtypes(mlpackage), _quantized_dtypes(mlpackage, "offset")
    compressed = [e["compressed_as"] for e in manifest["selection"]["weights"].values() if e["compressed"]]
    assert compressed and all(data[name] == offsets[name] == "UINT4" for name in compressed)
    _assert_matches_the_reference_with_decompressed_weights(manifest)


def test_hot_rows_correct_the_most_read_rows_of_the_tied_table_in_both_its_uses(source, tmp_path):
    """gptq-int4-b32-zp-hot: the table is gptq-int4-b32-zp's code, and the rows the calibration
    text reads (here fewer than 4096, so all of them, most read first) carry an int8 residual
    that the package adds where it looks rows up and where it computes the head. The package on
    the executor equals the reference with the table plus its residual rows, and differs from
    one with the correction in only one use, or in neither."""
    import hashlib

    from coreml.bits import bits_per_weight
    from coreml.decoded import decoded_weights, hot_rows_head_norm
    from pipeline.ground.reference import UNTIED_HEAD

    ids = np.random.default_rng(9).integers(0, VOCAB // 2, 128 * 16).astype(np.int64)
    hot = compress_package(source.path, "gptq-int4-b32-zp-hot", tmp_path / "hot", calibration_ids=ids)
    plain = compress_package(source.path, "gptq-int4-b32-zp", tmp_path / "zp", calibration_ids=ids)
    entry = hot["selection"]["weights"]["model_model_embed_tokens_weight"]
    assert source["special_tokens"]["bos_token_id"] is None  # no BOS opens the windows: the text's own counts
    counts = np.bincount(ids, minlength=VOCAB)
    read = np.flatnonzero(counts)
    expected = read[np.lexsort((read, -counts[read]))]
    assert entry["hot_rows"]["rows"] == len(expected) < VOCAB
    assert entry["hot_rows"]["ids_sha256"] == hashlib.sha256(expected.astype("<i4").tobytes()).hexdigest()

    table = _decompressed_weights(plain)["model.embed_tokens.weight"]
    with_rows = _decompressed_weights(hot)["model.embed_tokens.weight"]
    assert np.array_equal(decoded_weights(hot.path)["model.embed_tokens.weight"], with_rows)
    original = random_weights(seed=1)["model.embed_tokens.weight"]
    cold = np.setdiff1d(np.arange(VOCAB), expected)
    assert np.array_equal(with_rows[cold], table[cold])  # the same GPTQ code, read alike
    error_hot, error_plain = (np.abs(w[expected] - original[expected]).max(axis=1) for w in (with_rows, table))
    assert np.all(error_hot < error_plain / 8)  # 8-bit residual codes of a 4-bit code's error

    model_args = ModelArgs.from_header({"arch": hot["architecture"]})
    weights = {**random_weights(seed=1), **_decompressed_weights(hot)}
    prompt = np.concatenate([expected[:40], cold[:10]]).astype(np.int32)
    got = open_package(hot.path, backend="executor").predict({"input_ids": prompt[None]})["logits"][0]

    def logits(lookup, head):
        model = build_model(model_args, {**weights, "model.embed_tokens.weight": lookup, UNTIED_HEAD: head})
        with torch.no_grad():
            return model(torch.tensor(prompt, dtype=torch.long)).numpy()

    expected_logits = logits(with_rows, with_rows)
    norm = hot_rows_head_norm(hot.path)
    assert norm >= np.linalg.norm(with_rows, axis=1).max()
    bound = model_logits_bound(build_model(model_args, weights), len(prompt), hot_rows_head_norm=norm)
    assert np.abs(got - expected_logits).max() <= bound
    for lookup, head in ((table, with_rows), (with_rows, table), (table, table)):
        assert np.abs(got - logits(lookup, head)).max() > 10 * bound
    # Each variable of the saved program is made by one op, the logits output too.
    spec = ct.utils.load_spec(str(hot.path / "model.mlpackage"))
    (block,) = spec.mlProgram.functions["main"].block_specializations.values()
    made = [output.name for op in block.operations for output in op.outputs]
    assert len(made) == len(set(made)) and "logits" in made
    # The stored residual (hot rows and a zero row, int8 per 32 with an fp16 scale), a uint16
    # slot per row and the hot ids (int32), over gptq-int4-b32-zp's bytes.
    extra = (len(expected) + 1) * ARCH["hidden_size"] * (1 + 2 / 32) + 2 * VOCAB + 4 * len(expected)
    parameters = bits_per_weight(plain.path)["parameters"]
    assert bits_per_weight(hot.path)["bits_per_weight"] == pytest.approx(
        bits_per_weight(plain.path)["bits_per_weight"] + 8 * extra / parameters, rel=1e-12)


def test_a_shared_cache_shares_hessians_and_codes_and_changes_no_byte(source, tmp_path, monkeypatch):
    """One survey's GPTQ recipes measure the same Hessians and make the same codes: made once into
    a shared folder (coreml.cache), found there by the next recipe without computing them again
    (here: gptq-int4-b32-zp-hot after gptq-int4-b32-zp, whose layer and table codes it shares),
    and the package is the one made without a cache, byte for byte."""
    from coreml.calibration import Calibration

    ids = np.random.default_rng(9).integers(0, VOCAB, 128 * 16).astype(np.int64)
    alone = compress_package(source.path, "gptq-int4-b32-zp-hot", tmp_path / "alone", calibration_ids=ids)
    cache = tmp_path / "cache"
    compress_package(source.path, "gptq-int4-b32-zp", tmp_path / "zp", calibration_ids=ids, shared_cache=cache)
    entries = sorted(path.name for path in cache.iterdir() if path.is_dir())
    assert len(entries) == 1 + 21  # the Hessians; the embedding's and 4 x 5 layer matrices' codes

    def computed(*args, **kwargs):
        raise AssertionError("computed again, not read from the cache")

    monkeypatch.setattr(Calibration, "_input_statistics", computed)
    monkeypatch.setattr(codes, "gptq_affine", computed)
    shared = compress_package(source.path, "gptq-int4-b32-zp-hot", tmp_path / "shared", calibration_ids=ids,
                              shared_cache=cache)
    assert sorted(path.name for path in cache.iterdir() if path.is_dir()) == entries
    for name in ("model.mlmodel", "weight.bin"):
        (a,), (b,) = ((m.path / "model.mlpackage").rglob(name) for m in (alone, shared))
        assert a.read_bytes() == b.read_bytes(), name
    assert shared["selection"] == alone["selection"]


def test_a_shared_cache_gives_palette4_int8lut_the_centres_of_palette4_gc32_and_changes_no_byte(source, tmp_path,
                                                                                                 monkeypatch):
    """The two 4-bit palettes differ only in their LUT's dtype: the second finds the first's k-means
    centres in the survey's folder and runs no Lloyd iteration, and its package is the one made
    without a cache, byte for byte."""
    alone = compress_package(source.path, "palette4-int8lut", tmp_path / "alone")
    cache = tmp_path / "cache"
    compress_package(source.path, "palette4-gc32", tmp_path / "gc32", shared_cache=cache)
    lloyd = codes._kmeans_rows

    def assigned_only(values, weights, nbits, dtype, iterations, settled=None):
        assert settled is not None, "k-means ran again, its centres not read from the cache"
        return lloyd(values, weights, nbits, dtype, iterations, settled)

    monkeypatch.setattr(codes, "_kmeans_rows", assigned_only)
    shared = compress_package(source.path, "palette4-int8lut", tmp_path / "shared", shared_cache=cache)
    for name in ("model.mlmodel", "weight.bin"):
        (a,), (b,) = ((m.path / "model.mlpackage").rglob(name) for m in (alone, shared))
        assert a.read_bytes() == b.read_bytes(), name
    assert shared["selection"] == alone["selection"]


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="sees the second worker wait in /proc/locks (Linux)")
def test_a_worker_that_wants_an_entry_another_is_making_waits_for_it(tmp_path):
    """Both workers of a survey start with GPTQ recipes, which need the same Hessians: the
    second waits for the first's entry instead of making it beside it. The first's `make`
    returns only once the second is seen waiting on the entry's lock (/proc/locks lists a
    blocked flock with "->") or has called its own `make`, so this holds however the two
    threads are scheduled."""
    import threading

    from coreml.cache import ResultCache, content_key

    cache, key = ResultCache(tmp_path / "cache"), content_key("entry", np.arange(4))
    first_making, second_made, results = threading.Event(), threading.Event(), {}

    def first_make():
        first_making.set()
        inode = os.stat(cache.folder / f".{key}.lock").st_ino
        for _ in range(6000):  # a minute at most, then the assertions below say what happened
            if second_made.is_set() or any("->" in line and f":{inode} " in line
                                           for line in Path("/proc/locks").read_text().splitlines()):
                break
            threading.Event().wait(0.01)
        return {"x": np.arange(4.0)}, {"made_by": "first"}

    def second_make():
        second_made.set()
        return {"x": np.zeros(4)}, {"made_by": "second"}

    first = threading.Thread(target=lambda: results.update(first=cache.arrays(key, first_make)))
    first.start()
    assert first_making.wait(60)
    results["second"] = cache.arrays(key, second_make)
    first.join()
    assert not second_made.is_set()
    assert results["second"][1] == {"made_by": "first"} and np.array_equal(results["second"][0]["x"], np.arange(4.0))


def test_mixed_measures_on_calibration_ids_and_stores_each_layer_at_its_choice(source, tmp_path):
    ids = np.random.default_rng(5).integers(0, VOCAB, 128 * 16).astype(np.int64)
    # The fixture keeps 16960 of its 164416 parameters in fp32 (norms; k/v at the 2048 threshold):
    # int4 everywhere else is 7.8 bits per weight, int8 everywhere 10.9; 9 buys some layers int8.
    manifest = compress_package(source.path, "mixed", tmp_path / "mixed", calibration_ids=ids, bpw=9.0)
    mixed = manifest["selection"]["mixed"]
    assert mixed["estimated_bits"] <= mixed["budget_bits"] and mixed["bpw_budget"] == 9.0
    assert mixed["chosen"] == "plan" and len(set(mixed["choices"].values())) > 1
    for group, errors in mixed["measured_error"].items():
        # int8's error is the smaller on every layer; gptq-int4-b64 codes the 64-wide embedding as one block.
        assert errors["int8-b32-fp16scale"] < errors["gptq-int4-b32"], group
        assert errors["gptq-int4-b64"] is not None, group
    # Every option that fits the budget everywhere was measured whole beside the plan, and none beat it.
    candidates = mixed["candidates"]
    assert set(candidates) == {"plan", "gptq-int4-b32", "gptq-int4-b64", "gptq-int4-b64-emb8", "gptq-int4-b32-zp",
                               "gptq-int4-b32-zp-hot"}
    assert all(candidates["plan"]["measured_error"] <= c["measured_error"] for c in candidates.values())
    dtypes = _quantized_dtypes(manifest.path / "model.mlpackage")
    for entry in manifest["selection"]["weights"].values():
        if entry["compressed"]:
            choice = mixed["choices"][Weight("", tuple(entry["hf_names"]), (), (), ()).group]
            assert dtypes[entry["compressed_as"]] == ("INT8" if choice == "int8-b32-fp16scale" or (
                choice == "gptq-int4-b64-emb8" and "model.embed_tokens.weight" in entry["hf_names"]) else "UINT4")
    # The plan's joint error is the calibration KL of the package's own decoded weights, measured
    # here through a calibration of its own (the same windows, a fresh reference model).
    from coreml.calibration import Calibration
    from manifests.chain import upstream_path
    from pipeline.ground.reference import load_reference

    model, _, _ = load_reference(upstream_path(source.path, source["source"]))
    kl = Calibration.of_model(model.eval(), ids).kl_with(_decompressed_weights(manifest))
    # The same sums over the same values; only the order of the float64 reductions may differ.
    assert kl == pytest.approx(candidates["plan"]["measured_error"], rel=1e-9)


def test_mixed_never_loses_to_a_uniform_option_that_fits_the_budget():
    """Per-layer errors that add up to a misleading plan: each layer alone says "int8 on layers 0
    and 1, palette on 2 and 3" is best, but coded together the palette layers interact; the
    joint measure prefers int4 everywhere, which fits, and the chooser takes it."""
    weights = [Weight(f"w{i}", (f"model.layers.{i}.mlp.up_proj.weight",), (64, 64), ("linear",), ()) for i in range(4)]
    options = ("palette4-gc32", "int4-b32", "int8-b32")
    alone = {"palette4-gc32": 1.0, "int4-b32": 0.9, "int8-b32": 0.1}

    def measure(group, option):
        return alone[option] * (3.0 if group in ("layers.0", "layers.1") else 1.0)

    def whole(choices):  # palette layers together cost far more than their sum
        summed = sum(measure(g, o) for g, o in choices.items())
        return summed * (10.0 if list(choices.values()).count("palette4-gc32") > 1 else 1.0)

    cost = {o: RECIPES[o].estimated_bits(weights[0]) for o in options}
    budget = 2 * cost["int8-b32"] + 2 * cost["palette4-gc32"]
    assert 4 * cost["int4-b32"] <= budget < 4 * cost["int8-b32"]
    plain = choose_mixed(weights, measure, budget, options)
    assert plain["choices"] == {"layers.0": "int8-b32", "layers.1": "int8-b32", "layers.2": "palette4-gc32",
                                "layers.3": "palette4-gc32"}
    judged = choose_mixed(weights, measure, budget, options, measure_whole=whole)
    assert judged["chosen"] == "int4-b32" and set(judged["choices"].values()) == {"int4-b32"}
    assert judged["plan"] == plain["choices"]
    assert set(judged["candidates"]) == {"plan", "palette4-gc32", "int4-b32"}  # int8 everywhere does not fit
    assert judged["candidates"]["int4-b32"]["measured_error"] < judged["candidates"]["plan"]["measured_error"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0, 10), st.floats(0, 10)), min_size=1, max_size=5),
       st.floats(0.0, 1.0))
def test_mixed_plan_is_the_least_summed_error_within_the_budget(errors, slack):
    """The plan against every assignment, enumerated: the knapsack is exact (a per-bit greedy
    along one chain of options is not)."""
    import itertools

    shapes = [(64, 64), (64, 128), (128, 64), (64, 256), (256, 64)]
    weights = [Weight(f"w{i}", (f"model.layers.{i}.mlp.up_proj.weight",), shapes[i], ("linear",), ())
               for i in range(len(errors))]
    options = ("palette4-gc32", "int4-b32", "int8-b32")
    table = {f"layers.{i}": dict(zip(options, e)) for i, e in enumerate(errors)}
    cost = {(f"layers.{i}", o): RECIPES[o].estimated_bits(w) for i, w in enumerate(weights) for o in options}
    least = sum(min(cost[g, o] for o in options) for g in table)
    most = sum(max(cost[g, o] for o in options) for g in table)
    budget = least + slack * (most - least)
    chosen = choose_mixed(weights, lambda g, o: table[g][o], budget, options)
    best = min(sum(table[g][o] for g, o in zip(table, combo)) for combo in itertools.product(options, repeat=len(table))
               if sum(cost[g, o] for g, o in zip(table, combo)) <= budget)
    assert chosen["estimated_bits"] <= budget
    assert sum(table[g][o] for g, o in chosen["choices"].items()) == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_calibration_windows_open_with_bos_when_the_model_has_one():
    from coreml.calibration import WINDOW, Calibration

    model = build_model(ModelArgs.from_header({"arch": ARCH}), random_weights(seed=1)).eval()
    ids = np.arange(3, 3 + 3 * WINDOW) % VOCAB
    with_bos = Calibration.of_model(model, ids, count=3, bos_id=1).windows
    assert [w[0] for w in with_bos] == [1, 1, 1] and all(len(w) == WINDOW for w in with_bos)
    assert np.array_equal(np.concatenate([w[1:] for w in with_bos]), ids[:3 * (WINDOW - 1)])  # the text, in order
    assert np.array_equal(np.concatenate(Calibration.of_model(model, ids, count=3).windows), ids)
    # Rows read over the whole text (not only the windows measured), BOS once per window of it.
    counts = Calibration.of_model(model, ids, count=1, bos_id=1).row_counts(VOCAB)
    text = np.bincount(ids, minlength=VOCAB)
    assert np.array_equal(np.delete(counts, 1), np.delete(text, 1)) and counts[1] == text[1] + 4  # 3 W ids: 4 windows


def test_compressing_leaves_nothing_in_the_temp_folder(source, tmp_path, monkeypatch):
    """The compressed program's weights and package are made in the output's staging folder, as
    an export's are, and the package saved from it holds only its own files."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    working_in, convert = [], compress_module.mil_convert

    def recorded(*args, **kwargs):
        working_in.append(Path(tempfile.gettempdir()))
        return convert(*args, **kwargs)

    monkeypatch.setattr(compress_module, "mil_convert", recorded)
    compress_package(source.path, "int8-b32", tmp_path / "int8")
    assert list(temp.iterdir()) == [] and tempfile.gettempdir() == str(temp)
    assert [unfinished_output(path) for path in working_in] == [(tmp_path / "int8").resolve()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8", "temp"]
    assert sorted(p.name for p in (tmp_path / "int8").iterdir()) == sorted(p.name for p in source.path.iterdir())


def test_refusals(source, compressed, tmp_path):
    with pytest.raises(OutputExists):
        compress_package(source.path, "int4-b32", compressed["int4-b32"].path)
    with pytest.raises(UnknownRecipe, match="int3"):
        compress_package(source.path, "int3", tmp_path / "out")
    with pytest.raises(RecipePrecondition, match="calibration_ids"):
        compress_package(source.path, "mixed", tmp_path / "out")
    tampered = tmp_path / "tampered"
    shutil.copytree(source.path, tampered)
    blob = next(tampered.rglob("weight.bin"))
    data = bytearray(blob.read_bytes())
    data[-3] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(IdentityError, match="weight.bin"):
        compress_package(tampered, "int4-b32", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_kl_against_a_fixed_distribution_is_torchs_kl_within_float64_summation():
    """`kl_rows_against` (what `Calibration.kl_with` measures a trial by: one exp per logit)
    against torch's kl_div of the two log-softmaxes in float64. Each side sums V products or
    exps in float64; by Higham each such sum errs by at most γ_V(2^-53) times the sum of its
    terms' magnitudes, which Σ p ≤ 1 bounds by B = max|log p| + max|x - max x| + log V + 1 for
    any of the three sums here; two sides, three sums each: 6 γ_V B."""
    from pipeline.ground.backend_protocol import kl_rows_against, log_softmax
    from pipeline.ground.models.numerics import gamma

    rng = np.random.default_rng(7)
    vocab = 50_000
    reference = (3 * rng.standard_normal((16, vocab))).astype(np.float32)
    trial = reference + (0.05 * rng.standard_normal(reference.shape)).astype(np.float32)
    log_p = log_softmax(reference)
    p = np.exp(log_p)
    got = kl_rows_against(p, np.einsum("rv,rv->r", p, log_p), trial)
    want = torch.nn.functional.kl_div(torch.log_softmax(torch.from_numpy(trial).double(), -1),
                                      torch.from_numpy(log_p), log_target=True, reduction="none").sum(-1).numpy()
    spread = trial.astype(np.float64) - trial.max(-1, keepdims=True)
    bound = 6 * gamma(vocab, 2.0**-53) * (np.abs(log_p).max() + np.abs(spread).max() + np.log(vocab) + 1)
    assert np.abs(got - want).max() <= bound < want.min() / 1e3


def test_input_hessians_are_the_mean_of_x_xT_within_a_float32_windows_rounding():
    """Each linear's Hessian is E[x x^T] of its inputs, here gathered by a hook on the norm that
    feeds q, k and v and summed in float64; the calibration sums each window's float32 product
    of WINDOW rows in float64, so they differ by at most γ_WINDOW (float32) of the summed
    magnitudes, plus float64's own rounding of the sum over every row."""
    from coreml.calibration import WINDOW, Calibration

    model = build_model(ModelArgs.from_header({"arch": ARCH}), random_weights(seed=1)).eval()
    calib = Calibration.of_model(model, np.random.default_rng(3).integers(0, VOCAB, 4 * WINDOW), count=4)
    hessians = calib.input_hessians()
    seen = []
    hook = model.model.layers[0].input_layernorm.register_forward_hook(
        lambda _m, _a, out: seen.append(out.reshape(-1, out.shape[-1])))
    with torch.no_grad():
        for window in calib.windows:
            model.hidden(torch.as_tensor(window))
    hook.remove()
    x = torch.cat(seen).double().numpy()
    want, magnitude = x.T @ x / len(x), np.abs(x).T @ np.abs(x) / len(x)

    def gamma(n, u):
        return n * u / (1 - n * u)

    bound = (gamma(WINDOW, 2.0 ** -24) + 2 * gamma(len(x), 2.0 ** -53)) * magnitude
    for proj in ("q_proj", "k_proj", "v_proj"):
        got = hessians[f"model.layers.0.self_attn.{proj}.weight"]
        assert got.dtype == np.float64 and np.all(np.abs(got - want) <= bound), proj


def test_gptq_drops_each_hessians_pages_once_its_weight_is_coded(tmp_path, monkeypatch):
    """A survey's Hessians are a shared map (`coreml.cache`), read whole by one weight's coding
    each: once the code is made (or found), its Hessian's pages leave the process. The codes are
    those made without releasing anything, bit for bit (a released page reads back the same)."""
    from coreml.cache import ResultCache
    from coreml.calibration import Calibration
    from coreml.recipes import RECIPES, gptq
    from coreml.recipes.base import Weight

    model = build_model(ModelArgs.from_header({"arch": ARCH}), random_weights(seed=1)).eval()
    ids = np.random.default_rng(3).integers(0, VOCAB, 2 * 128)
    calib = Calibration.of_model(model, ids, count=2)
    calib.cache, calib.weights_identity = ResultCache(tmp_path / "cache"), "test"
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)] + ["model.layers.0.self_attn.q_proj.weight"]
    weights = [Weight(f"w{i}", (name,), calib.weight(name).shape, ("linear",), ()) for i, name in enumerate(names)]
    hessians = calib.input_hessians()
    released = []
    monkeypatch.setattr(gptq, "release_pages", lambda array: released.append(array))
    encoders = RECIPES["gptq-int4-b32"].encoders(weights, calib)
    for w in weights:
        before = len(released)
        code = encoders[w.name](calib.weight(w.hf_names[0]))
        assert [id(a) for a in released[before:]] == [id(hessians[w.hf_names[0]])]
        fresh = gptq.GptqAffine(4).encode_for(calib.weight(w.hf_names[0]), np.array(hessians[w.hf_names[0]]))
        assert all(np.array_equal(getattr(code, f), getattr(fresh, f)) for f in ("data", "scale", "offset"))


def test_sensitivity_weighted_palette_weighs_each_column_by_its_calibration_second_moment(source, tmp_path):
    with pytest.raises(RecipePrecondition, match="calibration_ids"):
        compress_package(source.path, "palette4-skm", tmp_path / "none")
    ids = np.random.default_rng(6).integers(0, VOCAB, 256).astype(np.int64)
    skm = compress_package(source.path, "palette4-skm", tmp_path / "skm", calibration_ids=ids)
    original = random_weights(seed=1)
    model = build_model(ModelArgs.from_header({"arch": skm["architecture"]}), original)
    # q_proj of layer 0 reads the first layer's input norm of the embedded tokens: its moments
    # computed here from the model's own modules, not through the recipe's hooks.
    with torch.no_grad():
        x = torch.cat([model.model.layers[0].input_layernorm(model.model.embed_tokens.weight[torch.as_tensor(w)])
                       for w in (ids[:128], ids[128:])])
    moments = (x.double() ** 2).mean(0).numpy()
    name = "model.layers.0.self_attn.q_proj.weight"
    want = codes.kmeans_tiles(original[name], 4, (32, 32), moments).decode()
    got = _decompressed_weights(skm)[name]
    # The recipe's moments are the same sums in another order: a LUT entry may differ in its
    # last fp16 bit, so compare through the codes' own fp16 rounding.
    assert np.abs(got - want).max() <= 2.0 ** -10 * np.abs(want).max()
    assert not np.array_equal(got, codes.kmeans_tiles(original[name], 4, (32, 32)).decode())  # weighting changed it


def test_gptq_recipe_codes_each_linear_for_its_calibration_inputs(source, compressed, tmp_path):
    """gptq-int4-b32 on calibration ids: layer 0's q_proj and the tied embedding (as the head)
    have a lower output error than int4-b32's plain fit of the same grid on their inputs,
    gathered here by hooks on the model's own modules (the first layer's input norm, the
    final norm), not through the recipe's."""
    with pytest.raises(RecipePrecondition, match="calibration_ids"):
        compress_package(source.path, "gptq-int4-b32", tmp_path / "none")
    ids = np.random.default_rng(8).integers(0, VOCAB, 128 * 16).astype(np.int64)
    gptq = _decompressed_weights(compress_package(source.path, "gptq-int4-b32", tmp_path / "gptq",
                                                  calibration_ids=ids))
    plain = _decompressed_weights(compressed["int4-b32"])
    original = random_weights(seed=1)
    model = build_model(ModelArgs.from_header({"arch": compressed["int4-b32"]["architecture"]}), original)
    inputs = {"model.layers.0.self_attn.q_proj.weight": model.model.layers[0].input_layernorm,
              "model.embed_tokens.weight": model.model.norm}
    seen = {name: [] for name in inputs}
    hooks = [module.register_forward_hook(lambda _m, _a, out, name=name: seen[name].append(out.reshape(-1, out.shape[-1])))
             for name, module in inputs.items()]
    with torch.no_grad():
        for window in ids.reshape(16, 128):
            model(torch.as_tensor(window))
    for hook in hooks:
        hook.remove()
    for name, outputs in seen.items():
        x = torch.cat(outputs).double().numpy()
        hessian = x.T @ x / len(x)

        def output_error(decoded):
            e = decoded.astype(np.float64) - original[name]
            return np.einsum("ij,jk,ik->", e, hessian, e)

        assert output_error(gptq[name]) < output_error(plain[name]), name


@pytest.mark.parametrize("recipe", ["int8-b32", "int8-b32-embfp16", "palette4-gc32", "gptq-int4-b32"])
def test_a_program_loaded_over_the_weight_file_compresses_to_the_same_package(source, tmp_path, monkeypatch,
                                                                              recipe):
    """The compression reads the package's float constants as read-only views of its weight file,
    not as coremltools' copies: the program's large float32 constants lie in that file's map, and
    the compressed package is the one the copying loader makes, byte for byte (the mlpackage's
    Manifest.json apart: its item identifiers are fresh UUIDs each save)."""
    from coreml.recipes import compress as compress_module
    from pipeline.ground.pages import is_mapped

    mlmodel = ct.models.MLModel(str(source.path / "model.mlpackage"), skip_model_load=True)
    program = compress_module.load_program(mlmodel)
    floats = [op.val.val for op in program.functions["main"].operations
              if op.op_type == "const" and isinstance(op.val.val, np.ndarray) and op.val.val.dtype == np.float32
              and op.val.val.size > 64]
    assert floats and all(is_mapped(value) and not value.flags.writeable for value in floats)

    extra = {"calibration_ids": np.arange(2, 200, dtype=np.int64)} if RECIPES[recipe].calibration else {}
    compress_package(source.path, recipe, tmp_path / "mapped", **extra)
    monkeypatch.setattr(compress_module, "_float_blobs_mapped", contextlib.nullcontext)
    compress_package(source.path, recipe, tmp_path / "copied", **extra)
    files = sorted(p.relative_to(tmp_path / "mapped") for p in (tmp_path / "mapped").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "copied") for p in (tmp_path / "copied").rglob("*") if p.is_file())
    compared = [name for name in files if name.name not in ("Manifest.json", "manifest.json")]
    assert {name.name for name in compared} >= {"model.mlmodel", "weight.bin"}
    for name in compared:
        assert (tmp_path / "mapped" / name).read_bytes() == (tmp_path / "copied" / name).read_bytes(), name
