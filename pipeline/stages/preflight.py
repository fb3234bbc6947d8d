"""The fp16 preflight: where a bundle's model overflows fp16, and the mitigations that make it safe.

    manifest = run_preflight("build/m/bundle", "build/m/preflight", context=512)

It runs the reference model over the calibration text (`pipeline.ground.text_roles`) and the
prompts known to trigger massive activations (BOS alone, BOS then ".", BOS then a newline:
the first token and the first delimiter, Sun et al. 2024, "Massive Activations in Large
Language Models"), and one window of the whole context; records per layer the abs-max of
the residual stream, q . k, the MLP intermediate and the norms' squares, and the logits, in
FP32 and in the naive fp16 reference, with each inf/NaN the fp16 forward met (layer,
quantity, token); chooses the mitigations (`pipeline.ground.models.fp16.choose_mitigations`)
and measures the mitigated fp16 reference again, which must be finite with every peak under
65504 / headroom.

The output folder holds `preflight.json` (findings, mitigations, verdict), `preflight.md`,
`preflight.png` (per-layer peaks against 65504) and `manifest.json` (format
`cmfdeploy.preflight/1`, the bundle bound by its manifest's sha256). A model no mitigation
makes safe is still reported (verdict "refused", the layer, quantity and value), then
refused: `Fp16Unsafe` is raised once the folder is in place.
"""

from pathlib import Path

import numpy as np

from manifests.identity import (
    MANIFEST_NAME,
    Manifest,
    artifact_source,
    canonical_json,
    check_files,
    environment,
    file_identity,
    inventory,
    load_manifest,
    portable_name,
    read_json,
    sha256_file,
    write_json,
)
from manifests.output import refuse_existing, staged_output
from pipeline.ground.errors import CmfdeployError, IdentityError
from pipeline.stages.disk import check_disk

FORMAT = "cmfdeploy.preflight/1"
REPORT_NAME = "preflight.json"
PAGE_NAME = "preflight.md"
PLOT_NAME = "preflight.png"
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TEXT = ROOT / "fixtures" / "botchan.txt"
# Calibration windows of CALIBRATION_WINDOW tokens (BOS included); the long window adds the
# whole context. A few windows: massive activations sit on fixed tokens, not rare text.
CALIBRATION_WINDOWS = 4
CALIBRATION_WINDOW = 128
PLOTTED = ("residual", "attention_logits", "mlp_intermediate", "norm_square", "branch_norm_square")


class PreflightError(CmfdeployError):
    """A preflight that cannot run (no tokenizer, a context the model does not have)."""


def preflight_windows(tokenizer, lines: list[str], context: int, where: str = "text") -> dict[str, np.ndarray]:
    """name -> token ids: BOS alone, BOS + ".", BOS + a newline, CALIBRATION_WINDOWS windows
    of the calibration lines, and one window of `context` tokens (BOS first where the
    tokenizer has one)."""
    from pipeline.ground.text_roles import text_roles
    from pipeline.stages.evaluate import windows as text_windows

    ids = tokenizer.encode(" ".join(text_roles(lines, where)["calibration"]))
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    prompts = {"bos": np.asarray(bos or ids[:1], np.int64),
               "first_period": np.asarray(bos + list(tokenizer.encode(".")), np.int64),
               "first_newline": np.asarray(bos + list(tokenizer.encode("\n")), np.int64)}
    calibration = text_windows(np.asarray(ids, np.int64), min(CALIBRATION_WINDOW, context), tokenizer.bos_id)
    prompts |= {f"calibration_{i}": w for i, w in enumerate(calibration[:CALIBRATION_WINDOWS])}
    longest = np.asarray(bos + list(ids[:context - len(bos)]), np.int64)
    if len(longest) < context:
        raise PreflightError(f"{where}: the calibration lines hold {len(ids)} tokens, short of the {context}-token "
                             "context the long window measures")
    return prompts | {"longest": longest}


def run_preflight(bundle_dir: str | Path, out_dir: str | Path, *, text: str | Path = DEFAULT_TEXT,
                  context: int | None = None, force: bool = False) -> Manifest:
    """Measure, choose and check the fp16 mitigations of the bundle's model; write the report.
    Raises Fp16Unsafe (after writing the report) when no mitigation makes the model safe."""
    from pipeline.ground.models.fp16 import (
        Fp16Unsafe,
        check_mitigated,
        choose_mitigations,
        mitigated_model,
        preflight_findings,
    )
    from pipeline.ground.reference import load_reference
    from pipeline.ground.tokenizer import tokenizer_from_artifact

    bundle_dir, out_dir, text = Path(bundle_dir), Path(out_dir), Path(text)
    refuse_existing(out_dir, force)
    model, args, _ = load_reference(bundle_dir)
    check_disk("preflight", out_dir, bundle_dir)
    context = args.deployed_context if context is None else context
    if not 2 <= context <= args.max_position_embeddings:
        raise PreflightError(f"{bundle_dir}: context {context} is outside 2..arch.max_position_embeddings "
                             f"{args.max_position_embeddings}")
    try:
        lines = text.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise PreflightError(f"{text}: cannot read as UTF-8 text ({error})") from None
    windows = preflight_windows(tokenizer_from_artifact(bundle_dir), lines, context, str(text))
    findings = preflight_findings(model, args, windows)
    mitigations = mitigated = refusal = None
    try:
        mitigations = choose_mitigations(findings, where=str(bundle_dir))
        mitigated = preflight_findings(mitigated_model(model, args, mitigations), args, windows)
        check_mitigated(mitigated, mitigations.headroom, where=f"{bundle_dir} (mitigated)")
    except Fp16Unsafe as error:
        refusal = error
    report = {
        "format": "cmfdeploy.preflight_report/1",
        "model": {"arch_name": args.arch_name, "layers": args.num_layers, "hidden_size": args.hidden_size},
        "context": context,
        "windows": findings["windows"],
        "findings": {"fp32": findings["fp32"], "fp16": findings["fp16"]},
        "mitigations": None if mitigations is None else mitigations.to_record(),
        "mitigated": None if mitigated is None else {"fp32": mitigated["fp32"], "fp16": mitigated["fp16"]},
        "verdict": "safe" if refusal is None else "refused",
        "refused": None if refusal is None else {"layer": refusal.layer, "quantity": refusal.quantity,
                                                 "value": _finite_or_text(refusal.value), "message": str(refusal)},
    }
    with staged_output(out_dir, force) as staging:
        manifest = {"format": FORMAT, "status": "incomplete", "source": artifact_source(bundle_dir, relative_to=out_dir)}
        write_json(staging / MANIFEST_NAME, manifest)
        report["source"] = manifest["source"]
        report["status"] = "complete"  # last: a reader of the report alone sees it finished
        (staging / REPORT_NAME).write_bytes(canonical_json(report))
        _plot(staging / PLOT_NAME, report)
        (staging / PAGE_NAME).write_text(_page(report, bundle_dir, out_dir), encoding="utf-8")
        manifest.update(
            text=file_identity(text) | {"path": portable_name(text, out_dir), "role": "calibration lines"},
            context=context,
            verdict=report["verdict"],
            mitigations=report["mitigations"],
            files=inventory(staging),
            environment=environment(),
        )
        manifest["status"] = "complete"
        write_json(staging / MANIFEST_NAME, manifest)
    if refusal is not None:
        raise refusal
    return Manifest(out_dir, load_manifest(out_dir, FORMAT))


def _finite_or_text(value: float):
    return value if np.isfinite(value) else str(value)


def verify_preflight(path: str | Path, hashes: bool = True) -> Manifest:
    """Verifier for `verify-artifact`: the files as recorded, and the report's verdict,
    mitigations and source the manifest's."""
    path = Path(path)
    manifest = load_manifest(path, FORMAT)
    check_files(path, manifest["files"], hashes=hashes)
    report = read_json(path / REPORT_NAME)
    for key in ("verdict", "mitigations", "source"):
        if report.get(key) != manifest[key]:
            raise IdentityError(f"{path / REPORT_NAME}: field {key!r} is {report.get(key)!r}, the manifest "
                                f"records {manifest[key]!r}")
    return Manifest(path, manifest)


def _peak(row: dict | None, quantity: str) -> float | None:
    entry = None if row is None else row.get(quantity)
    return None if entry is None else entry["value"]


def _plot(path: Path, report: dict) -> Path:
    from pipeline.ground.models.fp16 import FP16_MAX, HEADROOM
    from pipeline.stages.report import line_plot

    series = {}
    for label, side in (("FP32", report["findings"]["fp32"]),
                        ("mitigated fp16", (report["mitigated"] or {}).get("fp16"))):
        if side is None:
            continue
        for quantity in PLOTTED:
            values = [_peak(row, quantity) for row in side["layers"]]
            if any(v is not None for v in values):
                series[f"{quantity} ({label})"] = (list(range(len(values))), values, label != "FP32")
    limit = (report["mitigations"] or {}).get("headroom", HEADROOM)
    return line_plot(path, series, title="per-layer abs-max peaks against fp16's largest value",
                     xlabel="layer", ylabel="abs-max (log scale)",
                     hlines={"fp16 max 65504": FP16_MAX, f"65504 / headroom {limit:g}": FP16_MAX / limit})


def _page(report: dict, bundle_dir: Path, out_dir: Path) -> str:
    from pipeline.stages.report import md_table

    fp32, fp16 = report["findings"]["fp32"], report["findings"]["fp16"]
    mitigated = (report["mitigated"] or {}).get("fp16")
    rows = []
    for i, row in enumerate(fp32["layers"]):
        rows.append([i, *(_peak(row, q) for q in PLOTTED),
                     _peak(mitigated["layers"][i], "residual") if mitigated else None,
                     _peak(mitigated["layers"][i], "norm_square") if mitigated else None])
    events = fp16["nonfinite"]
    lines = [f"# fp16 preflight: {portable_name(bundle_dir, out_dir)}", "",
             f"Verdict: **{report['verdict']}**" + (f": {report['refused']['message']}" if report["refused"] else ""),
             "", f"Context {report['context']}; windows: "
             + ", ".join(f"{name} ({n} tokens)" for name, n in report["windows"].items()), "",
             "## Mitigations", "",
             md_table(["mitigation", "value"], [[k, v] for k, v in (report["mitigations"] or {}).items()])
             if report["mitigations"] else "none chosen (refused)\n",
             "## Per-layer peaks (FP32 reference; last two columns: the mitigated fp16 reference)", "",
             md_table(["layer", *PLOTTED, "residual (mitigated fp16)", "norm_square (mitigated fp16)"], rows),
             "Model-wide (FP32): " + ", ".join(f"{q} {_peak(fp32['model'], q):.4g}" for q in fp32["model"]
                                              if _peak(fp32["model"], q) is not None), "",
             "## Naive fp16 forward (no mitigation)", "",
             md_table(["window", "layer", "quantity", "token", "value"],
                      [[e["window"], e["layer"], e["quantity"], e["position"], e["value"]] for e in events])
             if events else "finite on every window\n",
             f"![per-layer peaks]({PLOT_NAME})", ""]
    return "\n".join(lines)


def fp16_conversion(bundle_dir: str | Path, preflight_dir: str | Path, precision: str = "fp16"):
    """The `coreml.kinds.export.Conversion` of an fp16 package: the mitigations the preflight at
    `preflight_dir` chose, applied by `mitigated_from_record`, and its report bound by sha256.

    The preflight must be intact, of this very bundle (by manifest sha256) and safe: a refused
    model is never converted, and the refusal names the layer and value again."""
    from coreml.kinds.export import Conversion

    bundle_dir, preflight_dir = Path(bundle_dir), Path(preflight_dir)
    manifest = verify_preflight(preflight_dir).data
    bundle_sha = sha256_file(bundle_dir / MANIFEST_NAME)
    if manifest["source"]["manifest_sha256"] != bundle_sha:
        raise PreflightError(f"{preflight_dir / MANIFEST_NAME}: field 'source.manifest_sha256' is "
                             f"{manifest['source']['manifest_sha256']}, but {bundle_dir} has manifest sha256 {bundle_sha}: "
                             "the preflight is of another bundle")
    if manifest["verdict"] != "safe":
        refused = read_json(preflight_dir / REPORT_NAME)["refused"]
        raise PreflightError(f"{preflight_dir / REPORT_NAME}: field 'verdict' is {manifest['verdict']!r}: "
                             f"{refused['message']}; an fp16 package of this model is not built")
    return Conversion(precision=precision, transform="pipeline.ground.models.fp16:mitigated_from_record",
                      mitigations=manifest["mitigations"], preflight=str(preflight_dir / REPORT_NAME))
