"""CLI: `cmfdeploy coreml BUNDLE -o OUT` and `cmfdeploy compress PACKAGE RECIPE -o OUT`."""

import argparse

from tqdm import tqdm

from coreml.interfaces import DEFAULT_INTERFACE, INTERFACES, loader_interface
from coreml.kinds import KINDS
from coreml.precisions import PRECISIONS, precision
from coreml.split import DEFAULT_MAX_PACKAGE_MB
from pipeline.cli.worker_arguments import add_worker_engine_arguments, worker_engine_of

# Kinds and recipes are checked by export_coreml and compress_package (typed errors naming the
# known ones), not by argparse choices. The recipes are not listed here: coreml.recipes would
# import coremltools and torch into `--help` (the kinds' registry imports neither).


def register(subparsers) -> None:
    convert = subparsers.add_parser("coreml", help="convert an FP32 bundle into Core ML packages")
    convert.add_argument("bundle", help="bundle directory (from `cmfdeploy bundle`)")
    convert.add_argument("-o", "--out", required=True, help="output directory; one subfolder per package kind")
    convert.add_argument("--kinds", nargs="+", help=f"{', '.join(KINDS)} (default: all of them)")
    convert.add_argument("--context", type=int, help="KV/flexible-length context (default: the model's limit, at most 2048)")
    convert.add_argument("--jobs", type=int, default=1,
                         help="package kinds converted at a time, each in its own process with an equal share of the cores")
    convert.add_argument("--precision", default="fp32",
                         help="compute precision: " + "; ".join(f"{p.name}: {p.description}" for p in PRECISIONS.values())
                         + " (default: fp32)")
    convert.add_argument("--preflight", metavar="DIR",
                         help="fp16: the preflight report whose mitigations the conversion applies (default: "
                              "OUT/../preflight, made first by `cmfdeploy preflight` when absent)")
    convert.add_argument("--head-part-width", type=int, metavar="ROWS",
                         help="a precision of the Neural Engine's layout (fp16): a head wider than this many rows is "
                              "split into logits_0.. outputs of at most this many (default: the Neural Engine's "
                              "H/W limit, 16384)")
    convert.add_argument("--interface", default=DEFAULT_INTERFACE,
                         help="the names the stateful package takes, for the Swift loader that loads it (docs/INTERFACES.md): "
                              + "; ".join(f"{i.name}: {i.description}" for i in INTERFACES.values())
                              + f" (default: {DEFAULT_INTERFACE}; the other kinds keep it)")
    convert.add_argument("--max-package-mb", type=_package_limit, default=DEFAULT_MAX_PACKAGE_MB, metavar="MB",
                         help="cut the stateful package into consecutive-layer pieces of at most this many MiB each, "
                              f"the device's per-package limit (docs/SPLIT.md; default {DEFAULT_MAX_PACKAGE_MB:g}, about "
                              "an iPhone's); 'none': one package whatever its size")
    add_worker_engine_arguments(convert)
    convert.add_argument("--force", action="store_true", help="replace an existing output")
    convert.set_defaults(func=_coreml)

    compress = subparsers.add_parser("compress", help="apply a compression recipe to a Core ML package")
    compress.add_argument("package", help="package directory (out/<kind>/ from `cmfdeploy coreml`)")
    compress.add_argument("recipe", help="a recipe of coreml.recipes.RECIPES (e.g. int8-b32, palette4-gc32)")
    compress.add_argument("-o", "--out", required=True, help="output package directory")
    compress.add_argument("--force", action="store_true", help="replace an existing output")
    compress.set_defaults(func=_compress)


def _package_limit(text: str) -> float | None:
    """--max-package-mb: a size in MiB (its sign is the conversion's to refuse, by name), or 'none'."""
    if text.lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a size in MiB nor 'none'") from None


def _coreml(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from coreml.convert import export_coreml, export_steps
    from coreml.kinds.export import Conversion

    kinds, engine = args.kinds or tuple(KINDS), worker_engine_of(args)
    fp16 = precision(args.precision).compute_precision == "float16"  # an unknown name is refused by name here
    loader_interface(args.interface)  # and so is an unknown interface, before the preflight
    conversion = _fp16_conversion(args) if fp16 else Conversion(args.precision)
    if args.head_part_width is not None:
        conversion = replace(conversion, head_part_width=args.head_part_width)
    conversion = replace(conversion, interface=args.interface, max_package_mb=args.max_package_mb)
    # disable=False explicitly: the quiet CLI disables tqdm's default to silence coremltools' bars.
    with tqdm(total=export_steps(kinds, args.jobs, engine), unit="stage", disable=False) as bar:

        def progress(stage: str) -> None:
            bar.set_description(stage)
            bar.update(1)

        manifests = export_coreml(args.bundle, args.out, kinds, force=args.force, context=args.context,
                                  progress=progress, jobs=args.jobs, conversion=conversion,
                                  engine=engine)
    for kind, manifest in manifests.items():
        print(f"{kind}: {manifest.path} ({manifest['package_bytes']} bytes)")
    return 0


def _fp16_conversion(args: argparse.Namespace):
    """The preflight's mitigations for an fp16 conversion; the preflight runs first where there is none."""
    from pathlib import Path

    from pipeline.stages.preflight import fp16_conversion, run_preflight

    preflight = Path(args.preflight) if args.preflight else Path(args.out).parent / "preflight"
    if not preflight.exists():
        print(f"preflight: {preflight} (none yet: measuring fp16 peaks first)")
        run_preflight(args.bundle, preflight, context=args.context)
    return fp16_conversion(args.bundle, preflight, args.precision)


def _compress(args: argparse.Namespace) -> int:
    from coreml.recipes import compress_package

    manifest = compress_package(args.package, args.recipe, args.out, force=args.force)
    print(f"{args.recipe}: {manifest.path} ({manifest['size_bytes']} bytes, "
          f"{manifest['base_size_bytes']} before)")
    return 0
