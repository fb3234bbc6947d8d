"""`cmfdeploy logits` / `cmfdeploy ppl` and the backend dispatch, against transformers.

The artifact is a CMF written from a random-weight HF Qwen3 with the fixture tokenizer;
expected logits and NLLs come from the HF model itself and the `tokenizers` library.
"""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from _hf_models import load_saved, save_hf_model
from pipeline.ground.models.numerics import model_logits_bound
from pipeline.ground.torch_backend import TorchBackend
from pipeline.stages.backends import BackendError, open_backend
from pipeline.stages.bundle import export_bundle
from pipeline.cli import main
from pipeline.ground.cmf import write_cmf
from pipeline.ground.models.hf_config import arch_from_hf_config
from pipeline.ground.reference import load_reference

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BOS = 1


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """(cmf path, HF model) sharing weights; the vocabulary is the fixture tokenizer's 1024."""
    root = tmp_path_factory.mktemp("eval")
    hf = save_hf_model("qwen3", root / "hf", seed=21, vocab_size=1024, tie_word_embeddings=False)
    config, weights = load_saved(root / "hf")
    arch, _ = arch_from_hf_config(config)
    path = root / "model.cmf"
    write_cmf(path, arch=arch, tensors=[(n, t.numpy(), "f32") for n, t in weights.items()],
              tokenizer_json=(FIXTURES / "tokenizer.json").read_bytes(),
              tokenizer_config={"bos_token_id": BOS, "eos_token_ids": [2], "pad_token_id": 3})
    return path, hf


@pytest.fixture(scope="module")
def bound(artifact):
    """Max |Δ logit| of two float32 evaluations of the artifact (pipeline/ground/models/numerics.py): ours and
    transformers', or ours at other lengths, over its whole context."""
    model, args, _ = load_reference(artifact[0])
    return model_logits_bound(model, args.max_position_embeddings)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.as_tensor(np.asarray(ids, dtype=np.int64))[None]).logits[0].numpy()


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_logits_from_ids_match_transformers_full_and_chunked(artifact, bound, tmp_path, capsys):
    path, hf = artifact
    ids = np.random.default_rng(0).integers(0, 1024, 40)
    np.save(tmp_path / "ids.npy", ids)
    expected = _hf_logits(hf, ids)
    for name, extra in (("full", []), ("chunked", ["--chunk", 7])):
        out = tmp_path / f"{name}.npz"
        code, _, err = _run(capsys, "logits", path, "--ids", tmp_path / "ids.npy", "-o", out, *extra)
        assert code == 0, err
        with np.load(out, allow_pickle=False) as npz:
            assert np.array_equal(npz["ids"], ids)
            assert npz["logits"].dtype == np.float32 and npz["logits"].shape == (40, 1024)
            assert np.abs(npz["logits"] - expected).max() <= bound


def test_logits_from_text_use_the_artifact_tokenizer_with_bos(artifact, bound, tmp_path, capsys):
    path, hf = artifact
    text = "I was sent to a middle school in the country."
    (tmp_path / "t.txt").write_text(text)
    code, _, err = _run(capsys, "logits", path, "--text", tmp_path / "t.txt", "-o", tmp_path / "t.npz")
    assert code == 0, err
    want = [BOS, *Tokenizer.from_file(str(FIXTURES / "tokenizer.json")).encode(text, add_special_tokens=False).ids]
    with np.load(tmp_path / "t.npz", allow_pickle=False) as npz:
        assert npz["ids"].tolist() == want
        assert np.abs(npz["logits"] - _hf_logits(hf, want)).max() <= bound


def test_an_existing_output_is_refused_without_force(artifact, tmp_path, capsys):
    path, _ = artifact
    np.save(tmp_path / "ids.npy", np.arange(5))
    (tmp_path / "out.npz").write_bytes(b"keep")
    code, _, err = _run(capsys, "logits", path, "--ids", tmp_path / "ids.npy", "-o", tmp_path / "out.npz")
    assert code == 1 and err.startswith("OutputExists:") and (tmp_path / "out.npz").read_bytes() == b"keep"


def test_out_of_vocabulary_ids_are_a_typed_error(artifact, tmp_path, capsys):
    path, _ = artifact
    np.save(tmp_path / "ids.npy", np.array([5, 1024]))
    code, _, err = _run(capsys, "logits", path, "--ids", tmp_path / "ids.npy", "-o", tmp_path / "o.npz")
    assert code == 1 and err.startswith("BackendError:") and "1024" in err


def test_ppl_matches_an_independent_window_computation(artifact, bound, tmp_path, capsys):
    path, hf = artifact
    lines = (FIXTURES / "botchan.txt").read_text().splitlines()[:12]
    text = "\n".join(lines)
    (tmp_path / "t.txt").write_text(text)
    code, out, err = _run(capsys, "ppl", path, "--text", tmp_path / "t.txt", "--window", 32)
    assert code == 0, err
    tokens, nll, ppl = re.search(r"(\d+) tokens .* mean NLL ([\d.]+) nats, perplexity ([\d.]+)", out).groups()

    ids = Tokenizer.from_file(str(FIXTURES / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    losses = []
    for start in range(0, len(ids), 31):  # BOS + 31 text tokens per window, each predicted once
        window = torch.tensor([BOS, *ids[start : start + 31]])
        with torch.no_grad():
            logits = hf(window[None]).logits[0, :-1]
        losses.append(torch.nn.functional.cross_entropy(logits.double(), window[1:], reduction="none"))
    losses = torch.cat(losses)
    assert int(tokens) == len(ids) == losses.numel()
    # Each NLL is a log_softmax entry: within 2 max|Δ logit| of transformers'; the printout
    # rounds the NLL to 6 decimals and the perplexity to 4 (1e-4 relative covers that).
    assert float(nll) == pytest.approx(losses.mean().item(), abs=2 * bound + 5e-7)
    assert float(ppl) == pytest.approx(np.exp(losses.mean().item()), rel=np.expm1(2 * bound) + 1e-4)


def test_torch_backend_prefill_and_extend_branch_like_one_forward(artifact, bound):
    path, _ = artifact
    backend = open_backend(path)
    assert isinstance(backend, TorchBackend) and backend.name == "torch-fp32"
    ids = np.random.default_rng(1).integers(0, 1024, 30)
    full = backend.logits(ids)
    prefix_logits, snapshot = backend.prefill(ids[:20])
    branch_a = backend.extend(snapshot, ids[20:])
    backend.extend(snapshot, ids[20:23][::-1].copy())  # another branch in between
    branch_b = backend.extend(snapshot, ids[20:])
    assert np.abs(prefix_logits - full[:20]).max() <= bound  # other lengths, other sums
    assert np.array_equal(branch_a, branch_b)  # the same call on the same snapshot: bitwise
    assert np.abs(branch_a - full[20:]).max() <= bound


def test_a_bundle_runs_on_torch_like_its_cmf(artifact, tmp_path):
    path, _ = artifact
    export_bundle(path, tmp_path / "bundle")
    ids = np.random.default_rng(2).integers(0, 1024, 24)
    assert np.array_equal(open_backend(tmp_path / "bundle").logits(ids), open_backend(path).logits(ids))


def test_dispatch_refuses_mismatched_backends(artifact, tmp_path):
    path, _ = artifact
    package = tmp_path / "pkg"
    (package / "model.mlpackage").mkdir(parents=True)
    with pytest.raises(BackendError, match="runs on coreml, not 'torch'"):
        open_backend(package, "torch")
    with pytest.raises(BackendError, match="needs a Core ML package folder"):
        open_backend(path, "coreml")
    with pytest.raises(BackendError, match="not one of"):
        open_backend(path, "tpu")
    with pytest.raises(BackendError, match="no such file"):
        open_backend(tmp_path / "missing.cmf")


def test_mlx_dispatch_reaches_the_mlx_runtime(artifact, bound):
    path, _ = artifact
    mlx = open_backend(path, "mlx")
    ids = np.random.default_rng(3).integers(0, 1024, 16)
    assert mlx.name == "mlx"
    assert np.abs(mlx.logits(ids) - open_backend(path).logits(ids)).max() <= bound  # the same f32 weights, other kernels
