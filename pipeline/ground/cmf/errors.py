"""Typed CMF errors (spec §1.2). Each message names the file, the item and the offending value."""

from pipeline.ground.errors import CmfdeployError


class CmfError(CmfdeployError):
    """Base of every CMF failure."""


class InvalidMagic(CmfError):
    pass


class UnsupportedVersion(CmfError):
    pass


class UnsupportedFeature(CmfError):
    pass


class Bounds(CmfError):
    pass


class Parse(CmfError):
    pass


class HashMismatch(CmfError):
    pass


class SignatureError(CmfError):
    pass


class ShardError(CmfError):
    pass


class SkillError(CmfError):
    pass
