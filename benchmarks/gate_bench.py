"""The gates' reference side of a single-token chunk pattern over an fp16 cache (the stateful
kind, every fp16 package): one forward per run of single tokens (`TorchBackend.single_steps`)
against the batches of branches that checked them before (`advance_arrays`, as many branches
a batch as REFERENCE_BATCH_BYTES of their caches allow), measured in the same run; printed,
never asserted.

    python benchmarks/gate_bench.py BUNDLE [BUNDLE ...] [--context 1024] [--start 448] [--tokens 128]

The package's caches before each step are the reference's own, cut from one prefill of
start + tokens tokens (slot = position, so the cache before the step at p is that one's slots
below p), rounded to fp16 as the stateful kind keeps them. Both sides compute every step's
logits; their largest difference is printed beside the FP32 bound the gate holds each to
(`exact_tolerances`' atol).
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.ground.reference import load_reference  # noqa: E402
from pipeline.ground.torch_backend import TorchBackend  # noqa: E402
from pipeline.stages.gates.exactness import REFERENCE_BATCH_BYTES, exact_tolerances, reference_runs  # noqa: E402


def cache_at(full: tuple[np.ndarray, np.ndarray], position: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The fp16 cache before the step at `position`: `full`'s slots below it, copied when asked (as
    the gate's `cache_arrays` copies; a copy is about 0.3 % of a step's time), so only a batch's
    caches are held at once."""
    keys, values = (part.copy() for part in full)
    keys[..., position:, :] = 0
    values[..., position:, :] = 0
    return keys, values, position


def timed(run) -> tuple[float, np.ndarray]:
    began = time.perf_counter()
    logits = run()
    return time.perf_counter() - began, logits


def bench(bundle: Path, context: int, start: int, tokens: int) -> dict:
    model, args = load_reference(bundle)[:2]
    backend = TorchBackend(model, args, context, cache_dtype=np.float16)
    ids = np.random.default_rng(0).integers(0, args.vocab_size, start + tokens)
    _, prefilled = backend.prefill(ids)
    full = (prefilled.keys.numpy().astype(np.float16), prefilled.values.numpy().astype(np.float16))
    steps = ids[start:]
    # run_checked sends its pending branches once they hold REFERENCE_BATCH_BYTES or more.
    per_batch = -(-REFERENCE_BATCH_BYTES // (4 * (full[0].size + full[1].size)))

    def branches() -> np.ndarray:
        out = []
        for first in range(0, tokens, per_batch):
            batch = [(cache_at(full, start + j), steps[j:j + 1]) for j in range(first, min(first + per_batch, tokens))]
            out += [logits for logits, _ in backend.advance_arrays(batch)]
        return np.concatenate(out)

    def single_steps() -> np.ndarray:
        out, at = [], 0
        for run in reference_runs([1] * tokens, np.float16):
            out.append(backend.single_steps(cache_at(full, start + at), cache_at(full, start + at + len(run)),
                                           steps[at:at + len(run)])[0])
            at += len(run)
        return np.concatenate(out)

    single_steps()  # warm-up: first-call allocations are no part of either
    before, old = timed(branches)
    after, new = timed(single_steps)
    return {"bundle": str(bundle), "branches_a_batch": per_batch, "tokens": tokens,
            "branches_s": before, "single_steps_s": after, "speedup": before / after,
            "max_abs_delta": float(np.abs(old - new).max()), "bound": exact_tolerances(model, context)[0].atol}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", type=Path)
    parser.add_argument("--context", type=int, default=1024, help="cache slots, as the package's (default 1024)")
    parser.add_argument("--start", type=int, default=448, help="tokens in the cache before the first step")
    parser.add_argument("--tokens", type=int, default=128, help="single-token steps checked")
    args = parser.parse_args()
    print("| bundle | branches a batch | steps | branches (s) | single_steps (s) | speed-up | max abs delta | bound |")
    print("|---|---|---|---|---|---|---|---|")
    for bundle in args.bundles:
        r = bench(bundle, args.context, args.start, args.tokens)
        print(f"| {bundle} | {r['branches_a_batch']} | {r['tokens']} | {r['branches_s']:.2f} | {r['single_steps_s']:.2f} "
              f"| {r['speedup']:.1f}x | {r['max_abs_delta']:.2e} | {r['bound']:.2e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
