"""fp16 packages in the Neural Engine's layout (coreml.layout; docs/FP16.md "Neural Engine
layout"): enumerated chunk lengths instead of a range, and a head wider than the part width
split into `logits_0..` outputs. The default fixture's vocabulary (1024) is narrower than the
Neural Engine's 16384, so these packages are converted with a part width of 384: three parts of
384, 384 and 256 rows. Every check of `coreml.ane` passes on them, the runners keep the Backend
protocol (chunks split greedily into enumerated lengths, a stateless call right-padded), their
logits are the unsplit fp16 package's within the fp16 bound, and `align` gates them."""

import json
import shutil

import numpy as np
import pytest
import torch
from _survey_models import cloze_slice
from conftest import FIXTURE_REFERENCE

from coreml.ane import HW_LIMIT, ane_report
from coreml.convert import export_coreml
from coreml.kinds.export import Conversion
from coreml.kinds.cache_runner import padded_pieces, pieces
from coreml.layout import chunk_lengths, head_rows
from coreml.manifest import verify_package
from coreml.mil import MilError
from coreml.package import open_package
from coreml.runner import open_package_backend
from pipeline.ground.errors import IdentityError
from pipeline.ground.models.fp16 import fp16_reference
from pipeline.ground.models.numerics import fp16_logits_bound
from pipeline.ground.reference import load_reference
from pipeline.stages.release import prediction_lines, usage_markdown

KINDS = ("stateless", "chunk_kv", "stateful")
WIDTH = 384
LENGTHS = [1, 8, 64, 128]  # chunk_lengths of the fixture's 128-token context
PARTS = [["logits_0", [0, 384]], ["logits_1", [384, 768]], ["logits_2", [768, 1024]]]


@pytest.fixture(scope="module")
def packages(fixture_bundle, tmp_path_factory):
    """The fixture's three kinds at fp16 with the head in parts ("split"), and its chunk-KV
    package at fp16 with the default part width, wider than its vocabulary ("whole")."""
    root = tmp_path_factory.mktemp("ane-layout")
    split = export_coreml(fixture_bundle, root / "split", kinds=KINDS, conversion=Conversion("fp16", head_part_width=WIDTH))
    whole = export_coreml(fixture_bundle, root / "whole", kinds=("chunk_kv",), conversion=Conversion("fp16"))
    return {"split": split, "whole": whole["chunk_kv"], "root": root}


@pytest.fixture(scope="module")
def prompt():
    """75 token ids: 64 + 8 + 1 + 1 + 1 in enumerated lengths."""
    return (np.arange(75, dtype=np.int32) * 37 + 11) % 1024


def test_the_layout_is_decided_by_the_precision_and_sized_by_the_context():
    assert chunk_lengths(128) == tuple(LENGTHS) and chunk_lengths(32) == (1, 8, 32) and chunk_lengths(1) == (1,)
    assert head_rows(1024, WIDTH) == ((0, 384), (384, 768), (768, 1024))
    assert head_rows(49152, HW_LIMIT) == ((0, 16384), (16384, 32768), (32768, 49152))
    assert head_rows(1024, HW_LIMIT) is None
    assert pieces(75, tuple(LENGTHS)) == [64, 8, 1, 1, 1] and pieces(128, tuple(LENGTHS)) == [128]
    assert pieces(75, None) == [75]


def test_a_part_width_below_one_row_is_refused_by_name(fixture_bundle, tmp_path):
    from coreml.kinds.export import BadConversion

    with pytest.raises(BadConversion, match=r"conversion field 'head_part_width' \(--head-part-width\) is 0, not a "
                                            r"positive number of rows"):
        export_coreml(fixture_bundle, tmp_path / "out", kinds=("chunk_kv",), conversion=Conversion("fp16", head_part_width=0))
    assert not (tmp_path / "out").exists()


def test_every_ane_check_passes_and_the_package_claims_the_neural_engine(packages):
    for kind, manifest in packages["split"].items():
        block = manifest["package"]
        assert block["enumerated"] == {"T": LENGTHS}
        assert [[p["output"], p["rows"]] for p in block["head_split"]["parts"]] == PARTS
        assert block["head_split"]["weight"] == "model.embed_tokens.weight"  # the fixture's head is tied
        assert block["head_split"]["bytes"] == 1024 * 128 * 2
        assert [f["shape"] for f in block["outputs"][:3]] == [[1, "T", 384], [1, "T", 384], [1, "T", 256]]
        report = ane_report(manifest.path / "model.mlpackage")
        for function in report["functions"].values():
            assert {c["check"]: c["verdict"] for c in function["checks"]} == dict.fromkeys(
                ("fp16_compute", "fixed_shapes", "dimension_limits", "weight_compression", "no_input_output_alias"),
                "pass"), (kind, function["checks"])
        assert report["compute_units"] == ["cpu", "gpu", "ane"], kind
        verify_package(manifest.path)
    stateful = packages["split"]["stateful"]["package"]["functions"]
    assert stateful == {"prefill": {"dims": {"T": [1, 128]}, "enumerated": {"T": LENGTHS}},
                        "decode": {"dims": {"T": [1, 1]}}}
    whole = packages["whole"]["package"]
    assert "head_split" not in whole and [f["name"] for f in whole["outputs"]][0] == "logits"


def test_an_fp32_package_keeps_its_range_and_whole_head(fixture_packages):
    block = json.loads((fixture_packages / "chunk_kv" / "manifest.json").read_text())["package"]
    assert "enumerated" not in block and "head_split" not in block and block["dims"] == {"T": [1, 128]}
    check = {c["check"]: c for c in ane_report(fixture_packages / "chunk_kv" / "model.mlpackage")
             ["functions"]["main"]["checks"]}["fixed_shapes"]
    assert check["verdict"] == "fail" and check["detail"] == "input 'input_ids' takes a range [[1, 128]]"


def _bound(fixture_bundle, tokens):
    """Two fp16 evaluations of the fixture's model (numerics.fp16_logits_bound, the gates' form)."""
    return fp16_logits_bound(load_reference(fixture_bundle)[0], tokens, probable=True)


def test_split_logits_through_the_runner_are_the_unsplit_packages_within_the_fp16_bound(packages, fixture_bundle,
                                                                                      prompt):
    whole = open_package_backend(packages["whole"].path, backend="executor").logits(prompt)
    bound = _bound(fixture_bundle, len(prompt))
    for kind, manifest in packages["split"].items():
        logits = open_package_backend(manifest.path, backend="executor").logits(prompt)
        assert logits.shape == (75, 1024) and logits.dtype == np.float32 and np.isfinite(logits).all()
        assert np.abs(logits - whole).max() <= bound, kind
    # Against the fp16 reference (torch, the gates' intended numerics), within the same bound.
    with torch.no_grad():
        reference = fp16_reference(load_reference(fixture_bundle)[0])(torch.from_numpy(prompt).long()).numpy()
    assert np.abs(whole - reference).max() <= bound


def test_a_length_that_is_not_enumerated_is_refused_by_name(packages):
    chunk_kv = open_package(packages["split"]["chunk_kv"].path, backend="executor")
    cache = np.zeros(chunk_kv.spec_inputs["key_cache"].shape, np.float16)
    with pytest.raises(MilError, match=r"input 'input_ids': shape \(1, 5\) is not one of the enumerated shapes "
                                       r"\[\(1, 1\), \(1, 8\), \(1, 64\), \(1, 128\)\]"):
        chunk_kv.predict({"input_ids": np.zeros((1, 5), np.int32), "position": np.array([0], np.int32),
                          "key_cache": cache, "value_cache": cache})
    prefill = open_package(packages["split"]["stateful"].path, backend="executor", function_name="prefill")
    with pytest.raises(MilError, match=r"function prefill: input 'input_ids': shape \(1, 65\) is not one of"):
        prefill.predict({"input_ids": np.zeros((1, 65), np.int32), "position": np.array([0], np.int32)},
                        state=prefill.make_state())
    decode = prefill.function("decode")
    with pytest.raises(MilError, match=r"function decode: input 'input_ids': shape \(1, 8\) outside the declared"):
        decode.predict({"input_ids": np.zeros((1, 8), np.int32), "position": np.array([0], np.int32)},
                       state=decode.make_state())


class _Recorded:
    """A package whose predictions record the token count of each call."""

    def __init__(self, package):
        self.package, self.calls = package, []

    def __getattr__(self, name):
        return getattr(self.package, name)

    def predict(self, inputs, state=None):
        self.calls.append(np.asarray(inputs["input_ids"]).shape[1])
        return self.package.predict(inputs, state) if state is not None else self.package.predict(inputs)

    def predict_batch(self, batch, rows=None, outputs=None):
        self.calls.extend(np.asarray(inputs["input_ids"]).shape[1] for inputs in batch)
        return self.package.predict_batch(batch, rows, outputs)

    def function(self, name):
        return _Recorded(self.package.function(name))


def test_a_chunk_of_75_tokens_runs_as_64_8_1_1_1_and_its_logits_are_one_calls(packages, prompt):
    backend = open_package_backend(packages["split"]["chunk_kv"].path, backend="executor")
    recorded = backend.kv.package = _Recorded(backend.kv.package)
    logits, snapshot = backend.kv.run(backend.kv.empty(), prompt)
    assert recorded.calls == [64, 8, 1, 1, 1] and snapshot.position == 75
    # The same calls made by hand, each from the cache the one before wrote: the very same logits.
    cache = np.zeros(backend.kv.cache_shape, np.float16)
    keys, values, rows, position = cache, cache, [], 0
    for size in (64, 8, 1, 1, 1):
        out = recorded.package.predict({"input_ids": prompt[None, position:position + size],
                                        "position": np.array([position], np.int32),
                                        "key_cache": keys, "value_cache": values})
        rows.append(np.concatenate([out[f"logits_{i}"][0] for i in range(3)], axis=-1).astype(np.float32))
        keys, values, position = out["new_key_cache"], out["new_value_cache"], position + size
    assert np.array_equal(logits, np.concatenate(rows))
    assert np.array_equal(snapshot.key_cache, keys) and np.array_equal(snapshot.value_cache, values)
    # The stateful runner splits the same way (decode for the single tokens, prefill for the rest).
    stateful = open_package_backend(packages["split"]["stateful"].path, backend="executor")
    for name, function in stateful.kv.functions.items():
        stateful.kv.functions[name] = _Recorded(function)
    stateful.logits(prompt)
    assert stateful.kv.functions["prefill"].calls == [64, 8] and stateful.kv.functions["decode"].calls == [1, 1, 1]


def test_scoring_batches_pad_a_chunks_last_piece_and_the_padding_changes_no_real_row(packages, prompt):
    """Scoring's batches (`prefill_batch`, `extend_batch`) right-pad a chunk's last piece to an
    enumerated length where the cache has room: 45 tokens are one call of 64, not ten calls.
    By causality no real row reads the padding, and its K/V lie past the snapshot's position,
    where every later query masks them until a later chunk writes over them: the same bits
    whatever the padding holds."""
    assert padded_pieces(45, tuple(LENGTHS), 128) == [64] and padded_pieces(45, tuple(LENGTHS), 50) == [8] * 6
    assert padded_pieces(128, tuple(LENGTHS), 128) == [128] and padded_pieces(0, tuple(LENGTHS), 128) == []
    backend = open_package_backend(packages["split"]["chunk_kv"].path, backend="executor")
    recorded = backend.kv.package = _Recorded(backend.kv.package)
    ((last, snapshot),) = backend.prefill_batch([prompt[:45]])
    assert recorded.calls == [64] and snapshot.position == 45 and last.shape == (1, 1024)

    def joined(out):
        return np.concatenate([out[f"logits_{i}"][0] for i in range(3)], axis=-1).astype(np.float32)

    cache = np.zeros(backend.kv.cache_shape, np.float16)
    other_tail = np.concatenate([prompt[:45], np.full(19, 7, prompt.dtype)])
    # Scoring asks only for the prefix's last row, which the head alone computes: asked the same
    # of a call with another tail, the same bits.
    (by_hand,) = recorded.package.predict_batch(
        [{"input_ids": other_tail[None], "position": np.array([0], np.int32), "key_cache": cache, "value_cache": cache}],
        rows=[{f"logits_{i}": np.array([44]) for i in range(3)}])
    assert np.array_equal(last, joined(by_hand))
    (extended,) = backend.extend_batch([(snapshot, prompt[45:48])])
    assert recorded.calls[1:] == [8] and extended.shape == (3, 1024)
    # The padding's K/V in slots 45..63 of the snapshot are never read: zeroed, the same bits.
    clean = [np.array(c) for c in (snapshot.key_cache, snapshot.value_cache)]
    for c in clean:
        c[..., 45:, :] = 0
    (again,) = backend.extend_batch([(backend.kv._snapshot(*clean, 45), prompt[45:48])])
    assert np.array_equal(extended, again)


def test_a_stateless_call_is_right_padded_to_the_next_length_and_cut_back(packages, prompt, fixture_bundle):
    backend = open_package_backend(packages["split"]["stateless"].path, backend="executor")
    recorded = backend.package = _Recorded(backend.package)
    logits = backend.logits(prompt)
    assert recorded.calls == [128] and logits.shape == (75, 1024)
    # By causality the padding changes no row: the first 75 rows of the 128-token call on the
    # prompt and any other tail are the same bits.
    tail = np.concatenate([prompt, np.full(53, 7, np.int32)])
    out = recorded.package.predict({"input_ids": tail[None]})
    other = np.concatenate([out[f"logits_{i}"][0] for i in range(3)], axis=-1)[:75].astype(np.float32)
    assert np.array_equal(logits, other)


@pytest.mark.parametrize("lie, message", [
    (lambda b: b["head_split"]["parts"][1].update(rows=[384, 700]),
     r"field 'package.head_split.parts\[\].rows' is \[\(0, 384\), \(384, 700\), \(768, 1024\)\], but the vocabulary"),
    (lambda b: b["head_split"].update(bytes=1),
     r"field 'package.head_split.bytes' is 1, but 1024 rows of 128 at 2 bytes"),
    (lambda b: b.update(enumerated={"T": [1, 8, 128]}),
     r"field 'package.inputs\[input_ids\].shape \(function main\)' is \[1, \{'one of': \[1, 8, 128\]\}\]"),
    (lambda b: b["head_split"].update(token_lookup=False),
     r"field 'package.head_split.token_lookup \(function main, logits_0\)' is False, but whether a gather reads"),
], ids=["rows", "bytes", "lengths", "token_lookup"])
def test_verify_refuses_a_manifest_that_lies_about_the_layout(packages, tmp_path, lie, message):
    package = tmp_path / "chunk_kv"
    shutil.copytree(packages["split"]["chunk_kv"].path, package)
    data = json.loads((package / "manifest.json").read_text())
    lie(data["package"])
    (package / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(IdentityError, match=message):
        verify_package(package, hashes=False)


def test_the_release_snippet_concatenates_the_parts_and_feeds_enumerated_lengths(packages, prompt):
    ids = [int(i) for i in prompt]
    for kind, manifest in packages["split"].items():
        interface = manifest["package"]
        release = {"interface": interface, "model": "botchan-llama-1m", "recipe": "fp16", "survey": {"target": "ane"},
                   "packages": [{"role": "fp32", "path": f"packages/fp32-{kind}"},
                                {"role": "deployed", "path": "packages/fp16"}]}
        text = "\n".join(usage_markdown(release))
        assert "logits_0" in text and "logits_2" in text and "computeUnits = .cpuAndNeuralEngine" in text
        # The Python lines run as written, on the executor standing in for Core ML.
        model = open_package(manifest.path, backend="executor", function_name="prefill" if kind == "stateful" else None)
        scope = {"np": np, "model": model, "ids": list(ids), "inputs": {"input_ids": np.array([ids], dtype=np.int32)}}
        exec("\n".join(prediction_lines(interface)), scope)
        expected = open_package_backend(manifest.path, backend="executor").logits(prompt)[-1]
        assert np.array_equal(scope["logits"][0, -1].astype(np.float32), expected), kind
        assert scope["next_id"] == int(expected.argmax())


def test_align_gates_the_fp16_package_in_the_neural_engine_layout(packages):
    from pipeline.stages.gates import align_package

    items = cloze_slice(packages["root"] / "items.jsonl")
    gate = align_package(packages["split"]["chunk_kv"].path, FIXTURE_REFERENCE, packages["root"] / "gate", items=items)
    assert gate.passed, gate.failure()
    assert gate.report["quality"]["nonfinite_logits"] == 0
    assert "ane" in gate.report["compute_units"]["claimable"]


def test_a_split_packages_decoded_weights_hold_its_tied_table_once(packages, fixture_bundle):
    """The token lookup gathers from the head's parts (`head_split.token_lookup`), so the program
    holds no table beside them: `decoded_weights` joins the parts as the tied table itself, and
    the reference built from them is tied, as the package computes it."""
    from coreml.decoded import decoded_weights

    assert packages["split"]["chunk_kv"]["package"]["head_split"]["token_lookup"] is True
    decoded = decoded_weights(packages["split"]["chunk_kv"].path)
    tied = load_reference(fixture_bundle)[0]
    table = tied.model.embed_tokens.weight.detach().numpy().astype(np.float16).astype(np.float32)
    assert "lm_head.weight" not in decoded and np.array_equal(decoded["model.embed_tokens.weight"], table)
    assert not any("model.embed_tokens.weight" in names
                   for names in packages["split"]["chunk_kv"]["package"]["weights"].values())
    assert load_reference(fixture_bundle, replaced=decoded)[0].lm_head is None


@pytest.mark.parametrize("recipe", ["int8-pc", "palette4-gc32", "int4-b32"])
def test_a_recipe_codes_each_head_part_as_the_rows_of_the_table_it_codes(packages, tmp_path, recipe):
    """The parts are selected as rows of the head's HF tensor (`Weight.rows`) and coded by the step
    the recipe gives that tensor. A scale per row, a LUT per tile of 32 rows (384 and 256 are
    whole tiles), or the GPU's scale per block of 32 inputs of a row, codes a row from that row
    alone, so the parts, which the token lookup reads too, decode to exactly the table of the
    unsplit package coded whole."""
    from coreml.decoded import decoded_weights
    from coreml.recipes.compress import compress_package

    out = compress_package(packages["split"]["chunk_kv"].path, recipe, tmp_path / recipe)
    parts = sorted((e["rows"], e) for e in out.data["selection"]["weights"].values() if "rows" in e)
    assert [rows for rows, _ in parts] == [rows for _, rows in PARTS]
    assert all(e["compressed"] and e["hf_names"] == ["model.embed_tokens.weight"]
               and sorted(e["consumers"]) == ["gather", "linear"] for _, e in parts)
    whole = compress_package(packages["whole"].path, recipe, tmp_path / f"{recipe}-whole")
    decoded, coded_whole = decoded_weights(out.path), decoded_weights(whole.path)
    assert "lm_head.weight" not in decoded
    assert np.array_equal(decoded["model.embed_tokens.weight"], coded_whole["model.embed_tokens.weight"])


def test_an_int8_lut_palette_quantizes_the_luts_alone_and_its_split_package_is_exact(packages, tmp_path):
    """coremltools' LUT quantizer is given the palettes' LUTs by name: with a global config it
    also quantized a constant the recipe left as it was (the split head's parts, before they were
    selected), and the compression was refused. The package is then gated in full."""
    from coreml.recipes.compress import compress_package
    from pipeline.stages.gates import align_package

    out = compress_package(packages["split"]["chunk_kv"].path, "palette4-int8lut", tmp_path / "lut")
    chains = [e["chain"] for e in out.data["selection"]["weights"].values() if e["compressed"]]
    layers = out.data["architecture"]["num_layers"]
    assert len(chains) == 7 * layers + len(PARTS)  # 7 linears per layer, the head's parts (the table too)
    assert all(chain == ["constexpr_blockwise_shift_scale", "constexpr_lut_to_dense"] for chain in chains)
    summary = align_package(out.path, FIXTURE_REFERENCE, tmp_path / "gate", items=cloze_slice(tmp_path / "items.jsonl"),
                            all_figures=True).report["summary"]
    assert summary["exact"] and summary["invariants_passed"]


def test_a_split_packages_bits_count_its_tied_table_once(packages):
    """The tied table is stored once, as the head's parts the lookup reads: the split package
    stores the unsplit one's bytes over the same parameters."""
    from coreml.bits import bits_per_weight

    split, whole = bits_per_weight(packages["split"]["chunk_kv"].path), bits_per_weight(packages["whole"].path)
    assert split == whole


def test_a_recipe_of_whole_tensors_refuses_a_split_head_by_name(packages, tmp_path):
    from coreml.recipes.base import RecipePrecondition
    from coreml.recipes.compress import compress_package

    with pytest.raises(RecipePrecondition, match=r"recipe cmf-native: head_parts_0\S* holds rows \[0, 384\] of "
                                                 r"model.embed_tokens.weight \(a head split into 3 parts"):
        compress_package(packages["split"]["chunk_kv"].path, "cmf-native", tmp_path / "cmf-native")


def test_the_mixed_palettes_code_a_split_head_and_an_fp16_packages_own_constants(fixture_bundle, tmp_path):
    """The chooser codes the tied table's parts as the rows they hold and measures them joined,
    and an fp16 package's codes are made from its own constants: the mitigated model's tensors
    (residual scale 0.5 in the table, o_proj and down_proj) rounded to fp16, which each carried
    code is checked against. Every option is a palette or a per-channel scale: the package
    claims the Neural Engine, within the 6 bits it was given, and its gate is exact."""
    from coreml.bits import bits_per_weight
    from coreml.recipes.compress import compress_package
    from pipeline.ground.models.fp16 import Fp16Mitigations
    from pipeline.stages.gates import align_package

    conversion = Conversion("fp16", transform="pipeline.ground.models.fp16:mitigated_from_record",
                            mitigations=Fp16Mitigations(residual_scale=0.5).to_record(), head_part_width=WIDTH)
    package = export_coreml(fixture_bundle, tmp_path / "pkg", kinds=("chunk_kv",), conversion=conversion)["chunk_kv"]
    out = compress_package(package.path, "mixed-palette-6", tmp_path / "mixed", calibration_ids=np.arange(600) % 1024)
    mixed = out.data["selection"]["mixed"]
    assert set(mixed["choices"]) == {"model.embed_tokens.weight", *(f"layers.{i}" for i in range(4))}
    assert mixed["budget_bits"] > 0 and bits_per_weight(out.path)["bits_per_weight"] <= 6.0
    parts = [e for e in out.data["selection"]["weights"].values() if "rows" in e]
    assert len(parts) == len(PARTS) and all(e["compressed"] for e in parts)
    assert ane_report(out.path / "model.mlpackage")["compute_units"] == ["cpu", "gpu", "ane"]
    gate = align_package(out.path, FIXTURE_REFERENCE, tmp_path / "gate", items=cloze_slice(tmp_path / "items.jsonl"),
                         all_figures=True)
    assert gate.report["summary"]["exact"] and gate.report["summary"]["invariants_passed"], gate.failure()
