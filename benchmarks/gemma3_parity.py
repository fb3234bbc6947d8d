"""Gemma 3 270M parity: the bundle's reference, the three Core ML packages (on the MIL
executor) and MLX on the f32 CMF, each against transformers' Gemma3ForCausalLM read from the
same GGUF (dequantized to float32 by transformers' own GGUF loader).

Figures, written as JSON (and printed):
- logits over the first `--tokens` held-out tokens (BOS first, past the 512-token window):
  max |Δ logit| against transformers and the derived bound of two float32 evaluations of
  this model (`model_logits_bound`; with the fp16 cache term for the stateful package);
- greedy continuations of `--prompt` for `--new` tokens: equal to transformers' or not,
  and where they first part;
- token ids of the held-out text: the release's (or a package's) tokenizer against
  transformers' GGUF tokenizer.

One backend at a time is held (logits of a 262k vocabulary over 1024 positions are 1 GB).

    python benchmarks/gemma3_parity.py --gguf build/gemma3-gguf/gemma-3-270m-q4_k_m.gguf \\
        --build build/gemma-3-270m-q4_k_m [--release dist/gemma-3-270m-q4_k_m-int8-b32] --out parity.json
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

from pipeline.ground.generation import generate  # noqa: E402
from pipeline.ground.models.numerics import model_logits_bound  # noqa: E402
from pipeline.ground.reference import load_reference  # noqa: E402
from pipeline.ground.text_roles import HELDOUT_FRACTION  # noqa: E402
from pipeline.ground.tokenizer import tokenizer_from_artifact  # noqa: E402

BOTCHAN = ROOT / "fixtures" / "botchan.txt"


def held_out_text() -> str:
    lines = BOTCHAN.read_text(encoding="utf-8").splitlines()
    return "\n".join(lines[len(lines) - len(lines) // HELDOUT_FRACTION:])


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--build", type=Path, required=True, help="build/<name>: import/, bundle/, coreml/")
    parser.add_argument("--release", type=Path, help="a release folder: its tokenizer is checked")
    parser.add_argument("--tokens", type=int, default=1024)
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
    ids = tokenizer.encode(text, add_bos=True)
    report = {"model": str(args.gguf.name), "cmf": str(cmf), "tokens": args.tokens,
              "tokenizer": {"source": str(args.release or args.build / "bundle"),
                            "held_out_tokens": int(len(ids)),
                            "ids_equal_transformers": ids.tolist() == theirs_tokenizer(text).input_ids}}
    ids = ids[:args.tokens]
    prompt = tokenizer.encode(args.prompt, add_bos=True)
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)[None]).logits[0].numpy()
        hf_greedy = hf.generate(torch.from_numpy(prompt)[None], max_new_tokens=args.new, do_sample=False,
                                min_new_tokens=args.new)[0, len(prompt):].tolist()
    del hf
    gc.collect()
    report["transformers"] = {"greedy": hf_greedy, "text": tokenizer.decode(hf_greedy)}
    reference, _, _ = load_reference(cmf)
    bounds = {cache: model_logits_bound(reference, len(ids), fp16_cache=cache) for cache in (False, True)}

    def measure(name: str, backend, fp16_cache: bool = False) -> None:
        t = time.perf_counter()
        got = np.asarray(backend.logits(ids), np.float32).reshape(len(ids), -1)
        delta = float(np.abs(got - want).max())
        top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
        del got
        greedy = list(generate(backend, prompt, max_tokens=args.new))
        report[name] = {"max_abs_logit_delta": delta, "bound": bounds[fp16_cache], "within": delta <= bounds[fp16_cache],
                        "top1_agreement": top1, "greedy_equal": greedy == hf_greedy,
                        "greedy_first_difference": first_difference(greedy, hf_greedy),
                        "text": tokenizer.decode(greedy), "seconds": round(time.perf_counter() - t, 1)}
        print(name, json.dumps(report[name]), flush=True)

    from pipeline.ground.torch_backend import TorchBackend

    if not args.no_reference:
        measure("reference (torch, f32 CMF)", TorchBackend(reference, reference.args, context=len(ids) + args.new))
    del reference
    gc.collect()
    from coreml.runner import open_package_backend

    for kind in args.kinds:
        measure(f"coreml {kind} (executor)", open_package_backend(args.build / "coreml" / kind, backend="executor"),
                fp16_cache=kind == "stateful")
        gc.collect()
    if not args.no_mlx:
        from mlx_runtime.backend import MlxBackend

        measure("mlx (f32 CMF)", MlxBackend(cmf))
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
