"""The quality budget: how far from FP32 a user lets a package's intended numerics go (`--budget`)."""

from dataclasses import dataclass

from pipeline.ground.errors import CmfdeployError

from coreml.precisions import PRECISIONS

# The budget of a package whose user declares none is its precision's (`coreml.precisions`);
# FP32's is the default where no package is at hand.
DEFAULT_BUDGET = PRECISIONS["fp32"].default_budget
# A compressed package's, whatever its precision: a recipe's loss is judged by one budget on
# every target. fp16's own (ppl 0.5%, top-1 0.99) bounds fp16 rounding alone, which an
# uncompressed fp16 package must hold; no 8-bit code keeps top-1 at 0.99 (SmolLM2's int8
# per channel: +0.29%, 0.957), so under it an fp16 survey could never deploy a package.
COMPRESSED_BUDGET = DEFAULT_BUDGET


class BudgetError(CmfdeployError):
    """A `--budget` that does not parse."""


@dataclass(frozen=True)
class Budget:
    """How far from FP32 a user lets the package's intended numerics go (`--budget`)."""
    ppl: float = 0.02  # relative perplexity increase on the quality text
    top1: float = 0.95  # pooled top-1 agreement with FP32, at least
    kl: float | None = None  # mean KL(FP32 || package) in nats, at most
    items: float | None = None  # fraction of scoring items whose top-1 candidate changed, at most

    def spec(self) -> str:
        optional = [f"{key}={value:g}" for key, value in (("kl", self.kl), ("items", self.items)) if value is not None]
        return ",".join([f"ppl={self.ppl * 100:g}%", f"top1={self.top1:g}", *optional])


def parse_budget(text: str) -> Budget:
    """`ppl=2%,top1=0.95[,kl=0.01][,items=0.05]`; a percentage or a fraction where it is a fraction."""
    values = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if key not in Budget.__dataclass_fields__ or not value:
            raise BudgetError(f"--budget {text!r}: item {part!r} is not one of ppl=, top1=, kl=, items=")
        try:
            values[key] = float(value[:-1]) / 100 if value.endswith("%") else float(value)
        except ValueError:
            raise BudgetError(f"--budget {text!r}: {key} value {value!r} is not a number") from None
    return Budget(**values)
