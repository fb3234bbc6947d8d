"""The decoder families of the reference model (`pipeline.ground.models`) on MLX, weights packed.

Dense Llama / Qwen2 / Qwen3 / Gemma and Qwen MoE, one forward for all of them: every
capability is recognised by tensor presence (spec §2), exactly as the reference decoder
does — q/k/v/o and MLP biases, q/k norms, a router (MoE layer), a shared expert. Task masks
(spec §5) and skills (spec §9) apply at load. Activations are float32 throughout (MLX's
float16 quantized matmul on x86 CPUs is far slower).

A forward of many tokens (`gemm=True`) runs every projection through a transient float32
expansion and a BLAS GEMM; one of a few tokens runs the packed weights on MLX's quantized
kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from pipeline.ground.cmf import CmfFile
from pipeline.ground.cmf.masks import TaskMask
from pipeline.ground.cmf.skills import skill_tensor_source
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models import ModelArgs
from pipeline.ground.models.errors import ModelConfigError
from pipeline.ground.models.rope import rope_inv_freq
from pipeline.ground.models.weights import WeightLedger
from mlx_runtime.cache import KVCache
from mlx_runtime.weights import GROUP, Linear, LoadReport, Packed, expanded_matmul, load_linear, lookup, matmul

ACTIVATIONS: dict[str, Callable[[mx.array], mx.array]] = {
    "silu": lambda x: x * mx.sigmoid(x),
    "gelu": lambda x: 0.5 * x * (1 + mx.erf(x / math.sqrt(2))),
    "gelu_pytorch_tanh": lambda x: 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
}


def project(lin: Linear, x: mx.array, gemm: bool) -> mx.array:
    return expanded_matmul(lin, x) if gemm else matmul(lin, x)


def _mask(bits: np.ndarray | None) -> mx.array | None:
    """A float 0/1 multiplier, or None when every bit is set."""
    if bits is None or bits.all():
        return None
    return mx.array(np.asarray(bits, dtype=np.float32))


@dataclass(frozen=True)
class Attention:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: mx.array | None
    k_norm: mx.array | None
    head_mask: mx.array | None


@dataclass(frozen=True)
class Mlp:
    gate: Linear
    up: Linear
    down: Linear
    neuron_mask: mx.array | None = None


@dataclass(frozen=True)
class Stacked:
    """All experts' gate/up/down packed alike, stacked [E, ...] for mx.gather_qmm."""

    gate: Packed
    up: Packed
    down: Packed


@dataclass(frozen=True)
class Moe:
    router: Linear
    experts: tuple[Mlp, ...]
    stacked: Stacked | None
    allowed: mx.array | None  # bool [E]; None = every expert
    top_k: int
    norm_topk_prob: bool
    shared: Mlp | None
    shared_gate: Linear | None


@dataclass(frozen=True)
class Layer:
    input_norm: mx.array
    post_norm: mx.array
    attn: Attention
    ffn: Mlp | Moe
    active: bool


@dataclass(frozen=True)
class Model:
    args: ModelArgs
    embed: Linear
    layers: tuple[Layer, ...]
    norm: mx.array
    head: Linear
    rope_periods: mx.array  # 1 / inv_freq, as mx.fast.rope takes them
    embed_scale: float | None
    report: LoadReport

    def new_cache(self, capacity: int = 256) -> KVCache:
        a = self.args
        return KVCache(a.num_layers, a.num_kv_heads, a.head_dim, a.max_position_embeddings, capacity)


# ---------------------------------------------------------------- loading


class _Tensors(WeightLedger):
    """The reference decoder's tensor bookkeeping (each handed out once; a tensor nobody took
    is a capability this runtime lacks and is refused by name), over CMF directory entries
    read through a skill's source map, kept packed and counted in the load report."""

    def __init__(self, cmf: CmfFile, source: dict[str, str], args: ModelArgs):
        super().__init__(source, cmf.path.name)
        self.cmf, self.args = cmf, args
        self.report = LoadReport()
        self.gemma = args.norm_style == "gemma"

    def _info(self, name: str, shape: tuple):
        info = self.cmf.info(self.entry(name))
        self.claim(name, info.shape, shape)
        return info

    def vector(self, name: str, size: int) -> mx.array:
        info = self._info(name, (size,))
        self.report.add(name, info.dtype.name, info.nbytes, 4 * size)
        vector = mx.array(self.cmf.decode(info.name))
        self.cmf.evict(info.name)
        return vector

    def norm(self, name: str, size: int) -> mx.array:
        """RMSNorm weight as multiplied: gemma stores w - 1 (spec §2 norm_style)."""
        w = self.vector(name, size)
        return w + 1.0 if self.gemma else w

    def matrix(self, name: str, out: int | None, in_: int | None) -> Linear:
        info = self._info(name, (out, in_))
        lin = load_linear(self.cmf, info.name)
        # mx.array copies: the mapped pages are dead weight from here on.
        self.cmf.evict(info.name)
        self.report.add_linear(name, info.nbytes, lin)
        return lin

    def linear(self, prefix: str, out: int | None, in_: int | None) -> Linear:
        """`{prefix}.weight` with its optional `{prefix}.bias` (capability by presence)."""
        lin = self.matrix(f"{prefix}.weight", out, in_)
        if self.has(f"{prefix}.bias"):
            return replace(lin, bias=self.vector(f"{prefix}.bias", lin.shape[0]))
        return lin


def _attention(t: _Tensors, prefix: str, head_bits: np.ndarray | None) -> Attention:
    a = t.args
    heads, kv, dim, hidden = a.num_attention_heads, a.num_kv_heads, a.head_dim, a.hidden_size
    q_norm, k_norm = f"{prefix}.q_norm.weight", f"{prefix}.k_norm.weight"
    return Attention(
        q=t.linear(f"{prefix}.q_proj", heads * dim, hidden),
        k=t.linear(f"{prefix}.k_proj", kv * dim, hidden),
        v=t.linear(f"{prefix}.v_proj", kv * dim, hidden),
        o=t.linear(f"{prefix}.o_proj", hidden, heads * dim),
        q_norm=t.norm(q_norm, dim) if t.has(q_norm) else None,
        k_norm=t.norm(k_norm, dim) if t.has(k_norm) else None,
        head_mask=_mask(head_bits),
    )


def _mlp(t: _Tensors, prefix: str, neuron_bits: np.ndarray | None) -> Mlp:
    """The FFN width comes from the tensors (pruned files, spec §11)."""
    hidden = t.args.hidden_size
    gate = t.linear(f"{prefix}.gate_proj", None, hidden)
    width = gate.shape[0]
    if neuron_bits is not None and len(neuron_bits) != width:
        raise ModelConfigError(
            f"{prefix}: a neuron mask of {len(neuron_bits)} bits cannot address a pruned FFN of width {width}"
        )
    return Mlp(gate, t.linear(f"{prefix}.up_proj", width, hidden), t.linear(f"{prefix}.down_proj", hidden, width),
               _mask(neuron_bits))


def _stack(linears: list[Linear]) -> Packed | None:
    """One Packed of all experts' matrices when they share one plain affine layout."""
    plain = all(
        len(l.blocks) == 1 and isinstance(l.blocks[0], Packed) and l.order is None and l.col is None
        and l.sparse is None and l.bias is None for l in linears
    )
    if not plain:
        return None
    blocks = [l.blocks[0] for l in linears]
    if len({(b.bits, b.scales.dtype, b.w.shape) for b in blocks}) != 1:
        return None
    return Packed(*(mx.stack([getattr(b, f) for b in blocks]) for f in ("w", "scales", "biases")), blocks[0].bits)


def _member(p: Packed, index: int) -> Packed:
    """Expert `index` of a stacked Packed as views (a range slice shares the buffer; an
    integer index would copy it)."""
    return Packed(*(a[index : index + 1].reshape(a.shape[1:]) for a in (p.w, p.scales, p.biases)), p.bits)


def _moe(t: _Tensors, prefix: str, index: int, mask: TaskMask | None) -> Moe:
    a = t.args
    if a.moe is None:
        raise ModelConfigError(f"{t.source}: {prefix}.gate.weight is a router but the header has no moe block")
    if mask is not None and not mask.ffn[index].all():
        raise UnsupportedModel(f"{t.source}: the task mask switches off FFN neurons of MoE layer {index}")
    router = t.linear(f"{prefix}.gate", None, a.hidden_size)
    count = router.shape[0]
    present = 0
    while t.has(f"{prefix}.experts.{present}.gate_proj.weight"):
        present += 1
    if present != count:
        raise ModelConfigError(f"{t.source}: {prefix}.gate.weight routes to {count} experts but {present} are present")
    experts = tuple(_mlp(t, f"{prefix}.experts.{e}", None) for e in range(count))
    bits = None if mask is None or mask.experts is None else np.asarray(mask.experts[index][:count], dtype=bool)
    if bits is not None and not bits.any():
        raise ModelConfigError(f"{prefix}: the task mask allows none of the {count} experts")
    parts = [_stack([getattr(e, f) for e in experts]) for f in ("gate", "up", "down")]
    stacked = Stacked(*parts) if all(p is not None for p in parts) else None
    if stacked is not None:
        # Keep one copy: each expert's blocks become views into the stacked arrays.
        mx.eval(*(getattr(getattr(stacked, f), a) for f in ("gate", "up", "down") for a in ("w", "scales", "biases")))
        experts = tuple(
            Mlp(*(replace(getattr(ex, f), blocks=(_member(getattr(stacked, f), e),)) for f in ("gate", "up", "down")))
            for e, ex in enumerate(experts)
        )
    shared = shared_gate = None
    if t.has(f"{prefix}.shared_expert.gate_proj.weight"):
        shared = _mlp(t, f"{prefix}.shared_expert", None)
        shared_gate = t.linear(f"{prefix}.shared_expert_gate", 1, a.hidden_size)
    return Moe(
        router=router,
        experts=experts,
        stacked=stacked,
        allowed=None if bits is None or bits.all() else mx.array(bits),
        top_k=min(a.moe.top_k, count if bits is None else int(bits.sum())),
        norm_topk_prob=a.moe.norm_topk_prob,
        shared=shared,
        shared_gate=shared_gate,
    )


def load_model(cmf: CmfFile, mask: TaskMask | None = None, skill: str | None = None) -> Model:
    """The model of an open CMF file, weights packed on MLX; `mask` a task mask, `skill` an id."""
    if cmf.is_skill_file:
        raise UnsupportedModel(f"{cmf.path.name}: a skill file (feature bit 6) never runs on its own; "
                               "apply it to its base (pipeline.ground.cmf.skills.apply_skill_file) and load that")
    args = ModelArgs.from_header(cmf.header, source=cmf.path.name)
    for index, layer_type in enumerate(args.layer_types):
        if layer_type != "FullAttention":
            raise UnsupportedModel(f"{cmf.path.name}: layer {index} has layer type {layer_type!r}; "
                                   "the MLX runtime runs only FullAttention layers")
    t = _Tensors(cmf, skill_tensor_source(cmf, skill), args)
    hidden, vocab = args.hidden_size, args.vocab_size
    embed = t.matrix("model.embed_tokens.weight", vocab, hidden)
    layers = []
    for i in range(args.num_layers):
        prefix = f"model.layers.{i}"
        attn = _attention(t, f"{prefix}.self_attn", None if mask is None else mask.heads[i])
        if t.has(f"{prefix}.mlp.gate.weight"):
            ffn = _moe(t, f"{prefix}.mlp", i, mask)
        else:
            ffn = _mlp(t, f"{prefix}.mlp", None if mask is None else mask.ffn[i])
        layers.append(Layer(
            input_norm=t.norm(f"{prefix}.input_layernorm.weight", hidden),
            post_norm=t.norm(f"{prefix}.post_attention_layernorm.weight", hidden),
            attn=attn,
            ffn=ffn,
            active=True if mask is None else bool(mask.layer_gates[i]),
        ))
    norm = t.norm("model.norm.weight", hidden)
    tied = args.tie_word_embeddings and not t.has("lm_head.weight")
    head = embed if tied else t.matrix("lm_head.weight", vocab, hidden)
    t.refuse_leftovers()
    return Model(
        args=args,
        embed=embed,
        layers=tuple(layers),
        norm=norm,
        head=head,
        rope_periods=mx.array(1.0 / rope_inv_freq(args)),
        embed_scale=hidden**0.5 if args.family == "gemma" else None,
        report=t.report,
    )


# ---------------------------------------------------------------- forward


def _attend_blas(q: mx.array, keys: mx.array, values: mx.array, start: int, scale: float) -> mx.array:
    """Causal grouped-query attention through numpy's BLAS, for long chunks (MLX's CPU
    attention is several times slower there). q [H, T, D] at positions start.., keys and
    values [KV, start + T, D]; query head h reads kv head h // (H / KV)."""
    mx.eval(q, keys, values)
    qn, kn, vn = np.asarray(q), np.asarray(keys), np.asarray(values)
    heads, count, dim = qn.shape
    kv, seen, _ = kn.shape
    scores = np.matmul(qn.reshape(kv, -1, dim), kn.transpose(0, 2, 1)).reshape(heads, count, seen)
    scores *= np.float32(scale)
    future = np.arange(seen)[None, :] > (start + np.arange(count))[:, None]
    scores[:, future] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return mx.array(np.matmul(scores.reshape(kv, -1, seen), vn).reshape(heads, count, dim))


def _attention_forward(model: Model, at: Attention, x: mx.array, cache: KVCache, index: int,
                       mask: mx.array | None, gemm: bool) -> mx.array:
    a = model.args
    T = x.shape[0]

    def rope(h: mx.array) -> mx.array:
        """HF's rotate_half RoPE on [heads, T, D]; periods are 1 / inv_freq (rope scaling included)."""
        return mx.fast.rope(h, a.head_dim, traditional=False, base=None, scale=1.0, offset=cache.position,
                            freqs=model.rope_periods)

    def heads(lin: Linear, count: int, norm: mx.array | None) -> mx.array:
        h = project(lin, x, gemm).reshape(T, count, a.head_dim)
        if norm is not None:
            h = mx.fast.rms_norm(h, norm, a.rms_norm_eps)
        return h.transpose(1, 0, 2)

    q = rope(heads(at.q, a.num_attention_heads, at.q_norm))
    k = rope(heads(at.k, a.num_kv_heads, at.k_norm))
    v = heads(at.v, a.num_kv_heads, None)
    keys, values = cache.write(index, k, v)
    scale = a.head_dim**-0.5
    if gemm:
        out = _attend_blas(q, keys, values, cache.position, scale)
    else:
        out = mx.fast.scaled_dot_product_attention(q[None], keys[None], values[None], scale=scale, mask=mask)[0]
    if at.head_mask is not None:
        out = out * at.head_mask[:, None, None]
    return project(at.o, out.transpose(1, 0, 2).reshape(T, -1), gemm)


def _mlp_forward(model: Model, m: Mlp, x: mx.array, gemm: bool) -> mx.array:
    h = ACTIVATIONS[model.args.hidden_act](project(m.gate, x, gemm)) * project(m.up, x, gemm)
    if m.neuron_mask is not None:
        h = h * m.neuron_mask
    return project(m.down, h, gemm)


def _route(moe: Moe, x: mx.array, gemm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(expert ids [T, k], weights [T, k]) on the host: softmax over all router logits, top-k
    with ties to the lower index (a stable sort), renormalised iff norm_topk_prob (spec §2.2)."""
    logits = project(moe.router, x, gemm)
    if moe.allowed is not None:
        logits = mx.where(moe.allowed, logits, -mx.inf)
    probs = np.asarray(mx.softmax(logits, axis=-1, precise=True))
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, : moe.top_k]
    top = np.take_along_axis(probs, chosen, axis=-1)
    if moe.norm_topk_prob:
        top = top / top.sum(axis=-1, keepdims=True)
    return chosen, top


def _moe_forward(model: Model, moe: Moe, x: mx.array, gemm: bool) -> mx.array:
    chosen, top = _route(moe, x, gemm)
    act = ACTIVATIONS[model.args.hidden_act]
    if moe.stacked is not None and not gemm:
        s = moe.stacked
        idx = mx.array(chosen.astype(np.uint32))

        def qmm(inp, p: Packed):
            return mx.gather_qmm(inp, p.w, p.scales, p.biases, rhs_indices=idx, transpose=True,
                                 group_size=GROUP, bits=p.bits)

        xe = x[:, None, None, :]
        h = act(qmm(xe, s.gate)) * qmm(xe, s.up)  # [T, k, 1, width]
        y = qmm(h, s.down)[:, :, 0, :]  # [T, k, hidden]
        out = (y * mx.array(top)[..., None]).sum(axis=1)
    else:
        # Each expert runs on the tokens routed to it only.
        out = mx.zeros_like(x)
        for e in np.unique(chosen):
            rows, slot = np.nonzero(chosen == e)
            ye = _mlp_forward(model, moe.experts[int(e)], x[mx.array(rows)], gemm)
            weight = mx.array(top[rows, slot][:, None])
            out = out.at[mx.array(rows)].add(ye * weight)
    if moe.shared is not None:
        out = out + mx.sigmoid(project(moe.shared_gate, x, gemm)) * _mlp_forward(model, moe.shared, x, gemm)
    return out


def forward(model: Model, ids: np.ndarray | mx.array, cache: KVCache, *, gemm: bool = False,
            last_only: bool = False) -> mx.array:
    """Logits [T, vocab] (or [1, vocab] with `last_only`) of ids [T] run after the cache's
    tokens; the cache advances by T. `gemm` runs projections as dense GEMMs (long prompts).
    Device ids (an mx.array) keep a decode step free of host synchronisation."""
    a = model.args
    if not isinstance(ids, mx.array):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    T = ids.size
    cache.reserve(T)
    start = cache.position
    # Causality alone keeps slots past position + t out: T == 1 attends to everything held.
    mask = None
    if T > 1:
        mask = mx.arange(start + T)[None, :] <= (mx.arange(T) + start)[:, None]
    h = lookup(model.embed, ids)
    if model.embed_scale is not None:
        h = h * mx.array(model.embed_scale, dtype=mx.float32)
    for index, layer in enumerate(model.layers):
        if not layer.active:
            # A gated-off layer leaves the residual stream alone (spec §5); its slots stay unread.
            continue
        x = mx.fast.rms_norm(h, layer.input_norm, a.rms_norm_eps)
        h = h + _attention_forward(model, layer.attn, x, cache, index, mask, gemm)
        x = mx.fast.rms_norm(h, layer.post_norm, a.rms_norm_eps)
        ffn = layer.ffn
        h = h + (_moe_forward(model, ffn, x, gemm) if isinstance(ffn, Moe) else _mlp_forward(model, ffn, x, gemm))
        if gemm:
            mx.eval(h)
    cache.advance(T)
    h = mx.fast.rms_norm(h[-1:] if last_only else h, model.norm, a.rms_norm_eps)
    return head_logits(model, h, gemm and not last_only)


HEAD_CHUNK = 8192


def head_logits(model: Model, h: mx.array, gemm: bool) -> mx.array:
    """LM head; for many rows, expanded a chunk of vocabulary rows at a time so the transient
    float32 copy stays small."""
    head = model.head
    if not gemm:
        return matmul(head, h)
    vocab = head.shape[0]
    outs = []
    for lo in range(0, vocab, HEAD_CHUNK):
        rows = lookup(head, np.arange(lo, min(vocab, lo + HEAD_CHUNK)))
        mx.eval(h, rows)
        outs.append(np.asarray(h) @ np.asarray(rows).T)
    logits = mx.array(np.concatenate(outs, axis=1))
    return logits if head.bias is None else logits + head.bias
