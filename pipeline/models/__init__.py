"""The reference PyTorch decoder (FP32): one short file per family, config as a dataclass.

    args = ModelArgs.from_header(header)
    model = build_model(args, weights)        # weights: Mapping of HF tensor names
    model(ids) -> logits [T, vocab]; model.forward_cached(ids, cache)
"""

import importlib
from collections.abc import Mapping

from pipeline.models.args import ModelArgs, MoeArgs
from pipeline.cmf.masks import TaskMask
from pipeline.models.base import CachedStep, Decoder, KVCache, Weights

__all__ = ["CachedStep", "Decoder", "KVCache", "ModelArgs", "MoeArgs", "build_model"]


def build_model(args: ModelArgs, weights: Mapping[str, object], masks: TaskMask | None = None,
                source: str = "weights") -> Decoder:
    """The family's decoder in eval mode; `source` names the file in error messages."""
    family = importlib.import_module(f"pipeline.models.{args.family}")
    return family.Model(args, Weights(weights, source), masks).eval()
