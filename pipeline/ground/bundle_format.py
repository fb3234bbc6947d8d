"""The FP32 bundle format: what a bundle folder holds, and its verifier.

A bundle is a folder:
    weights.safetensors     every unique tensor in FP32 (a tied head is stored once, as the embedding)
    config.json             the header blocks `ModelArgs.from_header` reads (`arch`, `moe`, `mtp`)
                            and `tokenizer_config`
    tokenizer.json          the CMF vocab section verbatim (when present)
    tokenizer_config.json   the header's tokenizer_config (chat template, eos/bos/pad ids)
    manifest.json           format "cmfdeploy.bundle/1"; `"status": "complete"` is written last

The stage that writes one is `pipeline.stages.bundle.export_bundle`; everything that reads a
bundle (the reference loader, the converter, the gates) needs only this module.
"""

import json
import math
import os
from pathlib import Path

import numpy as np

from manifests.identity import MANIFEST_NAME, Manifest, check_files, is_recorded_file, load_manifest, read_json
from pipeline.ground.cmf import CmfFile, open_cmf
from pipeline.ground.cmf.skills import skill_tensor_source
from pipeline.ground.errors import CmfdeployError, IdentityError, UnsupportedModel

FORMAT = "cmfdeploy.bundle/1"
WEIGHTS_NAME = "weights.safetensors"
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
# Header blocks the reference model and tokenizer read; provenance, hashes, skills and shards stay behind.
CONFIG_KEYS = ("arch", "moe", "mtp", "tokenizer_config")

def verify_bundle(path: str | os.PathLike, hashes: bool = True) -> Manifest:
    """Check a bundle's identity: known format, complete status, exactly the recorded files
    with their sizes (and sha256 when `hashes`). Raises IdentityError naming the file."""
    path = Path(path)
    manifest = load_manifest(path, FORMAT)
    check_files(path, manifest["files"], hashes=hashes)
    tokenizer = manifest["tokenizer"]
    if tokenizer is not None:
        recorded = manifest["files"].get("tokenizer.json")
        if recorded is None or recorded["sha256"] != tokenizer["sha256"]:
            raise IdentityError(f"{path / MANIFEST_NAME}: field 'tokenizer.sha256' does not match files['tokenizer.json']")
    _cross_check(path, manifest)
    return Manifest(path, manifest)


# -- cross-checks: what the manifest and config claim against what the files say


def _first_difference(where: Path, field_prefix: str, claimed: dict, actual: dict, what: str) -> None:
    for key in sorted(set(claimed) | set(actual)):
        if claimed.get(key) != actual.get(key):
            raise IdentityError(f"{where}: field '{field_prefix}{key}' is {claimed.get(key)!r}, "
                                f"but {what} says {actual.get(key)!r}")


def _cross_check(path: Path, manifest: dict) -> None:
    """config.json against the manifest's architecture, and the safetensors header against
    the tensors the bundle must hold. With the source CMF still at its recorded path, both
    are compared with the CMF itself (its header blocks; its directory through the same
    plan the export follows). Without it, the tensor set is derived from config.json by the
    model family's own weight ledger."""
    where, weights = path / "config.json", path / WEIGHTS_NAME
    config = read_json(where)
    arch = config.get("arch")
    if not isinstance(arch, dict):
        raise IdentityError(f"{where}: field 'arch' is {arch!r}, not an object")
    _first_difference(where, "arch.", arch, manifest["architecture"], f"{path / MANIFEST_NAME} architecture")
    shapes = safetensors_header(weights)
    if sum(math.prod(s) for s in shapes.values()) != manifest["parameter_count"]:
        raise IdentityError(f"{path / MANIFEST_NAME}: field 'parameter_count' is {manifest['parameter_count']}, "
                            f"but the header of {weights} holds {sum(math.prod(s) for s in shapes.values())}")
    source = Path(manifest["source"]["path"])
    if not is_recorded_file(source):
        _check_tensor_set(weights, config, shapes)
        return
    with open_cmf(source) as cmf:
        header = {k: cmf.header[k] for k in CONFIG_KEYS if cmf.header.get(k)}
        _first_difference(where, "arch.", arch, header.get("arch") or {}, f"the source CMF {source}")
        _first_difference(where, "", config, header, f"the source CMF {source}")
        skill = (manifest["applied"]["skill"] or {}).get("id")
        expected = {name: tuple(cmf.tensors[entry].shape) for name, entry in bundle_plan(cmf, skill).entries}
    missing, extra = sorted(expected.keys() - shapes.keys()), sorted(shapes.keys() - expected.keys())
    if missing or extra:
        raise IdentityError(f"{weights}: the header lacks tensors {missing[:5]} and holds extra {extra[:5]}, "
                            f"against the source CMF {source}")
    for name, shape in expected.items():
        if shapes[name] != shape:
            raise IdentityError(f"{weights}: tensor {name!r} has shape {list(shapes[name])}, "
                                f"the source CMF {source} says {list(shape)}")


def _check_tensor_set(weights: Path, config: dict, shapes: dict[str, tuple]) -> None:
    """The safetensors header holds exactly the tensors the config's model family takes, in
    their shapes: derived by building the reference decoder over shape-only (meta) tensors,
    so the family's own weight ledger names what is missing, extra or wrongly shaped."""
    import torch

    from pipeline.ground.models import ModelArgs, build_model

    try:
        args = ModelArgs.from_header(config, source=str(weights.with_name("config.json")))
        build_model(args, {n: torch.empty(s, device="meta") for n, s in shapes.items()}, source=str(weights))
    except CmfdeployError as error:
        raise IdentityError(f"{weights}: the header disagrees with the tensors config.json derives: {error}") from None


# The header is JSON text before the data; real ones are kilobytes to a few MB (SmolLM2: 20 kB).
HEADER_LIMIT = 100 << 20
SAFETENSORS_ITEMSIZE = {"F32": 4}


def safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a bundle's safetensors header, every entry checked: F32,
    its byte range exactly its shape's size, the ranges back to back and ending at the end
    of the file. Anything else is an IdentityError naming the file and the entry."""
    return {name: shape for name, (shape, _) in safetensors_layout(path).items()}


def safetensors_layout(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    """Tensor name -> (shape, offset of its first byte in the file), checked as
    `safetensors_header` says."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 <= length <= min(size - 8, HEADER_LIMIT):
            raise IdentityError(f"{path}: header length {length} does not fit a {size}-byte file")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise IdentityError(f"{path}: header is not valid JSON ({error})") from None
    if not isinstance(header, dict):
        raise IdentityError(f"{path}: header is {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise IdentityError(f"{path}: header __metadata__ is {metadata!r}, not an object of strings")
    layout, ranges = {}, []
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise IdentityError(f"{where}: entry {entry!r} is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_ITEMSIZE:
            raise IdentityError(f"{where}: dtype {dtype!r}; a bundle holds {sorted(SAFETENSORS_ITEMSIZE)} only")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise IdentityError(f"{where}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise IdentityError(f"{where}: data_offsets {offsets!r} is not two integers")
        if offsets[1] - offsets[0] != SAFETENSORS_ITEMSIZE[dtype] * math.prod(shape):
            raise IdentityError(f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
                                f"shape {shape} of {dtype} needs {SAFETENSORS_ITEMSIZE[dtype] * math.prod(shape)}")
        layout[name] = (tuple(shape), 8 + length + offsets[0])
        ranges.append((offsets[0], offsets[1], name))
    end = 0
    for start, stop, name in sorted(ranges):
        if start != end:
            raise IdentityError(f"{path}: tensor {name!r} starts at data byte {start}, expected {end} (a gap or overlap)")
        end = stop
    if 8 + length + end != size:
        raise IdentityError(f"{path}: the tensors end at byte {8 + length + end}, the file has {size}")
    return layout


def mapped_weights(path: Path) -> dict[str, np.ndarray]:
    """Tensor name -> float32 array over a copy-on-write map of a bundle's safetensors file
    (its layout checked by `safetensors_layout`): nothing is read until a tensor is used, and
    the pages read are the file's, shared by every process that maps it and dropped under
    memory pressure rather than swapped. Arrays are writable (torch takes them without
    copying or warning), but a write only ever makes a private copy of the page it touches:
    the file never changes, and a stray write shows up as anonymous memory."""
    layout = safetensors_layout(path)
    if not layout:
        return {}
    data = np.memmap(path, dtype=np.uint8, mode="c")
    weights = {}
    for name, (shape, start) in layout.items():
        array = data[start : start + 4 * math.prod(shape)].view(np.float32).reshape(shape)
        # Bundles written here start their data 8-aligned; a foreign writer's odd offset is copied into alignment.
        weights[name] = array if array.flags.aligned else np.array(array)
    return weights


# -- planning: which tensors, from where, under which name


class BundlePlan:
    """The tensors to write, in directory order: (output name, CMF entry to decode)."""

    def __init__(self, entries: list[tuple[str, str]], tied: bool, applied_skill: dict | None):
        self.entries = entries
        self.tied = tied
        self.applied_skill = applied_skill


def bundle_plan(cmf: CmfFile, skill: str | None) -> BundlePlan:
    source = skill_tensor_source(cmf, skill)
    applied_skill = None
    if skill is not None:
        entry = next(e for e in cmf.skills if e["id"] == skill)
        replaced = sorted(name for name, entry_name in source.items() if entry_name != name)
        applied_skill = {"id": skill, "name": entry.get("name"), "replaced_tensors": replaced}

    tied = bool(cmf.arch.get("tie_word_embeddings"))
    if tied and LM_HEAD in source:
        # A file may carry the tied head explicitly; it is only droppable if it really is the embedding.
        if not np.array_equal(cmf.decode(source[LM_HEAD]), cmf.decode(source[EMBED])):
            raise UnsupportedModel(
                f"{cmf.path}: arch.tie_word_embeddings is true but '{LM_HEAD}' differs from '{EMBED}'"
            )
        del source[LM_HEAD]
    elif not tied and LM_HEAD not in source:
        raise UnsupportedModel(f"{cmf.path}: arch.tie_word_embeddings is false and there is no '{LM_HEAD}'")
    return BundlePlan(list(source.items()), tied, applied_skill)
