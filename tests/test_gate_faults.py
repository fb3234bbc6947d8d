"""Every seeded converter fault (`pipeline.stages.gates.faults`) fails its gate, and the report
says which part failed and where: the gates are shown to catch what they exist for (issue 49).
The fixture's FP32 chunk-KV package, the kind the gates and scoring run most."""

import pytest

from _survey_models import cloze_slice
from conftest import FIXTURE_REFERENCE
from manifests.identity import read_json
from pipeline.cli import main
from pipeline.stages.gates.faults import FAULTS, FaultNotApplicable, seeded_copy


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    return cloze_slice(tmp_path_factory.mktemp("items") / "items.jsonl")


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_seeded_fault_fails_the_gate_and_the_report_says_where(fault, fixture_packages, fixture_bundle, items,
                                                                 tmp_path, capsys):
    package, where = seeded_copy(fixture_packages / "chunk_kv", fixture_bundle, tmp_path / "coreml" / "chunk_kv", fault)
    assert main(["verify-artifact", str(package)]) == 0  # the identity chain holds: only numerics can tell
    out = tmp_path / "gate"
    assert main(["align", str(package), "--fixtures", str(FIXTURE_REFERENCE), "-o", str(out),
                 "--items", str(items)]) == 1, where
    report = read_json(out / "alignment.json")
    assert not report["passed"]
    failed_parts = [part for part, ok in (("exactness", report["summary"]["exact"]),
                                          ("quality", report["quality"]["within_budget"]),
                                          ("invariants", report["summary"]["invariants_passed"])) if ok is False]
    assert failed_parts, report["summary"]
    if "exactness" in failed_parts:  # where: the case and pattern of each failed comparison
        failed = [r for r in report["records"] if not r["passed"]]
        assert failed and all(r["case"] and r["pattern"] for r in failed)
    assert "GateFailed" in capsys.readouterr().err


def test_a_fault_that_cannot_be_seeded_is_refused_by_name(fixture_packages, fixture_bundle, tmp_path):
    with pytest.raises(FaultNotApplicable, match="not among"):
        seeded_copy(fixture_packages / "chunk_kv", fixture_bundle, tmp_path / "x", "no_such_fault")
