"""The compression survey on the default fixture: every record complete and true to the files it
names, the deployed recipe the smallest passing one, unmet preconditions reported, and tampered or
ungated input refused before anything is built."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from _survey_models import (SCORING_ITEMS, SURVEY_BUDGET, SURVEY_RECIPES, WORKER_RECIPES, built_survey, failed_gate,
                            survey_in_workers)
from conftest import FIXTURE_REFERENCE

from pipeline.stages.survey import ForeignGate, SurveyError, load_survey, run_survey
from manifests.chain import upstream_path
from pipeline.stages.artifacts import verify_chain
from manifests.identity import read_json, sha256_file
from pipeline.stages.gates import DEFAULT_QUALITY_TEXT, GateFailed
from pipeline.stages.backends import open_backend
from pipeline.cli import main
from pipeline.ground.errors import IdentityError, OutputExists
from pipeline.ground.models.numerics import model_logits_bound
from pipeline.ground.reference import load_reference
from pipeline.stages.scoring import load_items, read_run, score_items
from pipeline.ground.tokenizer import tokenizer_from_artifact

MEASURED = ("int8-b32", "int4-b32", "palette4-gc32", "gptq-int4-b32-zp-hot")


@pytest.fixture(scope="module")
def survey(fixture_packages, tmp_path_factory):
    return built_survey(fixture_packages, tmp_path_factory.getbasetemp())


def _records(survey) -> dict:
    return {r["name"]: r for r in survey.record["recipes"]}


def _bytes_on_disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_every_recipe_has_a_complete_record_true_to_its_files(survey):
    assert load_survey(survey.path) == json.loads(json.dumps(survey.record))  # schema + every file's sha256
    records = _records(survey)
    assert tuple(records) == SURVEY_RECIPES
    fp32_bytes = _bytes_on_disk(survey.package / "model.mlpackage")
    assert survey.record["fp32"]["package"]["size_bytes"] == fp32_bytes
    for name in MEASURED:
        record = records[name]
        assert record["status"] == "measured"
        package = survey.path / record["package"]["path"]
        assert record["package"]["size_bytes"] == _bytes_on_disk(package / "model.mlpackage")
        assert record["package"]["bytes_vs_fp32"] == pytest.approx(record["package"]["size_bytes"] / fp32_bytes)
        assert record["package"]["manifest_sha256"] == sha256_file(package / "manifest.json")
        report_path = survey.path / record["gate"]["report"]["path"]
        assert record["gate"]["report"]["sha256"] == sha256_file(report_path)
        report = read_json(report_path)
        assert report["recipe"] == name and report["passed"] == record["gate"]["passed"]
        for key in ("max_abs", "outside", "exact", "within_budget", "invariants_passed"):
            assert record["gate"][key] == report["summary"].get(key), (name, key)  # absent: not measured
        for key, value in record["gate"]["quality"].items():
            assert value == report["quality"][key], (name, key)
        assert record["gate"]["passed"] == bool(record["gate"]["exact"] and record["gate"]["within_budget"]
                                                and record["gate"]["invariants_passed"])
        if record["gate"]["exact"] is None:  # over budget: parts 1 and 3 could not change the verdict
            assert not record["gate"]["within_budget"] and record["gate"]["invariants_passed"] is None
            assert record["gate"]["max_abs"] is None and report["records"] == []
            assert f"| {name} |" in (survey.path / "survey.md").read_text()
        else:
            assert record["gate"]["max_abs"] == max(r["max_abs"] for r in report["records"] if "max_abs" in r)
        if record["gate"]["quality"]["items_top1_changed"] is None:  # over budget on the text: items not scored
            assert record["gate"]["quality"]["over_budget"] and not record["gate"]["within_budget"]
            assert record["scoring"] == {"not_measured": report["quality"]["items_not_measured"]}
            assert not (survey.path / "scores" / name).exists()
            continue
        run = read_json(survey.path / record["scoring"]["run"] / "manifest.json")
        assert record["scoring"]["scores_sha256"] == run["scores_sha256"]
        assert run["scoring_set"]["n_items"] == SCORING_ITEMS


def test_compression_shrinks_the_package_by_its_bit_width(survey):
    size = {name: r["package"]["size_bytes"] for name, r in _records(survey).items() if name in MEASURED}
    fp32 = survey.record["fp32"]["package"]["size_bytes"]
    # 8-bit payloads are a quarter of float32, 4-bit ones an eighth, plus scales / palettes.
    assert 0.25 < size["int8-b32"] / fp32 < 0.4
    assert 0.125 < size["int4-b32"] / fp32 < size["int8-b32"] / fp32
    assert 0.125 < size["palette4-gc32"] / fp32 < size["int8-b32"] / fp32


def test_unmet_precondition_is_reported_not_skipped(survey):
    mixed = _records(survey)["mixed"]
    assert mixed["status"] == "precondition_unmet" and mixed["precondition"]["stage"] == "compress"
    assert "over the budget of" in mixed["precondition"]["reason"]
    text = (survey.path / "survey.md").read_text()
    assert "`mixed` (compress)" in text and not (survey.path / "packages" / "mixed").exists()


def test_deployed_recipe_is_the_smallest_that_passed_all_three_parts(survey):
    records = [r for r in survey.record["recipes"] if r["status"] == "measured"]
    passed = [r for r in records if r["gate"]["passed"]]
    deployed = survey.record["deployed"]["recipe"]
    if not passed:
        assert deployed is None
        return
    chosen = next(r for r in records if r["name"] == deployed)
    assert chosen["gate"]["passed"]
    assert all(chosen["package"]["size_bytes"] <= r["package"]["size_bytes"] for r in passed)
    smaller = [r for r in records if r["package"]["size_bytes"] < chosen["package"]["size_bytes"]]
    assert not any(r["gate"]["passed"] for r in smaller)
    assert f"| {deployed} |" in (survey.path / "survey.md").read_text()


def _record(name: str, size: int, passed: bool, units: list[str]) -> dict:
    return {"name": name, "status": "measured", "package": {"size_bytes": size},
            "gate": {"passed": passed, "compute_units": units}}


def test_the_neural_engine_target_falls_back_to_the_gpu_saying_why():
    from coreml.targets import target
    from pipeline.stages.survey import deployment_choice

    gpu_only, cpu_gpu = ["cpu", "gpu"], ["cpu", "gpu", "ane"]
    # One passing package claims the Neural Engine: it deploys there, the smaller GPU-only one not.
    records = [_record("int4-b32", 10, True, gpu_only), _record("palette6-gc32", 20, True, cpu_gpu),
               _record("palette4-gc32", 5, False, cpu_gpu)]
    assert deployment_choice(records, target("ane")) == {
        "recipe": "palette6-gc32", "rule": deployment_choice(records, target("ane"))["rule"], "deployed_for": "ane"}
    # None does: the smallest passing one deploys for the GPU, and the record says why.
    records[1]["gate"]["compute_units"] = gpu_only
    chosen = deployment_choice(records, target("ane"))
    assert chosen["recipe"] == "int4-b32" and chosen["deployed_for"] == "gpu"
    assert "can claim ane" in chosen["fallback"] and "int4-b32 (cpu, gpu)" in chosen["fallback"]
    # A target without a fallback, or nothing passing at all, deploys nothing.
    assert deployment_choice(records, target("cpu"))["recipe"] == "int4-b32"
    nothing = [_record("palette4-gc32", 5, False, gpu_only)]
    assert deployment_choice(nothing, target("ane")) == {**deployment_choice(nothing, target("ane")), "recipe": None,
                                                          "deployed_for": "ane"}
    assert "fallback" not in deployment_choice(nothing, target("ane"))


def test_every_recipe_is_exact_on_this_machine(survey, tmp_path):
    """Not exact would be a conversion or runtime bug, whatever the recipe's bit width. The
    survey measures exactness only within budget; a package it did not is gated here with
    --all-figures, which measures every part."""
    from pipeline.stages.gates import align_package

    unmeasured = 0
    for name in MEASURED:
        gate = _records(survey)[name]["gate"]
        if gate["exact"] is None:
            unmeasured += 1
            gate = align_package(survey.path / "packages" / name, FIXTURE_REFERENCE, tmp_path / name,
                                 items=survey.items, all_figures=True).report["summary"]
        assert gate["exact"] and gate["invariants_passed"], name
    assert 0 < unmeasured < len(MEASURED)  # both paths of the survey were taken


def test_perplexity_change_matches_an_independent_recount(survey):
    """pipeline.stages.evaluate's perplexity over the same held-out windows, FP32 bundle against the
    reference model loaded with coremltools' decoding of the package's weights."""
    from coreml.decoded import decoded_weights
    from pipeline.ground.torch_backend import TorchBackend
    from pipeline.stages.evaluate import perplexity
    from pipeline.ground.reference import load_reference
    from pipeline.ground.text_roles import text_roles
    import torch

    bundle = upstream_path(survey.package, read_json(survey.package / "manifest.json")["source"])
    tokenizer = tokenizer_from_artifact(bundle)
    text = DEFAULT_QUALITY_TEXT
    assert survey.record["quality"]["text"]["sha256"] == sha256_file(text)
    ids = tokenizer.encode(" ".join(text_roles(text.read_text(encoding="utf-8").splitlines())["quality"]))
    fp32 = perplexity(open_backend(bundle), ids, window=128, bos_id=tokenizer.bos_id)
    assert fp32.tokens == survey.record["quality"]["tokens"]
    for name in MEASURED:
        model, args, _ = load_reference(bundle)
        weights = decoded_weights(survey.path / "packages" / name)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=False)
        got = perplexity(TorchBackend(model, args, 128), ids, window=128, bos_id=tokenizer.bos_id)
        change = _records(survey)[name]["gate"]["quality"]["ppl_change"]
        assert change == pytest.approx(got.perplexity / fp32.perplexity - 1, abs=1e-6), name


def test_bits_per_weight_count_what_the_recipe_stores(survey):
    """int8-b32: 8 bits per value plus one fp32 scale per 32 (1 bit); every other weight stays fp32."""
    manifest = read_json(survey.path / "packages" / "int8-b32" / "manifest.json")
    parameters = sum(int(np.prod(shape)) for shape in _weight_shapes(survey.package))
    compressed = sum(int(np.prod(e["shape"])) for e in manifest["selection"]["weights"].values() if e["compressed"])
    expected = (9 * compressed + 32 * (parameters - compressed)) / parameters
    assert _records(survey)["int8-b32"]["package"]["bits_per_weight"] == pytest.approx(expected, rel=1e-9)
    assert survey.record["fp32"]["package"]["bits_per_weight"] == 32.0


def _weight_shapes(package: Path) -> list:
    """Shapes of the bundle weights the package carries (a tied head once)."""
    from safetensors.numpy import load_file

    bundle = upstream_path(package, read_json(package / "manifest.json")["source"])
    return [w.shape for w in load_file(bundle / "weights.safetensors").values()]


def test_scoring_effects_match_an_independent_recount(survey):
    baseline = read_run(survey.path / "scores" / "fp32")
    # The FP32 package ranks as the torch reference does (independent runtime, same bundle).
    bundle = upstream_path(survey.package, read_json(survey.package / "manifest.json")["source"])
    reference = score_items(open_backend(bundle), tokenizer_from_artifact(bundle), load_items(survey.items))
    # Each of a candidate's log-probs moves by at most 2 max|Δ logit| between two float32
    # evaluations of the model (pipeline/ground/models/numerics.py), so its score by n times that.
    bound = model_logits_bound(load_reference(bundle)[0], 128)
    assert all(np.all(np.abs(a.scores - b.scores) <= 2 * bound * np.array(b.n_tokens))
               for a, b in zip(baseline, reference))
    scored = [name for name in MEASURED if "run" in _records(survey)[name]["scoring"]]
    assert "int8-b32" in scored  # within budget on the fixture, so its gate scored the items
    for name in scored:
        scoring = _records(survey)[name]["scoring"]
        run = read_run(survey.path / scoring["run"])
        gold = np.array([r.gold for r in run])
        top1 = np.array([np.argmax(r.scores) for r in run])
        assert scoring["top1_accuracy"] == pytest.approx(np.mean(top1 == gold))
        changed = [r.id for r, b in zip(run, baseline) if np.argmax(r.scores) != np.argmax(b.scores)]
        assert scoring["top1_changed_ids"] == changed and scoring["top1_changed"] == len(changed)
        assert scoring["max_abs_delta_score"] == pytest.approx(
            max(np.abs(r.scores - b.scores).max() for r, b in zip(run, baseline)))
        assert scoring["max_abs_delta_score"] > 0  # the compressed weights move the scores


def test_compressed_manifests_bind_the_fp32_package_and_its_gate(survey):
    for name in MEASURED:
        manifest = read_json(survey.path / "packages" / name / "manifest.json")
        assert manifest["source"]["manifest_sha256"] == sha256_file(survey.package / "manifest.json")
        assert manifest["fp32_alignment"]["report_sha256"] == sha256_file(survey.fp32_gate / "alignment.json")
        assert manifest["fp32_alignment"]["manifest_sha256"] == sha256_file(survey.fp32_gate / "manifest.json")
        assert manifest["recipe"]["name"] == name


def test_survey_page_and_plot(survey):
    text = (survey.path / "survey.md").read_text()
    assert text.startswith("# Compression survey")
    for name in MEASURED:
        assert f"| {name} |" in text
    assert "![package size against perplexity change](size_vs_error.png)" in text
    assert f"budget: **{SURVEY_BUDGET}**" in text and "bits/weight" in text
    not_scored = [n for n in MEASURED if "not_measured" in _records(survey)[n]["scoring"]]
    assert not_scored and "not measured¹" in text and "`survey --all-figures`" in text  # int4, palette4 on the fixture
    assert (survey.path / "size_vs_error.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the chain: nested artifacts were written in the staging folder, now renamed away --------------


CHAIN_FROM_COMPRESSED = ["cmfdeploy.compressed/1", "cmfdeploy.coreml/1", "cmfdeploy.bundle/1", "cmf"]


def _chain(path: Path) -> list[tuple[str, str, str]]:
    return [(link.format, link.path, link.result) for link in verify_chain(path)]


def test_nested_gates_and_scores_chain_back_to_the_source_cmf(survey):
    bundle = str(upstream_path(survey.package, read_json(survey.package / "manifest.json")["source"]))
    cmf = read_json(Path(bundle) / "manifest.json")["source"]["path"]
    upstream = [str(survey.package.resolve()), bundle, cmf]
    for name in MEASURED:
        package = str((survey.path / "packages" / name).resolve())
        for nested, format_name in (("gates", "cmfdeploy.alignment/1"), ("scores", "cmfdeploy.scores/1")):
            if nested == "scores" and "run" not in _records(survey)[name]["scoring"]:
                continue  # over budget on the text: no scoring run (test_every_recipe_has_a_complete_record...)
            assert _chain(survey.path / nested / name) == list(zip(
                [format_name, *CHAIN_FROM_COMPRESSED], [str(survey.path / nested / name), package, *upstream],
                ["verified"] * 5))
    assert _chain(survey.path / "scores" / "fp32") == list(zip(
        ["cmfdeploy.scores/1", *CHAIN_FROM_COMPRESSED[1:]], [str(survey.path / "scores" / "fp32"), *upstream],
        ["verified"] * 4))


def test_verify_artifact_on_a_scoring_run(survey, tmp_path, capsys):
    run = survey.path / "scores" / "int8-b32"
    assert main(["verify-artifact", str(run)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("  checked: ")]
    assert lines[0] == f"cmfdeploy.scores/1 {run}: verified" and len(lines) == 5
    assert all(line.endswith(": verified") for line in lines)

    copy = shutil.copytree(run, tmp_path / "run")
    scores = (copy / "scores.jsonl").read_text()
    (copy / "scores.jsonl").write_text(scores.replace("-", "+", 1))  # same size, one score's sign flipped
    assert main(["verify-artifact", str(copy)]) == 1
    assert capsys.readouterr().err.startswith(f"IdentityError: {copy}: file 'scores.jsonl' has sha256")


def test_a_build_tree_copied_whole_verifies_within_itself(survey, tmp_path):
    """Bundle, FP32 packages and survey copied elsewhere: every link but the CMF (which stayed put)
    is found in the copy, by the relative paths the manifests record."""
    fixture_dir, survey_root = survey.package.parent.parent, survey.path.parent
    assert fixture_dir.parent == survey_root.parent  # both under pytest's basetemp
    for folder in (fixture_dir / "bundle", fixture_dir / "coreml", survey.path):
        shutil.copytree(folder, tmp_path / folder.relative_to(fixture_dir.parent))
    copy = tmp_path / survey_root.name / "survey"
    links = verify_chain(copy / "gates" / "int8-b32")
    assert [link.format for link in links] == ["cmfdeploy.alignment/1", *CHAIN_FROM_COMPRESSED]
    assert all(link.result == "verified" for link in links)
    assert all(Path(link.path).resolve().is_relative_to(tmp_path.resolve()) for link in links[:-1])

    package = tmp_path / fixture_dir.name / "coreml" / "chunk_kv" / "manifest.json"
    manifest = read_json(package)
    manifest["conversion"]["seconds"] += 1.0  # valid and complete, but not the package the survey compressed
    package.write_text(json.dumps(manifest))
    with pytest.raises(IdentityError, match=r"source\.manifest_sha256"):
        verify_chain(copy / "gates" / "int8-b32")


# --- refusals: all happen before anything is compressed -----------------------------------------


def _copy_package(survey, tmp_path) -> Path:
    copy = tmp_path / "chunk_kv"
    shutil.copytree(survey.package, copy)
    return copy


def _survey_into(survey, package, gate, out):
    return run_survey(package, gate, FIXTURE_REFERENCE, survey.items, out, recipes=("int8-b32",), progress=False)


def test_a_flipped_weight_byte_is_refused_naming_the_file(survey, tmp_path):
    package = _copy_package(survey, tmp_path)
    weights = next(package.rglob("weight.bin"))
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(IdentityError, match=r"weight\.bin.*sha256"):
        _survey_into(survey, package, survey.fp32_gate, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_edited_package_manifest_no_longer_matches_its_gate(survey, tmp_path):
    package = _copy_package(survey, tmp_path)
    manifest = read_json(package / "manifest.json")
    manifest["conversion"]["seconds"] += 1.0  # still valid and complete, but not the gated package
    (package / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ForeignGate, match=r"source\.manifest_sha256.*another package"):
        _survey_into(survey, package, survey.fp32_gate, tmp_path / "out")


def test_an_edited_gate_report_is_refused(survey, tmp_path):
    gate = tmp_path / "gate"
    shutil.copytree(survey.fp32_gate, gate)
    report = (gate / "alignment.json").read_text().replace('"passed": true', '"passed": false', 1)
    (gate / "alignment.json").write_text(report)
    with pytest.raises(IdentityError, match=r"file 'alignment\.json' has"):
        _survey_into(survey, survey.package, gate, tmp_path / "out")


def test_a_package_whose_fp32_gate_failed_is_not_surveyed(survey, tmp_path):
    gate = failed_gate(survey.path)
    with pytest.raises(GateFailed, match=f"{gate}.*did not pass"):
        _survey_into(survey, survey.package, gate, tmp_path / "out")


def test_existing_output_and_unknown_recipes_are_refused(survey, tmp_path, capsys):
    with pytest.raises(OutputExists):
        _survey_into(survey, survey.package, survey.fp32_gate, survey.path)
    code = main(["survey", str(survey.package), "--fp32-gate", str(survey.fp32_gate), "--fixtures",
                 str(FIXTURE_REFERENCE), "--items", str(survey.items), "-o", str(survey.path)])
    assert code == 1 and capsys.readouterr().err.startswith(f"OutputExists: {survey.path}")
    with pytest.raises(SurveyError, match="not among"):
        run_survey(survey.package, survey.fp32_gate, FIXTURE_REFERENCE, survey.items, tmp_path / "o", recipes=("int3",))


def test_a_survey_in_two_worker_processes_measures_what_one_process_does(survey):
    """jobs=2: recipes surveyed by worker processes (JSON orders and records) into one staging
    folder. The packages are the same bytes (their codes are elementwise functions of the
    weights), the records the same fields, and the perplexity change the same up to two float32
    evaluations of the fixture (the workers run 1 BLAS thread): log(1 + ppl change) is the mean
    NLL of the package less FP32's, and each mean NLL moves by at most 2 max|Δ logit|
    (target logit plus log-sum-exp), so the two runs' values differ by at most 4 bounds.
    FP32's item scores are read from the first survey's run (`fp32_scores`, as make passes the
    FP32 gate's), so its baseline is that run's to the byte."""
    names = WORKER_RECIPES
    path, parallel = survey_in_workers(survey.path, survey.package, survey.fp32_gate, survey.items)
    assert load_survey(path) == json.loads(json.dumps(parallel))
    assert (path / "scores" / "fp32" / "scores.jsonl").read_bytes() == (
        survey.path / "scores" / "fp32" / "scores.jsonl").read_bytes()
    bundle = upstream_path(survey.package, read_json(survey.package / "manifest.json")["source"])
    bound = model_logits_bound(load_reference(bundle)[0], 128)
    for name, record in zip(names, parallel["recipes"]):
        serial = _records(survey)[name]
        assert record["name"] == name and record.keys() == serial.keys()
        for blob in ("model.mlpackage/Data/com.apple.CoreML/weights/weight.bin",):
            assert sha256_file(path / "packages" / name / blob) == sha256_file(
                survey.path / "packages" / name / blob)
        got, want = record["gate"]["quality"], serial["gate"]["quality"]
        assert abs(np.log1p(got["ppl_change"]) - np.log1p(want["ppl_change"])) <= 4 * bound
        assert record["gate"]["exact"] is serial["gate"]["exact"] and record["gate"]["exact"] is not False
        assert record["scoring"].keys() == serial["scoring"].keys()


def test_the_workers_take_one_calibration_recipe_first_and_others_beside_it():
    """The calibration-aware recipes go first (the longest), but the Hessians they share are made
    by the first while the others wait for them (coreml.cache): the other workers start with
    recipes that need none. Every recipe is taken once; one worker takes them as before."""
    from coreml.recipes import RECIPES
    from pipeline.stages.survey import survey_order

    recipes = ("int8-b32", "gptq-int4-b32", "int4-b32", "mixed", "palette4-gc32", "gptq-int4-b64")
    assert survey_order(recipes, 2) == ["gptq-int4-b32", "int8-b32", "mixed", "gptq-int4-b64", "int4-b32",
                                        "palette4-gc32"]
    assert survey_order(recipes, 3) == ["gptq-int4-b32", "int8-b32", "int4-b32", "mixed", "gptq-int4-b64",
                                        "palette4-gc32"]
    assert survey_order(recipes, 1) == sorted(recipes, key=lambda name: not RECIPES[name].calibration)
