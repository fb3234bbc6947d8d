"""Alignment gates on the default fixture's real packages, run by the MIL executor."""

import json
import shutil

import numpy as np
import pytest

from conftest import FIXTURE_REFERENCE
from coreml.package import open_package
from coreml.runner import ChunkKVRunner
from manifests.chain import verify_artifact
from manifests.identity import read_json
from pipeline.align import (
    INVARIANT,
    GateFailed,
    ReferenceFixtures,
    align_package,
    branching_invariants,
    compare,
    require_passed,
)
from pipeline.cli import main


@pytest.fixture(scope="module")
def gates(fixture_packages, tmp_path_factory):
    out = tmp_path_factory.mktemp("align")
    reports = {kind: align_package(fixture_packages / kind, FIXTURE_REFERENCE, out / kind)
               for kind in ("stateless", "chunk_kv")}
    return out, reports


@pytest.mark.parametrize("kind", ["stateless", "chunk_kv"])
def test_fp32_packages_pass_their_gate(gates, kind):
    out, reports = gates
    report = reports[kind]
    assert report["passed"] and report["candidate_backend"] == "coreml-executor"
    assert report["summary"]["max_abs"] <= 3e-4 and report["summary"]["outside"] == 0
    cases = {r["case"] for r in report["records"]}
    assert cases >= {"short", "long", "right_pad", "changed_future"}
    names = {i["name"] for i in report["invariants"]}
    assert {"right_pad_prefix_equals_short", "changed_future_prefix_equals_short"} <= names
    on_disk = read_json(out / kind / "alignment.json")
    assert on_disk["records"] == json.loads(json.dumps(report["records"]))
    assert (out / kind / "alignment.md").read_text().startswith("# Alignment gate: PASSED")
    assert (out / kind / "alignment.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert verify_artifact(out / kind)["passed"] is True
    require_passed(out / kind)


def test_chunk_kv_gate_covers_schedules_and_branching(gates):
    report = gates[1]["chunk_kv"]
    patterns = {(r["case"], r["pattern"]) for r in report["records"]}
    for case in ("short", "long", "right_pad", "changed_future"):
        for pattern in ("one_shot", "single_tokens", "split_3", "half_half"):
            assert (case, pattern) in patterns
    assert ("long", "single_tokens_vs_kv_steps") in patterns
    invariants = {i["name"]: i for i in report["invariants"]}
    for name in ("branch_A_B_A_bitwise", "snapshot_unchanged", "dirty_tail_bitwise"):
        assert invariants[name]["passed"], name


def test_the_gate_compares_against_the_fixtures_not_itself(fixture_packages):
    """Independent recomputation: the executor's one-shot logits vs the frozen npz."""
    fixtures = ReferenceFixtures(FIXTURE_REFERENCE)
    package = open_package(fixture_packages / "stateless")
    case = fixtures.cases["long"]
    got = package.predict({"input_ids": case.input_ids.astype(np.int32)[None]})["logits"][0]
    assert np.abs(got - case.logits).max() <= 3e-4


def test_failed_gate_writes_its_report_and_exits_nonzero(fixture_packages, tmp_path, capsys):
    fixtures = tmp_path / "fixtures"
    shutil.copytree(FIXTURE_REFERENCE, fixtures)
    with np.load(fixtures / "logits.npz", allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    arrays["long.logits"][40, 7] += 0.01  # far outside 3e-4: the package is right, the "reference" is not
    np.savez(fixtures / "logits.npz", **arrays)

    status = main(["align", str(fixture_packages / "stateless"), "--fixtures", str(fixtures), "-o", str(tmp_path / "gate")])
    assert status == 1
    assert "GateFailed" in capsys.readouterr().err
    report = read_json(tmp_path / "gate" / "alignment.json")
    assert report["passed"] is False
    failing = [r for r in report["records"] if not r["passed"]]
    assert [(r["case"], r["outside"]) for r in failing] == [("long", 1)]
    assert (tmp_path / "gate" / "alignment.md").read_text().startswith("# Alignment gate: FAILED")
    with pytest.raises(GateFailed, match="did not pass"):
        require_passed(tmp_path / "gate")


def test_fixtures_of_another_checkpoint_are_refused(fixture_packages, tmp_path):
    fixtures = tmp_path / "fixtures"
    shutil.copytree(FIXTURE_REFERENCE, fixtures)
    index = read_json(fixtures / "index.json")
    index["checkpoint"]["sha256"] = "0" * 64
    (fixtures / "index.json").write_text(json.dumps(index))
    with pytest.raises(GateFailed, match="fixtures were made from CMF sha256 0{64}"):
        align_package(fixture_packages / "stateless", fixtures, tmp_path / "gate")
    assert not (tmp_path / "gate").exists()


def test_existing_report_is_kept_without_force(gates, fixture_packages):
    out, _ = gates
    before = (out / "stateless" / "alignment.json").read_bytes()
    with pytest.raises(Exception, match="--force"):
        align_package(fixture_packages / "stateless", FIXTURE_REFERENCE, out / "stateless")
    assert (out / "stateless" / "alignment.json").read_bytes() == before


class _LeakyTail(ChunkKVRunner):
    """A broken package stand-in: its output depends on cache slots it must not read."""

    def run(self, snapshot, ids):
        logits, nxt = super().run(snapshot, ids)
        return logits + 1e-3 * float(snapshot.key_cache[..., -1, :].mean()), nxt


def test_branching_invariants_catch_a_package_that_reads_its_unused_tail(fixture_packages):
    fixtures = ReferenceFixtures(FIXTURE_REFERENCE)
    prefix = fixtures.cases["long"].input_ids[:7]
    good = {i["name"]: i["passed"] for i in branching_invariants(ChunkKVRunner(open_package(fixture_packages / "chunk_kv")), prefix)}
    bad = {i["name"]: i["passed"] for i in branching_invariants(_LeakyTail(open_package(fixture_packages / "chunk_kv")), prefix)}
    assert all(good.values())
    assert bad["dirty_tail_bitwise"] is False and bad["branch_A_B_A_bitwise"] is True


def test_compare_counts_nonfinite_outputs_as_outside():
    want = np.zeros((2, 5), np.float32)
    got = want.copy()
    got[1, 3] = np.nan
    record = compare(got, want, INVARIANT)
    assert record["outside"] == 1 and not record["passed"]


def test_reference_fixtures_command_reproduces_the_frozen_fixtures(tmp_path):
    from fixtures.corpus import corpus_lines, split_lines
    from conftest import FIXTURE_CMF
    from _numerics import model_logits_bound
    from pipeline.reference import load_reference

    text = tmp_path / "held_out.txt"
    text.write_text("\n".join(split_lines(corpus_lines())[1]), encoding="utf-8")
    assert main(["reference-fixtures", str(FIXTURE_CMF), "-o", str(tmp_path / "ref"), "--text", str(text)]) == 0
    made, frozen = ReferenceFixtures(tmp_path / "ref"), ReferenceFixtures(FIXTURE_REFERENCE)
    assert made.checkpoint_sha256 == frozen.checkpoint_sha256
    # Frozen logits came from another CPU's float32 kernels: equal within two evaluations'
    # worst-case float32 error (tests/_numerics.py), not bitwise. Ids are integers: exact.
    bound = model_logits_bound(load_reference(FIXTURE_CMF)[0], len(frozen.cases["long"].input_ids))
    for name, case in frozen.cases.items():
        np.testing.assert_array_equal(made.cases[name].input_ids, case.input_ids)
        assert np.abs(made.cases[name].logits - case.logits).max() <= bound
    assert np.abs(made.kv_step_logits - frozen.kv_step_logits).max() <= bound
