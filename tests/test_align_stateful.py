"""The stateful package's alignment gate: the default fixture's fp16-KV-state package against
the frozen PyTorch FP32 fixtures, run by the MIL executor through coreml.runner.StatefulRunner."""

import contextlib
import io
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import FIXTURE_REFERENCE
from coreml.package import open_package
from coreml.runner import PackageBackend, PackageInterfaceError, StatefulRunner
from manifests.chain import verify_artifact
from manifests.identity import MANIFEST_NAME, inventory, read_json, write_json
from pipeline.align import (
    BRANCH_A,
    BRANCH_B,
    FP16_CACHE_HEADROOM,
    PATTERN_INVARIANTS,
    TOLERANCES,
    GateFailed,
    ReferenceFixtures,
    align_package,
    chunk_patterns,
    gate_policy,
    require_passed,
    tolerance_dict,
)
from pipeline.cli import main

CASES = ("short", "long", "right_pad", "changed_future")


@pytest.fixture(scope="module")
def gate(fixture_stateful, tmp_path_factory):
    """The gate run through the CLI: (report folder, alignment.json, printed line)."""
    out = tmp_path_factory.mktemp("align-stateful") / "gate"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["align", str(fixture_stateful), "--fixtures", str(FIXTURE_REFERENCE), "-o", str(out)])
    assert status == 0
    return out, read_json(out / "alignment.json"), printed.getvalue()


@pytest.fixture(scope="module")
def runner(fixture_stateful):
    return StatefulRunner(open_package(fixture_stateful, backend="executor"))


def test_stateful_package_passes_its_fp16_cache_gate(gate, fixture_stateful):
    out, report, printed = gate
    assert report["passed"] and report["candidate_backend"] == "coreml-executor"
    assert report["recipe"] == "fp32" and report["policy"] == "fp32-fp16-cache"
    assert "stateful, coreml-executor, policy fp32-fp16-cache" in printed
    patterns = {(r["case"], r["pattern"]): r for r in report["records"]}
    expected = {(case, p) for case in CASES for p in chunk_patterns(16)} | {("long", "single_tokens_vs_kv_steps")}
    assert set(patterns) == expected and {r["check"] for r in report["records"]} == {"stateful"}
    # One prefill attends over its own float32 K/V: FP32-level against the reference.
    for case in CASES:
        assert patterns[case, "one_shot"]["max_abs"] <= TOLERANCES["fp32"].atol
    # Later chunks read fp16-rounded K/V: measurably beyond the FP32 bound, within the policy.
    assert TOLERANCES["fp32"].atol < report["summary"]["max_abs"] <= report["tolerance"]["atol"]
    measured = read_json(fixture_stateful / "manifest.json")["checks"]["fp16_cache_error_bound"]
    assert report["tolerance"]["atol"] == max(TOLERANCES["fp32-fp16-cache"].atol, FP16_CACHE_HEADROOM * measured)
    assert report["summary"]["outside"] == 0 and report["summary"]["top1_agreement_min"] == 1.0
    invariants = {i["name"]: i for i in report["invariants"]}
    assert all(i["passed"] for i in invariants.values())
    for case in CASES:
        for pattern in ("single_tokens", "split_3", "half_half"):
            assert f"{case}_{pattern}_equals_one_shot" in invariants
    # Prefix invariants compare one prefill with another: still the FP32 bound.
    assert report["invariant_tolerance"] == tolerance_dict(TOLERANCES["fp32"])
    assert report["pattern_tolerance"]["atol"] == report["tolerance"]["atol"]
    assert report["pattern_tolerance"]["max_kl"] >= PATTERN_INVARIANTS["fp32-fp16-cache"].max_kl
    for name in ("right_pad_prefix_equals_short", "changed_future_prefix_equals_short"):
        assert invariants[name]["max_abs"] <= TOLERANCES["fp32"].atol
    for name in ("branch_A_B_A_bitwise", "snapshot_unchanged", "dirty_tail_bitwise"):
        assert invariants[name]["passed"], name
    assert (out / "alignment.md").read_text().startswith("# Alignment gate: PASSED")
    assert verify_artifact(out)["passed"] is True
    require_passed(out)


def _miscompiled_copy(package, bundle, out):
    """The package with its final norm weight off by 0.1%, re-inventoried: the identity chain
    holds, as it would for a converter that wrote wrong numbers; only the gate can tell."""
    shutil.copytree(package, out)
    norm = load_file(bundle / "weights.safetensors")["model.norm.weight"].astype(np.float32)
    blob = next(out.rglob("weight.bin"))
    data = blob.read_bytes()
    assert data.count(norm.tobytes()) == 1
    blob.write_bytes(data.replace(norm.tobytes(), (norm * np.float32(1.001)).tobytes()))
    manifest = read_json(out / MANIFEST_NAME)
    manifest["files"] = inventory(out)
    write_json(out / MANIFEST_NAME, manifest)
    return out


def test_a_miscompiled_stateful_package_fails_and_keeps_its_report(fixture_stateful, fixture_bundle, tmp_path, capsys):
    package = _miscompiled_copy(fixture_stateful, fixture_bundle, tmp_path / "package")
    status = main(["align", str(package), "--fixtures", str(FIXTURE_REFERENCE), "-o", str(tmp_path / "gate")])
    assert status == 1
    err = capsys.readouterr().err
    assert err.startswith("GateFailed: ") and str(package) in err
    report = read_json(tmp_path / "gate" / "alignment.json")
    assert report["passed"] is False and report["policy"] == "fp32-fp16-cache"
    failing = [r for r in report["records"] if not r["passed"]]
    # Logits scale by 1.001 (|logit| up to 12): far outside 4e-3 + 3e-4·|ref| on every case.
    assert {r["case"] for r in failing} == set(CASES)
    assert all(r["max_abs"] > report["tolerance"]["atol"] for r in failing)
    assert (tmp_path / "gate" / "alignment.md").read_text().startswith("# Alignment gate: FAILED")
    with pytest.raises(GateFailed, match="did not pass"):
        require_passed(tmp_path / "gate")


@pytest.mark.parametrize("kind, recipe", [("stateful", "int8-b32"), ("stateless", "fp32-fp16-cache")])
def test_recipe_and_kind_must_fit_a_policy(fixture_stateful, fixture_packages, tmp_path, kind, recipe):
    package = fixture_stateful if kind == "stateful" else fixture_packages / kind
    with pytest.raises(GateFailed, match=rf"{package}: a {kind} package with recipe '{recipe}' has no gate policy"):
        align_package(package, FIXTURE_REFERENCE, tmp_path / "gate", recipe=recipe)
    assert not (tmp_path / "gate").exists()


def test_a_stateful_snapshot_is_never_mutated_by_a_later_run(runner):
    ids = ReferenceFixtures(FIXTURE_REFERENCE).cases["long"].input_ids
    _, snapshot = runner.run_schedule(ids[:9], [5, 4])
    before = (snapshot.key_cache.copy(), snapshot.value_cache.copy())
    assert snapshot.key_cache.dtype == np.float16 and snapshot.position == 9
    assert not snapshot.key_cache.flags.writeable and not snapshot.value_cache.flags.writeable
    a1, after_a = runner.run(snapshot, BRANCH_A)  # decode
    _, after_b = runner.run(snapshot, BRANCH_B)  # prefill
    a2, _ = runner.run(snapshot, BRANCH_A)
    np.testing.assert_array_equal(snapshot.key_cache, before[0])
    np.testing.assert_array_equal(snapshot.value_cache, before[1])
    np.testing.assert_array_equal(a1, a2)
    for later in (after_a, after_b):
        assert not np.shares_memory(later.key_cache, snapshot.key_cache)
        # The run wrote its own slots and left the snapshot's prefix as it was.
        np.testing.assert_array_equal(later.key_cache[..., :9, :], snapshot.key_cache[..., :9, :])
        assert np.any(later.key_cache[..., 9, :] != 0) and not np.any(later.key_cache[..., later.position:, :])


def test_stateful_runner_refuses_tokens_beyond_its_context(runner):
    _, snapshot = runner.run(runner.empty(), np.arange(runner.context - 2))
    with pytest.raises(PackageInterfaceError, match=rf"position {runner.context - 2} \+ 3 tokens exceeds"):
        runner.run(snapshot, [5, 6, 7])


def test_package_backend_branches_a_stateful_package(fixture_stateful):
    case = ReferenceFixtures(FIXTURE_REFERENCE).cases["long"]
    backend = PackageBackend(open_package(fixture_stateful, backend="executor"), chunk=8)
    prefix_logits, snapshot = backend.prefill(case.input_ids[:40])
    suffix_logits = backend.extend(snapshot, case.input_ids[40:56])
    got = np.concatenate([prefix_logits, suffix_logits])
    assert np.abs(got - case.logits[:56]).max() <= TOLERANCES["fp32-fp16-cache"].atol
    np.testing.assert_array_equal(backend.extend(snapshot, case.input_ids[40:56]), suffix_logits)


def test_the_fp16_cache_policy_scales_with_the_error_measured_at_conversion(tmp_path):
    """A 30-layer model's fp16 cache errs far more than the 4-layer fixture's (SmolLM2-135M:
    0.029 at conversion, 0.048 on its text fixtures): the floor rises to 4x its own figure."""
    manifest = {"package": {"kind": "stateful"}, "checks": {"fp16_cache_error_bound": 0.03}}
    policy, tol, pattern = gate_policy(tmp_path, manifest, "fp32")
    floor = TOLERANCES["fp32-fp16-cache"]
    assert policy == "fp32-fp16-cache" and tol.atol == pytest.approx(0.12) and pattern.atol == tol.atol
    assert tol.max_kl == pytest.approx(floor.max_kl * (0.12 / floor.atol) ** 2)
    assert (tol.rtol, tol.min_top1) == (floor.rtol, floor.min_top1)
    small = {"package": {"kind": "stateful"}, "checks": {"fp16_cache_error_bound": 1e-4}}
    kept = gate_policy(tmp_path, small, "fp32")[1]  # never below the floor
    assert (kept.atol, kept.rtol, kept.min_top1, kept.max_kl) == (floor.atol, floor.rtol, floor.min_top1, floor.max_kl)
    assert "0.0001 measured at conversion" in kept.why
    with pytest.raises(GateFailed, match="fp16_cache_error_bound"):
        gate_policy(tmp_path, {"package": {"kind": "stateful"}, "checks": {}}, "fp32")
