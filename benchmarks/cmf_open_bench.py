"""open_cmf cost is O(directory), not O(weights): printed (never asserted).

Writes two files with the same directory (same tensor names, dtypes and count) but
payloads 64x apart in size — 16 MiB and 1 GiB by default — into a temporary
directory, times `open_cmf` + close on each, and prints the ratio (about 1 when open
never touches the blob). Write and verify throughput of the same files come along as
context: a list of tensors is written straight into place, a generator is staged and
copied in-kernel. The files are deleted afterwards.

    python benchmarks/cmf_open_bench.py [--small-mb 16] [--large-mb 1024] [--tensors 96]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.ground.cmf import RawTensor, dtype_by_name, open_cmf, verify_cmf, write_cmf  # noqa: E402

# A mix of fixed-size dtypes, so open runs each size rule.
DTYPE_CYCLE = ("f32", "f16", "q4_block", "q8_row")
COLS = 4096


def tensors(total_mb: int, count: int):
    """`count` tensors adding up to about total_mb MiB; payloads are untouched zero pages (content is irrelevant)."""
    per_tensor = (total_mb << 20) // count
    for i in range(count):
        dtype = dtype_by_name(DTYPE_CYCLE[i % len(DTYPE_CYCLE)])
        bytes_per_row = dtype.fixed_nbytes((1, COLS))
        rows = max(1, per_tensor // bytes_per_row)
        shape = (rows, COLS)
        yield RawTensor(f"model.layers.{i}.w", dtype.id, shape, np.zeros(dtype.fixed_nbytes(shape), np.uint8))


def best_open_seconds(path: Path, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        with open_cmf(path):
            pass
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-mb", type=int, default=16)
    parser.add_argument("--large-mb", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=96)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()

    arch = {"arch_name": "bench", "num_layers": args.tensors}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, mb in (("small", args.small_mb), ("large", args.large_mb)):
            path = Path(tmp) / f"{label}.cmf"
            t = time.perf_counter()
            write_cmf(path, arch=arch, tensors=list(tensors(mb, args.tensors)))
            write_s = time.perf_counter() - t
            t = time.perf_counter()
            write_cmf(path, arch=arch, tensors=tensors(mb, args.tensors), force=True)
            staged_s = time.perf_counter() - t
            size = path.stat().st_size
            with open_cmf(path) as cmf:
                n = len(cmf.tensors)
                dir_len = cmf.envelope.dir_len
                t = time.perf_counter()
                verify_cmf(cmf)
                verify_s = time.perf_counter() - t
            open_s = best_open_seconds(path, args.repeat)
            results[label] = open_s
            print(
                f"{label:5s} {size / 2**20:8.1f} MiB  {n} tensors, dir {dir_len} B  "
                f"open {open_s * 1e3:7.3f} ms   write {size / write_s / 1e9:5.2f} GB/s "
                f"(generator, staged: {size / staged_s / 1e9:5.2f} GB/s)   verify {size / verify_s / 1e9:5.2f} GB/s"
            )
            path.unlink()
    ratio = results["large"] / results["small"]
    scale = args.large_mb / args.small_mb
    print(f"open time ratio large/small: {ratio:.2f} for a {scale:.0f}x larger blob (O(directory): ~1)")


if __name__ == "__main__":
    main()
