"""How far the gates' exactness bound sits above what a correct package errs, and above what a
converter fault moves (issue 49): the measurements a bound from the reference's own rounding
noise would be set against. Printed, never asserted.

    python benchmarks/noise_bench.py MODEL.cmf [MODEL.cmf ...] [--context 256] [--windows 2]

Per model, on held-out windows of fixtures/botchan.txt (BOS first where the model has one):
  - noise: the float32 reference against the same reference in float64
    (`pipeline.ground.models.noise.rounding_noise`), max |Δ| of the logits and of the written
    K/V: how far float32 arithmetic itself lands from the exact function;
  - the a-priori bound the gates hold a package to today (`exact_tolerances`, logits);
  - faults, each applied to a copy of the float32 reference as a converter fault would leave
    the package: one layer's down_proj scaled by 1 + 1e-3 (and 1 + 1e-2), and one layer's
    attention scale x 1.01; |Δ logit| against the float32 reference,
    which is what the gate would see of such a package (its own summation noise aside).
The ratios say how many times the noise each figure is: a bound at k x noise catches a fault
whose ratio exceeds k.
"""

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.ground.models.noise import rounding_noise  # noqa: E402
from pipeline.ground.reference import load_reference  # noqa: E402
from pipeline.ground.text_roles import text_roles  # noqa: E402
from pipeline.ground.tokenizer import tokenizer_from_artifact  # noqa: E402
from pipeline.stages.evaluate import windows  # noqa: E402
from pipeline.stages.gates.exactness import exact_tolerances  # noqa: E402


@torch.no_grad()
def logits(model, ids: np.ndarray) -> np.ndarray:
    return model(torch.from_numpy(ids)).to(torch.float64).numpy()


def faulty(model, layer: int, name: str, factor: float):
    """A copy of `model` with one weight of one layer, or its attention's scale, times `factor`."""
    broken = copy.deepcopy(model)
    module = broken.model.layers[layer]
    for part in name.split("."):
        module = getattr(module, part)
    if isinstance(module, float):  # self_attn.scale
        attention = broken.model.layers[layer].self_attn
        attention.scale = module * factor
    else:
        module.weight.mul_(factor)
    return broken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--text", type=Path, default=ROOT / "fixtures" / "botchan.txt")
    args = parser.parse_args()
    lines = args.text.read_text(encoding="utf-8").splitlines()
    print("| model | window | logit noise | cache noise | a-priori bound | bound / noise "
          "| fault | Δ max | Δ / noise | Δ / bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.models:
        model, model_args, _ = load_reference(path)
        tokenizer = tokenizer_from_artifact(path)
        ids = tokenizer.encode(" ".join(text_roles(lines, str(args.text))["quality"]))
        cases = windows(np.asarray(ids, np.int64), args.context, tokenizer.bos_id)[:args.windows]
        bound = exact_tolerances(model, args.context)[0].atol
        layer = model_args.num_layers // 2
        faults = {f"layer {layer} down_proj x(1+1e-3)": faulty(model, layer, "mlp.down_proj", 1 + 1e-3),
                  f"layer {layer} down_proj x(1+1e-2)": faulty(model, layer, "mlp.down_proj", 1 + 1e-2),
                  f"layer {layer} attention scale x1.01": faulty(model, layer, "self_attn.scale", 1.01)}
        for index, case in enumerate(cases):
            start = time.perf_counter()
            want = logits(model, case)
            seconds32 = time.perf_counter() - start
            start = time.perf_counter()
            noise = rounding_noise(model, case)
            seconds_noise = time.perf_counter() - start
            head = (f"| {path.stem} | {index} ({len(case)} tokens; forward {seconds32:.1f} s, noise {seconds_noise:.1f} s) "
                    f"| {noise.logits:.3g} | {noise.cache:.3g} | {bound:.3g} | {bound / noise.logits:,.0f}x")
            for name, broken in faults.items():
                delta = np.abs(logits(broken, case) - want).max()
                print(f"{head} | {name} | {delta:.3g} | {delta / noise.logits:,.1f}x | {delta / bound:.3g}x |", flush=True)
                head = "| | | | | | "


if __name__ == "__main__":
    main()
