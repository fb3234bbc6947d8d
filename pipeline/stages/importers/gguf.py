"""`import-gguf`: a llama-family GGUF file to CMF v2.

Tensors are dequantized with `gguf.quants.dequantize` (any GGML type that package knows)
and re-encoded under the quant policy. llama.cpp's converter permutes the rows of q_proj
and k_proj for its rotary layout; that permutation is undone exactly as transformers' GGUF
loader undoes it (rows regrouped per head from (dim, 2) to (2, dim) order). The GPT-2-style
BPE vocabulary is rebuilt as a Hugging Face tokenizer.json carried in the vocab section,
with llama.cpp's pre-tokenizer split for the file's `tokenizer.ggml.pre`, its control
tokens as special tokens and its chat template and eos/bos/pad ids in `tokenizer_config`.
Anything the importer does not map exactly (another architecture, a tensor it does not
know, rope scaling, a sentencepiece vocabulary, an unknown pre-tokenizer) is refused by name.
"""

import os
import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

from manifests.identity import file_identity
from pipeline.ground.errors import UnsupportedModel
from pipeline.stages.importers.common import write_import
from pipeline.stages.importers.quant_policy import QuantPolicy
from pipeline.ground.models.hf_config import arch_from_hf_config

ARCHITECTURES = ("llama",)
_TOP_LEVEL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}  # fmt: skip
_PER_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
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
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp) for the `tokenizer.ggml.pre` values
# handled here: every one ends in the GPT-2 split, which ByteLevel(use_regex=True) applies;
# some isolate each numeric character first.
_GPT2_PRE = ("gpt2", "mpt", "olmo", "jais")
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_CONTROL, _USER_DEFINED = 3, 4


def import_gguf(path: str | os.PathLike, out: str | os.PathLike, *, policy: QuantPolicy = QuantPolicy(),
                force: bool = False) -> list[Path]:
    path = Path(path)
    reader = GGUFReader(path)
    fields = _Fields(reader, path)
    architecture = fields.get("general.architecture")
    if architecture not in ARCHITECTURES:
        raise UnsupportedModel(f"{path}: general.architecture is {architecture!r}; supported: {ARCHITECTURES}")
    tensors = {t.name: t for t in reader.tensors}
    config = _hf_config(fields, architecture, tensors, path)
    arch, moe = arch_from_hf_config(config, source=str(path))

    mapped = {}
    for name, tensor in tensors.items():
        hf_name = _hf_name(name, path)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists ne0 (the input) first
        # llama.cpp permutes q/k biases along with the weights.
        role = hf_name.split(".", 3)[-1].rsplit(".", 1)[0]
        heads = {"self_attn.q_proj": arch["num_attention_heads"], "self_attn.k_proj": arch["num_kv_heads"]}.get(role)
        mapped[hf_name] = (shape, _loader(tensor, shape, heads, path))

    tokenizer_json, tokenizer_config = _tokenizer(fields, path)
    provenance = {
        "importer": "cmfdeploy import-gguf",
        "source": path.name,
        **{f"source_{k}": v for k, v in file_identity(path).items()},
        "general.name": fields.optional("general.name"),
        "ggml_types": _type_counts(reader),
        "qk_permutation": "reversed as transformers' GGUF loader does",
    }
    return write_import(
        out, source=str(path), arch=arch, moe=moe, tensors=mapped, policy=policy,
        tokenizer_json=tokenizer_json, tokenizer_config=tokenizer_config, provenance=provenance, force=force,
    )  # fmt: skip


class _Fields:
    """Typed access to GGUF metadata; a missing required key is an error naming it."""

    def __init__(self, reader: GGUFReader, path: Path):
        self._fields, self._path = reader.fields, path

    def optional(self, key: str, default=None):
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def get(self, key: str):
        if key not in self._fields:
            raise UnsupportedModel(f"{self._path}: metadata key {key!r} is missing")
        return self._fields[key].contents()


def _hf_config(fields: _Fields, arch: str, tensors: dict, path: Path) -> dict:
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
    vocab_size = fields.optional(f"{arch}.vocab_size", len(fields.get("tokenizer.ggml.tokens")))
    return {
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
        "hidden_act": "silu",
    }


def _hf_name(name: str, path: Path) -> str:
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    match = _BLOCK.fullmatch(name)
    if match is None or match[2] not in _PER_LAYER:
        raise UnsupportedModel(f"{path}: tensor '{name}' has no Hugging Face counterpart this importer knows")
    return f"model.layers.{match[1]}.{_PER_LAYER[match[2]]}"


def _loader(tensor, shape: tuple[int, ...], heads: int | None, path: Path):
    def load() -> np.ndarray:
        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            kind = GGMLQuantizationType(tensor.tensor_type).name
            raise UnsupportedModel(f"{path}: tensor '{tensor.name}' is {kind}, which gguf cannot dequantize") from None
        array = array.astype(np.float32, copy=False).reshape(shape)
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


def _tokenizer(fields: _Fields, path: Path) -> tuple[bytes, dict]:
    """(tokenizer.json bytes, CMF tokenizer_config) rebuilt from the GGUF vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(f"{path}: tokenizer.ggml.model is {kind!r}; only 'gpt2' (byte-level BPE) is rebuilt")
    pre = fields.get("tokenizer.ggml.pre")
    if pre not in _GPT2_PRE + _DIGIT_SPLIT_PRE:
        raise UnsupportedModel(f"{path}: tokenizer.ggml.pre is {pre!r}; known: {sorted(_GPT2_PRE + _DIGIT_SPLIT_PRE)}")
    tokens = fields.get("tokenizer.ggml.tokens")
    types = fields.get("tokenizer.ggml.token_type")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    outside = next((t for t, kind in zip(tokens, types) if kind != _CONTROL and not set(t) <= alphabet), None)
    if outside is not None:
        raise UnsupportedModel(f"{path}: token {outside!r} is not spelled in the byte-level alphabet")

    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None,
                                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))  # fmt: skip
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
        if pre in _DIGIT_SPLIT_PRE else byte_level
    )  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types) if kind == _CONTROL])
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types) if kind == _USER_DEFINED])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise UnsupportedModel(f"{path}: rebuilt vocabulary has {tokenizer.get_vocab_size()} tokens, the file {len(tokens)}")

    eos = [fields.get("tokenizer.ggml.eos_token_id")]
    eot = fields.optional("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos:
        eos.append(eot)
    config = {
        "chat_template": fields.optional("tokenizer.chat_template"),
        "eos_token_ids": eos,
        "bos_token_id": fields.optional("tokenizer.ggml.bos_token_id"),
        "pad_token_id": fields.optional("tokenizer.ggml.padding_token_id"),
    }
    return tokenizer.to_str().encode("utf-8"), config
