"""The stateful package's alignment gate: the default fixture's fp16-KV-state package held to
FP32's bound against the reference with fp16 K/V caches (each chunk from the package's own
cache), run by the MIL executor through coreml.kinds.stateful.StatefulRunner."""

import contextlib
import io
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest
from safetensors.numpy import load_file

from _missteps import PAST_SLOT, Misstep
from _survey_models import cloze_slice
from conftest import FIXTURE_REFERENCE
from coreml.kinds.cache_runner import PackageInterfaceError
from coreml.kinds.stateful import StatefulRunner
from coreml.package import open_package
from coreml.runner import PackageBackend
from pipeline.stages.artifacts import verify_artifact
from manifests.identity import MANIFEST_NAME, inventory, read_json, write_json
from pipeline.stages.gates import GateFailed, ReferenceFixtures, intended_references, require_passed, upstream_of
from pipeline.stages.gates.exactness import (NOISE_FACTOR, chunk_patterns, compare, exact_tolerances, reference_runs,
                                            run_checked)
from pipeline.stages.gates.invariants import BRANCH_A, BRANCH_B
from pipeline.cli import main

CASES = ("short", "long", "right_pad", "changed_future")

# A budget whose items limit every package meets: under it a gate scores the scoring set (the
# default budget sets no items limit, so no gate scores it; the fp16-cache test below).
ITEMS_BUDGET = "ppl=2%,top1=0.95,items=1"


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    return cloze_slice(tmp_path_factory.mktemp("items") / "items.jsonl")


@pytest.fixture(scope="module")
def gate(fixture_stateful, items, tmp_path_factory):
    """The gate run through the CLI: (report folder, alignment.json, printed line)."""
    out = tmp_path_factory.mktemp("align-stateful") / "gate"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["align", str(fixture_stateful), "--fixtures", str(FIXTURE_REFERENCE), "-o", str(out),
                       "--items", str(items), "--budget", ITEMS_BUDGET])
    assert status == 0
    return out, read_json(out / "alignment.json"), printed.getvalue()


@pytest.fixture(scope="module")
def runner(fixture_stateful):
    return StatefulRunner(open_package(fixture_stateful, backend="executor"))


def test_stateful_package_is_exact_against_the_fp16_cache_reference(gate, fixture_exact):
    out, report, printed = gate
    assert report["passed"] and report["candidate_backend"] == "coreml-executor"
    assert report["recipe"] == "fp32" and report["numerics"] == "fp32, fp16 K/V cache"
    assert "stateful, coreml-executor, fp32, fp16 K/V cache" in printed
    chunked = {(r["case"], r["pattern"]): r for r in report["records"] if r["check"] == "stateful"}
    assert set(chunked) == {(case, p) for case in CASES for p in chunk_patterns(16)}
    # The same bound as every FP32 package (its reference's rounding noise, under FP32's a-priori
    # ceiling): the reference rounds its K/V to fp16 as the package does, each chunk starting from
    # the package's own cache; the written caches agree too.
    tolerance = report["tolerance"]
    assert tolerance["ceiling"] == fixture_exact.atol and tolerance["atol"] == NOISE_FACTOR * tolerance["noise"]
    assert report["summary"]["max_abs"] <= tolerance["atol"] < fixture_exact.atol
    assert all(r["cache_outside"] == 0 for r in chunked.values())
    frozen = {r["case"]: r for r in report["records"] if r["check"] == "one_shot"}
    assert set(frozen) == set(CASES)  # one prefill attends over its own float32 K/V: the FP32 fixtures
    invariants = {i["name"]: i for i in report["invariants"]}
    assert all(i["passed"] for i in invariants.values())
    for case in CASES:
        for pattern in ("single_tokens", "split_3", "half_half"):
            assert f"{case}_{pattern}_equals_one_shot" in invariants
    for name in ("branch_A_B_A_bitwise", "snapshot_unchanged", "dirty_tail_bitwise"):
        assert invariants[name]["passed"], name
    # One-shot windows attend over their own float32 K/V; the scoring set's branches read fp16 K/V.
    assert report["quality"]["ppl_change"] == 0.0 and report["quality"]["within_budget"]
    assert (out / "alignment.md").read_text().startswith("# Alignment gate: PASSED")
    assert verify_artifact(out)["passed"] is True
    require_passed(out)


def _miscompiled_copy(package, bundle, out):
    """The package with its final norm weight off by 0.1%, re-inventoried: the identity chain
    holds, as it would for a converter that wrote wrong numbers; only the gate can tell. The
    bundle is copied along, where the package's relative source link expects it."""
    shutil.copytree(package, out)
    relative = read_json(package / MANIFEST_NAME)["source"]["relative_path"]
    shutil.copytree(bundle, os.path.normpath(out / relative))
    norm = load_file(bundle / "weights.safetensors")["model.norm.weight"].astype(np.float32)
    blob = next(out.rglob("weight.bin"))
    data = blob.read_bytes()
    assert data.count(norm.tobytes()) == 1
    blob.write_bytes(data.replace(norm.tobytes(), (norm * np.float32(1.001)).tobytes()))
    manifest = read_json(out / MANIFEST_NAME)
    manifest["files"] = inventory(out)
    write_json(out / MANIFEST_NAME, manifest)
    return out


def test_a_miscompiled_stateful_package_fails_and_keeps_its_report(fixture_stateful, fixture_bundle, items, tmp_path,
                                                                    capsys):
    package = _miscompiled_copy(fixture_stateful, fixture_bundle, tmp_path / "coreml" / "stateful")
    status = main(["align", str(package), "--fixtures", str(FIXTURE_REFERENCE), "-o", str(tmp_path / "gate"),
                   "--items", str(items)])
    assert status == 1
    err = capsys.readouterr().err
    assert err.startswith("GateFailed: ") and str(package) in err
    report = read_json(tmp_path / "gate" / "alignment.json")
    assert report["passed"] is False and not report["summary"]["exact"]
    failing = [r for r in report["records"] if not r["passed"]]
    # Logits scale by 1.001 (|logit| up to 12): far outside 3e-4 + 3e-4·|ref| on every case.
    assert {r["case"] for r in failing} == set(CASES)
    assert all(r["max_abs"] > report["tolerance"]["atol"] for r in failing)
    assert (tmp_path / "gate" / "alignment.md").read_text().startswith("# Alignment gate: FAILED")
    with pytest.raises(GateFailed, match="did not pass"):
        require_passed(tmp_path / "gate")


@pytest.mark.parametrize("kind", ["chunk_kv", "stateful"])
def test_decode_steps_leave_the_head_for_last_and_match_a_run_of_single_token_chunks(
        kind, fixture_packages, fixture_stateful):
    """`run_tokens`: a token a call, the head made once for all of them after the last. The
    caches are the same bits as `run_schedule`'s with chunks of 1, on any machine: every op that
    writes them runs on the same inputs of the same shapes either way. Each token's logits are
    its call's but for the head's product, one of 7 rows against one of a row: the same
    float32 dot products in another summation order, which the gate's bound covers (derived
    from γ over the model's whole chain of sums, the head's among them: `exact_tolerances`)."""
    package = fixture_stateful if kind == "stateful" else fixture_packages / kind
    chunks = PackageBackend(open_package(package, backend="executor")).chunks
    decoder = chunks._decoder()
    head = decoder.executor._steps[decoder.executor._row_tails["logits"][0]]
    rows_seen = []
    decoder.executor._steps[decoder.executor._row_tails["logits"][0]] = replace(
        head, fn=lambda **kw: rows_seen.append(kw["x"].shape[-2]) or head.fn(**kw))
    manifest = read_json(package / MANIFEST_NAME)
    intended, _ = intended_references(package, manifest, upstream_of(package, manifest)[2])
    tolerance, _ = exact_tolerances(intended.model, intended.context)
    ids = ReferenceFixtures(FIXTURE_REFERENCE).cases["long"].input_ids[:12]
    _, start = chunks.run_schedule(ids[:5], [5])
    stepped, stepped_end = chunks.run_schedule(ids[5:], [1] * 7, start)
    rows_seen.clear()
    decoded, end = chunks.run_tokens(start, ids[5:])
    assert rows_seen == [7]  # one product of the head, for every step's row
    assert end.position == stepped_end.position == 12
    np.testing.assert_array_equal(end.key_cache, stepped_end.key_cache)
    np.testing.assert_array_equal(end.value_cache, stepped_end.value_cache)
    assert decoded.shape == stepped.shape and compare(decoded, stepped, tolerance)["passed"]


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
    manifest = read_json(fixture_stateful / MANIFEST_NAME)
    intended, _ = intended_references(fixture_stateful, manifest, upstream_of(fixture_stateful, manifest)[2])
    tolerance, cache_tolerance = exact_tolerances(intended.model, intended.context)
    checked = run_checked(backend.chunks, intended, case.input_ids[:56], [8] * 7, cache_tolerance)
    np.testing.assert_array_equal(np.concatenate([prefix_logits, suffix_logits]), checked["got"])
    assert np.abs(checked["got"] - checked["want"]).max() <= tolerance.atol and checked["cache_outside"] == 0
    np.testing.assert_array_equal(backend.extend(snapshot, case.input_ids[40:56]), suffix_logits)


@pytest.mark.parametrize("where", [None, "logits", "cache", "past"])
def test_single_token_steps_over_the_fp16_cache_are_checked_row_by_row_in_one_forward(fixture_stateful, where,
                                                                                      monkeypatch):
    """The reference checks the fp16 cache's single-token steps 64 at a time, each row
    attending to the package's cache before it and its own K/V (`TorchBackend.single_steps`):
    the same figures as checking each step from its own cache, and a step in the middle of a
    run that returns wrong logits, or writes a wrong key slot (its own or an earlier one), is
    outside the bound. A wrong slot shows in the cache compared where the run ends; the steps
    after it read it from the package's cache on both sides."""
    manifest = read_json(fixture_stateful / MANIFEST_NAME)
    intended, _ = intended_references(fixture_stateful, manifest, upstream_of(fixture_stateful, manifest)[2])
    tolerance, cache_tolerance = exact_tolerances(intended.model, intended.context)
    chunks = PackageBackend(open_package(fixture_stateful, backend="executor")).chunks
    ids = ReferenceFixtures(FIXTURE_REFERENCE).cases["long"].input_ids[:80]
    assert reference_runs([1] * len(ids), intended.cache_dtype) == [[1] * 64, [1] * 16]
    checked = run_checked(chunks if where is None else Misstep(chunks, 40, where), intended, ids, [1] * len(ids),
                          cache_tolerance)
    outside = np.abs(checked["got"] - checked["want"]).max(-1) > tolerance.atol
    if where is None:
        # Step by step, each from its own cache (runs of one chunk), as before: both within the bound.
        monkeypatch.setattr("pipeline.stages.gates.exactness.REFERENCE_RUN_TOKENS", 1)
        alone = run_checked(chunks, intended, ids, [1] * len(ids), cache_tolerance)
        assert checked["cache_outside"] == alone["cache_outside"] == 0
        # The package's head makes a run's rows in one product (`run_tokens`), 64 rows against 1:
        # the same float32 dot products in another summation order, within the gate's bound
        # (derived from γ over the model's chain of sums, the head's among them).
        assert compare(checked["got"], alone["got"], tolerance)["passed"]
        assert compare(checked["got"], checked["want"], tolerance)["passed"]
        assert compare(alone["got"], alone["want"], tolerance)["passed"]
    elif where == "logits":
        assert checked["cache_outside"] == 0 and outside.nonzero()[0].tolist() == [40]
    elif where == "cache":
        assert checked["cache_outside"] > 0 and not outside.any()
    else:
        # The steps up to the misstep read the slot whole, the reference the run's end's: theirs differ too.
        assert checked["cache_outside"] > 0 and outside.nonzero()[0].tolist() == list(range(PAST_SLOT + 1, 41))


def test_the_stateful_gate_reads_fp32_scores_of_its_bundle_and_refuses_others(
        gate, fixture_packages, fixture_stateful, items, tmp_path, capsys):
    """An FP32 chunk_kv gate writes FP32's scores of the scoring set (--scores-out); the
    stateful gate of the same bundle reads them (--fp32-scores) instead of scoring them again,
    and judges its items as when it scores FP32 itself (the same reference, the same code).
    A run of another scoring set or of another numerics is refused, naming the field."""
    fp32_run, gated = tmp_path / "fp32-scores", tmp_path / "stateful-gate"
    common = ["--fixtures", str(FIXTURE_REFERENCE), "--items", str(items), "--budget", ITEMS_BUDGET]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["align", str(fixture_packages / "chunk_kv"), "-o", str(tmp_path / "chunk-gate"), *common,
                     "--scores-out", str(fp32_run)]) == 0
        assert main(["align", str(fixture_stateful), "-o", str(gated), *common, "--fp32-scores", str(fp32_run)]) == 0
    assert read_json(fp32_run / MANIFEST_NAME)["backend"] == "torch-fp32"
    # Scoring FP32 for the others is this gate's work, so its report shows what it cost.
    assert read_json(tmp_path / "chunk-gate" / "alignment.json")["seconds"]["fp32_scores"] > 0
    quality, scored_itself = read_json(gated / "alignment.json")["quality"], gate[1]["quality"]
    assert quality["items_top1_changed"] is not None
    assert quality["items_top1_changed"] == scored_itself["items_top1_changed"]
    assert quality["perplexity"] == scored_itself["perplexity"]

    other_items, fp16_run = tmp_path / "other.jsonl", tmp_path / "fp16-scores"
    other_items.write_text("\n".join(items.read_text().splitlines()[:3]) + "\n")
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["align", str(fixture_stateful), "-o", str(tmp_path / "g2"), *common,
                     "--scores-out", str(fp16_run)]) == 0
    for run, field in ((fp16_run, "backend"), (fp32_run, "scoring_set.sha256")):
        flags = common if run == fp16_run else ["--fixtures", str(FIXTURE_REFERENCE), "--items", str(other_items)]
        capsys.readouterr()
        assert main(["align", str(fixture_stateful), "-o", str(tmp_path / f"refused-{field}"), *flags,
                     "--fp32-scores", str(run)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("GateFailed: ") and f"field '{field}'" in err and "not the FP32 baseline" in err


def test_a_gate_reads_fp32_scores_scored_on_the_bundle_itself(gate, fixture_stateful, items, tmp_path):
    """make scores the bundle once (`cmfdeploy score BUNDLE`: an fp16 build has no FP32 gate to
    write FP32's scores, and an FP32 build's gates run side by side) and the gates and the
    survey read that run: it is the same FP32 reference, so the verdict is the one a gate that
    scores FP32 itself reaches."""
    from pipeline.stages.gates.lineage import resolve_lineage

    bundle, run = resolve_lineage(fixture_stateful).bundle, tmp_path / "bundle-scores"
    common = ["--fixtures", str(FIXTURE_REFERENCE), "--items", str(items), "--budget", ITEMS_BUDGET]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["score", str(bundle), str(items), "-o", str(run)]) == 0
        assert main(["align", str(fixture_stateful), "-o", str(tmp_path / "gated"), *common,
                     "--fp32-scores", str(run)]) == 0
    quality, scored_itself = read_json(tmp_path / "gated" / "alignment.json")["quality"], gate[1]["quality"]
    assert quality["items_top1_changed"] is not None
    assert quality["items_top1_changed"] == scored_itself["items_top1_changed"]


def test_the_fp16_cache_reference_reuses_fp32s_text_logits_and_scores_its_own_items(fixture_stateful, items,
                                                                                    monkeypatch):
    """The stateful kind's FP32 reference differs from FP32 only in the cache it keeps: a window
    run in one pass never reads a cache, so its text logits are FP32's by construction and are
    not computed again. Its items branch from fp16 snapshots, so they are scored where the
    budget limits them; the default budget sets no items limit, so there they decide nothing and
    are not scored, and the record says why."""
    from pipeline.ground.torch_backend import TorchBackend
    from pipeline.stages.gates import Budget, QualityInputs
    from pipeline.stages.gates.quality import measure_quality
    from pipeline.stages.gates.stage import DEFAULT_QUALITY_TEXT

    manifest = read_json(fixture_stateful / MANIFEST_NAME)
    bundle = upstream_of(fixture_stateful, manifest)[2]
    intended, fp32 = intended_references(fixture_stateful, manifest, bundle)
    assert intended is not fp32 and intended.model is fp32.model and intended.cache_dtype == np.float16
    quality = QualityInputs(fp32, bundle, DEFAULT_QUALITY_TEXT, items, fp32.context)
    fp32_logits = quality.fp32_logits
    ran = []
    logits = TorchBackend.logits
    monkeypatch.setattr(TorchBackend, "logits", lambda self, ids: ran.append(self) or logits(self, ids))
    record, scores = measure_quality(intended, quality, Budget(items=1.0))
    assert ran == [] and len(fp32_logits) == len(quality.windows)
    assert record["ppl_change"] == 0.0 and record["top1_agreement"] == 1.0 and record["measured_on"] == intended.name
    assert scores is not None and len(scores) == len(quality.items) and record["items_top1_changed"] is not None
    scored = []
    monkeypatch.setattr(TorchBackend, "prefill_batch", lambda self, prefixes: scored.append(self) or pytest.fail())
    unlimited, none = measure_quality(intended, quality, Budget())
    assert none is None and scored == [] and unlimited["items_top1_changed"] is None
    assert "no limit on the scoring set (items=)" in unlimited["items_not_measured"] and unlimited["within_budget"]
    assert {k: v for k, v in unlimited.items() if k not in ("items_top1_changed", "items_not_measured", "budget")} == {
        k: v for k, v in record.items() if k not in ("items_top1_changed", "budget")}
