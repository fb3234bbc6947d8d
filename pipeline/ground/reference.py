"""Load the reference FP32 decoder from a CMF file or an FP32 bundle directory.

    model, args, tokenizer_json = load_reference("model.cmf", task="coding", skill="math")

A CMF task applies its mask (spec §5); a skill reads `skill.{id}.{name}` in place of
`name` wherever the skill has one (spec §9); a blend mixes several skills' tensors as
`sum_i w_i T_i` with `w = softmax(-E / T)`.
"""

from __future__ import annotations

import copy
import json
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from pipeline.ground.bundle_format import WEIGHTS_NAME, mapped_weights, verify_bundle
from pipeline.ground.cmf import open_cmf
from pipeline.ground.cmf.reader import CmfFile
from pipeline.ground.cmf.skills import skill_tensor_source
from pipeline.ground.errors import CmfdeployWarning, UnsupportedModel
from pipeline.ground.models import ModelArgs, build_model
from pipeline.ground.models.errors import ModelConfigError
from pipeline.ground.pages import is_mapped, release_pages

if TYPE_CHECKING:  # torch loads only when a decoder is built (the MLX runtime reads task masks here)
    import torch

    from pipeline.ground.models.base import Decoder

BUNDLE_CONFIG = "config.json"
UNTIED_HEAD = "lm_head.weight"
BUNDLE_TOKENIZER = "tokenizer.json"


def skill_blend_weights(energies: Sequence[float], temperature: float) -> np.ndarray:
    """w = softmax(-E / T) in float64, shifted by the minimum energy so no exp overflows."""
    if not temperature > 0:
        raise ModelConfigError(f"skill blend: temperature {temperature!r} must be positive")
    energies = np.asarray(energies, dtype=np.float64)
    logits = -(energies - energies.min()) / temperature
    weights = np.exp(logits)
    return weights / weights.sum()


class CmfTensors(Mapping):
    """Base tensor names -> float32 arrays, each decoded when asked for.

    With several (source map, weight) members, a tensor is the weighted sum of the members'
    sources; a tensor every member reads from the same entry is decoded once and not mixed,
    so skills that leave a tensor alone reproduce it exactly.
    """

    def __init__(self, cmf: CmfFile, members: Sequence[tuple[Mapping[str, str], float]]):
        self.cmf, self.members = cmf, members
        self.names = list(members[0][0])

    def __getitem__(self, name: str) -> np.ndarray:
        sources = [source[name] for source, _ in self.members]
        if len(set(sources)) == 1:
            return self.cmf.decode(sources[0])
        total = np.zeros(self.cmf.tensors[name].shape, dtype=np.float32)
        for source, (_, weight) in zip(sources, self.members):
            total += np.float32(weight) * self.cmf.decode(source)
        return total

    def __contains__(self, name: object) -> bool:
        # Mapping's default would decode the tensor to find out.
        return name in self.members[0][0]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def cmf_tensors(cmf: CmfFile, skill: str | None = None, blend: Mapping[str, float] | None = None,
                temperature: float = 1.0) -> CmfTensors:
    """The tensors a model reads from `cmf`: base, one skill's, or a blend of skills by energy.

    `blend` maps skill ids to energies E (the base itself may take part as the id "base").
    """
    if blend is None:
        return CmfTensors(cmf, [(skill_tensor_source(cmf, skill), 1.0)])
    if skill is not None:
        raise ModelConfigError(f"{cmf.path.name}: give either skill or blend, not both")
    ids = list(blend)
    weights = skill_blend_weights([blend[i] for i in ids], temperature)
    members = [(skill_tensor_source(cmf, None if i == "base" else i), float(w)) for i, w in zip(ids, weights)]
    return CmfTensors(cmf, members)


def task_mask(cmf: CmfFile, task: str | int):
    """The named (or numbered) task mask; warns when its quality was never measured (spec §5)."""
    if cmf.masks is None:
        raise ModelConfigError(f"{cmf.path.name}: task {task!r} asked for, but the file has no masks section")
    try:
        mask = cmf.masks.task(task)
    except KeyError as error:
        raise ModelConfigError(f"{cmf.path.name}: masks: {error.args[0]}") from None
    if mask.meta.get("quality") is None:
        warnings.warn(f"{cmf.path.name}: task {mask.name!r} has no measured quality", CmfdeployWarning, stacklevel=2)
    return mask


def load_reference(artifact: str | Path, task: str | int | None = None, skill: str | None = None,
                   blend: Mapping[str, float] | None = None, temperature: float = 1.0,
                   replaced: Mapping[str, np.ndarray] | None = None) -> tuple[Decoder, ModelArgs, bytes | None]:
    """(model, args, tokenizer.json bytes or None) from a CMF file or a bundle directory.

    `replaced` (bundles only) gives some of the bundle's tensors other values (a package's
    decoded weights); names the bundle does not hold are ignored, as a non-strict
    `load_state_dict` would, so a tied head stays the embedding, except `lm_head.weight`
    (UNTIED_HEAD): a package that stores its head apart from a tied embedding (coreml.layout's
    head split) computes an untied model, and the reference then is one.
    """
    path = Path(artifact)
    if path.is_dir():
        if task is not None or skill is not None or blend is not None:
            raise ModelConfigError(f"{path}: a bundle is one fixed model; task, skill and blend apply to CMF files")
        return _load_bundle(path, replaced)
    if replaced is not None:
        raise ModelConfigError(f"{path}: replaced tensors apply to bundles, not CMF files")
    with open_cmf(path) as cmf:
        if cmf.is_skill_file:
            raise UnsupportedModel(f"{cmf.path.name}: a skill file (feature bit 6) never runs on its own; "
                                   "apply it to its base (pipeline.ground.cmf.skills.apply_skill_file) and load that")
        args = ModelArgs.from_header(cmf.header, source=cmf.path.name)
        mask = None if task is None else task_mask(cmf, task)
        model = build_model(args, cmf_tensors(cmf, skill, blend, temperature), mask, source=cmf.path.name)
        return model, args, cmf.vocab


def _release_pages_after_use(model: Decoder, arrays: Iterable[np.ndarray]) -> None:
    """Drop each decoder layer's and the head's mapped weights from the process once the module
    has run (`pipeline.ground.pages`): a forward then holds about one layer of the bundle's map
    resident, not all of it. The embedding's lookup reads only its tokens' rows.

    The map is copy-on-write, and dropping a page a write has copied would undo the write: a
    parameter written in place (`load_state_dict` without `assign`, which copies into it; torch
    counts every in-place write in the tensor's version) keeps its pages from then on, and so
    its written values."""
    mapped = {array.ctypes.data: array for array in arrays if is_mapped(array)}
    for module in (*model.model.layers, model.head):
        owned = tuple(((p,), mapped[p.data_ptr()]) for p in module.parameters() if p.data_ptr() in mapped)
        if owned:
            module.register_forward_hook(ReleaseUnwrittenPages(owned))


class ReleaseUnwrittenPages:
    """A module's forward hook: drop the pages of each mapped array whose parameters, every one
    that reads it, torch has never seen written (`_release_pages_after_use`)."""

    def __init__(self, owned: tuple[tuple[tuple[torch.Tensor, ...], np.ndarray], ...]):
        self.owned = owned

    def __call__(self, *_hook_arguments) -> None:
        for parameters, array in self.owned:
            if all(parameter._version == 0 for parameter in parameters):
                release_pages(array)

    def __deepcopy__(self, memo: dict) -> "ReleaseUnwrittenPages":
        # A copy of the model (an fp16 mitigated model, the fp16 reference) shares the map: a
        # deep copy of its arrays would be a copy of the weights in memory (SmolLM2-135M's
        # fp16 conversion held 0.54 GB of them). The copy's hook watches the copy's parameters
        # as well as the ones watched already, since any of them may share the map's pages.
        # Those are kept as they are, never copied: a copy of a copy (the gates' fp16 reference
        # of the mitigated model) finds the first model's parameters in the hook, which its
        # memo does not map, and deep-copying them held the layers and head of the FP32 model
        # in memory (Qwen2.5-Coder-1.5B's chain gate: 6.2 GB of its 8.0 GB anonymous).
        # A module's `_parameters` precede its hooks in its __dict__, so the copy's own
        # parameters are in the memo by the time its hooks are copied.
        return ReleaseUnwrittenPages(tuple(
            ((*parameters, *(memo[id(p)] for p in parameters if id(p) in memo)), array)
            for parameters, array in self.owned))


def _load_bundle(path: Path, replaced: Mapping[str, np.ndarray] | None) -> tuple[Decoder, ModelArgs, bytes | None]:
    verify_bundle(path)
    config = json.loads((path / BUNDLE_CONFIG).read_text())
    args = ModelArgs.from_header(config, source=str(path / BUNDLE_CONFIG))
    # The model's parameters are the map's pages (`mapped_weights`), not a copy of them.
    weights = mapped_weights(path / WEIGHTS_NAME)
    weights.update((name, value) for name, value in (replaced or {}).items() if name in weights or name == UNTIED_HEAD)
    model = build_model(args, weights, source=str(path / WEIGHTS_NAME))
    _release_pages_after_use(model, weights.values())
    tokenizer = path / BUNDLE_TOKENIZER
    return model, args, tokenizer.read_bytes() if tokenizer.exists() else None
