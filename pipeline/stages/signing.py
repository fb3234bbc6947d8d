"""Detached Ed25519 signatures over an artifact's manifest.

An artifact's manifest lists every file with its sha256 (a release's also binds every
package, gate and the survey by digest), so one signature over `manifest.json` is one
signed statement covering every byte of the folder: the sigstore model-signing idea.
The signature is the CMF's detached-signature JSON (spec §8.2: `alg`, `pubkey`, `sha256`,
`sig`), written and checked by the CMF sign machinery, in `manifest.json.sig` beside the
manifest (the one file an inventory leaves out besides the manifest itself).
"""

from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from manifests.identity import MANIFEST_NAME, SIGNATURE_NAME
from pipeline.ground.cmf.errors import SignatureError
from pipeline.ground.cmf.verify import load_signing_key, signature_problem, write_signature


def sign_manifest(folder: str | Path, key_path: str | Path) -> Path:
    """Write `folder/manifest.json.sig`, signed with the private key at `key_path`."""
    sig_path = Path(folder) / SIGNATURE_NAME
    write_signature(Path(folder) / MANIFEST_NAME, load_signing_key(key_path), sig_path)
    return sig_path


def public_key_bytes(pubkey: str) -> bytes:
    """The 32 raw bytes of `pubkey`: hex, or a file holding a PEM public key or hex."""
    text = pubkey
    if Path(pubkey).is_file():
        data = Path(pubkey).read_bytes()
        if data.lstrip().startswith(b"-----BEGIN"):
            try:
                key = serialization.load_pem_public_key(data)
            except ValueError as error:
                raise SignatureError(f"{pubkey}: not a PEM public key: {error}") from None
            if not isinstance(key, Ed25519PublicKey):
                raise SignatureError(f"{pubkey}: PEM key is {type(key).__name__}, not Ed25519")
            return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        text = data.decode("ascii", "replace").strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise SignatureError(f"--pubkey {pubkey!r}: not 64 hex digits (a raw Ed25519 public key) or a PEM key file")
    return raw


def check_manifest_signature(folder: str | Path, pubkey: bytes) -> Path:
    """The artifact at `folder` carries a valid signature by `pubkey` over its manifest;
    SignatureError when it is unsigned, signed by another key, or the signature is bad."""
    sig_path = Path(folder) / SIGNATURE_NAME
    if not sig_path.is_file():
        raise SignatureError(f"{sig_path}: missing; the artifact is unsigned, but a public key was given")
    problem = signature_problem(Path(folder) / MANIFEST_NAME, sig_path, pubkey)
    if problem is not None:
        stored, actual = problem
        raise SignatureError(f"{sig_path}: stored {stored}, actual {actual}")
    return sig_path
