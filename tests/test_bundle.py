"""The FP32 bundle: values against the conformance vectors' independent decoding, task
baking against the reference model's own mask path, identity checks, and atomicity."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file

from _hf_models import load_saved, save_hf_model
from pipeline.ground.models.numerics import model_logits_bound
from manifests.identity import MANIFEST_NAME, read_json, write_json
from manifests.schema import validate
from pipeline.ground.bundle_format import verify_bundle
from pipeline.stages.bundle import NonFiniteWeights, export_bundle
from pipeline.ground.cmf import Masks, TaskMask, write_cmf
from pipeline.ground.cmf.skills import add_skill
from pipeline.ground.errors import IdentityError, OutputExists, UnsupportedModel
from pipeline.ground.models import ModelArgs, build_model
from pipeline.ground.models.hf_config import arch_from_hf_config
from pipeline.ground.reference import load_reference

CONFORMANCE = Path("/work/shared/cmf-conformance")
MODEL_CASES = ["model_f32_a", "model_f16_b", "model_q8_row_a", "model_q4_block_c", "model_q8_2f_b",
               "model_vbit_a", "model_masks_tok_a", "model_sharded_a"]  # fmt: skip
IDS = torch.randint(0, 100, (24,), generator=torch.Generator().manual_seed(3))


def _case(case: str) -> tuple[dict, Path, dict[str, np.ndarray]]:
    meta = json.loads((CONFORMANCE / f"{case}.json").read_text())
    with np.load(CONFORMANCE / f"{case}.expected.npz", allow_pickle=False) as npz:
        expected = {name: npz[name] for name in npz.files}
    return meta, CONFORMANCE / meta["open"], expected


@pytest.mark.parametrize("case", MODEL_CASES)
def test_bundle_holds_the_independently_decoded_weights(tmp_path, case):
    meta, cmf, expected = _case(case)
    manifest = export_bundle(cmf, tmp_path / "b")
    weights = load_file(tmp_path / "b" / "weights.safetensors")
    tied = meta["arch"]["tie_word_embeddings"]
    assert set(weights) == set(expected) - ({"lm_head.weight"} if tied else set())
    for name, array in weights.items():
        assert array.dtype == np.float32 and array.shape == expected[name].shape
        assert np.array_equal(array.view(np.uint32), expected[name].view(np.uint32)), name

    data = manifest.data
    validate(data)
    assert data["status"] == "complete" and data["format"] == "cmfdeploy.bundle/1"
    assert data["parameter_count"] == sum(a.size for a in weights.values())
    assert data["tied_head"] is tied and data["architecture"] == json.loads(
        json.dumps(meta["arch"]))
    source = data["source"]
    assert source["header_hash"] == meta["envelope"]["header_hash"]
    assert source["dir_hash"] == meta["envelope"]["dir_hash"]
    assert source["sha256"] == hashlib.sha256(cmf.read_bytes()).hexdigest()
    assert source["bytes"] == cmf.stat().st_size and source["verified_tensors"] == len(meta["tensors"])
    if meta["vocab"] is not None:
        assert data["tokenizer"]["sha256"] == meta["vocab"]["sha256"]
        assert (tmp_path / "b" / "tokenizer.json").read_bytes() == cmf.open("rb").read()[
            meta["envelope"]["vocab_off"]: meta["envelope"]["vocab_off"] + meta["envelope"]["vocab_len"]]
    else:
        assert data["tokenizer"] is None and not (tmp_path / "b" / "tokenizer.json").exists()
    if "shards" in meta:
        assert [s["file"] for s in source["shards"]] == meta["files"]
    assert verify_bundle(tmp_path / "b").data == data


def test_bundle_runs_like_the_cmf_in_the_reference_model(tmp_path):
    export_bundle(CONFORMANCE / "model_masks_tok_a.cmf", tmp_path / "b")
    from_cmf, _, _ = load_reference(CONFORMANCE / "model_masks_tok_a.cmf")
    from_bundle, _, vocab = load_reference(tmp_path / "b")
    with torch.no_grad():
        assert torch.equal(from_cmf(IDS), from_bundle(IDS))
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["tokenizer_config"] == json.loads((tmp_path / "b" / "tokenizer_config.json").read_text())
    assert vocab is not None


def _bits(hex_rows, width):
    rows = np.frombuffer(bytes.fromhex("".join(hex_rows)), np.uint8).reshape(len(hex_rows), -1)
    return np.unpackbits(rows, axis=1, bitorder="little")[:, :width].astype(bool)


@pytest.mark.parametrize("task", ["coding", "sparse-random", 2])
def test_task_is_baked_exactly(tmp_path, task):
    """Expected weights come from the vectors' own mask hex; expected logits from the
    reference model applying the mask at run time (its own implementation of §5)."""
    meta, cmf, expected = _case("model_masks_tok_a")
    manifest = export_bundle(cmf, tmp_path / "b", task=task)
    decoded = next(t for t in meta["masks"]["decoded"] if task in (t["name"], t["task_id"]))
    arch = meta["arch"]
    ffn = _bits(decoded["ffn_masks_hex"], arch["intermediate_size"])
    heads = _bits(decoded["head_masks_hex"], arch["num_attention_heads"])
    want = dict(expected)
    for layer, gate in enumerate(decoded["layer_gates"]):
        down, o_proj = f"model.layers.{layer}.mlp.down_proj.weight", f"model.layers.{layer}.self_attn.o_proj.weight"
        keep_down = ffn[layer] if gate else np.zeros_like(ffn[layer])
        keep_heads = np.repeat(heads[layer], arch["head_dim"]) if gate else np.zeros(arch["hidden_size"], bool)
        want[down] = np.where(keep_down, expected[down], 0)
        want[o_proj] = np.where(keep_heads, expected[o_proj], 0)
    got = load_file(tmp_path / "b" / "weights.safetensors")
    for name in got:
        assert np.array_equal(got[name], want[name]), name

    applied = manifest["applied"]["task"]
    assert applied["name"] == decoded["name"] and applied["task_id"] == decoded["task_id"]
    assert applied["inactive_layers"] == [i for i, g in enumerate(decoded["layer_gates"]) if not g]
    open_layers = np.array(decoded["layer_gates"])
    assert applied["inactive_ffn_neurons"] == int((~ffn[open_layers]).sum())

    with pytest.warns(UserWarning):  # tasks without measured quality warn in the reference loader
        masked, _, _ = load_reference(cmf, task=task)
    baked, _, _ = load_reference(tmp_path / "b")
    with torch.no_grad():
        # Zeroed weights vs masked activations: other sums of the same terms (pipeline/ground/models/numerics.py).
        torch.testing.assert_close(baked(IDS), masked(IDS), rtol=0, atol=model_logits_bound(masked, len(IDS)))


def _hf(tmp_path, family, **overrides):
    save_hf_model(family, tmp_path / "hf", seed=4, **overrides)
    config, weights = load_saved(tmp_path / "hf")
    arch, moe = arch_from_hf_config(config)
    return arch, moe, {name: t.numpy() for name, t in weights.items()}


def _task_mask(arch, moe=None, gates=None, experts=None):
    layers = arch["num_layers"]
    return TaskMask(
        meta={"task_id": 0, "name": "t", "quality": None},
        ffn=np.ones((layers, arch["intermediate_size"]), bool),
        heads=np.ones((layers, arch["num_attention_heads"]), bool),
        layer_gates=np.ones(layers, bool) if gates is None else gates,
        experts=experts if experts is not None else (None if moe is None else np.ones((layers, moe["num_experts"]), bool)),
    )


def test_a_gated_moe_layer_with_shared_expert_passes_through(tmp_path):
    arch, moe, weights = _hf(tmp_path, "qwen2_moe", num_hidden_layers=3)
    mask = _task_mask(arch, moe, gates=np.array([True, False, True]))
    write_cmf(tmp_path / "m.cmf", arch=arch, moe=moe, tensors=[(n, w, "f32") for n, w in weights.items()],
              masks=Masks(default_task="t", tasks=[mask]))
    export_bundle(tmp_path / "m.cmf", tmp_path / "b", task="t")
    baked = load_file(tmp_path / "b" / "weights.safetensors")
    args = ModelArgs.from_header({"arch": arch, "moe": moe})
    with torch.no_grad():
        model = build_model(args, weights, mask)
        want = model(IDS)
        torch.testing.assert_close(build_model(args, baked)(IDS), want, rtol=0, atol=model_logits_bound(model, len(IDS)))
    zeroed = [n for n in baked if n.startswith("model.layers.1.") and not baked[n].any()]
    assert "model.layers.1.mlp.shared_expert.down_proj.weight" in zeroed
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in zeroed and "model.layers.1.self_attn.o_proj.weight" in zeroed


def test_restricted_expert_routing_is_refused(tmp_path):
    arch, moe, weights = _hf(tmp_path, "qwen3_moe")
    experts = np.ones((arch["num_layers"], moe["num_experts"]), bool)
    experts[0, 2] = False
    write_cmf(tmp_path / "m.cmf", arch=arch, moe=moe, tensors=[(n, w, "f16") for n, w in weights.items()],
              masks=Masks(default_task="t", tasks=[_task_mask(arch, moe, experts=experts)]))
    with pytest.raises(UnsupportedModel, match="restricts expert routing"):
        export_bundle(tmp_path / "m.cmf", tmp_path / "b", task="t")
    assert not (tmp_path / "b").exists()


@pytest.fixture
def dense(tmp_path):
    arch, _, weights = _hf(tmp_path, "qwen3", tie_word_embeddings=False)
    return arch, weights


def test_skill_tensors_replace_the_base(tmp_path, dense):
    arch, weights = dense
    write_cmf(tmp_path / "m.cmf", arch=arch, tensors=[(n, w, "f32") for n, w in weights.items()])
    new = {n: weights[n] + 1.0 for n in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight")}
    add_skill(tmp_path / "m.cmf", {"id": "code", "name": "Code"}, [(n, w, "f32") for n, w in new.items()])
    manifest = export_bundle(tmp_path / "m.cmf", tmp_path / "b", skill="code")
    got = load_file(tmp_path / "b" / "weights.safetensors")
    assert set(got) == set(weights)  # skill entries are not bundled under their own names
    for name in weights:
        assert np.array_equal(got[name], new.get(name, weights[name])), name
    assert manifest["applied"]["skill"] == {"id": "code", "name": "Code", "replaced_tensors": sorted(new)}


def test_an_explicit_tied_head_is_stored_once_or_refused(tmp_path, dense):
    arch, weights = dense
    arch = {**arch, "tie_word_embeddings": True}
    tensors = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    write_cmf(tmp_path / "same.cmf", arch=arch, tensors=[(n, w, "f32") for n, w in tensors.items()])
    export_bundle(tmp_path / "same.cmf", tmp_path / "b")
    with safe_open(tmp_path / "b" / "weights.safetensors", "np") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()

    tensors["lm_head.weight"] = weights["model.embed_tokens.weight"] * 2
    write_cmf(tmp_path / "differs.cmf", arch=arch, tensors=[(n, w, "f32") for n, w in tensors.items()])
    with pytest.raises(UnsupportedModel, match="tie_word_embeddings is true but 'lm_head.weight' differs"):
        export_bundle(tmp_path / "differs.cmf", tmp_path / "b2")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_by_tensor_and_index(tmp_path, dense, bad):
    arch, weights = dense
    broken = weights["model.layers.1.mlp.up_proj.weight"].copy()
    broken[5, 7] = bad
    tensors = {**weights, "model.layers.1.mlp.up_proj.weight": broken}
    write_cmf(tmp_path / "m.cmf", arch=arch, tensors=[(n, w, "f32") for n, w in tensors.items()])
    with pytest.raises(NonFiniteWeights, match=r"'model.layers.1.mlp.up_proj.weight' holds .* at index \[5, 7\]"):
        export_bundle(tmp_path / "m.cmf", tmp_path / "b")
    assert sorted(os.listdir(tmp_path)) == ["hf", "m.cmf"]  # no output, no temp folder left behind


def test_a_file_that_fails_verification_is_refused_naming_each_failure(tmp_path):
    meta = json.loads((CONFORMANCE / "corrupt_payload_flip_a.json").read_text())
    names = [f["name"] for f in meta["expect"]["verify_failures"]]
    with pytest.raises(IdentityError, match="fails verification") as error:
        export_bundle(CONFORMANCE / "corrupt_payload_flip_a.cmf", tmp_path / "b")
    assert names and all(f"'{name}'" in str(error.value) for name in names)


def test_existing_output_needs_force(tmp_path):
    cmf = CONFORMANCE / "model_q8_row_a.cmf"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "old.txt").write_text("old")
    with pytest.raises(OutputExists, match="already exists"):
        export_bundle(cmf, tmp_path / "b")
    assert (tmp_path / "b" / "old.txt").exists()
    export_bundle(cmf, tmp_path / "b", force=True)
    verify_bundle(tmp_path / "b")
    assert sorted(os.listdir(tmp_path)) == ["b"]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    path = tmp_path_factory.mktemp("bundle") / "b"
    export_bundle(CONFORMANCE / "model_masks_tok_a.cmf", path)
    return path


def _tampered(bundle, tmp_path, edit) -> Path:
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(bundle):
        (copy / name).write_bytes((bundle / name).read_bytes())
    edit(copy)
    return copy


def _flip_last_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "edit, message",
    [(lambda b: _flip_last_byte(b / "weights.safetensors"), "'weights.safetensors' has sha256"),
     (lambda b: (b / "config.json").write_text("{}"), "'config.json' has 2 bytes"),
     (lambda b: (b / "notes.txt").write_text("hi"), "unexpected file 'notes.txt'"),
     (lambda b: (b / "tokenizer.json").unlink(), "'tokenizer.json' listed in the manifest is missing"),
     (lambda b: write_json(b / MANIFEST_NAME, {**read_json(b / MANIFEST_NAME), "status": "incomplete"}),
      "'status' is 'incomplete': the artifact was not finished"),
     (lambda b: write_json(b / MANIFEST_NAME, {**read_json(b / MANIFEST_NAME), "format": "cmfdeploy.bundle/2"}),
      "field 'format' is 'cmfdeploy.bundle/2', expected 'cmfdeploy.bundle/1'"),
     (lambda b: (b / MANIFEST_NAME).unlink(), "manifest.json: file not found")],
    ids=["weights-byte", "config-size", "extra-file", "missing-file", "incomplete", "unknown-format", "no-manifest"],
)
def test_verify_bundle_names_what_is_wrong(bundle, tmp_path, edit, message):
    with pytest.raises(IdentityError, match=message):
        verify_bundle(_tampered(bundle, tmp_path, edit))


def test_verify_bundle_without_hashes_checks_sizes_only(bundle, tmp_path):
    copy = _tampered(bundle, tmp_path, lambda b: _flip_last_byte(b / "weights.safetensors"))
    verify_bundle(copy, hashes=False)


_EXPORT = """
import sys
from pipeline.stages.bundle import export_bundle
export_bundle(sys.argv[1], sys.argv[2])
"""


def test_a_killed_export_leaves_nothing_that_looks_complete(tmp_path):
    """SIGKILL while weights.safetensors is being written: the output name never appears,
    and the temp folder left behind says it is incomplete and fails verification."""
    rng = np.random.default_rng(0)
    tensors = [(f"model.layers.0.t{i}.weight", rng.standard_normal((512, 512), np.float32), "f32") for i in range(64)]
    arch = {"arch_name": "llama", "hidden_size": 512, "num_layers": 1, "vocab_size": 512,
            "tie_word_embeddings": True, "intermediate_size": 512, "num_attention_heads": 8,
            "num_kv_heads": 8, "head_dim": 64}  # fmt: skip
    write_cmf(tmp_path / "m.cmf", arch=arch, tensors=[("model.embed_tokens.weight", tensors[0][1], "f32"), *tensors])
    full_size = 4 * 512 * 512 * 65
    out = tmp_path / "out" / "b"
    out.parent.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _EXPORT, str(tmp_path / "m.cmf"), str(out)],
                             cwd=Path(__file__).parent.parent)
    weights_size = 0
    deadline = time.monotonic() + 60
    while weights_size == 0 and time.monotonic() < deadline and child.poll() is None:
        partial = list(out.parent.glob(".b.*.partial/weights.safetensors"))
        weights_size = partial[0].stat().st_size if partial else 0
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert 0 < weights_size < full_size, "the kill did not land while the weights were being written"

    assert not out.exists()
    (leftover,) = out.parent.glob(".b.*.partial")
    # Besides it only the killed run's lock file, which no process holds any more.
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([leftover.name, ".b.lock"])
    assert read_json(leftover / MANIFEST_NAME)["status"] == "incomplete"
    assert (leftover / "weights.safetensors").stat().st_size < full_size + 8
    with pytest.raises(IdentityError, match="not finished"):
        verify_bundle(leftover)


def test_cli_bundle_and_verify_artifact(tmp_path, capsys):
    from pipeline.cli import main

    cmf = CONFORMANCE / "model_masks_tok_a.cmf"
    assert main(["bundle", str(cmf), "-o", str(tmp_path / "b"), "--task", "coding"]) == 0
    assert main(["verify-artifact", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-3:] == [f"cmfdeploy.bundle/1 {tmp_path / 'b'}: verified",
                        "  checked: 4 files by sha256; the tokenizer record against tokenizer.json", f"cmf {cmf}: verified"]
    _flip_last_byte(tmp_path / "b" / "weights.safetensors")
    assert main(["verify-artifact", str(tmp_path / "b")]) == 1
    assert capsys.readouterr().err.startswith("IdentityError: ")
