"""The FP32 bundle: a CMF model decoded to dense float32, with its identity recorded.

    manifest = export_bundle("model.cmf", "out/bundle", task="coding")

The folder's layout and its verifier are `pipeline.ground.bundle_format`.

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

from manifests.identity import MANIFEST_NAME, Manifest, canonical_json, cmf_source, environment, inventory, sha256_bytes, write_json
from manifests.output import refuse_existing, staged_output
from pipeline.ground.bundle_format import CONFIG_KEYS, FORMAT, WEIGHTS_NAME, BundlePlan, bundle_plan
from pipeline.ground.cmf import CmfFile, open_cmf, verify_cmf
from pipeline.ground.errors import CmfdeployError, IdentityError, UnsupportedModel
from pipeline.stages.disk import check_disk

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
    check_disk("bundle", out_dir, cmf_path)
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
        plan = bundle_plan(cmf, skill)
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


def _decoded(cmf: CmfFile, plan: BundlePlan, keep: dict[str, np.ndarray] | None) -> Iterator[tuple[str, np.ndarray]]:
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


def _write_weights(cmf: CmfFile, plan: BundlePlan, keep: dict[str, np.ndarray] | None, path: Path) -> tuple[int, dict]:
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
