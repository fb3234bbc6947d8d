"""A model cut into consecutive-layer pieces, each a package under the device's per-package limit.

iOS loads a package whole, and practice around Apple's tools (ANEMLL's `--chunk auto` caps a
piece at 950 MB) puts the limit near 1 GB on an iPhone: a 1.5B model in fp16 (3.5 GB) cannot
ship as one package. `plan_pieces` cuts the decoder's layers into runs whose weights fit the
limit; the embedding rides with the first run, the final norm and head with the last, or in a
piece of their own where they are too large to share one (Gemma 3's 262k-row head). Each piece
is a stateful package holding its own layers' K/V caches; the hidden state passes from piece to
piece in the package's float dtype, which is what the unsplit program computes there too
(an fp16 program's layer outputs are fp16), so the chain is the model op for op.

Like `coreml.layout`, this module imports neither torch nor coremltools: the manifests' readers
use it too.

    plan_pieces(layer_bytes=[10] * 6, embed_bytes=25, head_bytes=25, limit=50)
    # (Piece(0, 3, (0, 3), embeds=True, head=False), ..., Piece(2, 3, (5, 6), embeds=False, head=True))
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.ground.errors import CmfdeployError

# `--max-package-mb` counts MiB (2^20 bytes) of the saved piece, all its files: a bound that errs
# low against a loader's limit stated in decimal MB.
MB = 2**20
# The per-package limit `cmfdeploy coreml` and `make` cut under unless told otherwise: about what an
# iPhone loads (ANEMLL's --chunk auto caps pieces at 950 MB; practice around Apple's tools, ~1 GB).
DEFAULT_MAX_PACKAGE_MB = 1024.0
# What a piece's name says: its place in the chain (`Piece.name`).
PIECE_NAME = "piece-{index}-of-{count}.mlpackage"
# The hidden state's features between pieces: each piece's output but the last's, and input but the
# first's (Core ML refuses one name for a function's input and output).
HIDDEN_INPUT, HIDDEN_OUTPUT = "hidden_in", "hidden_out"
# Why a package is split (the manifest's `package.split.why`).
SPLIT_REASON = (
    "a device loads a package whole, and one larger than its per-package limit does not load (about 1 GB "
    "on iOS, as ANEMLL's --chunk auto caps pieces at 950 MB): the model is cut at layer boundaries into "
    "stateful packages run in turn, each holding its own layers' caches; the hidden state passes between "
    "them in the package's float dtype, what the unsplit program holds there too. A tied embedding is "
    "stored twice, in the first piece (the token lookup) and the last (the head)"
)


class PieceTooLarge(CmfdeployError):
    """No cut at layer boundaries keeps a piece under the limit (one layer, the embedding or the
    head alone exceeds it), or a saved piece came out over it."""


@dataclass(frozen=True)
class Piece:
    """One package of a split model: layers [start, stop) (empty for a head-only piece), with the
    token embedding where it is the first, the final norm and head where it is the last."""

    index: int
    count: int
    layers: tuple[int, int]
    embeds: bool
    head: bool

    @property
    def name(self) -> str:
        return PIECE_NAME.format(index=self.index + 1, count=self.count)

    @property
    def layer_count(self) -> int:
        return self.layers[1] - self.layers[0]

    def record(self) -> dict:
        """The manifest's `piece` record of this piece (`package.pieces[].piece`)."""
        return {"index": self.index, "count": self.count, "layers": list(self.layers),
                "takes": "input_ids" if self.embeds else "hidden",
                "gives": "logits" if self.head else "hidden"}

    @classmethod
    def from_record(cls, record: dict) -> "Piece":
        return cls(record["index"], record["count"], tuple(record["layers"]), record["takes"] == "input_ids",
                   record["gives"] == "logits")


def plan_pieces(layer_bytes: list[int], embed_bytes: int, head_bytes: int, limit: int,
                where: object = "model") -> tuple[Piece, ...]:
    """The fewest consecutive-layer pieces, filled in order, whose weight bytes each stay within
    `limit`: the embedding counted in the first, the head (with the final norm, counted in it)
    in the last, or alone after it where the last layers and it do not fit together. One piece
    where the whole fits. PieceTooLarge naming `where` when a layer, or the embedding with the
    first layer, or the head alone, exceeds the limit."""
    if not layer_bytes:
        raise PieceTooLarge(f"{where}: a model without decoder layers is not cut into pieces")
    runs, start, held = [], 0, embed_bytes
    for index, size in enumerate(layer_bytes):
        if held + size > limit and index > start:
            runs.append((start, index))
            start, held = index, 0
        held += size
        if held > limit:
            what = f"layer {index} ({size} B)" + (" with the embedding" if start == 0 else "")
            raise PieceTooLarge(f"{where}: {what} holds {held} B of weights, over the per-package limit of "
                                f"{limit} B; no cut at layer boundaries keeps a piece under it")
    if head_bytes > limit:
        raise PieceTooLarge(f"{where}: the head alone holds {head_bytes} B of weights, over the per-package "
                            f"limit of {limit} B")
    head_alone = held + head_bytes > limit
    runs.append((start, len(layer_bytes)))
    if head_alone:
        runs.append((len(layer_bytes), len(layer_bytes)))
    count = len(runs)
    return tuple(Piece(i, count, run, embeds=i == 0, head=i == count - 1) for i, run in enumerate(runs))


def pieces_of(block: dict) -> tuple[Piece, ...] | None:
    """The pieces a package's manifest block (`package`) records, in chain order; None for a
    package in one piece."""
    records = block.get("pieces")
    return None if records is None else tuple(Piece.from_record(p["piece"]) for p in records)


def program_views(manifest: dict) -> list[tuple[str, dict]]:
    """(the .mlpackage name, the manifest as that program's own) of each program of a package:
    the package's one, or each piece of a split package with its own block, op histogram and,
    compressed, selection, as every reader of one program reads them."""
    block = manifest["package"]
    if "pieces" not in block:
        return [(block["name"], manifest)]
    return [(piece["name"], {**manifest, "package": piece, "op_histogram": piece["op_histogram"],
                             **({"selection": piece["selection"]} if "selection" in piece else {})})
            for piece in block["pieces"]]


def chained_histogram(pieces: list[dict]) -> dict[str, dict[str, int]]:
    """The package's op histogram: per function, its ops summed over the pieces."""
    total: dict[str, dict[str, int]] = {}
    for piece in pieces:
        for function, counts in piece["op_histogram"].items():
            into = total.setdefault(function, {})
            for op, count in counts.items():
                into[op] = into.get(op, 0) + count
    return {function: dict(sorted(counts.items())) for function, counts in sorted(total.items())}
