"""Task masks (spec §5) and the read-only sparse index (spec §7).

A mask blob has no inner headers: its layout follows from `arch` (and `moe`).
Bit i of a row is bit `i % 8` of byte `i / 8` (LSB-first); set = active; tail bits
past a dimension must be zero. With LOOP_MASKS and `arch.num_loops > 1` the FFN rows
are stored per visit (`num_layers * num_loops`, pass-major) while head rows, layer
gates and expert rows stay per physical layer. (Spec §5 says gates are per visit
too; the conformance vectors store them per physical layer, and the vectors win.)
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from pipeline.ground.cmf.errors import Bounds, Parse

FEATURE_LOOP_MASKS = 1 << 5
BLOB_ALIGN = 8
_SECTION_PREFIX = struct.Struct("<II")
# Meta keys the writer owns; everything else in a task's meta is kept as given.
_LAYOUT_KEYS = ("blob_off", "blob_len")


@dataclass(frozen=True)
class MaskLayout:
    """Row counts and widths of every mask blob of one file."""

    ffn_rows: int  # num_layers, or num_layers * num_loops with LOOP_MASKS
    intermediate: int
    num_layers: int
    heads: int
    num_experts: int | None

    def blob_len(self, has_experts: bool) -> int:
        n = self.ffn_rows * _nbytes(self.intermediate) + self.num_layers * _nbytes(self.heads)
        n += _nbytes(self.num_layers)
        if has_experts:
            n += self.num_layers * _nbytes(self.num_experts)
        return n


@dataclass
class TaskMask:
    """One task's decoded mask; `meta` is its meta entry (name, task_id, sparsity, quality, ...)."""

    meta: dict
    ffn: np.ndarray  # bool [ffn_rows, intermediate]
    heads: np.ndarray  # bool [num_layers, num_attention_heads]
    layer_gates: np.ndarray  # bool [num_layers], per physical layer
    experts: np.ndarray | None = None  # bool [num_layers, num_experts]

    @property
    def visit_gates(self) -> np.ndarray:
        """Layer gates per visit (virtual layer, pass-major), aligned with the FFN rows."""
        return np.tile(self.layer_gates, self.ffn.shape[0] // self.layer_gates.size)

    @property
    def name(self) -> str:
        return self.meta["name"]

    @property
    def task_id(self) -> int:
        return self.meta["task_id"]


@dataclass
class Masks:
    default_task: str
    tasks: list[TaskMask]
    meta: dict = field(default_factory=dict)  # the section's meta JSON as stored (empty when built in memory)

    def task(self, key: str | int) -> TaskMask:
        """A task by name or task_id."""
        for task in self.tasks:
            if key in (task.name, task.task_id):
                return task
        raise KeyError(f"no mask task {key!r}; tasks are {[t.name for t in self.tasks]}")


def _nbytes(bits: int) -> int:
    return -(-bits // 8)


def mask_layout(header: dict, required_features: int, where: str) -> MaskLayout:
    arch = header["arch"]

    def count(value, what: str, minimum: int = 0) -> int:
        if type(value) is not int or value < minimum:
            raise Parse(f"{where}: masks need {what} as an int >= {minimum}, header has {value!r}")
        return value

    layers = count(arch.get("num_layers"), "arch.num_layers")
    loops = count(arch.get("num_loops", 1), "arch.num_loops", 1)
    moe = header.get("moe") or arch.get("moe")
    experts = count(moe.get("num_experts"), "moe.num_experts", 1) if isinstance(moe, dict) else None
    per_visit = bool(required_features & FEATURE_LOOP_MASKS) and loops > 1
    return MaskLayout(
        ffn_rows=layers * loops if per_visit else layers,
        intermediate=count(arch.get("intermediate_size"), "arch.intermediate_size"),
        num_layers=layers,
        heads=count(arch.get("num_attention_heads"), "arch.num_attention_heads"),
        num_experts=experts,
    )


def unpack_rows(data: np.ndarray, rows: int, bits: int, where: str) -> np.ndarray:
    """bool [rows, bits] from LSB-first packed rows; nonzero tail bits are a Parse error."""
    width = _nbytes(bits)
    unpacked = np.unpackbits(data[: rows * width].reshape(rows, width), axis=1, bitorder="little").astype(bool)
    tail = unpacked[:, bits:]
    if tail.any():
        row, col = np.argwhere(tail)[0]
        raise Parse(f"{where}: row {row} has tail bit {bits + col} set past its {bits} bits")
    return unpacked[:, :bits]


def pack_rows(rows: np.ndarray) -> bytes:
    """LSB-first packing of a bool [rows, bits] array, each row padded to whole bytes with zeros."""
    return np.packbits(np.asarray(rows, dtype=bool), axis=1, bitorder="little").tobytes()


def parse_masks(section: np.ndarray, header: dict, required_features: int, label: str) -> Masks:
    where = f"{label}: masks section"
    if section.size < _SECTION_PREFIX.size:
        raise Bounds(f"{where}: length {section.size:#x} is shorter than its 8-byte prefix")
    n_masks, meta_len = _SECTION_PREFIX.unpack_from(section, 0)
    if _SECTION_PREFIX.size + meta_len > section.size:
        raise Bounds(f"{where}: meta_len {meta_len:#x} runs past the section length {section.size:#x}")
    try:
        meta = json.loads(section[8 : 8 + meta_len].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise Parse(f"{where}: meta JSON: {error}") from None
    entries = meta.get("masks") if isinstance(meta, dict) else None
    if not isinstance(entries, list) or len(entries) != n_masks:
        raise Parse(f"{where}: meta 'masks' must be a list of n_masks={n_masks} entries")
    layout = mask_layout(header, required_features, where)
    tasks = []
    for i, entry in enumerate(entries):
        tasks.append(_parse_blob(section, entry, layout, 8 + meta_len, f"{where}: mask #{i}"))
    return Masks(default_task=meta.get("default_task"), tasks=tasks, meta=meta)


def _parse_blob(section: np.ndarray, entry, layout: MaskLayout, blobs_start: int, where: str) -> TaskMask:
    if not isinstance(entry, dict):
        raise Parse(f"{where}: meta entry is {type(entry).__name__}, not an object")
    for key, kind in (("task_id", int), ("name", str), ("blob_off", int), ("blob_len", int)):
        if type(entry.get(key)) is not kind:
            raise Parse(f"{where}: meta '{key}' is {entry.get(key)!r}, not {kind.__name__}")
    has_experts = entry.get("has_expert_fields", False)
    if type(has_experts) is not bool:
        raise Parse(f"{where}: meta 'has_expert_fields' is {has_experts!r}, not a bool")
    if has_experts and layout.num_experts is None:
        raise Parse(f"{where} ('{entry['name']}'): has_expert_fields but the header has no moe.num_experts")
    off, length = entry["blob_off"], entry["blob_len"]
    if off % BLOB_ALIGN or off < blobs_start or off + length > section.size:
        raise Bounds(
            f"{where} ('{entry['name']}'): blob [{off:#x}, +{length:#x}) must be 8-aligned "
            f"inside [{blobs_start:#x}, {section.size:#x})"
        )
    need = layout.blob_len(has_experts)
    if length != need:
        raise Bounds(f"{where} ('{entry['name']}'): blob_len {length:#x}, the arch implies {need:#x}")
    where = f"{where} ('{entry['name']}')"
    blob = section[off : off + length]
    pos = 0

    def take(rows: int, bits: int, what: str) -> np.ndarray:
        nonlocal pos
        out = unpack_rows(blob[pos:], rows, bits, f"{where} {what}")
        pos += rows * _nbytes(bits)
        return out

    ffn = take(layout.ffn_rows, layout.intermediate, "FFN")
    heads = take(layout.num_layers, layout.heads, "heads")
    gates = take(1, layout.num_layers, "layer gates")[0]
    experts = take(layout.num_layers, layout.num_experts, "experts") if has_experts else None
    return TaskMask(meta=entry, ffn=ffn, heads=heads, layer_gates=gates, experts=experts)


def encode_masks(masks: Masks, header: dict, required_features: int) -> bytes:
    """The masks section for `masks` (the writer's side of parse_masks)."""
    layout = mask_layout(header, required_features, "write_cmf: masks")
    blobs = []
    for task in masks.tasks:
        has_experts = task.experts is not None
        want = {
            "ffn": (layout.ffn_rows, layout.intermediate),
            "heads": (layout.num_layers, layout.heads),
            "layer_gates": (layout.num_layers,),
        }
        if has_experts:
            want["experts"] = (layout.num_layers, layout.num_experts)
        for attr, shape in want.items():
            got = np.shape(getattr(task, attr))
            if got != shape:
                raise Parse(f"write_cmf: mask '{task.meta.get('name')}' {attr} has shape {got}, the arch implies {shape}")
        parts = [pack_rows(task.ffn), pack_rows(task.heads), pack_rows(task.layer_gates[None, :])]
        if has_experts:
            parts.append(pack_rows(task.experts))
        blobs.append((b"".join(parts), has_experts))

    entries = [{k: v for k, v in t.meta.items() if k not in _LAYOUT_KEYS} for t in masks.tasks]
    for entry, (_, has_experts) in zip(entries, blobs):
        entry.setdefault("quality", None)  # never invented: null means "not measured"
        entry["has_expert_fields"] = has_experts
    # Blob offsets live inside the meta whose length decides them: iterate to a fixed point.
    meta_len = 0
    while True:
        offsets, pos = [], _align(8 + meta_len)
        for blob, _ in blobs:
            offsets.append(pos)
            pos = _align(pos + len(blob))
        for entry, (blob, _), off in zip(entries, blobs, offsets):
            entry["blob_off"], entry["blob_len"] = off, len(blob)
        meta = json.dumps(
            {"default_task": masks.default_task, "masks": entries}, ensure_ascii=False, separators=(",", ":")
        ).encode("utf-8")
        if len(meta) == meta_len:
            break
        meta_len = len(meta)
    out = bytearray(_SECTION_PREFIX.pack(len(entries), meta_len) + meta)
    for (blob, _), off in zip(blobs, offsets):
        out += bytes(off - len(out)) + blob
    return bytes(out)


def _align(n: int) -> int:
    return -(-n // BLOB_ALIGN) * BLOB_ALIGN


def parse_sparse_index(section: np.ndarray, label: str) -> list[dict]:
    """Entries `{task_id, layer_idx, active_ffn_groups, active_heads}` (spec §7)."""
    where = f"{label}: sparse index"
    if section.size < 8:
        raise Bounds(f"{where}: length {section.size:#x} is shorter than its 8-byte prefix")
    n_entries, reserved = struct.unpack_from("<II", section, 0)
    if reserved:
        raise Parse(f"{where}: reserved word is {reserved:#x}, not 0")
    if 8 + 16 * n_entries > section.size:
        raise Bounds(f"{where}: {n_entries:#x} entries cannot fit in {section.size:#x} bytes")
    out, pos = [], 8
    for i in range(n_entries):
        if pos + 16 > section.size:
            raise Bounds(f"{where}: entry #{i} at {pos:#x} runs past the section end {section.size:#x}")
        task_id, layer, n_groups, n_heads = struct.unpack_from("<IIII", section, pos)
        body = 2 * n_groups + n_heads
        end = pos + 16 + -(-body // 4) * 4
        if end > section.size:
            raise Bounds(f"{where}: entry #{i} at {pos:#x} ends at {end:#x} past the section end {section.size:#x}")
        groups = section[pos + 16 : pos + 16 + 2 * n_groups].view("<u2")
        heads = section[pos + 16 + 2 * n_groups : pos + 16 + body]
        out.append(
            {
                "task_id": task_id,
                "layer_idx": layer,
                "active_ffn_groups": groups.tolist(),
                "active_heads": heads.tolist(),
            }
        )
        pos = end
    if pos != section.size:
        raise Parse(f"{where}: {section.size - pos:#x} trailing bytes after {n_entries} entries")
    return out
