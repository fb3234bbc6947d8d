"""Qwen3-MoE and Qwen2-MoE: a layer whose router is present is a sparse mixture of experts.

Semantics as the reference's (`pipeline.ground.models.qwen3_moe`, spec §2.2). A forward of a
few tokens runs the chosen experts of every token at once on `mx.gather_qmm` when all experts
share one plain packed layout; otherwise each expert runs on the tokens routed to it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from pipeline.ground.cmf.masks import TaskMask
from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models import ModelArgs
from pipeline.ground.models.errors import ModelConfigError
from mlx_runtime.models import base
from mlx_runtime.models.base import ACTIVATIONS, Mlp, Tensors, load_mlp, project
from mlx_runtime.weights import GROUP, Linear, Packed


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

    def _route(self, x: mx.array, gemm: bool) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids [T, k], weights [T, k]) on the host: softmax over all router logits, top-k
        with ties to the lower index (a stable sort), renormalised iff norm_topk_prob (spec §2.2)."""
        logits = project(self.router, x, gemm)
        if self.allowed is not None:
            logits = mx.where(self.allowed, logits, -mx.inf)
        probs = np.asarray(mx.softmax(logits, axis=-1, precise=True))
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, : self.top_k]
        top = np.take_along_axis(probs, chosen, axis=-1)
        if self.norm_topk_prob:
            top = top / top.sum(axis=-1, keepdims=True)
        return chosen, top

    def __call__(self, args: ModelArgs, x: mx.array, gemm: bool) -> mx.array:
        chosen, top = self._route(x, gemm)
        act = ACTIVATIONS[args.hidden_act]
        if self.stacked is not None and not gemm:
            s = self.stacked
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
                ye = self.experts[int(e)](args, x[mx.array(rows)], gemm)
                weight = mx.array(top[rows, slot][:, None])
                out = out.at[mx.array(rows)].add(ye * weight)
        if self.shared is not None:
            out = out + mx.sigmoid(project(self.shared_gate, x, gemm)) * self.shared(args, x, gemm)
        return out


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


def load_moe(t: Tensors, prefix: str, index: int, mask: TaskMask | None) -> Moe:
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
    experts = tuple(load_mlp(t, f"{prefix}.experts.{e}", None) for e in range(count))
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
        shared = load_mlp(t, f"{prefix}.shared_expert", None)
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


class Family(base.Family):
    @classmethod
    def make_ffn(cls, t: Tensors, prefix: str, index: int, mask: TaskMask | None) -> base.Ffn:
        if not t.has(f"{prefix}.gate.weight"):
            return super().make_ffn(t, prefix, index, mask)
        return load_moe(t, prefix, index, mask)
