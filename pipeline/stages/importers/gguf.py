"""`import-gguf`: a llama, qwen2 or gemma3 GGUF file to CMF v2.

Tensors are dequantized with `gguf.quants.dequantize` (any GGML type that package knows)
and re-encoded under the quant policy. Each architecture's own layout is undone exactly as
transformers' GGUF loader undoes it: llama.cpp's llama converter permutes the rows of q_proj
and k_proj for its rotary layout (rows regrouped per head from (dim, 2) to (2, dim) order);
its qwen2 converter stores every tensor as Hugging Face has it (q/k/v biases included, an
untied head as `output.weight`); its gemma3 converter does not permute, but stores every norm
weight as 1 + w (w as Hugging Face keeps it, for x_hat * (1 + w)), so 1 is subtracted again.
The vocabulary is rebuilt by `gguf_vocab`. Gemma 3's sliding-layer pattern, local RoPE base
and query scalar are not in the file: llama.cpp fixes them for the architecture, and they are
taken from the same rules.
Anything the importer does not map exactly (another architecture, a tensor or qwen2/gemma3
metadata key it does not know, a qwen2 layer tensor missing, rope scaling, an unknown
vocabulary) is refused by name. docs/QWEN2.md has the qwen2 mapping.
"""

import importlib.metadata
import os
import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

from manifests.identity import file_identity
from pipeline.ground.errors import UnsupportedModel
from pipeline.stages.importers.common import write_import
from pipeline.stages.importers.gguf_fields import GgufFields
from pipeline.stages.importers.gguf_vocab import gguf_vocab
from pipeline.stages.importers.quant_policy import QuantPolicy
from pipeline.ground.models.hf_config import arch_from_hf_config

_TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}  # fmt: skip
_ATTENTION_AND_MLP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Per-layer GGUF tensor -> HF name, per architecture (gguf-py's tensor map): a llama or qwen2
# layer's one FFN norm is its post-attention norm; a gemma3 layer has four norms and q/k norms.
_PER_LAYER = {
    "llama": {**_ATTENTION_AND_MLP, "ffn_norm.weight": "post_attention_layernorm.weight"},
    "qwen2": {**_ATTENTION_AND_MLP, "ffn_norm.weight": "post_attention_layernorm.weight"},
    "gemma3": {**_ATTENTION_AND_MLP, "attn_q_norm.weight": "self_attn.q_norm.weight",
               "attn_k_norm.weight": "self_attn.k_norm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
}
ARCHITECTURES = tuple(_PER_LAYER)
# Per-layer tensors every layer must have. Qwen2Attention always has q/k/v biases: a layer
# without one would be run by transformers with a freshly initialized bias, so it is refused.
# (A llama layer's biases are optional: LlamaConfig.attention_bias.)
_REQUIRED_PER_LAYER = {"qwen2": tuple(_PER_LAYER["qwen2"])}
# What llama.cpp's converter stored in place of the HF weight (convert_hf_to_gguf.py):
# LlamaModel permutes q/k; Qwen2Model and Gemma3Model write them unchanged.
_PERMUTES_QK = {"llama": True, "qwen2": False, "gemma3": False}
_NORM_SHIFT = {"llama": None, "qwen2": None, "gemma3": np.float32(1.0)}
# The qwen2.* keys llama.cpp's Qwen2Model writes for a dense Qwen2/2.5 and this importer reads
# (plus the two that `_hf_config` checks against what it derives: a vocabulary size and a
# rotary width). Any other (a sliding window, key/value lengths, rope scaling) would change the
# model transformers and llama.cpp build, so it is refused by name rather than ignored.
_QWEN2_KEYS = {f"qwen2.{key}" for key in (
    "context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon", "vocab_size",
    "rope.dimension_count")
}  # fmt: skip
# The gemma3.* keys llama.cpp writes and this importer reads. llama.cpp fixes the rest of a
# Gemma 3 for the architecture, so a key it does not write could only mean something this
# importer would ignore: each other one is refused by name.
_GEMMA3_KEYS = {f"gemma3.{key}" for key in (
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "attention.sliding_window", "rope.freq_base", "rope.dimension_count")
}  # fmt: skip
# The architectures whose every `<arch>.*` key must be one of these (llama files carry keys
# this importer has always let pass; they stay as they were).
_KNOWN_KEYS = {"qwen2": _QWEN2_KEYS, "gemma3": _GEMMA3_KEYS}
# llama.cpp's fixed rules for Gemma 3 (llama-model.cpp): five sliding layers then one full
# (Gemma3TextConfig's default pattern too), sliding layers at RoPE base 10000, and queries
# scaled by head_dim ** -0.5 except in the 27B (62 layers), where by (hidden / heads) ** -0.5.
_GEMMA3_LOCAL_ROPE_BASE = 10000.0
_GEMMA3_27B_LAYERS = 62
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_UNKNOWN_TYPE = re.compile(r"(\d+)\)? is not a valid GGMLQuantizationType")


def import_gguf(path: str | os.PathLike, out: str | os.PathLike, *, policy: QuantPolicy = QuantPolicy(),
                force: bool = False) -> list[Path]:
    path = Path(path)
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError) as error:  # what gguf-py raises on a cut or corrupt file
        if unknown := _UNKNOWN_TYPE.search(str(error)):  # a tensor type newer than this gguf package
            raise UnsupportedModel(f"{path}: a tensor has GGML type code {unknown[1]}, which gguf "
                                   f"{importlib.metadata.version('gguf')} does not know") from None
        raise UnsupportedModel(f"{path}: not a complete GGUF file ({path.stat().st_size} bytes): {error}") from None
    fields = GgufFields(reader, path)
    architecture = fields.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise UnsupportedModel(f"{path}: general.architecture is {architecture!r}; supported: {ARCHITECTURES}")
    tensors = {t.name: t for t in reader.tensors}
    config = _hf_config(fields, architecture, tensors, path)
    _check_layers(tensors, architecture, config["num_hidden_layers"], path)
    arch, moe = arch_from_hf_config(config, source=str(path))

    mapped = {}
    for name, tensor in tensors.items():
        hf_name = _hf_name(name, architecture, path)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists ne0 (the input) first
        # llama.cpp permutes q/k biases along with the weights.
        role = hf_name.split(".", 3)[-1].rsplit(".", 1)[0]
        heads = {"self_attn.q_proj": arch["num_attention_heads"], "self_attn.k_proj": arch["num_kv_heads"]}.get(role)
        shift = _NORM_SHIFT[architecture] if name.endswith("norm.weight") else None
        mapped[hf_name] = (shape, _loader(tensor, shape, heads if _PERMUTES_QK[architecture] else None, shift, path))

    tokenizer_json, tokenizer_config = gguf_vocab(fields, architecture, path)
    provenance = {
        "importer": "cmfdeploy import-gguf",
        "source": path.name,
        **{f"source_{k}": v for k, v in file_identity(path).items()},
        "general.name": fields.optional("general.name"),
        "ggml_types": _type_counts(reader),
        "qk_permutation": ("reversed as transformers' GGUF loader does" if _PERMUTES_QK[architecture]
                           else "none (llama.cpp's converter does not permute this architecture)"),
    }
    if _NORM_SHIFT[architecture] is not None:
        provenance["norm_shift"] = "1 subtracted from every norm weight, as transformers' GGUF loader does"
    return write_import(
        out, source=str(path), arch=arch, moe=moe, tensors=mapped, policy=policy,
        tokenizer_json=tokenizer_json, tokenizer_config=tokenizer_config, provenance=provenance, force=force,
    )  # fmt: skip


def _hf_config(fields: GgufFields, arch: str, tensors: dict, path: Path) -> dict:
    """The config.json transformers would build from this file, for `arch_from_hf_config`."""
    for key in (f"{arch}.rope.scaling.type", f"{arch}.rope.scaling.factor"):
        if fields.optional(key) not in (None, "none"):
            raise UnsupportedModel(f"{path}: {key} = {fields.optional(key)!r}: rope scaling is not imported")
    if "rope_freqs.weight" in tensors:
        raise UnsupportedModel(f"{path}: tensor 'rope_freqs.weight' (Llama-3 rope frequencies) is not imported")
    heads = fields.get(f"{arch}.attention.head_count")
    hidden = fields.get(f"{arch}.embedding_length")
    head_dim = fields.optional(f"{arch}.attention.key_length", hidden // heads)
    rope_dim = fields.optional(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise UnsupportedModel(f"{path}: {arch}.rope.dimension_count {rope_dim} != head dim {head_dim} (partial rotary)")
    if arch in _KNOWN_KEYS:
        unknown = sorted(key for key in fields.keys() if key.startswith(f"{arch}.") and key not in _KNOWN_KEYS[arch])
        if unknown:
            raise UnsupportedModel(f"{path}: metadata key {unknown[0]!r} is not one this importer maps for {arch}")
    vocab_size = fields.optional(f"{arch}.vocab_size", len(fields.get("tokenizer.ggml.tokens")))
    config = {
        "model_type": arch,
        "num_hidden_layers": fields.get(f"{arch}.block_count"),
        "hidden_size": hidden,
        "intermediate_size": fields.get(f"{arch}.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": fields.optional(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "rms_norm_eps": fields.get(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": fields.get(f"{arch}.rope.freq_base"),
        "max_position_embeddings": fields.get(f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    return _gemma3_config(fields, config, path) if arch == "gemma3" else {**config, "hidden_act": "silu"}


def _gemma3_config(fields: GgufFields, config: dict, path: Path) -> dict:
    """The Gemma3TextConfig dict of a gemma3 file (transformers 4's spelling of its RoPE keys)."""
    value_dim = fields.optional("gemma3.attention.value_length", config["head_dim"])
    if value_dim != config["head_dim"]:
        raise UnsupportedModel(f"{path}: gemma3.attention.value_length {value_dim} != key_length {config['head_dim']}")
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    return {
        **config,
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": fields.get("gemma3.attention.sliding_window"),
        # No layer_types: arch_from_hf_config derives them by Gemma3TextConfig's pattern, llama.cpp's too.
        "rope_local_base_freq": _GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": hidden // heads if layers == _GEMMA3_27B_LAYERS else config["head_dim"],
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def _check_layers(tensors: dict, arch: str, layers: int, path: Path) -> None:
    """Refuse a layer past block_count, and a required per-layer tensor missing, by name."""
    for name in tensors:
        match = _BLOCK.fullmatch(name)
        if match and int(match[1]) >= layers:
            raise UnsupportedModel(f"{path}: tensor '{name}' is past {arch}.block_count {layers}")
    for layer in range(layers):
        for role in _REQUIRED_PER_LAYER.get(arch, ()):
            if f"blk.{layer}.{role}" not in tensors:
                raise UnsupportedModel(f"{path}: tensor 'blk.{layer}.{role}' is missing (every {arch} layer has one)")


def _hf_name(name: str, arch: str, path: Path) -> str:
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _BLOCK.fullmatch(name)
    if match is None or match[2] not in _PER_LAYER[arch]:
        raise UnsupportedModel(f"{path}: tensor '{name}' has no Hugging Face counterpart this importer knows")
    return f"model.layers.{match[1]}.{_PER_LAYER[arch][match[2]]}"


def _loader(tensor, shape: tuple[int, ...], heads: int | None, shift: np.float32 | None, path: Path):
    def load() -> np.ndarray:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            kind = GGMLQuantizationType(tensor.tensor_type).name
            raise UnsupportedModel(f"{path}: tensor '{tensor.name}' is {kind}, which gguf cannot dequantize") from None
        array = array.astype(np.float32, copy=False).reshape(shape)
        if shift is not None:
            array = array - shift
        return array if heads is None else unpermute_rows(array, heads)

    return load


def unpermute_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' `_reverse_permute_weights`).

    llama.cpp stores each head's rows as (dim, 2) pairs, interleaving the two rotary halves;
    Hugging Face keeps them as (2, dim) blocks. Swapping the two axes back is exact.
    """
    dim = weights.shape[0] // heads // 2
    return np.ascontiguousarray(weights.reshape(heads, dim, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape))


def _type_counts(reader: GGUFReader) -> dict[str, int]:
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = GGMLQuantizationType(tensor.tensor_type).name
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))

