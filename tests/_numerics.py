"""Error bounds that follow from the arithmetic being compared, never from one CPU's bits.

Two float32 evaluations of one decoder (torch eager, the MIL executor, another BLAS or
vector width) differ only in summation order, blocking and FMA contraction. A dot of length
K in any order errs by at most gamma_K * sum|a*b| (gamma_K = K u / (1 - K u), u = 2^-24),
and a logit's error, to first order, adds up along the longest chain of such accumulations
it goes through. Every RMSNorm rescales its input, so a relative error in the hidden state
stays relative; the head's dot then gives |Δ logit_j| <= rel * sum_i |h_i E_ji|, and with
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


def decoder_chain(layers: int, hidden: int, q_width: int, head_dim: int, intermediate: int, tokens: int) -> int:
    """Inner lengths of every accumulation on one logit's longest path through a pre-norm decoder."""
    per_layer = (hidden  # input RMSNorm's mean of squares
                 + hidden  # q/k/v projections
                 + head_dim  # q . k
                 + 2 * tokens  # softmax's sum, probabilities @ V
                 + q_width  # o_proj
                 + hidden  # post-attention RMSNorm
                 + hidden  # gate / up
                 + intermediate)  # down
    return layers * per_layer + 2 * hidden  # final norm, head


def logits_bound(chain: int, hidden: int, final_norm: np.ndarray, head: np.ndarray) -> float:
    """Max |Δ logit| between two float32 evaluations whose accumulations total `chain`."""
    scale = np.sqrt(hidden) * np.abs(final_norm).max() * np.linalg.norm(head, axis=1).max()
    return 2 * gamma(chain) * float(scale)


def model_logits_bound(model, tokens: int, fp16_cache: bool = False) -> float:
    """`logits_bound` for a pipeline.models Decoder attending over at most `tokens` positions.

    fp16_cache: one side reads its K/V back from fp16, each value within 2^-11 relative, so
    each layer's q . k and probabilities @ V gain 2^-11 of their sum|a*b| (the other side is
    exact there): 2 * layers * 2^-11 more relative error."""
    a = model.args
    chain = decoder_chain(a.num_layers, a.hidden_size, a.num_attention_heads * a.head_dim, a.head_dim,
                          a.intermediate_size, tokens)
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    gain = model.model.norm.weight + 1.0 if model.model.norm.offset else model.model.norm.weight
    bound = logits_bound(chain, a.hidden_size, gain.detach().numpy(), head.weight.detach().numpy())
    if fp16_cache:
        bound *= 1 + 2 * a.num_layers * 2.0**-11 / (2 * gamma(chain))
    return bound

