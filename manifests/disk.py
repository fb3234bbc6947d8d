"""The disk a stage needs at its peak, checked before it writes anything (docs/DISK.md).

    require_disk(out_dir, DISK_NEEDS["bundle"], weight_bytes)

Every need is a bound in W, the model's FP32 weight bytes (a bundle's weights.safetensors),
and L, the float32 logits a gate computes (its cases' and quality windows' rows x vocab x 4
bytes), derived from the copies of the weights the stage has on disk at once, and checked
against `benchmarks/disk_peaks.py`'s measurements. A stage out of room used to fail deep
inside a library (coremltools: 'A valid manifest does not exist') or part-way through a write
(`OutputWriteFailed`); now it is refused by name before it starts: NotEnoughDisk names the
stage, the output, the filesystem checked, the bytes needed and how they were counted, and
the bytes free.

What a stage writes beside its output (its staging folder, `manifests.output`, and
coremltools' working files, which `coreml.manifest.working_files_in` puts there) is checked on
the output's filesystem; what its gates hold in unlinked scratch files
(`pipeline.ground.scratch`) on the temp folder's. Where both are one filesystem, their sum is.
"""

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.ground.errors import NotEnoughDisk

MiB = 1 << 20


@dataclass(frozen=True)
class DiskNeed:
    """A stage's peak disk: `weight_multiple` x W for each unit it keeps (a package kind, a
    surveyed recipe; 1 for a stage of one output), `job_multiple` x W for each job running at
    once (a conversion's or compression's working copies) and `logits_multiple` x L, beside the
    output; `scratch_multiple` x W + `scratch_logits_multiple` x L for each job in the temp
    folder; and `fixed_bytes` for what does not grow with the model (reports, plots, tokenizer
    files)."""

    stage: str
    weight_multiple: float
    fixed_bytes: int
    why: str
    job_multiple: float = 0.0
    logits_multiple: float = 0.0
    scratch_multiple: float = 0.0
    scratch_logits_multiple: float = 0.0

    def output_bytes(self, weight_bytes: int, logits_bytes: int = 0, units: int = 1, jobs: int = 1) -> int:
        weights = (units * self.weight_multiple + jobs * self.job_multiple) * weight_bytes
        return int(weights + self.logits_multiple * logits_bytes) + self.fixed_bytes

    def scratch_bytes(self, weight_bytes: int, logits_bytes: int = 0, jobs: int = 1) -> int:
        return int(jobs * (self.scratch_multiple * weight_bytes + self.scratch_logits_multiple * logits_bytes))

    def formula(self, weight_bytes: int, logits_bytes: int, units: int, jobs: int) -> str:
        """How the bytes were counted, with the figures put in."""
        terms = []
        if self.weight_multiple:
            terms.append(f"{units} x {self.weight_multiple:g} x W" if units != 1 else f"{self.weight_multiple:g} x W")
        if self.job_multiple:
            terms.append(f"{jobs} x {self.job_multiple:g} x W" if jobs != 1 else f"{self.job_multiple:g} x W")
        if self.logits_multiple:
            terms.append(f"{self.logits_multiple:g} x L")
        for multiple, what in ((self.scratch_multiple, "W (temp folder)"),
                               (self.scratch_logits_multiple, "L (temp folder)")):
            if multiple:
                terms.append(f"{jobs} x {multiple:g} x {what}" if jobs != 1 else f"{multiple:g} x {what}")
        terms.append(f"{self.fixed_bytes} B fixed")
        figures = f"W = {weight_bytes} B, the model's FP32 weight bytes"
        if self.logits_multiple or self.scratch_logits_multiple:
            figures += f"; L = {logits_bytes} B of float32 logits"
        return f"{' + '.join(terms)} ({figures}; {self.why})"


# One row per stage: its peak as the copies of the weights it has on disk at once. Each bound is
# derived from what the stage writes; docs/DISK.md has the measured peaks beside them (the
# 1M-parameter fixture, SmolLM2-135M), every one at or under its bound.
DISK_NEEDS = {need.stage: need for need in (
    # write_cmf stages the payloads of a streamed import in a temporary file and copies them in
    # behind the header: two copies of the CMF at once, an f32 CMF being 1 W (a narrower quant
    # policy takes less). Measured 2.00 W on SmolLM2.
    DiskNeed("import", 2.0, 16 * MiB, "the staged payloads and the CMF they are copied into"),
    # One FP32 safetensors file and the tokenizer files (W counts both), written once; beside them
    # only the config and the manifest, kilobytes.
    DiskNeed("bundle", 1.0, MiB, "weights.safetensors and the tokenizer files"),
    # Each kind's package is at most 1 W (FP32; fp16 is half). A job converting a kind holds
    # coremltools' working copies in the staging folder besides (`working_files_in`): the
    # converted program's weights and its temporary package, and for a stateful kind each
    # function's package and their merge: 3 W at most. Measured 3.30 W for one stateful kind
    # of SmolLM2 (its 1 W package and 2.3 W of working copies at the peak).
    DiskNeed("coreml", 1.0, 16 * MiB, "each kind's package; coremltools' working copies while a kind converts",
             job_multiple=3.0),
    # A compressed package is at most 16 bits a weight (0.5 W). coremltools reads the FP32
    # program in place and saves each compressed function as a temporary package (0.5 W each,
    # two for a stateful package, compressed one function at a time) before the merge writes
    # another: 1.5 W of working copies at most.
    DiskNeed("compress", 0.5, 16 * MiB, "the compressed package (at most 16 bits a weight) and coremltools' "
             "temporary packages", job_multiple=1.5),
    # A report, a plot and a page beside the output; in scratch, the fp16 reference's halves of
    # the model and of its mitigated copy (0.5 W each) and the mitigation's rescaled weights,
    # float32 (1 W at most). Measured 0.99 W on SmolLM2 in its first 400 s (stopped there).
    DiskNeed("preflight", 0.0, 16 * MiB, "a report, a plot and a page; fp16 halves and rescaled weights in scratch",
             scratch_multiple=2.0),
    # logits.npz: the cases' float32 logits (and a long case's steps), L, written once; the
    # model is read from the CMF, never written.
    DiskNeed("reference-fixtures", 0.0, 16 * MiB, "logits.npz, the cases' float32 logits", logits_multiple=1.0),
    # A gate writes a report; its scratch holds a compressed package's weights decoded for the
    # intended reference (1 W) and as the executor's constexpr results (1 W at most: each
    # weight once), an fp16 reference's halves (0.5 W) and its mitigation's rescaled weights
    # (float32, 1 W at most), and its logits: the FP32 quality windows' and a case's two
    # sides (L). Measured 4.40 W on the fixture's FP32 gates, nearly all L (4.0 W there).
    DiskNeed("align", 0.0, 16 * MiB, "a report and a plot; decoded weights and logits in scratch",
             scratch_multiple=3.5, scratch_logits_multiple=1.0),
    # A survey keeps each recipe's package, at most 16 bits a weight (0.5 W), with its gate and
    # scores; each job holds a compression's working copies (as compress) and then its gate's
    # scratch (as align). Measured 3.48 W on SmolLM2 (int8-b32, one job; bound 6.5 W with
    # L = 1.02 W): 0.29 W kept, the rest the gate's scratch.
    DiskNeed("survey", 0.5, 16 * MiB, "each recipe's package (at most 16 bits a weight), its gate and scores",
             job_multiple=1.5, scratch_multiple=3.5, scratch_logits_multiple=1.0),
    # A deployment is one survey recipe on the stateful package: its compressed package, the
    # compression's working copies, and the gate's scratch.
    DiskNeed("deploy", 0.5, 16 * MiB, "the compressed package (at most 16 bits a weight) and its gate",
             job_multiple=1.5, scratch_multiple=3.5, scratch_logits_multiple=1.0),
    # A release copies each package it ships (a unit each), at most 1 W (an FP32 one), with its
    # gate, and the survey's records.
    DiskNeed("release", 1.0, 16 * MiB, "a copy of each package it ships, at most 1 W each"),
)}


def nearest_existing(path: str | os.PathLike) -> Path:
    """`path`, or its closest ancestor that exists: the folder a new output will be made in."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def same_filesystem(a: Path, b: Path) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def require_disk(out_path: str | os.PathLike, need: DiskNeed, weight_bytes: int, *, logits_bytes: int = 0,
                 units: int = 1, jobs: int = 1) -> None:
    """Raise NotEnoughDisk unless the filesystems `need` writes on have its bytes free: the
    output's (`out_path`, or its nearest existing ancestor) and the temp folder's."""
    out_fs, temp_fs = nearest_existing(out_path), Path(tempfile.gettempdir())
    output = need.output_bytes(weight_bytes, logits_bytes, units, jobs)
    scratch = need.scratch_bytes(weight_bytes, logits_bytes, jobs)
    same = scratch == 0 or same_filesystem(out_fs, temp_fs)
    checks = [(out_fs, output + scratch)] if same else [(out_fs, output), (temp_fs, scratch)]
    for folder, needed in checks:
        _refuse_unless_free(out_path, need.stage, folder, needed, need.formula(weight_bytes, logits_bytes, units, jobs),
                            "output folder (-o)" if folder == out_fs else "temp folder (TMPDIR)")


def require_copy_disk(out_path: str | os.PathLike, stage: str, copied_bytes: int, what: str) -> None:
    """Raise NotEnoughDisk unless the output's filesystem has room for a stage that copies
    `copied_bytes` of an artifact as it is (`what` says which), and its small files."""
    needed = copied_bytes + COPY_FIXED_BYTES
    _refuse_unless_free(out_path, stage, nearest_existing(out_path), needed,
                        f"{copied_bytes} B of {what} + {COPY_FIXED_BYTES} B fixed", "output folder (-o)")


# Beside what a copying stage copies: its manifest, descriptor and page, kilobytes.
COPY_FIXED_BYTES = MiB


def _refuse_unless_free(out_path, stage: str, folder: Path, needed: int, counted_as: str, elsewhere: str) -> None:
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise NotEnoughDisk(
            f"{out_path}: stage {stage!r} needs {needed} B ({needed / 2**30:.2f} GiB) free on the "
            f"filesystem of {folder}, which has {free} B ({free / 2**30:.2f} GiB); counted as "
            f"{counted_as}. Free space there, or pass another {elsewhere}")
