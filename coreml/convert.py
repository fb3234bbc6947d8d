"""Convert a bundle's reference model into Core ML packages: `export_coreml` runs the
exporters of the requested kinds (`coreml.kinds`, one module each) into one atomic output.
"""

from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path

from coreml.interfaces import DEFAULT_INTERFACE, INTERFACES, Interface, shaping
from coreml.kinds import KINDS, UnknownKind
from coreml.kinds.export import Conversion, Reference, reference_for_export
from coreml.precisions import precision
from manifests.disk import DISK_NEEDS, require_disk
from manifests.identity import Manifest, artifact_source, load_manifest
from manifests.output import refuse_existing, staged_output
from pipeline.ground.bundle_format import WEIGHTS_NAME
from pipeline.ground.workers import LOCAL, WorkerEngine, bundle_job_memory, run_in_workers


def in_workers(kinds: tuple[str, ...], jobs: int, engine: WorkerEngine) -> bool:
    """Whether `export_coreml` converts these kinds in workers rather than in its own process."""
    return (jobs > 1 and len(kinds) > 1) or not engine.in_process


def export_steps(kinds: Iterable[str], jobs: int = 1, engine: WorkerEngine = LOCAL) -> int:
    """How many times `export_coreml` calls `progress` for these kinds (for a progress bar)."""
    kinds = tuple(kinds)
    if in_workers(kinds, jobs, engine):
        return 1 + len(kinds)  # one step as each worker's kind is done
    return 1 + sum(KINDS[k].steps for k in kinds if k in KINDS)  # an unknown kind is export_coreml's to refuse


def export_coreml(
    bundle_dir: str | Path,
    out_dir: str | Path,
    kinds: Iterable[str] = KINDS,
    force: bool = False,
    context: int | None = None,
    progress: Callable[[str], None] | None = None,
    jobs: int = 1,
    conversion: Conversion = Conversion(),
    engine: WorkerEngine = LOCAL,
) -> dict[str, Manifest]:
    """Convert the bundle at `bundle_dir` into `out_dir/<kind>/` packages; manifests by kind.

    The bundle is verified (hashes included) before anything is built from it; the whole
    output appears at once (temp sibling + rename) or not at all. `context` caps the
    package context below the model's max_position_embeddings. `jobs` > 1 converts that
    many kinds at a time, each in a worker process (`_kinds_in_workers`). `conversion` names the
    precision and the model transform every kind traces (`coreml.kinds.export.Conversion`).
    `engine` says where the workers run (the Ray engine converts even one kind on the cluster).
    The kinds `conversion.interface` shapes take its names (`coreml.interfaces`), the others cmfdeploy's.
    """
    kinds, out_dir = tuple(kinds), Path(out_dir)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise UnknownKind(f"{out_dir}: package kinds {unknown or '(none)'} are not among {tuple(KINDS)}")
    shaping(conversion.interface, kinds, precision(conversion.precision).float_dtype, out_dir)
    step = progress or (lambda stage: None)
    refuse_existing(out_dir, force)
    step("verify the bundle and build the reference model")
    ref = reference_for_export(Path(bundle_dir), context, conversion)
    # Before coremltools writes a byte: out of room there it fails as 'A valid manifest does not exist'.
    require_disk(out_dir, DISK_NEEDS["coreml"], (Path(bundle_dir) / WEIGHTS_NAME).stat().st_size,
                 units=len(kinds), jobs=min(jobs, len(kinds)))
    with staged_output(out_dir, force) as staging:
        if in_workers(kinds, jobs, engine):
            del ref  # each worker builds its own; this one's weights need not sit here meanwhile
            _kinds_in_workers(kinds, Path(bundle_dir), staging, out_dir, context, jobs, step, conversion, engine)
        else:
            for kind in kinds:
                _export(ref, kind, staging, out_dir, step, conversion)
    return {kind: Manifest(out_dir / kind, load_manifest(out_dir / kind)) for kind in kinds}


def _export(ref: Reference, kind: str, staging: Path, out_dir: Path, step: Callable[[str], None],
            conversion: Conversion) -> None:
    # A package's records take their relative paths from its final folder, not the staging one.
    final = out_dir / kind
    unit = kind_interface(conversion.interface, kind)
    # A single-function interface's loader reads one `logits` output: its head is never split.
    head_rows = None if unit.single_function else ref.head_rows
    KINDS[kind].export(replace(ref, source=artifact_source(ref.bundle_dir, relative_to=final),
                               numerics=conversion.record(final), interface=unit, head_rows=head_rows),
                       staging / kind, step)


def kind_interface(name: str, kind: str) -> Interface:
    """The interface a package of `kind` takes in a conversion asking for interface `name`."""
    unit = INTERFACES[name]
    return unit if unit.shapes(kind) else INTERFACES[DEFAULT_INTERFACE]


def _kinds_in_workers(kinds: tuple[str, ...], bundle_dir: Path, staging: Path, out_dir: Path, context: int | None,
                      jobs: int, step: Callable[[str], None], conversion: Conversion = Conversion(),
                      engine: WorkerEngine = LOCAL) -> None:
    """The kinds converted by `jobs` worker processes (`pipeline.ground.workers`), each with a
    1/jobs share of the cores, the longest first (the kind of most export steps: stateful,
    half the total on SmolLM2). Tracing, coremltools' MIL passes and saving run mostly on one
    core, so two workers take about the longest kind's time instead of the sum. Each worker
    verifies the bundle and builds its reference model once: kind names in, package folders out."""
    setup = {"bundle": str(bundle_dir), "context": context, "staging": str(staging), "out_dir": str(out_dir),
             "conversion": asdict(conversion)}
    longest_first = sorted(kinds, key=lambda kind: -KINDS[kind].steps)
    run_in_workers("coreml.convert:conversion_worker", setup, longest_first, jobs, where=out_dir, shared=(staging,),
                   engine=engine, done=lambda kind, _: step(f"{kind}: converted"),
                   memory_per_job=bundle_job_memory(bundle_dir))


def conversion_worker(setup: dict) -> Callable[[str], str]:
    """A worker of `_kinds_in_workers`: each kind it is given, exported into the staging folder."""
    conversion = Conversion(**setup["conversion"])
    ref = reference_for_export(Path(setup["bundle"]), setup["context"], conversion)

    def convert(kind: str) -> str:
        _export(ref, kind, Path(setup["staging"]), Path(setup["out_dir"]), lambda stage: None, conversion)
        return kind
    return convert
