"""The FP32 bundle: a CMF model decoded to dense float32, with its identity recorded.

    manifest = export_bundle("model.cmf", "out/bundle", task="coding")
    verify_bundle("out/bundle")

A bundle is a folder:
    weights.safetensors     every unique tensor in FP32 (a tied head is stored once, as the embedding)
    config.json             the header blocks `ModelArgs.from_header` reads (`arch`, `moe`, `mtp`)
                            and `tokenizer_config`
    tokenizer.json          the CMF vocab section verbatim (when present)
    tokenizer_config.json   the header's tokenizer_config (chat template, eos/bos/pad ids)
    manifest.json           format "cmfdeploy.bundle/1"; `"status": "complete"` is written last

Tasks and skills. A skill (spec §9) replaces tensors, which a dense file expresses
exactly. A task mask (spec §5) is baked into the weights only where that is exact:
  - an inactive FFN neuron i of layer l: column i of `down_proj` is zeroed, so the
    neuron's output is multiplied by zero whatever the activation did;
  - an inactive head h: the head's `head_dim` columns of `o_proj` are zeroed;
  - a closed layer gate: every projection that writes the residual stream of that
    layer (attention `o_proj`/`out_proj`, FFN `down_proj` of the MLP, every expert and
    the shared expert, with their biases) is zeroed, so both residual updates add
    exactly 0.0 and the hidden state passes through unchanged.
What cannot be written as weights is refused with UnsupportedModel rather than
approximated: expert-routing restrictions (the router softmax is renormalised over the
marked experts, which no weight edit reproduces), per-visit masks of a looped model
whose visits differ (the visits share weights), and masks on layers whose residual
writers are not recognised.
"""

import hashlib
import json
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from manifests.identity import (
    MANIFEST_NAME,
    Manifest,
    canonical_json,
    check_files,
    cmf_source,
    environment,
    inventory,
    is_recorded_file,
    load_manifest,
    read_json,
    sha256_bytes,
    write_json,
)
from manifests.output import refuse_existing, staged_output
from pipeline.cmf import CmfFile, open_cmf, verify_cmf
from pipeline.cmf.skills import skill_tensor_source
from pipeline.errors import CmfdeployError, IdentityError, UnsupportedModel

FORMAT = "cmfdeploy.bundle/1"
WEIGHTS_NAME = "weights.safetensors"
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
# Header blocks the reference model and tokenizer read; provenance, hashes, skills and shards stay behind.
CONFIG_KEYS = ("arch", "moe", "mtp", "tokenizer_config")
POLICY = {
    "weights_dtype": "F32",
    "tied_head": "stored once, as model.embed_tokens.weight",
    "non_finite": "refused, naming the tensor and its first bad index",
    "task": "baked only where exact (down_proj columns, o_proj head columns, residual writers "
    "of gated layers); anything else refused",
}


class NonFiniteWeights(CmfdeployError):
    """A decoded tensor holds NaN or an infinity; an FP32 bundle would carry it silently."""


def export_bundle(
    cmf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    task: str | int | None = None,
    skill: str | None = None,
    force: bool = False,
) -> Manifest:
    """Decode a verified CMF into an FP32 bundle at `out_dir` and return its manifest.

    The CMF is verified first (every hash; a failure names each failing item). Tensors are
    decoded and written one at a time, so peak memory is about two FP32 tensors (one being
    written while the next decodes) besides the mapped CMF pages.
    """
    cmf_path, out_dir = Path(cmf_path), Path(out_dir)
    refuse_existing(out_dir, force)
    with open_cmf(cmf_path) as cmf:
        if cmf.is_skill_file:
            raise UnsupportedModel(f"{cmf_path}: is a standalone skill file (feature bit 6); it never runs on its own")
        # The sha256 of the source runs beside the hash64 verification: both release the GIL.
        with ThreadPoolExecutor(max_workers=1) as pool:
            source_future = pool.submit(cmf_source, cmf)
            report = verify_cmf(cmf)
            source = source_future.result()
        if not report.ok:
            raise IdentityError(
                f"{cmf_path}: refusing to bundle a file that fails verification: "
                + "; ".join(str(f) for f in report.failures)
            )
        plan = _plan(cmf, skill)
        task_mask, applied_task = _task(cmf, task)

        with staged_output(out_dir, force) as tmp:
            manifest = {
                "format": FORMAT,
                "status": "incomplete",
                "architecture": cmf.arch,
                "source": source,
            }
            # Written first so a killed run leaves a folder that says what it is and that it is unfinished.
            write_json(tmp / MANIFEST_NAME, manifest)
            parameters, weights_identity = _write_weights(cmf, plan, task_mask, tmp / WEIGHTS_NAME)
            (tmp / "config.json").write_bytes(canonical_json({k: cmf.header[k] for k in CONFIG_KEYS if cmf.header.get(k)}))
            tokenizer = _write_tokenizer(cmf, tmp)
            manifest.update(
                {
                    "parameter_count": parameters,
                    "tied_head": plan.tied,
                    "special_tokens": _special_tokens(cmf.tokenizer_config),
                    "tokenizer": tokenizer,
                    "applied": {"task": applied_task, "skill": plan.applied_skill},
                    "files": {**inventory(tmp, exclude=(MANIFEST_NAME, WEIGHTS_NAME)), WEIGHTS_NAME: weights_identity},
                    "environment": environment(),
                    "policy": POLICY,
                    "status": "complete",
                }
            )
            write_json(tmp / MANIFEST_NAME, manifest)
    return Manifest(out_dir, manifest)


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
        expected = {name: tuple(cmf.tensors[entry].shape) for name, entry in _plan(cmf, skill).entries}
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

    from pipeline.models import ModelArgs, build_model

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
    shapes, ranges = {}, []
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
        shapes[name] = tuple(shape)
        ranges.append((offsets[0], offsets[1], name))
    end = 0
    for start, stop, name in sorted(ranges):
        if start != end:
            raise IdentityError(f"{path}: tensor {name!r} starts at data byte {start}, expected {end} (a gap or overlap)")
        end = stop
    if 8 + length + end != size:
        raise IdentityError(f"{path}: the tensors end at byte {8 + length + end}, the file has {size}")
    return shapes


# -- planning: which tensors, from where, under which name


class _Plan:
    """The tensors to write, in directory order: (output name, CMF entry to decode)."""

    def __init__(self, entries: list[tuple[str, str]], tied: bool, applied_skill: dict | None):
        self.entries = entries
        self.tied = tied
        self.applied_skill = applied_skill


def _plan(cmf: CmfFile, skill: str | None) -> _Plan:
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
    return _Plan(list(source.items()), tied, applied_skill)


# -- tasks


def _task(cmf: CmfFile, task: str | int | None) -> tuple[dict[str, np.ndarray] | None, dict | None]:
    """Per-tensor column masks (True = keep) that bake the task, and its manifest record."""
    if task is None:
        return None, None
    if cmf.masks is None:
        raise UnsupportedModel(f"{cmf.path}: task {task!r} requested but the file has no masks section")
    try:
        mask = cmf.masks.task(int(task) if str(task).isdigit() else task)
    except KeyError as error:
        raise UnsupportedModel(f"{cmf.path}: {error.args[0]}") from None

    arch, where = cmf.arch, f"{cmf.path}: task '{mask.name}'"
    layers = arch["num_layers"]
    if mask.experts is not None and not mask.experts.all():
        raise UnsupportedModel(
            f"{where}: restricts expert routing (renormalised router softmax), which no weight edit reproduces"
        )
    ffn = mask.ffn
    if ffn.shape[0] != layers:
        visits = ffn.reshape(-1, layers, ffn.shape[1])
        if not (visits == visits[:1]).all():
            raise UnsupportedModel(f"{where}: per-visit FFN masks differ between loops, but the loops share weights")
        ffn = visits[0]

    keep: dict[str, np.ndarray] = {}
    head_dim = arch["head_dim"]
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        if not mask.layer_gates[layer]:
            writers = _residual_writers(cmf, prefix)
            if not writers:
                raise UnsupportedModel(f"{where}: layer {layer} is gated off but its residual writers are not recognised")
            for name in writers:
                keep[name] = np.zeros(cmf.tensors[name].shape[-1], dtype=bool)
            continue
        if not ffn[layer].all():
            down = prefix + "mlp.down_proj.weight"
            if down not in cmf.tensors or cmf.tensors[down].shape[1] != ffn.shape[1]:
                raise UnsupportedModel(
                    f"{where}: layer {layer} masks FFN neurons but has no dense '{down}' of width {ffn.shape[1]}"
                )
            keep[down] = ffn[layer]
        if not mask.heads[layer].all():
            o_proj = prefix + "self_attn.o_proj.weight"
            if o_proj not in cmf.tensors:
                raise UnsupportedModel(f"{where}: layer {layer} masks heads but has no '{o_proj}'")
            if cmf.tensors[o_proj].shape[1] != mask.heads.shape[1] * head_dim:
                raise UnsupportedModel(
                    f"{where}: layer {layer} masks heads but '{o_proj}' has {cmf.tensors[o_proj].shape[1]} "
                    f"input columns, not num_attention_heads * head_dim = {mask.heads.shape[1] * head_dim}"
                )
            keep[o_proj] = np.repeat(mask.heads[layer], head_dim)

    gated = [int(i) for i in np.flatnonzero(~mask.layer_gates)]
    record = {
        "task_id": mask.task_id,
        "name": mask.name,
        "inactive_ffn_neurons": int((~ffn[mask.layer_gates]).sum()),
        "inactive_heads": int((~mask.heads[mask.layer_gates]).sum()),
        "inactive_layers": gated,
        "quality": mask.meta.get("quality"),
    }
    return keep, record


_RESIDUAL_WRITER_SUFFIXES = ("self_attn.o_proj", "linear_attn.out_proj", "mlp.down_proj", "mlp.shared_expert.down_proj")


def _residual_writers(cmf: CmfFile, prefix: str) -> list[str]:
    """Weights and biases whose outputs are added to the residual stream in one layer."""
    writers = []
    for name in cmf.tensors:
        if not name.startswith(prefix):
            continue
        stem = name[len(prefix) :].rsplit(".", 1)[0]
        is_expert_down = stem.startswith("mlp.experts.") and stem.endswith(".down_proj")
        if stem in _RESIDUAL_WRITER_SUFFIXES or is_expert_down:
            writers.append(name)
    has_attention = any(".o_proj." in n or ".out_proj." in n for n in writers)
    has_ffn = any(".down_proj." in n for n in writers)
    return writers if has_attention and has_ffn else []


# -- writing


def _decoded(cmf: CmfFile, plan: _Plan, keep: dict[str, np.ndarray] | None) -> Iterator[tuple[str, np.ndarray]]:
    for name, entry in plan.entries:
        array = cmf.decode(entry)
        bad = ~np.isfinite(array)
        if bad.any():
            index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad.reshape(-1))), array.shape))
            raise NonFiniteWeights(
                f"{cmf.path}: tensor '{entry}' holds {array[index]} at index {list(index)}; refusing to bundle it"
            )
        if keep and name in keep:
            # Bias vectors (1-D) are zeroed with their gated weight; 2-D weights lose input columns.
            array = array * keep[name] if array.ndim > 1 else np.zeros_like(array)
        yield name, np.ascontiguousarray(array, dtype=np.float32)


def _write_weights(cmf: CmfFile, plan: _Plan, keep: dict[str, np.ndarray] | None, path: Path) -> tuple[int, dict]:
    """Stream a safetensors file tensor by tensor; returns the parameter count and the
    file's `{"bytes", "sha256"}`.

    The shapes are all known from the directory, so the header is written first and each
    tensor is decoded, written and dropped in turn (`safetensors.numpy.save_file` would
    need every array in memory at once). A writer thread writes and hashes tensor i while
    the caller decodes tensor i + 1, so at most two decoded tensors are alive, and the
    file is never read back to hash it.
    """
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, entry in plan.entries:
        nbytes = 4 * math.prod(cmf.tensors[entry].shape)
        header[name] = {"dtype": "F32", "shape": list(cmf.tensors[entry].shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-aligned, as safetensors writes it
    digest = hashlib.sha256()
    with open(path, "wb") as f, ThreadPoolExecutor(max_workers=1) as writer:

        def put(data) -> None:
            f.write(data)
            digest.update(data)

        pending = writer.submit(put, len(blob).to_bytes(8, "little") + blob)
        for _, array in _decoded(cmf, plan, keep):
            view = memoryview(array).cast("B")
            pending.result()
            pending = writer.submit(put, view)
        pending.result()
        f.flush()
        os.fsync(f.fileno())
    return offset // 4, {"bytes": 8 + len(blob) + offset, "sha256": digest.hexdigest()}


def _write_tokenizer(cmf: CmfFile, folder: Path) -> dict | None:
    vocab = cmf.vocab
    if vocab is None:
        return None
    (folder / "tokenizer.json").write_bytes(vocab)
    config = cmf.tokenizer_config
    if config is not None:
        (folder / "tokenizer_config.json").write_bytes(canonical_json(config))
    return {"sha256": sha256_bytes(vocab), "bytes": len(vocab), "has_config": config is not None}


def _special_tokens(config: dict | None) -> dict:
    config = config or {}
    return {
        "eos_token_ids": list(config.get("eos_token_ids") or []),
        "bos_token_id": config.get("bos_token_id"),
        "pad_token_id": config.get("pad_token_id"),
    }
