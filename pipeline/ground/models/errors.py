"""Typed errors of the reference model area."""

from pipeline.ground.errors import CmfdeployError


class ModelConfigError(CmfdeployError):
    """An architecture block or a weight set is missing a key or tensor, or has the wrong shape."""


class ContextOverflow(CmfdeployError):
    """A cached forward would write past the end of its KV cache."""
