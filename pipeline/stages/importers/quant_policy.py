"""Which CMF dtype each imported tensor gets: one default, overridable per role.

Roles: `embeddings` (model.embed_tokens), `lm_head`, `attention` (self_attn / linear_attn
projections), `mlp` (dense FFN and expert projections). Whatever the choice:
  - 1-D tensors and tensors under 32 elements (norms, biases, scalars) stay float: f32 in an
    f32 import, f16 otherwise (spec §3.1);
  - MoE routers (`mlp.gate`, `mlp.shared_expert_gate`) are treated the same way: a few
    thousand weights whose rounding moves every routing decision;
  - a dtype whose layout the tensor cannot take falls back as the spec's conversion rule
    does: the 2-D-only quants take q4_block for other ranks; the ones that need
    `in % 32 == 0` take q8_2f (vbit, vbit_ro) or q4_block (q4tp, q2tp) otherwise.
Each fallback is reported, so the importer records it in the provenance.
"""

import argparse
import math
import re
from dataclasses import dataclass, field

from pipeline.ground.errors import UnsupportedModel

ROLES = ("embeddings", "lm_head", "attention", "mlp")
# Dtypes an importer can encode to; the reserved ids and u8 are not weights.
CHOICES = ("f32", "f16", "bf16", "q8_row", "q8_2f", "q4_block", "q4_tiled", "q4tp", "q2tp",
           "vbit", "vbit_ro", "q1", "q1s", "q1t")  # fmt: skip
FLOAT_DTYPES = ("f32", "f16", "bf16")
_TWO_D_ONLY = {"q8_row", "q8_2f", "q4tp", "q2tp", "vbit", "vbit_ro", "q1t"}
_NEEDS_IN_32 = {"vbit": "q8_2f", "vbit_ro": "q8_2f", "q4tp": "q4_block", "q2tp": "q4_block"}
_Q1T_MAX_IN = 65536
_ROUTER = re.compile(r"\.mlp\.(gate|shared_expert_gate)\.weight$")


def role_of(name: str) -> str | None:
    if name == "model.embed_tokens.weight":
        return "embeddings"
    if name == "lm_head.weight":
        return "lm_head"
    if ".self_attn." in name or ".linear_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    return None


@dataclass(frozen=True)
class QuantPolicy:
    default: str = "f16"
    overrides: dict[str, str] = field(default_factory=dict)  # role -> dtype name

    def __post_init__(self):
        for role, dtype in (("default", self.default), *self.overrides.items()):
            if role != "default" and role not in ROLES:
                raise UnsupportedModel(f"quant policy: unknown role {role!r}; roles are {ROLES}")
            if dtype not in CHOICES:
                raise UnsupportedModel(f"quant policy: {role} dtype {dtype!r} is not one of {CHOICES}")

    @property
    def float_dtype(self) -> str:
        """What norms, biases and other small tensors are stored as."""
        return "f32" if self.default == "f32" else "f16"

    def choose(self, name: str, shape: tuple[int, ...]) -> tuple[str, str | None]:
        """`(dtype, fallback_reason)` for one tensor; the reason is None when the policy's choice held."""
        if len(shape) <= 1 or math.prod(shape) < 32 or _ROUTER.search(name):
            return self.float_dtype, None
        wanted = self.overrides.get(role_of(name), self.default)
        if wanted in _TWO_D_ONLY and len(shape) != 2:
            return "q4_block", f"{wanted} needs a 2-D tensor, shape is {list(shape)}"
        if wanted in _NEEDS_IN_32 and shape[1] % 32:
            return _NEEDS_IN_32[wanted], f"{wanted} needs in % 32 == 0, in is {shape[1]}"
        if wanted == "q1t" and shape[1] > _Q1T_MAX_IN:
            return "q1s", f"q1t needs in <= {_Q1T_MAX_IN}, in is {shape[1]}"
        return wanted, None

    def as_dict(self) -> dict:
        return {"default": self.default, "overrides": dict(sorted(self.overrides.items()))}


def add_quant_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quant", default="f16", choices=CHOICES, help="dtype of the weight matrices (default f16)")
    for role in ROLES:
        parser.add_argument(f"--{role.replace('_', '-')}", dest=f"quant_{role}", choices=CHOICES,
                            help=f"dtype of the {role} tensors (default: --quant)")


def policy_from_args(args: argparse.Namespace) -> QuantPolicy:
    overrides = {role: getattr(args, f"quant_{role}") for role in ROLES if getattr(args, f"quant_{role}")}
    return QuantPolicy(args.quant, overrides)
