"""Core ML packages: conversion, compression recipes, and a numpy MIL reference executor."""

import logging


class _LinuxImportNoise(logging.Filter):
    """coremltools logs, at import, that its macOS-only native proxies are missing. That is
    the expected state on Linux (prediction goes through the MIL executor here), so the
    lines carry no information; every other coremltools message still gets through."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to load _ML")


logging.getLogger("coremltools").addFilter(_LinuxImportNoise())
