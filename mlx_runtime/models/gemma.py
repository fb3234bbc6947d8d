"""Gemma (v1): GeGLU and x_hat * (1 + w) norms (both from the arch block), scaled embeddings."""

from pipeline.ground.models import ModelArgs
from mlx_runtime.models import base


class Family(base.Family):
    @staticmethod
    def embed_scale(args: ModelArgs) -> float:
        return args.hidden_size**0.5
