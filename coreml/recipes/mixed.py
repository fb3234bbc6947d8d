"""The mixed recipe: one option per decoder layer (the embedding on its own), chosen from
each group's measured sensitivity (calibration logit KL with only that group coded) under a
budget of bits per weight. Its options are other registered recipes."""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from coreml.calibration import Calibration
from coreml.recipes.base import (RECIPES, WEIGHT_THRESHOLD, Context, Prepared, Recipe, RecipePrecondition, Weight,
                                 carried, register_recipe)

# Default budget of the mixed recipe in bits per weight, counted as mlx-lm and Core ML count
# (every stored byte of codes, scales, offsets and LUTs, x 8, over the parameter count).
MIXED_BPW = 4.5


@dataclass(frozen=True)
class MixedRecipe(Recipe):
    """Per group, the option with the best error drop per bit that the budget allows."""

    calibration = True
    options: tuple[str, ...]
    group: str
    measure: str

    def params(self) -> dict:
        return {"mixed": {"options": list(self.options), "group": self.group, "measure": self.measure}}

    def prepare(self, weights: list[Weight], context: Context) -> Prepared:
        calib = context.calibration()
        below = sum(w.size for w in weights if w.hf_names and w.size <= WEIGHT_THRESHOLD)
        record, cached = mixed_plan(weights, calib, context.bpw, below, self.options)
        by_name = {w.name: w for w in weights}
        return Prepared(
            lambda weight: RECIPES[record["choices"][weight.group]].select(weight, as_part_of=self.name),
            {n: carried(n, c, calib.weight(by_name[n].hf_names[0])) for n, c in cached.items()},
            {"mixed": record})


MIXED = register_recipe(MixedRecipe("mixed", options=("palette4-gc32", "int4-b32", "int8-b32"),
                                    group="decoder layer (embedding on its own)",
                                    measure="calibration logit KL, one group coded at a time"))


def choose_mixed(
    weights: list[Weight],
    measure: Callable[[str, str], float],
    budget_bits: float,
    options: tuple[str, ...] = MIXED.options,
) -> dict:
    """Choose one option per group (decoder layer, or the embedding) under `budget_bits`.

    `measure(group, option)` is the error (logit KL on calibration text) of the model with
    only that group compressed by that option. Start every group at the smallest option,
    then repeatedly take the upgrade with the largest error drop per extra bit that still
    fits the budget. Raises `RecipePrecondition` when even the smallest choice exceeds it.
    """
    groups: dict[str, list[Weight]] = {}
    for weight in weights:
        if weight.hf_names and weight.size > WEIGHT_THRESHOLD:
            groups.setdefault(weight.group, []).append(weight)
    cost = {(g, o): sum(RECIPES[o].estimated_bits(w.shape) for w in ws) for g, ws in groups.items() for o in options}
    by_size = sorted(options, key=lambda o: sum(cost[g, o] for g in groups))
    error = {(g, o): float(measure(g, o)) for g in groups for o in options}
    level = {g: 0 for g in groups}
    total = sum(cost[g, by_size[0]] for g in groups)
    if total > budget_bits:
        raise RecipePrecondition(
            f"recipe mixed: the smallest choice ({by_size[0]} everywhere) needs {total:.0f} bits, "
            f"over the budget of {budget_bits:.0f}"
        )
    while True:
        upgrades = []
        for g in groups:
            if level[g] + 1 < len(by_size):
                now, nxt = by_size[level[g]], by_size[level[g] + 1]
                extra = cost[g, nxt] - cost[g, now]
                if total + extra <= budget_bits:
                    upgrades.append(((error[g, now] - error[g, nxt]) / max(extra, 1.0), g, extra))
        if not upgrades:
            break
        gain, group, extra = max(upgrades)
        if gain <= 0:
            break
        level[group] += 1
        total += extra
    return {
        "choices": {g: by_size[level[g]] for g in sorted(groups)},
        "measured_error": {g: {o: error[g, o] for o in options} for g in sorted(groups)},
        "budget_bits": budget_bits,
        "estimated_bits": total,
    }


def _decoded(code) -> np.ndarray:
    return code.decode() if hasattr(code, "decode") else np.asarray(code, np.float32)


def mixed_plan(weights: list[Weight], calib: Calibration, bpw: float, below_elements: int,
               options: tuple[str, ...] = MIXED.options) -> tuple[dict, dict]:
    """(the chooser's record, MIL name -> code for `code` steps) for `bpw` bits per weight.

    Each group's sensitivity is the calibration KL with only that group's weights coded by
    the option (from the reference model's tensor); the budget counts every bundle
    parameter, the uncompressed ones (norms and matrices of at most WEIGHT_THRESHOLD
    elements, `below_elements`) at their 32 bits.
    """
    selected = [w for w in weights if w.hf_names and w.size > WEIGHT_THRESHOLD]
    cache = {(w.name, o): _reference_code(calib, w, RECIPES[o]) for w in selected for o in options}

    def measure(group: str, option: str) -> float:
        return calib.kl_with({n: _decoded(cache[w.name, option]) for w in selected if w.group == group
                              for n in w.hf_names})

    total = sum(w.size for w in selected) + below_elements
    chosen = choose_mixed(selected, measure, bpw * total - 32 * below_elements, options)
    chosen["bpw_budget"] = bpw
    codes_by_name = {w.name: cache[w.name, chosen["choices"][w.group]] for w in selected
                     if "code" in RECIPES[chosen["choices"][w.group]].steps(w)}
    return chosen, codes_by_name


def _reference_code(calib: Calibration, weight: Weight, recipe: Recipe) -> object:
    """What `recipe`'s step stores for `weight`, computed from the reference model's tensor."""
    (step,) = recipe.steps(weight).values()
    return step.encode(calib.weight(weight.hf_names[0]))
