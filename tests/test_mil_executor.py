"""The numpy MIL executor against torch eager on real coremltools conversions.

Every variant of a tiny Llama-like decoder (tests/_mil_modules.py) is converted once per
session with ct.convert(iOS18, FLOAT32, flexible T) and run from the SAVED package.
"""

import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

import _mil_modules as mm
from pipeline.ground.models.numerics import decoder_chain, gamma, logits_bound
from coreml.kinds.stateful import _beyond_one_fp16_step
from coreml.mil import Executor, MilError, UnsupportedOp, load_program
from coreml.mil.ops import OPS, OpDef
from coreml.package import PackageError, open_package


def _bounds() -> tuple[float, float]:
    """(logits, K/V) bounds of two float32 evaluations of the tiny decoder (pipeline/ground/models/numerics.py).

    Every variant attends over at most MAX_LEN positions. A cached key or value is rope of a
    DIM-long dot with the attention-normed input: gamma(2 DIM + 3) relative (mean of squares,
    projection, rope's two products and sum) of sqrt(DIM) max|attn_norm| max|W_row|, times 2
    for rope's two terms and 2 for two evaluations."""
    m = mm.TinyDecoder().eval()
    chain = decoder_chain(1, mm.DIM, mm.HEADS * mm.HEAD_DIM, mm.HEAD_DIM, mm.HIDDEN, mm.MAX_LEN)
    logits = logits_bound(chain, mm.DIM, m.final_norm.detach().numpy(), m.embed.detach().numpy())
    rows = max(float(lin.weight.norm(dim=1).max()) for lin in (m.k, m.v))
    cache = 2 * 2 * gamma(2 * mm.DIM + 3) * np.sqrt(mm.DIM) * float(m.attn_norm.abs().max()) * rows
    return logits, cache


TOL, KV_TOL = _bounds()
CHUNKS = ((0, 5), (5, 1), (6, 4), (10, 17))  # (position, T): prefill, decode, then chunks


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return mm.build_packages(tmp_path_factory.mktemp("mil"))


@pytest.fixture(scope="module")
def paths(built):
    return built["paths"]


def _ids(T, seed):
    return np.random.default_rng(seed).integers(0, mm.VOCAB, size=(1, T), dtype=np.int32)


def _torch(module, *args):
    with torch.no_grad():
        out = module(*args)
    return [o.numpy() for o in out] if isinstance(out, tuple) else out.numpy()


@pytest.mark.parametrize("T", [1, 2, 7, 33, 128])
def test_stateless_matches_torch_for_every_length(paths, T):
    pkg = open_package(paths["stateless"])
    ids = _ids(T, T)
    out = pkg.predict({"ids": ids})["logits"]
    ref = _torch(mm.TinyDecoder().eval(), torch.from_numpy(ids))
    assert out.shape == (1, T, mm.VOCAB) and out.dtype == np.float32
    assert np.abs(out - ref).max() <= TOL


def test_fp16_program_computes_in_fp16(paths):
    """compute_precision=FLOAT16: every activation is rounded to fp16 at each op, as declared.
    Measured |Δ| ~1e-3 of the largest logit, i.e. about one fp16 ulp; allow 3 ulps."""
    pkg = open_package(paths["fp16"])
    assert pkg.spec_outputs["logits"].dtype.name == "fp16"
    for T in (1, 7, 64):
        ids = _ids(T, T)
        out = pkg.predict({"ids": ids})["logits"]
        ref = _torch(mm.TinyDecoder().eval(), torch.from_numpy(ids))
        assert out.dtype == np.float16
        assert np.abs(out - ref).max() <= 3 * 2**-10 * np.abs(ref).max()


def test_kv_variant_matches_torch_chunk_by_chunk(paths):
    pkg = open_package(paths["kv"])
    module = mm.TinyDecoderKV().eval()
    k = v = np.zeros(mm.cache_shape(), np.float32)
    tk, tv = torch.zeros(mm.cache_shape()), torch.zeros(mm.cache_shape())
    for step, (pos, T) in enumerate(CHUNKS):
        ids, position = _ids(T, step), np.array([pos], np.int32)
        out = pkg.predict({"ids": ids, "position": position, "k_cache": k, "v_cache": v})
        logits, tk, tv = (torch.from_numpy(a) for a in _torch(module, torch.from_numpy(ids), torch.from_numpy(position), tk, tv))
        assert np.abs(out["logits"] - logits.numpy()).max() <= TOL
        assert np.abs(out["k_out"] - tk.numpy()).max() <= KV_TOL
        assert np.abs(out["v_out"] - tv.numpy()).max() <= KV_TOL
        k, v = out["k_out"], out["v_out"]
    assert np.count_nonzero(np.abs(k).sum(axis=(0, 1, 3))) == sum(T for _, T in CHUNKS)


def test_stateful_variant_matches_torch_and_keeps_fp16_states(paths):
    pkg = open_package(paths["stateful"])
    module = mm.TinyDecoderStateful().eval()
    state = pkg.make_state()
    assert {name: state.read_state(name).dtype for name in ("k_cache", "v_cache")} == {"k_cache": np.float16, "v_cache": np.float16}
    for step, (pos, T) in enumerate(CHUNKS):
        ids, position = _ids(T, step), np.array([pos], np.int32)
        # Both start each chunk from the package's fp16 state: an entry that float32 summation
        # order rounded to the other fp16 neighbour must not reach later chunks' logits.
        for name in ("k_cache", "v_cache"):
            getattr(module, name).copy_(torch.from_numpy(state.read_state(name)))
        out = pkg.predict({"ids": ids, "position": position}, state=state)["logits"]
        ref = _torch(module, torch.from_numpy(ids), torch.from_numpy(position))
        assert np.abs(out - ref).max() <= TOL
        # Each fp16 entry rounds one of two float32 values KV_TOL apart, each by up to half a
        # step: equal, or a step apart where a value sits next to a rounding boundary.
        for name in ("k_cache", "v_cache"):
            assert _beyond_one_fp16_step(state.read_state(name), getattr(module, name).numpy()) <= KV_TOL


def test_state_snapshot_by_read_and_write_branches_exactly(paths):
    pkg = open_package(paths["stateful"])
    state = pkg.make_state()
    pkg.predict({"ids": _ids(6, 0), "position": np.array([0], np.int32)}, state=state)
    branch = pkg.make_state()
    for name in ("k_cache", "v_cache"):
        branch.write_state(name, state.read_state(name))
    feed = {"ids": _ids(2, 1), "position": np.array([6], np.int32)}
    a = pkg.predict(feed, state=state)["logits"]
    b = pkg.predict(feed, state=branch)["logits"]
    np.testing.assert_array_equal(a, b)
    with pytest.raises(MilError, match="write of shape"):
        branch.write_state("k_cache", np.zeros(3))


def test_run_batch_matches_run_and_refuses_stateful_functions(paths):
    """`run_batch` gives each input set `run`'s outputs: the products of its rows stacked with
    other inputs' differ only in summation order (within TOL / KV_TOL, two float32
    evaluations); a function with states is refused, since each call owns its state."""
    pkg = open_package(paths["kv"])
    rng = np.random.default_rng(3)
    feeds = [{"ids": _ids(T, pos), "position": np.array([pos], np.int32),
              "k_cache": rng.normal(size=mm.cache_shape()).astype(np.float32),
              "v_cache": rng.normal(size=mm.cache_shape()).astype(np.float32)} for pos, T in CHUNKS]
    for got, feed in zip(pkg.predict_batch(feeds), feeds):
        want = pkg.predict(feed)
        assert got.keys() == want.keys() and all(got[k].shape == want[k].shape for k in want)
        assert np.abs(got["logits"] - want["logits"]).max() <= TOL
        assert max(np.abs(got[k] - want[k]).max() for k in ("k_out", "v_out")) <= KV_TOL
    with pytest.raises(MilError, match="without states"):
        open_package(paths["stateful"]).predict_batch([{"ids": _ids(1, 0), "position": np.array([0], np.int32)}])


def test_run_batch_computes_only_the_wanted_rows_of_an_output_made_from_rows(paths):
    """`run_batch(rows=...)`: the head (a constant-weight linear, each logit row a function of its
    hidden row alone) is fed only the wanted rows, in the order asked; they are the full run's
    rows up to the product's summation order (TOL). The caches, made by the same products of the
    same rows either way, are the same bits; an output that is not made from rows alone (a
    cache) is computed whole and its rows selected, the same bits as selecting them by hand."""
    pkg = open_package(paths["kv"])
    executor = pkg.executor
    (head_index, *_), = (executor._row_tails["logits"],)
    assert "k_out" not in executor._row_tails
    head = executor._steps[head_index]
    assert head.op.type == "linear"
    seen = []
    executor._steps[head_index] = replace(head, fn=lambda **kw: seen.append(len(kw["x"])) or head.fn(**kw))
    rng = np.random.default_rng(4)
    feeds = [{"ids": _ids(T, pos), "position": np.array([pos], np.int32),
              "k_cache": rng.normal(size=mm.cache_shape()).astype(np.float32),
              "v_cache": rng.normal(size=mm.cache_shape()).astype(np.float32)} for pos, T in CHUNKS]
    wanted = [{"logits": np.array([4])}, {"logits": np.arange(0)}, {"logits": np.array([3, 0])},
              {"logits": np.arange(17), "k_out": np.array([2, 0])}]
    full = pkg.predict_batch(feeds)
    assert seen == [5 + 1 + 4 + 17]
    got = pkg.predict_batch(feeds, rows=wanted)
    assert seen[1:] == [1 + 0 + 2 + 17]
    for out, everything, rows in zip(got, full, wanted):
        assert out["logits"].shape == (1, len(rows["logits"]), mm.VOCAB)
        assert np.abs(out["logits"] - everything["logits"][:, rows["logits"]]).max(initial=0) <= TOL
        assert np.array_equal(out["v_out"], everything["v_out"])
        want_k = everything["k_out"][..., rows["k_out"], :] if "k_out" in rows else everything["k_out"]
        assert np.array_equal(out["k_out"], want_k)
    # Asked for some outputs alone: the same steps make them, the same bits, and a step that only
    # the others read is not run (the head, when only the caches are asked for).
    for out, everything in zip(pkg.predict_batch(feeds, outputs=["logits"]), full):
        assert out.keys() == {"logits"} and np.array_equal(out["logits"], everything["logits"])
    calls = len(seen)
    for out, everything in zip(pkg.predict_batch(feeds, outputs=["k_out", "v_out"]), full):
        assert out.keys() == {"k_out", "v_out"} and all(np.array_equal(out[k], everything[k]) for k in out)
    assert len(seen) == calls
    with pytest.raises(MilError, match="not among"):
        pkg.predict_batch(feeds, outputs=["logit"])


def test_run_leaves_the_head_for_later_and_finish_rows_makes_many_calls_rows_at_once(paths):
    """`run(rows_later=True)`: the head (an output made from rows alone) is not run; the rows its
    linear reads stand in its place, and the other outputs are the plain run's, the same bits.
    `finish_rows` of one call's rows is that call's logits, the same bits (the same product of
    the same row); of several calls' rows stacked, each row is its call's up to the product's
    summation order (TOL)."""
    pkg = open_package(paths["kv"])
    executor = pkg.executor
    assert pkg.row_outputs == {"logits"}
    (head_index, *_), = (executor._row_tails["logits"],)
    head = executor._steps[head_index]
    seen = []
    executor._steps[head_index] = replace(head, fn=lambda **kw: seen.append(kw["x"].shape) or head.fn(**kw))
    rng = np.random.default_rng(5)
    feeds = [{"ids": _ids(1, pos), "position": np.array([pos], np.int32),
              "k_cache": rng.normal(size=mm.cache_shape()).astype(np.float32),
              "v_cache": rng.normal(size=mm.cache_shape()).astype(np.float32)} for pos in (0, 3, 7, 11)]
    plain = [pkg.predict(feed) for feed in feeds]
    calls = len(seen)
    later = [pkg.predict(feed, rows_later=True) for feed in feeds]
    assert len(seen) == calls
    for out, everything in zip(later, plain):
        assert out.keys() == everything.keys() and out["logits"].shape == (1, 1, mm.DIM)
        assert all(np.array_equal(out[k], everything[k]) for k in ("k_out", "v_out"))
    assert np.array_equal(pkg.finish_rows("logits", later[2]["logits"]), plain[2]["logits"])
    stacked = pkg.finish_rows("logits", np.concatenate([out["logits"] for out in later], axis=-2))
    assert seen[calls + 1:] == [(1, len(feeds), mm.DIM)]  # one product for every call's rows
    assert stacked.shape == (1, len(feeds), mm.VOCAB)
    assert np.abs(stacked - np.concatenate([out["logits"] for out in plain], axis=-2)).max() <= TOL


def test_stateful_package_needs_a_state(paths):
    pkg = open_package(paths["stateful"])
    with pytest.raises(MilError, match="state"):
        pkg.predict({"ids": _ids(3, 0), "position": np.array([0], np.int32)})


def test_multifunction_package_runs_each_function(paths):
    ids = _ids(9, 1)
    prefill = open_package(paths["multi"])
    assert prefill.function_name == "prefill" and set(prefill.functions) == {"prefill", "decode"}
    ref = _torch(mm.TinyDecoder().eval(), torch.from_numpy(ids))
    assert np.abs(prefill.predict({"ids": ids})["logits"] - ref).max() <= TOL

    decode = open_package(paths["multi"], function_name="decode")
    cache = np.zeros(mm.cache_shape(), np.float32)
    out = decode.predict({"ids": ids, "position": np.array([4], np.int32), "k_cache": cache, "v_cache": cache})
    zero = torch.zeros(mm.cache_shape())
    ref = _torch(mm.TinyDecoderKV().eval(), torch.from_numpy(ids), torch.tensor([4], dtype=torch.int32), zero, zero)
    assert np.abs(out["logits"] - ref[0]).max() <= TOL
    sibling = prefill.function("decode")  # the same loaded program, not a second map of the weights
    assert sibling.function_name == "decode" and sibling.program is prefill.program
    inputs = {"ids": ids, "position": np.array([4], np.int32), "k_cache": cache, "v_cache": cache}
    assert np.array_equal(sibling.predict(inputs)["logits"], out["logits"])
    with pytest.raises(MilError, match="no function 'nope'"):
        open_package(paths["multi"], function_name="nope")


@pytest.mark.parametrize("kind", mm.COMPRESSED)
def test_compressed_package_matches_torch_with_decompressed_weights(built, kind):
    weights = built["weights"][kind]
    original = mm.TinyDecoder().eval()
    # The reference weights really are the lossy ones: compare against them, not the originals.
    assert max(np.abs(w - original.state_dict()[_key(original, n)].numpy()).max() for n, w in weights.items()) > 1e-4
    module = mm.with_weights(original, weights)
    pkg = open_package(built["paths"][kind])
    for T in (1, 6, 40):
        ids = _ids(T, T)
        ref = _torch(module, torch.from_numpy(ids))
        assert np.abs(pkg.predict({"ids": ids})["logits"] - ref).max() <= TOL


def _key(module, const_name):
    return next(k for k in module.state_dict() if k.replace(".", "_") == const_name)


def test_compressed_weights_are_decompressed_once_at_load(built, monkeypatch):
    real = OPS["constexpr_blockwise_shift_scale"]
    calls = []
    counted = OpDef(lambda **kw: calls.append(1) or real.fn(**kw), real.lists)
    monkeypatch.setitem(OPS, "constexpr_blockwise_shift_scale", counted)
    pkg = open_package(built["paths"]["int4"])
    assert len(calls) == len(built["weights"]["int4"])  # one per compressed weight
    for T in (1, 4):
        pkg.predict({"ids": _ids(T, T)})
    assert len(calls) == len(built["weights"]["int4"])


def test_unknown_op_fails_by_name(paths, tmp_path):
    from coremltools.proto import Model_pb2

    from coreml.mil.loader import model_path

    bad = tmp_path / "bad.mlpackage"
    shutil.copytree(paths["stateless"], bad)
    spec_file = model_path(bad)
    model = Model_pb2.Model()
    model.ParseFromString(spec_file.read_bytes())
    silu = next(op for op in model.mlProgram.functions["main"].block_specializations["CoreML8"].operations if op.type == "silu")
    silu.type = "frobnicate"
    spec_file.write_bytes(model.SerializeToString())
    with pytest.raises(UnsupportedOp, match=rf"function main, op frobnicate -> {silu.outputs[0].name}: MIL op types \['frobnicate'\]"):
        open_package(bad)


def test_inputs_are_checked_against_the_spec(paths):
    pkg = open_package(paths["stateless"])
    with pytest.raises(MilError, match=r"input 'ids': shape \(1, 129\)"):
        pkg.predict({"ids": _ids(129, 0)})
    with pytest.raises(MilError, match="input 'ids' is missing"):
        pkg.predict({})
    with pytest.raises(MilError, match="input 'ids' has dtype float32"):
        pkg.predict({"ids": np.zeros((1, 3), np.float32)})
    with pytest.raises(MilError, match="unknown inputs"):
        pkg.predict({"ids": _ids(3, 0), "extra": 1})


def test_corrupt_weight_blob_is_named(paths, tmp_path):
    bad = tmp_path / "corrupt.mlpackage"
    shutil.copytree(paths["stateless"], bad)
    weights = bad / "Data" / "com.apple.CoreML" / "weights" / "weight.bin"
    raw = bytearray(weights.read_bytes())
    raw[64:68] = b"\0\0\0\0"  # the first blob_metadata sentinel
    weights.write_bytes(bytes(raw))
    with pytest.raises(MilError, match=r"weight.bin @ 64: blob_metadata.sentinel is 0x0"):
        load_program(bad)


def test_open_package_layouts_and_backends(paths, tmp_path):
    pkg = open_package(paths["stateless"], backend="coreml-executor")
    assert pkg.backend == "coreml-executor" and pkg.manifest is None
    assert list(pkg.spec_inputs) == ["ids"] and list(pkg.spec_outputs) == ["logits"]
    assert pkg.spec_inputs["ids"].ranges == ((1, 1), (1, mm.MAX_LEN))
    folder = tmp_path / "pkg"
    folder.mkdir()
    shutil.copytree(paths["stateless"], folder / "model.mlpackage")
    assert open_package(folder, backend="executor").mlpackage == folder / "model.mlpackage"
    with pytest.raises(PackageError, match="neither an .mlpackage"):
        open_package(tmp_path)
    with pytest.raises(PackageError, match="backend 'tpu'"):
        open_package(folder, backend="tpu")


def test_executor_is_built_per_function_from_a_loaded_program(paths):
    program = load_program(paths["multi"])
    assert program.default_function == "prefill"
    decode = Executor(program, "decode")
    assert [f.name for f in decode.function.spec_outputs] == ["logits", "k_out", "v_out"]


def _stateful_read_cast_slice_program(tmp_path):
    """What coremltools' torch frontend makes of an FP32 stateful step over an fp16 cache of 2
    layers: the state read through one float32 cast of the whole, sliced a layer at a time, and
    written back by a slice_update over all of that cast (torch's `cache[:] = new`)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    from coreml.manifest import save_model

    @mb.program(input_specs=[mb.StateTensorSpec((2, 3, 4), dtype=types.fp16), mb.TensorSpec((3, 4))],
                opset_version=ct.target.iOS18)
    def prog(cache, x):
        wide = mb.cast(x=mb.read_state(input=cache), dtype="fp32")
        layers = [mb.slice_by_index(x=wide, begin=[i, 0, 0], end=[i + 1, 3, 4], squeeze_mask=[True, False, False])
                  for i in range(2)]
        new = mb.stack(values=[mb.add(x=layers[0], y=x), mb.mul(x=layers[1], y=x)], axis=0)
        whole = mb.slice_update(x=wide, update=new, begin=[0, 0, 0], end=[2, 3, 4])
        mb.coreml_update_state(state=cache, value=mb.cast(x=whole, dtype="fp16"))
        return mb.reduce_sum(x=new, axes=[0])

    model = ct.convert(prog, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                       compute_precision=ct.precision.FLOAT32)
    path = tmp_path / "state.mlpackage"
    save_model(model, path)
    return path


def test_a_cast_state_read_by_slices_alone_is_cast_a_slice_at_a_time(tmp_path, monkeypatch):
    """The executor slices the fp16 state and casts each slice (`_slice_before_casts`) and takes a
    slice_update over all of its x as the update (`_whole_updates`): the same values as the
    program's whole-state cast, which an FP32 stateful package at context 8192 held as 378 MB of
    float32 K/V for SmolLM2. That cast is never made."""
    path = _stateful_read_cast_slice_program(tmp_path)
    program = load_program(path)
    operations = program.functions["main"].block.operations
    read = next(name for op in operations if op.type == "read_state" for name, _ in op.outputs)
    whole_cast = next(name for op in operations if op.type == "cast" and op.inputs["x"][0].name == read
                      for name, _ in op.outputs)
    executor = Executor(program)
    made = []
    store = Executor._store
    monkeypatch.setattr(Executor, "_store", staticmethod(
        lambda step, result, env, rows_cut=False: (store(step, result, env, rows_cut),
                                                   made.extend(name for name, _ in step.op.outputs))))
    rng = np.random.default_rng(0)
    start = rng.standard_normal((2, 3, 4)).astype(np.float16)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    state = executor.make_state()
    state.write_state("cache", start)
    (out,) = executor.run({"x": x}, state).values()
    # Equal, not within a bound: each value is one IEEE float32 add or multiply (the sum of two
    # layers one add) and exact casts or one fp16 rounding, correctly rounded on any CPU.
    wide = start.astype(np.float32)
    new = np.stack([wide[0] + x, wide[1] * x])
    np.testing.assert_array_equal(out, new.sum(0))
    np.testing.assert_array_equal(state.read_state("cache"), new.astype(np.float16))
    assert read in made and whole_cast not in made
