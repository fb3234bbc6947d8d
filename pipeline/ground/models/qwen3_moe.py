"""Qwen3-MoE and Qwen2-MoE: a layer whose router is present is a sparse mixture of experts.

Semantics (spec §2.2): softmax over all router logits in float32, top-k with ties going to
the lower expert index, the k weights renormalised iff `norm_topk_prob`, the weighted sum
of the chosen experts, plus a shared expert scaled by sigmoid(shared_expert_gate @ x).
Experts are counted by presence (defragmented files keep a dense prefix); a task mask's
expert bits restrict routing, so the softmax is renormalised over the allowed experts.
"""

import numpy as np
import torch
from torch import nn

from pipeline.ground.errors import UnsupportedModel
from pipeline.ground.models.args import ModelArgs
from pipeline.ground.cmf.masks import TaskMask
from pipeline.ground.models.base import Decoder, GatedMLP, Weights, linear
from pipeline.ground.models.errors import ModelConfigError


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs, weights: Weights, prefix: str, expert_bits: np.ndarray | None):
        super().__init__()
        if args.moe is None:
            raise ModelConfigError(f"{weights.source}: {prefix}.gate.weight is a router but the header has no moe block")
        self.gate = linear(weights, f"{prefix}.gate", None, args.hidden_size)
        count = self.gate.weight.shape[0]
        present = 0
        while weights.has(f"{prefix}.experts.{present}.gate_proj.weight"):
            present += 1
        if present != count:
            raise ModelConfigError(
                f"{weights.source}: {prefix}.gate.weight routes to {count} experts but {present} are present"
            )
        self.experts = nn.ModuleList(GatedMLP(args, weights, f"{prefix}.experts.{e}", None) for e in range(count))
        allowed = np.ones(count, dtype=bool) if expert_bits is None else np.asarray(expert_bits[:count], dtype=bool)
        if not allowed.any():
            raise ModelConfigError(f"{prefix}: the task mask allows none of the {count} experts")
        self.allowed = None if allowed.all() else torch.tensor(allowed)
        self.top_k = min(args.moe.top_k, int(allowed.sum()))
        self.register_buffer("lower_index", torch.ones(count, count, dtype=torch.bool).tril(-1), persistent=False)
        self.norm_topk_prob = args.moe.norm_topk_prob
        self.shared_expert = None
        if weights.has(f"{prefix}.shared_expert.gate_proj.weight"):
            self.shared_expert = GatedMLP(args, weights, f"{prefix}.shared_expert", None)
            self.shared_expert_gate = linear(weights, f"{prefix}.shared_expert_gate", 1, args.hidden_size)

    def forward(self, x):
        logits = self.gate(x)
        if self.allowed is not None:
            logits = logits.masked_fill(~self.allowed, float("-inf"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        # Expert e is chosen iff fewer than k experts are ahead of it, where j is ahead of e
        # when p_j > p_e, or p_j == p_e and j < e (ties go to the lower index). Comparisons
        # and a sum, rather than sort or topk, so the tie rule holds in any converted graph.
        p_e, p_j = probs[..., :, None], probs[..., None, :]
        ahead = torch.logical_or(p_j > p_e, torch.logical_and(p_j == p_e, self.lower_index))
        chosen = ahead.sum(dim=-1) < self.top_k
        route = torch.where(chosen, probs, torch.zeros_like(probs))  # [1, T, experts], zero off the top-k
        if self.norm_topk_prob:
            route = route / route.sum(dim=-1, keepdim=True)
        if route.dtype != x.dtype:
            # The fp16 reference (pipeline.ground.models.fp16): the router's float32 softmax ends
            # at an op boundary, so its weights enter the fp16 path rounded once.
            route = route.to(x.dtype)
        # Every expert runs on every token and unchosen ones are weighted by exactly 0: no
        # data-dependent control flow, which a traced graph could not follow.
        out = route[..., 0:1] * self.experts[0](x)
        for e, expert in enumerate(self.experts[1:], start=1):
            out = out + route[..., e : e + 1] * expert(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Model(Decoder):
    def make_ffn(self, args: ModelArgs, weights: Weights, prefix: str, index: int, masks: TaskMask | None):
        if not weights.has(f"{prefix}.gate.weight"):
            return super().make_ffn(args, weights, prefix, index, masks)
        if masks is not None and not masks.ffn[index].all():
            # FFN rows address a dense FFN's neurons; on a router layer they have no defined target.
            raise UnsupportedModel(f"{weights.source}: the task mask switches off FFN neurons of MoE layer {index}")
        expert_bits = None if masks is None or masks.experts is None else masks.experts[index]
        return SparseMoeBlock(args, weights, prefix, expert_bits)
