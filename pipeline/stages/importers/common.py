"""What both importers share: tensor-name checks, the dtype plan, streaming into write_cmf.

An importer produces an `arch`/`moe` pair (through `arch_from_hf_config`), a mapping of HF
tensor names to `(shape, load)` where `load()` returns the float32 array, and the tokenizer.
`write_import` checks that the reference model can run the architecture, plans every
tensor's dtype from its name and shape alone (the plan goes into the header's provenance,
which `write_cmf` fixes before it sees a payload), then loads, checks and encodes one tensor
at a time.
"""

import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from manifests.disk import DISK_NEEDS, require_disk
from pipeline.ground.cmf import write_cmf
from pipeline.ground.errors import UnsupportedModel
from pipeline.stages.importers.quant_policy import QuantPolicy
from pipeline.ground.models import ModelArgs

Loader = Callable[[], np.ndarray]
F16_MAX = 65504.0

# Per-layer tensors the reference model reads (spec §2, §2.2; norms of both norm styles).
_LAYER_TENSOR = re.compile(
    r"(input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|post_feedforward_layernorm)\.weight"
    r"|self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)"
    r"|self_attn\.(q_norm|k_norm)\.weight"
    r"|mlp\.(gate_proj|up_proj|down_proj)\.weight"
    r"|mlp\.gate\.weight|mlp\.shared_expert_gate\.weight"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight"
    r"|mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight"
)
_TOP_LEVEL = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


def check_tensor_name(name: str, where: str) -> None:
    """Refuse a tensor the reference model would not know what to do with, by name."""
    if name in _TOP_LEVEL:
        return
    match = _LAYER_NAME.fullmatch(name)
    if match is None or not _LAYER_TENSOR.fullmatch(match[2]):
        raise UnsupportedModel(f"{where}: tensor '{name}' is not one the reference model reads")


def canonical_order(names) -> list[str]:
    """Embedding, then layers in numeric order (names sorted within a layer), then the rest."""

    def key(name: str):
        match = _LAYER_NAME.fullmatch(name)
        if name == "model.embed_tokens.weight":
            return (0, 0, name)
        if match:
            return (1, int(match[1]), match[2])
        return (2, 0, name)

    return sorted(names, key=key)


def write_import(
    out: str | os.PathLike,
    *,
    source: str,
    arch: dict,
    moe: dict | None,
    tensors: Mapping[str, tuple[tuple[int, ...], Loader]],
    policy: QuantPolicy,
    tokenizer_json: bytes | None,
    tokenizer_config: dict | None,
    provenance: dict,
    force: bool,
) -> list[Path]:
    """Write the CMF and return its paths; `source` names the input in every error."""
    ModelArgs.from_header({"arch": arch, "moe": moe}, source=source)
    for name in tensors:
        check_tensor_name(name, source)
    names = canonical_order(tensors)
    if "model.embed_tokens.weight" not in tensors:
        raise UnsupportedModel(f"{source}: no 'model.embed_tokens.weight'")
    if arch["tie_word_embeddings"] == ("lm_head.weight" in tensors):
        state = "has" if "lm_head.weight" in tensors else "lacks"
        raise UnsupportedModel(
            f"{source}: tie_word_embeddings is {arch['tie_word_embeddings']} but the checkpoint {state} 'lm_head.weight'"
        )
    plan = {name: policy.choose(name, tensors[name][0]) for name in names}
    require_disk(out, DISK_NEEDS["import"], 4 * sum(math.prod(shape) for shape, _ in tensors.values()))

    def encoded():
        for name in names:
            shape, load = tensors[name]
            array = load()
            if array.shape != tuple(shape):
                raise UnsupportedModel(f"{source}: tensor '{name}' loaded as shape {array.shape}, expected {shape}")
            finite = np.isfinite(array)
            if not finite.all():
                index = np.unravel_index(int(np.argmin(finite)), array.shape)
                raise UnsupportedModel(f"{source}: tensor '{name}' holds {array[index]} at index {list(map(int, index))}")
            dtype = plan[name][0]
            peak = float(np.abs(array).max()) if dtype == "f16" and array.size else 0.0
            if peak > F16_MAX:
                raise UnsupportedModel(
                    f"{source}: tensor '{name}' reaches {peak}, beyond f16's {F16_MAX}; import with --quant f32 or bf16"
                )
            yield name, array, dtype

    fallbacks = {name: reason for name, (_, reason) in plan.items() if reason}
    return write_cmf(
        out,
        arch=arch,
        moe=moe,
        tensors=encoded(),
        quant_type=policy.default.upper(),
        provenance={**provenance, "quant_policy": policy.as_dict(), "dtype_fallbacks": fallbacks},
        tokenizer_json=tokenizer_json,
        tokenizer_config=tokenizer_config,
        force=force,
    )
