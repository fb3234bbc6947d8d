"""RoPE inverse frequencies in numpy (no torch here, so the MLX runtime loads without it)."""

import math

import numpy as np

from pipeline.ground.models.args import ModelArgs


def rope_inv_freq(args: ModelArgs, layer_type: str = "FullAttention") -> np.ndarray:
    """Inverse frequencies float32 [head_dim / 2] of `layer_type`'s layers, transformers' formula
    step by step.

    Shared by the torch reference and the MLX runtime. numpy's float32 power and torch's fused
    elementwise kernels may round differently, so values can sit an ulp from transformers'.
    """
    dim = args.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    if layer_type == "SlidingAttention" and args.rope_local_base_freq is not None:
        # Gemma 3's local RoPE: its own base, and transformers applies rope scaling to the
        # full-attention layers alone.
        return 1.0 / (args.rope_local_base_freq ** exponents)
    inv_freq = 1.0 / (args.rope_theta ** exponents)
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)
