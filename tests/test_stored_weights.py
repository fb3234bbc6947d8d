"""The stored-weights invariant (`pipeline.stages.gates.invariants.WeightsAsIntended`) on the
fixture's packages, against references that differ from the package where the test says: the
check is bit for bit, finds a matrix the package does not hold, and counts a recipe's compressed
tensors apart (the seeded faults of tests/test_gate_faults.py edit the package instead)."""

from types import SimpleNamespace

import pytest
import torch

from coreml.package import open_package
from coreml.recipes import compress_package
from manifests.identity import read_json
from pipeline.stages.gates.invariants import GateRun, WeightsAsIntended
from pipeline.stages.gates.references import intended_references


def _intended(package_dir, bundle):
    return intended_references(package_dir, read_json(package_dir / "manifest.json"), bundle)[0]


def _records(package_dir, bundle, edit=lambda weights: weights) -> dict:
    """The invariant's record for the package at `package_dir`, its intended reference's weights
    passed through `edit`."""
    intended = _intended(package_dir, bundle)
    candidate = SimpleNamespace(package=open_package(package_dir, backend="executor"))
    gate = GateRun(candidate, None, {}, None, None, False, intended.args, edit(intended.model.named_weights()))
    [record] = WeightsAsIntended().run(gate)
    return record


def _one_step_up(name: str, at: tuple[int, int]):
    """An edit of the reference's weights: `name`'s entry `at` the next value of its dtype up."""
    def edit(weights):
        wrong = weights[name].clone()
        wrong[at] = torch.nextafter(wrong[at], torch.tensor(float("inf"), dtype=wrong.dtype))
        return {**weights, name: wrong}

    return edit


@pytest.mark.parametrize("kind", ["chunk_kv", "stateless"])
def test_every_matrix_of_a_correct_package_is_the_references_bit_for_bit(kind, fixture_packages, fixture_bundle):
    record = _records(fixture_packages / kind, fixture_bundle)
    assert record["passed"] and not record["differing"] and not record["not_held"], record
    weights = _intended(fixture_packages / kind, fixture_bundle).model.named_weights()
    assert record["plain"] >= sum(tensor.dim() >= 2 for tensor in weights.values())


def test_one_ulp_in_one_element_of_one_matrix_fails_and_is_named(fixture_packages, fixture_bundle):
    name = "model.layers.1.self_attn.o_proj.weight"
    record = _records(fixture_packages / "chunk_kv", fixture_bundle, _one_step_up(name, (3, 5)))
    assert not record["passed"]
    assert [(d["tensor"], d["elements"]) for d in record["differing"]] == [(name, 1)]
    assert 0 < record["max_abs"] < 1e-6


def test_a_matrix_the_package_does_not_hold_fails_by_name(fixture_packages, fixture_bundle):
    record = _records(fixture_packages / "chunk_kv", fixture_bundle,
                      lambda weights: {**weights, "model.layers.0.mlp.extra_proj.weight": torch.ones(4, 4)})
    assert not record["passed"] and record["not_held"] == ["model.layers.0.mlp.extra_proj.weight"]
    assert not record["differing"]


@pytest.mark.parametrize("recipe", ["int8-pc", "palette4-gc32", "int4-b32"])
def test_a_compressed_package_holds_its_codes_as_its_recipe_decoded_them(recipe, fixture_packages, fixture_bundle,
                                                                        tmp_path):
    compress_package(fixture_packages / "chunk_kv", recipe, tmp_path / recipe)
    record = _records(tmp_path / recipe, fixture_bundle)
    assert record["passed"] and not record["not_held"] and not record["coded_unrecorded"], record
    selection = read_json(tmp_path / recipe / "manifest.json")["selection"]["weights"]
    coded = [entry for entry in selection.values() if entry["compressed"]]
    assert record["coded"] == sum(len(entry["hf_names"]) for entry in coded) > 0
    assert all(len(entry["decoded_sha256"]) == 64 for entry in coded)
    assert record["plain"] > 0  # the norms stay plain constants, and are the bundle's


def test_a_code_decoded_otherwise_than_its_recipe_recorded_fails_and_is_named(fixture_packages, fixture_bundle,
                                                                            tmp_path):
    compress_package(fixture_packages / "chunk_kv", "int8-pc", tmp_path / "int8-pc")
    name = "model.layers.0.mlp.down_proj.weight"
    record = _records(tmp_path / "int8-pc", fixture_bundle, _one_step_up(name, (0, 0)))
    assert not record["passed"] and [d["tensor"] for d in record["differing"]] == [name]
    assert "decoded_sha256" in record["differing"][0]["why"]


def test_codes_coremltools_rewrote_after_the_recipe_wrote_them_carry_no_record(fixture_packages, fixture_bundle,
                                                                               tmp_path):
    """palette4-int8lut's LUTs are quantized by coremltools after the recipe wrote them
    (`Recipe.after_codes`): the recipe's decoding is no longer the package's, so it records none,
    and the gate's record says which codes it could not hold to one."""
    compress_package(fixture_packages / "chunk_kv", "palette4-int8lut", tmp_path / "lut")
    selection = read_json(tmp_path / "lut" / "manifest.json")["selection"]["weights"]
    assert not any("decoded_sha256" in entry for entry in selection.values())
    record = _records(tmp_path / "lut", fixture_bundle)
    assert record["passed"] and not record["not_held"]
    assert record["coded_unrecorded"] == sorted({t for e in selection.values() if e["compressed"] for t in e["hf_names"]})
