"""Error bounds that follow from the arithmetic being compared, never from one CPU's bits.

Two float32 evaluations of one decoder (torch eager, the MIL executor, another BLAS or
vector width) differ only in summation order, blocking and FMA contraction. A dot of length
K in any order errs by at most gamma_K * sum|a*b| (gamma_K = K u / (1 - K u), u = 2^-24),
and a logit's error, to first order, adds up along the longest chain of such accumulations
it goes through, taking each layer's gain on a relative error as one: every RMSNorm rescales
its input, softmax moves a probability by at most 2 p max|Δ score| and SiLU's slope stays
under 1.1, so a relative error in the hidden state stays relative; the head's dot then gives |Δ logit_j| <= rel * sum_i |h_i E_ji|, and with
|h|_2 <= sqrt(D) * max|gamma| (unit RMS before the final norm's weight) Cauchy-Schwarz
bounds that scale by weights alone. Two evaluations are each within the bound of the
exact value, hence the factor 2. These are worst cases: typical differences sit two to
three decades lower, and a real bug (a wrong slot, mask, rope or norm) is a logit error of
order one.
"""

import numpy as np

U32 = 2.0**-24  # float32 unit roundoff


def gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


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


def logits_bound(chain: int, hidden: int, final_norm: np.ndarray, head: np.ndarray, rel: float = 0.0) -> float:
    """Max |Δ logit| between two float32 evaluations whose accumulations total `chain`, one side
    carrying `rel` more relative error (rounded weights or caches)."""
    scale = np.sqrt(hidden) * np.abs(final_norm).max() * np.linalg.norm(head, axis=1).max()
    return (2 * gamma(chain) + rel) * float(scale)


# Weight matrices on one logit's path per layer: q, k, v, o, gate, up, down.
MATRICES_PER_LAYER = 7


def model_logits_bound(model, tokens: int, fp16_cache: bool = False, weight_rtol: float = 0.0) -> float:
    """`logits_bound` for a pipeline.models Decoder attending over at most `tokens` positions.

    Per layer it also counts q/k norms (head_dim) and, for MoE, the router (hidden), its
    softmax (experts) and the weighted sum of top-k and shared experts. fp16_cache: one side
    reads its K/V back from fp16, each value within 2^-11 relative, so each layer's q . k and
    probabilities @ V gain 2^-11 of their sum|a*b|. weight_rtol: one side's weights differ
    from the other's by that much relative (every matrix on the path, and the head)."""
    a = model.args
    ffn, extra = a.intermediate_size, a.head_dim
    if a.moe is not None:
        ffn = max(ffn, a.moe.moe_intermediate_size, a.moe.shared_expert_intermediate_size or 0)
        extra += a.hidden_size + a.moe.num_experts + a.moe.top_k + 1
    chain = decoder_chain(a.num_layers, a.hidden_size, a.num_attention_heads * a.head_dim, a.head_dim, ffn, tokens,
                          extra)
    rel = weight_rtol * (MATRICES_PER_LAYER * a.num_layers + 1)
    if fp16_cache:
        rel += 2 * a.num_layers * 2.0**-11
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    gain = model.model.norm.weight + 1.0 if model.model.norm.offset else model.model.norm.weight
    return logits_bound(chain, a.hidden_size, gain.detach().numpy(), head.weight.detach().numpy(), rel)


def assert_within_sums(got, want, magnitude, n: int) -> None:
    """got and want: two float32 evaluations of sums of n terms (any order, products rounded
    too) whose absolute terms add up to `magnitude`: each within gamma_n * magnitude of exact."""
    assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)) <= 2 * gamma(n) * magnitude)
