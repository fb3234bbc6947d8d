"""Gemma 3 (text): Gemma's scaled embeddings and x_hat * (1 + w) norms.

Everything else Gemma 3 adds is a capability `base` picks by tensor presence or by the arch,
as any family would: q/k norms; the four norms a layer carries (pre_feedforward_layernorm
present makes post_attention_layernorm the attention output's norm); SlidingAttention layers
(arch.sliding_window) with their own RoPE base (arch.rope_local_base_freq); queries scaled by
arch.query_pre_attn_scalar ** -0.5. Softcapping, which Gemma 2 had and 3 dropped, is refused
by `ModelArgs`.
"""

from pipeline.ground.cmf.masks import TaskMask
from pipeline.ground.models import gemma
from pipeline.ground.models.args import ModelArgs
from pipeline.ground.models.base import Weights
from pipeline.ground.models.errors import ModelConfigError


class Model(gemma.Model):
    def __init__(self, args: ModelArgs, weights: Weights, masks: TaskMask | None = None):
        # base falls back to head_dim ** -0.5 and to one RoPE base, which Gemma 3 never means
        # (the 27B's scalar is not its head_dim): a file without these keys is refused.
        needed = {"query_pre_attn_scalar": args.query_pre_attn_scalar}
        if "SlidingAttention" in args.layer_types:
            needed["rope_local_base_freq"] = args.rope_local_base_freq
        for key, value in needed.items():
            if value is None:
                raise ModelConfigError(f"{weights.source}: arch.{key} is missing (gemma3 needs it)")
        super().__init__(args, weights, masks)
