"""Seeded mutation fuzzing: a damaged file opens, decodes and verifies, or fails with a CmfError.

Nothing else may escape (no IndexError, MemoryError, struct.error, ...), nothing may
hang, and every single-byte flip of the hashed regions is caught by open or verify.
"""

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from _fuzz import HANG_SECONDS, deadline, interesting, mutate_bytes

from pipeline.ground.cmf import Masks, TaskMask, open_cmf, verify_cmf, write_cmf
from pipeline.ground.cmf.errors import CmfError
from pipeline.ground.cmf.skills import add_skill

VECTORS = Path("/work/shared/cmf-conformance")
CASES_PER_BASE = 500
ARCH = {"arch_name": "llama", "hidden_size": 32, "intermediate_size": 37, "num_layers": 2, "num_attention_heads": 3}
# Directory record fields: (offset inside the 56-byte record, struct format).
RECORD_FIELDS = [(0, "<I"), (4, "<H"), (6, "<B"), (7, "<B"), *((8 + 4 * k, "<I") for k in range(6)), (32, "<Q"), (40, "<Q")]


def exercise(path: Path) -> None:
    """Everything a consumer does with a file; only CmfError may come out."""
    try:
        with open_cmf(path) as cmf:
            for name in cmf.tensors:
                try:
                    cmf.decode(name)
                except CmfError:
                    pass
            verify_cmf(cmf)
            _ = (cmf.masks, cmf.sparse_index, cmf.vocab, cmf.skills)
    except CmfError:
        pass


@pytest.fixture(scope="module")
def writer_base(tmp_path_factory) -> Path:
    rng = np.random.default_rng(99)
    tmp = tmp_path_factory.mktemp("fuzzbase")

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    tensors = [
        ("embed", w(16, 32), "q8_row"),
        ("norm", w(32), "f16"),
        ("a", w(8, 64), "vbit"),
        ("b", w(8, 64), "vbit_ro"),
        ("c", w(8, 64), "q1s"),
        ("d", w(8, 64), "q1t"),
        ("e", w(8, 64), "q4tp"),
        ("f", w(8, 64), "q2tp"),
        ("g", w(3, 5, 7), "q4_block"),
        ("h", w(8, 64), "q8_2f"),
    ]
    task = TaskMask(
        meta={"task_id": 0, "name": "t", "quality": None},
        ffn=rng.random((2, 37)) < 0.5,
        heads=rng.random((2, 3)) < 0.5,
        layer_gates=np.array([True, False]),
    )
    (path,) = write_cmf(
        tmp / "base.cmf", arch=ARCH, tensors=tensors, tokenizer_json=b'{"vocab": {}}', masks=Masks("t", [task]),
        tokenizer_config={"eos_token_ids": [1]},
    )  # fmt: skip
    add_skill(path, {"id": "s"}, [("norm", w(32), "f32")])
    return path


BASES = ["model_masks_tok_a.cmf", "layout_align_masks_a.cmf", "dtype_q1t_a.cmf", "dtype_vbit_ro_a.cmf", "dtype_q1s_a.cmf"]


def mutate(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    buf = bytearray(data)
    size = len(buf)
    env = struct.unpack_from("<4sIII14Q", data, 0)
    dir_off, dir_len = env[6], env[7]
    count = struct.unpack_from("<Q", data, dir_off)[0] if dir_off + 8 <= size else 0

    def put(off: int, fmt: str, value: int) -> None:
        if 0 <= off <= size - struct.calcsize(fmt):
            bits = 8 * struct.calcsize(fmt)
            struct.pack_into(fmt, buf, off, value % (1 << bits))

    kind = int(rng.integers(6))
    if kind < 2:  # flips, truncation, insertion, a random integer overwritten
        return mutate_bytes(data, rng)
    if kind == 2:
        off = 0x10 + 8 * int(rng.integers(14))
        value = interesting(struct.unpack_from("<Q", data, off)[0], size, rng)
        put(off, "<Q", value)
        return bytes(buf), f"envelope u64 at {off:#x} = {value % 2**64:#x}"
    if kind == 3 and count:
        rec = dir_off + 16 + 56 * int(rng.integers(min(count, 1 << 20)))
        field, fmt = RECORD_FIELDS[int(rng.integers(len(RECORD_FIELDS)))]
        old = struct.unpack_from(fmt, data, rec + field)[0] if rec + field + 8 <= size else 0
        value = interesting(old, size, rng)
        put(rec + field, fmt, value)
        return bytes(buf), f"record field at {rec + field:#x} = {value:#x}"
    if kind == 4:
        off = dir_off + 8 * int(rng.integers(2))
        value = interesting(struct.unpack_from("<Q", data, off)[0] if off + 8 <= size else 0, size, rng)
        put(off, "<Q", value)
        return bytes(buf), f"directory prefix at {off:#x} = {value:#x}"
    # Kind 5 (and 3 without records): u32 fields of the masks/index prefixes and the sparse-index entries.
    sec_off = env[12] if rng.integers(2) else env[16]
    off = sec_off + 4 * int(rng.integers(6))
    value = interesting(struct.unpack_from("<I", data, off)[0] if off + 4 <= size else 0, size, rng)
    put(off, "<I", value)
    return bytes(buf), f"section u32 at {off:#x} = {value % 2**32:#x}"


@pytest.mark.parametrize("base", ["writer", *BASES])
def test_mutations_fail_only_with_cmf_errors(tmp_path, writer_base, base):
    source = writer_base if base == "writer" else VECTORS / base
    data = source.read_bytes()
    exercise(source)
    rng = np.random.default_rng(zlib.crc32(base.encode()))
    target = tmp_path / "mutant.cmf"
    for case in range(CASES_PER_BASE):
        mutant, what = mutate(data, rng)
        target.write_bytes(mutant)
        with deadline(HANG_SECONDS, f"{base} case {case}: {what}"):
            try:
                exercise(target)
            except Exception as error:  # noqa: BLE001 - the point is to name any escape
                pytest.fail(f"{base} case {case} ({what}): {type(error).__name__}: {error}")


def test_every_hashed_byte_flip_is_caught(tmp_path, writer_base):
    data = writer_base.read_bytes()
    env = struct.unpack_from("<4sIII14Q", data, 0)
    header_off, header_len, dir_off, dir_len = env[4:8]
    masks_off, masks_len, vocab_off, vocab_len = env[12:16]
    positions = [
        *range(0x70, 0x80),  # the envelope's hash fields
        *range(header_off, header_off + header_len),
        *range(dir_off, dir_off + dir_len),
        *range(masks_off, masks_off + masks_len),
        *range(vocab_off, vocab_off + vocab_len),
    ]
    with open_cmf(writer_base) as cmf:
        payload = np.concatenate([np.arange(t.off, t.off + t.nbytes) for t in cmf.tensors.values()])
    rng = np.random.default_rng(5)
    positions += rng.choice(payload, 400, replace=False).tolist()
    target = tmp_path / "flipped.cmf"
    missed = []
    for pos in positions:
        mutant = bytearray(data)
        mutant[pos] ^= int(rng.integers(1, 256))
        target.write_bytes(mutant)
        try:
            with open_cmf(target) as cmf:
                if verify_cmf(cmf).ok:
                    missed.append(pos)
        except CmfError:
            pass
    assert missed == []
    assert len(positions) > 1000
