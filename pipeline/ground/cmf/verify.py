"""Integrity verification (spec §8.1) and detached Ed25519 signatures (spec §8.2).

`verify_cmf` walks the whole hash chain of every file of a model — envelope header
and directory hashes (0 = not recorded, skipped), the header's `section_hashes`,
every tensor hash — and reports every problem, not just the first. A `<file>.sig`
next to a file is checked whenever it exists.

Signing keys (`sign_cmf`): a PEM (PKCS#8, unencrypted) Ed25519 private key, or a file
of exactly 32 raw bytes holding the Ed25519 private seed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from manifests.identity import sha256_file
from manifests.output import staged_file
from pipeline.ground.cmf.errors import HashMismatch, SignatureError
from pipeline.ground.cmf.hash64 import hash64
from pipeline.ground.cmf.reader import HASHED_SECTIONS, CmfFile, open_cmf
from pipeline.ground.errors import OutputExists

SIG_ALG = "ed25519-sha256"


@dataclass(frozen=True)
class VerifyFailure:
    what: str  # "section", "tensor" or "signature"
    name: str  # section name (header, dir, masks, vocab, index), tensor name, or the .sig file
    stored: str
    actual: str
    file: str  # the file (shard) that holds the item

    def as_dict(self) -> dict:
        """The conformance-vector form `{what, name, stored, actual}`."""
        return {"what": self.what, "name": self.name, "stored": self.stored, "actual": self.actual}

    def __str__(self) -> str:
        return f"{self.file}: {self.what} '{self.name}': stored {self.stored}, actual {self.actual}"


@dataclass
class VerifyReport:
    path: Path
    failures: list[VerifyFailure] = field(default_factory=list)
    checked: int = 0  # number of hashes compared
    signatures: list[str] = field(default_factory=list)  # files whose .sig checked out

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_on_failure(self) -> None:
        """HashMismatch (or SignatureError when only signatures fail) listing every failure."""
        if self.ok:
            return
        kind = SignatureError if all(f.what == "signature" for f in self.failures) else HashMismatch
        raise kind(f"{self.path.name}: {len(self.failures)} integrity failure(s): " + "; ".join(map(str, self.failures)))


def verify_cmf(source: str | os.PathLike | CmfFile, pubkey: bytes | None = None) -> VerifyReport:
    """Check every hash of every file of the model; `pubkey` (32 raw bytes) pins the signer."""
    cmf = source if isinstance(source, CmfFile) else open_cmf(source)
    try:
        report = VerifyReport(cmf.path)
        for shard_no, path in enumerate(cmf.paths, start=1):
            _verify_file(cmf, shard_no, report)
            sig = signature_path(path)
            if sig.exists():
                _verify_signature(path, sig, pubkey, report)
        return report
    finally:
        if cmf is not source:
            cmf.close()


def _verify_file(cmf: CmfFile, shard_no: int, report: VerifyReport) -> None:
    env = cmf.envelope_of(shard_no)
    label = cmf.paths[shard_no - 1].name

    def check(what: str, name: str, stored: int, data) -> None:
        actual = hash64(data)
        report.checked += 1
        if actual != stored:
            report.failures.append(VerifyFailure(what, name, f"{stored:016x}", f"{actual:016x}", label))

    for name, stored in (("header", env.header_hash), ("dir", env.dir_hash)):
        if stored:
            check("section", name, stored, cmf.section_bytes(name, shard_no))
    # The reader validated these as hex strings at open.
    recorded = cmf.header_of(shard_no).get("section_hashes") or {}
    for name in HASHED_SECTIONS:
        if name in recorded:
            check("section", name, int(recorded[name], 16), cmf.section_bytes(name, shard_no))
    for info in cmf.tensors.values():
        if info.shard_no == shard_no:
            check("tensor", info.name, info.hash64, cmf.raw(info.name))


def signature_path(path: Path) -> Path:
    return path.with_name(path.name + ".sig")


def _verify_signature(path: Path, sig_path: Path, pubkey: bytes | None, report: VerifyReport) -> None:
    problem = signature_problem(path, sig_path, pubkey)
    if problem is None:
        report.signatures.append(path.name)
    else:
        report.failures.append(VerifyFailure("signature", sig_path.name, *problem, path.name))


def signature_problem(path: Path, sig_path: Path, pubkey: bytes | None) -> tuple[str, str] | None:
    """None when `sig_path` is a valid signature over `path`'s sha256 (by `pubkey`, when
    given); else (stored, actual): what the signature file says and what is wrong with it."""
    try:
        sig = json.loads(sig_path.read_text(encoding="utf-8"))
        alg, key_hex, sha_hex, sig_hex = (sig[k] for k in ("alg", "pubkey", "sha256", "sig"))
        key_bytes, signature = bytes.fromhex(key_hex), bytes.fromhex(sig_hex)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        return "unreadable", f"{type(error).__name__}: {error}"
    if alg != SIG_ALG:
        return str(alg), f"unsupported (only {SIG_ALG})"
    digest = bytes.fromhex(sha256_file(path))
    if sha_hex != digest.hex():
        return str(sha_hex), digest.hex()
    if pubkey is not None and key_bytes != pubkey:
        return key_hex, f"signed by an untrusted key (trusted {pubkey.hex()})"
    try:
        Ed25519PublicKey.from_public_bytes(key_bytes).verify(signature, digest)
    except (ValueError, InvalidSignature):
        return sig_hex, "invalid signature over the file's sha256"
    return None


def load_signing_key(key_path: str | os.PathLike) -> Ed25519PrivateKey:
    key_path = Path(key_path)
    try:
        data = key_path.read_bytes()
    except OSError as error:
        raise SignatureError(f"{key_path}: cannot read key: {error.strerror}") from None
    if data.lstrip().startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as error:
            raise SignatureError(f"{key_path}: not an unencrypted PEM private key: {error}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise SignatureError(f"{key_path}: PEM key is {type(key).__name__}, not Ed25519")
        return key
    if len(data) == 32:
        return Ed25519PrivateKey.from_private_bytes(data)
    raise SignatureError(f"{key_path}: {len(data)} bytes is neither a PEM key nor a 32-byte raw Ed25519 seed")


def sign_cmf(path: str | os.PathLike, key_path: str | os.PathLike, *, force: bool = False) -> list[Path]:
    """Write `<file>.sig` (spec §8.2) for every file of the model; returns the .sig paths."""
    key = load_signing_key(key_path)
    with open_cmf(path) as cmf:
        files = list(cmf.paths)
    sig_paths = [signature_path(f) for f in files]
    existing = [p.name for p in sig_paths if p.exists()]
    if existing and not force:
        raise OutputExists(f"{', '.join(existing)} already exist(s); pass force to replace")
    for file, sig_path in zip(files, sig_paths):
        write_signature(file, key, sig_path)
    return sig_paths


def write_signature(path: Path, key: Ed25519PrivateKey, sig_path: Path) -> None:
    """`sig_path` := the spec §8.2 signature JSON: Ed25519 by `key` over the sha256 of `path`."""
    pub = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    digest = bytes.fromhex(sha256_file(path))
    body = {"alg": SIG_ALG, "pubkey": pub.hex(), "sha256": digest.hex(), "sig": key.sign(digest).hex()}
    with staged_file(sig_path) as f:
        f.write((json.dumps(body, indent=1) + "\n").encode())
