"""One table of named units (precisions, targets, package kinds, recipes): registered once, in
order, and looked up by name with an error that names who asked and what is known.

    PRECISIONS = Registry("precision", UnknownPrecision)
    FP16 = PRECISIONS.add("fp16", Precision(...))
    PRECISIONS.lookup(args.precision, "--precision")   # UnknownPrecision: "--precision: precision 'fp8' is not among [...]"

A registry is a dict in registration order, so listing, `in` and `[name]` read as usual.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from pipeline.ground.errors import CmfdeployError

Unit = TypeVar("Unit")


class RegisteredTwice(CmfdeployError):
    """Two units claim one name in a registry (a programming error found at import)."""


class Registry(dict[str, Unit], Generic[Unit]):
    def __init__(self, what: str, unknown: type[CmfdeployError]):
        super().__init__()
        self.what, self.unknown = what, unknown

    def add(self, name: str, unit: Unit) -> Unit:
        if name in self:
            raise RegisteredTwice(f"{self.what} {name!r} is registered twice")
        self[name] = unit
        return unit

    def lookup(self, name: str, where: object) -> Unit:
        """The unit `name`; the registry's `unknown` error naming `where` and the known names otherwise."""
        try:
            return self[name]
        except KeyError:
            raise self.unknown(f"{where}: {self.what} {name!r} is not among {list(self)}") from None
