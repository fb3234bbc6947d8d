"""Gemma 3 on the MLX runtime and as Core ML packages, against the reference decoder, across the window.

One small random Gemma3ForCausalLM (4 layers, three SlidingAttention of window 8 and one
FullAttention, context 128, the default fixture's 1024-token vocabulary so the gates can
tokenize their texts) imported with import-hf: on MLX from a CMF of each dtype the MLX tests
use, one shot, and chunked prefill + decode whose chunks cross the window's edge many times;
as the three package kinds on the MIL executor, one shot and over chunk schedules that cross
it; and the gates on the chunk-KV and stateful packages. Every comparison takes the derived
float32 bound (pipeline/ground/models/numerics.py).
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

from _hf_models import save_hf_model
from _one_thread import one_thread  # noqa: F401 (autouse fixture)
from _survey_models import cloze_slice
from conftest import FIXTURE_CMF
from coreml.convert import export_coreml
from coreml.kinds.chunk_kv import ChunkKVRunner
from coreml.runner import open_package_backend
from fixtures.corpus import corpus_lines, split_lines
from manifests.identity import load_manifest
from mlx_runtime.models import forward, load_model
from pipeline.ground.cmf import open_cmf
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models import args as model_args
from pipeline.ground.models.numerics import model_logits_bound
from pipeline.ground.reference import load_reference
from pipeline.stages.bundle import export_bundle
from pipeline.stages.gates import align_package, make_reference_fixtures
from pipeline.stages.gates.invariants import BRANCH_PREFIX, branch_prefix, branching_invariants
from pipeline.stages.importers.hf import import_hf
from pipeline.stages.importers.quant_policy import QuantPolicy

# A context of 128: the gates' scoring items run up to 79 tokens.
WINDOW, CONTEXT = 8, 128
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
# The dtypes tests/test_mlx_model.py runs the families in, and f32; MLX decodes each bitwise
# as the reference does (only q4tp/q2tp differ, by 2^-20), so the bound has no weight term.
MLX_DTYPES = ["f32", "q8_row", "q4_block", "vbit_ro"]
IDS = np.random.default_rng(7).integers(0, 1024, CONTEXT)
# Chunks crossing the window's edge inside a chunk, one-token decode across it, and a chunk
# ending at the last slot.
SCHEDULES = [(1, 4, 1, 1, 1, 1, 9, 1, 1, 20, CONTEXT - 40), (5, 1, 1, 1, 1, 1, 1, 1, CONTEXT - 12),
             (17, 3, CONTEXT - 20), (CONTEXT,)]


def _schedule_id(schedule) -> str:
    return ",".join(map(str, schedule))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """The transformers folder, with the default fixture's tokenizer beside the weights."""
    folder = tmp_path_factory.mktemp("gemma3") / "hf"
    save_hf_model("gemma3", folder, seed=5, vocab_size=1024, num_hidden_layers=4, sliding_window=WINDOW,
                  max_position_embeddings=CONTEXT, layer_types=LAYER_TYPES)
    with open_cmf(FIXTURE_CMF) as cmf:
        (folder / "tokenizer.json").write_bytes(cmf.vocab)
        (folder / "tokenizer_config.json").write_text(json.dumps(cmf.tokenizer_config))
    return folder


@pytest.fixture(scope="module")
def cmf_f32(hf_folder):
    path = hf_folder.parent / "gemma3-f32.cmf"
    import_hf(hf_folder, path, policy=QuantPolicy("f32"))
    return path


@torch.no_grad()
def _reference_logits(path, ids) -> np.ndarray:
    model, _, _ = load_reference(path)
    return model(torch.from_numpy(np.asarray(ids))).numpy()


# -- MLX


@pytest.fixture(scope="module", params=MLX_DTYPES)
def mlx_cmf(request, hf_folder, cmf_f32):
    if request.param == "f32":
        return cmf_f32
    path = hf_folder.parent / f"gemma3-{request.param}.cmf"
    import_hf(hf_folder, path, policy=QuantPolicy(request.param))
    return path


def test_mlx_runs_the_sliding_layers_as_the_reference(mlx_cmf):
    reference, args, _ = load_reference(mlx_cmf)
    assert args.layer_types.count("SlidingAttention") == 3 and args.sliding_window == WINDOW
    want = _reference_logits(mlx_cmf, IDS)
    bound = model_logits_bound(reference, CONTEXT)
    with open_cmf(mlx_cmf) as cmf:
        model = load_model(cmf)
    assert not model.report.fallbacks
    for gemm in (False, True):  # MLX's quantized kernels, then the dense-GEMM path
        assert np.abs(np.array(forward(model, IDS, model.new_cache(), gemm=gemm)) - want).max() <= bound
    for schedule in SCHEDULES:
        cache, got, start = model.new_cache(), [], 0
        for size in schedule:
            got.append(np.array(forward(model, IDS[start:start + size], cache, gemm=size > WINDOW)))
            start += size
        assert np.abs(np.concatenate(got) - want).max() <= bound, schedule


def test_mlx_without_the_window_is_caught(cmf_f32):
    """The bound is tight enough to see a window dropped: full causal attention on the
    sliding layers parts from the reference past the window."""
    reference, args, _ = load_reference(cmf_f32)
    with open_cmf(cmf_f32) as cmf:
        model = load_model(cmf)
    unwindowed = dataclasses.replace(model, args=dataclasses.replace(args, sliding_window=CONTEXT))
    got = np.array(forward(unwindowed, IDS, unwindowed.new_cache(), gemm=True))
    want = _reference_logits(cmf_f32, IDS)
    bound = model_logits_bound(reference, CONTEXT)
    assert np.abs(got[:WINDOW] - want[:WINDOW]).max() <= bound
    assert np.abs(got[WINDOW:] - want[WINDOW:]).max() > bound


def test_a_family_without_an_mlx_module_is_refused_by_name(cmf_f32, monkeypatch):
    monkeypatch.setitem(model_args.FAMILY_OF_ARCH, "gemma3", "unported")
    monkeypatch.setitem(model_args.FAMILY_ACTIVATION, "unported", "gelu_pytorch_tanh")
    with open_cmf(cmf_f32) as cmf, pytest.raises(UnsupportedModel, match=(
            "gemma3-f32.cmf: arch.arch_name 'gemma3' .family 'unported'. has no MLX decoder "
            r"\(mlx_runtime.models.unported is missing\)")):
        load_model(cmf)


# -- Core ML


@pytest.fixture(scope="module")
def packages(cmf_f32):
    root = cmf_f32.parent
    export_bundle(cmf_f32, root / "bundle")
    export_coreml(root / "bundle", root / "packages")
    return root / "packages"


@pytest.mark.parametrize("kind", ["stateless", "chunk_kv", "stateful"])
def test_every_package_kind_matches_the_reference_one_shot(packages, cmf_f32, kind):
    reference, _, _ = load_reference(cmf_f32)
    backend = open_package_backend(packages / kind, backend="executor")
    got = backend.logits(IDS)
    # The stateful package reads its K/V back from fp16.
    bound = model_logits_bound(reference, CONTEXT, fp16_cache=kind == "stateful")
    assert np.abs(got - _reference_logits(cmf_f32, IDS)).max() <= bound


@pytest.mark.parametrize("kind", ["chunk_kv", "stateful"])
@pytest.mark.parametrize("schedule", SCHEDULES, ids=_schedule_id)
def test_cache_packages_match_the_reference_over_schedules_across_the_window(packages, cmf_f32, kind, schedule):
    reference, _, _ = load_reference(cmf_f32)
    backend = open_package_backend(packages / kind, backend="executor")
    got, snapshot = backend.kv.run_schedule(IDS, list(schedule))
    assert snapshot.position == CONTEXT
    bound = model_logits_bound(reference, CONTEXT, fp16_cache=kind == "stateful")
    assert np.abs(got - _reference_logits(cmf_f32, IDS)).max() <= bound


def test_the_manifest_says_why_every_cache_is_full_length(packages):
    for kind in ("stateless", "chunk_kv", "stateful"):
        record = load_manifest(packages / kind)["checks"]["sliding_window"]
        assert record["size"] == WINDOW and record["layers"] == [0, 1, 3] and record["cache"] == "full-length"
        assert "ring buffer" in record["why"]


@pytest.fixture(scope="module")
def gate_inputs(cmf_f32, tmp_path_factory):
    """Reference fixtures made from the model's own CMF, and a scoring set."""
    root = tmp_path_factory.mktemp("gate-inputs")
    fixtures = make_reference_fixtures(cmf_f32, root / "fixtures", split_lines(corpus_lines())[1], context=CONTEXT)
    return fixtures, cloze_slice(root / "items.jsonl")


@pytest.mark.parametrize("kind", ["chunk_kv", "stateful"])
def test_the_gates_pass_on_the_cache_packages(packages, gate_inputs, kind, tmp_path):
    fixtures, items = gate_inputs
    result = align_package(packages / kind, fixtures, tmp_path / "gate", items=items)
    report = result.report
    assert result.passed, report["summary"]
    assert report["summary"]["exact"]
    invariants = {i["name"]: i["passed"] for i in report["invariants"]}
    assert invariants["dirty_tail_bitwise"] and invariants["branch_A_B_A_bitwise"]
    # The patterns cross the window on every case longer than it, window_edge decoding on each
    # side of its edge.
    edges = [r for r in report["records"] if r["pattern"] == "window_edge"]
    assert {r["case"] for r in edges} == {"short", "long", "right_pad", "changed_future"} and all(r["passed"] for r in edges)


def test_the_converters_checks_cross_the_window_and_reach_the_last_slot(packages):
    """From the arch and the context: a schedule decoding at positions window-1 and window, then
    a chunk across the window's edge (the last slot is the short schedules' (127, 1) at this
    context), and the stateless graph replayed over the whole context."""
    long = f"[{WINDOW - 1},1,1,64,1]"
    for kind, key in (("chunk_kv", "schedules_vs_reference_max_abs"),
                      ("stateful", "executor_vs_fp16_cache_graph_max_abs")):
        assert long in load_manifest(packages / kind)["checks"][key]
    assert f"T={CONTEXT}" in load_manifest(packages / "stateless")["checks"]["traced_vs_reference_max_abs"]


class _ReadsOutsideTheWindow(ChunkKVRunner):
    """A broken package stand-in: its logits depend on slot 0 of a sliding layer, which no query
    past the window may read (a ring buffer whose slot rule is off would do this)."""

    def run(self, snapshot, ids):
        logits, after = super().run(snapshot, ids)
        return logits + 1e-3 * float(snapshot.key_cache[0, ..., 0, :].mean()), after


def test_the_dirty_tail_check_starts_past_the_window_and_catches_a_read_outside_it(packages, cmf_f32):
    _, args, _ = load_reference(cmf_f32)
    assert branch_prefix(args, CONTEXT) == WINDOW + BRANCH_PREFIX
    prefix = IDS[:branch_prefix(args, CONTEXT)]
    good = open_package_backend(packages / "chunk_kv", backend="executor")
    bad = open_package_backend(packages / "chunk_kv", backend="executor")
    bad.kv = bad.chunks = _ReadsOutsideTheWindow(bad.package)
    good, bad = ({i["name"]: i["passed"] for i in branching_invariants(b, prefix, args)} for b in (good, bad))
    assert all(good.values())
    assert bad["dirty_tail_bitwise"] is False and bad["branch_A_B_A_bitwise"] is True
