"""What every decoder family shares on MLX: tensor intake, attention, the gated MLP, RMSNorms,
the decoder loop and the LM head; a family (`Family`) changes only its FFN and embedding scale.

Every capability is recognised by tensor presence (spec §2), exactly as the reference decoder
does: q/k/v/o and MLP biases, q/k norms, sandwich norms (pre_feedforward_layernorm present).
SlidingAttention layers, their RoPE base and the query scale come from the arch, as there.
Task masks (spec §5) and skills (spec §9) apply at
load. Activations are float32 throughout (MLX's float16 quantized matmul on x86 CPUs is far
slower).

A forward of many tokens (`gemm=True`) runs every projection through a transient float32
expansion and a BLAS GEMM; one of a few tokens runs the packed weights on MLX's quantized
kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

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
from mlx_runtime.weights import Linear, LoadReport, expanded_matmul, load_linear, lookup, matmul

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


class Ffn(Protocol):
    """A layer's feed-forward block: `ffn(args, x, gemm)` -> [T, hidden]."""

    def __call__(self, args: ModelArgs, x: mx.array, gemm: bool) -> mx.array: ...


@dataclass(frozen=True)
class Attention:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    q_norm: mx.array | None
    k_norm: mx.array | None
    head_mask: mx.array | None
    sliding: bool = False  # a SlidingAttention layer: arch.sliding_window keys, the local RoPE


@dataclass(frozen=True)
class Mlp:
    """down(act(gate x) * up x): SwiGLU or GeGLU."""

    gate: Linear
    up: Linear
    down: Linear
    neuron_mask: mx.array | None = None

    def __call__(self, args: ModelArgs, x: mx.array, gemm: bool) -> mx.array:
        h = ACTIVATIONS[args.hidden_act](project(self.gate, x, gemm)) * project(self.up, x, gemm)
        if self.neuron_mask is not None:
            h = h * self.neuron_mask
        return project(self.down, h, gemm)


@dataclass(frozen=True)
class Layer:
    input_norm: mx.array
    # post_attention_layernorm: the FFN input's norm (Llama), or with pre_ffn_norm present the
    # attention output's, before its residual add (Gemma 2/3 sandwich norms).
    post_norm: mx.array
    attn: Attention
    ffn: Ffn
    active: bool
    pre_ffn_norm: mx.array | None = None
    post_ffn_norm: mx.array | None = None


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
    sliding_rope_periods: mx.array | None = None  # the SlidingAttention layers'; None without them

    def new_cache(self, capacity: int = 256) -> KVCache:
        a = self.args
        return KVCache(a.num_layers, a.num_kv_heads, a.head_dim, a.max_position_embeddings, capacity)


# ---------------------------------------------------------------- loading


class Tensors(WeightLedger):
    """The reference decoder's tensor bookkeeping (each handed out once; a tensor nobody took
    is a capability this runtime lacks and is refused by name), over CMF directory entries
    read through a skill's source map, kept packed and counted in the load report."""

    def __init__(self, cmf: CmfFile, source: dict[str, str], args: ModelArgs):
        super().__init__(source, cmf.path.name)
        self.cmf, self.args = cmf, args
        self.report = LoadReport()
        self.norm_offset = args.norm_style == "gemma"

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
        """RMSNorm weight as multiplied: norm_style "gemma" stores w - 1 (spec §2)."""
        w = self.vector(name, size)
        return w + 1.0 if self.norm_offset else w

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


def load_attention(t: Tensors, prefix: str, head_bits: np.ndarray | None, sliding: bool = False) -> Attention:
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
        sliding=sliding,
    )


def load_mlp(t: Tensors, prefix: str, neuron_bits: np.ndarray | None) -> Mlp:
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


class Family:
    """A decoder family's departures from the shared decoder. As it stands it is Llama / Qwen2 /
    Qwen3; a family module (`mlx_runtime.models.<family>`) subclasses it as `Family`."""

    @staticmethod
    def embed_scale(args: ModelArgs) -> float | None:
        """The factor the looked-up embeddings are multiplied by (the tied head stays unscaled)."""
        return None

    @classmethod
    def make_ffn(cls, t: Tensors, prefix: str, index: int, mask: TaskMask | None) -> Ffn:
        return load_mlp(t, prefix, None if mask is None else mask.ffn[index])


def load_decoder(family: type[Family], cmf: CmfFile, args: ModelArgs, mask: TaskMask | None,
                 skill: str | None) -> Model:
    """The decoder of `family` from an open CMF file of architecture `args`."""
    for index, layer_type in enumerate(args.layer_types):
        if layer_type not in ("FullAttention", "SlidingAttention"):
            raise UnsupportedModel(f"{cmf.path.name}: layer {index} has layer type {layer_type!r}; "
                                   "the MLX runtime runs only FullAttention and SlidingAttention layers")
    t = Tensors(cmf, skill_tensor_source(cmf, skill), args)
    hidden, vocab = args.hidden_size, args.vocab_size
    embed = t.matrix("model.embed_tokens.weight", vocab, hidden)
    layers = []
    for i in range(args.num_layers):
        prefix = f"model.layers.{i}"
        attn = load_attention(t, f"{prefix}.self_attn", None if mask is None else mask.heads[i],
                              sliding=args.layer_types[i] == "SlidingAttention")
        ffn = family.make_ffn(t, f"{prefix}.mlp", i, mask)
        pre_ffn, post_ffn = f"{prefix}.pre_feedforward_layernorm.weight", f"{prefix}.post_feedforward_layernorm.weight"
        sandwich = t.has(pre_ffn)
        layers.append(Layer(
            input_norm=t.norm(f"{prefix}.input_layernorm.weight", hidden),
            post_norm=t.norm(f"{prefix}.post_attention_layernorm.weight", hidden),
            attn=attn,
            ffn=ffn,
            active=True if mask is None else bool(mask.layer_gates[i]),
            pre_ffn_norm=t.norm(pre_ffn, hidden) if sandwich else None,
            # Without the pre-FFN norm a post-FFN one has no place: left untaken, it is refused.
            post_ffn_norm=t.norm(post_ffn, hidden) if sandwich and t.has(post_ffn) else None,
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
        embed_scale=family.embed_scale(args),
        report=t.report,
        sliding_rope_periods=(mx.array(1.0 / rope_inv_freq(args, "SlidingAttention"))
                              if "SlidingAttention" in args.layer_types else None),
    )


# ---------------------------------------------------------------- forward


def _attend_blas(q: mx.array, keys: mx.array, values: mx.array, start: int, scale: float,
                 window: int | None = None) -> mx.array:
    """Causal grouped-query attention through numpy's BLAS, for long chunks (MLX's CPU
    attention is several times slower there). q [H, T, D] at positions start.., keys and
    values [KV, start + T, D]; query head h reads kv head h // (H / KV). With `window`, the
    query at i sees only keys j > i - window (a SlidingAttention layer)."""
    mx.eval(q, keys, values)
    qn, kn, vn = np.asarray(q), np.asarray(keys), np.asarray(values)
    heads, count, dim = qn.shape
    kv, seen, _ = kn.shape
    scores = np.matmul(qn.reshape(kv, -1, dim), kn.transpose(0, 2, 1)).reshape(heads, count, seen)
    scores *= np.float32(scale)
    future = np.arange(seen)[None, :] > (start + np.arange(count))[:, None]
    if window is not None:
        future |= np.arange(seen)[None, :] <= (start + np.arange(count))[:, None] - window
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
                            freqs=model.sliding_rope_periods if at.sliding else model.rope_periods)

    def heads(lin: Linear, count: int, norm: mx.array | None) -> mx.array:
        h = project(lin, x, gemm).reshape(T, count, a.head_dim)
        if norm is not None:
            h = mx.fast.rms_norm(h, norm, a.rms_norm_eps)
        return h.transpose(1, 0, 2)

    q = rope(heads(at.q, a.num_attention_heads, at.q_norm))
    k = rope(heads(at.k, a.num_kv_heads, at.k_norm))
    v = heads(at.v, a.num_kv_heads, None)
    keys, values = cache.write(index, k, v)
    scale = a.head_dim**-0.5 if a.query_pre_attn_scalar is None else a.query_pre_attn_scalar**-0.5
    if gemm:
        out = _attend_blas(q, keys, values, cache.position, scale, a.sliding_window if at.sliding else None)
    else:
        out = mx.fast.scaled_dot_product_attention(q[None], keys[None], values[None], scale=scale, mask=mask)[0]
    if at.head_mask is not None:
        out = out * at.head_mask[:, None, None]
    return project(at.o, out.transpose(1, 0, 2).reshape(T, -1), gemm)


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
    sliding_mask = None
    if "SlidingAttention" in a.layer_types:
        # Query i sees key j iff i - window < j <= i; a lone token too, once the window is full.
        keys_at, queries_at = mx.arange(start + T)[None, :], (mx.arange(T) + start)[:, None]
        sliding_mask = (keys_at <= queries_at) & (keys_at > queries_at - a.sliding_window)
    h = lookup(model.embed, ids)
    if model.embed_scale is not None:
        h = h * mx.array(model.embed_scale, dtype=mx.float32)
    for index, layer in enumerate(model.layers):
        if not layer.active:
            # A gated-off layer leaves the residual stream alone (spec §5); its slots stay unread.
            continue
        x = mx.fast.rms_norm(h, layer.input_norm, a.rms_norm_eps)
        attn_out = _attention_forward(model, layer.attn, x, cache, index,
                                      sliding_mask if layer.attn.sliding else mask, gemm)
        if layer.pre_ffn_norm is None:
            h = h + attn_out
            x = mx.fast.rms_norm(h, layer.post_norm, a.rms_norm_eps)
            h = h + layer.ffn(a, x, gemm)
        else:
            h = h + mx.fast.rms_norm(attn_out, layer.post_norm, a.rms_norm_eps)
            ffn_out = layer.ffn(a, mx.fast.rms_norm(h, layer.pre_ffn_norm, a.rms_norm_eps), gemm)
            if layer.post_ffn_norm is not None:
                ffn_out = mx.fast.rms_norm(ffn_out, layer.post_ffn_norm, a.rms_norm_eps)
            h = h + ffn_out
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
