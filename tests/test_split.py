"""Stateful packages split under a per-package limit (`cmfdeploy coreml --max-package-mb`,
coreml/split.py, docs/SPLIT.md): the plan's cuts, the default fixture converted in pieces at
FP32 and fp16 (a head in parts included) and run as one model against the unsplit package of
the same numerics, every piece under the limit, the manifest's claims checked against each
piece's program and refused when altered, the gate passing the chain and failing it with a
fault seeded in one piece, and the refusals by name.

The fixture (4 layers, hidden 128, vocabulary 1024, tied) holds 0.79 MiB of FP32 weights per
layer and 0.52 MiB of embedding: 2 MiB cuts it into [embedding, layer 0], [layers 1-2],
[layer 3, head].
"""

import re
import shutil

import numpy as np
import pytest

from conftest import FIXTURE_REFERENCE
from coreml.convert import export_coreml
from coreml.kinds.export import BadConversion, Conversion
from coreml.manifest import verify_package
from coreml.package import ChainedPackage, open_package
from coreml.runner import open_package_backend
from coreml.split import MB, Piece, PieceTooLarge, plan_pieces
from manifests.identity import MANIFEST_NAME, inventory, read_json, write_json
from pipeline.ground.errors import IdentityError
from pipeline.stages.gates import align_package
from pipeline.stages.gates.faults import seeded_copy

PROMPT = np.random.default_rng(7).integers(4, 1024, 70)


# --------------------------------------------------------------------------- the plan

def test_plan_fills_pieces_in_order_with_the_embedding_first_and_the_head_last():
    plan = plan_pieces([10] * 6, embed_bytes=25, head_bytes=25, limit=50)
    assert [(p.layers, p.embeds, p.head) for p in plan] == [
        ((0, 2), True, False), ((2, 6), False, False), ((6, 6), False, True)]
    # The head fits beside the last layers where it can.
    plan = plan_pieces([10] * 6, embed_bytes=25, head_bytes=10, limit=50)
    assert [(p.layers, p.embeds, p.head) for p in plan] == [((0, 2), True, False), ((2, 6), False, True)]
    assert [p.name for p in plan] == ["piece-1-of-2.mlpackage", "piece-2-of-2.mlpackage"]
    assert plan_pieces([10] * 3, 5, 5, limit=100) == (Piece(0, 1, (0, 3), True, True),)


@pytest.mark.parametrize("layers, embed, head, named", [
    ([10, 60, 10], 5, 5, "layer 1 (60 B)"),
    ([40, 10], 20, 5, "layer 0 (40 B) with the embedding"),
    ([10, 10], 5, 70, "the head alone holds 70 B"),
])
def test_plan_refuses_what_no_cut_fits(layers, embed, head, named):
    with pytest.raises(PieceTooLarge, match=re.escape(named)):
        plan_pieces(layers, embed, head, limit=50, where="model.cmf")


# --------------------------------------------------------------------------- conversions

@pytest.fixture(scope="module")
def converted(fixture_bundle, tmp_path_factory):
    """The fixture's stateful package at FP32 and fp16 (its head in parts of 300 rows), each
    whole and split, converted once for the module."""
    root = tmp_path_factory.mktemp("split")
    out = {}
    for name, conversion in {
        "fp32": Conversion(), "fp32-split": Conversion(max_package_mb=2),
        "fp16": Conversion("fp16", head_part_width=300),
        "fp16-split": Conversion("fp16", head_part_width=300, max_package_mb=1),
    }.items():
        export_coreml(fixture_bundle, root / name, kinds=("stateful",), conversion=conversion)
        out[name] = root / name / "stateful"
    return out


def _run(package_dir, backend="executor"):
    """Logits and caches of a prefill, then three decodes, through the stateful runner."""
    runner = open_package_backend(package_dir, backend=backend)
    logits, snapshot = runner.prefill(PROMPT)
    steps = [logits]
    for token in PROMPT[:3]:
        logits, snapshot = runner.advance(snapshot, np.array([token]))
        steps.append(logits)
    return steps, snapshot


@pytest.mark.parametrize("precision, limit_mb, pieces", [("fp32", 2, [(0, 1), (1, 3), (3, 4)]),
                                                          ("fp16", 1, [(0, 1), (1, 3), (3, 4)])])
def test_the_chain_is_the_unsplit_package_op_for_op(converted, precision, limit_mb, pieces):
    split, whole = converted[f"{precision}-split"], converted[precision]
    manifest = verify_package(split).data
    block = manifest["package"]
    assert [tuple(p["piece"]["layers"]) for p in block["pieces"]] == pieces
    assert block["split"]["max_package_bytes"] == limit_mb * MB
    for piece in block["pieces"]:
        on_disk = sum(f["bytes"] for name, f in manifest["files"].items() if name.startswith(piece["name"] + "/"))
        assert piece["package_bytes"] == on_disk <= limit_mb * MB
    # The chain's interface is the unsplit package's: the runner, gates and generate take it as one.
    unsplit = read_json(whole / MANIFEST_NAME)["package"]
    for key in ("inputs", "outputs", "states", "functions", "default_function"):
        assert block.get(key) == unsplit.get(key), key
    # Its head's parts too, save where the tied table lies: the whole looks tokens up from the
    # parts, the chain from its first piece's own table.
    if "head_split" in unsplit:
        assert {**unsplit["head_split"], "token_lookup": False} == block["head_split"]
        assert unsplit["head_split"]["token_lookup"] is True
    got, got_cache = _run(split)
    want, want_cache = _run(whole)
    # The same ops on the same values in the same order: the pieces pass the hidden state in the
    # dtype the unsplit program holds it in, so nothing rounds differently. Both sides run in this
    # process on the executor's one set of kernels, so the equality holds whatever a CPU's kernels
    # round (AVX2, AVX-512, arm64): it compares the two programs, not this machine's bits.
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got_cache.key_cache, want_cache.key_cache)
    np.testing.assert_array_equal(got_cache.value_cache, want_cache.value_cache)


def test_fp16_pieces_pass_the_hidden_state_in_fp16_and_the_last_splits_the_head(converted):
    block = read_json(converted["fp16-split"] / MANIFEST_NAME)["package"]
    first, middle, last = block["pieces"]
    assert [f["name"] for f in first["inputs"]] == ["input_ids", "position"]
    assert [(f["name"], f["dtype"]) for f in first["outputs"]] == [("hidden_out", "float16")]
    assert [(f["name"], f["dtype"]) for f in middle["inputs"]][0] == ("hidden_in", "float16")
    assert [f["name"] for f in last["outputs"]] == ["logits_0", "logits_1", "logits_2", "logits_3"]
    assert "head_split" in last and "head_split" not in first
    assert [s["shape"][0] for s in middle["states"]] == [2, 2]
    chain = open_package(converted["fp16-split"], backend="executor", function_name="decode")
    assert isinstance(chain, ChainedPackage) and chain.function_name == "decode"


def test_a_tied_table_is_counted_once_where_the_whole_fits(fixture_bundle):
    """One program stores the fixture's tied table once (3.67 MB in all at FP32): at 4 MB it is
    not split, though the table counted in a first piece and again in a last (4.20 MB) is over."""
    from coreml.kinds.export import reference_for_export
    from coreml.kinds.stateful_split import split_plan

    assert split_plan(reference_for_export(fixture_bundle, conversion=Conversion(max_package_mb=4))) is None
    plan = split_plan(reference_for_export(fixture_bundle, conversion=Conversion(max_package_mb=3)))
    assert [p.layers for p in plan] == [(0, 3), (3, 4)]


def test_a_head_alone_is_a_piece_without_states(fixture_bundle, tmp_path, monkeypatch):
    import coreml.kinds.stateful_split as split

    def head_apart(layers, embed, head, limit, where):
        return (Piece(0, 3, (0, 2), True, False), Piece(1, 3, (2, 4), False, False), Piece(2, 3, (4, 4), False, True))

    monkeypatch.setattr(split, "plan_pieces", head_apart)
    # 3 MB: under the model's 3.67 MB (the whole is not split where it fits), over each piece's.
    export_coreml(fixture_bundle, tmp_path / "pkg", kinds=("stateful",), conversion=Conversion(max_package_mb=3))
    manifest = verify_package(tmp_path / "pkg" / "stateful").data
    head = manifest["package"]["pieces"][-1]
    assert "states" not in head and head["piece"] == {"index": 2, "count": 3, "layers": [4, 4], "takes": "hidden",
                                                      "gives": "logits"}
    assert manifest["checks"]["executor_vs_fp16_cache_graph_max_abs"]  # measured as the chain


# --------------------------------------------------------------------------- claims and refusals

def _altered(package_dir, tmp_path, edit):
    copy = tmp_path / "altered"
    shutil.copytree(package_dir, copy)
    manifest = read_json(copy / MANIFEST_NAME)
    edit(manifest)
    manifest["files"] = inventory(copy)
    write_json(copy / MANIFEST_NAME, manifest)
    return copy


@pytest.mark.parametrize("edit, field", [
    (lambda m: m["package"]["pieces"][1]["piece"].update(layers=[1, 2]), "package.pieces"),
    (lambda m: m["package"]["pieces"].reverse(), "package.pieces"),
    (lambda m: m["package"]["pieces"][0].update(name="piece-2-of-3.mlpackage"), "package.pieces"),
    (lambda m: m["package"].update(package_bytes=1), "belong to package.pieces"),
    (lambda m: m.update(package_bytes=m["package_bytes"] - 1), "package_bytes"),
    (lambda m: m["package"]["pieces"][1]["states"][0]["shape"].__setitem__(0, 3), re.escape("package.states[key_cache].shape")),
    (lambda m: m["package"]["pieces"][0]["outputs"][0].update(name="hidden_in"), "package.outputs"),
])
def test_the_cross_check_refuses_a_piece_claim_its_program_contradicts(converted, tmp_path, edit, field):
    with pytest.raises(IdentityError, match=field):
        verify_package(_altered(converted["fp32-split"], tmp_path, edit))


def test_a_piece_program_in_another_place_is_refused(converted, tmp_path):
    copy = tmp_path / "swapped"
    shutil.copytree(converted["fp32-split"], copy)
    first, last = copy / "piece-1-of-3.mlpackage", copy / "piece-3-of-3.mlpackage"
    first.rename(tmp_path / "held")
    last.rename(first)
    (tmp_path / "held").rename(last)
    manifest = read_json(copy / MANIFEST_NAME)
    manifest["files"] = inventory(copy)
    write_json(copy / MANIFEST_NAME, manifest)
    with pytest.raises(IdentityError, match="cmfdeploy.piece|package.interface|piece"):
        verify_package(copy)


def test_a_loader_interface_of_one_package_is_not_split(fixture_bundle, tmp_path):
    with pytest.raises(BadConversion, match="causal-lm interface's loader runs one package"):
        export_coreml(fixture_bundle, tmp_path / "pkg", kinds=("stateful",),
                      conversion=Conversion("fp16", interface="causal-lm", max_package_mb=1))
    assert not (tmp_path / "pkg").exists()


@pytest.mark.parametrize("limit", [0, -1, True, "1"])
def test_a_limit_that_is_not_a_positive_size_is_refused(fixture_bundle, tmp_path, limit):
    with pytest.raises(BadConversion, match="max_package_mb"):
        export_coreml(fixture_bundle, tmp_path / "pkg", kinds=("stateful",), conversion=Conversion(max_package_mb=limit))


def test_a_limit_below_one_layer_is_refused_by_name(fixture_bundle, tmp_path):
    with pytest.raises(PieceTooLarge, match="layer 0 .* with the embedding"):
        export_coreml(fixture_bundle, tmp_path / "pkg", kinds=("stateful",), conversion=Conversion(max_package_mb=0.5))


# --------------------------------------------------------------------------- the gate

def test_the_gate_passes_the_chain_and_fails_a_fault_in_one_piece(converted, fixture_bundle, tmp_path):
    passed = align_package(converted["fp32-split"], FIXTURE_REFERENCE, tmp_path / "align")
    assert passed.passed, passed.failure()
    assert set(passed.report["compute_units"]["ane"]["functions"]) == {
        f"piece-{i}-of-3.mlpackage:{f}" for i in (1, 2, 3) for f in ("prefill", "decode")}
    # A 0.1% fault in the middle layer's matrix, in the piece that holds it (layers 1-2).
    faulty, where = seeded_copy(converted["fp32-split"], fixture_bundle, tmp_path / "faulty" / "stateful",
                                "matrix_scale")
    assert where == "model.layers.2.mlp.down_proj.weight"
    failed = align_package(faulty, FIXTURE_REFERENCE, tmp_path / "align-faulty")
    assert not failed.passed
    assert not failed.report["exactness"]["passed"]


# --------------------------------------------------------------------------- compressed, deployed, released

@pytest.fixture(scope="module")
def survey(fixture_packages, tmp_path_factory):
    from _survey_models import built_survey

    return built_survey(fixture_packages, tmp_path_factory.mktemp("split-survey"))


@pytest.fixture(scope="module")
def deployed(converted, survey, tmp_path_factory):
    """The survey's deployed recipe on the split FP32 stateful package, gated, and released."""
    from pipeline.stages.deploy import deploy_package
    from pipeline.stages.release import make_release

    root = tmp_path_factory.mktemp("split-deploy")
    gate = root / "gate-fp32-split"
    assert align_package(converted["fp32-split"], FIXTURE_REFERENCE, gate, items=survey.items).passed
    deployment = deploy_package(survey.path, converted["fp32-split"], gate, root / "deployed",
                                fixtures_dir=FIXTURE_REFERENCE, items=survey.items)
    release = make_release(survey.path, root / "dist", packages=[(converted["fp32-split"], gate)],
                           deployment=deployment.manifest.path)
    return deployment, release


def test_a_split_package_is_compressed_piece_by_piece_with_the_unsplit_packages_codes(converted, tmp_path):
    from coreml.bits import bits_per_weight
    from coreml.recipes.compress import code_digests, compress_package

    split = compress_package(converted["fp32-split"], "int8-b32", tmp_path / "split")
    whole = compress_package(converted["fp32"], "int8-b32", tmp_path / "whole")
    verify_package(split.path)
    assert [p["name"] for p in split["package"]["pieces"]] == [f"piece-{i}-of-3.mlpackage" for i in (1, 2, 3)]
    assert split["size_bytes"] == sum(p["package_bytes"] for p in split["package"]["pieces"]) < split["base_size_bytes"]
    # The tied table is coded once, alike in the first piece (its lookup) and the last (the head).
    assert code_digests(split.path) == code_digests(whole.path)
    assert split["selection"]["weights"]["model_model_embed_tokens_weight"]["consumers"] == ["gather", "linear"]
    got, _ = _run(split.path)
    want, _ = _run(whole.path)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # Its bits count the table twice as stored, its parameters once.
    bits, unsplit = bits_per_weight(split.path), bits_per_weight(whole.path)
    assert bits["parameters"] == unsplit["parameters"]
    table = 1024 * 128  # the fixture's embedding, int8 codes and one scale per block of 32
    assert bits["weight_bytes"] - unsplit["weight_bytes"] == table + table // 32 * 4


def test_the_deployed_split_package_carries_the_surveyed_codes_and_passes_its_gate(deployed, survey):
    from coreml.recipes.compress import code_digests
    from pipeline.stages.deploy import verify_deployment

    deployment, _ = deployed
    recipe = survey.record["deployed"]["recipe"]
    assert code_digests(deployment.package_dir) == code_digests(survey.path / "packages" / recipe)
    manifest = read_json(deployment.package_dir / MANIFEST_NAME)
    assert all(p["package_bytes"] <= 2 * MB for p in manifest["package"]["pieces"])
    assert deployment.passed
    verify_deployment(deployment.manifest.path)


def test_the_release_lists_the_pieces_and_runs_them_as_one_model(deployed, survey):
    from coreml.manifest import pieces_sha256
    from _survey_models import greedy_of_release_and_survey
    from pipeline.stages.release import prediction_lines, usage_markdown, verify_release

    _, release = deployed
    verify_release(release.path)
    shipped = next(e for e in release["packages"] if e["role"] == "shipped")
    package = read_json(release.path / shipped["path"] / MANIFEST_NAME)
    metadata = read_json(release.path / "metadata.json")
    assert metadata["assets"]["model"] == shipped["path"]
    assert [(p["path"], p["layers"], p["sha256"]) for p in metadata["assets"]["pieces"]] == [
        (f"{shipped['path']}/piece-{i + 1}-of-3.mlpackage", layers, digest)
        for i, (layers, digest) in enumerate(zip([[0, 1], [1, 3], [3, 4]], pieces_sha256(package)))]
    text = "\n".join(usage_markdown(release.data))
    assert "class Chain" in text and "piece-3-of-3.mlpackage" in text and '"hidden_in": hidden' in text
    # RELEASE.md's Python lines run as written on the chain (the executor standing in for Core ML).
    ids = [int(i) for i in PROMPT[:20]]
    model = open_package(release.path / shipped["path"], backend="executor", function_name="prefill")
    scope = {"np": np, "model": model, "ids": ids, "inputs": {"input_ids": np.array([ids], dtype=np.int32)}}
    exec("\n".join(prediction_lines(release["interface"])), scope)
    expected = open_package_backend(release.path / shipped["path"], backend="executor").logits(np.array(ids))[-1]
    assert np.array_equal(scope["logits"][0, -1].astype(np.float32), expected)
    # generate runs the release's chain as the surveyed unsplit package runs.
    released, surveyed = greedy_of_release_and_survey(release, survey.path / "packages" / release["recipe"])
    assert released == surveyed
