"""Memory that scales with the model: which stage holds the weights as a map of a file and
which as its own copy, held as properties (where a tensor's bytes live, whether a map's
pages were written), never as a timing or a measured size. The sizes themselves are
measured by benchmarks/scale_bench.py."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from rss import TreeSampler, process_tree  # noqa: E402

from coreml.mil import executor as executor_module  # noqa: E402
from coreml.mil.executor import Executor  # noqa: E402
from coreml.mil.loader import load_program  # noqa: E402
from coreml.recipes import compress_package  # noqa: E402
from manifests.identity import load_manifest  # noqa: E402
from pipeline.ground.bundle_format import WEIGHTS_NAME, mapped_weights  # noqa: E402
from pipeline.ground.reference import load_reference  # noqa: E402
from pipeline.stages.gates.lineage import upstream_of  # noqa: E402
from pipeline.stages.gates.references import intended_references  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc (Linux only)")

MIB = 1 << 20


def _mappings(path: Path) -> list[dict]:
    """This process's mappings of `path`: address range and smaps' counters in bytes."""
    found, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's first line
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            current = {"start": start, "stop": stop} if len(fields) >= 6 and fields[5] == str(path) else None
            if current is not None:
                found.append(current)
        elif current is not None and fields[0].endswith(":") and len(fields) == 3 and fields[2] == "kB":
            current[fields[0][:-1]] = int(fields[1]) * 1024
    return found


def _inside(tensor: torch.Tensor, mappings: list[dict]) -> bool:
    start = tensor.data_ptr()
    stop = start + tensor.numel() * tensor.element_size()
    return any(m["start"] <= start and stop <= m["stop"] for m in mappings)


# -- the sampler


def test_sampler_counts_anonymous_memory_apart_from_mapped_file_pages(tmp_path):
    """A child that holds 64 MiB of its own and has read a 64 MiB file through a map: the
    anonymous peak holds the first and not the second, the total both; the grandchild counts
    in the tree."""
    data = tmp_path / "data.bin"
    data.write_bytes(np.arange(16 * MIB, dtype=np.float32).tobytes())
    child = (
        "import subprocess, sys, numpy as np\n"
        f"own = np.ones({8 * MIB}, np.float64)\n"
        f"mapped = np.memmap({str(data)!r}, dtype=np.uint8, mode='r'); mapped.sum()\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE)\n"
        "print(grandchild.pid, flush=True); sys.stdin.read(); grandchild.communicate()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild = int(process.stdout.readline())
    sampler = TreeSampler(process.pid)
    sampler.sample()
    process.communicate("")
    peaks = sampler.result()
    assert grandchild in sampler.processes and process.pid in sampler.processes
    assert peaks["process_anon"] >= 64 * MIB
    assert peaks["process_rss"] >= peaks["process_anon"] + 64 * MIB  # the file's pages, read through the map
    assert peaks["process_anon"] < 64 * MIB + 64 * MIB  # ...which are not anonymous (interpreter and numpy < 64 MiB)
    assert peaks["tree_anon"] > peaks["process_anon"]
    assert all(peaks["holders"][peak]["pid"] == process.pid for peak in ("process_rss", "process_anon"))
    assert process_tree(process.pid) == [process.pid]  # gone: only the root is named


# -- the reference model over the bundle's map


def test_reference_parameters_are_the_bundle_map_and_nothing_writes_it(fixture_bundle):
    weights = fixture_bundle / WEIGHTS_NAME
    model, _, _ = load_reference(fixture_bundle)
    dirty = []

    def record(*_):
        # Copy-on-write: a page the model wrote would be a private dirty page of the mapping,
        # seen here before the module's own hook drops its pages (which would drop the write too).
        dirty.append(sum(m.get("Private_Dirty", 0) for m in _mappings(weights)))

    for module in (*model.model.layers, model.head):
        module.register_forward_hook(record, prepend=True)
    with torch.no_grad():
        model(torch.arange(16))
    mappings = _mappings(weights)
    assert mappings, "the bundle's weights are not mapped"
    parameters = list(model.parameters())
    assert parameters and all(_inside(p, mappings) for p in parameters)
    assert len(dirty) == len(model.model.layers) + 1 and set(dirty) == {0}
    assert all(m.get("Private_Dirty", 0) == 0 for m in mappings)


# -- dropping a map's pages once read


def _resident(array: np.ndarray) -> int:
    (mapping,) = [m for m in _all_mappings() if m["start"] <= array.ctypes.data < m["stop"]]
    return mapping["Rss"]


def _all_mappings() -> list[dict]:
    found = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            start, stop = (int(x, 16) for x in fields[0].split("-"))
            found.append({"start": start, "stop": stop})
        elif fields[0] == "Rss:":
            found[-1]["Rss"] = int(fields[1]) * 1024
    return found


@pytest.mark.parametrize("mode", ["r", "c", "r+"])  # a package's weight.bin, a bundle, a scratch file
def test_released_pages_leave_the_process_and_read_back_the_same(tmp_path, mode):
    """Releasing a view of a read 16 MiB map drops at least the whole pages that view covers (no
    read comes between, so the kernel maps nothing back; a kernel that maps the page cache's
    large folios whole may drop the whole folio around an end), and a read afterwards sees the
    file's values. What the read left resident is not asserted: under memory pressure the kernel
    may reclaim clean file pages at any moment, which never raises what a release leaves."""
    from pipeline.ground.pages import is_mapped, release_pages

    path = tmp_path / "data.bin"
    values = np.random.default_rng(0).standard_normal(4 * MIB).astype(np.float32)
    values.tofile(path)
    mapped = np.memmap(path, np.float32, mode=mode)
    assert mapped.sum() == values.sum()
    view = mapped[1000:3 * MIB + 7].reshape(-1, 1)  # neither end on a page boundary
    page = 4096
    first, last = -(-1000 * 4 // page), (3 * MIB + 7) * 4 // page  # its whole pages
    assert is_mapped(view)
    release_pages(view)
    assert _resident(mapped) <= values.nbytes - (last - first) * page
    assert np.array_equal(view[:, 0], values[1000:3 * MIB + 7]) and np.array_equal(mapped, values)
    own = values.copy()
    assert not is_mapped(own)
    release_pages(own)  # not a map's: nothing happens to it
    assert np.array_equal(own, values)


def test_a_forward_releases_every_layer_and_the_head_and_computes_the_same(fixture_bundle, monkeypatch):
    """The reference drops each decoder layer's and the head's pages of the bundle's map once the
    module has run; the logits are those of the same model with nothing released, bit for bit
    (the same bytes are read, from the page cache instead of the process's own mapping)."""
    from pipeline.ground import reference as reference_module

    released = set()
    original = reference_module.release_pages
    monkeypatch.setattr(reference_module, "release_pages",
                        lambda array: (released.add(array.ctypes.data), original(array)))
    model, _, _ = load_reference(fixture_bundle)
    ids = torch.arange(16)
    with torch.no_grad():
        logits = model(ids)
        for module in model.modules():
            module._forward_hooks.clear()
        kept = model(ids)
    owned = {p.data_ptr() for module in (*model.model.layers, model.head) for p in module.parameters()}
    assert released == owned
    assert torch.equal(logits, kept)


@pytest.mark.parametrize("copy_of", ["fp16 mitigated model", "fp16 reference", "fp16 reference of the mitigated model"])
def test_a_copy_of_the_reference_keeps_the_map_and_releases_its_pages(fixture_bundle, monkeypatch, copy_of):
    """The fp16 conversion's mitigated model and the gates' fp16 reference are deep copies of the
    reference, the gates' of a copy. Their page-dropping hooks keep the arrays of the bundle's
    map, never copies of them (a deep copy of those arrays was a copy of the weights in memory:
    0.54 GB in SmolLM2-135M's fp16 conversion), nor copies of the parameters they watch (the
    FP32 layers and head of Qwen2.5-Coder-1.5B in its chain gate's reference: 6.2 GB), and a
    forward of the copy drops the pages of every layer and the head."""
    from pipeline.ground import reference as reference_module
    from pipeline.ground.models.fp16 import Fp16Mitigations, fp16_reference, mitigated_model
    from pipeline.ground.pages import is_mapped

    released = set()
    original = reference_module.release_pages
    monkeypatch.setattr(reference_module, "release_pages",
                        lambda array: (released.add(array.ctypes.data), original(array)))
    model, args, _ = load_reference(fixture_bundle)
    models = [model]
    if copy_of != "fp16 reference":
        models.append(mitigated_model(model, args, Fp16Mitigations(residual_scale=0.5, rmsnorm="max_scaled")))
    if copy_of != "fp16 mitigated model":
        models.append(fp16_reference(models[-1]))
    copied = models[-1]

    def hooked_arrays(module):
        return [array for m in module.modules() for hook in m._forward_hooks.values() for _, array in hook.owned]

    arrays = hooked_arrays(copied)
    assert arrays and all(is_mapped(array) for array in arrays)
    watched = [p for m in copied.modules() for hook in m._forward_hooks.values() for ps, _ in hook.owned for p in ps]
    existing = {p.data_ptr() for m in models for p in m.parameters()}
    assert watched and all(p.data_ptr() in existing for p in watched), "a hook watches a copy of a parameter's data"
    assert {a.ctypes.data for a in arrays} == {a.ctypes.data for a in hooked_arrays(model)}
    with torch.no_grad():
        copied(torch.arange(16))
    assert released == {a.ctypes.data for a in arrays}


def test_a_parameter_written_in_place_keeps_its_values_through_a_forward(fixture_bundle):
    """Dropping a copy-on-write page would undo a write into it: a parameter written in place
    (`load_state_dict` without `assign` copies into the map's pages) keeps its pages, so the
    model computes with the written values in every forward, as it did before anything was
    dropped."""
    model, _, _ = load_reference(fixture_bundle)
    weight = model.model.layers[0].mlp.down_proj.weight
    written = torch.full_like(weight, 0.25)
    model.load_state_dict({"model.layers.0.mlp.down_proj.weight": written}, strict=False)
    ids = torch.arange(16)
    with torch.no_grad():
        first = model(ids)
        second = model(ids)
    assert torch.equal(weight, written) and torch.equal(first, second)


def test_mapped_weights_equal_the_file_read_by_safetensors(fixture_bundle):
    from safetensors.numpy import load_file

    read = load_file(fixture_bundle / WEIGHTS_NAME)
    mapped = mapped_weights(fixture_bundle / WEIGHTS_NAME)
    assert list(mapped) == list(read)
    for name, array in read.items():
        assert mapped[name].dtype == np.float32 and mapped[name].flags.writeable
        np.testing.assert_array_equal(mapped[name], array)


@pytest.fixture(scope="module")
def int8_chunk_kv(fixture_packages, tmp_path_factory):
    return compress_package(fixture_packages / "chunk_kv", "int8-b32", tmp_path_factory.mktemp("int8") / "chunk_kv").path


def test_intended_reference_takes_decoded_weights_without_writing_the_map(int8_chunk_kv, fixture_bundle):
    """The compressed package's reference: its decoded weights in place of the bundle's (the
    tied head still the decoded embedding), any other tensor the bundle's map, which nothing
    writes; the same values as loading the bundle and `load_state_dict(decoded, strict=False)`."""
    from coreml.decoded import decoded_weights

    manifest = load_manifest(int8_chunk_kv)
    bundle = upstream_of(int8_chunk_kv, manifest)[2]
    intended, fp32 = intended_references(int8_chunk_kv, manifest, bundle)
    decoded = decoded_weights(int8_chunk_kv)
    old_way, _, _ = load_reference(bundle)
    old_way.load_state_dict({n: torch.from_numpy(w) for n, w in decoded.items()}, strict=False)
    state, expected = intended.model.state_dict(), old_way.state_dict()
    assert list(state) == list(expected)
    for name in state:
        assert torch.equal(state[name], expected[name]), name
    mappings = _mappings(bundle / WEIGHTS_NAME)
    # int8-b32 stores every weight the bundle holds, norms as fp32 constants: all are the package's.
    assert all(_inside(p, mappings) == (n not in decoded) for n, p in intended.model.named_parameters())
    assert all(_inside(p, mappings) for p in fp32.model.parameters())
    del old_way, state, expected  # the one model here that wrote into its map (load_state_dict)
    import gc

    gc.collect()
    assert all(m.get("Private_Dirty", 0) == 0 for m in _mappings(bundle / WEIGHTS_NAME))



def test_calibration_swaps_weights_without_writing_the_map(fixture_bundle):
    """A calibration-aware recipe's trials (`Calibration.kl_with`) swap each candidate weight in
    and the bundle's back by assignment: the map is never written, and no copy of the model is
    kept to put it back from."""
    from coreml.calibration import Calibration

    model, _, _ = load_reference(fixture_bundle)
    calib = Calibration.of_model(model.eval(), np.arange(300) % 200)
    name = "model.layers.0.mlp.down_proj.weight"
    before = model.state_dict()[name].clone()
    assert calib.kl_with({name: np.zeros_like(before.numpy())}) > 0  # the trial ran with the swapped weight
    # Put back by assignment: the model's parameters are the very tensors it started with.
    assert all(t is calib.original[n] for n, t in model.state_dict(keep_vars=True).items())
    mappings = _mappings(fixture_bundle / WEIGHTS_NAME)
    assert torch.equal(model.state_dict()[name], before)
    assert all(_inside(p, mappings) for p in model.parameters())
    assert all(_inside(t, mappings) for t in calib.original.values())
    assert all(m.get("Private_Dirty", 0) == 0 for m in mappings)


# -- the MIL executor's constants


def test_executor_fp32_constants_are_views_of_the_weight_file(fixture_packages):
    package = fixture_packages / "chunk_kv"
    program = load_program(package / load_manifest(package)["package"]["name"])
    executor = Executor(program)
    weight_file = next(program.path.glob("Data/com.apple.CoreML/weights/*.bin"))
    mappings = _mappings(weight_file.resolve())
    large = {n: v for n, v in executor.constants.items() if isinstance(v, np.ndarray) and v.nbytes >= 4096}
    assert large and all(v.dtype == np.float32 for v in large.values())
    for name, value in large.items():
        start = value.__array_interface__["data"][0]
        assert not value.flags.owndata and not value.flags.writeable, name
        assert any(m["start"] <= start and start + value.nbytes <= m["stop"] for m in mappings), name


def test_an_executor_run_releases_every_mapped_constant_and_computes_the_same(fixture_packages, monkeypatch):
    package = fixture_packages / "chunk_kv"
    program = load_program(package / load_manifest(package)["package"]["name"])
    executor = Executor(program)
    feeds = {f.name: np.zeros(f.shape, f.dtype.numpy) for f in executor.function.spec_inputs}
    kept = executor.run(feeds)
    released = set()
    original = executor_module.release_pages
    monkeypatch.setattr(executor_module, "release_pages", lambda array: (released.add(array.ctypes.data), original(array)))
    outputs = executor.run(feeds)
    read = {v.ctypes.data for step in executor._steps for v in step.static.values() if isinstance(v, np.ndarray)}
    mapped = {v.ctypes.data for v in executor.constants.values() if isinstance(v, np.ndarray) and v.flags.owndata is False
              and v.ctypes.data in read and v.nbytes >= 4096}
    assert mapped and mapped <= released
    assert all(np.array_equal(outputs[name], kept[name]) for name in kept)


def test_a_single_token_prediction_keeps_the_weights_pages_for_the_next_within_the_decode_budget(
        fixture_packages, monkeypatch):
    """A one-token prediction on the executor drops no page (the next step reads every weight
    again), where its program's mapped constants fit RESIDENT_DECODE_BYTES; over it, or for more
    tokens, every mapped constant's pages go after its op, as before; the outputs are the same."""
    from coreml.package import open_package

    package = open_package(fixture_packages / "chunk_kv", backend="executor")
    executor = package.executor
    assert 0 < executor.mapped_bytes <= executor_module.RESIDENT_DECODE_BYTES
    feeds = {f.name: np.zeros(f.shape, f.dtype.numpy) for f in executor.function.spec_inputs
             if f.name != "input_ids"}
    released = []
    original = executor_module.release_pages
    monkeypatch.setattr(executor_module, "release_pages", lambda array: (released.append(array), original(array)))

    def predict(tokens: int) -> dict:
        released.clear()
        return package.predict({**feeds, "input_ids": np.full((1, tokens), 3, np.int32)})

    kept = predict(1)
    assert released == []
    predict(2)
    assert len(released) >= sum(len(step.mapped) for step in executor._steps) > 0
    monkeypatch.setattr(executor_module, "RESIDENT_DECODE_BYTES", executor.mapped_bytes - 1)
    dropped = predict(1)
    assert len(released) == sum(len(step.mapped) for step in executor._steps)
    assert all(np.array_equal(dropped[name], kept[name]) for name in kept)


# -- the scale benchmark's models and table


def test_scale_bench_models_have_smollm2s_parameter_counts():
    """The configs are SmolLM2's: built on the meta device, each model has the published count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from scale_bench import COMMON, SHAPES

    published = {"135m": 134_515_008, "360m": 361_821_120, "1.7b": 1_711_376_384}
    for name, shape in SHAPES.items():
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**shape, **COMMON))
        assert sum(p.numel() for p in model.parameters()) == published[name], name


def test_scale_bench_rows_are_ratios_to_the_weights_and_the_baseline():
    from scale_bench import GB, rows

    def stage(seconds, rss, anon):
        return {"seconds": seconds, "process_rss": rss, "process_anon": anon, "tree_anon": anon}

    results = {"135m": {"fp32_bytes": 1 * GB, "stages": {"align": stage(10, 2 * GB, 1 * GB)}},
               "360m": {"fp32_bytes": 3 * GB, "stages": {"align": stage(60, 4 * GB, 5 * GB)}}}
    base, big = rows(results)
    assert base["seconds_x_base"] == base["rss_x_base"] == base["anon_x_base"] == 1
    assert big["seconds_x_base"] == 6 and big["seconds_per_weight_x_base"] == 2
    assert big["rss_x_weights"] == 4 / 3 and big["anon_x_weights"] == 5 / 3 and big["anon_x_base"] == 5
    assert base["anon_within_target"] and big["anon_within_target"] == (5 <= 1.25 * 3 + 1.5)


def test_scratch_file_holds_arrays_as_maps_of_an_unlinked_file():
    """What a stage makes once and then reads (decoded weights, a gate's logits) lives in the
    page cache: the values round-trip bit for bit, each array is a view of one shared map of a
    file no folder lists, and it stays readable after the ScratchFile object itself is gone."""
    import gc

    from pipeline.ground.scratch import ScratchFile

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((300, 7)).astype(np.float32), rng.standard_normal(5).astype(np.float16),
              np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]]  # not contiguous
    scratch = ScratchFile()
    held = [scratch.hold(a) for a in arrays]
    joined = scratch.empty((300, 7), np.float32)  # written in parts, as a gate's chunks are
    joined[:100], joined[100:] = arrays[0][:100], arrays[0][100:].astype(np.float16)
    del scratch
    gc.collect()
    for array, mapped in zip(arrays, held):
        assert mapped.dtype == array.dtype and mapped.shape == array.shape
        assert np.array_equal(mapped.view(np.uint8), np.ascontiguousarray(array).view(np.uint8))
    assert np.array_equal(joined, np.concatenate([arrays[0][:100], arrays[0][100:].astype(np.float16)]))
    # One map of one deleted file in the temp folder holds them all.
    (mapping,) = [m for m in _scratch_mappings() if m["start"] <= held[0].ctypes.data < m["stop"]]
    assert all(mapping["start"] <= a.ctypes.data < mapping["stop"] for a in [*held, joined])


def test_scratch_takes_its_disk_blocks_before_writing_and_says_when_there_are_none(tmp_path, monkeypatch):
    """A sparse file's page written through a map where the disk is full kills the process
    with SIGBUS, naming nothing (a 1.7B survey worker died so, exit -7): the blocks of each
    array are taken when it is placed, and a full disk is a typed error naming the folder."""
    import errno
    import os

    from pipeline.ground import scratch as scratch_module

    scratch = scratch_module.ScratchFile(str(tmp_path))
    placed = scratch.empty((5000,), np.float64)  # not written yet
    assert os.fstat(scratch._file.fileno()).st_blocks * 512 >= placed.nbytes  # its blocks taken all the same

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(scratch_module.os, "posix_fallocate", full)
    with pytest.raises(scratch_module.ScratchSpace, match=f"{tmp_path}: no room for 8000 bytes"):
        scratch.hold(np.zeros(1000))


def test_executor_and_reference_hold_decoded_weights_in_scratch_maps(int8_chunk_kv, fixture_bundle, monkeypatch):
    """A compressed package's weights, decoded once by the executor and once by coremltools for
    the gate's reference, are maps of scratch files, not memory of the process."""
    monkeypatch.setattr(executor_module, "SCRATCH_BYTES", 4096)  # the fixture's weights are KBs, not MBs
    program = load_program(int8_chunk_kv / load_manifest(int8_chunk_kv)["package"]["name"])
    executor = Executor(program)
    operations = program.functions[program.default_function].block.operations
    decoded = [executor.constants[name] for op in operations if op.type.startswith("constexpr_")
               for name, _ in op.outputs if name in executor.constants]
    large = [value for value in decoded if value.nbytes >= executor_module.SCRATCH_BYTES]
    assert large
    manifest = load_manifest(int8_chunk_kv)
    intended, _ = intended_references(int8_chunk_kv, manifest, upstream_of(int8_chunk_kv, manifest)[2])
    scratch_maps = [m for m in _scratch_mappings()]
    embedding = intended.model.state_dict()["model.embed_tokens.weight"]
    assert any(m["start"] <= embedding.data_ptr() < m["stop"] for m in scratch_maps)
    assert all(any(m["start"] <= value.ctypes.data < m["stop"] for m in scratch_maps) for value in large)


def _scratch_mappings() -> list[dict]:
    """Maps of deleted files in the temp folder: scratch files, unlinked from the start."""
    import tempfile

    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith(tempfile.gettempdir()) and fields[5].endswith("(deleted)"):
            start, stop = (int(x, 16) for x in line.split()[0].split("-"))
            found.append({"start": start, "stop": stop})
    return found


def test_executor_holds_each_decompressed_weight_once(fixture_packages, tmp_path):
    """int4-b32 decodes each weight to fp16 and casts it to fp32: only the fp32 result, which
    the program's ops read, stays among the executor's constants."""
    package = compress_package(fixture_packages / "chunk_kv", "int4-b32", tmp_path / "int4").path
    program = load_program(package / load_manifest(package)["package"]["name"])
    executor = Executor(program)
    operations = program.functions[program.default_function].block.operations
    folded = {name: op for op in operations if op.type.startswith("constexpr_") for name, _ in op.outputs}
    cast_inputs = {op.inputs["source_val"][0].name for op in operations if op.type == "constexpr_cast"}
    read = {a.name for op in operations if not op.type.startswith(("const", "constexpr_"))
            for args in op.inputs.values() for a in args if a.name}
    assert cast_inputs and cast_inputs <= set(folded) and not cast_inputs & set(executor.constants)
    assert {name for name in folded if name in read} <= set(executor.constants)
    assert all(executor.constants[name].dtype == np.float32 for name in folded if name in executor.constants)


@pytest.mark.parametrize("recipe", ["palette4-gc32", "int8-b32", "int4-b32-emb8"])
def test_decoding_in_row_blocks_gives_the_whole_decoding(fixture_packages, tmp_path, monkeypatch, recipe):
    """coremltools' decodings make arrays of the weight's size, or many times it (a palette's LUT
    repeated to every element: 4.1 GB for SmolLM2's embedding at 64 entries; a shift-scale's codes,
    scale, offset and product), so the gate's reference decodes rows a block of whole tiles or
    scale blocks at a time: the same elementwise decoding of the same values, bit for bit. The
    recipes cover a LUT, float32 scales, and fp16 scales with offsets."""
    from coreml import codes, decoded

    package = compress_package(fixture_packages / "chunk_kv", recipe, tmp_path / recipe).path
    monkeypatch.setattr(codes, "DECODE_BLOCK_BYTES", 1 << 62)  # every weight in one block
    whole = decoded.decoded_weights(package)
    monkeypatch.setattr(codes, "DECODE_BLOCK_BYTES", 1)  # one tile or scale block of rows a block
    blocked = decoded.decoded_weights(package)
    assert list(blocked) == list(whole)
    for name in whole:
        assert np.array_equal(blocked[name].view(np.uint32), whole[name].view(np.uint32)), name


@pytest.mark.parametrize("offset", [None, np.float16, np.uint8])
def test_shift_scale_codes_decode_in_row_blocks_as_whole(monkeypatch, offset):
    """A recipe's own codes (`coreml.codes.ShiftScale`, which `mixed` decodes for every trial) decode a
    block of rows at a time, to the bits of one whole decoding: fp16 scales, no offset, an fp16
    offset and an integer zero point; blocks of 32 along each row, as the recipes code them."""
    from coreml import codes

    rng = np.random.default_rng(0)
    rows, cols, block = 37, 96, 32
    data = rng.integers(0, 16, (rows, cols), dtype=np.uint8)
    scale = rng.uniform(1e-3, 1e-1, (rows, cols // block)).astype(np.float16)
    offsets = None if offset is None else (rng.integers(0, 16, scale.shape).astype(offset) if offset == np.uint8
                                           else rng.uniform(-8, 8, scale.shape).astype(np.float16))
    code = codes.ShiftScale(data, scale, offsets, 4, signed=False)
    monkeypatch.setattr(codes, "DECODE_BLOCK_BYTES", 1 << 62)
    whole = code.decode()
    monkeypatch.setattr(codes, "DECODE_BLOCK_BYTES", 1)  # a row a block
    blocked = code.decode()
    assert whole.dtype == blocked.dtype == np.float32 and whole.shape == (rows, cols)
    assert np.array_equal(blocked.view(np.uint32), whole.view(np.uint32))
