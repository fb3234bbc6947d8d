"""Skills (spec §9: append-only growth, skill files) and shards (spec §10)."""

import shutil
import struct

import numpy as np
import pytest

from pipeline.ground.cmf import hash64, open_cmf, verify_cmf, write_cmf
from pipeline.ground.cmf.errors import ShardError, SkillError
from pipeline.ground.cmf.skills import add_skill, apply_skill_file, export_skill_file, skill_tensor_source
from pipeline.ground.cmf.writer import RawTensor

ARCH = {"arch_name": "llama", "hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_attention_heads": 4}


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def base_tensors(rng):
    return [
        ("model.embed_tokens.weight", rng.standard_normal((64, 32)).astype(np.float32), "q8_row"),
        ("model.layers.0.mlp.up_proj.weight", rng.standard_normal((64, 32)).astype(np.float32), "q4_block"),
        ("model.layers.0.mlp.down_proj.weight", rng.standard_normal((32, 64)).astype(np.float32), "vbit"),
        ("model.norm.weight", rng.standard_normal(32).astype(np.float32), "f16"),
    ]


@pytest.fixture
def base(tmp_path, rng):
    (path,) = write_cmf(tmp_path / "base.cmf", arch=ARCH, tensors=base_tensors(rng), tokenizer_json=b'{"v": 1}')
    return path


def test_add_skill_is_append_only_and_replaces(base, rng):
    before = base.read_bytes()
    up = rng.standard_normal((64, 32)).astype(np.float32)
    add_skill(base, {"id": "code", "name": "coding", "layers": [0]}, [("model.layers.0.mlp.up_proj.weight", up, "f16")])
    after = base.read_bytes()
    # Every byte after the envelope is where it was; only the envelope was rewritten.
    assert after[128 : len(before)] == before[128:]
    assert len(after) > len(before)
    with open_cmf(base) as cmf:
        assert verify_cmf(cmf).ok
        assert cmf.skills == [
            {"id": "code", "name": "coding", "layers": [0], "base_dir_hash": f"{hash64(_dir(before)):016x}"}
        ]
        source = skill_tensor_source(cmf, "code")
        assert source["model.layers.0.mlp.up_proj.weight"] == "skill.code.model.layers.0.mlp.up_proj.weight"
        assert source["model.norm.weight"] == "model.norm.weight"
        assert skill_tensor_source(cmf, None)["model.layers.0.mlp.up_proj.weight"] == "model.layers.0.mlp.up_proj.weight"
        np.testing.assert_array_equal(cmf.decode(source["model.layers.0.mlp.up_proj.weight"]), up.astype(np.float16))
        assert cmf.vocab == b'{"v": 1}'  # older sections still reachable through the envelope
        info = cmf.tensors["skill.code.model.layers.0.mlp.up_proj.weight"]
        assert info.off % 64 == 0


def _dir(data: bytes) -> bytes:
    off, length = struct.unpack_from("<QQ", data, 0x20)
    return data[off : off + length]


def test_add_skill_refuses_bad_requests_without_touching_the_file(base, rng):
    before = base.read_bytes()
    w = rng.standard_normal((64, 32)).astype(np.float32)
    with pytest.raises(SkillError, match="unknown tensor"):
        add_skill(base, {"id": "s"}, [("model.nope", w, "f16")])
    with pytest.raises(SkillError, match="shape"):
        add_skill(base, {"id": "s"}, [("model.layers.0.mlp.down_proj.weight", w, "f16")])
    with pytest.raises(SkillError, match="no tensors"):
        add_skill(base, {"id": "s"}, [])
    with pytest.raises(SkillError, match="id"):
        add_skill(base, {"id": "has.dot"}, [("model.layers.0.mlp.up_proj.weight", w, "f16")])
    assert base.read_bytes() == before
    add_skill(base, {"id": "s"}, [("model.layers.0.mlp.up_proj.weight", w, "f16")])
    with pytest.raises(SkillError, match="already exists"):
        add_skill(base, {"id": "s"}, [("model.layers.0.mlp.up_proj.weight", w, "f16")])
    with open_cmf(base) as cmf, pytest.raises(SkillError):
        skill_tensor_source(cmf, "other")


def test_skill_file_export_and_apply_reproduce_the_same_file(base, tmp_path, rng):
    pristine = tmp_path / "pristine.cmf"
    shutil.copy(base, pristine)
    down = rng.standard_normal((32, 64)).astype(np.float32)
    add_skill(base, {"id": "math", "name": "maths"}, [("model.layers.0.mlp.down_proj.weight", down, "q8_2f")])
    skill_file = export_skill_file(base, "math", tmp_path / "math.skill.cmf")
    with open_cmf(skill_file) as skill:
        assert skill.is_skill_file and skill.required_features & (1 << 6)
        assert list(skill.tensors) == ["skill.math.model.layers.0.mlp.down_proj.weight"]
        assert skill.skills[0]["base_arch"] == ARCH
        assert verify_cmf(skill).ok
    apply_skill_file(pristine, skill_file)
    assert pristine.read_bytes() == base.read_bytes()

    # A base with another directory (here: one that already grew) is refused.
    with pytest.raises(SkillError, match="directory hash"):
        apply_skill_file(base, skill_file)
    with pytest.raises(SkillError, match="not a skill file"):
        apply_skill_file(pristine, base)


def test_skills_survive_a_second_append(base, rng):
    w = rng.standard_normal((64, 32)).astype(np.float32)
    add_skill(base, {"id": "a"}, [("model.layers.0.mlp.up_proj.weight", w, "f16")])
    up = "model.layers.0.mlp.up_proj.weight"
    add_skill(base, {"id": "b"}, [("model.embed_tokens.weight", w, "q8_row"), (up, -w, "f32")])
    with open_cmf(base) as cmf:
        assert [s["id"] for s in cmf.skills] == ["a", "b"]
        assert verify_cmf(cmf).ok
        np.testing.assert_array_equal(cmf.decode(skill_tensor_source(cmf, "b")[up]), -w)
        np.testing.assert_array_equal(cmf.decode(skill_tensor_source(cmf, "a")[up]), w.astype(np.float16))
        assert skill_tensor_source(cmf, "b")["model.embed_tokens.weight"] == "skill.b.model.embed_tokens.weight"


# ---------------------------------------------------------------- shards


@pytest.fixture
def sharded(tmp_path, rng):
    tensors = [(f"model.layers.{i}.w", rng.standard_normal((128, 256)).astype(np.float32), "f32") for i in range(5)]
    paths = write_cmf(
        tmp_path / "model.cmf", arch=ARCH, tensors=tensors, tokenizer_json=b"{}", tokenizer_config={"eos_token_ids": [0]},
        shard_max_mb=0.3,
    )  # fmt: skip
    return paths, tensors


def test_sharded_write_and_merge(sharded):
    paths, tensors = sharded
    assert [p.name for p in paths] == [f"model-{i:05d}-of-00003.cmf" for i in (1, 2, 3)]
    for path in paths:
        with open_cmf(path) as cmf:  # any shard name resolves to shard 1
            assert cmf.path == paths[0]
            assert list(cmf.tensors) == [t[0] for t in tensors]
            assert [t.shard_no for t in cmf.tensors.values()] == [1, 1, 2, 2, 3]
            for name, array, _ in tensors:
                np.testing.assert_array_equal(cmf.decode(name), array)
            assert cmf.vocab == b"{}" and cmf.tokenizer_config == {"eos_token_ids": [0]}
            for no in (1, 2, 3):
                assert cmf.header_of(no)["shard"] == {"no": no, "count": 3}
                assert (cmf.envelope_of(no).vocab_len > 0) == (no == 1)
                assert ("tokenizer_config" in cmf.header_of(no)) == (no == 1)
            assert verify_cmf(cmf).checked == 5 + 3 * 2 + 1  # tensors, header+dir per shard, vocab


def test_shard_errors(sharded, tmp_path):
    paths, _ = sharded
    lone = tmp_path / "renamed.cmf"
    shutil.copy(paths[1], lone)
    with pytest.raises(ShardError, match="shard 2 of 3"):
        open_cmf(lone)

    miscounted = tmp_path / "model-00001-of-00002.cmf"
    shutil.copy(paths[0], miscounted)
    with pytest.raises(ShardError):
        open_cmf(miscounted)

    # Give shard 3's only tensor the name of a shard-2 tensor (same length, so the layout holds).
    data = bytearray(paths[2].read_bytes())
    i = data.index(b"model.layers.4.w")
    data[i : i + 16] = b"model.layers.3.w"
    paths[2].write_bytes(bytes(data))
    with pytest.raises(ShardError, match="model.layers.3.w"):
        open_cmf(paths[0])

    paths[2].unlink()
    with pytest.raises(ShardError, match="missing"):
        open_cmf(paths[0])


def test_skills_on_a_sharded_model_go_to_shard_one(sharded, rng):
    paths, tensors = sharded
    w = rng.standard_normal((128, 256)).astype(np.float32)
    add_skill(paths[2], {"id": "s"}, [RawTensor("model.layers.4.w", 0, (128, 256), w.tobytes())])
    with open_cmf(paths[0]) as cmf:
        assert cmf.tensors["skill.s.model.layers.4.w"].shard_no == 1
        np.testing.assert_array_equal(cmf.decode(skill_tensor_source(cmf, "s")["model.layers.4.w"]), w)
        assert verify_cmf(cmf).ok


def test_signing_a_sharded_model_signs_every_file(sharded, tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    from pipeline.ground.cmf import sign_cmf

    paths, _ = sharded
    key = tmp_path / "key.raw"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))
    sigs = sign_cmf(paths[1], key)
    assert [s.name for s in sigs] == [p.name + ".sig" for p in paths]
    report = verify_cmf(paths[0])
    assert report.ok and report.signatures == [p.name for p in paths]

    data = bytearray(paths[2].read_bytes())
    data[-1] ^= 0xFF  # inside shard 3's last payload: its tensor hash and its signature both fail
    paths[2].write_bytes(bytes(data))
    failures = verify_cmf(paths[0]).failures
    assert [(f.what, f.file) for f in failures] == [("tensor", paths[2].name), ("signature", paths[2].name)]
