"""Tensor bookkeeping shared by the torch reference and the MLX runtime (no torch here, so
the MLX runtime loads without it)."""

from collections.abc import Mapping

from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models.errors import ModelConfigError

# Tensors a decoder may carry that the reference forward has no use for.
IGNORED_PREFIXES = ("model.mtp.", "skill.")


class WeightLedger:
    """HF-named tensors handed out once each, so tensors nobody consumed can be refused.

    A tensor we do not recognise means a capability we do not implement; running without it
    would silently compute something else. Subclasses decide what a tensor is handed out as.
    """

    def __init__(self, tensors: Mapping[str, object], source: str):
        self.tensors, self.source, self.taken = tensors, source, set()

    def has(self, name: str) -> bool:
        return name in self.tensors

    def entry(self, name: str) -> object:
        if name not in self.tensors:
            raise ModelConfigError(f"{self.source}: tensor {name} is missing")
        return self.tensors[name]

    def claim(self, name: str, actual: tuple, shape: tuple) -> None:
        """Marks `name` taken once its `actual` shape fits `shape` (`None` accepts any size on that axis)."""
        if len(actual) != len(shape) or any(w is not None and w != s for w, s in zip(shape, actual)):
            want = tuple("*" if w is None else w for w in shape)
            raise ModelConfigError(f"{self.source}: tensor {name} has shape {tuple(actual)}, expected {want}")
        self.taken.add(name)

    def refuse_leftovers(self) -> None:
        leftover = sorted(n for n in self.tensors if n not in self.taken and not n.startswith(IGNORED_PREFIXES))
        if leftover:
            shown = ", ".join(leftover[:5]) + (" ..." if len(leftover) > 5 else "")
            raise UnsupportedModel(f"{self.source}: tensors this model family cannot run: {shown}")
