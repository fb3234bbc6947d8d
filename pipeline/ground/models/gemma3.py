"""Gemma 3 (text): Gemma's scaled embeddings and x_hat * (1 + w) norms.

Everything else Gemma 3 adds is a capability `base` picks by tensor presence or by the arch,
as any family would: q/k norms; the four norms a layer carries (pre_feedforward_layernorm
present makes post_attention_layernorm the attention output's norm); SlidingAttention layers
(arch.sliding_window) with their own RoPE base (arch.rope_local_base_freq); queries scaled by
arch.query_pre_attn_scalar ** -0.5. Softcapping, which Gemma 2 had and 3 dropped, is refused
by `ModelArgs`, and so is a file without the keys above (`args.FAMILY_KEYS`).
"""

from pipeline.ground.models import gemma


class Model(gemma.Model):
    pass
