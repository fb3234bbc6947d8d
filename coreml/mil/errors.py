"""Typed failures of the MIL reference executor; messages name the package, function and value."""

from pipeline.ground.errors import CmfdeployError


class MilError(CmfdeployError):
    """A saved ML Program is malformed, or an input does not fit its declared type."""


class UnsupportedOp(MilError):
    """The program uses an operation the executor does not implement."""
