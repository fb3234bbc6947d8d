"""CMF library speed: hash64 and dtype decoding, printed (never asserted).

Every figure comes with a ratio to a plain numpy copy of the same number of
bytes measured in the same run, so results from different machines compare.
Targets: hash64 >= 1 GB/s, q4_block decode >= 1 GB/s of float32 output, and a
peak RSS under 1.3 GB while hashing a 1 GB memory-mapped tensor.

Open time (the reader's directory parse) is measured by the reader's own
benchmark, not here.

    python benchmarks/cmf_bench.py [--hash-mb 1024] [--rows 2048 --cols 4096]
"""

import argparse
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.ground.cmf.dtypes import dtype_by_name  # noqa: E402
from pipeline.ground.cmf.hash64 import hash64  # noqa: E402
from rss import peak_rss_mib  # noqa: E402

DECODE_DTYPES = ("q4_block", "q8_row", "vbit", "q4tp")


def _best_seconds(fn, repeat: int = 3) -> float:
    fn()  # warm caches and page in
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _copy_gbps(nbytes: int) -> float:
    src = np.ones(nbytes, np.uint8)
    return nbytes / _best_seconds(lambda: src.copy()) / 1e9


def bench_hash(size_mb: int) -> None:
    data = np.random.default_rng(0).integers(0, 256, size_mb << 20, dtype=np.uint8)
    gbps = data.nbytes / _best_seconds(lambda: hash64(data)) / 1e9
    base = _copy_gbps(data.nbytes)
    print(f"hash64        {size_mb:6d} MiB  {gbps:6.2f} GB/s   x{gbps / base:.2f} of numpy copy ({base:.2f} GB/s)")


def bench_decode(rows: int, cols: int) -> None:
    w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    base = _copy_gbps(w.nbytes)
    print(f"decode [{rows}x{cols}] float32 output; numpy copy of {w.nbytes >> 20} MiB: {base:.2f} GB/s")
    for name in DECODE_DTYPES:
        dt = dtype_by_name(name)
        payload = dt.encode(w)
        gbps = w.nbytes / _best_seconds(lambda: dt.decode(payload, w.shape)) / 1e9
        print(f"  {name:10s} payload {payload.nbytes >> 10:7d} KiB  {gbps:6.2f} GB/s   x{gbps / base:.2f} of numpy copy")


def _hash_file_and_report(path: str) -> None:
    """Child process: hash a memmap and report memory, so nothing else shares its peak."""
    rss_before = peak_rss_mib()
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tracemalloc.start()
    t = time.perf_counter()
    hash64(mm)
    seconds = time.perf_counter() - t
    _, heap_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_peak = peak_rss_mib()
    print(
        f"hash64 memmap {mm.nbytes >> 20:6d} MiB  {mm.nbytes / seconds / 1e9:6.2f} GB/s (cold pages)   "
        f"peak RSS {rss_peak:.0f} MiB (of which {rss_before:.0f} MiB before mapping; "
        f"mapped file pages count as resident), heap peak {heap_peak / 2**20:.1f} MiB"
    )


def bench_hash_memory(size_mb: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tensor.bin"
        block = np.random.default_rng(2).integers(0, 256, 64 << 20, dtype=np.uint8)
        with open(path, "wb") as f:
            for _ in range(size_mb // 64):
                block.tofile(f)
        out = subprocess.run(
            [sys.executable, __file__, "--hash-file", str(path)], capture_output=True, text=True, check=True
        )
        print(out.stdout, end="")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hash-mb", type=int, default=1024, help="size of the memory-mapped hash test (multiple of 64)")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--hash-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hash_file:
        _hash_file_and_report(args.hash_file)
        return
    bench_hash(256)
    bench_hash_memory(args.hash_mb)
    bench_decode(args.rows, args.cols)


if __name__ == "__main__":
    main()
