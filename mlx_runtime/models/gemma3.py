"""Gemma 3 (text): Gemma's scaled embeddings (sqrt(hidden), float32; the tied head unscaled)
and x_hat * (1 + w) norms.

The rest is what `base` picks by tensor presence or by the arch, as the reference decoder
does: q/k norms, sandwich norms, SlidingAttention layers with their own RoPE base, and the
query scale arch.query_pre_attn_scalar ** -0.5.
"""

from mlx_runtime.models import gemma


class Family(gemma.Family):
    pass
