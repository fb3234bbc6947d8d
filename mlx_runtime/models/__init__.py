"""The decoder families of the reference model (`pipeline.ground.models`) on MLX, weights packed.

    model = load_model(cmf, mask, skill)      # an open CmfFile; a task mask, a skill id
    forward(model, ids, cache) -> logits [T, vocab]

`base` holds everything the families share; family `f` (`ModelArgs.family`) is the module
`mlx_runtime.models.f`, whose `Family` overrides what that family does differently, as
`pipeline.ground.models.f` does for the reference decoder.
"""

from __future__ import annotations

import importlib

from pipeline.ground.cmf import CmfFile
from pipeline.ground.cmf.masks import TaskMask
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models import ModelArgs
from mlx_runtime.models.base import Model, forward, load_decoder

__all__ = ["Model", "forward", "load_model"]


def load_model(cmf: CmfFile, mask: TaskMask | None = None, skill: str | None = None) -> Model:
    """The model of an open CMF file, weights packed on MLX; `mask` a task mask, `skill` an id."""
    if cmf.is_skill_file:
        raise UnsupportedModel(f"{cmf.path.name}: a skill file (feature bit 6) never runs on its own; "
                               "apply it to its base (pipeline.ground.cmf.skills.apply_skill_file) and load that")
    args = ModelArgs.from_header(cmf.header, source=cmf.path.name)
    module = f"{__name__}.{args.family}"
    try:
        family = importlib.import_module(module).Family
    except ModuleNotFoundError as error:
        if error.name != module:  # a module the family's own module imports: not this refusal
            raise
        raise UnsupportedModel(f"{cmf.path.name}: arch.arch_name {args.arch_name!r} (family {args.family!r}) "
                               f"has no MLX decoder ({module} is missing)") from None
    return load_decoder(family, cmf, args, mask, skill)
