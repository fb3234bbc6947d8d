"""import-hf and import-gguf on small checkpoints, each against transformers reading the same
files: logits, tensors, tokenizers, chat bundles; and every refusal names what it refused."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from _hf_models import rewrite_config, save_hf_model
from pipeline.ground.models.numerics import model_logits_bound
from pipeline.cli import main
from pipeline.ground.cmf import dtype_by_name, open_cmf
from pipeline.ground.errors import OutputExists, UnsupportedModel
from pipeline.stages.importers.gguf import import_gguf, unpermute_rows
from pipeline.stages.importers.hf import import_hf
from pipeline.stages.importers.quant_policy import QuantPolicy, role_of
from pipeline.ground.models.errors import ModelConfigError
from pipeline.ground.reference import load_reference

os.environ.setdefault("HF_HUB_OFFLINE", "1")
FIXTURE_TOKENIZER = Path(__file__).resolve().parent.parent / "fixtures" / "tokenizer.json"
IDS = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(1))


# -- quant policy


@pytest.mark.parametrize(
    "name, shape, expected",
    [("model.layers.0.input_layernorm.weight", (64,), ("f16", None)),
     ("model.layers.0.self_attn.q_proj.bias", (64,), ("f16", None)),
     ("model.layers.0.mlp.gate.weight", (6, 64), ("f16", None)),  # MoE router stays float
     ("model.layers.0.self_attn.q_norm.weight", (4, 4), ("f16", None)),  # under 32 elements
     ("model.embed_tokens.weight", (128, 64), ("q8_row", None)),
     ("lm_head.weight", (128, 64), ("f32", None)),
     ("model.layers.0.self_attn.o_proj.weight", (64, 64), ("q4_block", None)),
     ("model.layers.0.mlp.down_proj.weight", (64, 96), ("vbit", None)),
     ("model.layers.0.mlp.down_proj.weight", (64, 100), ("q8_2f", "vbit needs in % 32 == 0, in is 100")),
     ("model.layers.0.mlp.experts.3.up_proj.weight", (2, 8, 64), ("q4_block", "vbit needs a 2-D tensor, shape is [2, 8, 64]"))],
)
def test_policy_chooses_by_role_shape_and_layout(name, shape, expected):
    policy = QuantPolicy("q8_row", {"lm_head": "f32", "attention": "q4_block", "mlp": "vbit"})
    assert policy.choose(name, shape) == expected


def test_f32_policy_keeps_small_tensors_f32_and_bad_choices_are_refused():
    assert QuantPolicy("f32").choose("model.norm.weight", (64,)) == ("f32", None)
    assert role_of("model.layers.2.linear_attn.out_proj.weight") == "attention"
    with pytest.raises(UnsupportedModel, match="unknown role 'vision'"):
        QuantPolicy("f16", {"vision": "q8_row"})
    with pytest.raises(UnsupportedModel, match="'u8' is not one of"):
        QuantPolicy("u8")


# -- import-hf


@torch.no_grad()
def _reference_logits(path):
    model, _, _ = load_reference(path)
    return model(IDS)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen2_moe", "gemma"])
def test_f32_import_runs_like_transformers(tmp_path, family):
    hf_model = save_hf_model(family, tmp_path / "hf", seed=2)
    paths = import_hf(tmp_path / "hf", tmp_path / "m.cmf", policy=QuantPolicy("f32"))
    assert paths == [tmp_path / "m.cmf"]
    with torch.no_grad():
        expected = hf_model(IDS[None]).logits[0]
    bound = model_logits_bound(load_reference(tmp_path / "m.cmf")[0], len(IDS))  # two float32 implementations
    torch.testing.assert_close(_reference_logits(tmp_path / "m.cmf"), expected, rtol=0, atol=bound)
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    with open_cmf(tmp_path / "m.cmf") as cmf:
        assert set(cmf.tensors) == set(saved)  # names 1:1
        assert all(np.array_equal(cmf.decode(n), saved[n].numpy()) for n in saved)
        assert {info.dtype.name for info in cmf.tensors.values()} == {"f32"}
        assert cmf.header["provenance"]["importer"] == "cmfdeploy import-hf"


def test_both_rope_config_forms_give_the_same_arch_and_a_missing_theta_is_an_error(tmp_path):
    save_hf_model("llama", tmp_path / "hf", seed=2)
    import_hf(tmp_path / "hf", tmp_path / "new.cmf", policy=QuantPolicy("f32"))

    def legacy(config):  # transformers 4: rope_theta at the top, the llama3 block in rope_scaling
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope

    rewrite_config(tmp_path / "hf", legacy)
    import_hf(tmp_path / "hf", tmp_path / "old.cmf", policy=QuantPolicy("f32"))
    new, old = open_cmf(tmp_path / "new.cmf").arch, open_cmf(tmp_path / "old.cmf").arch
    assert new == old and new["rope_theta"] == 500000.0 and new["rope_scaling"]["factor"] == 8.0

    rewrite_config(tmp_path / "hf", lambda c: c.pop("rope_theta"))
    with pytest.raises(ModelConfigError, match="rope_theta"):
        import_hf(tmp_path / "hf", tmp_path / "none.cmf")


def test_sharded_bf16_checkpoint(tmp_path):
    save_hf_model("qwen3", tmp_path / "full", seed=3)
    saved = load_file(tmp_path / "full" / "model.safetensors")
    hf_model = save_hf_model("qwen3", tmp_path / "hf", seed=3)
    hf_model.to(torch.bfloat16).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    (tmp_path / "hf" / "model.safetensors").unlink(missing_ok=True)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    import_hf(tmp_path / "hf", tmp_path / "m.cmf", policy=QuantPolicy("f32"))
    with open_cmf(tmp_path / "m.cmf") as cmf:
        for name, tensor in saved.items():
            assert np.array_equal(cmf.decode(name), tensor.to(torch.bfloat16).float().numpy()), name


def test_per_role_dtypes_encode_exactly_what_the_policy_says(tmp_path):
    save_hf_model("qwen3", tmp_path / "hf", seed=4, intermediate_size=100, tie_word_embeddings=False)
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    code = main(["import-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "m.cmf"), "--quant", "q8_row",
                 "--embeddings", "f16", "--lm-head", "f32", "--attention", "q4_block", "--mlp", "vbit"])
    assert code == 0
    policy = QuantPolicy("q8_row", {"embeddings": "f16", "lm_head": "f32", "attention": "q4_block", "mlp": "vbit"})
    with open_cmf(tmp_path / "m.cmf") as cmf:
        for name, tensor in saved.items():
            dtype, _ = policy.choose(name, tuple(tensor.shape))
            assert cmf.tensors[name].dtype.name == dtype, name
            assert np.array_equal(cmf.raw(name), dtype_by_name(dtype).encode(tensor.numpy())), name
        assert cmf.tensors["model.layers.0.input_layernorm.weight"].dtype.name == "f16"
        assert cmf.tensors["model.layers.0.mlp.up_proj.weight"].dtype.name == "vbit"
        fallbacks = cmf.header["provenance"]["dtype_fallbacks"]
        assert fallbacks == {f"model.layers.{i}.mlp.down_proj.weight": "vbit needs in % 32 == 0, in is 100"
                             for i in range(2)}
        assert cmf.header["quant_type"] == "Q8_ROW"


TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("where", ["chat_template.jinja", "chat_template.json", "tokenizer_config.json"])
def test_chat_bundle_from_tokenizer_files(tmp_path, where):
    save_hf_model("qwen3", tmp_path / "hf", seed=5, eos_token_id=2, bos_token_id=1)
    (tmp_path / "hf" / "tokenizer.json").write_bytes(FIXTURE_TOKENIZER.read_bytes())
    tok_config = {"eos_token": "</s>", "pad_token": {"content": "<pad>"}, "bos_token": "<s>"}
    if where == "tokenizer_config.json":
        tok_config["chat_template"] = TEMPLATE
    elif where == "chat_template.json":
        (tmp_path / "hf" / where).write_text(json.dumps({"chat_template": TEMPLATE}))
    else:
        (tmp_path / "hf" / where).write_text(TEMPLATE)
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    import_hf(tmp_path / "hf", tmp_path / "m.cmf")
    with open_cmf(tmp_path / "m.cmf") as cmf:
        assert cmf.vocab == FIXTURE_TOKENIZER.read_bytes()
        assert cmf.tokenizer_config == {"chat_template": TEMPLATE, "eos_token_ids": [2, 3], "bos_token_id": 1,
                                        "pad_token_id": 3}


def _edit_weights(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "break_it, error, message",
    [(lambda d: rewrite_config(d, lambda c: c.update(model_type="phi3")), UnsupportedModel, "'phi3' is not a supported"),
     (lambda d: _edit_weights(d, lambda t: t.update({"model.vision.proj.weight": torch.zeros(2, 2)})),
      UnsupportedModel, "tensor 'model.vision.proj.weight' is not one the reference model reads"),
     (lambda d: _edit_weights(d, lambda t: t.update({"model.norm.weight": torch.zeros(64, dtype=torch.int8)})),
      UnsupportedModel, "tensor 'model.norm.weight' has dtype I8"),
     (lambda d: _edit_weights(d, lambda t: t["model.layers.1.mlp.up_proj.weight"].__setitem__((3, 4), float("nan"))),
      UnsupportedModel, r"'model.layers.1.mlp.up_proj.weight' holds nan at index \[3, 4\]"),
     (lambda d: _edit_weights(d, lambda t: t.pop("lm_head.weight")), UnsupportedModel, "lacks 'lm_head.weight'"),
     (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"), UnsupportedModel,
      r"pytorch_model.bin are pickles, which are never loaded")],
    ids=["architecture", "tensor-name", "tensor-dtype", "non-finite", "missing-head", "pickle"],
)
def test_import_hf_refusals_name_the_problem(tmp_path, break_it, error, message):
    save_hf_model("qwen3", tmp_path / "hf", seed=6, tie_word_embeddings=False)
    break_it(tmp_path / "hf")
    with pytest.raises(error, match=message):
        import_hf(tmp_path / "hf", tmp_path / "m.cmf")
    assert not (tmp_path / "m.cmf").exists()


def test_existing_output_is_refused_on_the_cli(tmp_path, capsys):
    save_hf_model("qwen3", tmp_path / "hf", seed=7)
    (tmp_path / "m.cmf").write_bytes(b"keep")
    capsys.readouterr()  # transformers' save progress bar
    assert main(["import-hf", str(tmp_path / "hf"), "-o", str(tmp_path / "m.cmf")]) == 1
    assert capsys.readouterr().err == f"OutputExists: {tmp_path / 'm.cmf'}: already exists; pass force to overwrite\n"
    assert (tmp_path / "m.cmf").read_bytes() == b"keep"
    with pytest.raises(OutputExists):
        import_hf(tmp_path / "hf", tmp_path / "m.cmf")
    import_hf(tmp_path / "hf", tmp_path / "m.cmf", force=True)


# -- import-gguf on a GGUF written here


def test_unpermute_rows_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, rows in ((4, 64), (2, 32)):
        w = rng.standard_normal((rows, 48)).astype(np.float32)
        # convert_hf_to_gguf.py: LlamaModel.permute
        permuted = w.reshape(heads, 2, rows // heads // 2, 48).swapaxes(1, 2).reshape(w.shape)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_rows(permuted, heads), w)
        bias = rng.standard_normal(rows).astype(np.float32)
        assert np.array_equal(unpermute_rows(bias.reshape(heads, 2, -1).swapaxes(1, 2).reshape(-1), heads), bias)


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a n", "Ġa n", "Ġan d"]
CHAT = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def _write_gguf(path: Path, arch: str = "llama", tokenizer_model: str = "gpt2", pre: str = "smollm",
                extra_tensor: str | None = None, rope_scaling: str | None = None,
                int_norm: bool = False) -> dict[str, np.ndarray]:
    """A 2-layer llama GGUF in llama.cpp's layout (q/k rows permuted, Q8_0/Q4_1/F16 blocks);
    returns the HF-layout float weights it was made from."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, RopeScalingType
    from gguf.quants import quantize

    tokens = SPECIALS + _byte_alphabet() + ["".join(m.split(" ")) for m in MERGES]
    hidden, inter, heads, kv, layers, vocab = 64, 96, 4, 2, 2, len(tokens)
    writer = GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    if rope_scaling:
        writer.add_rope_scaling_type(RopeScalingType(rope_scaling))
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT)

    rng = np.random.default_rng(9)
    hf: dict[str, np.ndarray] = {}

    def add(gguf_name, hf_name, shape, qtype, permute_heads=None, scale=0.2):
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        hf[hf_name] = w
        stored = w
        if permute_heads:
            stored = w.reshape(permute_heads, 2, shape[0] // permute_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
        if qtype == Q.I8:
            writer.add_tensor(gguf_name, stored.astype(np.int8))
        elif qtype == Q.F32:
            writer.add_tensor(gguf_name, stored)
        elif qtype == Q.F16:
            writer.add_tensor(gguf_name, stored.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, quantize(stored, qtype), raw_dtype=qtype)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, hidden), Q.Q8_0, scale=1.0)
    for i in range(layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_norm.weight", p + "input_layernorm.weight", (hidden,), Q.F32)
        add(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", (hidden,), Q.F32)
        add(b + "attn_q.weight", p + "self_attn.q_proj.weight", (hidden, hidden), Q.Q4_1, heads)
        add(b + "attn_k.weight", p + "self_attn.k_proj.weight", (kv * 16, hidden), Q.Q8_0, kv)
        add(b + "attn_v.weight", p + "self_attn.v_proj.weight", (kv * 16, hidden), Q.F16)
        add(b + "attn_output.weight", p + "self_attn.o_proj.weight", (hidden, hidden), Q.Q4_1)
        add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", (inter, hidden), Q.Q8_0)
        add(b + "ffn_up.weight", p + "mlp.up_proj.weight", (inter, hidden), Q.Q4_1)
        add(b + "ffn_down.weight", p + "mlp.down_proj.weight", (hidden, inter), Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", (hidden,), Q.I8 if int_norm else Q.F32)
    if extra_tensor:
        add(extra_tensor, "unused", (hidden,), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    _write_gguf(folder / "tiny.gguf")
    import_gguf(folder / "tiny.gguf", folder / "tiny.cmf", policy=QuantPolicy("f32"))
    return folder


def test_gguf_import_equals_transformers_gguf_loader(tiny_gguf):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_gguf, gguf_file="tiny.gguf", dtype=torch.float32,
                                                    local_files_only=True).eval()
    state = hf_model.state_dict()
    with open_cmf(tiny_gguf / "tiny.cmf") as cmf:
        assert set(cmf.tensors) == set(state) - {"lm_head.weight"}
        for name in cmf.tensors:
            assert np.array_equal(cmf.decode(name), state[name].numpy()), name
        assert cmf.header["provenance"]["ggml_types"] == {"F16": 2, "F32": 5, "Q4_1": 6, "Q8_0": 7}
    ids = IDS % hf_model.config.vocab_size
    model, _, _ = load_reference(tiny_gguf / "tiny.cmf")
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_model(ids[None]).logits[0], rtol=0, atol=model_logits_bound(model, len(ids)))


def test_gguf_tokenizer_and_chat_bundle(tiny_gguf):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tiny_gguf, gguf_file="tiny.gguf", local_files_only=True)
    with open_cmf(tiny_gguf / "tiny.cmf") as cmf:
        ours = Tokenizer.from_str(cmf.vocab.decode())
        config = cmf.tokenizer_config
    text = "<|im_start|>the and in an ant then<|im_end|> héllo\nthe"
    assert ours.encode(text).ids == theirs(text, add_special_tokens=False).input_ids
    assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    # "smollm" pre-tokenization isolates each digit (llama.cpp's rule; transformers skips it)
    assert ours.encode("a 12").tokens == ["a", "Ġ", "1", "2"]
    assert config == {"chat_template": CHAT, "eos_token_ids": [2], "bos_token_id": 1, "pad_token_id": 0}


@pytest.mark.parametrize(
    "options, message",
    [({"arch": "qwen3"}, "general.architecture is 'qwen3'"),
     ({"tokenizer_model": "llama"}, "tokenizer.ggml.model is 'llama'"),
     ({"pre": "deepseek-llm"}, "tokenizer.ggml.pre is 'deepseek-llm'"),
     ({"extra_tensor": "blk.0.attn_sinks.weight"}, "tensor 'blk.0.attn_sinks.weight' has no Hugging Face counterpart"),
     ({"rope_scaling": "yarn"}, "rope.scaling.type = .yarn.: rope scaling is not imported"),
     ({"int_norm": True}, "tensor 'output_norm.weight' is I8, which gguf cannot dequantize")],
)
def test_import_gguf_refusals_name_the_problem(tmp_path, options, message):
    _write_gguf(tmp_path / "x.gguf", **options)
    with pytest.raises(UnsupportedModel, match=message):
        import_gguf(tmp_path / "x.gguf", tmp_path / "x.cmf")
    assert not (tmp_path / "x.cmf").exists()
