"""`cmfdeploy inspect | verify | sign | dump`: output, exit codes, and one-line errors for bad input."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pipeline.cli import main
from pipeline.ground.cmf import open_cmf

VECTORS = Path("/work/shared/cmf-conformance")


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_json_summarises_the_file(capsys):
    code, out, _ = run(capsys, "inspect", VECTORS / "model_masks_tok_a.cmf", "--json")
    assert code == 0
    summary = json.loads(out)
    spec = json.loads((VECTORS / "model_masks_tok_a.json").read_text())
    assert summary["tensor_count"] == len(spec["tensors"])
    assert summary["arch"] == spec["arch"]
    by_dtype = {}
    for t in spec["tensors"]:
        row = by_dtype.setdefault(t["dtype"], [0, 0])
        row[0] += t["nbytes"]
        row[1] += int(np.prod(t["shape"]))
    for name, (nbytes, n) in by_dtype.items():
        assert summary["dtypes"][name]["bytes"] == nbytes
        assert summary["dtypes"][name]["bits_per_weight"] == pytest.approx(8 * nbytes / n, abs=1e-4)
    assert [m["name"] for m in summary["masks"]] == ["general", "coding", "sparse-random"]
    assert summary["masks"][1]["quality"] is None
    assert summary["sections"]["index"] == {"off": spec["envelope"]["index_off"], "len": spec["envelope"]["index_len"]}
    assert summary["required_features"] == ["TENSOR_DIR", "BINARY_MASKS"]


def test_inspect_text(capsys):
    code, out, _ = run(capsys, "inspect", VECTORS / "layout_align_masks_a.cmf")
    assert code == 0
    assert "arch_name=qwen2" in out and "LOOP_MASKS" in out and "q4_block" in out and "bits/weight" in out


def test_verify_exit_codes(capsys):
    code, out, _ = run(capsys, "verify", VECTORS / "model_q8_row_a.cmf")
    assert code == 0 and out.startswith("OK:")
    code, out, _ = run(capsys, "verify", VECTORS / "corrupt_payload_flip_a.cmf")
    assert code == 1
    assert out.splitlines() == [
        "HashMismatch: corrupt_payload_flip_a.cmf: tensor 'model.embed_tokens.weight': "
        "stored df690309e0e9edb5, actual a3bdf0a83e22d707"
    ]


@pytest.mark.parametrize("form", ["raw", "pem"])
def test_sign_then_verify_then_tamper(tmp_path, capsys, form):
    model = tmp_path / "m.cmf"
    shutil.copy(VECTORS / "model_f16_a.cmf", model)
    key = Ed25519PrivateKey.generate()
    key_file = tmp_path / "key"
    encoding, fmt = {
        "raw": (serialization.Encoding.Raw, serialization.PrivateFormat.Raw),
        "pem": (serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8),
    }[form]
    key_file.write_bytes(key.private_bytes(encoding, fmt, serialization.NoEncryption()))
    assert run(capsys, "sign", model, "--key", key_file)[0] == 0
    sig = json.loads((tmp_path / "m.cmf.sig").read_text())
    pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert sig["alg"] == "ed25519-sha256" and sig["pubkey"] == pub.hex()

    code, out, _ = run(capsys, "verify", model)
    assert code == 0 and "signatures ok: m.cmf" in out
    code, out, _ = run(capsys, "verify", model, "--pubkey", "00" * 32)
    assert code == 1 and out.startswith("SignatureError:")
    code, _, err = run(capsys, "sign", model, "--key", key_file)
    assert code == 1 and err.startswith("OutputExists:")

    # A flipped byte in the padding between directory and blob: no CMF hash covers it, the signature does.
    data = bytearray(model.read_bytes())
    with open_cmf(model) as cmf:
        pad = cmf.envelope.dir_off + cmf.envelope.dir_len
    data[pad] ^= 1
    model.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", model)
    assert code == 1 and out.count("\n") == 1 and "SignatureError" in out

    # A forged signature over the right digest.
    data[pad] ^= 1
    model.write_bytes(bytes(data))
    sig["sig"] = Ed25519PrivateKey.generate().sign(bytes.fromhex(sig["sha256"])).hex()
    (tmp_path / "m.cmf.sig").write_text(json.dumps(sig))
    code, out, _ = run(capsys, "verify", model)
    assert code == 1 and "invalid signature" in out


def test_dump_npz(tmp_path, capsys):
    out = tmp_path / "t.npz"
    code, _, _ = run(capsys, "dump", VECTORS / "model_vbit_a.cmf", "-o", out)
    assert code == 0
    with np.load(VECTORS / "model_vbit_a.expected.npz", allow_pickle=False) as want, np.load(out, allow_pickle=False) as got:
        assert sorted(got.files) == sorted(want.files)
        for key in want.files:
            np.testing.assert_array_equal(got[key].view(np.uint32), want[key].view(np.uint32))
    code, _, err = run(capsys, "dump", VECTORS / "model_vbit_a.cmf", "-o", out)
    assert code == 1 and err.startswith("OutputExists:")
    code, _, _ = run(capsys, "dump", VECTORS / "model_vbit_a.cmf", "-o", out, "--force", "--tensor", "model.norm.weight")
    with np.load(out, allow_pickle=False) as got:
        assert got.files == ["model.norm.weight"]


def test_dump_with_a_skill_keys_by_base_name(tmp_path, capsys):
    from pipeline.ground.cmf.skills import add_skill

    model = tmp_path / "m.cmf"
    shutil.copy(VECTORS / "model_f32_a.cmf", model)
    name = "model.layers.0.mlp.gate_proj.weight"
    with open_cmf(model) as cmf:
        shape = cmf.tensors[name].shape
    replacement = np.full(shape, 0.25, np.float32)
    add_skill(model, {"id": "k"}, [(name, replacement, "f32")])
    out = tmp_path / "s.npz"
    assert run(capsys, "dump", model, "-o", out, "--skill", "k")[0] == 0
    with np.load(out, allow_pickle=False) as got:
        assert not any(k.startswith("skill.") for k in got.files)
        np.testing.assert_array_equal(got[name], replacement)


@pytest.mark.parametrize(
    "argv, kind",
    [
        (["inspect", VECTORS / "corrupt_tiny_file.cmf"], "Bounds"),
        (["inspect", VECTORS / "corrupt_unknown_dtype_a.cmf"], "Parse"),
        (["verify", VECTORS / "corrupt_feature_bit7_a.cmf"], "UnsupportedFeature"),
        (["dump", VECTORS / "corrupt_bad_magic_a.cmf", "-o", "/nonexistent/x.npz"], "InvalidMagic"),
        (["inspect", "/nonexistent/model.cmf"], "Bounds"),
        (["dump", VECTORS / "model_f16_a.cmf", "-o", "/tmp/never.npz", "--tensor", "nope"], "Parse"),
        (["dump", VECTORS / "model_f16_a.cmf", "-o", "/tmp/never.npz", "--skill", "nope"], "SkillError"),
        (["sign", VECTORS / "model_f16_a.cmf", "--key", "/nonexistent/key"], "SignatureError"),
    ],
)
def test_bad_input_is_one_line(capsys, argv, kind):
    code, out, err = run(capsys, *argv)
    assert code == 1
    assert err.count("\n") == 1 and err.startswith(f"{kind}: ")
    assert "Traceback" not in err + out


def test_subprocess_has_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "verify", str(VECTORS / "corrupt_section_overflow.cmf")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("Bounds: corrupt_section_overflow.cmf: section 'masks'")
    assert "Traceback" not in proc.stderr


def test_dump_writes_the_decodable_tensors_and_names_the_reserved_ones(tmp_path, capsys):
    case = json.loads((VECTORS / "dtype_reserved_a.json").read_text())
    out = tmp_path / "r.npz"
    code, stdout, err = run(capsys, "dump", VECTORS / "dtype_reserved_a.cmf", "-o", out)
    assert code == 0, err
    decodable = [t for t in case["tensors"] if t["decodable"]]
    with np.load(VECTORS / "dtype_reserved_a.expected.npz", allow_pickle=False) as want, \
            np.load(out, allow_pickle=False) as got:
        assert sorted(got.files) == sorted(t["npz_key"] for t in decodable) == sorted(want.files)
        for key in want.files:
            np.testing.assert_array_equal(got[key].view(np.uint32), want[key].view(np.uint32))
    lines = stdout.splitlines()
    assert lines[0] == f"{out}: {len(decodable)} tensors"
    assert lines[1:] == [f"not decoded: {t['name']}: dtype {t['dtype_id']} ({t['dtype']}) is reserved and has no "
                         "defined decoding" for t in case["tensors"] if not t["decodable"]]
