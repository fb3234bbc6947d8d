"""Packages are self-contained and speak text: they carry the bundle's tokenizer, bound to its
identity; `generate`, `logits`, `ppl` and `score` run on a package folder with text alone.

Greedy generation on a package is checked against an independent reference: the PyTorch FP32
model's argmax after one full forward of the whole sequence per token (no cache, no shared
decode loop).
"""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HfTokenizer

from conftest import FIXTURE_CMF
from pipeline.stages.artifacts import verify_chain
from manifests.identity import file_identity, load_manifest, read_json, write_json
from pipeline.stages.gates.exactness import Tolerance
from pipeline.stages.backends import open_backend
from pipeline.cli import build_parser, main
from pipeline.ground.errors import IdentityError
from pipeline.ground.generation import Sampling, generate
from pipeline.ground.tokenizer import tokenizer_from_artifact

PROMPT = "I was sent to a middle school in the country."
TOKENS = 48  # the fixture's context is 128; the prompt is 15 tokens with BOS


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def prompt():
    return tokenizer_from_artifact(FIXTURE_CMF).encode(PROMPT, add_bos=True)


@pytest.fixture(scope="module")
def reference(prompt):
    """Greedy tokens of the torch FP32 reference, each step's logits from one full forward,
    and each step's (top-1 logit, top-2 logit)."""
    torch_backend = open_backend(FIXTURE_CMF, "torch")
    ids, tops = list(prompt), []
    for _ in range(TOKENS):
        last = torch_backend.logits(np.array(ids))[-1]
        second, first = np.sort(last)[-2:]
        tops.append((first, second))
        ids.append(int(np.argmax(last)))
    return ids[len(prompt):], tops


def _fp32_bound(fp16_cache: bool = False) -> float:
    """Two float32 evaluations of the fixture over 128 positions differ by at most this
    (worst case, pipeline/ground/models/numerics.py); one side's fp16 K/V adds its rounding."""
    from pipeline.ground.models.numerics import model_logits_bound
    from pipeline.ground.reference import load_reference

    return model_logits_bound(load_reference(FIXTURE_CMF)[0], 128, fp16_cache=fp16_cache)


def _gate_bound(package_dir: Path) -> Tolerance:
    """What the package promises against the FP32 reference, |Δ logit| <= atol + rtol |logit|:
    FP32's summation-order bound; a stateful package also rounds its K/V to fp16."""
    stateful = load_manifest(package_dir)["package"]["kind"] == "stateful"
    return Tolerance(_fp32_bound(stateful), 0.0, None, None, "derived worst case")


def _check_greedy(got: list[int], reference, tol: Tolerance) -> int:
    """Every token equals the reference's until the first that differs; a difference is
    allowed only where the reference's top-2 margin lies within the gate's bound on both
    logits (a tie the gate cannot resolve). Returns how many tokens agreed."""
    want, tops = reference
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        if g != w:
            first, second = tops[step]
            bound = 2 * tol.atol + tol.rtol * (abs(first) + abs(second))
            assert first - second <= bound, f"token {step}: {g} != {w} with a top-2 margin {first - second} > {bound}"
            return step
    return len(got)


@pytest.mark.parametrize("kind", ["chunk_kv", "stateful", "stateless"])
def test_greedy_generation_on_each_package_kind_follows_the_torch_reference(
        kind, fixture_packages, fixture_stateful, prompt, reference):
    package_dir = fixture_stateful if kind == "stateful" else fixture_packages / kind
    got = list(generate(open_backend(package_dir), prompt, max_tokens=TOKENS))
    agreed = _check_greedy(got, reference, _gate_bound(package_dir))
    print(f"{kind}: {agreed}/{TOKENS} greedy tokens equal to the reference")


def test_generate_cli_streams_the_package_tokens_as_text(fixture_packages, prompt, capsys):
    package_dir = fixture_packages / "chunk_kv"
    code, out, err = _run(capsys, "generate", package_dir, "--prompt", PROMPT, "--bos", "--max-tokens", TOKENS)
    assert code == 0, err
    tokens = list(generate(open_backend(package_dir), prompt, max_tokens=TOKENS))
    assert out == HfTokenizer.from_file(str(package_dir / "tokenizer.json")).decode(tokens) + "\n"
    assert "coreml-executor" in err and f"prefill: {prompt.size} tokens" in err and f"decode: {TOKENS} tokens" in err


def test_seeded_sampling_on_a_package_repeats_and_stays_in_the_nucleus(fixture_packages, prompt):
    backend = open_backend(fixture_packages / "chunk_kv")
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=7)
    first = list(generate(backend, prompt, max_tokens=8, sampling=sampling))
    assert first == list(generate(backend, prompt, max_tokens=8, sampling=sampling))
    assert first != list(generate(backend, prompt, max_tokens=8, sampling=Sampling(0.8, 0.9, seed=8)))


def test_generate_refuses_a_request_past_the_context(fixture_packages, capsys):
    package_dir = fixture_packages / "chunk_kv"
    code, _, err = _run(capsys, "generate", package_dir, "--prompt", PROMPT, "--max-tokens", 500)
    assert code == 1
    assert err.splitlines()[-1] == (f"GenerateError: {package_dir}: 14 prompt tokens + 500 new tokens exceed "
                                    "the context of 128")


def test_mlx_generate_and_generate_take_the_same_generation_flags():
    def flags(*path):
        parser = build_parser(path[0])
        for word in path:
            parser = next(a for a in parser._actions if a.dest in ("command", "mlx_command")).choices[word]
        return {s for a in parser._actions for s in a.option_strings}

    shared = {"--prompt", "--chat", "--bos", "--max-tokens", "--temperature", "--top-p", "--seed", "--task", "--skill"}
    assert shared <= flags("generate") and shared <= flags("mlx", "generate")
    assert flags("generate") - flags("mlx", "generate") == {"--backend"}


# --- the tokenizer inside every package ----------------------------------------------------------


def test_every_package_carries_the_bundles_tokenizer_bound_to_its_identity(fixture_bundle, fixture_packages,
                                                                            fixture_stateful):
    bundle = load_manifest(fixture_bundle)
    for package_dir in (fixture_packages / "stateless", fixture_packages / "chunk_kv", fixture_stateful):
        manifest = load_manifest(package_dir)
        assert manifest["tokenizer"] == bundle["tokenizer"]
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (package_dir / name).read_bytes() == (fixture_bundle / name).read_bytes()
            assert manifest["files"][name] == bundle["files"][name]
        tokenizer = tokenizer_from_artifact(package_dir)
        assert tokenizer.encode(PROMPT).tolist() == tokenizer_from_artifact(FIXTURE_CMF).encode(PROMPT).tolist()


def test_a_package_with_another_tokenizer_does_not_verify(fixture_packages, tmp_path):
    copy = tmp_path / "chunk_kv"
    shutil.copytree(fixture_packages / "chunk_kv", copy)
    # Consistent inside the package (file, inventory and record agree), but not the bundle's.
    vocab = copy / "tokenizer.json"
    vocab.write_bytes(vocab.read_bytes().replace(b'"<unk>"', b'"<UNK>"', 1))
    manifest = read_json(copy / "manifest.json")
    manifest["files"]["tokenizer.json"] = file_identity(vocab)
    manifest["tokenizer"].update(file_identity(vocab))
    manifest["source"]["relative_path"] = Path(os.path.relpath(fixture_packages.parent / "bundle", copy)).as_posix()
    write_json(copy / "manifest.json", manifest)
    with pytest.raises(IdentityError, match=r"tokenizer\.sha256.*its source .*bundle records tokenizer sha256"):
        verify_chain(copy)


def test_logits_ppl_and_score_run_on_a_package_with_text_alone(fixture_packages, tmp_path, capsys):
    package_dir = fixture_packages / "chunk_kv"
    text = tmp_path / "t.txt"
    text.write_text(PROMPT)
    code, out, err = _run(capsys, "logits", package_dir, "--text", text, "-o", tmp_path / "x.npz")
    assert code == 0, err
    want_ids = tokenizer_from_artifact(FIXTURE_CMF).encode(PROMPT, add_bos=True)
    with np.load(tmp_path / "x.npz", allow_pickle=False) as npz:
        assert npz["ids"].tolist() == want_ids.tolist()
        # FP32 package against FP32 reference: only summation order differs.
        assert np.abs(npz["logits"] - open_backend(FIXTURE_CMF).logits(want_ids)).max() <= _fp32_bound()

    nll = {}
    for artifact in (package_dir, FIXTURE_CMF):
        code, out, err = _run(capsys, "ppl", artifact, "--text", text)
        assert code == 0, err
        nll[artifact] = float(out.split("mean NLL ")[1].split()[0])
    # log-softmax moves by at most 2 max|Δ logit|, so each token's NLL does too.
    assert abs(nll[package_dir] - nll[FIXTURE_CMF]) <= 2 * _fp32_bound() + 1e-6  # 1e-6: the printed digits

    items = tmp_path / "items.jsonl"
    items.write_text('{"id": "a", "context": "I was sent to a middle", "candidates": [" school", " cat"], "gold": 0}\n')
    code, out, err = _run(capsys, "score", package_dir, items)
    assert code == 0, err
    assert out.startswith(f"{package_dir}: 1 items, top-1 accuracy")
