"""The fp16 mitigation `key_bias = "rope_offset"` (pipeline.ground.models.fp16): k's bias moved
past RoPE, less itself, so every score of a query row loses the same constant q . b. On a small
qwen2 given Qwen2.5-0.5B's shape of bias (a few hundred in RoPE's lowest frequencies, where
its layer 0 forms q . k ~ 11,800): the FP32 function kept, one shot and chunked; the fp16
reference's logits closer to FP32's; the preflight choosing it for a model with key biases
only, and its q . k peak falling; old mitigation records unchanged."""

import pytest
import torch

from _hf_models import load_saved, save_hf_model
from pipeline.ground.models import KVCache, ModelArgs, build_model
from pipeline.ground.models.fp16 import (
    FP16_MAX,
    Fp16MitigationError,
    Fp16Mitigations,
    Fp16Unsafe,
    RopeKeyOffset,
    check_mitigated,
    choose_mitigations,
    fp16_reference,
    mitigated_model,
    preflight_findings,
)
from pipeline.ground.models.hf_config import arch_from_hf_config
from pipeline.ground.models.numerics import fp16_logits_bound, model_logits_bound

# Qwen2.5-0.5B's layer 0: k bias -145 and 135 on the last dims of each half of a head (the
# lowest-frequency RoPE pair), q bias 81; here on head_dim 16, the pair (7, 15).
K_BIAS, Q_BIAS = 140.0, 40.0


def _qwen2(tmp_path, seed: int, biased: bool):
    save_hf_model("qwen2", tmp_path, seed=seed)
    config, weights = load_saved(tmp_path)
    arch, moe = arch_from_hf_config(config)
    args = ModelArgs.from_header({"arch": arch, "moe": moe})
    if biased:
        low = [args.head_dim // 2 - 1, args.head_dim - 1]
        for i in range(args.num_layers):
            k = weights[f"model.layers.{i}.self_attn.k_proj.bias"].view(args.num_kv_heads, args.head_dim)
            q = weights[f"model.layers.{i}.self_attn.q_proj.bias"].view(args.num_attention_heads, args.head_dim)
            k[:, low] = torch.tensor([-K_BIAS, K_BIAS])
            q[:, low] = torch.tensor([-Q_BIAS, Q_BIAS])
    ids = torch.randint(0, args.vocab_size, (200,), generator=torch.Generator().manual_seed(seed))
    return build_model(args, weights), args, ids


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    return _qwen2(tmp_path_factory.mktemp("qwen2-key-bias"), seed=5, biased=True)


def test_the_record_is_unchanged_for_models_without_it():
    """Records written before the field existed are what a plain one writes, and read as plain."""
    plain = Fp16Mitigations(rmsnorm="max_scaled")
    assert "key_bias" not in plain.to_record()
    assert Fp16Mitigations.from_record(plain.to_record()) == plain
    moved = Fp16Mitigations(rmsnorm="max_scaled", key_bias="rope_offset")
    assert moved.to_record()["key_bias"] == "rope_offset"
    assert Fp16Mitigations.from_record(moved.to_record()) == moved
    with pytest.raises(Fp16MitigationError, match="key_bias 'after' is not one of"):
        Fp16Mitigations(key_bias="after")


def test_moving_the_key_bias_keeps_the_fp32_function(biased):
    """Softmax is unchanged by a constant added to a row, so only float32's rounding differs:
    the scores are summed without the large term q . b (summation order, within the derived
    bound of two float32 evaluations), and the offset (R - I) b rounds once more in float32."""
    model, args, ids = biased
    mitigated = mitigated_model(model, args, Fp16Mitigations(key_bias="rope_offset"))
    assert all(layer.self_attn.k_proj.bias is None and isinstance(layer.self_attn.key_offset, RopeKeyOffset)
               for layer in mitigated.model.layers)
    assert all(layer.self_attn.k_proj.bias is not None for layer in model.model.layers)  # the source keeps its own
    with torch.no_grad():
        want, got = model(ids), mitigated(ids)
        cache = KVCache.empty(args, len(ids))
        chunked = torch.cat([mitigated.forward_cached(part, cache) for part in ids.split(37)])
    delta = max(float((got - want).abs().max()), float((chunked - want).abs().max()))
    bound = model_logits_bound(model, len(ids))
    print(f"FP32 against FP32 with the key bias moved: max |Δ logit| {delta:.3g} <= {bound:.3g}")
    assert delta <= bound


def test_the_fp16_reference_with_the_bias_moved_is_closer_to_fp32(biased):
    """The scores' fp16 step is set by q . b (~11,000 here: a step of 8) and the cached keys'
    by b (140: 0.125); moved, neither is there. The offset stays float32 until it meets the
    keys, as a package's positional ops do."""
    model, args, ids = biased
    plain = fp16_reference(model)
    moved_model = mitigated_model(model, args, Fp16Mitigations(key_bias="rope_offset"))
    moved = fp16_reference(moved_model)
    offsets = [m for m in moved.modules() if isinstance(m, RopeKeyOffset)]
    assert offsets and all(b.dtype == torch.float32 for m in offsets for b in m.buffers())
    with torch.no_grad():
        want = model(ids)
        errors = {name: float((ref(ids) - want).abs().max()) for name, ref in (("plain", plain), ("moved", moved))}
    bound = fp16_logits_bound(moved_model, len(ids), against_fp32=True)
    print(f"fp16 against FP32, max |Δ logit|: {errors} (bound {bound:.3g})")
    assert errors["moved"] <= bound
    assert errors["moved"] < errors["plain"] / 4


def test_the_preflight_chooses_it_for_key_biases_and_the_scores_peak_falls(biased, tmp_path):
    model, args, ids = biased
    windows = {"text": ids.numpy()}
    findings = preflight_findings(model, args, windows)
    chosen = choose_mitigations(findings)
    assert findings["key_bias"] and chosen.key_bias == "rope_offset"
    mitigated = preflight_findings(mitigated_model(model, args, chosen), args, windows)
    check_mitigated(mitigated)
    before = max(row["attention_logits"]["value"] for row in findings["fp32"]["layers"])
    after = max(row["attention_logits"]["value"] for row in mitigated["fp32"]["layers"])
    print(f"q . k peak: {before:.0f} plain, {after:.0f} with the key bias moved")
    assert before > 2 * K_BIAS * Q_BIAS * 0.9 and after < before / 10
    # A model without key biases (llama) gets the plain form, and its record stays as before.
    save_hf_model("llama", tmp_path, seed=3)
    config, weights = load_saved(tmp_path)
    arch, moe = arch_from_hf_config(config)
    llama_args = ModelArgs.from_header({"arch": arch, "moe": moe})
    llama = build_model(llama_args, weights)
    llama_findings = preflight_findings(llama, llama_args, {"text": ids.numpy() % llama_args.vocab_size})
    assert not llama_findings["key_bias"] and choose_mitigations(llama_findings).key_bias == "plain"


def test_scores_over_the_limit_only_through_the_key_bias_are_not_refused(tmp_path):
    """Qwen2.5-Coder-1.5B's layer 0 forms q . k = 144,167 plain (over fp16's 65504 itself), 1,146
    with the key bias moved: the unmitigated peak says nothing of the mitigated scores, so the
    choice moves the bias and `check_mitigated` judges what is left. Without a key bias the
    same peak is refused by name, as before."""
    model, args, ids = _qwen2(tmp_path / "big", seed=6, biased=False)
    low = [args.head_dim // 2 - 1, args.head_dim - 1]
    for layer in model.model.layers:  # 10x the 0.5B's bias: q . b alone passes fp16's range
        layer.self_attn.k_proj.bias.data.view(args.num_kv_heads, args.head_dim)[:, low] = torch.tensor([-1400.0, 1400.0])
        layer.self_attn.q_proj.bias.data.view(args.num_attention_heads, args.head_dim)[:, low] = torch.tensor([-40.0, 40.0])
    windows = {"text": ids.numpy()}
    findings = preflight_findings(model, args, windows)
    before = max(row["attention_logits"]["value"] for row in findings["fp32"]["layers"])
    assert before > FP16_MAX
    chosen = choose_mitigations(findings)
    assert chosen.key_bias == "rope_offset"
    mitigated = preflight_findings(mitigated_model(model, args, chosen), args, windows)
    check_mitigated(mitigated)
    after = max(row["attention_logits"]["value"] for row in mitigated["fp32"]["layers"])
    print(f"q . k peak: {before:.0f} plain, {after:.0f} with the key bias moved")
    assert after < FP16_MAX / chosen.headroom
    with pytest.raises(Fp16Unsafe, match="layer 0: attention_logits peaks at"):
        choose_mitigations({**findings, "key_bias": False}, where="plain")


def test_the_mitigated_model_traces(biased):
    """The converter traces `CachedStep(mitigated_model(...))`: the offset reads the position
    input, so a trace at one position must hold at another."""
    from pipeline.ground.models.base import CachedStep

    model, args, ids = biased
    step = CachedStep(mitigated_model(model, args, Fp16Mitigations(key_bias="rope_offset")))
    cache = KVCache.empty(args, 64)
    chunk = ids[:8].reshape(1, -1)
    with torch.no_grad():
        traced = torch.jit.trace(step, (chunk, torch.tensor([0]), cache.keys, cache.values))
        for position in (0, 17, 56):
            want = step(chunk, torch.tensor([position]), cache.keys, cache.values)
            got = traced(chunk, torch.tensor([position]), cache.keys, cache.values)
            assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_preflight_manifest_schema_takes_the_record():
    """The 0.5B's first preflight with it was refused by its own manifest's schema."""
    import json

    import jsonschema

    from conftest import ROOT

    schema = json.loads((ROOT / "manifests" / "schemas" / "preflight.schema.json").read_text())
    mitigations = schema["properties"]["mitigations"]
    jsonschema.validate(Fp16Mitigations(rmsnorm="max_scaled", key_bias="rope_offset").to_record(), mitigations)
    jsonschema.validate(Fp16Mitigations().to_record(), mitigations)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**Fp16Mitigations().to_record(), "key_bias": "sideways"}, mitigations)
