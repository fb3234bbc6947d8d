"""Llama, Qwen2 and Qwen3 dense decoders.

They differ only in which tensors exist (Qwen2: q/k/v biases; Qwen3: q/k norms; some
Llamas: MLP biases), and `base` reads all of those by presence, so the family is the base
decoder as it stands.
"""

from pipeline.ground.models.base import Decoder


class Model(Decoder):
    pass
