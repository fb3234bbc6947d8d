"""`cmfdeploy preflight`: the report, its verifier and chain, the refusal by name, and the
real models (slow)."""

import json
import subprocess
import sys

import numpy as np
import pytest

from _fp16_hazard import HAZARD_LAYER, make_hazard_bundle
from pipeline.ground.errors import IdentityError, OutputExists
from pipeline.ground.models.fp16 import FP16_MAX, Fp16Mitigations, Fp16Unsafe
from pipeline.stages.artifacts import verify_chain
from pipeline.stages.preflight import PAGE_NAME, PLOT_NAME, REPORT_NAME, run_preflight, verify_preflight

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def hazard_bundle(tmp_path_factory):
    return make_hazard_bundle(tmp_path_factory.mktemp("hazard"))


@pytest.fixture(scope="module")
def hazard_preflight(hazard_bundle):
    out = hazard_bundle.parent / "preflight"
    return run_preflight(hazard_bundle, out)


def test_the_preflight_finds_the_hazard_and_chooses_its_mitigations(hazard_preflight):
    manifest = hazard_preflight
    assert manifest["verdict"] == "safe"
    assert Fp16Mitigations.from_record(manifest["mitigations"]) == Fp16Mitigations(residual_scale=2.0**-3,
                                                                                   rmsnorm="max_scaled")
    report = json.loads((manifest.path / REPORT_NAME).read_text())
    assert report["status"] == "complete" and report["source"] == manifest["source"]
    assert set(report["windows"]) >= {"bos", "first_period", "first_newline", "longest"}
    assert report["windows"]["longest"] == manifest["context"] == 128
    fp32 = report["findings"]["fp32"]["layers"]
    assert fp32[HAZARD_LAYER]["residual"]["value"] > FP16_MAX
    first = report["findings"]["fp16"]["nonfinite"][0]
    assert (first["layer"], first["quantity"]) == (HAZARD_LAYER, "residual")
    mitigated = report["mitigated"]["fp16"]
    assert mitigated["nonfinite"] == []
    assert max(row["residual"]["value"] for row in mitigated["layers"]) <= FP16_MAX / 4
    page = (manifest.path / PAGE_NAME).read_text()
    assert "Verdict: **safe**" in page and f"| {HAZARD_LAYER} | " in page and f"]({PLOT_NAME})" in page
    assert (manifest.path / PLOT_NAME).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_verifies_down_its_chain_and_a_changed_byte_is_named(hazard_preflight, tmp_path):
    import shutil

    links = verify_chain(hazard_preflight.path)
    assert [link.format for link in links][:2] == ["cmfdeploy.preflight/1", "cmfdeploy.bundle/1"]
    copy = tmp_path / "preflight"
    shutil.copytree(hazard_preflight.path, copy)
    report = json.loads((copy / REPORT_NAME).read_text())
    report["verdict"] = "refused"
    (copy / REPORT_NAME).write_text(json.dumps(report))
    with pytest.raises(IdentityError, match="preflight.json"):
        verify_preflight(copy)


def test_an_existing_report_is_kept_without_force(hazard_bundle, hazard_preflight):
    with pytest.raises(OutputExists):
        run_preflight(hazard_bundle, hazard_preflight.path)


def test_an_unsafe_model_is_refused_by_name_and_its_report_still_written(tmp_path):
    bundle = make_hazard_bundle(tmp_path / "wide", intermediate_gain=400.0)
    out = tmp_path / "preflight"
    with pytest.raises(Fp16Unsafe, match=f"layer {HAZARD_LAYER}: mlp_intermediate peaks at"):
        run_preflight(bundle, out, context=64)
    manifest = verify_preflight(out)
    assert manifest["verdict"] == "refused" and manifest["mitigations"] is None
    report = json.loads((out / REPORT_NAME).read_text())
    assert report["refused"]["layer"] == HAZARD_LAYER and report["refused"]["quantity"] == "mlp_intermediate"
    assert "Verdict: **refused**" in (out / PAGE_NAME).read_text()
    # The CLI: one line naming the layer, exit status 1.
    again = subprocess.run([sys.executable, "-m", "pipeline.cli", "preflight", str(bundle), "-o", str(out),
                            "--context", "64", "--force"], capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 1
    assert again.stderr.strip().startswith("Fp16Unsafe: ") and f"layer {HAZARD_LAYER}: mlp_intermediate" in again.stderr


# -- real models: a few windows each


def _real_preflight(cmf, context: int):
    """Findings, mitigations and the mitigated model on the calibration windows (the stage's
    own choice), then ppl and top-1 of the mitigated fp16 reference against FP32 on the
    quality lines (`pipeline.ground.text_roles`) in windows of `context`."""
    import torch

    from pipeline.ground.models.fp16 import (
        check_mitigated,
        choose_mitigations,
        fp16_reference,
        mitigated_model,
        preflight_findings,
    )
    from pipeline.ground.reference import load_reference
    from pipeline.ground.text_roles import text_roles
    from pipeline.ground.tokenizer import tokenizer_from_artifact
    from pipeline.stages.evaluate import windows
    from pipeline.stages.preflight import preflight_windows

    model, args, _ = load_reference(cmf)
    tokenizer = tokenizer_from_artifact(cmf)
    lines = (ROOT / "fixtures" / "botchan.txt").read_text(encoding="utf-8").splitlines()
    measured = {k: v for k, v in preflight_windows(tokenizer, lines, context).items() if k != "calibration_3"}
    findings = preflight_findings(model, args, measured)
    mitigations = choose_mitigations(findings, where=cmf.name)
    safe = mitigated_model(model, args, mitigations)
    check_mitigated(preflight_findings(safe, args, measured), where=cmf.name)
    quality = tokenizer.encode(" ".join(text_roles(lines)["quality"]))
    half = fp16_reference(safe)
    nll = {"fp32": 0.0, "fp16": 0.0}
    agree = count = 0
    with torch.no_grad():
        for ids in windows(np.asarray(quality, np.int64), context, tokenizer.bos_id)[:4]:
            tokens = torch.as_tensor(ids)
            for name, m in (("fp32", model), ("fp16", half)):
                logp = torch.log_softmax(m(tokens).double(), -1)[:-1]
                nll[name] -= float(logp[torch.arange(len(ids) - 1), tokens[1:]].sum())
                if name == "fp32":
                    top = logp.argmax(-1)
                else:
                    agree += int((logp.argmax(-1) == top).sum())
            count += len(ids) - 1
    ppl_change = float(np.exp((nll["fp16"] - nll["fp32"]) / count) - 1)
    return findings, mitigations, ppl_change, agree / count


def _table(findings, mitigations, ppl_change, top1) -> str:
    rows = [f"{r['layer']:>3} {r['residual']['value']:>10.1f} {r['norm_square']['value']:>12.4g} "
            f"{r['attention_logits']['value']:>8.1f} {r['mlp_intermediate']['value']:>8.1f}"
            for r in findings["fp32"]["layers"]]
    first = findings["fp16"]["nonfinite"][:1]
    return "\n".join(["layer  residual  norm_square  q.k  mlp_int", *rows, f"naive fp16 first non-finite: {first}",
                      f"mitigations: {mitigations}", f"mitigated fp16: ppl change {ppl_change:+.4%}, top-1 {top1:.4f}"])


@pytest.mark.slow
def test_smollm2_preflight_mitigated_fp16_within_budget(smollm2_cmf):
    findings, mitigations, ppl_change, top1 = _real_preflight(smollm2_cmf, 128)
    print(_table(findings, mitigations, ppl_change, top1))
    assert ppl_change <= 0.005 and top1 >= 0.99


@pytest.mark.slow
def test_gemma3_preflight_finds_peaks_past_65504_and_the_mitigated_fp16_is_within_budget(gemma3_cmf):
    findings, mitigations, ppl_change, top1 = _real_preflight(gemma3_cmf, 128)
    print(_table(findings, mitigations, ppl_change, top1))
    assert max(r["residual"]["value"] for r in findings["fp32"]["layers"]) > FP16_MAX
    assert findings["fp16"]["nonfinite"]  # naive fp16 breaks
    assert mitigations.residual_scale < 1
    assert ppl_change <= 0.005 and top1 >= 0.99
