"""Alignment gates on the default fixture's real packages, run by the MIL executor: the three
parts (exactness against the intended numerics, quality within the budget, invariants), a
runtime that mis-decodes a compressed weight, and the same gate over the MLX runtime."""

import gc
import json
import shutil
import sys
import tempfile

import numpy as np
import pytest

from _missteps import Misstep
from _survey_models import cloze_slice
from conftest import FIXTURE_CMF, FIXTURE_REFERENCE
from coreml.mil.ops import OPS, OpDef
from coreml.package import open_package
from coreml.recipes import compress_package
from coreml.kinds.chunk_kv import ChunkKVRunner
from coreml.runner import PackageBackend, open_package_backend
from pipeline.stages.artifacts import verify_artifact
from manifests.identity import load_manifest, read_json
from pipeline.stages.gates import (
    DEFAULT_QUALITY_TEXT,
    Budget,
    BudgetError,
    GateFailed,
    QualityInputs,
    ReferenceFixtures,
    align_package,
    gate_backend,
    intended_references,
    parse_budget,
    require_passed,
    upstream_of,
)
from pipeline.stages.gates.exactness import COMPRESSED_PATTERNS, NOISE_FACTOR, Tolerance, compare, exact_tolerances
from pipeline.stages.gates.invariants import branching_invariants
from pipeline.stages.gates.quality import measure_quality
from pipeline.cli import main
from pipeline.ground.torch_backend import TorchBackend
from pipeline.ground.models.numerics import model_cache_bound, model_logits_bound

PATTERNS = ("one_shot", "single_tokens", "split_3", "half_half")


@pytest.fixture(scope="module")
def items(tmp_path_factory):
    return cloze_slice(tmp_path_factory.mktemp("items") / "items.jsonl")


@pytest.fixture(scope="module")
def gates(fixture_packages, items, tmp_path_factory):
    out = tmp_path_factory.mktemp("align")
    reports = {kind: align_package(fixture_packages / kind, FIXTURE_REFERENCE, out / kind, items=items).report
               for kind in ("stateless", "chunk_kv")}
    return out, reports


def _references(package):
    """(intended, FP32) references of a package, on its bundle."""
    manifest = load_manifest(package)
    return intended_references(package, manifest, upstream_of(package, manifest)[2])


@pytest.fixture(scope="module")
def int8_stateless(fixture_packages, tmp_path_factory):
    return compress_package(fixture_packages / "stateless", "int8-b32",
                            tmp_path_factory.mktemp("int8") / "stateless-int8").path


def test_report_shows_each_steps_cost(gates):
    """Loading (lineage, the references) and each part, in order, in the report and on its page
    (quality first: it decides whether the others can change the verdict; the package is opened
    after it, for parts 1 and 3); the chunk patterns only where the backend runs chunks."""
    out, reports = gates
    loading = ["lineage", "references", "quality", "open_package", "rounding_noise"]
    assert list(reports["stateless"]["seconds"]) == loading + ["one_shot", "branching"]
    assert list(reports["chunk_kv"]["seconds"]) == loading + ["chunk_patterns", "one_shot", "branching"]
    page = (out / "chunk_kv" / "alignment.md").read_text()
    cost = page[page.index("## Cost"):]
    assert all(step.replace("_", " ") in cost for step in reports["chunk_kv"]["seconds"])
    assert all(seconds >= 0 for report in reports.values() for seconds in report["seconds"].values())


@pytest.mark.parametrize("kind", ["stateless", "chunk_kv"])
def test_fp32_packages_pass_all_three_parts(gates, kind, fixture_exact):
    out, reports = gates
    report = reports[kind]
    assert report["passed"] and report["candidate_backend"] == "coreml-executor"
    assert report["summary"]["exact"] and report["summary"]["within_budget"] and report["summary"]["invariants_passed"]
    # The bound is NOISE_FACTOR x the reference's own rounding noise, under the a-priori ceiling.
    tolerance = report["tolerance"]
    assert tolerance["ceiling"] == fixture_exact.atol and tolerance["atol"] == NOISE_FACTOR * tolerance["noise"]
    assert 0 < tolerance["atol"] < fixture_exact.atol and report["numerics"] == "fp32"
    assert report["summary"]["max_abs"] <= tolerance["atol"] and report["summary"]["outside"] == 0
    # FP32 intends FP32: the quality part is FP32 against itself.
    quality = report["quality"]
    assert quality["ppl_change"] == 0.0 and quality["top1_agreement"] == 1.0 and quality["items_top1_changed"] == 0.0
    assert quality["budget"]["spec"] == "ppl=2%,top1=0.95" and quality["tokens"] > 1000
    cases = {r["case"] for r in report["records"]}
    assert cases >= {"short", "long", "right_pad", "changed_future"}
    names = {i["name"] for i in report["invariants"]}
    assert {"right_pad_prefix_equals_short", "changed_future_prefix_equals_short", "branch_A_B_A_bitwise"} <= names
    on_disk = read_json(out / kind / "alignment.json")
    assert on_disk["records"] == json.loads(json.dumps(report["records"]))
    page = (out / kind / "alignment.md").read_text()
    assert page.startswith("# Alignment gate: PASSED")
    for part in ("## 1. Exactness", "## 2. Quality against FP32", "## 3. Invariants"):
        assert part in page
    assert (out / kind / "alignment.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert verify_artifact(out / kind)["passed"] is True
    require_passed(out / kind)


def test_chunk_kv_gate_covers_schedules_caches_and_branching(gates):
    report = gates[1]["chunk_kv"]
    chunked = {(r["case"], r["pattern"]): r for r in report["records"] if r["check"] == "chunk_kv"}
    assert set(chunked) == {(c, p) for c in ("short", "long", "right_pad", "changed_future") for p in PATTERNS}
    assert all(r["cache_outside"] == 0 for r in chunked.values())
    frozen = {r["case"] for r in report["records"] if r["check"] == "one_shot"}
    assert frozen == {"short", "long", "right_pad", "changed_future"}  # FP32: the frozen fixtures too
    invariants = {i["name"]: i for i in report["invariants"]}
    for name in ("branch_A_B_A_bitwise", "snapshot_unchanged", "dirty_tail_bitwise", "long_single_tokens_equals_one_shot"):
        assert invariants[name]["passed"], name


def test_the_gate_compares_against_the_fixtures_not_itself(fixture_packages, fixture_exact):
    """Independent recomputation: the executor's one-shot logits vs the frozen npz."""
    fixtures = ReferenceFixtures(FIXTURE_REFERENCE)
    package = open_package(fixture_packages / "stateless")
    case = fixtures.cases["long"]
    got = package.predict({"input_ids": case.input_ids.astype(np.int32)[None]})["logits"][0]
    assert np.abs(got - case.logits).max() <= fixture_exact.atol


def test_a_runtime_that_misdecodes_a_weight_is_not_exact_though_quality_cannot_tell(int8_stateless, items):
    """One compressed weight's scales applied one block to the right, as a runtime with that bug
    would: the quality part, which measures the numerics the package intends, is untouched, and
    even the broken runtime's own figures stay within the budget; only exactness sees it."""
    real, calls = OPS["constexpr_blockwise_shift_scale"], []

    def scales_on_the_wrong_block(data, scale, offset=None):
        calls.append(data.shape)
        return real.fn(data=data, scale=np.roll(scale, 1, axis=-1) if len(calls) == 3 else scale, offset=offset)

    OPS["constexpr_blockwise_shift_scale"] = OpDef(scales_on_the_wrong_block, real.lists)
    try:
        broken = open_package_backend(int8_stateless)  # constexpr ops are decoded once, at load
    finally:
        OPS["constexpr_blockwise_shift_scale"] = real
    assert len(calls) > 3
    manifest = load_manifest(int8_stateless)
    bundle = upstream_of(int8_stateless, manifest)[2]
    intended, fp32 = intended_references(int8_stateless, manifest, bundle)
    quality = QualityInputs(fp32, bundle, DEFAULT_QUALITY_TEXT, items, fp32.context)
    fixtures, budget = ReferenceFixtures(FIXTURE_REFERENCE), parse_budget("ppl=2%,top1=0.95")
    good = gate_backend(open_package_backend(int8_stateless), intended, fixtures, quality, budget, frozen=False,
                        patterns=COMPRESSED_PATTERNS)
    bad = gate_backend(broken, intended, fixtures, quality, budget, frozen=False, patterns=COMPRESSED_PATTERNS)
    bound = exact_tolerances(intended.model, intended.context)[0].atol
    assert good["passed"] and good["summary"]["max_abs"] <= bound
    assert not bad["summary"]["exact"] and bad["summary"]["max_abs"] > 10 * bound
    assert bad["quality"] == good["quality"] and bad["summary"]["within_budget"]
    own, _ = measure_quality(broken, quality, budget)  # the quality part run on the broken runtime itself
    assert own["within_budget"], own


def test_over_budget_is_a_result_and_exactness_stands_apart(int8_stateless, items, tmp_path, capsys, monkeypatch):
    from coreml import runner

    opened = []
    open_backend = runner.open_package_backend
    monkeypatch.setattr(runner, "open_package_backend", lambda *a, **k: opened.append(a) or open_backend(*a, **k))
    # Agreement cannot exceed 1: this budget refuses any package that is not FP32 itself.
    status = main(["align", str(int8_stateless), "--fixtures", str(FIXTURE_REFERENCE), "-o", str(tmp_path / "gate"),
                   "--items", str(items), "--budget", "ppl=2%,top1=1.0,items=0"])
    assert status == 1
    err = capsys.readouterr().err
    report = read_json(tmp_path / "gate" / "alignment.json")
    assert not report["summary"]["within_budget"] and not report["passed"]
    assert report["quality"]["over_budget"] == ["top1_agreement"] and "over the budget" in err
    assert report["recipe"] == "int8-b32"
    assert report["quality"]["ppl_change"] != 0.0  # the decoded weights really are the lossy ones
    page = (tmp_path / "gate" / "alignment.md").read_text()
    assert "OVER BUDGET" in page
    # Over budget on the held-out text: neither the items nor parts 1 and 3 can change the
    # verdict, so none of them was measured, and the report says so rather than "passed"...
    assert report["quality"]["items_top1_changed"] is None and "top1_agreement" in report["quality"]["items_not_measured"]
    assert "not measured: over budget on top1_agreement" in page
    assert report["summary"]["exact"] is None and report["summary"]["invariants_passed"] is None
    assert report["records"] == [] and report["invariants"] == [] and "top1_agreement" in report["exactness"]["not_measured"]
    assert "not run" in page and "Parts 1 and 3 not measured" in page
    assert "not exact" not in err and "invariants failed" not in err
    # ...nor was the package opened (a compressed package's weights are decoded as it opens)...
    assert opened == [] and report["candidate_backend"] == "coreml-executor" and "open_package" not in report["seconds"]
    # ...unless asked for: then every part is measured, and the items budget (no top-1 may change) judged too.
    status = main(["align", str(int8_stateless), "--fixtures", str(FIXTURE_REFERENCE), "-o", str(tmp_path / "all"),
                   "--items", str(items), "--budget", "ppl=2%,top1=1.0,items=0", "--all-figures"])
    report = read_json(tmp_path / "all" / "alignment.json")
    full = report["quality"]
    assert status == 1 and "items_not_measured" not in full and full["items_top1_changed"] is not None
    assert full["over_budget"] == ["top1_agreement"] + (["items_top1_changed"] if full["items_top1_changed"] > 0 else [])
    assert report["summary"]["exact"] and report["summary"]["invariants_passed"] and not report["passed"]
    assert report["exactness"]["patterns"] == ["one_shot"] and "not_measured" not in report["exactness"]  # stateless
    assert len(opened) == 1 and "open_package" in report["seconds"]


def test_a_gate_over_budget_is_returned_as_a_failed_result_not_raised(int8_stateless, items, tmp_path):
    """The stage returns a failed gate as it returns a passed one, its report written; only the
    CLI turns the failure into an error line and exit status 1."""
    gate = align_package(int8_stateless, FIXTURE_REFERENCE, tmp_path / "gate", items=items, budget="ppl=2%,top1=1.0")
    assert gate.passed is False and gate.report["passed"] is False
    assert gate.report["summary"]["exact"] is None and not gate.report["summary"]["within_budget"]
    assert read_json(tmp_path / "gate" / "alignment.json")["records"] == json.loads(json.dumps(gate.report["records"]))
    assert gate.failure().startswith(f"{int8_stateless}: gate failed: over the budget ppl=2%,top1=1 ")
    assert gate.scores is None  # over budget on the text: the scoring set was not measured


def test_failed_exactness_writes_its_report_and_exits_nonzero(fixture_packages, items, tmp_path, capsys):
    fixtures = tmp_path / "fixtures"
    shutil.copytree(FIXTURE_REFERENCE, fixtures)
    with np.load(fixtures / "logits.npz", allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    arrays["long.logits"][40, 7] += 0.01  # far outside 3e-4: the package is right, the "reference" is not
    np.savez(fixtures / "logits.npz", **arrays)

    status = main(["align", str(fixture_packages / "stateless"), "--fixtures", str(fixtures), "-o", str(tmp_path / "gate"),
                   "--items", str(items)])
    assert status == 1
    assert "not exact" in capsys.readouterr().err
    report = read_json(tmp_path / "gate" / "alignment.json")
    assert report["passed"] is False and report["summary"]["within_budget"]
    failing = [r for r in report["records"] if not r["passed"]]
    assert [(r["case"], r["outside"]) for r in failing] == [("long", 1)]
    page = (tmp_path / "gate" / "alignment.md").read_text()
    assert page.startswith("# Alignment gate: FAILED") and "NOT EXACT" in page
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
    prefix = ReferenceFixtures(FIXTURE_REFERENCE).cases["long"].input_ids[:7]
    good = PackageBackend(open_package(fixture_packages / "chunk_kv"))
    bad = PackageBackend(open_package(fixture_packages / "chunk_kv"))
    bad.kv = bad.chunks = _LeakyTail(bad.package)
    good, bad = ({i["name"]: i["passed"] for i in branching_invariants(b, prefix)} for b in (good, bad))
    assert all(good.values()) and set(good) == {"branch_A_B_A_bitwise", "snapshot_unchanged", "dirty_tail_bitwise"}
    assert bad["dirty_tail_bitwise"] is False and bad["branch_A_B_A_bitwise"] is True


def test_an_mlx_artifact_is_gated_by_the_same_code(items):
    """The MLX runtime on the fixture CMF through gate_backend: exact against the FP32 reference
    (the frozen fixtures), FP32 quality, A/B/A branching; it exposes no cache snapshots, so the
    chunk patterns and snapshot checks are reported as not offered, not passed."""
    from mlx_runtime.backend import MlxBackend
    from pipeline.ground.reference import load_reference

    model, args, _ = load_reference(FIXTURE_CMF)
    fp32 = TorchBackend(model, args, args.max_position_embeddings)
    quality = QualityInputs(fp32, FIXTURE_CMF, DEFAULT_QUALITY_TEXT, items, fp32.context)
    candidate = MlxBackend(FIXTURE_CMF)
    report = gate_backend(candidate, fp32, ReferenceFixtures(FIXTURE_REFERENCE), quality, Budget(), frozen=True)
    assert report["candidate_backend"] == "mlx" and report["summary"]["exact"], report["summary"]
    assert report["summary"]["max_abs"] <= exact_tolerances(model, fp32.context)[0].atol and report["exactness"]["patterns"] == ["one_shot"]
    invariants = {i["name"]: i for i in report["invariants"]}
    assert invariants["branch_A_B_A_bitwise"]["passed"] and invariants["right_pad_prefix_equals_short"]["passed"]
    assert invariants["dirty_tail_bitwise"]["passed"] is None and "not_offered" in invariants["dirty_tail_bitwise"]
    assert report["quality"]["ppl_change"] == 0.0 and report["passed"]


def test_fp32_logits_are_held_in_a_file_nothing_names(items, tmp_path, monkeypatch):
    """The quality part's FP32 logits (1 GB a window on a 262k vocabulary) lie in an unlinked
    scratch file: a gate that is killed leaves nothing in the temp folder."""
    from pipeline.ground.reference import load_reference

    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    model, args, _ = load_reference(FIXTURE_CMF)
    fp32 = TorchBackend(model, args, args.max_position_embeddings)
    quality = QualityInputs(fp32, FIXTURE_CMF, DEFAULT_QUALITY_TEXT, items, fp32.context)
    for tokens, logits in zip(quality.windows, quality.fp32_logits):
        np.testing.assert_array_equal(logits, fp32.logits(tokens))
    assert list(temp.iterdir()) == []


@pytest.mark.parametrize("text, budget", [
    ("ppl=2%,top1=0.95", Budget(0.02, 0.95)),
    ("ppl=0.05,top1=0.9,kl=0.01,items=5%", Budget(0.05, 0.9, 0.01, 0.05)),
    ("top1=0.99", Budget(0.02, 0.99)),
])
def test_budget_parses(text, budget):
    assert parse_budget(text) == budget
    assert parse_budget(budget.spec()) == budget


@pytest.mark.parametrize("text", ["ppl", "top=0.9", "ppl=two%"])
def test_bad_budget_is_named(text):
    with pytest.raises(BudgetError, match=f"--budget {text!r}"):
        parse_budget(text)


def test_compare_counts_nonfinite_outputs_as_outside():
    want = np.zeros((2, 5), np.float32)
    got = want.copy()
    got[1, 3] = np.nan
    record = compare(got, want, Tolerance(1.0, 0.0, None, None, "any"))
    assert record["outside"] == 1 and not record["passed"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cache_outside_counts_as_its_rule_over_every_entry(dtype):
    """The cache check runs its rule (bound plus one step of the cache dtype; every non-finite
    entry outside) only on the entries beyond `atol`: the count is the rule's over them all."""
    from pipeline.stages.gates.exactness import cache_outside

    rng = np.random.default_rng(1)
    want = (rng.standard_normal((3, 1, 2, 64, 8)) * 50).astype(dtype)
    got = (want.astype(np.float32) + rng.standard_normal(want.shape).astype(np.float32) * 0.02).astype(dtype)
    got.flat[[5, 77, 300]] = [np.nan, np.inf, -np.inf]
    want.flat[301] = np.inf
    tol = Tolerance(0.03, 1e-4, None, None, "any")
    got32, want32 = got.astype(np.float32), want.astype(np.float32)
    step = np.spacing(np.maximum(np.abs(got), np.abs(want))).astype(np.float32)
    with np.errstate(invalid="ignore"):
        rule = int(np.count_nonzero(np.abs(got32 - want32) > tol.atol + tol.rtol * np.abs(want32) + step)
                   + np.count_nonzero(~np.isfinite(got32)))
    with np.errstate(invalid="ignore"):
        assert cache_outside(got, want, tol) == rule >= 3
    assert cache_outside(want, want.copy(), tol) == int(np.count_nonzero(~np.isfinite(want)))


def test_quality_block_figures_are_torchs_within_float64_summation():
    """The quality part's figures of a block of rows (`_block_figures`: NLLs, KL, agreeing argmaxes;
    `kl_rows_of_logits`, which the gates' comparisons share) against torch's cross entropy and
    kl_div of the two log-softmaxes in float64. The NLLs are log_softmax's own values, negated:
    equal to the last bit. The KL rearranges the sums: each sum of V float64 terms errs by at most
    γ_V(2^-53) times the sum of its terms' magnitudes (Higham), bounded by B = max|x'| + max|y'| +
    log V + 1 (x', y': rows less their max; Σ p ≤ 1), four such sums a side: 8 γ_V B a row."""
    import torch
    import torch.nn.functional as F

    from pipeline.ground.backend_protocol import log_softmax
    from pipeline.ground.models.numerics import gamma
    from pipeline.stages.gates.quality import _block_figures

    rng = np.random.default_rng(5)
    rows, vocab = 12, 40_000
    fp32 = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    package = fp32 + (0.05 * rng.standard_normal(fp32.shape)).astype(np.float32)
    targets = rng.integers(0, vocab, rows)
    nll_fp32, nll_package, kl, agree = _block_figures(fp32, package, targets)
    at = np.arange(rows)
    assert nll_fp32 == -log_softmax(fp32)[at, targets].sum() and nll_package == -log_softmax(package)[at, targets].sum()
    log_p, log_q = (torch.log_softmax(torch.from_numpy(a).double(), -1) for a in (fp32, package))
    assert nll_fp32 == pytest.approx(float(F.nll_loss(log_p, torch.from_numpy(targets), reduction="sum")), rel=rows * 2.0**-52)
    want = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).numpy()
    spread = max(np.ptp(a, axis=-1).max() for a in (fp32, package))
    bound = rows * 8 * gamma(vocab, 2.0**-53) * (2 * spread + np.log(vocab) + 1)
    assert abs(kl - want.sum()) <= bound < want.sum() / 1e3
    assert agree == int(np.count_nonzero(fp32.argmax(-1) == package.argmax(-1)))
    assert _block_figures(fp32, None, targets) == (nll_fp32, nll_fp32, 0.0, rows)


def test_compare_in_row_blocks_gives_the_whole_arrays_figures(monkeypatch):
    """A 262k vocabulary's logits go through in blocks of rows; every figure is the one the
    whole arrays give (the blocks change no sum but |Δ|'s, taken whole)."""
    from pipeline.ground.backend_protocol import kl_rows, log_softmax
    from pipeline.ground.models.numerics import gamma
    from pipeline.stages.gates import exactness

    rng = np.random.default_rng(0)
    want = rng.standard_normal((37, 300)).astype(np.float32)
    got = want + rng.standard_normal(want.shape).astype(np.float32) * 1e-3
    tol = Tolerance(2e-3, 1e-4, None, None, "any")
    whole = compare(got, want, tol)
    monkeypatch.setattr(exactness, "COMPARE_BLOCK_BYTES", 5 * 300 * 4)  # 5 rows a block, 8 blocks
    blocked = compare(got, want, tol)
    # The mean is a float64 sum of 11100 float32 values, by blocks or whole: 11100 * 2^-53 apart at most.
    assert blocked.pop("mean_abs") == pytest.approx(whole.pop("mean_abs"), rel=11100 * 2.0**-53)
    assert blocked == whole
    delta = np.abs(got - want)
    # The percentile from the largest values kept: numpy interpolates between the same two order
    # statistics in their own float32 (two roundings of 2^-24 each), this in float64.
    assert whole["max_abs"] == float(delta.max())
    assert whole["p99_abs"] == pytest.approx(float(np.percentile(delta, 99)), rel=2 * 2.0**-24)
    for n in (1, 2, 3, 99, 100, 101, 1000):  # every count: the rank's neighbours are among the kept values
        values = rng.standard_normal(n)
        kept = np.sort(values)[-exactness._largest_needed(n, 99.0):]
        assert exactness._percentile_of_largest(kept, n, 99.0) == pytest.approx(np.percentile(values, 99), rel=4 * 2.0**-53)
    assert whole["outside"] == int(np.count_nonzero(delta > tol.atol + tol.rtol * np.abs(want)))
    # The KL's sums rearranged (kl_rows_of_logits): within 8 γ_V(2^-53) B a row of the log-softmaxes'
    # KL, B = max|x'| + max|y'| + log V + 1 (test_quality_block_figures_are_torchs_within_float64_summation).
    spread = max(np.ptp(a, axis=-1).max() for a in (want, got))
    kl_bound = 8 * gamma(want.shape[1], 2.0**-53) * (2 * spread + np.log(want.shape[1]) + 1)
    assert whole["kl_mean"] == pytest.approx(float(np.mean(kl_rows(log_softmax(want), log_softmax(got)))), abs=kl_bound)
    # A first block of exactly as many values as the percentile keeps (2 of 100): held unpartitioned.
    monkeypatch.setattr(exactness, "COMPARE_BLOCK_BYTES", 2 * 4)
    for seed in range(50):  # seed 20 took the first block's first value as the least of the two
        draws = np.random.default_rng(seed)
        column = draws.standard_normal((100, 1)).astype(np.float32)
        shifted = column + draws.standard_normal((100, 1)).astype(np.float32) * np.float32(1e-3)
        assert compare(shifted, column, tol)["p99_abs"] == pytest.approx(
            float(np.percentile(np.abs(shifted - column), 99)), rel=2 * 2.0**-24)
    monkeypatch.setattr(exactness, "COMPARE_BLOCK_BYTES", 5 * 300 * 4)
    # |Δ| of three values only, exactly (quarters): ties at the least of the kept values in every block.
    grid = np.round(want * 4) / 4
    tied = grid + rng.integers(0, 3, want.shape).astype(np.float32) / 2
    assert set(np.unique(np.abs(tied - grid))) == {0.0, 0.5, 1.0}
    assert compare(tied, grid, tol)["p99_abs"] == float(np.percentile(np.abs(tied - grid), 99))


def test_reference_fixtures_command_reproduces_the_frozen_fixtures(tmp_path):
    from fixtures.corpus import corpus_lines, split_lines
    from pipeline.ground.reference import load_reference

    text = tmp_path / "held_out.txt"
    text.write_text("\n".join(split_lines(corpus_lines())[1]), encoding="utf-8")
    assert main(["reference-fixtures", str(FIXTURE_CMF), "-o", str(tmp_path / "ref"), "--text", str(text), "--step-logits"]) == 0
    made, frozen = ReferenceFixtures(tmp_path / "ref"), ReferenceFixtures(FIXTURE_REFERENCE)
    assert made.checkpoint_sha256 == frozen.checkpoint_sha256
    # Frozen logits came from another CPU's float32 kernels: equal within two evaluations'
    # worst-case float32 error (pipeline/ground/models/numerics.py), not bitwise. Ids are integers: exact.
    bound = model_logits_bound(load_reference(FIXTURE_CMF)[0], len(frozen.cases["long"].input_ids))
    for name, case in frozen.cases.items():
        np.testing.assert_array_equal(made.cases[name].input_ids, case.input_ids)
        assert np.abs(made.cases[name].logits - case.logits).max() <= bound
    with np.load(tmp_path / "ref" / "logits.npz") as a, np.load(FIXTURE_REFERENCE / "logits.npz") as b:
        assert np.abs(a["long_kv_step_logits"] - b["long_kv_step_logits"]).max() <= bound


def test_reference_fixtures_leave_out_step_logits_unless_asked(tmp_path):
    """No gate reads long_kv_step_logits, and on a 262k vocabulary they are a forward per position:
    another model's fixtures hold the cases alone, and their index says nothing of the steps."""
    from fixtures.corpus import corpus_lines, split_lines

    text = tmp_path / "held_out.txt"
    text.write_text("\n".join(split_lines(corpus_lines())[1]), encoding="utf-8")
    assert main(["reference-fixtures", str(FIXTURE_CMF), "-o", str(tmp_path / "ref"), "--text", str(text)]) == 0
    with np.load(tmp_path / "ref" / "logits.npz") as npz:
        assert "long_kv_step_logits" not in npz.files and "long.logits" in npz.files
    index = json.loads((tmp_path / "ref" / "index.json").read_text())
    assert "long_kv_step_logits" not in index and "long_kv_step" not in index["computed_with"]


def _batches_of(share, monkeypatch, module, owner, method: str) -> list[int]:
    """Set the batches' share of memory in the backend's `module` and record the size of each
    batch `owner.method` runs."""
    if share is not None:
        monkeypatch.setattr(module, "BATCH_CACHE_SHARE", share)
    sizes, run = [], getattr(owner, method)

    def recorded(self, *args, **kwargs):
        batch = args[0] if args else kwargs["branches"]
        sizes.append(len(batch))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, recorded)
    return sizes


# The default share (the fixture's caches are small beside its weights: one batch each), and one
# so small that every branch is a batch of its own.
SHARES = [None, 1e-12]


@pytest.mark.parametrize("share", SHARES)
def test_the_intended_reference_batches_as_it_runs_one_at_a_time(fixture_packages, monkeypatch, share):
    """The gates score items through the intended reference's `prefill_batch` / `extend_batch`: each branch
    from its own snapshot must match `prefill` / `extend` of that branch alone, however the
    branches are grouped into batches (`branch_groups`). Two float32 evaluations of one model in
    another batching: within the worst-case bound of two such evaluations
    (pipeline/ground/models/numerics.py), which holds on any machine; caches likewise."""
    from pipeline.ground import torch_backend
    from pipeline.ground.torch_backend import TorchBackend

    sizes = _batches_of(share, monkeypatch, torch_backend, TorchBackend, "_stacked_branches")
    package = fixture_packages / "chunk_kv"
    intended, _ = _references(package)
    bound = model_logits_bound(intended.model, intended.context)
    cache_bound = model_cache_bound(intended.model, intended.context)
    prefixes = [np.arange(1, 20), np.arange(5, 12), np.array([3])]
    batched = intended.prefill_batch(prefixes)
    singles = [intended.prefill(prefix) for prefix in prefixes]
    for (logits, snapshot), (want, want_snapshot) in zip(batched, singles):
        position = snapshot.position
        assert position == want_snapshot.position and logits.shape == want[-1:].shape  # the last token's row alone
        assert np.abs(logits - want[-1:]).max() <= bound
        for got, ref in ((snapshot.keys, want_snapshot.keys), (snapshot.values, want_snapshot.values)):
            assert np.abs(got.numpy()[..., :position, :] - ref.numpy()[..., :position, :]).max() <= cache_bound
    branches = [(snapshot, np.array([7, 8, 9])) for _, snapshot in batched] + [(batched[0][1], np.array([4]))]
    for got, (snapshot, ids) in zip(intended.extend_batch(branches), branches):
        assert np.abs(got - intended.extend(snapshot, ids)).max() <= bound
    _assert_batches_within_their_share(sizes, 7, 8 * batched[0][1].keys.numel(), intended.weight_bytes,
                                       torch_backend.BATCH_CACHE_SHARE, share)


@pytest.mark.parametrize("share", SHARES)
def test_a_chunk_kv_package_batches_as_it_runs_one_at_a_time(fixture_packages, monkeypatch, share):
    """Scoring runs a chunk-KV package's branches as batch predictions (the executor applies
    each constant-weight `linear` to all their rows at once), grouped as `branch_groups` says:
    every branch must match its own prediction. The same float32 program in another summation
    order of the products: within the worst-case bound of two float32 evaluations
    (pipeline/ground/models/numerics.py); caches likewise."""
    from coreml import runner
    from coreml.kinds.chunk_kv import ChunkKVRunner
    from coreml.runner import open_package_backend

    sizes = _batches_of(share, monkeypatch, runner, ChunkKVRunner, "run_batch")
    package = fixture_packages / "chunk_kv"
    backend = open_package_backend(package)
    intended, _ = _references(package)
    bound = model_logits_bound(intended.model, intended.context)
    cache_bound = model_cache_bound(intended.model, intended.context)
    prefixes = [np.arange(1, 20), np.arange(5, 12), np.array([3])]
    batched = backend.prefill_batch(prefixes)
    for (logits, snapshot), prefix in zip(batched, prefixes):
        want, want_snapshot = backend.prefill(prefix)
        assert snapshot.position == want_snapshot.position == len(prefix)
        assert logits.shape == want[-1:].shape and np.abs(logits - want[-1:]).max() <= bound
        for got, ref in ((snapshot.key_cache, want_snapshot.key_cache), (snapshot.value_cache, want_snapshot.value_cache)):
            assert np.abs(got - ref).max() <= cache_bound
    branches = [(snapshot, np.array([7, 8, 9])) for _, snapshot in batched] + [(batched[0][1], np.array([4]))]
    for got, (snapshot, ids) in zip(backend.extend_batch(branches), branches):
        want = backend.extend(snapshot, ids)
        assert got.shape == want.shape and np.abs(got - want).max() <= bound
    cache_bytes = 4 * (batched[0][1].key_cache.size + batched[0][1].value_cache.size)
    _assert_batches_within_their_share(sizes, 7, cache_bytes, backend.weight_bytes, runner.BATCH_CACHE_SHARE, share)


def _assert_batches_within_their_share(sizes: list[int], branches: int, cache_bytes: int, weight_bytes: int,
                                       default: float, share) -> None:
    """3 prefixes, then 4 branches: every batch's float32 caches within the share of the weights
    (or a single branch), and as many branches a batch as that allows."""
    allowed = max(1, int((default if share is None else share) * weight_bytes) // cache_bytes)
    assert sum(sizes) == branches
    assert all(size <= allowed for size in sizes) and all(size == min(allowed, 3) for size in sizes[:1])
    assert share is None or sizes == [1] * branches


def test_decode_steps_let_each_steps_written_caches_go_before_the_next_runs(fixture_packages, monkeypatch):
    """`run_tokens` keeps only the head's rows of each decode step for the one product after the
    last: a step's written caches are the next step's input and then garbage. At each step's
    start, every cache but the one it reads (its snapshot's) is checked dead through a weak
    reference (64 steps' caches were 0.75 GB of a SmolLM2 gate, 6.4 GB of a 1.7B model's)."""
    import weakref

    from coreml.kinds.chunk_kv import ChunkKVRunner
    from coreml.runner import PackageBackend, open_package

    chunks = PackageBackend(open_package(fixture_packages / "chunk_kv", backend="executor")).chunks
    earlier, live_at_start, decode = [], [], ChunkKVRunner._decode

    def recorded(self, snapshot, token):
        gc.collect()
        live_at_start.append(sum(ref() is not None and ref() is not snapshot.key_cache for ref in earlier))
        out, after = decode(self, snapshot, token)
        earlier.append(weakref.ref(after.key_cache))
        return out, after

    monkeypatch.setattr(ChunkKVRunner, "_decode", recorded)
    chunks.run_tokens(chunks.empty(), np.arange(3, 9))
    assert len(live_at_start) == 6 and live_at_start == [0] * 6


@pytest.mark.parametrize("backend_kind", ["reference", "package"])
def test_extend_batch_lets_each_batchs_written_caches_go_before_the_next_batch_runs(fixture_packages, monkeypatch,
                                                                                    backend_kind):
    """Scoring's candidates read only their logits: the caches a batch of them wrote must be
    gone when the next batch runs (40 of the 1.7B model's chunk-KV branches held 4 GB while
    the last batches ran). One branch a batch; at each batch's start, every cache an earlier
    batch of the same call wrote is checked dead through a weak reference. A package is not
    asked for a candidate's caches at all (`ChunkKVRunner.run_batch(snapshots=False)`)."""
    import weakref

    from coreml import runner
    from coreml.kinds.chunk_kv import ChunkKVRunner
    from coreml.runner import open_package_backend
    from pipeline.ground import torch_backend
    from pipeline.ground.torch_backend import TorchBackend

    for module in (runner, torch_backend):
        monkeypatch.setattr(module, "BATCH_CACHE_SHARE", 1e-12)
    package = fixture_packages / "chunk_kv"
    if backend_kind == "reference":
        backend, owner, method = _references(package)[0], TorchBackend, "_stacked_branches"
        written = lambda done: [cache.keys for _, cache in done]  # noqa: E731
    else:
        backend, owner, method = open_package_backend(package), ChunkKVRunner, "run_batch"
        written = lambda done: [snapshot.key_cache for _, snapshot in done if snapshot is not None]  # noqa: E731
    batched = backend.prefill_batch([np.arange(1, 20), np.arange(5, 12)])
    branches = [(snapshot, np.array(ids)) for _, snapshot in batched for ids in ([7, 8, 9], [4], [2, 3])]
    earlier, live_at_start, run = [], [], getattr(owner, method)

    def recorded(self, *args, **kwargs):
        gc.collect()
        live_at_start.append(sum(ref() is not None for ref in earlier))
        done = run(self, *args, **kwargs)
        earlier.extend(weakref.ref(cache) for cache in written(done))
        return done

    monkeypatch.setattr(owner, method, recorded)
    logits = backend.extend_batch(branches)
    assert len(logits) == len(branches) == len(live_at_start) and live_at_start == [0] * len(branches)
    assert len(earlier) == (len(branches) if backend_kind == "reference" else 0)


def test_reference_runs_merge_short_chunks_over_a_float32_cache_and_single_tokens_over_any():
    from pipeline.stages.gates.exactness import REFERENCE_RUN_TOKENS, reference_runs

    schedule = [1] * (REFERENCE_RUN_TOKENS + 3) + [3, REFERENCE_RUN_TOKENS + 1, 2]
    runs = reference_runs(schedule, np.float32)
    assert [size for run in runs for size in run] == schedule
    assert runs == [[1] * REFERENCE_RUN_TOKENS, [1, 1, 1, 3], [REFERENCE_RUN_TOKENS + 1], [2]]
    # A cache that rounds what it keeps: runs of single tokens only, each checked row by row.
    assert reference_runs(schedule, np.float16) == [[1] * REFERENCE_RUN_TOKENS, [1, 1, 1], [3],
                                                    [REFERENCE_RUN_TOKENS + 1], [2]]
    assert reference_runs([2, 1, 1, 5, 1], np.float16) == [[2], [1, 1], [5], [1]]


@pytest.mark.parametrize("where", ["logits", "cache", "past"])
def test_a_single_token_step_gone_wrong_inside_a_reference_run_is_caught(fixture_packages, where):
    """The reference checks a float32 cache's single-token steps 64 at a time (`reference_runs`):
    a step in the middle of a run that returns wrong logits, or writes a wrong key slot (its own
    or an earlier one), is still outside the bound. The cache's error shows in the cache
    compared where the run ends, and in the logits of the steps after it, which read the slot."""
    from pipeline.stages.gates.exactness import run_checked

    package = fixture_packages / "chunk_kv"
    backend = open_package_backend(package)
    intended, _ = _references(package)
    tolerance, cache_tolerance = exact_tolerances(intended.model, intended.context)
    ids = ReferenceFixtures(FIXTURE_REFERENCE).cases["long"].input_ids[:80]
    clean = run_checked(backend.chunks, intended, ids, [1] * len(ids), cache_tolerance)
    assert clean["cache_outside"] == 0 and compare(clean["got"], clean["want"], tolerance)["passed"]
    broken = run_checked(Misstep(backend.chunks, 40, where), intended, ids, [1] * len(ids), cache_tolerance)
    outside = np.abs(broken["got"] - broken["want"]).max(-1) > tolerance.atol
    if where == "logits":
        assert broken["cache_outside"] == 0 and outside.nonzero()[0].tolist() == [40]
    else:
        assert broken["cache_outside"] > 0 and outside[41:64].all() and not outside[:41].any()


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the macos backend is available")
def test_a_backend_this_machine_lacks_is_refused_before_the_gate_runs(fixture_packages, items, tmp_path, capsys):
    """The package opens only after quality, where parts 1 and 3 run; the backend asked for is
    still refused at once, by name, with no report written."""
    status = main(["align", str(fixture_packages / "stateless"), "--fixtures", str(FIXTURE_REFERENCE),
                   "-o", str(tmp_path / "gate"), "--items", str(items), "--backend", "coreml-macos"])
    assert status != 0 and "backend 'macos' needs macOS" in capsys.readouterr().err
    assert not (tmp_path / "gate").exists()


def test_the_reference_writes_a_batchs_logits_into_the_rows_it_is_given(fixture_packages):
    """`advance_arrays(..., logits_out=)`: the head writes each branch's rows, in order, into the
    caller's array, and each branch's logits are views of it; the same products as without."""
    backend = open_package_backend(fixture_packages / "chunk_kv")
    intended, _ = _references(fixture_packages / "chunk_kv")
    _, snapshot = backend.chunks.run(backend.chunks.empty(), np.arange(1, 9))
    cache = backend.chunks.cache_arrays(snapshot)
    branches = [(cache, np.array([7, 8, 9])), (cache, np.array([4, 5, 6]))]
    out = np.full((6, intended.args.vocab_size), np.nan, np.float32)
    written = intended.advance_arrays(branches, logits_out=out)
    made = intended.advance_arrays(branches)
    assert all(np.shares_memory(logits, out) for logits, _ in written)
    np.testing.assert_array_equal(out, np.concatenate([logits for logits, _ in made]))
