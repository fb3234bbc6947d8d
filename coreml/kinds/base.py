"""A package kind: one registered unit that knows its interface, graph, exporter, runner,
cache dtype and usage snippet, so adding a kind is adding one module under coreml/kinds/.

    @register_kind
    class ChunkKV(PackageKind):
        name = "chunk_kv"
        ...

What the kinds share lives beside them: `export` (the reference, tracing, checks, conversion,
manifest) and `cache_runner` (snapshots, the runner base). The registry is read where nothing
is converted (the gates, `--help`), so it imports neither torch nor coremltools: what builds a
package (graphs, exporters, interfaces) imports them, with `export` and coreml.manifest, when it runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from coreml.layout import chunk_lengths
from pipeline.ground.errors import CmfdeployError
from pipeline.ground.registry import Registry

if TYPE_CHECKING:
    from torch import nn

    from coreml.precisions import Precision
    from coreml.kinds.cache_runner import CacheRunner
    from coreml.kinds.export import Reference
    from manifests.identity import Manifest

CACHE_MEANING = "(layer, batch, kv_head, slot, head_dim); slot s holds the token at absolute position s"


class UnknownKind(CmfdeployError):
    """A package kind no module under coreml/kinds/ registers."""


def feature(name: str, dtype: str, shape: list, meaning: str) -> dict:
    """One input, output or state of a package's interface (the manifest's `package` block)."""
    return {"name": name, "dtype": dtype, "shape": shape, "meaning": meaning}


def position_feature() -> dict:
    """The `position` input of the kinds that carry a K/V cache."""
    return feature(
        "position", "int32", [1],
        "absolute position of input_ids[0, 0]; cache slots position..position+T-1 are written, later slots are ignored",
    )


def chunked_prompt_lines(lengths: tuple[int, ...], call: str, after: str = "") -> list[str]:
    """RELEASE.md's loop feeding the prompt `ids` in the enumerated `lengths`, largest first
    (1 among them, so every prompt length is reached exactly): `call` predicts on the chunk
    `ids[position:position + n]` into `out`; `after` (if any) carries what the next chunk reads."""
    return [f"position, lengths = 0, {sorted(lengths, reverse=True)}  # the enumerated chunk lengths, largest first",
            "while position < len(ids):",
            "    n = next(n for n in lengths if n <= len(ids) - position)",
            "    chunk = np.array([ids[position:position + n]], dtype=np.int32)",
            f"    out = {call}",
            *([f"    {after}"] if after else []),
            "    position += n"]


def logits_features(ref: Reference) -> list[dict]:
    """The logits output, or its parts where the reference's head is split (`Reference.head_rows`)."""
    dtype, vocab = ref.precision.float_dtype, ref.args.vocab_size
    if ref.head_rows is None:
        return [feature("logits", dtype, [1, "T", vocab], "next-token logits at each input position")]
    return [feature(f"logits_{i}", dtype, [1, "T", stop - start],
                    f"next-token logits of token ids {start}..{stop - 1} at each input position; logits_0.."
                    f"logits_{len(ref.head_rows) - 1} concatenated on the last axis are the logits [1, T, {vocab}]")
            for i, (start, stop) in enumerate(ref.head_rows)]


class PackageKind(ABC):
    """What every stage asks of a package kind; subclasses set the attributes and methods."""

    name: str
    # One line for the package's Core ML description and the release page.
    description: str
    # How many times `export` calls its `step` (the conversion's progress bar).
    steps: int
    # Drives a saved package chunk by chunk through cache snapshots (coreml.runner); None for
    # a kind without a cache, which runs one full forward per call.
    runner: type[CacheRunner] | None = None

    def cache_dtype(self, precision: Precision) -> type[np.floating] | None:
        """The dtype of the K/V cache a package of this kind and `precision` carries (inputs/outputs
        or state); None for a kind without a cache. The gates' intended-numerics reference rounds
        its cache to it, and the kind's runner feeds it."""
        return None

    def interface(self, ref: Reference) -> dict:
        """The manifest's `package` block: features by name, dtype, shape and meaning.

        `"T"` in a shape is the flexible token count, with its range under `dims` (and per
        function for a kind whose functions fix it); at a precision of the Neural Engine's layout
        the counts it takes are listed under `enumerated` (no others), and a head wider than the
        conversion's part width is split into outputs `logits_0..` (`head_split`, written with
        the manifest). Kinds with more features extend this block.
        Float features are in the precision's float dtype; `compute_units` is the package's
        intended target (what the ANE check, `coreml.ane`, grants is a separate verdict).
        """
        from coreml.manifest import MODEL_NAME

        block = {
            "name": MODEL_NAME,
            "kind": self.name,
            "context": ref.context,
            "chunk": None,
            "compute_precision": ref.precision.compute_precision,
            "precision": ref.precision.name,
            "compute_units": ref.precision.compute_units,
            "minimum_deployment_target": "iOS18",
            "dims": {"T": [1, ref.context]},
            "interface": ref.interface.name,
            "inputs": [feature(ref.interface.token_input, "int32", [1, "T"], "token ids")],
            "outputs": logits_features(ref),
        }
        if ref.precision.neural_engine_layout:
            block["enumerated"] = {"T": list(chunk_lengths(ref.context))}
        return block

    def description_for(self, ref: Reference) -> str:
        """The package's Core ML description for `ref`'s precision and interface (FP32's in
        cmfdeploy's interface is `description` unchanged)."""
        return self.description

    def snippet_model_arguments(self, interface: dict) -> str:
        """Arguments RELEASE.md's Python example adds to `ct.models.MLModel(path...)` for a package
        of `interface` (its manifest's `package` block)."""
        return ""

    @abstractmethod
    def graph(self, ref: Reference) -> nn.Module:
        """The torch module over the reference model that is traced into this kind's program."""

    @abstractmethod
    def export(self, ref: Reference, package_dir: Path, step: Callable[[str], None]) -> Manifest:
        """Trace, check, convert and save the package into `package_dir` (not there yet),
        calling `step` `steps` times; the package's manifest."""

    @abstractmethod
    def snippet(self, interface: dict) -> list[str]:
        """RELEASE.md's Python example, this kind's part: the lines that run `model` on the
        prompt `ids` (`inputs` holds input_ids of them) and leave in `out` the outputs whose
        last row is the last token's (a package of enumerated lengths: fed in those lengths)."""


KINDS: Registry[PackageKind] = Registry("package kind", UnknownKind)


def register_kind(cls: type[PackageKind]) -> type[PackageKind]:
    """Class decorator: one instance of `cls` joins KINDS under `cls.name`."""
    KINDS.add(cls.name, cls())
    return cls


def package_kind(name: str, where: object = "package") -> PackageKind:
    """The registered kind `name`; UnknownKind naming `where` and the known kinds otherwise."""
    return KINDS.lookup(name, where)
