"""The reference PyTorch decoder (FP32): one short file per family, config as a dataclass.

    args = ModelArgs.from_header(header)
    model = build_model(args, weights)        # weights: Mapping of HF tensor names
    model(ids) -> logits [T, vocab]; model.forward_cached(ids, cache)

torch loads on first use of a decoder piece, so the config, errors, weight ledger and RoPE
(`args`, `errors`, `weights`, `rope`) serve the MLX runtime without it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pipeline.ground.models.args import ModelArgs, MoeArgs
from pipeline.ground.cmf.masks import TaskMask

if TYPE_CHECKING:
    from pipeline.ground.models.base import Decoder

__all__ = ["CachedStep", "Decoder", "KVCache", "ModelArgs", "MoeArgs", "build_model"]
_TORCH_NAMES = ("CachedStep", "Decoder", "KVCache", "Weights")


def __getattr__(name: str):
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("pipeline.ground.models.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def build_model(args: ModelArgs, weights: Mapping[str, object], masks: TaskMask | None = None,
                source: str = "weights") -> Decoder:
    """The family's decoder in eval mode; `source` names the file in error messages."""
    family = importlib.import_module(f"pipeline.ground.models.{args.family}")
    base = importlib.import_module("pipeline.ground.models.base")
    return family.Model(args, base.Weights(weights, source), masks).eval()
