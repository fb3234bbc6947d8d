"""A small random-weight Llama-style bundle for the Core ML conversion and recipe tests.

4 layers, GQA (4 query heads over 2 KV heads), tied head, context 128, widths that are
multiples of 32 (so every per-block/per-group recipe applies). It goes through the real
stages: CMF writer -> `export_bundle`, so the conversion reads exactly what a user's does.
"""

from pathlib import Path

import numpy as np

from pipeline.stages.bundle import export_bundle
from pipeline.ground.cmf import write_cmf

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, CONTEXT = 4, 64, 4, 2, 16, 128, 256, 128

ARCH = {
    "arch_name": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": FFN,
    "num_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "layer_types": ["FullAttention"] * LAYERS,
    "rms_norm_eps": 1e-5,
    "norm_style": "qwen",
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "max_position_embeddings": CONTEXT,
}


def random_weights(seed: int) -> dict[str, np.ndarray]:
    """HF-named weights with spreads that give O(1) logits (small ones would hide errors)."""
    rng = np.random.default_rng(seed)
    shapes = {
        "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
        "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
        "mlp.gate_proj": (FFN, HIDDEN),
        "mlp.up_proj": (FFN, HIDDEN),
        "mlp.down_proj": (HIDDEN, FFN),
    }
    weights = {"model.embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, HIDDEN)),
               "model.norm.weight": 1 + 0.1 * rng.normal(size=HIDDEN)}
    for i in range(LAYERS):
        for name, shape in shapes.items():
            weights[f"model.layers.{i}.{name}.weight"] = rng.normal(0, 0.15, shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            weights[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * rng.normal(size=HIDDEN)
    return {name: w.astype(np.float32) for name, w in weights.items()}


def make_bundle(root: Path, seed: int = 0) -> Path:
    """Write a random-weight CMF under `root` and export its FP32 bundle; the bundle dir."""
    cmf = root / "tiny.cmf"
    write_cmf(cmf, arch=ARCH, tensors=[(n, w, "f32") for n, w in random_weights(seed).items()])
    export_bundle(cmf, root / "bundle")
    return root / "bundle"


def doubled_final_norm(model, args, mitigations):
    """A conversion transform for the tests (`Conversion.transform`): the model with its final
    norm's weight doubled, so every logit doubles: a package traced from it is told apart from
    one traced from the reference. `mitigations` is the record the conversion hands over."""
    import copy

    import torch

    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.norm.weight.mul_(2.0)
    return changed
