"""Gemma 3 into CMF: import-gguf on the real 270M Q4_K_M file and on small gemma3 GGUFs
written here, import-hf on a small random Gemma3ForCausalLM; each against transformers
reading the same file: tensors bit for bit, the arch block, token ids. Every refusal names
what it refused."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, RopeScalingType
from safetensors.torch import load_file

from _gguf_peers import held_out_text, transformers_model, transformers_tokenizer
from _hf_models import rewrite_config, save_hf_model
from pipeline.cli import main
from pipeline.ground.cmf import open_cmf
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models.errors import ModelConfigError
from pipeline.ground.models.hf_config import arch_from_hf_config
from pipeline.ground.tokenizer import tokenizer_from_artifact
from pipeline.stages.importers.gguf import import_gguf
from pipeline.stages.importers.hf import import_hf
from pipeline.stages.importers.quant_policy import QuantPolicy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SLIDING, FULL = "SlidingAttention", "FullAttention"
# A Gemma 3 layer's norms, GGUF name -> HF name; llama.cpp's converter stores each as 1 + w.
NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
         "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
MIXED_TEXT = "<start_of_turn>the and  in\n\nhéllo   then 🙂 <unk>"


def _assert_tensors_equal(cmf_path: Path, state: dict) -> None:
    with open_cmf(cmf_path) as cmf:
        assert set(cmf.tensors) == set(state) - {"lm_head.weight"}  # tied: transformers shares it
        for name in cmf.tensors:
            assert np.array_equal(cmf.decode(name), state[name].numpy()), name


# -- the real file: Gemma 3 270M, Q4_K_M


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_gguf):
    """transformers' Gemma3ForCausalLM read from the same GGUF (~45 s to load): the peer."""
    return transformers_model(gemma3_gguf.parent, gemma3_gguf.name)


@pytest.mark.slow
def test_real_gguf_tensors_equal_transformers_gguf_loader(gemma3_cmf, hf_gemma3):
    """Dequantized Q4_K/Q5_0/Q6_K/Q8_0/F32, the name mapping and the norms' 1 + w undone, bit for bit."""
    hf_model = hf_gemma3
    _assert_tensors_equal(gemma3_cmf, hf_model.state_dict())
    with open_cmf(gemma3_cmf) as cmf:
        assert cmf.header["provenance"]["ggml_types"] == {"F32": 109, "Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}
        assert {info.dtype.name for info in cmf.tensors.values()} == {"f32"}
        # transformers' config from the same file maps to the same arch block.
        assert cmf.arch == arch_from_hf_config(hf_model.config.to_dict())[0]


@pytest.mark.slow
def test_real_model_logits_equal_transformers_past_the_window(gemma3_cmf, hf_gemma3):
    """The reference decoder on the real 270M weights against transformers on the same weights,
    600 held-out tokens (past the 512-token sliding window), within the worst case of two
    float32 evaluations of this model (`model_logits_bound`)."""
    from pipeline.ground.models.numerics import model_logits_bound
    from pipeline.ground.reference import load_reference

    ids = tokenizer_from_artifact(gemma3_cmf).encode(held_out_text(), add_bos=True)[:600]
    assert len(ids) == 600
    model, _, _ = load_reference(gemma3_cmf)
    with torch.no_grad():
        ours = model(torch.from_numpy(ids))
        theirs = hf_gemma3(torch.from_numpy(ids)[None]).logits[0]
    assert (ours - theirs).abs().max().item() <= model_logits_bound(model, len(ids))


@pytest.mark.slow
def test_real_model_on_mlx_equals_transformers_past_the_window(gemma3_cmf, hf_gemma3):
    """The MLX runtime on the f32 CMF against transformers on the same GGUF: 600 held-out
    tokens, within the same bound as the reference decoder."""
    from mlx_runtime.backend import MlxBackend
    from pipeline.ground.models.numerics import model_logits_bound
    from pipeline.ground.reference import load_reference

    ids = tokenizer_from_artifact(gemma3_cmf).encode(held_out_text(), add_bos=True)[:600]
    model, _, _ = load_reference(gemma3_cmf)
    bound = model_logits_bound(model, len(ids))
    del model
    ours = MlxBackend(gemma3_cmf).logits(ids)
    with torch.no_grad():
        theirs = hf_gemma3(torch.from_numpy(ids)[None]).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= bound


@pytest.mark.slow
def test_real_gguf_arch_block(gemma3_cmf):
    with open_cmf(gemma3_cmf) as cmf:
        arch = dict(cmf.arch)
    assert arch.pop("layer_types") == ([SLIDING] * 5 + [FULL]) * 3
    assert arch == {
        "arch_name": "gemma3", "hidden_size": 640, "intermediate_size": 2048, "num_layers": 18,
        "num_attention_heads": 4, "num_kv_heads": 1, "head_dim": 256, "vocab_size": 262144,
        "rms_norm_eps": float(np.float32(1e-6)), "norm_style": "gemma", "rope_theta": 1e6,
        "tie_word_embeddings": True, "max_position_embeddings": 32768, "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": 512, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256,
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }


@pytest.mark.slow
def test_real_gguf_tokenizer_encodes_held_out_text_as_transformers(gemma3_cmf, gemma3_gguf):
    theirs = transformers_tokenizer(gemma3_gguf.parent, gemma3_gguf.name)
    ours = tokenizer_from_artifact(gemma3_cmf)
    assert (ours.bos_id, ours.eos_ids, ours.pad_id, ours.vocab_size) == (2, (1,), 0, 262144)
    for text in (held_out_text(), MIXED_TEXT):
        ids = ours.encode(text, add_bos=True).tolist()
        assert ids == theirs(text).input_ids  # transformers adds BOS: add_bos_token is true
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    held_out = held_out_text()
    assert ours.decode(ours.encode(held_out)) == held_out


@pytest.mark.slow
def test_real_gguf_cmf_verifies(gemma3_cmf, capsys):
    assert main(["verify", str(gemma3_cmf)]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {gemma3_cmf.name}: ")


# -- small gemma3 GGUFs written here


# (token, GGUF token type): control 3, user-defined 4, byte 6, normal 1. Runs of spaces are
# stored as spaces, as in Gemma's file; the merges come from the order of the pieces.
VOCAB = ([("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 3), ("<mask>", 3), ("<start_of_turn>", 3),
          ("\n", 4), ("\n\n", 4), ("  ", 4), ("   ", 4)] + [(f"<0x{b:02X}>", 6) for b in range(256)]
         + [(t, 1) for t in ("▁", "t", "h", "e", "a", "n", "d", "i", "l", "o", "é", "▁t", "he", "▁the", "an",
                             "▁an", "▁and", "in", "▁in", "ll", "lo", "llo", "▁h", "▁hé", "▁then", "en")])


def _k_quant_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random Q4_K or Q6_K blocks with finite scales (gguf-py quantizes no K type)."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for at in {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[qtype]:  # d (and dmin) of each block
        raw[..., at:at + 2] = scale
    return raw.reshape(rows, -1)


def _write_gemma3_gguf(path: Path, layers: int = 7, hidden: int = 256, heads: int = 2, head_dim: int = 128,
                       metadata: dict | None = None,
                       drop: tuple[str, ...] = (), retype: dict | None = None) -> None:
    """A gemma3 GGUF in llama.cpp's layout: norms stored as 1 + w, q/k unpermuted, the 270M
    file's tensor types (K-quants where the widths are multiples of 256), a SentencePiece
    vocabulary. `metadata` adds or replaces keys ({key: (writer method, value)}); `drop` removes them;
    `retype` stores tensors as another GGML type ({tensor name: type}; I8 as int8 values)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    inter, kv = 2 * hidden, 1
    k_quants = hidden % 256 == 0
    keys = {
        "gemma3.block_count": ("add_block_count", layers), "gemma3.context_length": ("add_context_length", 128),
        "gemma3.embedding_length": ("add_embedding_length", hidden),
        "gemma3.feed_forward_length": ("add_feed_forward_length", inter),
        "gemma3.attention.head_count": ("add_head_count", heads), "gemma3.attention.head_count_kv": ("add_head_count_kv", kv),
        "gemma3.attention.key_length": ("add_key_length", head_dim),
        "gemma3.attention.value_length": ("add_value_length", head_dim),
        "gemma3.rope.freq_base": ("add_rope_freq_base", 1e6), "gemma3.attention.sliding_window": ("add_sliding_window", 8),
        "gemma3.attention.layer_norm_rms_epsilon": ("add_layer_norm_rms_eps", 1e-6),
        "tokenizer.ggml.model": ("add_tokenizer_model", "llama"), "tokenizer.ggml.pre": ("add_tokenizer_pre", "default"),
        "tokenizer.ggml.tokens": ("add_token_list", [t for t, _ in VOCAB]),
        "tokenizer.ggml.scores": ("add_token_scores", [-float(i) for i in range(len(VOCAB))]),
        "tokenizer.ggml.token_type": ("add_token_types", [kind for _, kind in VOCAB]),
        "tokenizer.ggml.bos_token_id": ("add_bos_token_id", 2), "tokenizer.ggml.eos_token_id": ("add_eos_token_id", 1),
        "tokenizer.ggml.unknown_token_id": ("add_unk_token_id", 3), "tokenizer.ggml.padding_token_id": ("add_pad_token_id", 0),
        "tokenizer.ggml.add_bos_token": ("add_add_bos_token", True), "tokenizer.ggml.add_eos_token": ("add_add_eos_token", False),
        "tokenizer.ggml.add_space_prefix": ("add_add_space_prefix", False),
        **(metadata or {}),
    }  # fmt: skip
    writer = GGUFWriter(path, "gemma3")
    for key, (method, value) in keys.items():
        if key not in drop:
            getattr(writer, method)(value)

    rng = np.random.default_rng(3)

    def add(name, shape, qtype):
        qtype = (retype or {}).get(name, qtype)
        if qtype == Q.I8:
            writer.add_tensor(name, rng.integers(-8, 8, shape, dtype=np.int8), raw_dtype=Q.I8)
        elif qtype in (Q.Q4_K, Q.Q6_K):
            writer.add_tensor(name, _k_quant_blocks(*shape, qtype, rng), raw_dtype=qtype)
        elif qtype == Q.F32:  # a norm: 1 + w, w around 0
            writer.add_tensor(name, (1 + 0.2 * rng.standard_normal(shape)).astype(np.float32))
        else:
            writer.add_tensor(name, quantize((0.3 * rng.standard_normal(shape)).astype(np.float32), qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(VOCAB), hidden), Q.Q8_0)
    for i in range(layers):
        b = f"blk.{i}."
        for norm in NORMS:
            add(b + norm + ".weight", (head_dim if norm in ("attn_q_norm", "attn_k_norm") else hidden,), Q.F32)
        add(b + "attn_q.weight", (heads * head_dim, hidden), Q.Q5_0)
        add(b + "attn_k.weight", (kv * head_dim, hidden), Q.Q5_0)
        add(b + "attn_v.weight", (kv * head_dim, hidden), Q.Q8_0)
        add(b + "attn_output.weight", (hidden, heads * head_dim), Q.Q4_K if k_quants else Q.Q8_0)
        add(b + "ffn_gate.weight", (inter, hidden), Q.Q5_0)
        add(b + "ffn_up.weight", (inter, hidden), Q.Q5_0)
        add(b + "ffn_down.weight", (hidden, inter), (Q.Q6_K if i % 2 else Q.Q4_K) if k_quants else Q.Q8_0)
    add("output_norm.weight", (hidden,), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3-gguf")
    _write_gemma3_gguf(folder / "small.gguf")
    import_gguf(folder / "small.gguf", folder / "small.cmf", policy=QuantPolicy("f32"))
    return folder


def test_small_gguf_equals_transformers_gguf_loader(small_gguf):
    hf_model = transformers_model(small_gguf, "small.gguf")
    _assert_tensors_equal(small_gguf / "small.cmf", hf_model.state_dict())
    with open_cmf(small_gguf / "small.cmf") as cmf:
        arch, provenance = cmf.arch, cmf.header["provenance"]
        stored = {t.name: np.array(t.data) for t in GGUFReader(small_gguf / "small.gguf").tensors}
        for gguf_name, hf_name in NORMS.items():  # w = stored - 1, as float32 arithmetic gives it
            assert np.array_equal(cmf.decode(f"model.layers.0.{hf_name}.weight"),
                                  stored[f"blk.0.{gguf_name}.weight"] - np.float32(1))
    assert provenance["ggml_types"] == {"F32": 43, "Q4_K": 11, "Q5_0": 28, "Q6_K": 3, "Q8_0": 8}
    assert provenance["qk_permutation"].startswith("none") and "norm_shift" in provenance
    # The file has no query scalar: llama.cpp takes head_dim (as every Gemma 3 but the 27B's
    # config has it), transformers' GGUF loader Gemma3TextConfig's default 256. On 270M both are 256.
    assert arch["query_pre_attn_scalar"] == 128
    assert {**arch, "query_pre_attn_scalar": 256} == arch_from_hf_config(hf_model.config.to_dict())[0]
    assert arch["layer_types"] == [SLIDING] * 5 + [FULL, SLIDING]
    assert (arch["sliding_window"], arch["rope_theta"], arch["rope_local_base_freq"]) == (8, 1e6, 1e4)


def test_small_gguf_tokenizer_encodes_as_transformers(small_gguf):
    theirs = transformers_tokenizer(small_gguf, "small.gguf")
    ours = tokenizer_from_artifact(small_gguf / "small.cmf")
    ids = ours.encode(MIXED_TEXT, add_bos=True).tolist()
    assert ids == theirs(MIXED_TEXT).input_ids
    assert ours.decode(ids, skip_special=False) == theirs.decode(ids)
    tokens = ours.hf.encode(MIXED_TEXT).tokens
    assert tokens == theirs.tokenize(MIXED_TEXT) and "▁▁" in tokens  # a run of spaces, renamed
    with open_cmf(small_gguf / "small.cmf") as cmf:
        assert cmf.tokenizer_config == {"chat_template": None, "eos_token_ids": [1], "bos_token_id": 2,
                                        "pad_token_id": 0}


def test_llama_cpp_scales_the_27b_queries_by_hidden_over_heads(tmp_path):
    # 62 layers is Gemma 3 27B's depth, where llama.cpp scales by (hidden / heads) ** -0.5.
    _write_gemma3_gguf(tmp_path / "deep.gguf", layers=62, hidden=64, heads=2, head_dim=16)
    import_gguf(tmp_path / "deep.gguf", tmp_path / "deep.cmf", policy=QuantPolicy("f32"))
    assert open_cmf(tmp_path / "deep.cmf").arch["query_pre_attn_scalar"] == 32


@pytest.mark.parametrize(
    "options, message",
    [({"metadata": {"gemma3.attention.sliding_window_pattern": ("add_sliding_window_pattern", [True, False] * 3 + [True])}},
      "metadata key 'gemma3.attention.sliding_window_pattern' is not one this importer maps for gemma3"),
     ({"metadata": {"gemma3.final_logit_softcapping": ("add_final_logit_softcapping", 30.0)}},
      "metadata key 'gemma3.final_logit_softcapping' is not one"),
     ({"metadata": {"gemma3.rope.scaling.type": ("add_rope_scaling_type", RopeScalingType.LINEAR)}},
      "gemma3.rope.scaling.type = 'linear': rope scaling is not imported"),
     ({"metadata": {"gemma3.attention.value_length": ("add_value_length", 64)}},
      "gemma3.attention.value_length 64 != key_length 32"),
     ({"metadata": {"tokenizer.ggml.model": ("add_tokenizer_model", "gpt2")}},
      "tokenizer.ggml.model is 'gpt2'; a gemma3 vocabulary is rebuilt from 'llama'"),
     ({"metadata": {"tokenizer.ggml.merges": ("add_token_merges", ["▁ t"])}},
      "tokenizer key 'tokenizer.ggml.merges' is not one a gemma3 vocabulary is rebuilt from"),
     ({"metadata": {"tokenizer.ggml.add_space_prefix": ("add_add_space_prefix", True)}},
      "tokenizer.ggml.add_space_prefix is True; a gemma3 vocabulary needs False"),
     ({"metadata": {"tokenizer.ggml.unknown_token_id": ("add_unk_token_id", 4)}},
      "tokenizer.ggml.unknown_token_id 4 is '<mask>', not '<unk>'"),
     ({"drop": ("gemma3.attention.sliding_window",)}, "metadata key 'gemma3.attention.sliding_window' is missing")],
    ids=["sliding-pattern", "softcapping", "rope-scaling", "value-length", "tokenizer-model", "merges",
         "space-prefix", "unk", "no-window"],
)
def test_gemma3_gguf_refusals_name_the_problem(tmp_path, options, message):
    _write_gemma3_gguf(tmp_path / "x.gguf", layers=1, hidden=64, heads=2, head_dim=32, **options)
    with pytest.raises(UnsupportedModel, match=message):
        import_gguf(tmp_path / "x.gguf", tmp_path / "x.cmf")
    assert not (tmp_path / "x.cmf").exists()


@pytest.mark.parametrize("cut", [(0.05, 1.0), (0.999, 1.0), (0.5, 0.6)], ids=["metadata", "last-tensor", "middle-chunk"])
def test_a_cut_gguf_is_refused_by_name(tmp_path, cut):
    """A chunk cut short, concatenated with the others, makes a cut file: in its metadata, in its
    last tensor, or a chunk in the middle (the later bytes shifted, so the file ends early)."""
    _write_gemma3_gguf(tmp_path / "whole.gguf", layers=1, hidden=64, heads=2, head_dim=32)
    whole = (tmp_path / "whole.gguf").read_bytes()
    end, resume = (int(len(whole) * f) for f in cut)
    (tmp_path / "cut.gguf").write_bytes(whole[:end] + whole[resume:])
    size = (tmp_path / "cut.gguf").stat().st_size
    with pytest.raises(UnsupportedModel, match=rf"cut.gguf: not a complete GGUF file \({size} bytes\)"):
        import_gguf(tmp_path / "cut.gguf", tmp_path / "cut.cmf")
    assert not (tmp_path / "cut.cmf").exists()


def test_a_tensor_type_gguf_cannot_dequantize_is_refused_by_name(tmp_path):
    from gguf import GGMLQuantizationType as Q

    _write_gemma3_gguf(tmp_path / "x.gguf", layers=1, hidden=64, heads=2, head_dim=32,
                       retype={"blk.0.attn_v.weight": Q.I8})
    with pytest.raises(UnsupportedModel, match="x.gguf: tensor 'blk.0.attn_v.weight' is I8, which gguf cannot dequantize"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "x.cmf")
    assert not (tmp_path / "x.cmf").exists()


def test_a_tensor_type_code_no_ggml_type_has_is_refused_by_name(tmp_path):
    """A type code from a newer llama.cpp than the gguf package here: refused with its code."""
    _write_gemma3_gguf(tmp_path / "x.gguf", layers=1, hidden=64, heads=2, head_dim=32)
    data = bytearray((tmp_path / "x.gguf").read_bytes())
    name = b"blk.0.attn_v.weight"
    at = data.index(name) + len(name)  # then n_dims (u32), the dims (u64 each), the type (u32)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (250).to_bytes(4, "little")
    (tmp_path / "x.gguf").write_bytes(bytes(data))
    with pytest.raises(UnsupportedModel, match="x.gguf: a tensor has GGML type code 250, which gguf .* does not know"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "x.cmf")
    assert not (tmp_path / "x.cmf").exists()


def test_a_cmf_whose_layer_types_miss_a_layer_is_refused_by_name(small_gguf, tmp_path):
    """Every runtime reads the arch through ModelArgs: one layer type short of num_layers is
    refused by name before any weight is read, never run with a guessed type."""
    from pipeline.ground.cmf.writer import write_cmf
    from pipeline.ground.models.errors import ModelConfigError
    from pipeline.ground.reference import load_reference

    with open_cmf(small_gguf / "small.cmf") as cmf:
        arch = {**cmf.arch, "layer_types": cmf.arch["layer_types"][:-1]}
        tensors = [(name, cmf.decode(name), "f32") for name in cmf.tensors]
    write_cmf(tmp_path / "short.cmf", arch=arch, tensors=tensors)
    with pytest.raises(ModelConfigError, match=r"short.cmf: arch.layer_types has 6 entries for num_layers 7"):
        load_reference(tmp_path / "short.cmf")


# -- import-hf: a small random Gemma3ForCausalLM


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gemma3-hf")
    save_hf_model("gemma3", folder / "hf", seed=12)
    return folder / "hf"


EXPECTED_HF_ARCH = {
    "arch_name": "gemma3", "hidden_size": 64, "intermediate_size": 96, "num_layers": 2, "num_attention_heads": 4,
    "num_kv_heads": 2, "head_dim": 16, "vocab_size": 128, "layer_types": [SLIDING, FULL], "rms_norm_eps": 1e-6,
    "norm_style": "gemma", "rope_theta": 1e6, "tie_word_embeddings": True, "max_position_embeddings": 512,
    "hidden_act": "gelu_pytorch_tanh", "sliding_window": 8, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 24,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}


def test_import_hf_keeps_tensors_and_maps_the_gemma3_keys(small_hf, tmp_path):
    import_hf(small_hf, tmp_path / "m.cmf", policy=QuantPolicy("f32"))
    saved = load_file(small_hf / "model.safetensors")
    with open_cmf(tmp_path / "m.cmf") as cmf:
        assert set(cmf.tensors) == set(saved)  # names 1:1, the head tied
        assert all(np.array_equal(cmf.decode(n), saved[n].numpy()) for n in saved)
        assert cmf.arch == EXPECTED_HF_ARCH


def _transformers_4(config: dict) -> None:
    """config.json as transformers 4 wrote it: both RoPE bases at the top, a layer pattern."""
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["full_attention"]["rope_theta"],
                  rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling=None,
                  sliding_window_pattern=2)
    config.pop("layer_types")


def test_a_transformers_4_config_gives_the_same_arch(small_hf):
    config = json.loads((small_hf / "config.json").read_text())
    _transformers_4(config)
    assert arch_from_hf_config(config)[0] == EXPECTED_HF_ARCH


@pytest.mark.parametrize(
    "edit, error, message",
    [(lambda c: c.update(model_type="gemma3"), UnsupportedModel, "only its text model .model_type 'gemma3_text'. is imported"),
     (lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0), UnsupportedModel,
      "rope_parameters.sliding_attention.rope_type 'linear'"),
     (lambda c: c.update(use_bidirectional_attention=True), UnsupportedModel, "use_bidirectional_attention is true"),
     (lambda c: (_transformers_4(c), c.pop("rope_local_base_freq")), ModelConfigError, "rope_local_base_freq is missing"),
     (lambda c: c.pop("query_pre_attn_scalar"), ModelConfigError, "field query_pre_attn_scalar is missing"),
     (lambda c: c.update(final_logit_softcapping=30.0), UnsupportedModel, "final_logit_softcapping 30.0")],
    ids=["multimodal", "sliding-rope-scaled", "bidirectional", "no-local-base", "no-query-scalar", "softcapping"],
)
def test_import_hf_gemma3_refusals_name_the_problem(small_hf, tmp_path, edit, error, message):
    folder = tmp_path / "hf"
    shutil.copytree(small_hf, folder)
    rewrite_config(folder, edit)
    with pytest.raises(error, match=message):
        import_hf(folder, tmp_path / "m.cmf")
    assert not (tmp_path / "m.cmf").exists()
