"""A package's greedy continuation beside the references it is judged by, in one run: the
package (split or not, any precision, on the executor or Core ML), the torch reference of the
numerics it intends (for an fp16 package: the fp16 reference with its mitigations, one
unsplit model; `pipeline.stages.gates.references`), and FP32's torch reference of its bundle.

Prints, for each, the tokens, the text, where it first parts from the package, and seconds per
new token; writes the same as JSON. A chat prompt goes through the model's chat template.

    python benchmarks/greedy_bench.py build/qwen15/coreml-fp16-split/stateful \\
        --prompt "Write a Python function that checks whether a number is prime." --chat --new 32 \\
        --out build/qwen15/greedy.json
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.ground.generation import first_difference, generate  # noqa: E402


def _greedy(backend, prompt: np.ndarray, new: int) -> tuple[list[int], float]:
    start = time.perf_counter()
    tokens = list(generate(backend, prompt, max_tokens=new))
    return tokens, (time.perf_counter() - start) / max(1, len(tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", type=Path, help="a package folder from `cmfdeploy coreml` or `compress`")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as one user turn of the chat template")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--backend", default="executor")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from coreml.runner import open_package_backend
    from pipeline.ground.chat import chat_ids
    from pipeline.ground.tokenizer import tokenizer_from_artifact
    from pipeline.stages.gates.lineage import resolve_lineage
    from pipeline.stages.gates.references import intended_references

    lineage = resolve_lineage(args.package)
    tokenizer = tokenizer_from_artifact(args.package)
    prompt = np.asarray(chat_ids(tokenizer, [{"role": "user", "content": args.prompt}]) if args.chat
                        else tokenizer.encode(args.prompt), np.int64)
    report = {"package": str(args.package), "prompt": args.prompt, "chat": args.chat,
              "prompt_tokens": int(prompt.size), "new": args.new, "runs": {}}

    def record(name: str, tokens: list[int], seconds: float) -> None:
        package = report["runs"].get("package", {}).get("tokens", tokens)
        report["runs"][name] = {"tokens": tokens, "text": tokenizer.decode(tokens),
                                "equal_to_package": tokens == package,
                                "first_difference": first_difference(tokens, package),
                                "seconds_per_token": round(seconds, 3)}
        print(f"{name}: {json.dumps(report['runs'][name]['text'])} (first difference from the package: "
              f"{report['runs'][name]['first_difference']}, {seconds:.2f} s/token)", flush=True)

    record("package", *_greedy(open_package_backend(args.package, backend=args.backend), prompt, args.new))
    gc.collect()
    intended, fp32 = intended_references(args.package, lineage.manifest, lineage.bundle)
    report["intended_numerics"] = intended.numerics
    if intended is not fp32:
        record(f"intended reference ({intended.numerics})", *_greedy(intended, prompt, args.new))
    record("FP32 reference (torch, bundle)", *_greedy(fp32, prompt, args.new))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
