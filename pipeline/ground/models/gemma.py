"""Gemma (v1): GeGLU, x_hat * (1 + w) norms (both from the arch block), scaled embeddings."""

import torch

from pipeline.ground.models.base import Decoder


class Model(Decoder):
    def embed_scale(self) -> torch.Tensor:
        # transformers keeps sqrt(hidden) as a tensor in the model dtype (float32 here) and
        # multiplies the looked-up embeddings by it; the tied LM head stays unscaled.
        return torch.tensor(self.args.hidden_size**0.5, dtype=torch.float32)
