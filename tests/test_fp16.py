"""fp16 numerics of the reference decoder: the op-boundary model torch's half kernels follow,
the mitigations keeping the FP32 function on every family, the fp16 reference, and the
failure mode (a massive activation past 65504) found, named and mitigated."""

import numpy as np
import pytest
import torch

from _fp16_hazard import HAZARD_LAYER, hazard_token, hazard_weights
from _hf_models import load_saved, save_hf_model
from pipeline.ground.models import KVCache, ModelArgs, build_model
from pipeline.ground.models.fp16 import (
    FP16_MAX,
    Fp16MitigationError,
    Fp16Mitigations,
    Fp16Unsafe,
    MaxScaledRMSNorm,
    check_mitigated,
    choose_mitigations,
    fp16_reference,
    mitigated_model,
    preflight_findings,
)
from pipeline.ground.models.hf_config import arch_from_hf_config
from pipeline.ground.models.numerics import (
    U16,
    _gain,
    fp16_cache_bound,
    fp16_logits_bound,
    gamma,
    logits_bound,
    model_logits_bound,
)
from pipeline.ground.torch_backend import TorchBackend

FIXTURE_CMF = "fixtures/botchan-llama-1m.cmf"


def _one_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    """got within one fp16 step of want (both fp16): a float32 result next to a rounding
    boundary may round either way when its summation order differs."""
    got, want = got.float(), want.float()
    step = torch.where(want == 0, torch.tensor(2.0**-24), want.abs() * 2 * U16)
    return bool(((got - want).abs() <= step).all())


def test_torch_half_ops_compute_in_float32_and_round_once():
    """The op-boundary model the fp16 reference rests on: each half op equals the float32 op
    on the same half inputs, rounded once to fp16 (up to one step where sums reorder). An
    fp16 accumulation instead would differ by many steps on a 2048-long dot."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 2048, generator=g).half(), torch.randn(2048, 64, generator=g).half()
    x = (3 * torch.randn(8, 512, generator=g)).half()
    cases = {
        "matmul": (a @ b, a.float() @ b.float()),
        "linear": (torch.nn.functional.linear(a, b.T), torch.nn.functional.linear(a.float(), b.float().T)),
        "softmax": (torch.softmax(x, -1), torch.softmax(x.float(), -1)),
        "mean": (x.mean(-1), x.float().mean(-1)),
        "silu": (torch.nn.functional.silu(x), torch.nn.functional.silu(x.float())),
        "gelu_tanh": (torch.nn.functional.gelu(x, approximate="tanh"),
                      torch.nn.functional.gelu(x.float(), approximate="tanh")),
        "rsqrt": (torch.rsqrt(x.abs() + 1), torch.rsqrt((x.abs() + 1).float())),
    }
    for name, (half, single) in cases.items():
        assert half.dtype == torch.float16, name
        assert _one_step(half, single.half()), name
    # A sum whose result passes 65504 is inf at the op's output, though every term is finite.
    assert torch.isinf(torch.full((4096,), 100.0, dtype=torch.float16).pow(2).sum())


def test_the_references_linear_and_matmul_of_halves_follow_the_same_model(monkeypatch):
    """The fp16 reference computes its linears and matmuls in float32 and rounds once
    (`models.base.half_linear`, `models.base.matmul`; ATen's Half GEMM is a scalar loop), as
    ATen's half ops do: each result is the exact (float64) one within a float32 sum's error
    over n terms, gamma_n * sum|x*w| (any order), plus one fp16 rounding, u16 * |result|. That
    holds across the blocks of rows a wide weight is widened in (shrunk here to 5 blocks)."""
    from pipeline.ground.models import base

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 5, 2048, generator=g).half(), (torch.randn(300, 2048, generator=g) / 8).half()
    bias = torch.randn(300, generator=g).half()
    monkeypatch.setattr(base, "HALF_BLOCK_BYTES", 64 * 4 * 2048)
    for b in (bias, None):  # a bias is one more term of the float32 sum
        b64 = None if b is None else b.double()
        exact = torch.nn.functional.linear(x.double(), w.double(), b64)
        magnitude = torch.nn.functional.linear(x.double().abs(), w.double().abs(), None if b is None else b64.abs())
        bound = gamma(2048 + 1, 2.0**-24) * magnitude + U16 * exact.abs() * (1 + 1e-6)
        candidates = {"half_linear": base.half_linear(x, w, b), "aten": torch.nn.functional.linear(x, w, b)}
        if b is None:
            candidates["matmul"] = base.matmul(x, w.T)
        for name, got in candidates.items():
            assert got.dtype == torch.float16 and got.shape == exact.shape, name
            assert bool(((got.double() - exact).abs() <= bound).all()), name
    assert base.matmul(x.float(), w.T.float()).dtype == torch.float32  # float32 operands: torch's own


# -- the mitigations record


def test_mitigations_record_round_trips_and_refuses_bad_records_by_name():
    chosen = Fp16Mitigations(residual_scale=0.125, rmsnorm="max_scaled", mask_value=-FP16_MAX)
    assert Fp16Mitigations.from_record(chosen.to_record()) == chosen
    assert Fp16Mitigations.none().is_none and not chosen.is_none
    with pytest.raises(Fp16MitigationError, match="unknown key 'clamp'"):
        Fp16Mitigations.from_record({**chosen.to_record(), "clamp": 1.0})
    with pytest.raises(Fp16MitigationError, match="residual_scale 0.48 is not a power of two"):
        Fp16Mitigations(residual_scale=0.48)
    with pytest.raises(Fp16MitigationError, match="rmsnorm 'layer_norm'"):
        Fp16Mitigations(rmsnorm="layer_norm")
    with pytest.raises(Fp16MitigationError, match="mask_value -100000.0 is not"):
        Fp16Mitigations(mask_value=-1e5)


# -- the FP32 function kept, every family

FAMILIES = {
    "llama-untied": ("llama", {}),
    "qwen3-tied-qk-norm": ("qwen3", {}),
    "gemma-tied-embed-scale": ("gemma", {}),
    "gemma3-sandwich-sliding": ("gemma3", {}),
    "qwen2-moe-shared-expert": ("qwen2_moe", {"norm_topk_prob": False}),
}
MITIGATIONS = {
    "residual": Fp16Mitigations(residual_scale=2.0**-5),
    "max_scaled": Fp16Mitigations(rmsnorm="max_scaled"),
    "finite_mask": Fp16Mitigations(mask_value=-FP16_MAX),
    "all": Fp16Mitigations(residual_scale=2.0**-3, rmsnorm="max_scaled", mask_value=-FP16_MAX),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    family, overrides = FAMILIES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    save_hf_model(family, directory, seed=3, **overrides)
    config, weights = load_saved(directory)
    arch, moe = arch_from_hf_config(config)
    args = ModelArgs.from_header({"arch": arch, "moe": moe})
    ids = torch.randint(0, args.vocab_size, (48,), generator=torch.Generator().manual_seed(2))
    return request.param, build_model(args, weights), args, ids


def _norms_on_path(model) -> int:
    return sum(1 for m in model.modules() if isinstance(m, MaxScaledRMSNorm))


def mitigation_bound(model, mitigated, tokens: int) -> float:
    """|Δ logit| between the FP32 model and its mitigated copy, both float32.

    A power-of-two residual scale is exact: every scaled weight and eps, every op on the
    scaled stream (sums, norms' mean, rsqrt of alpha**2 times a value) gives alpha times the
    same float32 number, and Gemma's fl(1 + w) * alpha is the gain the original computes,
    times alpha. The finite mask is exact (exp under -103.9 is 0 in float32, as exp(-inf)).
    So only the float32 sums may differ, in order (`model_logits_bound`), plus what the
    max-scaled norm adds: x / m, sqrt(eps) / m and its square round once each, three more
    roundings of at most u32 on each norm of the path (sqrt(eps) itself one more), counted
    as relative error on one side."""
    extra = 4 * _norms_on_path(mitigated)
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    rel = gamma(extra)
    return model_logits_bound(model, tokens) + logits_bound(0, model.args.hidden_size, _gain(model.model.norm),
                                                            head.weight.detach().numpy(), rel)


@pytest.mark.parametrize("name", sorted(MITIGATIONS))
def test_each_mitigation_keeps_the_fp32_function(family_model, name):
    family, model, args, ids = family_model
    before = {key: value.clone() for key, value in model.state_dict().items()}
    mitigated = mitigated_model(model, args, MITIGATIONS[name])
    with torch.no_grad():
        want, got = model(ids), mitigated(ids)
        cache = KVCache.empty(args, len(ids))
        chunked = torch.cat([mitigated.forward_cached(part, cache) for part in ids.split(20)])
    bound = mitigation_bound(model, mitigated, len(ids))
    delta = max(float((got - want).abs().max()), float((chunked - want).abs().max()))
    print(f"{family} {name}: max |Δ logit| {delta:.3g} <= {bound:.3g}")
    assert delta <= bound
    # The source model is left as it was, every weight and gain (the copy shares the weights it
    # does not scale, and binds new tensors to those it does).
    assert model.model.embed_tokens.weight is not mitigated.model.embed_tokens.weight
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())
    assert model.model.norm.offset == (args.norm_style == "gemma")


def test_residual_scale_scales_the_stream_and_leaves_the_embedding_scale(family_model):
    """What alpha moves: the residual stream is alpha times the original's at every layer."""
    family, model, args, ids = family_model
    alpha = 2.0**-5
    mitigated = mitigated_model(model, args, Fp16Mitigations(residual_scale=alpha))
    streams = {}
    for label, m in (("fp32", model), ("mitigated", mitigated)):
        seen = []
        handle = m.model.norm.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
        with torch.no_grad():
            m(ids)
        handle.remove()
        streams[label] = seen[0]
    # Scaling by a power of two is exact, so only the sums' order may differ (none: same kernels here).
    assert torch.allclose(streams["mitigated"], alpha * streams["fp32"], rtol=2 * gamma(args.num_layers * 8), atol=0)
    assert (mitigated.embed_scale() is None) == (model.embed_scale() is None)


def test_weights_already_scaled_take_only_the_eps_the_norm_form_and_the_mask(family_model):
    """A mitigated package's decoded weights carry alpha: rebuilt from them with
    `weights_scaled`, the model is the mitigated one (same weights, same constants), Gemma's
    too, whose moved gains the package stores as the plain gains they became."""
    family, model, args, ids = family_model
    mitigations = MITIGATIONS["all"]
    mitigated = mitigated_model(model, args, mitigations)
    scaled = mitigated_model(model, args, Fp16Mitigations(residual_scale=mitigations.residual_scale)).state_dict()
    again = mitigated_model(build_model(args, scaled), args, mitigations, weights_scaled=True)
    with torch.no_grad():
        assert torch.equal(again(ids), mitigated(ids))


def _op_kinds(model, args) -> set[str]:
    from pipeline.ground.models import CachedStep

    cache = KVCache.empty(args, 8)
    with torch.no_grad():
        traced = torch.jit.trace(CachedStep(model), (torch.zeros(1, 3, dtype=torch.int32),
                                                     torch.tensor([0], dtype=torch.int32), cache.keys, cache.values),
                                 check_trace=False)
    return {node.kind() for node in traced.inlined_graph.nodes() if node.kind().startswith("aten::")}


def test_weight_only_mitigations_add_no_op_kind_to_the_traced_graph(family_model):
    """Residual scale and finite mask change weights and constants only; the max-scaled norm
    adds exactly |x|, its max, the floor and the divisions (sqrt(eps) / m traces as a reciprocal)."""
    family, model, args, _ = family_model
    original = _op_kinds(model, args)
    weight_only = Fp16Mitigations(residual_scale=2.0**-3, mask_value=-FP16_MAX)
    assert _op_kinds(mitigated_model(model, args, weight_only), args) <= original
    scaled = _op_kinds(mitigated_model(model, args, Fp16Mitigations(rmsnorm="max_scaled")), args)
    assert scaled - original == {"aten::abs", "aten::amax", "aten::clamp_min", "aten::div", "aten::reciprocal"}


# -- the fp16 reference


@pytest.fixture(scope="module")
def fixture_model():
    from pipeline.ground.reference import load_reference

    model, args, _ = load_reference(FIXTURE_CMF)
    ids = torch.randint(0, args.vocab_size, (96,), generator=torch.Generator().manual_seed(5))
    return model, args, ids


def _output_dtypes(half, ids) -> tuple[set, torch.Tensor]:
    """The floating dtypes every module of the fp16 reference outputs, and its logits."""
    dtypes = set()

    def seen(module, inputs, output):
        for t in output if isinstance(output, tuple) else (output,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                dtypes.add(t.dtype)

    handles = [m.register_forward_hook(seen) for m in half.decoder.modules()]
    with torch.no_grad():
        logits = half(ids)
    for handle in handles:
        handle.remove()
    return dtypes, logits


def test_fp16_reference_rounds_every_op_output_to_fp16(fixture_model):
    model, args, ids = fixture_model
    half = fp16_reference(model)
    dtypes, logits = _output_dtypes(half, ids)
    assert dtypes == {torch.float16}
    assert logits.dtype == torch.float32
    assert all(b.dtype == torch.float32 for name, b in half.decoder.named_buffers() if name.endswith("inv_freq"))


def test_fp16_reference_of_every_family_is_fp16_throughout_and_near_fp32(family_model):
    """Gemma's float32 embedding scale, RoPE tables and the MoE router's float32 softmax
    each end at an op boundary: nothing downstream is float32."""
    family, model, args, ids = family_model
    safe = mitigated_model(model, args, MITIGATIONS["all"])
    dtypes, logits = _output_dtypes(fp16_reference(safe), ids)
    assert dtypes == {torch.float16}
    with torch.no_grad():
        want = model(ids)
    assert float((logits - want).abs().max()) <= fp16_logits_bound(safe, len(ids), against_fp32=True)


def test_fp16_reference_against_fp32_and_against_itself_chunked(fixture_model):
    """fp16 against FP32 within the derived fp16 bound (weights and op outputs rounded), and
    the backend's chunked and branched runs (other op boundaries: different T, a cache read
    back) against its one-shot run within the fp16-vs-fp16 bound; its caches are fp16 values."""
    model, args, ids = fixture_model
    backend = TorchBackend(fp16_reference(model), args, 128, cache_dtype=np.float16, numerics="fp16")
    chunked = TorchBackend(fp16_reference(model), args, 128, chunk=32, cache_dtype=np.float16, numerics="fp16")
    with torch.no_grad():
        want = model(ids).numpy()
    one_shot = backend.logits(ids.numpy())
    assert np.abs(one_shot - want).max() <= fp16_logits_bound(model, len(ids), against_fp32=True)
    bound = fp16_logits_bound(model, len(ids))
    assert np.abs(chunked.logits(ids.numpy()) - one_shot).max() <= bound
    prefix, snapshot = backend.prefill(ids[:60].numpy())
    after = backend.extend(snapshot, ids[60:].numpy())
    assert np.abs(np.concatenate([prefix, after]) - one_shot).max() <= bound
    (batched,) = backend.extend_batch([(snapshot, ids[60:].numpy())])  # forward_branches, vmapped in fp16
    assert np.abs(batched - one_shot[60:]).max() <= bound
    keys = snapshot.keys.numpy()
    assert np.array_equal(keys, keys.astype(np.float16).astype(np.float32))
    assert fp16_cache_bound(model, len(ids)) > 0


def test_fp16_bounds_grow_with_the_boundaries_a_mitigation_adds(fixture_model):
    from pipeline.ground.models.numerics import fp16_boundaries

    model, args, _ = fixture_model
    scaled = mitigated_model(model, args, Fp16Mitigations(rmsnorm="max_scaled"))
    # 2 norms a layer and the final one, 4 boundaries more each.
    assert fp16_boundaries(scaled) - fp16_boundaries(model) == 4 * (2 * args.num_layers + 1)
    assert fp16_logits_bound(scaled, 64, probable=True) > fp16_logits_bound(model, 64, probable=True)
    assert fp16_logits_bound(model, 64, probable=True) < fp16_logits_bound(model, 64)


# -- the failure mode: a massive activation past 65504 on one token


@pytest.fixture(scope="module")
def hazard():
    from pipeline.ground.cmf import open_cmf
    from pipeline.ground.tokenizer import tokenizer_from_artifact

    with open_cmf(FIXTURE_CMF) as cmf:
        args = ModelArgs.from_header(cmf.header)
    model = build_model(args, hazard_weights())
    tokenizer = tokenizer_from_artifact(FIXTURE_CMF)
    lines = open("fixtures/botchan.txt", encoding="utf-8").read().splitlines()[500:520]
    ids = np.concatenate([[tokenizer.bos_id], tokenizer.encode(" ".join(lines))])[:128].astype(np.int64)
    return model, args, ids


def test_naive_fp16_is_inf_on_the_hazard_token_and_the_preflight_names_the_layer(hazard):
    model, args, ids = hazard
    positions = np.flatnonzero(ids == hazard_token())
    assert len(positions) >= 2  # the hazard token occurs, past position 0
    findings = preflight_findings(model, args, {"text": ids})
    fp32 = findings["fp32"]["layers"]
    # FP32: under 65504 before the hazard layer, over it from there on, on the hazard token.
    assert all(row["residual"]["value"] < 100 for row in fp32[:HAZARD_LAYER])
    for row in fp32[HAZARD_LAYER:]:
        assert row["residual"]["value"] > FP16_MAX and row["residual"]["position"] in positions
    # fp16: the first inf is that layer's residual, at the hazard token's first position.
    first = findings["fp16"]["nonfinite"][0]
    assert (first["layer"], first["quantity"], first["position"]) == (HAZARD_LAYER, "residual", positions[0])
    # Up to the token before it naive fp16 is finite; with it, not (and, one shot, its NaN
    # K/V reach every query through probabilities @ V, where 0 * NaN is NaN).
    naive = fp16_reference(model)
    with torch.no_grad():
        assert torch.isfinite(naive(torch.as_tensor(ids[:positions[0]]))).all()
        assert not torch.isfinite(naive(torch.as_tensor(ids[:positions[0] + 1]))[-1]).any()
    with pytest.raises(Fp16Unsafe, match=f"layer {HAZARD_LAYER}: residual peaks at inf"):
        check_mitigated(findings, where="hazard")


def test_the_preflight_takes_the_logits_peaks_a_block_of_rows_at_a_time(hazard, monkeypatch):
    """The longest window's logits are 1 GB on a 262k vocabulary, so the preflight takes their
    peak a block of rows at a time. Every other finding is the same computation, so the same
    bits; the logits' peak is the same dot products in blocks of another shape, which BLAS
    may sum in another order: within the head's summation-order bound of the peak of the
    whole logits at once, 2·γ(hidden)·max|h|_2·max|head row|_2."""
    from pipeline.ground.models import fp16
    from pipeline.ground.models.numerics import gamma

    model, args, ids = hazard
    whole = preflight_findings(model, args, {"text": ids})
    monkeypatch.setattr(fp16, "LOGITS_BLOCK_BYTES", 5 * args.vocab_size * 4)  # 5 rows a block
    blocked = preflight_findings(model, args, {"text": ids})
    for side in ("fp32", "fp16"):
        assert blocked[side]["layers"] == whole[side]["layers"] and blocked[side]["nonfinite"] == whole[side]["nonfinite"]
        assert {k: v for k, v in blocked[side]["model"].items() if k != "logits"} == \
            {k: v for k, v in whole[side]["model"].items() if k != "logits"}
    with torch.no_grad():
        hidden = model.hidden(torch.as_tensor(ids))
        logits = model.logits_of(hidden)
        bound = 2 * gamma(args.hidden_size) * float(hidden.norm(dim=-1).max() * model.head.weight.norm(dim=-1).max())
    peak = blocked["fp32"]["model"]["logits"]
    assert abs(peak["value"] - float(logits.abs().max())) <= bound
    assert abs(float(logits[peak["position"]].abs().max()) - peak["value"]) <= bound


def test_the_mitigated_hazard_model_is_finite_and_close_to_fp32(hazard):
    model, args, ids = hazard
    findings = preflight_findings(model, args, {"text": ids})
    mitigations = choose_mitigations(findings)
    # 102,400 / 2**3 = 12,800 <= 65504 / 4; its square needs the max-scaled norm.
    assert mitigations == Fp16Mitigations(residual_scale=2.0**-3, rmsnorm="max_scaled")
    safe = mitigated_model(model, args, mitigations)
    again = preflight_findings(safe, args, {"text": ids})
    check_mitigated(again)
    assert again["fp16"]["nonfinite"] == []
    tokens = torch.as_tensor(ids)
    with torch.no_grad():
        want, got = model(tokens), fp16_reference(safe)(tokens)
    assert torch.isfinite(got).all()
    delta = float((got - want).abs().max())
    bound = fp16_logits_bound(safe, len(ids), against_fp32=True)
    print(f"hazard: mitigated fp16 against FP32 max |Δ logit| {delta:.3g} <= {bound:.3g}")
    assert delta <= bound
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_an_intermediate_no_mitigation_rescales_is_refused_by_name(hazard):
    model, args, ids = hazard
    wide = build_model(args, hazard_weights(intermediate_gain=400.0))
    findings = preflight_findings(wide, args, {"text": ids})
    assert findings["fp32"]["layers"][HAZARD_LAYER]["mlp_intermediate"]["value"] > FP16_MAX / 4
    with pytest.raises(Fp16Unsafe, match=f"hazard: layer {HAZARD_LAYER}: mlp_intermediate peaks at [0-9.e+]+, over"):
        choose_mitigations(findings, where="hazard")
