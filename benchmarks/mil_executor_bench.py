"""MIL executor speed: the numpy executor against torch eager on the same tiny decoder.

Printed, never asserted. Each line is a ratio executor / torch eager measured in the same
run (both single-threaded, so a shared machine skews them alike), for the stateless package
at several T, one decode step of the stateful package, and package open time (including
constexpr decompression) for the int4 and 4-bit palette packages.

    python benchmarks/mil_executor_bench.py [--repeats 30]
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: match torch's single thread

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import _mil_modules as mm  # noqa: E402
from coreml.package import open_package  # noqa: E402


def per_call(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        paths = mm.build_packages(tmp)["paths"]
        pkg, module = open_package(paths["stateless"], backend="executor"), mm.TinyDecoder().eval()
        rng = np.random.default_rng(0)
        for T in (1, 16, 128):
            ids = rng.integers(0, mm.VOCAB, size=(1, T), dtype=np.int32)
            ours = per_call(lambda: pkg.predict({"ids": ids}), args.repeats)
            with torch.no_grad():
                theirs = per_call(lambda: module(torch.from_numpy(ids)), args.repeats)
            print(f"stateless T={T:4d}: executor {ours * 1e3:7.2f} ms  torch {theirs * 1e3:7.2f} ms  ratio {ours / theirs:5.2f}")

        pkg, module = open_package(paths["stateful"], backend="executor"), mm.TinyDecoderStateful().eval()
        state, ids, pos = pkg.make_state(), np.array([[5]], np.int32), np.array([20], np.int32)
        ours = per_call(lambda: pkg.predict({"ids": ids, "position": pos}, state=state), args.repeats)
        with torch.no_grad():
            theirs = per_call(lambda: module(torch.from_numpy(ids), torch.from_numpy(pos)), args.repeats)
        print(f"stateful decode  : executor {ours * 1e3:7.2f} ms  torch {theirs * 1e3:7.2f} ms  ratio {ours / theirs:5.2f}")

        for kind in ("int4", "pal4"):
            opened = per_call(lambda: open_package(paths[kind], backend="executor"), 5)
            plain = per_call(lambda: open_package(paths["stateless"], backend="executor"), 5)
            print(f"open {kind:5s}       : {opened * 1e3:7.2f} ms  (uncompressed {plain * 1e3:.2f} ms, ratio {opened / plain:5.2f})")


if __name__ == "__main__":
    main()
