"""A palette's cost and output error, beside coremltools' own palettizer on the same weight: its
k-means LUT per group of output rows (`_get_kmeans_lookup_table_and_weight`, what
`palettize_weights(mode="kmeans", granularity="per_grouped_channel")` runs per group), measured in
the same run. Ours is `coreml.codes.gptq_palette` with a scale per row: k-means weighted by the
inputs' second moments, GPTQ's error feedback on the LUT grid, and the preconditioned LUT refit.

    python benchmarks/palette_bench.py [--bundle BUNDLE --weight NAME] [--nbits 4] [--rows 32]

The weight is a bundle's (default: a t(4)-tailed random one of SmolLM2's MLP shape, 1536 x 576).
The inputs' second moments H are synthetic, correlated channels whose energies span 100x with a
few outliers, as real layers' are: no calibration text runs here. Output error is
tr((W - W_hat) H (W - W_hat)^T), each side decoded in fp16 as the package stores it. Printed,
never asserted.
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coreml import codes  # noqa: E402


def synthetic_hessian(cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4 * cols, cols)) * np.geomspace(0.01, 1, cols)[rng.permutation(cols)]
    x[:, :3] *= 20  # outlier channels
    x = x @ (np.eye(cols) + 0.3 * rng.standard_normal((cols, cols)) / np.sqrt(cols))
    return (x.T @ x / len(x)).astype(np.float32)


def coremltools_palette(w: np.ndarray, nbits: int, rows: int) -> np.ndarray:
    """coremltools' k-means palette of each `rows`-row group, decoded in fp16."""
    from coremltools.models.neural_network.quantization_utils import _get_kmeans_lookup_table_and_weight

    decoded = np.empty_like(w)
    for start in range(0, len(w), rows):
        lut, indices = _get_kmeans_lookup_table_and_weight(nbits, w[start:start + rows])
        decoded[start:start + rows] = lut.astype(np.float16)[indices.reshape(-1)].reshape(w[start:start + rows].shape)
    return decoded


def output_error(w: np.ndarray, decoded: np.ndarray, h: np.ndarray) -> float:
    e = (w - decoded).astype(np.float64)
    return float(np.einsum("ij,ij->", e @ h, e))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", type=Path)
    parser.add_argument("--weight", default="model.layers.15.mlp.down_proj.weight")
    parser.add_argument("--nbits", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32, help="output rows per LUT")
    args = parser.parse_args()
    if args.bundle is not None:
        from safetensors import safe_open

        with safe_open(args.bundle / "weights.safetensors", framework="numpy") as weights:
            w = weights.get_tensor(args.weight).astype(np.float32)
        what = f"{args.bundle.name}: {args.weight}"
    else:
        w = (np.random.default_rng(1).standard_t(4, size=(1536, 576)) * 0.02).astype(np.float32)
        what = "t(4) random weight"
    h = synthetic_hessian(w.shape[1])
    rows, cols = w.shape
    print(f"{what} [{rows} x {cols}], {args.nbits} bits per {args.rows} rows, synthetic correlated inputs")
    start = time.perf_counter()
    theirs = coremltools_palette(w, args.nbits, args.rows)
    their_seconds = time.perf_counter() - start
    start = time.perf_counter()
    palette = codes.gptq_palette(w, h, args.nbits, (args.rows, cols), row_scale=True)
    our_seconds = time.perf_counter() - start
    ours = palette.decode()
    their_error, our_error = output_error(w, theirs, h), output_error(w, ours, h)
    # The weights' own squared error, which k-means minimises and GPTQ trades for output error.
    their_mse, our_mse = (float(np.square(w - d, dtype=np.float64).sum()) for d in (theirs, ours))
    their_bits = args.nbits + (1 << args.nbits) * 16 / (args.rows * cols)
    print("| palette | bits/weight | output error | vs coremltools | weight error | vs coremltools | seconds | "
          "vs coremltools |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| coremltools k-means | {their_bits:.3f} | {their_error:.4g} | 1.00x | {their_mse:.4g} | 1.00x | "
          f"{their_seconds:.2f} | 1.00x |")
    print(f"| gptq_palette, row-scaled | {palette.bits() / w.size:.3f} | {our_error:.4g} | "
          f"{our_error / their_error:.3f}x | {our_mse:.4g} | {our_mse / their_mse:.3f}x | {our_seconds:.2f} | "
          f"{our_seconds / their_seconds:.2f}x |")


if __name__ == "__main__":
    main()
