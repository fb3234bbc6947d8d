"""CLI: `cmfdeploy inspect | verify | sign | dump` over CMF files."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np

from manifests.output import refuse_existing, staged_file
from pipeline.ground.cmf.errors import Parse
from pipeline.ground.cmf.reader import CmfFile, open_cmf
from pipeline.ground.cmf.skills import SKILL_PREFIX, skill_tensor_source
from pipeline.ground.cmf.verify import sign_cmf, verify_cmf

FEATURE_NAMES = {
    0: "TENSOR_DIR",
    1: "BINARY_MASKS",
    2: "QUANT_2F",
    3: "DELTA_MASKS",
    4: "HOT_PACKS",
    5: "LOOP_MASKS",
    6: "SKILL_FILE",
}
_ARCH_SUMMARY = (
    "arch_name", "hidden_size", "intermediate_size", "num_layers", "num_attention_heads",
    "num_kv_heads", "head_dim", "vocab_size", "norm_style", "tie_word_embeddings",
)  # fmt: skip


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="summarise a CMF file: arch, dtypes, sections, masks, skills")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_inspect)

    p = subparsers.add_parser("verify", help="check every hash (and a .sig when present)")
    p.add_argument("file")
    p.add_argument("--pubkey", help="hex Ed25519 public key the .sig must be made with")
    p.set_defaults(func=_verify)

    p = subparsers.add_parser("sign", help="write a detached Ed25519 signature <file>.sig")
    p.add_argument("file")
    p.add_argument("--key", required=True, help="Ed25519 private key: unencrypted PEM, or 32 raw bytes")
    p.add_argument("--force", action="store_true", help="replace an existing .sig")
    p.set_defaults(func=_sign)

    p = subparsers.add_parser("dump", help="decode tensors to float32 arrays in an .npz (tensors of reserved "
                              "dtypes, which have no defined decoding, are listed instead)")
    p.add_argument("file")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--tensor", action="append", help="only this tensor (repeatable)")
    p.add_argument("--skill", help="read tensors as skill ID sees them (keys stay the base names)")
    p.add_argument("--force", action="store_true", help="overwrite an existing output")
    p.set_defaults(func=_dump)


def summarize(cmf: CmfFile) -> dict:
    """The `inspect` summary as plain JSON data."""
    dtypes: dict[str, dict] = {}
    params = 0
    for info in cmf.tensors.values():
        n = int(np.prod(info.shape, dtype=object))
        params += n
        row = dtypes.setdefault(info.dtype.name, {"tensors": 0, "bytes": 0, "elements": 0})
        row["tensors"] += 1
        row["bytes"] += info.nbytes
        row["elements"] += n
    for row in dtypes.values():
        row["bits_per_weight"] = round(8 * row["bytes"] / row["elements"], 4) if row["elements"] else None
    env = cmf.envelope
    sections = {}
    for name in ("header", "dir", "data", "masks", "vocab", "index"):
        off, length = env.section(name)
        if length:
            sections[name] = {"off": off, "len": length}
    masks = None
    if cmf.masks is not None:
        masks = [
            {
                "task_id": t.task_id,
                "name": t.name,
                "sparsity": t.meta.get("sparsity"),
                "quality": t.meta.get("quality"),
                "ffn_active": round(float(t.ffn.mean()), 4) if t.ffn.size else None,
                "heads_active": round(float(t.heads.mean()), 4) if t.heads.size else None,
                "experts": t.experts is not None,
            }
            for t in cmf.masks.tasks
        ]
    skills = [
        {
            "id": s["id"],
            "name": s.get("name"),
            "tensors": sum(n.startswith(f"{SKILL_PREFIX}{s['id']}.") for n in cmf.tensors),
        }
        for s in cmf.skills
    ]
    features = cmf.required_features
    return {
        "file": str(cmf.path),
        "files": [str(p) for p in cmf.paths],
        "bytes": sum(os.path.getsize(p) for p in cmf.paths),
        "arch": cmf.arch,
        "moe": cmf.moe,
        "quant_type": cmf.header.get("quant_type"),
        "required_features": [FEATURE_NAMES.get(b, f"bit{b}") for b in range(32) if features >> b & 1],
        "skill_file": cmf.is_skill_file,
        "tensor_count": len(cmf.tensors),
        "parameters": params,
        "dtypes": dtypes,
        "sections": sections,
        "masks": masks,
        "skills": skills,
        "vocab_bytes": env.vocab_len or None,
        "tokenizer_config": cmf.tokenizer_config is not None,
    }


def _inspect(args) -> int:
    with open_cmf(args.file) as cmf:
        summary = summarize(cmf)
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    arch = summary["arch"]
    print(f"{summary['file']}  ({len(summary['files'])} file(s), {summary['bytes']:,} bytes)")
    print("arch: " + ", ".join(f"{k}={arch[k]}" for k in _ARCH_SUMMARY if k in arch))
    if summary["moe"]:
        print(f"moe: {summary['moe']}")
    print(f"quant_type: {summary['quant_type']}   features: {' '.join(summary['required_features'])}")
    print(f"tensors: {summary['tensor_count']}   parameters: {summary['parameters']:,}")
    for name, row in sorted(summary["dtypes"].items(), key=lambda kv: -kv[1]["bytes"]):
        bpw = "-" if row["bits_per_weight"] is None else f"{row['bits_per_weight']:.3f}"
        print(f"  {name:10s} {row['tensors']:6d} tensors {row['bytes']:14,d} bytes {bpw:>8s} bits/weight")
    print("sections: " + ", ".join(f"{k} {v['off']:#x}+{v['len']:#x}" for k, v in summary["sections"].items()))
    for mask in summary["masks"] or []:
        q = "unmeasured" if mask["quality"] is None else mask["quality"]
        active = f"ffn {mask['ffn_active']} heads {mask['heads_active']}"
        print(f"  mask {mask['task_id']} '{mask['name']}': {active} quality {q}")
    for skill in summary["skills"]:
        print(f"  skill '{skill['id']}' ({skill['name']}): {skill['tensors']} tensors")
    return 0


def _verify(args) -> int:
    try:
        pubkey = None if args.pubkey is None else bytes.fromhex(args.pubkey)
    except ValueError:
        raise Parse(f"--pubkey {args.pubkey!r} is not hex") from None
    report = verify_cmf(args.file, pubkey=pubkey)
    if not report.ok:
        for failure in report.failures:
            print(f"HashMismatch: {failure}" if failure.what != "signature" else f"SignatureError: {failure}")
        return 1
    signed = f", signatures ok: {', '.join(report.signatures)}" if report.signatures else ""
    print(f"OK: {report.path.name}: {report.checked} hashes match{signed}")
    return 0


def _sign(args) -> int:
    for path in sign_cmf(args.file, args.key, force=args.force):
        print(path)
    return 0


def _dump(args) -> int:
    out = Path(args.output)
    refuse_existing(out, args.force)
    with open_cmf(args.file) as cmf:
        source = skill_tensor_source(cmf, args.skill) if args.skill else {n: n for n in cmf.tensors}
        names = args.tensor or list(source)
        missing = [n for n in names if n not in source]
        if missing:
            raise Parse(f"{cmf.path.name}: no tensor named {', '.join(map(repr, missing))}")
        # A reserved dtype opens and verifies (spec) but has no decoding: listed, not fatal.
        dtypes = {name: cmf.tensors[source[name]].dtype for name in names}
        decodable = [name for name in names if dtypes[name].decodable]
        write_npz(out, ((name, cmf.decode(source[name])) for name in decodable))
    print(f"{out}: {len(decodable)} tensors")
    for name in names:
        if not dtypes[name].decodable:
            print(f"not decoded: {name}: dtype {dtypes[name].id} ({dtypes[name].name}) is reserved and has no "
                  "defined decoding")
    return 0


def write_npz(out: Path, arrays) -> None:
    """An uncompressed .npz written one array at a time (never all in memory), renamed into place."""
    with staged_file(out) as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, array in arrays:
            with zf.open(f"{name}.npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, np.asarray(array), allow_pickle=False)
