"""Part 2, quality: the intended numerics stay within the user's `Budget` of FP32.

Measured on held-out text (`pipeline.ground.text_roles` "quality" lines: not the calibration
text, not the gate fixtures) and on the scoring set: perplexity change, mean KL(FP32 ||
package), pooled top-1 agreement, the fraction of items whose top-1 candidate changed.
"""

from dataclasses import asdict
from pathlib import Path

import numpy as np

from manifests.identity import file_identity, portable_name, sha256_file
from pipeline.ground.backend_protocol import kl_rows_of_logits, log_softmax
from pipeline.ground.scratch import ScratchFile
from pipeline.stages.gates.budget import Budget
from pipeline.stages.gates.lineage import upstream_of
from pipeline.stages.gates.report import GateFailed


# The quality part's log-softmaxes go through this many bytes of rows at a time: each is made
# in float64, so a block's figures hold about six times its bytes (`COMPARE_BLOCK_BYTES`).
QUALITY_BLOCK_BYTES = 16 * 2**20


class QualityInputs:
    """The held-out text and scoring set a quality part is measured on, with FP32's side
    computed once (a survey measures every recipe against the same FP32 figures). `bundle`:
    the bundle (or CMF) whose tokenizer reads them and whose reference `fp32` is."""

    def __init__(self, fp32, bundle: Path, text_path: Path, items_path: Path, window: int):
        from pipeline.stages.evaluate import windows
        from pipeline.stages.scoring import load_items
        from pipeline.ground.text_roles import text_roles
        from pipeline.ground.tokenizer import tokenizer_from_artifact

        self.fp32, self.bundle, self.tokenizer = fp32, Path(bundle), tokenizer_from_artifact(bundle)
        self.text_path, self.items_path = Path(text_path), Path(items_path)
        lines = self.text_path.read_text(encoding="utf-8").splitlines()
        ids = self.tokenizer.encode(" ".join(text_roles(lines, str(self.text_path))["quality"]))
        self.windows = windows(np.asarray(ids, np.int64), window, self.tokenizer.bos_id)
        self.items = load_items(self.items_path)
        self._fp32_scores = self._fp32_logits = None

    @property
    def fp32_logits(self) -> list[np.ndarray]:
        """FP32's logits per window, as the model returned them (float32), computed once and
        held in a scratch file (`ScratchFile`): a 262k vocabulary's logits over a 1024-token
        window are 1 GB, and a survey measures every recipe against them. The file is unlinked
        from the start, so a gate that is killed leaves no gigabytes behind in the temp folder."""
        if self._fp32_logits is None:
            scratch = ScratchFile()
            self._fp32_logits = [scratch.hold(np.asarray(self.fp32.logits(window), np.float32))
                                 for window in self.windows]
        return self._fp32_logits

    def use_fp32_scores(self, run_dir: Path) -> None:
        """Take FP32's item scores from a finished scoring run of this scoring set by the FP32
        reference of this bundle (the FP32 gate's `--scores-out`, or a survey's scores/fp32
        shared by its worker processes) instead of scoring them again. The run is verified;
        one of another scoring set, backend or bundle is refused, naming the field."""
        from manifests.chain import upstream_path
        from manifests.identity import load_manifest
        from pipeline.ground.bundle_format import FORMAT as BUNDLE_FORMAT
        from pipeline.stages.scoring import read_run, verify_scores

        run_dir = Path(run_dir)
        manifest = verify_scores(run_dir).data
        scored = upstream_path(run_dir, manifest["source"])
        scored_manifest = load_manifest(scored)
        # Scored on the bundle itself (`cmfdeploy score BUNDLE`: an fp16 build's FP32 baseline,
        # which no FP32 gate writes), or on a package of it (the FP32 chunk-KV gate's run).
        bundle = scored if scored_manifest["format"] == BUNDLE_FORMAT else upstream_of(scored, scored_manifest)[2]
        expected = {"scoring_set.sha256": (manifest["scoring_set"]["sha256"], sha256_file(self.items_path)),
                    "backend": (manifest["backend"], self.fp32.name),
                    "source (its bundle's manifest sha256)": (
                        sha256_file(bundle / "manifest.json"), sha256_file(self.bundle / "manifest.json"))}
        for field, (got, want) in expected.items():
            if got != want:
                raise GateFailed(f"{run_dir / 'manifest.json'}: field {field!r} is {got!r}, not {want!r}: not the "
                                 f"FP32 baseline of {self.items_path} on the bundle {self.bundle}")
        self._fp32_scores = read_run(run_dir)

    @property
    def fp32_scores(self) -> list:
        from pipeline.stages.scoring import score_items

        if self._fp32_scores is None:
            self._fp32_scores = score_items(self.fp32, self.tokenizer, self.items)
        return self._fp32_scores

    def identity(self, relative_to: str | Path) -> dict:
        """Inputs named as `portable_name` names them from `relative_to` (reports travel in releases)."""
        return {"text": file_identity(self.text_path) | {"path": portable_name(self.text_path, relative_to),
                                                         "role": "quality lines"},
                "items": file_identity(self.items_path) | {"path": portable_name(self.items_path, relative_to)},
                "windows": len(self.windows), "tokens": int(sum(len(w) - 1 for w in self.windows))}


def quality_identity(numerics, text_path: Path, items_path: Path, budget: Budget, all_figures: bool) -> dict:
    """Everything a quality record is a function of: the intended numerics (`IntendedNumerics`,
    whatever the package's kind), the held-out text and scoring set (their tokenizer is the
    bundle's, in `numerics`), what the record measures (`budget`, `all_figures`: which figures
    `measure_quality` skips) and the code that measured it. Two gates with equal identities
    measure the same record, so one may take the other's (`reuse_quality`)."""
    from manifests.identity import environment

    return {"intended": numerics.identity(), "text_sha256": sha256_file(text_path),
            "items_sha256": sha256_file(items_path), "budget": budget.spec(), "all_figures": all_figures,
            "packages": environment()["packages"]}


def reuse_quality(gate_dir: Path, identity: dict, relative_to: Path) -> dict:
    """The quality record of the verified gate at `gate_dir`, whose identity must equal
    `identity` field by field; the first that differs is refused by name (GateFailed). The
    record is returned with `reused_from`: that gate's folder (relative to `relative_to`) and
    manifest sha256. A gate of the same intended numerics (the fp16 stateless, chunk-KV and
    stateful packages of one conversion) thus measures quality once (300 s a gate on SmolLM2)."""
    from manifests.identity import MANIFEST_NAME, read_json
    from pipeline.stages.gates.report import REPORT_NAME, verify_alignment

    gate_dir = Path(gate_dir)
    verify_alignment(gate_dir)
    record = read_json(gate_dir / REPORT_NAME)["quality"]
    theirs = record.get("identity")
    for field, ours, got in _differences(identity, theirs if isinstance(theirs, dict) else {}):
        raise GateFailed(f"{gate_dir / REPORT_NAME}: field 'quality.identity.{field}' is {got!r}, here it is "
                         f"{ours!r}: that gate's quality record is not of this package's intended numerics and inputs")
    return {**record, "reused_from": {"path": portable_name(gate_dir, relative_to),
                                      "manifest_sha256": sha256_file(gate_dir / MANIFEST_NAME)}}


def _differences(ours: dict, theirs: dict, prefix: str = ""):
    """(dotted field, ours, theirs) for each leaf that differs, missing ones included."""
    for key in sorted(ours.keys() | theirs.keys()):
        a, b = ours.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            yield from _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            yield f"{prefix}{key}", a, b


def _block_figures(fp32_rows: np.ndarray, package_rows: np.ndarray | None, targets: np.ndarray):
    """(FP32's summed NLL of `targets`, the package's, summed KL(FP32 || package), rows whose
    argmax agree) of a block of rows; `package_rows` None: FP32's own. The NLLs are
    `log_softmax`'s values to the bit, the KL `kl_rows_of_logits`'."""
    if package_rows is None:
        nll = float(-log_softmax(fp32_rows)[np.arange(len(targets)), targets].sum())
        return nll, nll, 0.0, len(targets)
    kl, log_p, log_q = kl_rows_of_logits(fp32_rows, package_rows, targets)
    agree = int(np.count_nonzero(np.argmax(fp32_rows, -1) == np.argmax(package_rows, -1)))
    return float(-log_p.sum()), float(-log_q.sum()), float(kl.sum()), agree


def measure_quality(intended, inputs: QualityInputs, budget: Budget, all_figures: bool = False) -> tuple[dict, list]:
    """The quality record of `intended` (any Backend) against FP32, and its item scores.

    The held-out text comes first. The scoring set costs ten times its tokens (320 items on
    SmolLM2: 100 s, against 5 s for the text; 120-190 s a gate on Gemma 3), so it is measured
    only where its figure can still matter: under a budget that limits it (`items=`), for a
    package within budget on the text, or for every package with `all_figures`. Over budget on
    the text is over budget whatever the items say, and a budget without an items limit takes
    no verdict from them; the record says the figure was not measured and why. Intended
    numerics that are FP32's own (the same
    object) have nothing to compare: no item can change, and no scores are returned. Where
    only the text's logits are FP32's own (`_text_logits_are_fp32s`), the text is not run again.
    """
    from pipeline.stages.scoring import rank_differences, score_items

    same = _text_logits_are_fp32s(intended, inputs.fp32)
    nll = {"fp32": 0.0, "package": 0.0}
    kl_sum = agree = count = positions = nonfinite = 0
    for tokens, logits in zip(inputs.windows, inputs.fp32_logits):
        package = logits if same else intended.logits(tokens)
        if not same:
            nonfinite += int(np.count_nonzero(~np.isfinite(package)))
        positions += len(tokens) - 1  # a row that is not finite agrees with nothing
        # Rows in blocks: each block's log-softmaxes are its rows' own, and a window's whole
        # ones would be two more arrays of its logits' size (1 GB each for a 262k vocabulary).
        step = max(1, QUALITY_BLOCK_BYTES // (logits[0].nbytes or 1))
        for start in range(0, len(tokens) - 1, step):
            rows = np.arange(start, min(start + step, len(tokens) - 1))
            if not same:
                # A row with an inf or NaN fails the budget whatever else (below); the figures
                # are over the finite rows, so they stay numbers.
                rows = rows[np.isfinite(np.asarray(package[rows])).all(-1)]
                if not len(rows):
                    continue
            block = _block_figures(logits[rows], None if same else package[rows], tokens[rows + 1])
            nll["fp32"] += block[0]
            nll["package"] += block[1]
            kl_sum += block[2]
            agree += block[3]
            count += len(rows)
        del package
    if count:
        ppl = {k: float(np.exp(v / count)) for k, v in nll.items()}
        figures = {"ppl_change": ppl["package"] / ppl["fp32"] - 1, "top1_agreement": agree / positions,
                   "kl_mean": float(kl_sum / count)}
    else:  # not one finite row: nothing to measure, and the budget fails on nonfinite_logits
        ppl, figures = {"fp32": None, "package": None}, {"ppl_change": None, "top1_agreement": 0.0, "kl_mean": None}
    limits = {"ppl_change": ("<=", budget.ppl), "top1_agreement": (">=", budget.top1),
              "kl_mean": ("<=", budget.kl), "items_top1_changed": ("<=", budget.items)}

    def over(names):
        return [k for k in names if limits[k][1] is not None and figures[k] is not None and not (
            figures[k] <= limits[k][1] if limits[k][0] == "<=" else figures[k] >= limits[k][1])]

    # Every logit finite is no budget a user sets: an inf or NaN (fp16 overflow) fails whatever the figures.
    over_text = over(("ppl_change", "top1_agreement", "kl_mean")) + (["nonfinite_logits"] if nonfinite else [])
    skipped = None
    scores = None
    if intended is inputs.fp32:
        figures["items_top1_changed"] = 0.0
    elif over_text and not all_figures:
        figures["items_top1_changed"] = None
        skipped = (f"over budget on {', '.join(over_text)} from the held-out text already, so the scoring set "
                   "cannot change the verdict (--all-figures measures it anyway)")
    elif budget.items is None and not all_figures:
        figures["items_top1_changed"] = None
        skipped = ("the budget sets no limit on the scoring set (items=), so it cannot change the verdict "
                   "(--all-figures, or a budget with items=, measures it)")
    else:
        scores = score_items(intended, inputs.tokenizer, inputs.items)
        figures["items_top1_changed"] = len(rank_differences(inputs.fp32_scores, scores).top1_changed) / len(inputs.items)
    over_budget = over_text + ([] if figures["items_top1_changed"] is None else over(("items_top1_changed",)))
    return {"perplexity": ppl, **figures, "nonfinite_logits": nonfinite, "tokens": count, "items": len(inputs.items),
            **({"items_not_measured": skipped} if skipped else {}),
            "budget": {**asdict(budget), "spec": budget.spec()}, "over_budget": over_budget,
            "within_budget": not over_budget, "measured_on": intended.name}, scores


def _text_logits_are_fp32s(intended, fp32) -> bool:
    """Whether `intended`'s logits of a held-out window are FP32's by construction: the same
    object, or the same model run in one pass (no `chunk`) by another TorchBackend, where the
    cache dtype never enters (it rounds only what a snapshot keeps: the stateful kind's FP32
    reference, whose K/V cache is fp16). Its items still differ: they branch from snapshots."""
    return intended is fp32 or (getattr(intended, "model", None) is not None and intended.model is fp32.model
                                and getattr(intended, "chunk", 0) is None and fp32.chunk is None)
