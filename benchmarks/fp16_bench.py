"""fp16 packages against FP32 ones of the same kind: conversion time and logits on the held-out
text, on the fixture and SmolLM2-135M; printed, never asserted.

    python benchmarks/fp16_bench.py [--models fixture smollm2] [--kinds chunk_kv stateful]
                                    [--smollm2-cmf PATH] [--work DIR] [--windows 4]

Conversion: each (kind, precision) is converted from the model's FP32 bundle at context 128 in
its own interpreter (`coreml_bench.convert`), which reports wall and CPU seconds; the fp16/FP32
ratio of each is printed (target: fp16 <= 1.5x FP32). On a shared machine wall time follows the
load, CPU time less so: both are printed.

Logits: the fp16 and FP32 packages of a kind on the numpy MIL executor (fp16 at op boundaries,
float32 inside ops), over `--windows` windows of 128 tokens of the held-out quality text
(`pipeline.ground.text_roles`, the lines the gates' quality part reads), each window one
128-token chunk from an empty cache: max |Δ logit| against FP32, whether every fp16 logit is
finite, top-1 agreement, and the perplexity of each. No bound is asserted: the gates judge fp16
packages (against the fp16 reference, and the FP32 model under the budget); these are figures.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from coreml_bench import CONTEXT, FIXTURE_CMF, convert  # noqa: E402

PRECISIONS = ("fp32", "fp16")
TIME_TARGET = 1.5


def windows(cmf: Path, count: int) -> list[np.ndarray]:
    from pipeline.ground.text_roles import text_roles
    from pipeline.ground.tokenizer import tokenizer_from_artifact

    lines = (ROOT / "fixtures" / "botchan.txt").read_text(encoding="utf-8").splitlines()
    ids = tokenizer_from_artifact(cmf).encode("\n".join(text_roles(lines)["quality"]))
    return [np.asarray(ids[i * CONTEXT:(i + 1) * CONTEXT], dtype=np.int32) for i in range(count)]


def nll(logits: np.ndarray, ids: np.ndarray) -> float:
    """Mean negative log-likelihood of ids[1:] (float64 log-softmax of float32 logits)."""
    x = logits[:-1].astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    log_probs = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return float(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean())


def compare(packages: dict[str, Path], cases: list[np.ndarray]) -> dict:
    from coreml.runner import open_package_backend

    logits = {}
    for precision, path in packages.items():
        backend = open_package_backend(path, backend="executor")
        logits[precision] = [backend.logits(ids) for ids in cases]
        del backend
    fp32, fp16 = logits["fp32"], logits["fp16"]
    finite = all(np.isfinite(x).all() for x in fp16)
    with np.errstate(invalid="ignore"):
        delta = max(float(np.abs(a - b).max()) for a, b in zip(fp32, fp16))
    return {"max_abs": delta, "finite": bool(finite),
            "nonfinite": int(sum((~np.isfinite(x)).sum() for x in fp16)),
            "top1": float(np.mean(np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(fp32, fp16)]))),
            "ppl": {p: float(np.exp(np.mean([nll(x, ids) for x, ids in zip(logits[p], cases)]))) for p in logits}}


def bench_model(label: str, cmf: Path, kinds: tuple[str, ...], count: int, work: Path, log) -> dict:
    from pipeline.stages.bundle import export_bundle

    bundle = work / "bundle"
    if not bundle.exists():
        export_bundle(cmf, bundle)
    cases = windows(cmf, count)
    rows = {}
    for kind in kinds:
        conversions, packages = {}, {}
        for precision in PRECISIONS:
            out = work / f"{kind}-{precision}"
            print(f"  {label}: convert {kind} at {precision} ...", flush=True)
            conversions[precision] = convert(bundle, out, kind, log, precision)
            packages[precision] = out / kind
        print(f"  {label}: {kind} logits, fp16 vs FP32 on the executor ...", flush=True)
        rows[kind] = {"conversions": conversions, "logits": compare(packages, cases)}
    return rows


def print_report(models: dict, count: int) -> None:
    print(f"\n## Conversion at context {CONTEXT}, fp16 vs FP32 of the same kind (target <= {TIME_TARGET}x)\n")
    print("| model | kind | FP32 wall s | fp16 wall s | wall ratio | FP32 CPU s | fp16 CPU s | CPU ratio | FP32 MiB | fp16 MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, rows in models.items():
        for kind, row in rows.items():
            a, b = row["conversions"]["fp32"], row["conversions"]["fp16"]
            print(f"| {label} | {kind} | {a['seconds']:.1f} | {b['seconds']:.1f} | {b['seconds'] / a['seconds']:.2f} | "
                  f"{a['cpu_seconds']:.1f} | {b['cpu_seconds']:.1f} | {b['cpu_seconds'] / a['cpu_seconds']:.2f} | "
                  f"{a['package_bytes'] / 2**20:.1f} | {b['package_bytes'] / 2**20:.1f} |")
    print(f"\n## Logits on the executor, {count} x {CONTEXT} held-out tokens: fp16 package vs FP32 package\n")
    print("| model | kind | max abs Δ | all finite | non-finite | top-1 agreement | ppl FP32 | ppl fp16 |")
    print("|---|---|---|---|---|---|---|---|")
    for label, rows in models.items():
        for kind, row in rows.items():
            r = row["logits"]
            print(f"| {label} | {kind} | {r['max_abs']:.3g} | {r['finite']} | {r['nonfinite']} | {r['top1']:.4f} | "
                  f"{r['ppl']['fp32']:.3f} | {r['ppl']['fp16']:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=("fixture", "smollm2"), default=["fixture", "smollm2"])
    parser.add_argument("--kinds", nargs="+", default=["chunk_kv", "stateful"])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--smollm2-cmf", type=Path, help="an f32 CMF of SmolLM2-135M (the tests cache one under .test-cache/smollm2/)")
    parser.add_argument("--work", type=Path, help="keep the artifacts here (default: a temporary folder)")
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    work = args.work or Path(tempfile.mkdtemp(prefix="fp16-bench.", dir=ROOT / "build"))
    work.mkdir(parents=True, exist_ok=True)
    models = {}
    with open(work / "convert.log", "w") as log:
        print(f"artifacts and conversion logs in {work}")
        if "fixture" in args.models:
            models["fixture"] = bench_model("fixture", FIXTURE_CMF, tuple(args.kinds), args.windows, work / "fixture", log)
        if "smollm2" in args.models:
            if args.smollm2_cmf is None:
                raise SystemExit("--smollm2-cmf: name an f32 CMF of SmolLM2-135M")
            models["smollm2"] = bench_model("smollm2", args.smollm2_cmf, tuple(args.kinds), args.windows,
                                            work / "smollm2", log)
    (work / "fp16_bench.json").write_text(json.dumps(models, indent=1))
    print_report(models, args.windows)


if __name__ == "__main__":
    main()
