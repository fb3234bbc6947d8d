"""A package kind: one registered unit that knows its interface, graph, exporter, runner,
cache dtype and usage snippet, so adding a kind is adding one module under coreml/kinds/.

    @register_kind
    class ChunkKV(PackageKind):
        name = "chunk_kv"
        ...
"""

from __future__ import annotations

import numpy as np

from pipeline.ground.errors import CmfdeployError


class UnknownKind(CmfdeployError):
    """A package kind no module under coreml/kinds/ registers."""


class PackageKind:
    """What every stage asks of a package kind; subclasses set the attributes and methods."""

    name: str
    # One line for the package's Core ML description and the release page.
    description: str
    # The dtype of the K/V cache the package carries (inputs/outputs or state); None for a
    # kind without a cache. The gates' intended-numerics reference rounds its cache to it.
    cache_dtype: type[np.floating] | None = None


KINDS: dict[str, PackageKind] = {}


def register_kind(cls: type[PackageKind]) -> type[PackageKind]:
    """Class decorator: one instance of `cls` joins KINDS under `cls.name`."""
    if cls.name in KINDS:
        raise ValueError(f"package kind {cls.name!r} is registered twice")
    KINDS[cls.name] = cls()
    return cls


def package_kind(name: str, where: object = "package") -> PackageKind:
    """The registered kind `name`; UnknownKind naming `where` and the known kinds otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownKind(f"{where}: package kind {name!r} is not among {list(KINDS)}") from None
