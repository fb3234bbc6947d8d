"""The stateful package cut into pieces under the device's per-package limit (`coreml.split`).

Each piece is a prefill/decode multifunction package of its own, `piece-<i>-of-<n>.mlpackage`
in the one package folder, holding its layers' fp16 caches as states; one manifest describes
the model's interface (what `coreml.package.ChainedPackage` presents, so the stateful runner,
the gates and `generate` run the chain as they run one package) and each piece's under
`package.pieces`, each checked against its program by `coreml.crosscheck`.

Checked as the unsplit package is: at FP32 the saved chain on the executor against the unsplit
fp16-cache torch graph; below, the traced pieces chained in torch against it.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from coreml.kinds.base import PackageKind, feature, logits_features
from coreml.split import HIDDEN_INPUT, HIDDEN_OUTPUT, SPLIT_REASON, Piece, PieceTooLarge, chained_histogram, plan_pieces

if TYPE_CHECKING:
    from coreml.kinds.export import Reference
    from manifests.identity import Manifest


def split_plan(ref: Reference) -> tuple[Piece, ...] | None:
    """The pieces of `ref`'s stateful package under its conversion's limit, by the weight bytes
    each holds at the precision's float width; None where there is no limit or the whole fits."""
    if ref.max_package_bytes is None:
        return None
    model, itemsize = ref.model, ref.precision.numpy_dtype.itemsize

    def size(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters()) * itemsize

    if size(model) <= ref.max_package_bytes:
        return None  # in one program a tied table is stored once (`HeadParts.token_rows`), in pieces twice
    layers = [size(layer) for layer in model.model.layers]
    head = model.head.weight.numel() * itemsize + size(model.model.norm)
    plan = plan_pieces(layers, size(model.model.embed_tokens), head, ref.max_package_bytes, where=ref.bundle_dir)
    return plan if len(plan) > 1 else None


def piece_block(whole: dict, ref: Reference, piece: Piece) -> dict:
    """Piece `piece`'s manifest block: the whole package's (`Stateful.interface`) with the hidden
    state in place of the token input after the first piece and of the logits before the last,
    and caches of its own layers (none for a head-only piece)."""
    shape, dtype = [1, "T", ref.args.hidden_size], ref.precision.float_dtype
    block = {key: value for key, value in whole.items() if key not in ("states", "inputs", "outputs")}
    block["name"] = piece.name
    block["inputs"] = [whole["inputs"][0] if piece.embeds else feature(
        HIDDEN_INPUT, dtype, shape, "the hidden states the piece before gave, one row per input position"),
        *whole["inputs"][1:]]
    block["outputs"] = logits_features(ref) if piece.head else [feature(
        HIDDEN_OUTPUT, dtype, shape, "the hidden states after the piece's last layer, one row per input position")]
    if piece.layer_count:
        shape = [piece.layer_count, *whole["states"][0]["shape"][1:]]
        block["states"] = [{**state, "shape": shape} for state in whole["states"]]
    block["piece"] = piece.record()
    return block


class PieceGraph(nn.Module):
    """One piece's stateful graph: layers start..stop-1 over fp16 buffers of their own caches
    (named as the interface names its states; the whole of each written back every call, as
    `Stateful.graph` does), from the token ids or the hidden state, to the hidden state or
    the logits (the head in parts where the reference splits it)."""

    def __init__(self, model: nn.Module, piece: Piece, ref: Reference):
        super().__init__()
        from coreml.kinds.export import HeadParts

        self.model, self.piece, self.unit = model, piece, ref.interface
        self.head = HeadParts(model, ref.head_rows) if piece.head and ref.head_rows is not None else None
        if piece.layer_count:
            shape = (piece.layer_count, *ref.cache_shape[1:])
            for name in (self.unit.key_cache, self.unit.value_cache):
                self.register_buffer(name, torch.zeros(shape, dtype=torch.float16))

    def forward(self, x, position):
        h = x
        if self.piece.layer_count:
            key_cache, value_cache = getattr(self, self.unit.key_cache), getattr(self, self.unit.value_cache)
            h, keys, values = self.model.layers_with_cache_tensors(x, position, key_cache, value_cache, self.piece.layers,
                                                                   compute_dtype=torch.float32)
            key_cache[:] = torch.stack(keys)
            value_cache[:] = torch.stack(values)
        if not self.piece.head:
            return h
        hidden = self.model.model.norm(h)
        return self.model.logits_of(hidden) if self.head is None else self.head(hidden)


class ChainedGraphs(nn.Module):
    """Graphs of the pieces (traced or eager) run in turn behind the unsplit stateful graph's
    interface: buffers of the whole model's caches, each piece's layers copied into its own
    buffers before it runs and back after (what `Stateful.check_traced` reads and writes)."""

    def __init__(self, graphs: list[nn.Module], pieces: tuple[Piece, ...], ref: Reference):
        super().__init__()
        self.graphs, self.pieces, self.unit = graphs, pieces, ref.interface
        for name in (self.unit.key_cache, self.unit.value_cache):
            self.register_buffer(name, torch.zeros(ref.cache_shape, dtype=torch.float16))

    def forward(self, ids, position):
        x = ids
        for graph, piece in zip(self.graphs, self.pieces):
            start, stop = piece.layers
            buffers = [name for name in (self.unit.key_cache, self.unit.value_cache) if piece.layer_count]
            for name in buffers:
                getattr(graph, name).copy_(getattr(self, name)[start:stop])
            x = graph(x, position)
            for name in buffers:
                getattr(self, name)[start:stop] = getattr(graph, name)
        return x


def piece_example(ref: Reference, piece: Piece, length: int) -> tuple:
    """Example inputs that trace a piece: token ids for the first, hidden states for the others."""
    from coreml.kinds.export import example_ids, position_tensor

    if piece.embeds:
        return example_ids(ref.args.vocab_size, length, 0), position_tensor(3)
    return torch.randn(1, length, ref.args.hidden_size, generator=torch.Generator().manual_seed(0)), position_tensor(3)


def export_split(kind: PackageKind, ref: Reference, plan: tuple[Piece, ...], package_dir: Path,
                 step: Callable[[str], None]) -> Manifest:
    """The stateful package of `ref` as the pieces of `plan`, saved into `package_dir` (not there
    yet) with one manifest; `step` is called `kind.steps` times, as the unsplit export calls it."""
    from coreml.kinds.export import (TRACE_LENGTH, convert_traced, describe_model, traced_check_record,
                                     trace_module)
    from coreml.manifest import save_model, working_files_in
    from coreml.multifunction import merge_functions
    from pipeline.ground.workers import return_freed_memory

    start = time.perf_counter()
    whole = kind.interface(ref)
    blocks = [piece_block(whole, ref, piece) for piece in plan]
    package_dir.mkdir(parents=True)
    traced_errors: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(dir=package_dir.parent) as scratch:
        saved: dict[int, dict[str, Path]] = {piece.index: {} for piece in plan}
        for name, function in whole["functions"].items():
            step(f"stateful: trace and convert {name} ({len(plan)} pieces)")
            length = min(TRACE_LENGTH, function["dims"]["T"][1])
            traced = [trace_module(PieceGraph(ref.model, piece, ref), piece_example(ref, piece, length))
                      for piece in plan]
            if ref.precision.compute_precision != "float32":
                checks = kind.DECODE_CHECKS if function["dims"]["T"][1] == 1 else ref.check_schedules
                traced_errors[name] = kind.check_traced(ChainedGraphs(traced, plan, ref), ref, name, checks)
            for piece, graph, block in zip(plan, traced, blocks):
                path = saved[piece.index][name] = Path(scratch) / f"{piece.index}-{name}.mlpackage"
                mlmodel = convert_traced(graph, block, function, ref.precision, path)
                describe_model(mlmodel, block, ref, piece_description(kind, ref, piece))
                save_model(mlmodel, path)
                del mlmodel
            del traced
            return_freed_memory()
        step(f"stateful: save {len(plan)} multifunction pieces")
        for piece, block in zip(plan, blocks):
            with working_files_in(package_dir.parent):
                mlmodel = merge_functions(saved[piece.index], whole["default_function"])
                describe_model(mlmodel, block, ref, piece_description(kind, ref, piece), features=False)
                save_model(mlmodel, package_dir / piece.name)
    if ref.precision.compute_precision == "float32":
        step("stateful: measure the fp16-cache error of the chained pieces")
        from coreml.package import ChainedPackage

        chain = ChainedPackage.open(package_dir, {"package": {**whole, "pieces": blocks}}, "executor", "prefill")
        checks = kind.measure(chain, ref, whole)
    else:
        step("stateful: record the checks of the traced pieces")
        checks = {"traced_vs_fp16_cache_graph_max_abs": traced_errors, "tolerance": ref.tolerance,
                  "cache_tolerance": ref.cache_tolerance, **traced_check_record(ref.precision)}
    return finish_split(package_dir, ref, whole, blocks, checks, time.perf_counter() - start)


def piece_description(kind: PackageKind, ref: Reference, piece: Piece) -> str:
    stop = piece.layers[1] - 1
    layers = f"layers {piece.layers[0]}-{stop}" if piece.layer_count else "no layers"
    ends = (["the token embedding"] if piece.embeds else []) + (["the final norm and head"] if piece.head else [])
    return (f"{kind.description_for(ref)}; piece {piece.index + 1} of {piece.count}: {layers}"
            + (f", {' and '.join(ends)}" if ends else ""))


def finish_split(package_dir: Path, ref: Reference, whole: dict, blocks: list[dict], checks: dict,
                 seconds: float) -> Manifest:
    """The split package's manifest: the model's interface, each piece's block completed with
    what its saved program says (weights, kept fp32 ops, op histogram, bytes), and each piece
    under the limit, else PieceTooLarge."""
    from coreml import manifest as package_manifest
    from coreml.kinds.export import finish_package, head_split_record, kept_fp32_record, weight_names

    pieces = []
    for block in blocks:
        mlpackage = package_dir / block["name"]
        size = package_manifest.package_bytes(mlpackage)
        if size > ref.max_package_bytes:
            raise PieceTooLarge(f"{mlpackage}: the saved piece holds {size} B, over the per-package limit of "
                                f"{ref.max_package_bytes} B (conversion field 'max_package_mb')")
        piece = {**block, "weights": weight_names(mlpackage, ref.model, ref.precision.numpy_dtype),
                 "fp32_ops": kept_fp32_record(mlpackage), "op_histogram": package_manifest.op_histogram(mlpackage),
                 "package_bytes": size}
        if block["piece"]["gives"] == "logits" and ref.head_rows is not None:
            piece["head_split"] = head_split_record(ref, token_lookup=False)  # the first piece looks tokens up
        pieces.append(piece)
    block = {key: value for key, value in whole.items() if key != "name"}
    block["pieces"] = pieces
    block["split"] = {"max_package_bytes": ref.max_package_bytes, "why": SPLIT_REASON}
    return finish_package(package_dir, ref, block, checks, seconds, histogram=chained_histogram(pieces),
                          size=sum(piece["package_bytes"] for piece in pieces))
