"""Error bounds that follow from the arithmetic being compared, never from one CPU's bits.

Two float32 evaluations of one decoder (torch eager, the MIL executor, Core ML, another BLAS
or vector width) differ only in summation order, blocking and FMA contraction. A dot of
length K in any order errs by at most gamma_K * sum|a*b| (gamma_K = K u / (1 - K u),
u = 2^-24), and a logit's error, to first order, adds up along the longest chain of such
accumulations it goes through, taking each layer's gain on a relative error as one: every
RMSNorm rescales its input, softmax moves a probability by at most 2 p max|Δ score| and
SiLU's slope stays under 1.1, so a relative error in the hidden state stays relative; the
head's dot then gives |Δ logit_j| <= rel * sum_i |h_i E_ji|, and with
|h|_2 <= sqrt(D) * max|gamma| (unit RMS before the final norm's weight) Cauchy-Schwarz
bounds that scale by weights alone. Two evaluations are each within the bound of the
exact value, hence the factor 2.

Two strengths of the same analysis:
- worst case (`gamma`): every rounding at its extreme and of one sign. It holds on every
  machine without assumption; the tests use it. It grows as the chain length N, so on a
  30-layer model it is about as large as a logit's spread and would let bugs through.
- probable (`gamma_probable`): Higham & Mary's probabilistic rounding error analysis
  (SIAM J. Sci. Comput. 41(5), 2019, Theorem 2.4). Modelling the roundings as independent
  and mean-zero, a sum of N terms errs by at most exp(lam sqrt(N) u + N u^2/(1-u)) - 1
  times sum|terms| with probability at least 1 - 2 N exp(-lam^2 (1-u)^2 / 2). With
  lam = 10 that failure probability is below 2 N e^-49.99 < 5e-16 per value for N < 2^20,
  under 1e-8 over the ~10^7 values a gate compares. The gates (`pipeline.stages.gates`) and the
  converter's schedule checks use it: it grows as sqrt(N), and it is still fixed by the
  model's shapes and weights alone, never by a measured difference.
Typical differences sit two to three decades below either; a real bug (a wrong slot, mask,
rope, norm, LUT axis or block scale) is a logit error of order one.
"""

import math

import numpy as np

U32 = 2.0**-24  # float32 unit roundoff
PROBABLE_LAMBDA = 10.0
# Weight matrices on one logit's path per layer: q, k, v, o, gate, up, down.
MATRICES_PER_LAYER = 7


def gamma(n: int, u: float = U32) -> float:
    return n * u / (1 - n * u)


def gamma_probable(n: int, lam: float = PROBABLE_LAMBDA, u: float = U32) -> float:
    return math.expm1(lam * math.sqrt(n) * u + n * u**2 / (1 - u))


def decoder_chain(layers: int, hidden: int, q_width: int, head_dim: int, intermediate: int, tokens: int,
                  extra_per_layer: int = 0) -> int:
    """Inner lengths of every accumulation on one logit's longest path through a pre-norm decoder."""
    per_layer = (hidden  # input RMSNorm's mean of squares
                 + hidden  # q/k/v projections
                 + head_dim  # q . k
                 + 2 * tokens  # softmax's sum, probabilities @ V
                 + q_width  # o_proj
                 + hidden  # post-attention RMSNorm
                 + hidden  # gate / up
                 + intermediate  # down
                 + extra_per_layer)
    return layers * per_layer + 2 * hidden  # final norm, head


def logits_bound(chain: int, hidden: int, final_norm: np.ndarray, head: np.ndarray, rel: float = 0.0,
                 probable: bool = False, head_norm: float | None = None) -> float:
    """Max |Δ logit| between two float32 evaluations whose accumulations total `chain`, one side
    carrying `rel` more relative error (rounded weights or caches). `head_norm`: a bound on
    the absolute terms of a head row's dot per |h|_2 larger than the row's own norm (a head
    summed from parts)."""
    norm = float(np.linalg.norm(head, axis=1).max())
    scale = np.sqrt(hidden) * np.abs(final_norm).max() * max(norm, head_norm or 0.0)
    return (2 * (gamma_probable(chain) if probable else gamma(chain)) + rel) * float(scale)


def _chain(model, tokens: int) -> int:
    """`decoder_chain` of a pipeline.ground.models Decoder attending over at most `tokens` positions.
    Per layer it also counts q/k norms (head_dim); for MoE, the router (hidden), its softmax
    (experts) and the weighted sum of top-k and shared experts; and a sandwich-norm layer's
    (Gemma 2/3) two norms past the pre-norm pair: with pre_feedforward_layernorm present,
    post_attention_layernorm norms the attention output (decoder_chain's "post-attention
    RMSNorm" term is then the pre-FFN norm), and post_feedforward_layernorm norms the FFN
    output, each one more mean of squares over hidden on the path; both rescale, so the gain
    on a relative error stays one. Sliding layers attend over fewer than `tokens` positions,
    which `tokens` bounds. A bias is one more term in the sum that ends its projection (Qwen2's
    q/k/v biases: one more on the q . k path), and a biased head one more at the end."""
    a = model.args
    ffn, extra = a.intermediate_size, a.head_dim
    extra += max(a.hidden_size * ((layer.pre_feedforward_layernorm is not None)
                                  + (layer.post_feedforward_layernorm is not None)) + _bias_terms(layer)
                 for layer in model.model.layers)
    if a.moe is not None:
        ffn = max(ffn, a.moe.moe_intermediate_size, a.moe.shared_expert_intermediate_size or 0)
        extra += a.hidden_size + a.moe.num_experts + a.moe.top_k + 1
    head_bias = model.head.bias is not None
    return decoder_chain(a.num_layers, a.hidden_size, a.num_attention_heads * a.head_dim, a.head_dim, ffn, tokens,
                         extra) + head_bias


def _bias_terms(layer) -> int:
    """The steps of one layer's path that end in a bias add: q/k/v (side by side, one step), o,
    gate/up, down (in any of an MoE block's experts)."""
    attn, mlp = layer.self_attn, layer.mlp
    mlps = [m for m in (*getattr(mlp, "experts", ()), getattr(mlp, "shared_expert", None)) if m is not None] or [mlp]
    steps = ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,),
             [p for m in mlps for p in (m.gate_proj, m.up_proj)], [m.down_proj for m in mlps])
    return sum(any(p.bias is not None for p in step) for step in steps)


def _weight(module) -> np.ndarray:
    # An fp16 reference's weights are widened (their squares would overflow in float16); a float32
    # model's are read in place (Gemma 3's head is 670 MB).
    weight = module.weight.detach()
    return (weight.float() if weight.element_size() < 4 else weight).numpy()


def _gain(norm) -> np.ndarray:
    weight = _weight(norm)
    return weight + 1.0 if norm.offset else weight


def model_logits_bound(model, tokens: int, fp16_cache: bool = False, weight_rtol: float = 0.0,
                       probable: bool = False, hot_rows_head_norm: float | None = None) -> float:
    """`logits_bound` for a pipeline.ground.models Decoder attending over at most `tokens` positions.

    fp16_cache: one side reads its K/V back from fp16, each value within 2^-11 relative, so
    each layer's q . k and probabilities @ V gain 2^-11 of their sum|a*b|. weight_rtol: one
    side's weights differ from the other's by that much relative (every matrix on the path,
    and the head). hot_rows_head_norm: one side's head is a table's code T plus its hot rows'
    residual R (`coreml.recipes.emit.emit_hot_rows`), logit j = h.T_j + h.R_j where the other
    side takes h.fl(T_j + R_j): a sum of 2·hidden terms and one add on the one side, the table's
    sum rounded once per element (u |h| |T_j + R_j|) on the other, whose absolute terms total at
    most |h|_2 (|T_j|_2 + |R_j|_2), the norm given (`coreml.decoded.hot_rows_head_norm`). The
    chain counts that longer head and the two roundings, and the scale takes the larger norm,
    on both sides."""
    a = model.args
    rel = weight_rtol * (MATRICES_PER_LAYER * a.num_layers + 1)
    if fp16_cache:
        rel += 2 * a.num_layers * 2.0**-11
    chain = _chain(model, tokens) + (a.hidden_size + 2 if hot_rows_head_norm is not None else 0)
    return logits_bound(chain, a.hidden_size, _gain(model.model.norm), _weight(model.head), rel, probable,
                        hot_rows_head_norm)


def model_cache_bound(model, tokens: int, probable: bool = False) -> float:
    """Max |Δ| of one K or V cache entry between two float32 evaluations. An entry of layer l
    is a projection of that layer's normed input, whose relative error is at most the chain
    up to it (bounded by the whole chain), times `_cache_scale`."""
    return 2 * (gamma_probable(_chain(model, tokens)) if probable else gamma(_chain(model, tokens))) * _cache_scale(model)


def _cache_scale(model) -> float:
    """The largest K or V entry: a projection's magnitude is at most |row of W|_2 * |x|_2
    with |x|_2 <= sqrt(D) max|gamma| (Cauchy-Schwarz), or sqrt(head_dim) max|k_norm| where a
    k norm follows. RoPE rotates pairs: norms kept."""
    a, scale = model.args, 0.0
    for layer in model.model.layers:
        attn = layer.self_attn
        x = math.sqrt(a.hidden_size) * float(np.abs(_gain(layer.input_layernorm)).max())
        rows = {name: float(np.linalg.norm(_weight(getattr(attn, name)), axis=1).max()) * x
                for name in ("k_proj", "v_proj")}
        if attn.k_norm is not None:
            rows["k_proj"] = math.sqrt(a.head_dim) * float(np.abs(_gain(attn.k_norm)).max())
        scale = max(scale, *rows.values())
    return scale


def assert_within_sums(got, want, magnitude, n: int) -> None:
    """got and want: two float32 evaluations of sums of n terms (any order, products rounded
    too) whose absolute terms add up to `magnitude`: each within gamma_n * magnitude of exact."""
    assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)) <= 2 * gamma(n) * magnitude)


# -- fp16: two evaluations under the op-boundary model (pipeline.ground.models.fp16)
#
# An fp16 program rounds every op's output to float16 (relative error at most u16 = 2^-11)
# while an op's own sums run in float32 (the gamma_K above). Two fp16 evaluations of one
# model with the same fp16 weights (torch's half reference and the MIL executor or Core ML
# running a package) may round at different places (a fused op rounds once where the
# reference rounds twice) and sum in different orders, so each is bounded against the
# exact value on those weights and the bound doubles, as for float32. A logit's relative
# error then adds up along its longest chain of op boundaries (with the same premise of a
# gain of one per layer as the float32 analysis: norms rescale, softmax and the activations
# move a relative error by at most its size): n roundings of at most u16 each give
# gamma(n, U16) = n u16 / (1 - n u16), and Higham & Mary's probable form with u16 in place of
# u32 for the gates. The float32 sums inside the ops add the float32 bound of the same model.
# Against the FP32 model (`against_fp32`) one side has also rounded every weight on the
# path once (the embedding, the head, every matrix and norm gain): one more u16 each.
U16 = 2.0**-11  # float16 unit roundoff
# Op boundaries on the longest path through one block, counted from the reference's forward
# (base.py; a converted program mirrors its ops one for one). Exact ops round nothing: a
# gather, transpose, reshape, concat, negation, a mask select, a 0/1 head or neuron mask,
# and the cache write (each slot's sum has one nonzero term).
NORM_BOUNDARIES = 6  # x * x, mean, + eps, rsqrt, x * r, * gain
MAX_SCALED_NORM_BOUNDARIES = 10  # |x|, max, clamp, x / m, then the six above
# q_proj, RoPE (x cos + rotate(x) sin: two on a path), q . k, * scale, softmax, p @ V, o_proj,
# the residual add; plus the input norm, and q norm / post-attention norm where present.
ATTENTION_BOUNDARIES = 9
# A k bias moved past RoPE (fp16 mitigation `key_bias`): the offset rounded to fp16 where it
# meets the keys, and its add.
KEY_OFFSET_BOUNDARIES = 2
# gate, activation, * up, down, the residual add; plus the norms.
FFN_BOUNDARIES = 5


def _norm_boundaries(norm) -> int:
    # A max-scaled norm (fp16.MaxScaledRMSNorm) has its `scaled` step; duck-typed, so this
    # module stays free of torch.
    return MAX_SCALED_NORM_BOUNDARIES if hasattr(norm, "scaled") else NORM_BOUNDARIES


def fp16_boundaries(model) -> int:
    """Op boundaries on a logit's longest path through a pipeline.ground.models Decoder: the
    embedding scale where there is one, each layer's attention and FFN blocks (an MoE block:
    the route weight and the sum over its experts), the final norm and the head."""
    count = 1 if model.embed_scale() is not None else 0
    for layer in model.model.layers:
        attn, norms = layer.self_attn, _norm_boundaries(layer.input_layernorm)
        count += ATTENTION_BOUNDARIES + norms + (0 if attn.q_norm is None else _norm_boundaries(attn.q_norm))
        count += 0 if attn.key_offset is None else KEY_OFFSET_BOUNDARIES
        count += FFN_BOUNDARIES + _norm_boundaries(layer.pre_feedforward_layernorm or layer.post_attention_layernorm)
        if layer.pre_feedforward_layernorm is not None:  # sandwich: the attention output's norm
            count += _norm_boundaries(layer.post_attention_layernorm)
        if layer.post_feedforward_layernorm is not None:
            count += _norm_boundaries(layer.post_feedforward_layernorm)
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            count += len(experts) + 1
    return count + _norm_boundaries(model.model.norm) + 1


def _fp16_weights_on_path(model) -> int:
    """Weights rounded once to fp16 on a logit's path: the embedding, the head, every
    matrix (MATRICES_PER_LAYER) and every norm gain."""
    norms = sum(1 for layer in model.model.layers for n in (
        layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
        layer.post_feedforward_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm) if n is not None)
    return 2 + MATRICES_PER_LAYER * model.args.num_layers + norms + 1


def _fp16_rel(model, tokens: int, probable: bool, against_fp32: bool) -> float:
    n = fp16_boundaries(model)
    chain = _chain(model, tokens)
    fp32 = 2 * (gamma_probable(chain) if probable else gamma(chain))
    if against_fp32:
        n += _fp16_weights_on_path(model)
        return (gamma_probable(n, u=U16) if probable else gamma(n, U16)) + fp32
    return 2 * (gamma_probable(n, u=U16) if probable else gamma(n, U16)) + fp32


def fp16_logits_bound(model, tokens: int, probable: bool = False, against_fp32: bool = False) -> float:
    """Max |Δ logit| between two fp16 evaluations of `model` (its FP32 module, mitigations
    applied: its weights rounded to fp16 are what both evaluate), attending over at most
    `tokens` positions; with `against_fp32`, between one fp16 evaluation and the FP32 model.
    The scale is `logits_bound`'s (sqrt(D) max|final gain| max|head row|_2)."""
    head = model.head
    return logits_bound(0, model.args.hidden_size, _gain(model.model.norm), _weight(head),
                        _fp16_rel(model, tokens, probable, against_fp32))


def fp16_cache_bound(model, tokens: int, probable: bool = False) -> float:
    """Max |Δ| of one K or V cache entry between two fp16 evaluations (the whole chain bounds
    the path up to any layer's K and V, as `model_cache_bound` takes it)."""
    return _fp16_rel(model, tokens, probable, against_fp32=False) * _cache_scale(model)
