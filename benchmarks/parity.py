"""A real model's parity with transformers: the bundle's reference, the Core ML packages (on the
MIL executor) and MLX on the f32 CMF, each against transformers' own model read from the same
GGUF (dequantized to float32 by transformers' GGUF loader). Run on Gemma 3 270M and
Qwen2.5-Coder-0.5B-Instruct (docs/QWEN2.md).

Figures, written as JSON (and printed):
- logits over the first `--tokens` held-out tokens (with BOS unless `--no-bos`: Qwen2's
  tokenizer adds none): max |Δ logit| against transformers and the derived bounds of two
  float32 evaluations of this model (`model_logits_bound`, probable and worst case; with the
  fp16 cache term for the stateful package), top-1 agreement;
- with `--decode N`, for every backend with a cache: the first `--tokens` - N tokens
  prefilled, then the last N fed one at a time up to the last position (a package's last
  slot where `--tokens` is its context), the same comparison on those N rows;
- greedy continuations of `--prompt` for `--new` tokens: equal to transformers' or not,
  and where they first part;
- token ids of the held-out text: the release's (or the bundle's) tokenizer against
  transformers' GGUF tokenizer.

One backend at a time is held (logits of a 262k vocabulary over 1024 positions are 1 GB).

    python benchmarks/parity.py --gguf build/gemma3-gguf/gemma-3-270m-q4_k_m.gguf \\
        --build build/gemma-3-270m-q4_k_m [--release dist/gemma-3-270m-q4_k_m-int8-b32] --out parity.json
    python benchmarks/parity.py --gguf build/qwen2-gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --no-bos \\
        --build build/qwen2.5-coder-0.5b-instruct-q4_k_m --tokens 2048 --decode 8 --out parity.json
"""

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pipeline.ground.generation import first_difference, generate  # noqa: E402
from pipeline.ground.models.numerics import model_logits_bound  # noqa: E402
from pipeline.ground.reference import load_reference  # noqa: E402
from pipeline.ground.text_roles import held_out  # noqa: E402
from pipeline.ground.tokenizer import tokenizer_from_artifact  # noqa: E402

BOTCHAN = ROOT / "fixtures" / "botchan.txt"


def held_out_text() -> str:
    return "\n".join(held_out(BOTCHAN.read_text(encoding="utf-8").splitlines()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--build", type=Path, required=True, help="build/<name>: import/, bundle/, coreml/")
    parser.add_argument("--release", type=Path, help="a release folder: its tokenizer is checked")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--no-bos", action="store_true", help="encode without BOS (a tokenizer that adds none: Qwen2)")
    parser.add_argument("--decode", type=int, default=0,
                        help="the last N of --tokens fed one at a time after the rest, on every backend with a cache")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--kinds", nargs="*", default=["stateless", "chunk_kv", "stateful"])
    parser.add_argument("--no-mlx", action="store_true")
    parser.add_argument("--no-reference", action="store_true", help="skip the torch reference decoder")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    cmf = next((args.build / "import").glob("*.cmf"))
    started = time.perf_counter()
    theirs_tokenizer = AutoTokenizer.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name, local_files_only=True)
    hf = AutoModelForCausalLM.from_pretrained(args.gguf.parent, gguf_file=args.gguf.name, dtype=torch.float32,
                                              local_files_only=True).eval()
    tokenizer = tokenizer_from_artifact(args.release or args.build / "bundle")
    text = held_out_text()
    ids = tokenizer.encode(text, add_bos=not args.no_bos)
    report = {"model": str(args.gguf.name), "cmf": str(cmf), "tokens": args.tokens,
              "tokenizer": {"source": str(args.release or args.build / "bundle"),
                            "held_out_tokens": int(len(ids)),
                            "ids_equal_transformers": ids.tolist() == theirs_tokenizer(text).input_ids}}
    ids = ids[:args.tokens]
    prompt = tokenizer.encode(args.prompt, add_bos=not args.no_bos)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)[None]).logits[0].numpy()
        hf_greedy = hf.generate(torch.from_numpy(prompt)[None], max_new_tokens=args.new, do_sample=False,
                                min_new_tokens=args.new)[0, len(prompt):].tolist()
    del hf
    gc.collect()
    report["transformers"] = {"greedy": hf_greedy, "text": tokenizer.decode(hf_greedy)}
    # The bundle is what the packages are converted from; its reference is the torch decoder over its map.
    reference, _, _ = load_reference(args.build / "bundle")
    bounds = {(cache, probable): model_logits_bound(reference, len(ids), fp16_cache=cache, probable=probable)
              for cache in (False, True) for probable in (False, True)}

    def measure(name: str, backend, fp16_cache: bool = False, cached: bool = True) -> None:
        t = time.perf_counter()
        got = np.asarray(backend.logits(ids), np.float32).reshape(len(ids), -1)
        delta = float(np.abs(got - want).max())
        top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
        del got
        # The probable form of the derived bound is the one asserted, as the real-model tests do
        # (the worst case grows as the chain and is about a logit's spread on 24 layers).
        bound, worst = bounds[fp16_cache, True], bounds[fp16_cache, False]
        record = {"max_abs_logit_delta": delta, "bound": bound, "worst_case_bound": worst, "within": delta <= bound,
                  "top1_agreement": top1}
        if args.decode and cached:
            split = len(ids) - args.decode
            _, snapshot = backend.prefill(ids[:split])
            rows = []
            for at in range(split, len(ids)):
                logits, snapshot = backend.advance(snapshot, ids[at:at + 1])
                rows.append(np.asarray(logits, np.float32).reshape(1, -1))
            decoded = float(np.abs(np.concatenate(rows) - want[split:]).max())
            record["decode"] = {"prefill": split, "single_tokens": args.decode, "max_abs_logit_delta": decoded,
                                "within": decoded <= bound}
        greedy = list(generate(backend, prompt, max_tokens=args.new))
        report[name] = {**record, "greedy_equal": greedy == hf_greedy,
                        "greedy_first_difference": first_difference(greedy, hf_greedy),
                        "text": tokenizer.decode(greedy), "seconds": round(time.perf_counter() - t, 1)}
        print(name, json.dumps(report[name]), flush=True)

    from pipeline.ground.torch_backend import TorchBackend

    if not args.no_reference:
        measure("reference (torch, bundle)", TorchBackend(reference, reference.args, context=len(ids) + args.new))
    del reference
    gc.collect()
    from coreml.runner import open_package_backend

    for kind in args.kinds:
        measure(f"coreml {kind} (executor)", open_package_backend(args.build / "coreml" / kind, backend="executor"),
                fp16_cache=kind == "stateful", cached=kind != "stateless")
        gc.collect()
    if not args.no_mlx:
        from mlx_runtime.backend import MlxBackend

        measure("mlx (f32 CMF)", MlxBackend(cmf))
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
