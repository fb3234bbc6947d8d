"""Package kinds, one module each (`export` and `cache_runner` are what they share);
importing this package registers them all, in the order below (the conversion's default
order and the order of the gates' list)."""

from coreml.kinds.base import KINDS, PackageKind, UnknownKind, package_kind, register_kind
from coreml.kinds import stateless  # noqa: E402,F401  (each module registers its kind)
from coreml.kinds import chunk_kv  # noqa: E402,F401
from coreml.kinds import stateful  # noqa: E402,F401

__all__ = ["KINDS", "PackageKind", "UnknownKind", "package_kind", "register_kind"]
