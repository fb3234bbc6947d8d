"""Core ML conversion of the reference model: packages run through the numpy MIL executor
and match the torch reference; the schedule check refuses broken graphs; manifests, atomic
output, --force and tampered bundles.

One random-weight bundle (4 layers, GQA, tied head, context 128) is converted once for the
module; each test reads the packages it needs.
"""

import dataclasses
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
import torch

from _coreml_models import CONTEXT, VOCAB, make_bundle
from pipeline.ground.models.numerics import model_logits_bound
from coreml.convert import _kinds_in_workers, export_coreml
from pipeline.ground.workers import WorkerFailed
from coreml.crosscheck import BUNDLE_SHA_KEY
from coreml.kinds import UnknownKind, package_kind
from coreml.kinds.export import ScheduleMismatch, check_chunk_schedules, reference_for_export
from coreml.kinds.schedules import CheckSchedule, check_schedules
from coreml.manifest import verify_package
from coreml.mil.loader import load_program
from coreml.package import open_package
from manifests.identity import sha256_file
from manifests.output import unfinished_output
from pipeline.cli import main
from pipeline.ground.errors import IdentityError, OutputExists
from pipeline.ground.models import CachedStep, KVCache



@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The bundle, the packages folder, and the stateless and chunk-KV manifests."""
    root = tmp_path_factory.mktemp("coreml")
    bundle = make_bundle(root)
    manifests = export_coreml(bundle, root / "packages", kinds=("stateless", "chunk_kv"))
    return bundle, root / "packages", manifests


@pytest.fixture(scope="module")
def stateful(built, tmp_path_factory):
    out = tmp_path_factory.mktemp("stateful") / "packages"
    return export_coreml(built[0], out, kinds=("stateful",))["stateful"]


@pytest.fixture(scope="module")
def reference(built):
    return reference_for_export(built[0])


def _ids(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, length).astype(np.int32)


def _expected(reference, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return reference.model(torch.tensor(ids, dtype=torch.long)).numpy()


@pytest.mark.parametrize("length", [1, 17, CONTEXT])
def test_stateless_package_matches_the_reference(built, reference, length):
    package = open_package(built[1] / "stateless", backend="executor")
    ids = _ids(length, seed=length)
    logits = package.predict({"input_ids": ids[None]})["logits"]
    assert logits.shape == (1, length, VOCAB)
    # float32 package vs float32 reference: summation order only.
    assert np.abs(logits[0] - _expected(reference, ids)).max() <= model_logits_bound(reference.model, length)


@pytest.mark.parametrize("schedule", [(1, 3, 124), (124, 3, 1), (127, 1)], ids=str)
def test_chunk_kv_package_matches_the_reference_on_any_schedule(built, reference, schedule):
    package = open_package(built[1] / "chunk_kv", backend="executor")
    ids = _ids(sum(schedule), seed=sum(schedule) + len(schedule))
    shape = reference.cache_shape
    # Noise in every slot: slots at or after position + T must never reach the output.
    rng = np.random.default_rng(5)
    keys, values = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
    logits, position = [], 0
    for size in schedule:
        out = package.predict({"input_ids": ids[None, position : position + size],
                               "position": np.array([position], dtype=np.int32),
                               "key_cache": keys, "value_cache": values})
        logits.append(out["logits"][0])
        keys, values = out["new_key_cache"], out["new_value_cache"]
        position += size
    # The graph attends over all CONTEXT slots (masked ones weigh exactly 0).
    assert np.abs(np.concatenate(logits) - _expected(reference, ids)).max() <= model_logits_bound(reference.model, CONTEXT)


def _run_from_package_caches(reference, prefill, decode, ids: np.ndarray, schedule):
    """(package logits, reference logits): each chunk through the package, and through the
    reference's cached forward starting from the package's own fp16 state. Carrying the
    reference's own cache instead lets a key that float32 summation order rounded to the
    neighbouring fp16 value (2^-11 relative) reach later logits: 4.2e-4 on one CPU, not on
    another."""
    state = prefill.make_state()
    cache = KVCache.empty(reference.args, CONTEXT)
    got, want, start = [], [], 0
    with torch.no_grad():
        for size in schedule:
            function = prefill if start == 0 else decode
            cache.keys = torch.from_numpy(state.read_state("key_cache").astype(np.float32))
            cache.values = torch.from_numpy(state.read_state("value_cache").astype(np.float32))
            want.append(reference.model.forward_cached(torch.tensor(ids[start : start + size]), cache).numpy())
            inputs = {"input_ids": ids[None, start : start + size], "position": np.array([start], np.int32)}
            got.append(function.predict(inputs, state)["logits"][0])
            start += size
    return np.concatenate(got), np.concatenate(want)


def test_stateful_package_prefill_then_decode_matches_an_fp16_cache_reference(stateful, reference):
    checks = stateful["checks"]
    prefill = open_package(stateful.path, backend="executor", function_name="prefill")
    decode = open_package(stateful.path, backend="executor", function_name="decode")
    ids = _ids(40, seed=9)
    logits, from_same_cache = _run_from_package_caches(reference, prefill, decode, ids, [37, 1, 1, 1])
    spec = ct.utils.load_spec(str(stateful.path / "model.mlpackage"))
    states = [s for function in spec.description.functions for s in function.state]
    float16 = ct.proto.FeatureTypes_pb2.ArrayFeatureType.FLOAT16
    assert len(states) == 4 and all(s.type.stateType.arrayType.dataType == float16 for s in states)
    # Same fp16 cache in, float32 compute on both sides: summation order only.
    assert np.abs(logits - from_same_cache).max() <= model_logits_bound(reference.model, len(ids))
    # Against the float32 reference the difference is the fp16 cache's, within its derived bound
    # (and the figure the manifest records, measured on the check schedules, within it too).
    fp16_bound = model_logits_bound(reference.model, len(ids), fp16_cache=True)
    assert 0 < np.abs(logits - _expected(reference, ids)).max() <= fp16_bound
    assert max(checks["fp16_cache_error_vs_float32_reference_max_abs"].values()) <= model_logits_bound(reference.model, CONTEXT, fp16_cache=True)
    assert max(checks["executor_vs_fp16_cache_graph_max_abs"].values()) <= checks["tolerance"]


def test_manifests_bind_the_package_to_its_bundle_code_and_program(built, stateful):
    bundle, out, manifests = built
    bundle_sha = sha256_file(bundle / "manifest.json")
    assert manifests["chunk_kv"].path == out / "chunk_kv"
    for manifest in [*manifests.values(), stateful]:
        package_dir = manifest.path
        assert verify_package(package_dir).data == manifest.data
        assert manifest["format"] == "cmfdeploy.coreml/1" and manifest["status"] == "complete"
        source = dict(manifest["source"])
        # From the package's final folder, not the staging one it was written in.
        assert (package_dir / source.pop("relative_path")).resolve() == bundle.resolve()
        # No absolute path: a package copied to another machine names none of the build machine's.
        assert source == {"kind": "artifact", "format": "cmfdeploy.bundle/1", "manifest_sha256": bundle_sha}
        spec = ct.utils.load_spec(str(package_dir / "model.mlpackage"))
        assert spec.description.metadata.userDefined[BUNDLE_SHA_KEY] == bundle_sha
        assert spec.description.metadata.author and spec.description.metadata.license
        assert spec.description.metadata.shortDescription and spec.description.metadata.versionString
        # The histogram is the saved program's, recounted here by the executor's own loader.
        program = load_program(package_dir / "model.mlpackage")
        recount = {name: dict(Counter(op.type for op in f.block.operations)) for name, f in program.functions.items()}
        assert manifest["op_histogram"] == recount
        on_disk = sum(p.stat().st_size for p in (package_dir / "model.mlpackage").rglob("*") if p.is_file())
        assert manifest["package_bytes"] == on_disk
        code = manifest["conversion"]["code"]["files"]
        assert code["coreml/convert.py"] == sha256_file(Path(__file__).parents[1] / "coreml/convert.py")
        assert "pipeline/ground/models/base.py" in code
        assert manifest["environment"]["packages"]["coremltools"] == ct.__version__
        weights = manifest["package"]["weights"]
        assert weights["model_model_embed_tokens_weight"] == ["model.embed_tokens.weight"]
        assert len(weights) == 1 + 4 * 9 + 1  # embedding, 7 projections + 2 norms per layer, final norm
    chunk = manifests["chunk_kv"]["package"]
    assert [f["name"] for f in chunk["inputs"]] == ["input_ids", "position", "key_cache", "value_cache"]
    assert chunk["inputs"][2]["shape"] == [4, 1, 2, CONTEXT, 16]
    assert set(manifests["chunk_kv"]["checks"]["schedules_vs_reference_max_abs"]) == {
        s.name for s in check_schedules(reference_for_export(bundle).args, CONTEXT)}
    assert stateful["package"]["functions"] == {"prefill": {"dims": {"T": [1, CONTEXT]}},
                                                "decode": {"dims": {"T": [1, 1]}}}
    assert sorted(stateful["op_histogram"]) == ["decode", "prefill"]


def test_kinds_converted_in_worker_processes_are_the_serial_packages(built, stateful, tmp_path):
    """jobs=2: each kind in its own process (1 BLAS thread) gives the serial conversion's
    package: the same weights to the byte, the same program op for op, the same manifest
    but for the measured check figures and seconds (those are figures of another run); the
    source record points at the bundle from the package's final folder."""
    bundle, serial_dir, serial = built
    parallel = export_coreml(bundle, tmp_path / "packages", jobs=2)
    serial = {**serial, "stateful": stateful}
    assert list(parallel) == ["stateless", "chunk_kv", "stateful"]
    for kind, manifest in parallel.items():
        assert manifest.path == tmp_path / "packages" / kind and verify_package(manifest.path).data == manifest.data
        weights = "model.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
        assert sha256_file(manifest.path / weights) == sha256_file(serial[kind].path / weights)
        assert manifest["op_histogram"] == serial[kind]["op_histogram"]
        figures = ("checks", "conversion", "environment", "files", "package_bytes", "source")
        assert {k: v for k, v in manifest.data.items() if k not in figures} == {
            k: v for k, v in serial[kind].data.items() if k not in figures}
        assert manifest["checks"].keys() == serial[kind]["checks"].keys()
        assert (manifest.path / manifest["source"]["relative_path"]).resolve() == bundle.resolve()
        assert {**manifest["source"], "relative_path": None} == {**serial[kind]["source"], "relative_path": None}


def test_a_failing_worker_is_a_typed_error_with_its_output(tmp_path):
    with pytest.raises(WorkerFailed, match=r"out: the worker running 'chunk_kv' exited 1:\n(.|\n)*no-bundle"):
        _kinds_in_workers(("chunk_kv",), tmp_path / "no-bundle", tmp_path / "staging", tmp_path / "out", None, 2,
                          lambda stage: None)


@pytest.mark.parametrize("where", [0, 6, 9])  # the first block, the last row of a block, the last block
def test_logits_compared_in_row_blocks_give_the_whole_comparison(monkeypatch, where):
    """The export's checks compare logits a block of rows at a time (the reference's made per
    block from its hidden states); the largest |Δ| is that of the whole arrays, a NaN anywhere
    included."""
    from coreml.kinds import export

    monkeypatch.setattr(export, "COMPARE_BLOCK_BYTES", 7 * 5 * 4)  # 7 rows of 5 float32 logits
    generator = torch.Generator().manual_seed(where)
    # Small integers: every dot product is exact in float32, in any summation order.
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight.data = torch.randint(-4, 5, (5, 3), generator=generator).float()
    model = type("Head", (), {"logits_of": lambda self, hidden: head(hidden)})()
    hidden = torch.randint(-4, 5, (10, 3), generator=generator).float()
    with torch.no_grad():
        want = head(hidden)
        got = want + 1e-3 * torch.randn(10, 5, generator=generator)
        got[where, 2] += 0.5
        assert export.max_abs_delta(got, want) == float((got - want).abs().max())
        assert export.max_abs_delta_to_reference(got, model, hidden) == float((got - want).abs().max())
        got[where, 1] = float("nan")
        assert np.isnan(export.max_abs_delta(got, want)) and np.isnan(export.max_abs_delta_to_reference(got, model, hidden))


def test_schedule_check_refuses_a_graph_that_ignores_position(reference):
    graph = CachedStep(reference.model)

    def forgets_position(ids, position, keys, values):
        return graph(ids, torch.zeros_like(position), keys, values)

    with pytest.raises(ScheduleMismatch, match=r"schedule \[1,3,124\] .* max \|Δ\| "):
        check_chunk_schedules(forgets_position, reference)


def test_schedule_check_refuses_a_graph_that_reads_slots_after_the_chunk(reference):
    graph = CachedStep(reference.model)

    def leaks_future_slots(ids, position, keys, values):
        logits, new_keys, new_values = graph(ids, position, keys, values)
        return logits + 1e-3 * new_values[..., -1, :].sum(), new_keys, new_values

    with pytest.raises(ScheduleMismatch, match=r"schedule \[1,3,124\]"):
        check_chunk_schedules(leaks_future_slots, reference)


def test_check_schedules_reach_the_context_end_over_a_synthetic_prefix(reference):
    """Past 128 slots one schedule starts over a synthetic cache and decodes into the last slot,
    and no schedule runs more than 128 tokens past a sliding window: a check's attention grows
    with the context, not its square (SmolLM2's chunk-KV check at 8192 ran 8191 real tokens)."""
    plain = reference.args
    for context in (100, 128, 2048, 8192):
        schedules = check_schedules(plain, context)
        assert all(s.start + s.tokens <= context and s.tokens <= 128 for s in schedules)
        assert any(s.start + s.tokens == context and s.chunks[-1] == 1 for s in schedules)
        assert any(s.start for s in schedules) == (context > 128)
    window = 512
    sliding = dataclasses.replace(plain, layer_types=("SlidingAttention",) * plain.num_layers, sliding_window=window)
    (edge,) = [s for s in check_schedules(sliding, 8192) if s.tokens > 128]
    decoded = {int(position) for position, size in zip(np.cumsum((0,) + edge.chunks), edge.chunks) if size == 1}
    assert edge.start == 0 and {window - 1, window} <= decoded and edge.tokens <= window + 128


def test_a_schedule_over_a_synthetic_prefix_catches_a_graph_that_forgets_it(reference):
    """The reference reads the noise the graph's cache holds below the schedule's start (the right
    graph passes), and a graph that reads zeros there instead is refused."""
    graph = CachedStep(reference.model)
    at_end = CheckSchedule((7, 1), -8)
    errors = check_chunk_schedules(graph, reference, (at_end,))
    assert list(errors) == [f"@{CONTEXT - 8}[7,1]"] and errors[f"@{CONTEXT - 8}[7,1]"] <= reference.tolerance

    def forgets_the_prefix(ids, position, keys, values):
        written = (torch.arange(keys.shape[3]) >= position)[:, None]
        return graph(ids, position, keys * written, values * written)

    # One chunk each: only what the cache held before the schedule can tell.
    assert check_chunk_schedules(forgets_the_prefix, reference, (CheckSchedule((8,)),))
    with pytest.raises(ScheduleMismatch, match=rf"schedule @{CONTEXT - 8}\[8\]"):
        check_chunk_schedules(forgets_the_prefix, reference, (CheckSchedule((8,), -8),))


class _ForgetsItsState:
    """A stateful package stand-in whose prediction reads an emptied state."""

    def __init__(self, package):
        self.package, self.path = package, package.path

    def function(self, name):
        return _ForgetsItsState(self.package.function(name))

    def make_state(self):
        return self.package.make_state()

    def predict(self, inputs, state):
        for name in ("key_cache", "value_cache"):
            state.write_state(name, np.zeros_like(state.read_state(name)))
        return self.package.predict(inputs, state)


def test_the_stateful_measure_starts_from_noise_in_the_state(stateful, reference):
    """The saved stateful package (on the executor) from a state holding noise below the schedule's
    start agrees with the fp16-cache graph within FP32's tolerance; the fp16-cache error it records
    is within its bound; a package that reads an emptied state passes from slot 0 and is refused
    from the prefix."""
    kind = package_kind("stateful")
    prefill = open_package(stateful.path, backend="executor", function_name="prefill")
    at_end, name = CheckSchedule((7, 1), -8), f"@{CONTEXT - 8}[7,1]"
    checks = kind.measure(prefill, reference, stateful["package"], (at_end,))
    assert checks["executor_vs_fp16_cache_graph_max_abs"][name] <= checks["tolerance"]
    fp16_bound = model_logits_bound(reference.model, CONTEXT, fp16_cache=True)
    assert 0 < checks["fp16_cache_error_vs_float32_reference_max_abs"][name] <= fp16_bound
    # One chunk each: only what the state held before the schedule can tell.
    assert kind.measure(_ForgetsItsState(prefill), reference, stateful["package"], (CheckSchedule((8,)),))
    with pytest.raises(ScheduleMismatch, match=rf"schedule @{CONTEXT - 8}\[8\] differs"):
        kind.measure(_ForgetsItsState(prefill), reference, stateful["package"], (CheckSchedule((8,), -8),))


def test_export_refuses_a_broken_chunk_graph_and_leaves_no_output(built, tmp_path, monkeypatch):
    class Broken(CachedStep):
        def forward(self, ids, position, key_cache, value_cache):
            return super().forward(ids, position * 0, key_cache, value_cache)

    monkeypatch.setattr(package_kind("chunk_kv"), "graph", lambda ref: Broken(ref.model))
    with pytest.raises(ScheduleMismatch):
        export_coreml(built[0], tmp_path / "out", kinds=("chunk_kv",))
    assert list(tmp_path.iterdir()) == []


def test_tampered_bundle_is_refused_before_anything_is_built(built, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(built[0], bundle)
    weights = bytearray((bundle / "weights.safetensors").read_bytes())
    weights[-5] ^= 0x01
    (bundle / "weights.safetensors").write_bytes(bytes(weights))
    with pytest.raises(IdentityError, match="weights.safetensors"):
        export_coreml(bundle, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_conversion_leaves_nothing_in_the_temp_folder(built, tmp_path, monkeypatch):
    """coremltools writes a program's weights and its package in the temp folder, and removes a
    temporary package only at interpreter exit: a long stage, or a worker that is killed, kept a
    copy of every package it made there. Each conversion and the stateful kind's merge make them
    in the stage's staging folder instead (a stage killed before its save leaves them there, not in
    the temp folder), and the saved output holds only the packages."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    working_in, convert = [], ct.convert

    def recorded(*args, **kwargs):
        working_in.append(Path(tempfile.gettempdir()))
        return convert(*args, **kwargs)

    monkeypatch.setattr(ct, "convert", recorded)
    export_coreml(built[0], tmp_path / "packages", kinds=("stateless", "stateful"))
    assert list(temp.iterdir()) == [] and tempfile.gettempdir() == str(temp)
    assert len(working_in) == 3  # stateless; stateful's prefill and decode
    assert all(unfinished_output(path) == (tmp_path / "packages").resolve() for path in working_in), working_in
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packages", "temp"]
    assert sorted(p.name for p in (tmp_path / "packages").iterdir()) == ["stateful", "stateless"]


def test_unknown_kind_is_refused(built, tmp_path):
    with pytest.raises(UnknownKind, match="stateles"):
        export_coreml(built[0], tmp_path / "out", kinds=("stateles",))


def test_cli_refuses_existing_output_without_force_and_replaces_it_with(built, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(built[1], out)
    before = (out / "stateless" / "manifest.json").read_bytes()
    assert main(["coreml", str(built[0]), "-o", str(out), "--kinds", "stateless"]) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("OutputExists: ")
    assert (out / "stateless" / "manifest.json").read_bytes() == before
    with pytest.raises(OutputExists):
        export_coreml(built[0], out, kinds=("stateless",))

    assert main(["coreml", str(built[0]), "-o", str(out), "--kinds", "stateless", "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["stateless"]  # chunk_kv went with the old output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or old folders left
    # The same bundle, by its own path; the relative path is from where each package lives.
    source, fixture_source = dict(verify_package(out / "stateless")["source"]), dict(built[2]["stateless"]["source"])
    assert (out / "stateless" / source.pop("relative_path")).resolve() == built[0].resolve()
    fixture_source.pop("relative_path")
    assert source == fixture_source
