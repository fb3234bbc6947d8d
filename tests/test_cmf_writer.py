"""write_cmf: round trips through the reader and verifier, and the byte layout of spec §1-§6."""

import json
import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

from pipeline.ground.cmf import DTYPES, Masks, RawTensor, TaskMask, dtype_by_name, hash64, open_cmf, verify_cmf, write_cmf
from pipeline.ground.cmf.errors import CmfError, Parse
from pipeline.ground.cmf.masks import encode_masks
from pipeline.ground.errors import OutputExists

VECTORS = Path("/work/shared/cmf-conformance")
ENCODABLE = [dt.name for dt in DTYPES.values() if dt.encode is not None]
ARCH = {
    "arch_name": "llama",
    "hidden_size": 64,
    "intermediate_size": 70,  # not a multiple of 8: mask rows carry tail bits
    "num_layers": 3,
    "num_attention_heads": 5,
    "num_kv_heads": 5,
    "vocab_size": 32,
}


def weights(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def parse_envelope(data: bytes) -> dict:
    """The envelope decoded straight from the spec table, independently of the reader."""
    names = ["header", "dir", "data", "masks", "vocab", "index"]
    values = struct.unpack_from("<4sIII14Q", data, 0)
    env = {"magic": values[0], "version": values[1], "flags": values[2], "features": values[3]}
    for i, name in enumerate(names):
        env[f"{name}_off"], env[f"{name}_len"] = values[4 + 2 * i], values[5 + 2 * i]
    env["header_hash"], env["dir_hash"] = values[16], values[17]
    return env


def parse_records(data: bytes, env: dict) -> list[dict]:
    count, pool_off = struct.unpack_from("<QQ", data, env["dir_off"])
    out = []
    for i in range(count):
        fields = struct.unpack_from("<IHBB6IQQQ", data, env["dir_off"] + 16 + 56 * i)
        name_off, name_len, dtype, ndim = fields[:4]
        start = env["dir_off"] + pool_off + name_off
        out.append(
            {
                "name": data[start : start + name_len].decode(),
                "dtype": dtype,
                "shape": tuple(fields[4 : 4 + ndim]),
                "off": fields[10],
                "nbytes": fields[11],
                "hash": fields[12],
            }
        )
    return out


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_every_encoder_round_trips(tmp_path, rng):
    arrays = {name: weights(rng, (12, 96)) for name in ENCODABLE}
    arrays["f32"][0, :5] = [0.0, -0.0, np.inf, -np.inf, 1e-42]
    tensors = [(f"w.{name}", arrays[name], name) for name in ENCODABLE]
    (path,) = write_cmf(tmp_path / "all.cmf", arch=ARCH, tensors=tensors)
    with open_cmf(path) as cmf:
        assert list(cmf.tensors) == [t[0] for t in tensors]
        for name, array, dtype_name in tensors:
            dtype = dtype_by_name(dtype_name)
            payload = dtype.encode(array)
            info = cmf.tensors[name]
            assert (info.dtype, info.shape, info.nbytes) == (dtype, array.shape, payload.size)
            assert cmf.raw(name).tobytes() == payload.tobytes()
            assert info.hash64 == hash64(payload)
            want = dtype.decode(payload, array.shape)
            np.testing.assert_array_equal(cmf.decode(name).view(np.uint32), want.view(np.uint32))
        assert verify_cmf(cmf).ok
        assert cmf.header["quant_type"] == "F32"  # the dtype holding the most bytes


def test_layout_follows_the_spec(tmp_path, rng):
    # Sizes chosen to straddle the 16 KiB page-alignment threshold.
    tensors = [
        ("small", weights(rng, (7,)), "f16"),
        ("just_under", weights(rng, (4095,)), "f32"),  # 16380 bytes: 64-aligned only
        ("page", weights(rng, (64, 64)), "f32"),  # 16 KiB: page-aligned
        ("odd", weights(rng, (3, 33)), "q4_block"),
        ("big", weights(rng, (40, 128)), "q8_2f"),
    ]
    tok = json.dumps({"model": {"vocab": {"a": 0}}}).encode()
    (path,) = write_cmf(tmp_path / "m.cmf", arch=ARCH, tensors=tensors, tokenizer_json=tok, masks=_masks(rng))
    data = path.read_bytes()
    env = parse_envelope(data)
    assert env["magic"] == b"CMF\x01" and env["version"] == 2 and env["flags"] == 0
    assert env["header_off"] == 128
    assert env["dir_off"] == 128 + env["header_len"]
    dir_end = env["dir_off"] + env["dir_len"]
    assert env["data_off"] % 4096 == 0 and env["data_off"] - dir_end < 4096
    assert data[dir_end : env["data_off"]] == bytes(env["data_off"] - dir_end)
    assert env["header_hash"] == hash64(data[128 : 128 + env["header_len"]])
    assert env["dir_hash"] == hash64(data[env["dir_off"] : dir_end])

    records = parse_records(data, env)
    pos = 0
    for rec in records:
        assert rec["off"] % 64 == 0
        assert rec["off"] % 4096 == 0 or rec["nbytes"] < 16384
        assert rec["off"] == -(-pos // (4096 if rec["nbytes"] >= 16384 else 64)) * (4096 if rec["nbytes"] >= 16384 else 64)
        gap = data[env["data_off"] + pos : env["data_off"] + rec["off"]]
        assert gap == bytes(len(gap))
        payload = data[env["data_off"] + rec["off"] : env["data_off"] + rec["off"] + rec["nbytes"]]
        assert rec["hash"] == hash64(payload)
        pos = rec["off"] + rec["nbytes"]
    assert [r["off"] for r in records if r["name"] == "page"][0] % 4096 == 0
    assert [r["off"] for r in records if r["name"] == "just_under"][0] % 4096 != 0
    assert env["data_len"] == pos

    # masks, then vocab, right behind the blob; no sparse index is written.
    assert env["masks_off"] == env["data_off"] + env["data_len"]
    assert env["vocab_off"] == env["masks_off"] + env["masks_len"]
    assert env["index_off"] == env["index_len"] == 0
    assert len(data) == env["vocab_off"] + env["vocab_len"]
    assert data[env["vocab_off"] :] == tok
    header = json.loads(data[128 : 128 + env["header_len"]])
    masks_bytes = data[env["masks_off"] : env["masks_off"] + env["masks_len"]]
    assert header["section_hashes"] == {"masks": f"{hash64(masks_bytes):016x}", "vocab": f"{hash64(tok):016x}"}
    # TENSOR_DIR, BINARY_MASKS, QUANT_2F (q8_2f present); no LOOP_MASKS without num_loops.
    assert env["features"] == 0b111


def test_masks_section_matches_the_independent_writer_byte_for_byte():
    with open_cmf(VECTORS / "layout_align_masks_a.cmf") as cmf:
        rebuilt = Masks(
            cmf.masks.default_task,
            [TaskMask(t.meta, t.ffn, t.heads, t.layer_gates, t.experts) for t in cmf.masks.tasks],
        )
        assert encode_masks(rebuilt, cmf.header, cmf.required_features) == cmf.section_bytes("masks").tobytes()


def _masks(rng, layers=3, loops=1, experts=None):
    def task(task_id, name, quality):
        return TaskMask(
            meta={"task_id": task_id, "name": name, "description": None, "sparsity": 0.5, "quality": quality,
                  "parent": None, "priority": "Normal", "has_hot_pack": False},  # fmt: skip
            ffn=rng.random((layers * loops, ARCH["intermediate_size"])) < 0.5,
            heads=rng.random((layers, ARCH["num_attention_heads"])) < 0.5,
            layer_gates=rng.random(layers) < 0.7,
            experts=None if experts is None else rng.random((layers, experts)) < 0.5,
        )

    return Masks("general", [task(0, "general", {"metric": "ppl_ratio", "value": 1.0}), task(1, "code", None)])


@pytest.mark.parametrize("loops, experts", [(1, None), (2, None), (1, 10)])
def test_masks_round_trip(tmp_path, rng, loops, experts):
    arch = dict(ARCH, num_loops=loops)
    moe = None if experts is None else {"num_experts": experts, "top_k": 2, "moe_intermediate_size": 16}
    masks = _masks(rng, loops=loops, experts=experts)
    (path,) = write_cmf(
        tmp_path / "m.cmf", arch=arch, moe=moe, tensors=[("w", weights(rng, (4, 32)), "f16")], masks=masks
    )
    with open_cmf(path) as cmf:
        assert cmf.required_features & 0b10
        assert bool(cmf.required_features & 0b100000) == (loops > 1)
        assert cmf.moe == moe
        for want, got in zip(masks.tasks, cmf.masks.tasks, strict=True):
            np.testing.assert_array_equal(got.ffn, want.ffn)
            np.testing.assert_array_equal(got.heads, want.heads)
            np.testing.assert_array_equal(got.layer_gates, want.layer_gates)
            np.testing.assert_array_equal(got.visit_gates, np.tile(want.layer_gates, loops))
            if experts is None:
                assert got.experts is None
            else:
                np.testing.assert_array_equal(got.experts, want.experts)
            assert got.meta["blob_off"] % 8 == 0
            assert got.meta["has_expert_fields"] == (experts is not None)
        assert cmf.masks.task("code").meta["quality"] is None  # unmeasured stays null
        assert verify_cmf(cmf).ok


def test_mask_tail_bits_must_be_zero(tmp_path, rng):
    (path,) = write_cmf(tmp_path / "m.cmf", arch=ARCH, tensors=[("w", weights(rng, (4, 32)), "f16")], masks=_masks(rng))
    data = bytearray(path.read_bytes())
    env = parse_envelope(bytes(data))
    with open_cmf(path) as cmf:
        first_blob = cmf.masks.tasks[0].meta["blob_off"]
    # Row 0 of the FFN field is 70 bits in 9 bytes: bit 71 is a tail bit.
    data[env["masks_off"] + first_blob + 8] |= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(Parse, match="tail bit"):
        open_cmf(path)


def test_header_blocks_vocab_and_metadata(tmp_path, rng):
    moe = {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}
    mtp = {"num_layers": 1, "share_lm_head": True, "share_embed": True}
    chat = {"chat_template": "{{ messages }}", "eos_token_ids": [1, 2], "bos_token_id": None, "pad_token_id": 0}
    (path,) = write_cmf(
        tmp_path / "m.cmf",
        arch=ARCH,
        tensors=[RawTensor("raw.u8", 6, (5,), b"\x00\x01\x02\xfe\xff")],
        quant_type="Q4_BLOCK",
        provenance={"source": "unit test"},
        tokenizer_json='{"tokenizer": "é"}',
        tokenizer_config=chat,
        moe=moe,
        mtp=mtp,
        extra_header={"note": "kept"},
    )
    with open_cmf(path) as cmf:
        assert cmf.header["quant_type"] == "Q4_BLOCK" and cmf.header["provenance"] == {"source": "unit test"}
        assert cmf.moe == moe and cmf.header["mtp"] == mtp and cmf.header["note"] == "kept"
        assert cmf.tokenizer_config == chat
        assert cmf.vocab == '{"tokenizer": "é"}'.encode()
        assert cmf.decode("raw.u8").tolist() == [0, 1, 2, 254, 255]
        assert cmf.required_features == 1  # u8 only: no QUANT_2F


def test_vbit_sets_quant_2f_and_vbit_ro_does_not(tmp_path, rng):
    for dtype_name, bit in (("vbit", 4), ("vbit_ro", 0), ("q8_2f", 4), ("q4_block", 0)):
        (path,) = write_cmf(tmp_path / f"{dtype_name}.cmf", arch=ARCH, tensors=[("w", weights(rng, (4, 64)), dtype_name)])
        with open_cmf(path) as cmf:
            assert cmf.required_features & 4 == bit, dtype_name


def test_refuses_bad_input_and_existing_output(tmp_path, rng):
    w = weights(rng, (4, 32))
    target = tmp_path / "m.cmf"
    with pytest.raises(Parse, match="duplicate"):
        write_cmf(target, arch=ARCH, tensors=[("w", w, "f16"), ("w", w, "f16")])
    with pytest.raises(Parse, match="unknown dtype"):
        write_cmf(target, arch=ARCH, tensors=[("w", w, "f8")])
    with pytest.raises(Parse, match="no encoder"):
        write_cmf(target, arch=ARCH, tensors=[("w", w, "mix8_4")])
    with pytest.raises(CmfError):
        write_cmf(target, arch=ARCH, tensors=[RawTensor("w", 3, (4, 32), b"\x00" * 10)])  # q8_row needs 136 bytes
    with pytest.raises(Parse, match="extra_header"):
        write_cmf(target, arch=ARCH, tensors=[], extra_header={"arch": {}})
    assert list(tmp_path.iterdir()) == []  # no temporaries left behind

    write_cmf(target, arch=ARCH, tensors=[("w", w, "f16")])
    with pytest.raises(OutputExists):
        write_cmf(target, arch=ARCH, tensors=[("w", w, "f32")])
    write_cmf(target, arch=ARCH, tensors=[("w", w, "f32")], force=True)
    with open_cmf(target) as cmf:
        assert cmf.tensors["w"].dtype.name == "f32"
    assert [p.name for p in tmp_path.iterdir()] == ["m.cmf"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask  # a normal file, not a private temporary


def test_streams_a_generator_and_cleans_up_when_it_fails(tmp_path, rng):
    def tensors(fail: bool):
        for i in range(5):
            if fail and i == 3:
                raise RuntimeError("source went away")
            yield f"layer.{i}", weights(rng, (16, 32)), "q4_block"

    with pytest.raises(RuntimeError):
        write_cmf(tmp_path / "m.cmf", arch=ARCH, tensors=tensors(True))
    assert list(tmp_path.iterdir()) == []
    (path,) = write_cmf(tmp_path / "m.cmf", arch=ARCH, tensors=tensors(False))
    with open_cmf(path) as cmf:
        assert list(cmf.tensors) == [f"layer.{i}" for i in range(5)]
        assert verify_cmf(cmf).ok


def test_conformance_files_rewrite_to_equivalent_files(tmp_path):
    """Copying every tensor of an independent file through RawTensor keeps payloads, hashes and decodes."""
    with open_cmf(VECTORS / "model_masks_tok_a.cmf") as src:
        raw = [RawTensor(n, i.dtype.id, i.shape, src.raw(n)) for n, i in src.tensors.items()]
        (path,) = write_cmf(
            tmp_path / "copy.cmf",
            arch=src.arch,
            tensors=raw,
            quant_type=src.header["quant_type"],
            tokenizer_json=src.vocab,
            tokenizer_config=src.tokenizer_config,
            masks=src.masks,
        )
        with open_cmf(path) as copy:
            assert verify_cmf(copy).ok
            for name, info in src.tensors.items():
                assert copy.tensors[name].hash64 == info.hash64
                np.testing.assert_array_equal(copy.decode(name), src.decode(name))
            assert copy.vocab == src.vocab
            for a, b in zip(src.masks.tasks, copy.masks.tasks, strict=True):
                np.testing.assert_array_equal(a.ffn, b.ffn)
                np.testing.assert_array_equal(a.heads, b.heads)
                np.testing.assert_array_equal(a.layer_gates, b.layer_gates)


def _mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path`, from /proc/self/smaps."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/self/smaps")
def test_evict_drops_a_tensors_pages_and_the_bytes_read_back_unchanged(tmp_path, rng):
    big = weights(rng, (2048, 1024))  # 8 MiB, far above anything the header parse touches
    (path,) = write_cmf(tmp_path / "m.cmf", arch=ARCH, tensors=[("small", weights(rng, (4, 32)), "f32"),
                                                                    ("big", big, "f32")])
    # Only what is resident after the eviction is asserted: the kernel may reclaim the file's
    # clean pages at any moment under memory pressure (it did, in a CI run beside a 1.5B model's
    # gate), which can lower what a decode left resident but never raise what an eviction leaves.
    with open_cmf(path) as cmf:
        assert np.array_equal(cmf.decode("big"), big)
        cmf.evict("big")
        evicted = _mapped_rss_kib(path.resolve())
        others = (path.stat().st_size - big.nbytes) // 1024
        assert evicted <= others + 8  # every page of "big" but a shared edge is gone
        assert np.array_equal(cmf.decode("big"), big)  # read-only file map: the pages fault back
