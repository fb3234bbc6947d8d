"""Reference fixtures: the PyTorch FP32 logits every alignment gate compares against, made and read.

A fixtures folder holds `logits.npz` (no pickle) with, per case, `{case}.input_ids` int64
[T], `{case}.logits` float32 [T, vocab] and `{case}.valid_prefix` (leading ids that are
real tokens, the rest PAD); plus, when asked for (the default fixture, whose tests hold the
cached path to it), `long_kv_step_logits`, the `long` ids fed one token at a time through the
cached path. No gate reads them, and they cost a full forward per position: on Gemma 3 at 1024
positions, 1024 single steps through a 671 MB head. `index.json` records the checkpoint, tokenizer and texts, so
a gate can refuse fixtures that belong to another model.

Cases: `short` (16 tokens), `long` (the full context), `right_pad` (short right-padded with
PAD to 32), `changed_future` (short's 16 tokens, then 16 others: rows 0..15 must equal
short's). The default fixture's folder is frozen in the repository; any other model gets
one made here from its own CMF (`make_reference_fixtures`). Torch is imported by the
writer alone, so reading fixtures (and `cmfdeploy align --help`) never loads it.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from manifests.identity import canonical_json, file_identity, portable_name, read_json, sha256_bytes, sha256_file
from manifests.output import refuse_existing, staged_output
from pipeline.ground.errors import CmfdeployError
from pipeline.ground.text_roles import CALIBRATION_START

FORMAT = "cmfdeploy.fixtures/1"
SHORT = 16
PADDED = 32
# Where in the text lines each case starts (fixed, so the cases never move).
SHORT_LINE, LONG_LINE, FUTURE_LINE = 0, 100, 200
LINES_PER_CASE = 30


class FixtureTextError(CmfdeployError):
    """The text given for the fixtures is too short for a case."""


# ---------------------------------------------------------------- reading

@dataclass(frozen=True)
class FixtureCase:
    name: str
    input_ids: np.ndarray
    valid_prefix: int
    npz_path: Path

    @property
    def logits(self) -> np.ndarray:
        """The FP32 reference's logits of the case, read from the npz each time they are asked
        for: only an FP32 package's gate compares with them (once a case), a compressed one's
        computes its own, and the long case's are 1 GB for a 262k vocabulary at 1024 positions."""
        with np.load(self.npz_path, allow_pickle=False) as npz:
            return npz[f"{self.name}.logits"]


class ReferenceFixtures:
    """The frozen reference: `index.json` (identity, format, cases) plus `logits.npz`."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.index = read_json(self.directory / "index.json")
        self.npz_path = self.directory / "logits.npz"
        # The cases' ids now, their logits when read (FixtureCase.logits); long_kv_step_logits,
        # as large as the long case's, no gate reads.
        with np.load(self.npz_path, allow_pickle=False) as npz:
            self.cases = {
                name: FixtureCase(name, npz[f"{name}.input_ids"], int(npz[f"{name}.valid_prefix"]), self.npz_path)
                for name in self.index["cases"]
            }

    @property
    def checkpoint_sha256(self) -> str:
        return self.index["checkpoint"]["sha256"]

    def identity(self, relative_to: str | Path | None = None) -> dict:
        """`path` as `relative_to` may name it when given (reports that travel name no build path)."""
        path = str(self.directory) if relative_to is None else portable_name(self.directory, relative_to)
        return {"name": "reference-fixtures", "path": path,
                "sha256": sha256_file(self.directory / "index.json"),
                "logits": file_identity(self.npz_path),
                "checkpoint_sha256": self.checkpoint_sha256}


# ---------------------------------------------------------------- making

def pad_id(tokenizer) -> int:
    """PAD, or the first EOS for tokenizers without one (padding only has to be a real token)."""
    if tokenizer.pad_id is not None:
        return tokenizer.pad_id
    if tokenizer.eos_ids:
        return tokenizer.eos_ids[0]
    raise FixtureTextError(f"{tokenizer.source}: tokenizer_config has neither pad_token_id nor eos_token_ids "
                           "to right-pad the right_pad case with")


def build_cases(tokenizer, lines: list[str], context: int) -> dict[str, dict]:
    def ids(line: int, count: int) -> np.ndarray:
        # LINES_PER_CASE lines, or as many more blocks of them as a long context needs (Gemma 3's
        # vocabulary gives ~14 tokens a line: 1024 take ~75 lines); the start never moves, and no
        # case reads the calibration lines (pipeline.ground.text_roles).
        end, last = line + LINES_PER_CASE, min(len(lines), CALIBRATION_START)
        while len(encoded := tokenizer.encode(" ".join(lines[line:end]), add_bos=True)) < count and end < last:
            end += LINES_PER_CASE
        if len(encoded) < count:
            raise FixtureTextError(f"text lines {line}..{min(end, last)} give {len(encoded)} tokens, "
                                   f"fewer than the {count} the case needs")
        return encoded[:count]

    short = ids(SHORT_LINE, SHORT)
    pad = np.full(PADDED - SHORT, pad_id(tokenizer), dtype=np.int64)
    cases = {
        "short": (short, SHORT),
        "long": (ids(LONG_LINE, context), context),
        "right_pad": (np.concatenate([short, pad]), SHORT),
        "changed_future": (np.concatenate([short, ids(FUTURE_LINE, PADDED)[SHORT:]]), PADDED),
    }
    # `text` is what the real (non-BOS, non-PAD) ids decode to, not the longer passage they came from.
    return {name: {"input_ids": i, "valid_prefix": v, "text": tokenizer.decode(i[:v])} for name, (i, v) in cases.items()}


def reference_arrays(artifact: Path, cases: dict[str, dict], context: int, step_logits: bool) -> dict[str, np.ndarray]:
    import torch

    from pipeline.ground.models import KVCache
    from pipeline.ground.reference import load_reference

    with torch.no_grad():
        model, args, _ = load_reference(artifact)
        arrays = {}
        for name, case in cases.items():
            arrays[f"{name}.input_ids"] = case["input_ids"]
            arrays[f"{name}.logits"] = model(torch.as_tensor(case["input_ids"])).numpy().astype(np.float32, copy=False)
            arrays[f"{name}.valid_prefix"] = np.int64(case["valid_prefix"])
        if not step_logits:
            return arrays
        cache = KVCache.empty(args, context)
        # Written row by row: the steps' logits are as large as the long case's (1 GB for a
        # 262k vocabulary at 1024 positions), so no list of them and no joined copy.
        steps = arrays["long_kv_step_logits"] = np.empty((context, args.vocab_size), np.float32)
        for i in range(context):
            steps[i] = model.forward_cached(torch.as_tensor(cases["long"]["input_ids"][i : i + 1]), cache).numpy()
    return arrays


def make_reference_fixtures(artifact: str | Path, out_dir: str | Path, lines: list[str], *, context: int | None = None,
                            step_logits: bool = False, force: bool = False) -> Path:
    """Compute the cases from `lines` of text with the CMF at `artifact` (and `long_kv_step_logits` when
    `step_logits`); write `out_dir` atomically. `context` None: the model's deployed context
    (`ModelArgs.deployed_context`), the packages' default."""
    import torch

    from pipeline.ground.cmf import open_cmf
    from pipeline.ground.models.args import ModelArgs
    from pipeline.ground.tokenizer import tokenizer_from_artifact
    from pipeline.stages.disk import check_disk

    artifact, out_dir = Path(artifact), Path(out_dir)
    refuse_existing(out_dir, force)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    tokenizer = tokenizer_from_artifact(artifact)
    if context is None:
        with open_cmf(artifact) as cmf:
            context = ModelArgs.from_header(cmf.header, source=cmf.path.name).deployed_context
    cases = build_cases(tokenizer, lines, context)
    with open_cmf(artifact) as cmf:
        rows = sum(len(case["input_ids"]) for case in cases.values()) + (context if step_logits else 0)
        check_disk("reference-fixtures", out_dir, artifact, logits_bytes=4 * rows * cmf.arch["vocab_size"])
    arrays = reference_arrays(artifact, cases, context, step_logits)
    index = {
        "format": FORMAT,
        "checkpoint": {"file": artifact.name, "sha256": sha256_file(artifact), "format": "cmf", "version": 2},
        "tokenizer": {"sha256": sha256_bytes(open_cmf(artifact).vocab), "pad_id": pad_id(tokenizer)},
        "computed_with": "pipeline.ground.reference.load_reference, FP32 on CPU: model(ids) per case"
                         + (", forward_cached one token at a time for long_kv_step_logits" if step_logits else ""),
        "torch": torch.__version__,
        "cases": {name: {"tokens": len(c["input_ids"]), "valid_prefix": c["valid_prefix"], "text": c["text"]}
                  for name, c in cases.items()},
    }
    if step_logits:
        index["long_kv_step_logits"] = {"input_ids": "long.input_ids", "tokens": context}
    with staged_output(out_dir, force) as staging:
        np.savez(staging / "logits.npz", **arrays)
        (staging / "index.json").write_bytes(canonical_json(index))
    return out_dir
