"""Task masks and skills against explicitly edited dense models.

A masked model must equal a dense one whose weights were changed by hand to mean the same
thing: inactive neurons and heads as zeroed down_proj / o_proj columns, a gated-off layer
as a model without that layer, restricted experts as a model holding only those experts,
a skill as the base with the replaced tensors swapped in.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from _hf_models import load_saved, save_hf_model
from pipeline.ground.models.numerics import gamma, model_logits_bound
from pipeline.ground.cmf import write_cmf
from pipeline.ground.cmf.masks import TaskMask
from pipeline.ground.cmf.skills import add_skill, export_skill_file
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models import ModelArgs, MoeArgs, build_model
from pipeline.ground.models.errors import ModelConfigError
from pipeline.ground.models.hf_config import arch_from_hf_config
from pipeline.ground.reference import load_reference, skill_blend_weights

CONFORMANCE = Path("/work/shared/cmf-conformance")


def _saved(tmp_path_factory, family, **overrides):
    directory = tmp_path_factory.mktemp(family)
    save_hf_model(family, directory, seed=11, **overrides)
    config, weights = load_saved(directory)
    arch, moe = arch_from_hf_config(config)
    return {"arch": arch, "moe": moe}, {name: t.numpy() for name, t in weights.items()}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _saved(tmp_path_factory, "qwen3", num_hidden_layers=3, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _saved(tmp_path_factory, "qwen3_moe", norm_topk_prob=True)


IDS = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _logits(header, weights, mask=None, ids=IDS):
    return build_model(ModelArgs.from_header(header), weights, mask)(ids)


def _mask(args, ffn=None, heads=None, gates=None, experts=None):
    return TaskMask(
        meta={"name": "t", "task_id": 0, "quality": None},
        ffn=np.ones((args.num_layers, args.intermediate_size), bool) if ffn is None else ffn,
        heads=np.ones((args.num_layers, args.num_attention_heads), bool) if heads is None else heads,
        layer_gates=np.ones(args.num_layers, bool) if gates is None else gates,
        experts=experts,
    )


def _assert_close(got, expected, header, weights, weight_rtol=0.0):
    """Two float32 evaluations of one function (other shapes, so other kernels and sums):
    within the derived bound of pipeline/ground/models/numerics.py for the model `header`/`weights` builds."""
    model = build_model(ModelArgs.from_header(header), weights)
    assert (got - expected).abs().max().item() <= model_logits_bound(model, len(got), weight_rtol=weight_rtol)


def test_inactive_neurons_and_heads_contribute_nothing(dense):
    header, weights = dense
    args = ModelArgs.from_header(header)
    rng = np.random.default_rng(0)
    ffn = rng.random((args.num_layers, args.intermediate_size)) < 0.5
    heads = np.array([[True, False, True, True], [False, True, True, False], [True, True, True, True]])
    edited = dict(weights)
    for i in range(args.num_layers):
        down = weights[f"model.layers.{i}.mlp.down_proj.weight"].copy()
        down[:, ~ffn[i]] = 0
        edited[f"model.layers.{i}.mlp.down_proj.weight"] = down
        o_proj = weights[f"model.layers.{i}.self_attn.o_proj.weight"].copy()
        o_proj[:, ~np.repeat(heads[i], args.head_dim)] = 0
        edited[f"model.layers.{i}.self_attn.o_proj.weight"] = o_proj
    masked = _logits(header, weights, _mask(args, ffn=ffn, heads=heads))
    _assert_close(masked, _logits(header, edited), header, weights)
    assert (masked - _logits(header, weights)).abs().max().item() > 0.1  # the mask did something


def test_a_gated_off_layer_is_a_model_without_it(dense):
    header, weights = dense
    args = ModelArgs.from_header(header)
    kept = {0: 0, 2: 1}
    shorter = {k: v for k, v in weights.items() if not k.startswith("model.layers.")}
    for name, value in weights.items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index in kept:
                shorter[name.replace(f"layers.{index}.", f"layers.{kept[index]}.", 1)] = value
    arch = {**header["arch"], "num_layers": 2, "layer_types": header["arch"]["layer_types"][:2]}
    gates = np.array([True, False, True])
    _assert_close(_logits(header, weights, _mask(args, gates=gates)), _logits({"arch": arch}, shorter), header, weights)


def _defragged(header, weights, keep):
    """The MoE model holding only experts `keep` (renumbered), as an expert-defragmented file would."""
    out = {}
    for name, value in weights.items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            expert = int(parts[5])
            if expert in keep:
                parts[5] = str(keep.index(expert))
                out[".".join(parts)] = value
        elif name.endswith("mlp.gate.weight"):
            out[name] = value[keep]
        else:
            out[name] = value
    return {**header, "moe": {**header["moe"], "num_experts": len(keep)}}, out


@pytest.mark.parametrize("keep", [[0, 2, 3, 5], [4]], ids=["four-of-six", "one-below-top-k"])
def test_expert_bits_restrict_and_renormalise_routing(moe, keep):
    header, weights = moe
    args = ModelArgs.from_header(header)
    experts = np.zeros((args.num_layers, args.moe.num_experts), bool)
    experts[:, keep] = True
    masked = _logits(header, weights, _mask(args, experts=experts))
    _assert_close(masked, _logits(*_defragged(header, weights, keep)), header, weights)


def test_router_ties_go_to_the_lower_expert_index(moe):
    """A zero router gives every expert the same weight: the first top_k experts must win."""
    header, weights = moe
    args = ModelArgs.from_header(header)
    flat = {n: (np.zeros_like(w) if n.endswith("mlp.gate.weight") else w) for n, w in weights.items()}
    _assert_close(_logits(header, flat), _logits(*_defragged(header, flat, list(range(args.moe.top_k)))), header, flat)


def test_ffn_bits_on_a_router_layer_are_refused(moe):
    header, weights = moe
    args = ModelArgs.from_header(header)
    ffn = np.ones((args.num_layers, args.intermediate_size), bool)
    ffn[1, 3] = False
    with pytest.raises(UnsupportedModel, match="FFN neurons of MoE layer 1"):
        build_model(args, weights, _mask(args, ffn=ffn))


# -- CMF files: a conformance model with masks, and skills written by pipeline.ground.cmf


def _bits(hex_rows, width):
    rows = np.frombuffer(bytes.fromhex("".join(hex_rows)), np.uint8).reshape(len(hex_rows), -1)
    return np.unpackbits(rows, axis=1, bitorder="little")[:, :width].astype(bool)


def test_conformance_task_mask_matches_hand_zeroed_weights():
    """model_masks_tok_a's "sparse-random" task (heads, neurons and a gated-off layer 1),
    with the bits decoded here from the vectors' own hex, not by pipeline.ground.cmf."""
    case = json.loads((CONFORMANCE / "model_masks_tok_a.json").read_text())
    task = next(t for t in case["masks"]["decoded"] if t["name"] == "sparse-random")
    with np.load(CONFORMANCE / "model_masks_tok_a.expected.npz", allow_pickle=False) as npz:
        weights = {name: npz[name] for name in npz.files}
    arch = case["arch"]
    ffn = _bits(task["ffn_masks_hex"], arch["intermediate_size"])
    heads = _bits(task["head_masks_hex"], arch["num_attention_heads"])
    assert task["layer_gates"] == [True, False]
    edited = dict(weights)
    down = weights["model.layers.0.mlp.down_proj.weight"].copy()
    down[:, ~ffn[0]] = 0
    o_proj = weights["model.layers.0.self_attn.o_proj.weight"].copy()
    o_proj[:, ~np.repeat(heads[0], arch["head_dim"])] = 0
    edited.update({"model.layers.0.mlp.down_proj.weight": down, "model.layers.0.self_attn.o_proj.weight": o_proj})
    one_layer = {k: v for k, v in edited.items() if not k.startswith("model.layers.1.")}
    ids = IDS % arch["vocab_size"]
    expected = _logits({"arch": {**arch, "num_layers": 1, "layer_types": ["FullAttention"]}}, one_layer, ids=ids)

    with pytest.warns(UserWarning, match="no measured quality"):
        model, args, vocab = load_reference(CONFORMANCE / "model_masks_tok_a.cmf", task="sparse-random")
    with torch.no_grad():
        _assert_close(model(ids), expected, {"arch": arch}, weights)
    assert vocab is not None and json.loads(vocab)


def test_unknown_task_is_a_typed_error():
    with pytest.raises(ModelConfigError, match="nope"):
        load_reference(CONFORMANCE / "model_masks_tok_a.cmf", task="nope")


SKILLS = {
    "math": ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"),
    "code": ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight"),
}


@pytest.fixture(scope="module")
def skilled(dense, tmp_path_factory):
    """A CMF of the dense model plus two skills, each replacing two tensors with new values."""
    header, weights = dense
    path = tmp_path_factory.mktemp("skills") / "model.cmf"
    write_cmf(path, arch=header["arch"], tensors=[(n, w, "f32") for n, w in weights.items()])
    rng = np.random.default_rng(3)
    replaced = {}
    for skill_id, names in SKILLS.items():
        replaced[skill_id] = {n: rng.standard_normal(weights[n].shape).astype(np.float32) * 0.1 for n in names}
        add_skill(path, {"id": skill_id, "name": skill_id}, [(n, w, "f32") for n, w in replaced[skill_id].items()])
    return path, header, weights, replaced


def test_a_skill_replaces_exactly_its_tensors(skilled):
    path, header, weights, replaced = skilled
    model, _, _ = load_reference(path, skill="math")
    with torch.no_grad():
        _assert_close(model(IDS), _logits(header, {**weights, **replaced["math"]}), header, weights)
        base, _, _ = load_reference(path)
        _assert_close(base(IDS), _logits(header, weights), header, weights)


def test_a_soft_blend_mixes_skills_by_softmax_of_negative_energy(skilled):
    path, header, weights, replaced = skilled
    energies, temperature = {"math": 0.2, "code": 1.1, "base": 0.7}, 0.5
    raw = {k: np.exp(-e / temperature) for k, e in energies.items()}
    w = {k: v / sum(raw.values()) for k, v in raw.items()}
    np.testing.assert_allclose(skill_blend_weights(list(energies.values()), temperature), list(w.values()))
    blended = dict(weights)
    for name in {n for names in SKILLS.values() for n in names}:
        blended[name] = sum(w[k] * replaced.get(k, {}).get(name, weights[name]) for k in energies)
    model, _, _ = load_reference(path, blend=energies, temperature=temperature)
    with torch.no_grad():
        # Both blend three float32 terms, in their own order: gamma_3 each of the members' size.
        _assert_close(model(IDS), _logits(header, blended), header, blended, weight_rtol=2 * gamma(3))


def test_a_skill_file_is_never_run_on_its_own(skilled, tmp_path):
    path = skilled[0]
    skill_file = export_skill_file(path, "math", tmp_path / "math.cmf")
    with pytest.raises(UnsupportedModel, match="skill file .* never runs on its own"):
        load_reference(skill_file)


# -- refusals


def test_linear_attention_layers_are_refused_by_name(dense):
    header, weights = dense
    arch = {**header["arch"], "layer_types": ["FullAttention", "LinearAttention", "FullAttention"]}
    with pytest.raises(UnsupportedModel, match="layer 1 has layer type 'LinearAttention'"):
        build_model(ModelArgs.from_header({"arch": arch}), weights)


def test_missing_rope_theta_is_never_defaulted(dense):
    header, _ = dense
    arch = {k: v for k, v in header["arch"].items() if k != "rope_theta"}
    with pytest.raises(ModelConfigError, match="arch.rope_theta is missing"):
        ModelArgs.from_header({"arch": arch}, source="x.cmf")
    with pytest.raises(ModelConfigError, match="rope_theta is missing"):
        arch_from_hf_config({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 1,
                             "hidden_size": 8, "hidden_act": "silu", "intermediate_size": 8, "vocab_size": 8,
                             "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 8,
                             "rope_parameters": {"rope_type": "default"}})


def test_an_unrecognised_tensor_is_refused(dense):
    header, weights = dense
    extra = {**weights, "model.layers.0.self_attn.sinks": np.zeros(4, np.float32)}
    with pytest.raises(UnsupportedModel, match="self_attn.sinks"):
        build_model(ModelArgs.from_header(header), extra)


def test_moe_args_from_a_header_nested_or_top_level(moe):
    header, _ = moe
    nested = {"arch": {**header["arch"], "moe": header["moe"]}}
    assert ModelArgs.from_header(nested).moe == ModelArgs.from_header(header).moe == MoeArgs(
        num_experts=6, top_k=2, moe_intermediate_size=32, norm_topk_prob=True)
