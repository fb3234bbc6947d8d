"""Resident memory of this process, for benchmarks that run each case in a fresh interpreter.

Linux reads /proc/self/status: getrusage's ru_maxrss survives exec there, so a child started
by a big parent would report the parent's peak. Elsewhere ru_maxrss is the best there is."""

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_mib(field: str) -> float | None:
    if not _STATUS.exists():
        return None
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    return None


def peak_rss_mib() -> float:
    """The peak resident set of this process image (VmHWM)."""
    peak = _status_mib("VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def current_rss_mib() -> float | None:
    """The resident set now (VmRSS); None where /proc is missing."""
    return _status_mib("VmRSS")
