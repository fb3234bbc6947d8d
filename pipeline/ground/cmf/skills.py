"""Skills: specialist tensors that replace base tensors (spec §9).

A skill `id` stores replacement tensors as ordinary entries `skill.{id}.{base_name}`
with the base tensor's full shape, and a registry entry in `header.skills`.

Growth is append-only (`add_skill`): the new payloads, then a new header and a new
directory are appended to the file's tail, and only then is the 128-byte envelope
rewritten in place to point at them. Every earlier byte stays where it was (the
old header and directory become dead bytes), and a crash before the envelope write
leaves the previous, still valid file. The data section grows to cover the new
payloads, so it may now span the older masks/vocab sections; readers address
sections only through the envelope (spec §1).

Each registry entry records `base_dir_hash`, the hash64 of the directory the skill
was added to. A standalone skill file (feature bit 6, `export_skill_file`) carries
it, and `apply_skill_file` refuses any base whose directory hashes differently.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from pipeline.ground.cmf.errors import SkillError
from pipeline.ground.cmf.hash64 import hash64
from pipeline.ground.cmf.reader import FEATURE_SKILL_FILE, CmfFile, open_cmf
from pipeline.ground.cmf.writer import (
    RawTensor,
    Record,
    dump_header,
    encode_tensor,
    pack_directory,
    round_up,
    tensor_alignment,
    write_cmf,
)

SKILL_PREFIX = "skill."
_SKILL_ID = re.compile(r"[A-Za-z0-9_-]+")
# Keys a skill file's registry entry adds to the base's entry.
_FILE_ONLY_KEYS = ("base_arch",)


def skill_tensor_name(skill_id: str, base_name: str) -> str:
    return f"{SKILL_PREFIX}{skill_id}.{base_name}"


def _entry(cmf: CmfFile, skill_id: str) -> dict:
    for entry in cmf.skills:
        if entry["id"] == skill_id:
            return entry
    raise SkillError(f"{cmf.path.name}: no skill '{skill_id}'; skills are {[s['id'] for s in cmf.skills]}")


def skill_tensor_source(cmf: CmfFile, skill_id: str | None) -> dict[str, str]:
    """For every base tensor, the directory entry to read under `skill_id` (replacement, not addition)."""
    base = {name: info for name, info in cmf.tensors.items() if not name.startswith(SKILL_PREFIX)}
    if skill_id is None:
        return {name: name for name in base}
    _entry(cmf, skill_id)
    prefix = f"{SKILL_PREFIX}{skill_id}."
    source = {name: name for name in base}
    for name, info in cmf.tensors.items():
        if not name.startswith(prefix):
            continue
        target = name[len(prefix) :]
        if target not in base:
            raise SkillError(f"{cmf.path.name}: skill tensor '{name}' replaces no base tensor '{target}'")
        if info.shape != base[target].shape:
            raise SkillError(
                f"{cmf.path.name}: skill tensor '{name}' has shape {info.shape}, base '{target}' has {base[target].shape}"
            )
        source[target] = name
    return source


def _base_dir_hash(cmf: CmfFile) -> str:
    return f"{hash64(cmf.section_bytes('dir')):016x}"


def add_skill(path: str | os.PathLike, skill_entry: dict, tensors) -> None:
    """Append skill `skill_entry['id']` with replacement `tensors` (keyed by BASE names) to the file.

    `tensors` yields `(base_name, array, dtype_name)` or RawTensors named by the base
    tensor they replace. For a sharded model the skill goes to shard 1.
    """
    skill_id = skill_entry.get("id") if isinstance(skill_entry, dict) else None
    if not isinstance(skill_id, str) or not _SKILL_ID.fullmatch(skill_id):
        raise SkillError(f"{path}: skill id {skill_id!r} must match {_SKILL_ID.pattern}")
    with open_cmf(path) as cmf:
        if any(s["id"] == skill_id for s in cmf.skills):
            raise SkillError(f"{cmf.path.name}: skill '{skill_id}' already exists")
        target = cmf.path  # shard 1 when sharded
        env = cmf.envelope
        base = {n: i for n, i in cmf.tensors.items() if not n.startswith(SKILL_PREFIX)}
        records = [
            Record(i.name, i.dtype.id, i.shape, i.off - env.data_off, i.nbytes, i.hash64)
            for i in cmf.tensors.values()
            if i.shard_no == 1
        ]
        header = dict(cmf.header)
        entry = {**skill_entry, "base_dir_hash": _base_dir_hash(cmf)}

    with open(target, "r+b") as fh:
        start = fh.seek(0, os.SEEK_END)
        try:
            new_env = _append_skill(fh, start, env, records, base, header, entry, tensors, target.name)
        except BaseException:
            fh.truncate(start)  # nothing points at the partial tail; drop it
            raise
        # The only in-place write: the envelope, after everything it points at is durable.
        fh.seek(0)
        fh.write(new_env.pack())
        fh.flush()
        os.fsync(fh.fileno())


def _append_skill(fh, end, env, records, base, header, entry, tensors, label):
    """Append payloads, header and directory at `end`; return the envelope that points at them."""
    skill_id = entry["id"]
    for item in tensors:
        base_name, dtype, shape, payload = encode_tensor(item)
        if base_name not in base:
            raise SkillError(f"{label}: skill '{skill_id}' replaces unknown tensor '{base_name}'")
        if shape != base[base_name].shape:
            raise SkillError(
                f"{label}: skill '{skill_id}' tensor '{base_name}' has shape {shape}, the base has {base[base_name].shape}"
            )
        off = env.data_off + round_up(end - env.data_off, tensor_alignment(payload.size))
        fh.write(bytes(off - end))
        fh.write(memoryview(payload))
        end = off + payload.size
        name = skill_tensor_name(skill_id, base_name)
        if any(r.name == name for r in records):
            raise SkillError(f"{label}: skill '{skill_id}' replaces '{base_name}' twice")
        records.append(Record(name, dtype.id, shape, off - env.data_off, payload.size, hash64(payload)))
    if not any(r.name.startswith(f"{SKILL_PREFIX}{skill_id}.") for r in records):
        raise SkillError(f"{label}: skill '{skill_id}' has no tensors")
    header["skills"] = [*(header.get("skills") or []), entry]
    header_bytes = dump_header(header)
    dir_bytes = pack_directory(records)
    fh.write(header_bytes + dir_bytes)
    fh.flush()
    os.fsync(fh.fileno())
    return dataclasses.replace(
        env,
        header_off=end,
        header_len=len(header_bytes),
        dir_off=end + len(header_bytes),
        dir_len=len(dir_bytes),
        data_len=end - env.data_off,
        header_hash=hash64(header_bytes),
        dir_hash=hash64(dir_bytes),
    )


def export_skill_file(base: str | os.PathLike, skill_id: str, out: str | os.PathLike, *, force: bool = False) -> Path:
    """Write skill `skill_id` of `base` as a standalone skill file (feature bit 6)."""
    with open_cmf(base) as cmf:
        entry = _entry(cmf, skill_id)
        if "base_dir_hash" not in entry:
            raise SkillError(f"{cmf.path.name}: skill '{skill_id}' records no base_dir_hash, so it cannot be exported")
        source = skill_tensor_source(cmf, skill_id)
        names = [name for name in source.values() if name.startswith(SKILL_PREFIX)]
        tensors = [RawTensor(n, cmf.tensors[n].dtype.id, cmf.tensors[n].shape, cmf.raw(n)) for n in names]
        (path,) = write_cmf(
            out,
            arch=cmf.arch,
            tensors=tensors,
            quant_type=cmf.header.get("quant_type"),
            provenance=entry.get("provenance") or cmf.header.get("provenance"),
            skills=[{**entry, "base_arch": cmf.arch}],
            extra_features=FEATURE_SKILL_FILE,
            force=force,
        )
    return path


def apply_skill_file(base: str | os.PathLike, skill_file: str | os.PathLike) -> None:
    """Append the skill held by `skill_file` to `base`; a foreign base is refused (SkillError)."""
    with open_cmf(skill_file) as skill:
        label = skill.path.name
        if not skill.is_skill_file:
            raise SkillError(f"{label}: not a skill file (required_features {skill.required_features:#x} lacks bit 6)")
        if len(skill.skills) != 1:
            raise SkillError(f"{label}: a skill file holds exactly one registry entry, found {len(skill.skills)}")
        entry = skill.skills[0]
        with open_cmf(base) as target:
            have = _base_dir_hash(target)
            if entry.get("base_dir_hash") != have:
                raise SkillError(
                    f"{label}: built for a base with directory hash {entry.get('base_dir_hash')}, "
                    f"{target.path.name} has {have}"
                )
            if entry.get("base_arch") != target.arch:
                raise SkillError(f"{label}: base_arch differs from {target.path.name}'s arch")
        prefix = f"{SKILL_PREFIX}{entry['id']}."
        tensors = []
        for name, info in skill.tensors.items():
            if not name.startswith(prefix):
                raise SkillError(f"{label}: tensor '{name}' does not belong to skill '{entry['id']}'")
            tensors.append(RawTensor(name[len(prefix) :], info.dtype.id, info.shape, skill.raw(name)))
        add_skill(base, {k: v for k, v in entry.items() if k not in _FILE_ONLY_KEYS}, tensors)
