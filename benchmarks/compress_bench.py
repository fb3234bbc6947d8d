"""Compression recipes on a real model: bits per weight, perplexity, top-1 agreement, time;
mlx-lm's own q4 and q8 beside them on the same windows.

    python benchmarks/compress_bench.py PACKAGE_DIR [--recipes int4-b32 mixed@5.5 ...] [--mlx-lm 4 8] [--work DIR]
    python benchmarks/compress_bench.py PACKAGE_DIR --diagnose [--out report]
    python benchmarks/compress_bench.py PACKAGE_DIR --recipes gptq-int4-b32-zp mixed --shared-cache   # as a survey shares

PACKAGE_DIR is an FP32 chunk_kv (or stateless) package, e.g. SmolLM2-135M:
`cmfdeploy bundle .test-cache/smollm2/*/SmolLM2-135M-Instruct-f32.cmf -o B` then
`cmfdeploy coreml B -o P --kinds chunk_kv --context 128`; Gemma 3 270M the same from
.test-cache/gemma3/*/gemma-3-270m-f32.cmf (`--context 256` keeps the conversion affordable).

Text: the survey's own (`pipeline.stages.gates.QualityInputs`, `pipeline.stages.survey.calibration_ids`):
fixtures/botchan.txt cut by `pipeline.ground.text_roles` into calibration lines (what
calibration-aware recipes see) and quality lines (what is scored here, never calibrated
on), each joined by spaces and tokenized by the package's bundle tokenizer; the quality
ids in non-overlapping windows of the package's context, every window opened by BOS
(`pipeline.stages.evaluate.windows`), as the survey's quality gate windows them.

Recipe mode: each recipe compresses the package (`compress_package`, timed; `mixed@B` is the
mixed recipe under a budget of B bits per weight); the compressed package's constants are
decoded by the MIL executor's own constexpr ops (`coreml.mil.executor.Executor`) and loaded
into the torch reference model, which by the survey's exactness gate computes what the
package computes; perplexity and top-1 agreement with the FP32 model per predicted token.
Bits per weight as mlx-lm and Core ML count them (`coreml.bits.bits_per_weight`: every
stored byte of the package's weights, x 8, over the parameter count). Each compressed package
also gets the Neural Engine's static check (`coreml.ane.ane_report`): the compute units it can
claim, and the verdict of its weight compression alone, which is the recipe's part (an FP32
package fails the fp16 check whatever its recipe; compress an fp16 package for the whole claim).

`--mlx-lm 4 8`: mlx-lm's own quantization (`benchmarks/mlx_lm_reference.py`: its model
file and `quantize_model`, group 64, bf16 scales and biases as `mlx_lm.convert` stores
them, computed in float32) of the same bundle weights, scored on the same windows against
mlx-lm's own unquantized model (and its perplexity beside our FP32's).

Diagnose mode: per weight tensor, the relative error ||W_hat - W|| / ||W|| and the same over
its largest 1% of |w|, for plain numpy quantizers of that tensor (absmax symmetric int4 per
32, which is what coremltools' linear_symmetric computes; min/max affine int4 per 32 as in
mlx-lm's q4 g32; a 16-entry k-means LUT per 32 output rows, coremltools' grouped-channel
palette) and for what each recipe's own encoder gives; then the perplexity change with
only the embedding, or only the decoder layers, coded each way.
Printed and written as JSON + markdown; never asserted.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from coreml import codes  # noqa: E402
from coreml.bits import bits_per_weight  # noqa: E402
from coreml.manifest import verify_package  # noqa: E402
from coreml.recipes import EMBEDDING, RECIPES, Weight, compress_package  # noqa: E402
from manifests.chain import upstream_path  # noqa: E402
from pipeline.ground.backend_protocol import kl_rows, log_softmax  # noqa: E402
from pipeline.stages.evaluate import windows  # noqa: E402
from pipeline.stages.survey import calibration_ids  # noqa: E402
from pipeline.ground.reference import load_reference  # noqa: E402
from pipeline.stages.report import md_table  # noqa: E402
from pipeline.ground.text_roles import text_roles  # noqa: E402
from pipeline.ground.tokenizer import tokenizer_from_artifact  # noqa: E402

TEXT = ROOT / "fixtures" / "botchan.txt"
DEFAULT_RECIPES = ("int8-b32", "int4-b32", "palette6-gc32", "palette4-gc32", "mixed", "cmf-native")


# Reference log-probabilities are kept (float32) for the KL column only while they take at
# most this many bytes; Gemma 3's 262k vocabulary over the quality text would take 2.4 GB.
KL_BYTES = 2**30


class Reference:
    """What a scored model is compared with, per window: its top-1 and (when kept) its log-probs."""

    def __init__(self, logprobs_of, windows: list[np.ndarray], vocab: int):
        keep = sum(len(w) for w in windows) * vocab * 4 <= KL_BYTES
        self.top1, self.logprobs = [], [] if keep else None
        for w in windows:
            lp = logprobs_of(w)
            self.top1.append(lp[:-1].argmax(-1))
            if keep:
                self.logprobs.append(lp[:-1].astype(np.float32))


class Model:
    """The FP32 reference of a package with swappable weights, scored on the survey's quality
    windows one window at a time (a window's log-probs of a 262k vocabulary are 0.5 GB)."""

    def __init__(self, bundle: Path, window: int):
        self.bundle = bundle
        self.model, _, _ = load_reference(self.bundle)
        self.model.eval()
        self.original = {n: t.detach().clone() for n, t in self.model.state_dict().items()}
        tokenizer = tokenizer_from_artifact(self.bundle)
        roles = text_roles(TEXT.read_text(encoding="utf-8").splitlines(), where=str(TEXT))
        self.calibration = calibration_ids(tokenizer, TEXT)
        quality = np.asarray(tokenizer.encode(" ".join(roles["quality"])), np.int64)
        self.window = window
        self.bos_id = tokenizer.bos_id
        self.windows = windows(quality, self.window, tokenizer.bos_id)
        self.parameters = sum(t.numel() for n, t in self.original.items())
        self.vocab = self.original[EMBEDDING].shape[0]
        self.tied = self.model.lm_head is None
        self.fp32 = Reference(self._logprobs, self.windows, self.vocab)

    def hot_rows(self, count: int) -> np.ndarray:
        """The `count` token ids most frequent in the calibration text (ties by id), and BOS,
        which opens every window."""
        ids, counts = np.unique(self.calibration, return_counts=True)
        return np.union1d(ids[np.argsort(-counts, kind="stable")[:count]], [self.bos_id])

    def hot_coverage(self, rows: np.ndarray) -> dict:
        """How much of the scored text `rows` cover: the calibration text is not the scored text."""
        scored = np.concatenate([w[1:] for w in self.windows])
        return {"rows": int(len(rows)), "scored_tokens_covered": float(np.isin(scored, rows).mean()),
                "scored_ids": int(len(np.unique(scored))),
                "scored_ids_not_in_calibration": int((~np.isin(np.unique(scored), self.calibration)).sum())}

    @classmethod
    def of_package(cls, package: Path) -> "Model":
        """The reference of the package's bundle, windowed at the package's context."""
        manifest = verify_package(package, hashes=False)
        return cls(upstream_path(package, manifest["source"]), manifest["package"]["context"])

    def _logprobs(self, window: np.ndarray) -> np.ndarray:
        import torch

        with torch.no_grad():
            return log_softmax(self.model(torch.as_tensor(window)).numpy())

    def score(self, weights: dict[str, np.ndarray] | None = None, logprobs_of=None,
              against: Reference | None = None, head: np.ndarray | None = None) -> dict:
        """Perplexity, top-1 agreement and mean KL (where the reference's log-probs are kept)
        against FP32 (or `against`) over the quality windows, with `weights` swapped in (or
        of `logprobs_of(window)`); `head`: a tied model's head use alone takes this matrix,
        its lookup keeps the embedding (the two uses of one table scored apart)."""
        import torch

        from pipeline.ground.models.base import Linear

        against = against or self.fp32
        weights = weights or {}
        if logprobs_of is None:
            self.model.load_state_dict({n: torch.from_numpy(np.ascontiguousarray(w, np.float32))
                                        for n, w in weights.items()}, strict=False)
        if head is not None:
            self.model.lm_head = Linear(torch.from_numpy(np.ascontiguousarray(head, np.float32)))
        try:
            nll, agree, count, kl = 0.0, 0, 0, 0.0
            for i, w in enumerate(self.windows):
                q = (logprobs_of or self._logprobs)(w)
                nll -= q[np.arange(len(w) - 1), w[1:]].sum()
                agree += int((against.top1[i] == q[:-1].argmax(-1)).sum())
                if against.logprobs is not None:
                    kl += float(kl_rows(against.logprobs[i].astype(np.float64), q[:-1]).sum())
                count += len(w) - 1
        finally:
            if head is not None:
                self.model.lm_head = None
            if logprobs_of is None:
                self.model.load_state_dict({n: self.original[n] for n in weights}, strict=False)
        return {"perplexity": float(np.exp(nll / count)), "top1_agreement": agree / count,
                "kl_mean": kl / count if against.logprobs is not None else None, "tokens": count}


def _kl(row: dict) -> str:
    return "not kept" if row.get("kl_mean") is None else f"{row['kl_mean']:.4f}"


def exactness(model: Model, manifest, weights: dict[str, np.ndarray]) -> dict:
    """The package on the MIL executor against the torch reference with its own decoded
    weights, one shot over the first quality window, within the survey gate's bound
    (`pipeline.stages.gates.exactness.exact_tolerances`)."""
    import torch

    from coreml.decoded import hot_rows_head_norm
    from coreml.package import open_package
    from pipeline.stages.gates.exactness import compare, exact_tolerances

    window = model.windows[0]
    package = open_package(manifest.path, backend="executor")
    inputs = {"input_ids": window[None].astype(np.int32)}
    for spec in manifest["package"]["inputs"]:
        if spec["name"] == "position":
            inputs["position"] = np.zeros(1, np.int32)
        elif spec["name"] != "input_ids":
            inputs[spec["name"]] = np.zeros(spec["shape"], np.float32)
    got = package.predict(inputs)["logits"][0]
    model.model.load_state_dict({n: torch.from_numpy(w) for n, w in weights.items()}, strict=False)
    try:
        with torch.no_grad():
            want = model.model(torch.as_tensor(window)).numpy()
        tolerance = exact_tolerances(model.model, model.window, hot_rows_head_norm(manifest.path))[0]
    finally:
        model.model.load_state_dict({n: model.original[n] for n in weights}, strict=False)
    record = compare(got, want, tolerance)
    return {"passed": record["passed"], "max_abs": record["max_abs"], "bound": tolerance.atol}


def ane_claim(package: Path) -> dict:
    """The compute units the package's program can claim by the Neural Engine's static check, and
    the verdict of the check of its weights' compression."""
    from coreml.ane import ane_report

    report = ane_report(package / "model.mlpackage")
    weights = [c for f in report["functions"].values() for c in f["checks"] if c["check"] == "weight_compression"]
    return {"compute_units": report["compute_units"],
            "weight_compression": "pass" if all(c["verdict"] == "pass" for c in weights) else "fail",
            "failed": sorted({c["check"] for f in report["functions"].values() for c in f["checks"]
                              if c["verdict"] == "fail"})}


def _ane(row: dict) -> str:
    if "ane" not in row:
        return ""
    claim = row["ane"]
    if "ane" in claim["compute_units"]:
        return "claims ane"
    return f"weights {claim['weight_compression']}; fails {', '.join(claim['failed'])}"


def decompressed_weights(manifest) -> dict[str, np.ndarray]:
    """HF name -> the package's constant as the MIL executor's constexpr ops decode it (a table
    with hot rows: as the package reads it, `coreml.codes.with_hot_rows`)."""
    from coreml.codes import with_hot_rows
    from coreml.decoded import hot_rows_of
    from coreml.mil.executor import Executor
    from coreml.mil.loader import load_program

    constants = Executor(load_program(manifest.path / "model.mlpackage")).constants
    hot = hot_rows_of(manifest.data)

    def value(var: str) -> np.ndarray:
        table = np.asarray(constants[var], np.float32)
        if var not in hot:
            return table
        return with_hot_rows(table.copy(), np.asarray(constants[hot[var]["residual"]], np.float32),
                             np.asarray(constants[hot[var]["slot"]], np.int64))

    return {hf: value(e["compressed_as"]) for e in manifest["selection"]["weights"].values() if e["compressed"]
            for hf in e["hf_names"]}


def _fp32_row(model: Model) -> dict:
    base = model.score()
    print(f"fp32: ppl {base['perplexity']:.3f} over {base['tokens']} tokens in {len(model.windows)} windows of "
          f"{model.window} (BOS {model.bos_id} first)", flush=True)
    return {**base, "bpw": 32.0, "seconds": 0.0}


def _result(model: Model, source: Path, rows: dict, how: str) -> dict:
    return {"package": str(source), "how": how, "parameters": model.parameters, "quality_tokens": rows["fp32"]["tokens"],
            "window": model.window, "bos_id": model.bos_id, "calibration_tokens": int(len(model.calibration)),
            "recipes": rows}


def run_recipes(package: Path, recipes: list[str], work: Path, mlx_bits: list[int], exact: bool = False,
                shared: bool = False) -> dict:
    """`shared`: the recipes share calibration Hessians, GPTQ codes and k-means centres as a survey's do
    (`coreml.cache`)."""
    model = Model.of_package(package)
    rows = {"fp32": _fp32_row(model)}
    base = rows["fp32"]
    for spec in recipes:
        recipe, _, budget = spec.partition("@")
        start = time.perf_counter()
        extra = {"calibration_ids": model.calibration} if RECIPES[recipe].calibration else {}
        if shared:
            extra["shared_cache"] = work / ".shared-cache"
        if budget:
            extra["bpw"] = float(budget)
        manifest = compress_package(package, recipe, work / spec, force=True, **extra)
        seconds = time.perf_counter() - start
        weights = decompressed_weights(manifest)
        scored = model.score(weights)
        row = {**scored, "bpw": bits_per_weight(manifest.path)["bits_per_weight"], "seconds": seconds,
               "ppl_delta": scored["perplexity"] / base["perplexity"] - 1, "compressed_tensors": len(weights),
               "ane": ane_claim(manifest.path)}
        if exact:
            row["exact"] = exactness(model, manifest, weights)
        if "mixed" in manifest["selection"]:
            mixed = manifest["selection"]["mixed"]
            row.update(chosen=mixed["chosen"], choices=mixed["choices"], candidates=mixed["candidates"])
        rows[spec] = row
        del weights
        shutil.rmtree(work / spec, ignore_errors=True)
        print(f"{spec}: {row['bpw']:.3f} bpw, ppl {row['perplexity']:.3f} ({row['ppl_delta']:+.2%}), "
              f"top-1 {row['top1_agreement']:.3f}, KL {_kl(row)}, {seconds:.1f} s"
              + (f", chose {row['chosen']}" if "chosen" in row else "") + f", ANE check: {_ane(row)}"
              + (f", exact {row['exact']['passed']} (max |Δ logit| {row['exact']['max_abs']:.2g}, bound "
                 f"{row['exact']['bound']:.2g})" if exact else ""), flush=True)
    if mlx_bits:
        rows.update(run_mlx_lm(model, work, mlx_bits, base))
    return _result(model, package, rows, "packages: compressed, decoded by the MIL executor's constexpr ops, "
                                         "scored through the torch reference")


def run_codes(bundle: Path, window: int, recipes: list[str], work: Path, mlx_bits: list[int]) -> dict:
    """The recipes' codes computed from the bundle's weights as `compress_package` computes
    them for a package of it (`coreml.recipes.mixed.OptionCodes`: each recipe's own encoder,
    GPTQ on the same calibration Hessians), decoded as the constexpr ops decode them and
    scored through the torch reference, without converting a package: for a model whose
    conversion this machine cannot afford in the time at hand. Every `mixed@B` shares one
    set of per-group measurements; each budget's plan is then measured whole beside the
    uniform options that fit it, as the recipe does."""
    from coreml.calibration import HESSIAN_WINDOWS, Calibration
    from coreml.recipes import MIXED_BPW, WEIGHT_THRESHOLD
    from coreml.recipes.mixed import MIXED, OptionCodes

    model = Model(bundle, window)
    rows = {"fp32": _fp32_row(model)}
    base = rows["fp32"]
    calib = Calibration.of_model(model.model, model.calibration, HESSIAN_WINDOWS, model.bos_id, model.original)
    tied = {EMBEDDING: ("gather", "linear")}
    weights = [Weight(n, (n,), tuple(t.shape), tied.get(n, ("linear",)), ()) for n, t in model.original.items()
               if t.ndim == 2 and t.numel() > WEIGHT_THRESHOLD]
    below = sum(t.numel() for n, t in model.original.items() if t.numel() <= WEIGHT_THRESHOLD or t.ndim != 2)
    uniform = [r for r in recipes if "@" not in r and r != "mixed"]
    start = time.perf_counter()
    # No recipe (mlx-lm's rows alone): no Hessians, which are most of an hour on 2 cores beside other work.
    options = OptionCodes(weights, calib, tuple(dict.fromkeys([*MIXED.options, *uniform]))) if recipes else None
    setup = time.perf_counter() - start
    print(f"Hessians and encoders: {setup:.1f} s", flush=True)
    for spec in recipes:
        recipe, _, budget = spec.partition("@")
        start = time.perf_counter()
        if recipe == "mixed":
            record, _ = options.plan(float(budget or MIXED_BPW), below, MIXED.options)
            choices, extra = record["choices"], {"chosen": record["chosen"], "candidates": record["candidates"],
                                                 "choices": record["choices"]}
        else:
            choices, extra = {g: recipe for g in options.groups}, {}
        decoded = options.decoded(choices)
        stored = sum(RECIPES[choices[w.group]].estimated_bits(w) for w in options.selected) + 32 * below
        seconds = time.perf_counter() - start
        scored = model.score(decoded)
        row = {**scored, "bpw": stored / model.parameters, "seconds": seconds,
               "ppl_delta": scored["perplexity"] / base["perplexity"] - 1, **extra}
        rows[spec] = row
        print(f"{spec}: {row['bpw']:.3f} bpw, ppl {row['perplexity']:.3f} ({row['ppl_delta']:+.2%}), "
              f"top-1 {row['top1_agreement']:.3f}, KL {_kl(row)}, {seconds:.1f} s"
              + (f", chose {row['chosen']}" if "chosen" in row else ""), flush=True)
    del options, calib
    if mlx_bits:
        rows.update(run_mlx_lm(model, work, mlx_bits, base))
    return _result(model, bundle, rows, "codes of each recipe's own encoders on the bundle's weights (GPTQ on the "
                                        "calibration Hessians), decoded as the constexpr ops decode them, scored "
                                        f"through the torch reference (Hessians and encoders: {setup:.0f} s)")


def run_mlx_lm(model: Model, work: Path, mlx_bits: list[int], base: dict) -> dict:
    """mlx-lm's own FP32 and q`bits` g64 of the bundle's weights on the same windows; each
    quantized row's deltas are against mlx-lm's own unquantized model."""
    from benchmarks.mlx_lm_reference import GROUP, MlxLm

    runner = MlxLm(model.bundle, work)
    runner.load(None)

    def logprobs_of(window):
        return log_softmax(runner.logits(window))

    own = Reference(logprobs_of, model.windows, model.vocab)
    mlx_fp32 = model.score(logprobs_of=logprobs_of)
    rows = {"mlx-lm fp32": {**mlx_fp32, "bpw": 32.0, "seconds": 0.0,
                            "ppl_delta": mlx_fp32["perplexity"] / base["perplexity"] - 1}}
    print(f"mlx-lm fp32: ppl {mlx_fp32['perplexity']:.3f} (ours {base['perplexity']:.3f}), top-1 vs ours "
          f"{mlx_fp32['top1_agreement']:.4f}", flush=True)
    for bits in mlx_bits:
        start = time.perf_counter()
        size = runner.load(bits)
        seconds = time.perf_counter() - start
        scored = model.score(logprobs_of=logprobs_of, against=own)
        row = {**scored, "bpw": size["bpw"], "seconds": seconds,
               "ppl_delta": scored["perplexity"] / mlx_fp32["perplexity"] - 1}
        rows[f"mlx-lm q{bits} g{GROUP}"] = row
        print(f"mlx-lm q{bits} g{GROUP}: {row['bpw']:.3f} bpw, ppl {row['perplexity']:.3f} ({row['ppl_delta']:+.2%} "
              f"vs mlx-lm fp32), top-1 {row['top1_agreement']:.3f}, {seconds:.1f} s", flush=True)
    return rows


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


PLAIN = {  # the numpy quantizers each recipe is compared with
    "sym-int4-b32": lambda w: codes.symmetric_blocks(w, 4, 32, np.float32).decode(),
    "affine-int4-b32": lambda w: codes.affine_blocks(w, 4, 32, np.float32).decode(),
    "kmeans4-gc32": lambda w: codes.kmeans_tiles(w, 4, (32, w.shape[1]), dtype=np.float32).decode(),
}


def diagnose(package: Path, recipes: list[str], hot_rows: list[int]) -> dict:
    """Per tensor, each method's relative error; then the perplexity change with a part coded
    each way. With `hot_rows` (a tied table only): the whole model's table as the method codes
    it, but its `count` most frequent calibration rows as Q8_0 codes them (symmetric int8 per
    32, fp16 scale), for each count: what a table whose rows in use are stored apart would lose."""
    model = Model.of_package(package)
    base = model.score()["perplexity"]
    hot = {count: model.hot_rows(count) for count in hot_rows if model.tied}
    methods = {**PLAIN, **{r: _recipe_encoder(r) for r in recipes}}
    tensors, decoded = [], {m: {} for m in methods}
    for name, tensor in model.original.items():
        if tensor.ndim != 2:
            continue
        w = tensor.numpy()
        big = np.abs(w) >= np.percentile(np.abs(w), 99)
        row = {"name": name, "shape": list(w.shape)}
        for method, fn in methods.items():
            w_hat = fn(name, w) if method in recipes else fn(w)
            decoded[method][name] = w_hat
            row[method] = {"rel": _relative(w_hat, w), "rel_top1pct": _relative(w_hat[big], w[big])}
        tensors.append(row)
        print(name, {m: round(row[m]["rel"], 4) for m in methods}, flush=True)
    ppl = {}
    for method, weights in decoded.items():
        layers = {n: w for n, w in weights.items() if n != EMBEDDING}
        ppl[method] = {"embedding_only": model.score({EMBEDDING: weights[EMBEDDING]})["perplexity"] / base - 1,
                       "layers_only": model.score(layers)["perplexity"] / base - 1,
                       "all": model.score(weights)["perplexity"] / base - 1}
        if model.tied:
            # One table, two uses: what each costs alone says whether a head-aware code (GPTQ on
            # the final hidden states) can help, or whether the lookup's own error is the floor.
            original = model.original[EMBEDDING].numpy()
            ppl[method]["head_use_only"] = model.score(head=weights[EMBEDDING])["perplexity"] / base - 1
            ppl[method]["lookup_only"] = model.score({EMBEDDING: weights[EMBEDDING]},
                                                     head=original)["perplexity"] / base - 1
            for count, rows in hot.items():
                table = weights[EMBEDDING].copy()
                table[rows] = codes.symmetric_blocks(original[rows], 8, 32).decode()
                ppl[method][f"hot{count}"] = model.score({EMBEDDING: table})["perplexity"] / base - 1
        print(method, {k: f"{v:+.1%}" for k, v in ppl[method].items()}, flush=True)
    return {"package": str(package), "fp32_perplexity": base, "tensors": tensors, "ppl_delta": ppl,
            "hot_rows": {count: model.hot_coverage(rows) for count, rows in hot.items()}}


def _recipe_encoder(recipe: str):
    """name, value -> decoded value under `recipe`'s own data-free code step."""
    def encode(name: str, w: np.ndarray) -> np.ndarray:
        step = RECIPES[recipe].steps(Weight("", (name,), w.shape, (), ()))
        return np.asarray(step["code"].encode(w).decode(), np.float32)
    return encode


def markdown(result: dict) -> str:
    if "recipes" in result:
        recipes = result["recipes"]
        anchors = {name: r["ppl_delta"] for name, r in recipes.items() if name.startswith("mlx-lm q4")}
        exact = {name: (f"yes ({r['exact']['max_abs']:.1g} ≤ {r['exact']['bound']:.1g})" if r["exact"]["passed"]
                        else f"NO ({r['exact']['max_abs']:.2g} > {r['exact']['bound']:.2g})") if "exact" in r else ""
                 for name, r in recipes.items()}
        rows = [[name, f"{r['bpw']:.3f}", f"{r['perplexity']:.3f}", f"{r.get('ppl_delta', 0.0):+.2%}",
                 f"{r['top1_agreement']:.3f}", _kl(r), exact[name], _ane(r), f"{r['seconds']:.1f}",
                 *(f"{r.get('ppl_delta', 0.0) / d:.2f}" if d else "" for d in anchors.values())]
                for name, r in recipes.items()]
        return (f"# Compression on {result['package']}\n\nMeasured as {result['how']}. "
                f"{result['quality_tokens']} quality tokens in windows of "
                f"{result['window']} (BOS {result['bos_id']} first), {result['calibration_tokens']} calibration "
                f"tokens, {result['parameters']} parameters; mlx-lm rows against mlx-lm's own FP32\n\n"
                + md_table(["recipe", "bits/weight", "perplexity", "Δ ppl", "top-1 agreement", "KL mean",
                            "exact on the executor", "ANE check", "seconds",
                            *(f"Δ / {name}'s" for name in anchors)], rows))
    methods = list(result["ppl_delta"])
    parts = [k for k in ("embedding_only", "head_use_only", "lookup_only", *(f"hot{c}" for c in result["hot_rows"]),
                         "layers_only", "all") if k in result["ppl_delta"][methods[0]]]
    rows = [[m, *(f"{result['ppl_delta'][m][k]:+.1%}" for k in parts),
             f"{np.median([t[m]['rel'] for t in result['tensors']]):.4f}",
             f"{np.median([t[m]['rel_top1pct'] for t in result['tensors']]):.4f}"] for m in methods]
    hot = "".join(f"hot{c}: the table with its {h['rows']} most frequent calibration rows (and BOS) at int8 per 32, "
                  f"covering {h['scored_tokens_covered']:.1%} of the scored tokens ({h['scored_ids_not_in_calibration']} "
                  f"of their {h['scored_ids']} ids not in the calibration text).\n\n" for c, h in result["hot_rows"].items())
    return (f"# Per-tensor diagnosis of {result['package']}\n\nFP32 perplexity {result['fp32_perplexity']:.3f}\n\n{hot}"
            + md_table(["method", *(f"Δ ppl {k.replace('_', ' ')}" for k in parts),
                        "median rel. error", "median rel. error, top 1% |w|"], rows))


def _recipe_spec(spec: str) -> str:
    recipe, _, budget = spec.partition("@")
    if recipe not in RECIPES:
        raise argparse.ArgumentTypeError(f"{recipe!r} is not one of {list(RECIPES)}")
    if budget:
        float(budget)
    return spec


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("package", type=Path, help="an FP32 package; with --window, a bundle (codes mode)")
    parser.add_argument("--window", type=int,
                        help="score the recipes' codes on the bundle PACKAGE in windows of this many tokens, "
                             "without packages (run_codes)")
    parser.add_argument("--recipes", nargs="*", default=list(DEFAULT_RECIPES), type=_recipe_spec,
                        help="recipe names; RECIPE@B gives a calibration recipe's budget B bits per weight (mixed)")
    parser.add_argument("--mlx-lm", nargs="*", type=int, default=[], choices=(4, 8), metavar="BITS",
                        help="also run mlx-lm's own q4 / q8 (group 64) on the same windows")
    parser.add_argument("--exact", action="store_true",
                        help="also run each package once on the MIL executor against the reference of its weights")
    parser.add_argument("--shared-cache", action="store_true",
                        help="recipes share calibration Hessians and GPTQ codes, as one survey's do (coreml.cache)")
    parser.add_argument("--diagnose", action="store_true")
    parser.add_argument("--hot-rows", nargs="*", type=int, default=[], metavar="COUNT",
                        help="with --diagnose on a tied model: also score the table with its COUNT most frequent "
                             "calibration rows at int8")
    parser.add_argument("--work", type=Path, help="folder for the compressed packages (default: a temp folder)")
    parser.add_argument("--out", type=Path, default=Path("compress_bench"), help="report stem (.json, .md)")
    args = parser.parse_args()
    if args.diagnose:
        code_recipes = [r for r in args.recipes if "code" in RECIPES[r].params_record()]
        result = diagnose(args.package, code_recipes, args.hot_rows)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            if args.window:
                result = run_codes(args.package, args.window, args.recipes, args.work or Path(tmp), args.mlx_lm)
            else:
                result = run_recipes(args.package, args.recipes, args.work or Path(tmp), args.mlx_lm, args.exact,
                                     args.shared_cache)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    args.out.with_suffix(".md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
