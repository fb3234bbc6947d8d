"""A fixture-sized model whose residual stream passes fp16's 65504 on one known token.

The default fixture (botchan-llama-1m: 4 layers, hidden 128, tied head) with weights set so
that one channel carries a massive activation on the "." token alone, as real models carry
them on BOS or the first delimiter (Sun et al. 2024):

- channel HAZARD_CHANNEL of the embedding is 0 for every token but "." (HAZARD_EMBEDDING
  there), and no o_proj or down_proj row writes it, so on every other token it stays
  exactly 0 through the whole stack;
- FFN neuron HAZARD_NEURON of layer HAZARD_LAYER reads only that channel (gate and up rows
  e_c) and only it writes the channel back (down_proj[c, j] = HAZARD_DOWN). On "." the
  channel dominates its row, so after the post-attention norm (gain 1 there) it is about
  sqrt(128) = 11.3: the neuron gives silu(11.3) * 11.3 ~ 128, and the write is about
  128 * 800 = 102,400 (at least 80,000 while the channel holds 90% of the row's energy);
- everywhere else the neuron gives silu(0) * 0 = 0.

So the FP32 residual peaks above 65504 from layer HAZARD_LAYER on, on "." only; in naive
fp16 that FFN's output is inf there (the first inf or NaN of the forward), while every
weight and every other op output stays far inside fp16's range. `intermediate_gain`
scales the neuron's up row: the MLP intermediate then grows with it, which no mitigation
here rescales (a model to refuse).
"""

from pathlib import Path

import numpy as np

from pipeline.ground.cmf import open_cmf, write_cmf
from pipeline.ground.reference import cmf_tensors
from pipeline.ground.tokenizer import tokenizer_from_artifact
from pipeline.stages.bundle import export_bundle

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_CMF = ROOT / "fixtures" / "botchan-llama-1m.cmf"
HAZARD_LAYER = 1
HAZARD_CHANNEL = 7
HAZARD_NEURON = 0
HAZARD_EMBEDDING = 30.0
HAZARD_DOWN = 800.0
HAZARD_TEXT = "."


def hazard_token() -> int:
    """The id of "." as it stands after a word in the fixture's tokenizer."""
    return int(tokenizer_from_artifact(FIXTURE_CMF).encode("a" + HAZARD_TEXT)[-1])


def hazard_weights(intermediate_gain: float = 1.0) -> dict[str, np.ndarray]:
    with open_cmf(FIXTURE_CMF) as cmf:
        weights = {name: np.array(tensor, dtype=np.float32) for name, tensor in cmf_tensors(cmf).items()}
        layers = cmf.arch["num_layers"]
    c, j, token = HAZARD_CHANNEL, HAZARD_NEURON, hazard_token()
    embed = weights["model.embed_tokens.weight"]
    embed[:, c] = 0.0
    embed[token, c] = HAZARD_EMBEDDING
    for i in range(layers):
        weights[f"model.layers.{i}.self_attn.o_proj.weight"][c, :] = 0.0
        weights[f"model.layers.{i}.mlp.down_proj.weight"][c, :] = 0.0
    prefix = f"model.layers.{HAZARD_LAYER}"
    for name, value in (("gate_proj", 1.0), ("up_proj", intermediate_gain)):
        row = weights[f"{prefix}.mlp.{name}.weight"][j]
        row[:] = 0.0
        row[c] = value
    weights[f"{prefix}.mlp.down_proj.weight"][:, j] = 0.0
    weights[f"{prefix}.mlp.down_proj.weight"][c, j] = HAZARD_DOWN
    weights[f"{prefix}.post_attention_layernorm.weight"][c] = 1.0
    return weights


def make_hazard_cmf(path: Path, intermediate_gain: float = 1.0) -> Path:
    with open_cmf(FIXTURE_CMF) as cmf:
        arch, vocab, config = cmf.arch, cmf.vocab, cmf.tokenizer_config
    write_cmf(path, arch=arch, tensors=[(n, w, "f32") for n, w in hazard_weights(intermediate_gain).items()],
              tokenizer_json=vocab, tokenizer_config=config,
              provenance={"script": "tests/_fp16_hazard.py", "from": FIXTURE_CMF.name,
                          "hazard": {"layer": HAZARD_LAYER, "channel": HAZARD_CHANNEL, "token_text": HAZARD_TEXT}})
    return path


def make_hazard_bundle(root: Path, intermediate_gain: float = 1.0) -> Path:
    """The hazard CMF under `root` and its FP32 bundle; the bundle dir."""
    root.mkdir(parents=True, exist_ok=True)
    cmf = make_hazard_cmf(root / "hazard.cmf", intermediate_gain)
    export_bundle(cmf, root / "bundle")
    return root / "bundle"
