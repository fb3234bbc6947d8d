"""Memory that scales with the model: which stage holds the weights as a map of a file and
which as its own copy, held as properties (where a tensor's bytes live, whether a map's
pages were written), never as a timing or a measured size. The sizes themselves are
measured by benchmarks/scale_bench.py."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from rss import TreeSampler, process_tree  # noqa: E402


pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc (Linux only)")

MIB = 1 << 20


# -- the sampler


def test_sampler_counts_anonymous_memory_apart_from_mapped_file_pages(tmp_path):
    """A child that holds 64 MiB of its own and has read a 64 MiB file through a map: the
    anonymous peak holds the first and not the second, the total both; the grandchild counts
    in the tree."""
    data = tmp_path / "data.bin"
    data.write_bytes(np.arange(16 * MIB, dtype=np.float32).tobytes())
    child = (
        "import subprocess, sys, numpy as np\n"
        f"own = np.ones({8 * MIB}, np.float64)\n"
        f"mapped = np.memmap({str(data)!r}, dtype=np.uint8, mode='r'); mapped.sum()\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE)\n"
        "print(grandchild.pid, flush=True); sys.stdin.read(); grandchild.communicate()\n"
    )
    process = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild = int(process.stdout.readline())
    sampler = TreeSampler(process.pid)
    sampler.sample()
    process.communicate("")
    peaks = sampler.result()
    assert grandchild in sampler.processes and process.pid in sampler.processes
    assert peaks["process_anon"] >= 64 * MIB
    assert peaks["process_rss"] >= peaks["process_anon"] + 64 * MIB  # the file's pages, read through the map
    assert peaks["process_anon"] < 64 * MIB + 64 * MIB  # ...which are not anonymous (interpreter and numpy < 64 MiB)
    assert peaks["tree_anon"] > peaks["process_anon"]
    assert process_tree(process.pid) == [process.pid]  # gone: only the root is named
