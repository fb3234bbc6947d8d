"""Compression recipes on a real model: bits per weight, perplexity, top-1 agreement, time.

    python benchmarks/compress_bench.py PACKAGE_DIR [--recipes int4-b32 ...] [--work DIR]
    python benchmarks/compress_bench.py PACKAGE_DIR --diagnose [--out report]

PACKAGE_DIR is an FP32 stateless (or chunk_kv) package, e.g. SmolLM2-135M:
`cmfdeploy bundle build/smollm2/*/SmolLM2-135M-Instruct-f32.cmf -o B` then
`cmfdeploy coreml B -o P --kinds stateless --context 128`.

Text: fixtures/botchan.txt cut by `pipeline.ground.text_roles` into calibration lines (what
calibration-aware recipes see) and quality lines (what is scored here, never calibrated
on), tokenized by the package's bundle tokenizer.

Recipe mode: each recipe compresses the package (`compress_package`, timed; the FP32
conversion of the same bundle is timed in the same run as the ratio's baseline); the
compressed package's constants are decoded by the MIL executor's own constexpr ops
(`coreml.mil.executor.Executor`) and loaded into the torch reference model, which by the
survey's exactness gate computes what the package computes; perplexity over the quality
text in non-overlapping 128-token windows (BOS first, `pipeline.stages.evaluate.windows`) and
top-1 agreement with the FP32 model per predicted token. Bits per weight as mlx-lm and
Core ML count them: bytes of the package's weight file (codes, scales, offsets, LUTs and
the uncompressed tensors) x 8 over the bundle's parameter count.

Diagnose mode: per weight tensor, the relative error ||W_hat - W|| / ||W|| and the same over
its largest 1% of |w|, for plain numpy quantizers of that tensor (absmax symmetric int4 per
32, which is what coremltools' linear_symmetric computes; min/max affine int4 per 32 as in
mlx-lm's q4 g32; a 16-entry k-means LUT per 32 output rows, coremltools' grouped-channel
palette) and for what each recipe's own encoder gives; then the perplexity change with
only the embedding, or only the decoder layers, coded each way.
Printed and written as JSON + markdown; never asserted.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coreml import codes  # noqa: E402
from coreml.calibration import logprobs_with  # noqa: E402
from coreml.manifest import verify_package  # noqa: E402
from coreml.recipes import EMBEDDING, RECIPES, Weight, compress_package  # noqa: E402
from manifests.chain import upstream_path  # noqa: E402
from pipeline.stages.evaluate import windows  # noqa: E402
from pipeline.ground.reference import load_reference  # noqa: E402
from pipeline.stages.report import md_table  # noqa: E402
from pipeline.ground.text_roles import text_roles  # noqa: E402
from pipeline.ground.tokenizer import tokenizer_from_artifact  # noqa: E402

TEXT = ROOT / "fixtures" / "botchan.txt"
WINDOW = 128
DEFAULT_RECIPES = ("int8-b32", "int4-b32", "palette6-gc32", "palette4-gc32", "mixed", "cmf-native")


class Model:
    """The FP32 reference of a package with swappable weights, scored on the quality text."""

    def __init__(self, package: Path):
        manifest = verify_package(package, hashes=False)
        self.bundle = upstream_path(package, manifest["source"])
        self.model, _, _ = load_reference(self.bundle)
        self.model.eval()
        self.original = {n: t.detach().clone() for n, t in self.model.state_dict().items()}
        tokenizer = tokenizer_from_artifact(self.bundle)
        roles = text_roles(TEXT.read_text(encoding="utf-8").splitlines(), where=str(TEXT))
        self.calibration = np.asarray(tokenizer.encode("\n".join(roles["calibration"])), np.int64)
        quality = np.asarray(tokenizer.encode("\n".join(roles["quality"])), np.int64)
        self.windows = windows(quality, WINDOW, tokenizer.bos_id)
        self.parameters = sum(t.numel() for n, t in self.original.items())
        self.fp32 = logprobs_with(self.model, self.original, self.windows, {})

    def score(self, weights: dict[str, np.ndarray] | None = None) -> dict:
        """Perplexity and top-1 agreement with FP32 over the quality windows, `weights` swapped in."""
        got = logprobs_with(self.model, self.original, self.windows, weights or {})
        nll, agree, count = 0.0, 0, 0
        for w, p, q in zip(self.windows, self.fp32, got):
            nll -= q[np.arange(len(w) - 1), w[1:]].sum()
            agree += int((p[:-1].argmax(-1) == q[:-1].argmax(-1)).sum())
            count += len(w) - 1
        return {"perplexity": float(np.exp(nll / count)), "top1_agreement": agree / count, "tokens": count}


def decompressed_weights(manifest) -> dict[str, np.ndarray]:
    """HF name -> the package's constant as the MIL executor's constexpr ops decode it."""
    from coreml.mil.executor import Executor
    from coreml.mil.loader import load_program

    constants = Executor(load_program(manifest.path / "model.mlpackage")).constants
    return {hf: np.asarray(constants[e["compressed_as"]], np.float32)
            for e in manifest["selection"]["weights"].values() if e["compressed"] for hf in e["hf_names"]}


def weight_bits(manifest) -> int:
    return 8 * sum(p.stat().st_size for p in (manifest.path / "model.mlpackage").rglob("weight.bin"))


def fp32_conversion_seconds(bundle: Path, work: Path) -> float:
    from coreml.convert import export_coreml

    start = time.perf_counter()
    export_coreml(bundle, work / "fp32-timing", kinds=("stateless",), context=WINDOW)
    return time.perf_counter() - start


def run_recipes(package: Path, recipes: list[str], work: Path, bpw: float | None) -> dict:
    model = Model(package)
    base = model.score()
    baseline_s = fp32_conversion_seconds(model.bundle, work)
    rows = {"fp32": {**base, "bpw": 32.0, "seconds": baseline_s}}
    print(f"fp32: ppl {base['perplexity']:.3f} over {base['tokens']} tokens; conversion {baseline_s:.1f} s", flush=True)
    for recipe in recipes:
        start = time.perf_counter()
        extra = {"calibration_ids": model.calibration} if RECIPES[recipe].calibration else {}
        if bpw is not None and recipe == "mixed":
            extra["bpw"] = bpw
        manifest = compress_package(package, recipe, work / recipe, force=True, **extra)
        seconds = time.perf_counter() - start
        weights = decompressed_weights(manifest)
        scored = model.score(weights)
        row = {**scored, "bpw": weight_bits(manifest) / model.parameters, "seconds": seconds,
               "seconds_vs_fp32_conversion": seconds / baseline_s,
               "ppl_delta": scored["perplexity"] / base["perplexity"] - 1, "compressed_tensors": len(weights)}
        if "mixed" in manifest["selection"]:
            row["choices"] = manifest["selection"]["mixed"]["choices"]
        rows[recipe] = row
        print(f"{recipe}: {row['bpw']:.3f} bpw, ppl {row['perplexity']:.3f} ({row['ppl_delta']:+.1%}), "
              f"top-1 {row['top1_agreement']:.3f}, {seconds:.1f} s", flush=True)
    return {"package": str(package), "parameters": model.parameters, "quality_tokens": base["tokens"],
            "calibration_tokens": int(len(model.calibration)), "recipes": rows}


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


PLAIN = {  # the numpy quantizers each recipe is compared with
    "sym-int4-b32": lambda w: codes.symmetric_blocks(w, 4, 32, np.float32).decode(),
    "affine-int4-b32": lambda w: codes.affine_blocks(w, 4, 32, np.float32).decode(),
    "kmeans4-gc32": lambda w: codes.kmeans_tiles(w, 4, (32, w.shape[1]), dtype=np.float32).decode(),
}


def diagnose(package: Path, recipes: list[str]) -> dict:
    model = Model(package)
    base = model.score()["perplexity"]
    methods = {**PLAIN, **{r: _recipe_encoder(r) for r in recipes}}
    tensors, decoded = [], {m: {} for m in methods}
    for name, tensor in model.original.items():
        if tensor.ndim != 2:
            continue
        w = tensor.numpy()
        big = np.abs(w) >= np.percentile(np.abs(w), 99)
        row = {"name": name, "shape": list(w.shape)}
        for method, fn in methods.items():
            w_hat = fn(name, w) if method in recipes else fn(w)
            decoded[method][name] = w_hat
            row[method] = {"rel": _relative(w_hat, w), "rel_top1pct": _relative(w_hat[big], w[big])}
        tensors.append(row)
        print(name, {m: round(row[m]["rel"], 4) for m in methods}, flush=True)
    ppl = {}
    for method, weights in decoded.items():
        layers = {n: w for n, w in weights.items() if n != EMBEDDING}
        ppl[method] = {"embedding_only": model.score({EMBEDDING: weights[EMBEDDING]})["perplexity"] / base - 1,
                       "layers_only": model.score(layers)["perplexity"] / base - 1,
                       "all": model.score(weights)["perplexity"] / base - 1}
        print(method, {k: f"{v:+.1%}" for k, v in ppl[method].items()}, flush=True)
    return {"package": str(package), "fp32_perplexity": base, "tensors": tensors, "ppl_delta": ppl}


def _recipe_encoder(recipe: str):
    """name, value -> decoded value under `recipe`'s own data-free code step."""
    def encode(name: str, w: np.ndarray) -> np.ndarray:
        step = RECIPES[recipe].steps(Weight("", (name,), w.shape, (), ()))
        return np.asarray(step["code"].encode(w).decode(), np.float32)
    return encode


def markdown(result: dict) -> str:
    if "recipes" in result:
        rows = [[name, f"{r['bpw']:.3f}", f"{r['perplexity']:.3f}", f"{r.get('ppl_delta', 0.0):+.2%}",
                 f"{r['top1_agreement']:.3f}", f"{r['seconds']:.1f}"] for name, r in result["recipes"].items()]
        return (f"# Compression on {result['package']}\n\n{result['quality_tokens']} quality tokens, "
                f"{result['calibration_tokens']} calibration tokens, {result['parameters']} parameters\n\n"
                + md_table(["recipe", "bits/weight", "perplexity", "Δ ppl", "top-1 agreement", "seconds"], rows))
    methods = list(result["ppl_delta"])
    rows = [[m, *(f"{result['ppl_delta'][m][k]:+.1%}" for k in ("embedding_only", "layers_only", "all")),
             f"{np.median([t[m]['rel'] for t in result['tensors']]):.4f}",
             f"{np.median([t[m]['rel_top1pct'] for t in result['tensors']]):.4f}"] for m in methods]
    return (f"# Per-tensor diagnosis of {result['package']}\n\nFP32 perplexity {result['fp32_perplexity']:.3f}\n\n"
            + md_table(["method", "Δ ppl embedding only", "Δ ppl layers only", "Δ ppl all",
                        "median rel. error", "median rel. error, top 1% |w|"], rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES), choices=list(RECIPES))
    parser.add_argument("--diagnose", action="store_true")
    parser.add_argument("--bpw", type=float, help="the mixed recipe's budget (default coreml.recipes.MIXED_BPW)")
    parser.add_argument("--work", type=Path, help="folder for the compressed packages (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=Path("compress_bench"), help="report stem (.json, .md)")
    args = parser.parse_args()
    if args.diagnose:
        code_recipes = [r for r in args.recipes if "code" in RECIPES[r].params_record()]
        result = diagnose(args.package, code_recipes)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            result = run_recipes(args.package, args.recipes, args.work or Path(tmp), args.bpw)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
