"""Issue 21's failure mode through packages and gates: a fixture-sized model whose residual
stream passes 65504 on "." (tests/_fp16_hazard.py). The fp16 package converted with the
preflight's mitigations is finite and passes its gate (exact against the fp16 reference under
the u16 bound, within the fp16 budget, invariants), and its stateful sibling's gate takes the
same quality record from it; the same package converted with the mitigations off is inf on "."
and fails its gate. Also: `--precision fp16` without a preflight of this bundle, or with a
refused one, builds nothing, and the survey takes a target."""

import json

import pytest

from _fp16_hazard import make_hazard_bundle
from _survey_models import cloze_slice
from pipeline.stages.gates import align_package, make_reference_fixtures
from pipeline.stages.gates.exactness import NOISE_FACTOR
from pipeline.stages.preflight import PreflightError, fp16_conversion, run_preflight

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
CONTEXT = 128


@pytest.fixture(scope="module")
def hazard(tmp_path_factory):
    from coreml.convert import export_coreml
    from coreml.kinds.export import Conversion

    root = tmp_path_factory.mktemp("fp16-gate")
    bundle = make_hazard_bundle(root)
    run_preflight(bundle, root / "preflight", context=CONTEXT)
    lines = (ROOT / "fixtures" / "botchan.txt").read_text(encoding="utf-8").splitlines()
    make_reference_fixtures(root / "hazard.cmf", root / "reference", lines, context=CONTEXT)
    # A CI-sized slice keeps the fp16 reference's scoring short; the gate's figures on it are real.
    cloze_slice(root / "items.jsonl")
    export_coreml(bundle, root / "mitigated", ["chunk_kv", "stateful"], context=CONTEXT,
                  conversion=fp16_conversion(bundle, root / "preflight"))
    export_coreml(bundle, root / "naive", ["chunk_kv"], context=CONTEXT, conversion=Conversion("fp16"))
    return root


def _gate(hazard, name, kind="chunk_kv", **options):
    return align_package(hazard / name / kind, hazard / "reference", hazard / f"gate-{name}-{kind}",
                         items=hazard / "items.jsonl", **options)


@pytest.fixture(scope="module")
def mitigated_gate(hazard):
    return _gate(hazard, "mitigated")


def test_the_mitigated_fp16_package_is_finite_and_passes_its_gate(hazard, mitigated_gate):
    manifest = json.loads((hazard / "mitigated" / "chunk_kv" / "manifest.json").read_text())
    assert manifest["numerics"]["mitigations"]["record"]["residual_scale"] < 1.0
    gate = mitigated_gate
    report = gate.report
    assert report["quality"]["budget"]["spec"] == "ppl=0.5%,top1=0.99"  # the fp16 precision's default
    assert report["quality"]["nonfinite_logits"] == 0
    assert report["numerics"].startswith("fp16 at op boundaries")
    # Held to 8x the fp16 reference's own rounding noise (fp16 against its function in float64),
    # under the fp16 a-priori bound (2·γ̃ over u16) as the ceiling.
    tolerance = report["tolerance"]
    assert "fp16 reference's own rounding noise" in tolerance["why"]
    assert tolerance["atol"] == NOISE_FACTOR * tolerance["noise"] < tolerance["ceiling"]
    assert gate.passed, gate.failure()
    assert set(report["compute_units"]["claimable"]) >= {"cpu", "gpu"}


@pytest.mark.parametrize("fault, seeded", [("norm_unscaled", "norms"), ("rmsnorm_eps", "read by mul")])
def test_a_fault_in_the_mitigated_norms_fails_the_gate(hazard, tmp_path, fault, seeded):
    """Seeded faults (pipeline.stages.gates.faults) where only a mitigated package has them:
    `norm_unscaled`, the converter left out the max-scaled norm the preflight chose, in a program
    that still claims it (its norms square the residual stream past 65504 on "."); and
    `rmsnorm_eps` on the max-scaled form's root eps (alpha sqrt(eps), which the residual scale
    alpha shrank), read by the `mul` that squares it."""
    from pipeline.stages.gates.faults import seeded_copy

    package, where = seeded_copy(hazard / "mitigated" / "chunk_kv", hazard / "bundle",
                                 tmp_path / "coreml" / "chunk_kv", fault)
    assert seeded in where
    gate = align_package(package, hazard / "reference", tmp_path / "gate", items=hazard / "items.jsonl")
    assert not gate.passed
    assert gate.report["summary"]["exact"] is False
    assert gate.report["summary"]["invariants_passed"] is False


def test_the_same_package_without_mitigations_is_inf_on_the_hazard_and_fails_its_gate(hazard):
    gate = _gate(hazard, "naive")
    report = gate.report
    assert not gate.passed
    assert report["quality"]["nonfinite_logits"] > 0
    assert "nonfinite_logits" in report["quality"]["over_budget"]
    assert not report["summary"]["within_budget"]


def test_an_fp16_conversion_takes_only_a_safe_preflight_of_its_own_bundle(hazard, tmp_path):
    other = make_hazard_bundle(tmp_path / "other", intermediate_gain=1.5)
    with pytest.raises(PreflightError, match="another bundle"):
        fp16_conversion(other, hazard / "preflight")
    from pipeline.ground.models.fp16 import Fp16Unsafe

    unsafe = make_hazard_bundle(tmp_path / "unsafe", intermediate_gain=400.0)
    with pytest.raises(Fp16Unsafe):
        run_preflight(unsafe, tmp_path / "unsafe-preflight", context=64)
    with pytest.raises(PreflightError, match="verdict"):
        fp16_conversion(unsafe, tmp_path / "unsafe-preflight")


def test_the_stateful_gate_takes_the_chunk_kv_gates_quality_record_which_is_its_own(hazard, mitigated_gate, tmp_path):
    from pipeline.stages.gates import GateFailed

    from pipeline.stages.gates import QualityInputs, intended_references, parse_budget, upstream_of
    from pipeline.stages.gates.quality import measure_quality
    from pipeline.stages.gates.stage import DEFAULT_QUALITY_TEXT

    reused = _gate(hazard, "mitigated", "stateful", quality_from=mitigated_gate.out_dir)
    assert reused.passed, reused.failure()
    record = reused.report["quality"]
    assert record.pop("reused_from")["path"] == "../gate-mitigated-chunk_kv"
    assert record == mitigated_gate.report["quality"]
    # The stateful package's own record, measured here: the same ops on the same inputs in one
    # process, so the same figures bit for bit.
    stateful = hazard / "mitigated" / "stateful"
    manifest = json.loads((stateful / "manifest.json").read_text())
    bundle = upstream_of(stateful, manifest)[2]
    intended, fp32 = intended_references(stateful, manifest, bundle)
    quality = QualityInputs(fp32, bundle, DEFAULT_QUALITY_TEXT, hazard / "items.jsonl", fp32.context)
    measured, _ = measure_quality(intended, quality, parse_budget(record["budget"]["spec"]))
    assert measured == {k: v for k, v in record.items() if k != "identity"}
    assert "by the gate at `../gate-mitigated-chunk_kv`" in (reused.out_dir / "alignment.md").read_text()
    with pytest.raises(GateFailed, match=r"'quality.identity.budget' is 'ppl=0.5%,top1=0.99', here it is "
                                         r"'ppl=0.4%,top1=0.99'"):
        _gate(hazard, "mitigated", "stateful", quality_from=mitigated_gate.out_dir, force=True,
              budget="ppl=0.4%,top1=0.99")
    # The naive package intends fp16 without mitigations: another numerics.
    with pytest.raises(GateFailed, match=r"'quality.identity.intended.mitigations.\w+' is"):
        align_package(hazard / "naive" / "chunk_kv", hazard / "reference", tmp_path / "naive",
                      items=hazard / "items.jsonl", quality_from=mitigated_gate.out_dir)
