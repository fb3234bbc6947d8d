"""A split stateful package (`--max-package-mb`, docs/SPLIT.md) against the unsplit package of the
same bundle, precision and context, both on the same backend in the same run:

- each piece's layers and bytes on disk against the limit, and the bytes of the whole chain
  against the unsplit package's (a tied embedding is stored twice);
- the logits of a prefill of `--tokens` held-out tokens and of `--decode` single-token steps
  after it, and the caches they leave: max |Δ| chain vs unsplit (the chain computes the unsplit
  program op for op, so 0 is expected);
- seconds per prefill and per decode step, chain over unsplit (the ratio is the chain's cost:
  one call per piece, the hidden state copied between them).

    python benchmarks/split_bench.py build/SmolLM2-135M-Instruct.Q4_1/coreml-fp16-split/stateful \\
        build/SmolLM2-135M-Instruct.Q4_1/coreml-fp16/stateful --tokens 128 --decode 8
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coreml.runner import open_package_backend  # noqa: E402
from manifests.identity import MANIFEST_NAME, read_json  # noqa: E402
from pipeline.ground.tokenizer import tokenizer_from_artifact  # noqa: E402


def _run(package_dir: Path, ids: np.ndarray, decode: int, backend: str) -> dict:
    runner = open_package_backend(package_dir, backend=backend)
    start = time.perf_counter()
    logits, snapshot = runner.prefill(ids[:-decode])
    prefill = time.perf_counter() - start
    steps, start = [logits], time.perf_counter()
    for token in ids[-decode:]:
        logits, snapshot = runner.advance(snapshot, np.array([token]))
        steps.append(logits)
    return {"logits": steps, "keys": snapshot.key_cache, "values": snapshot.value_cache,
            "prefill_s": prefill, "decode_s": (time.perf_counter() - start) / decode}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("split", type=Path, help="the split stateful package folder")
    parser.add_argument("unsplit", type=Path, help="the unsplit stateful package of the same bundle and precision")
    parser.add_argument("--text", type=Path, default=ROOT / "fixtures" / "botchan.txt")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--decode", type=int, default=8)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    manifest, unsplit = read_json(args.split / MANIFEST_NAME), read_json(args.unsplit / MANIFEST_NAME)
    limit = manifest["package"]["split"]["max_package_bytes"]
    tokenizer = tokenizer_from_artifact(args.split)
    lines = args.text.read_text().splitlines()
    ids = np.asarray(tokenizer.encode(" ".join(lines[len(lines) // 2:]))[:args.tokens], dtype=np.int32)
    got = _run(args.split, ids, args.decode, args.backend)
    want = _run(args.unsplit, ids, args.decode, args.backend)
    report = {
        "limit_bytes": limit,
        "pieces": [{"name": p["name"], "layers": p["piece"]["layers"], "bytes": p["package_bytes"],
                    "of_limit": p["package_bytes"] / limit} for p in manifest["package"]["pieces"]],
        "chain_bytes": manifest["package_bytes"], "unsplit_bytes": unsplit["package_bytes"],
        "chain_over_unsplit_bytes": manifest["package_bytes"] / unsplit["package_bytes"],
        "max_abs_logits": float(max(np.abs(a - b).max() for a, b in zip(got["logits"], want["logits"]))),
        "max_abs_cache": float(max(np.abs(got[k] - want[k]).max() for k in ("keys", "values"))),
        "prefill_s": {"chain": got["prefill_s"], "unsplit": want["prefill_s"],
                      "ratio": got["prefill_s"] / want["prefill_s"]},
        "decode_s_per_token": {"chain": got["decode_s"], "unsplit": want["decode_s"],
                               "ratio": got["decode_s"] / want["decode_s"]},
        "tokens": len(ids), "decode": args.decode, "backend": args.backend,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
