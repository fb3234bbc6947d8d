"""Llama, Qwen2 and Qwen3 dense decoders: they differ only in which tensors exist (biases,
q/k norms), which the base reads by presence, so the family is the base decoder as it stands."""

from mlx_runtime.models import base


class Family(base.Family):
    pass
