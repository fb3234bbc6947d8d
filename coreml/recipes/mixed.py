"""The mixed recipe: per decoder layer (and the embedding on its own) one of its options,
chosen under a budget of bits per weight. Its options are other registered recipes.

Why it is built this way (docs/COMPRESSION.md, "Why mixed lost to its own options"): a
chooser under a budget must never lose to one of its options applied everywhere at that
budget. So the options include the GPTQ recipes; the plan minimises the summed per-group
calibration KL exactly (a knapsack over the groups, not a per-bit greedy along one chain of
options); and the plan is then measured as a whole, beside every option that fits the
budget applied uniformly, on the same calibration text: the lowest joint KL is stored.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass, replace

import numpy as np

from coreml import calibration
from coreml.calibration import Calibration
from pipeline.ground.pages import release_pages
from pipeline.ground.scratch import ScratchFile
from coreml.recipes.base import (RECIPES, WEIGHT_THRESHOLD, Context, Encoder, Prepared, Recipe, RecipePrecondition,
                                 StepRecipe, Weight, carried, precondition, register_recipe)

# Default budget of the mixed recipe in bits per weight, counted as mlx-lm and Core ML count
# (every stored byte of codes, scales, offsets and LUTs, x 8, over the parameter count).
MIXED_BPW = 4.5
PLAN = "plan"  # the name of the per-group plan among the candidates the chooser compares


@dataclass(frozen=True)
class MixedRecipe(Recipe):
    """Per group, the option that minimises the summed calibration KL within the budget, kept
    only if the whole plan measures better than each uniform option that fits."""

    calibration = True
    options: tuple[str, ...]
    group: str
    measure: str
    bpw: float | None = None  # the recipe's own budget; None: the survey's (`--mixed-bpw`, else MIXED_BPW)

    def params(self) -> dict:
        return {"mixed": {"options": list(self.options), "group": self.group, "measure": self.measure,
                          **({"bpw": self.bpw} if self.bpw is not None else {})}}

    def prepare(self, weights: list[Weight], context: Context) -> Prepared:
        bpw = context.bpw if self.bpw is None else self.bpw
        below = sum(w.size for w in weights if w.hf_names and w.size <= WEIGHT_THRESHOLD)
        _require_budget(_groups(weights), _budget_bits(weights, bpw, below), self.options)  # before measuring
        calib = context.calibration(calibration.HESSIAN_WINDOWS)
        record, cached = mixed_plan(weights, calib, bpw, below, self.options)
        by_name = {w.name: w for w in weights}
        return Prepared(
            lambda weight: RECIPES[record["choices"][weight.group]].select(weight, as_part_of=self.name),
            {n: carried(n, c, _value(calib, by_name[n])) for n, c in cached.items()},
            {"mixed": record})


def _value(calib: Calibration, weight: Weight) -> np.ndarray:
    """The tensor the package holds as `weight`: its HF tensor, or the rows a part of a split head holds."""
    value = calib.weight(weight.hf_names[0])
    return value if weight.rows is None else value[weight.rows[0]:weight.rows[1]]


MIXED = register_recipe(MixedRecipe(
    "mixed", options=("gptq-int4-b64", "gptq-int4-b32-zp", "gptq-int4-b32-zp-hot", "gptq-int4-b32", "gptq-int4-b64-emb8",
                      "int8-b32-fp16scale"),
    group="decoder layer (embedding on its own)",
    measure="calibration logit KL: per group coded alone (summed, minimised exactly under the budget), then the "
            "plan and every uniform option that fits, each coded whole"))
# The same chooser among what the Neural Engine reads (issue 48): row-scaled GPTQ palettes, 4-bit
# per 32 rows (4 + 24/cols bits; the tied table per 32 x 32 tile, 4.25 + 16/cols) and 6-bit per 16 rows
# (6 + 80/cols), and int8 per channel (8 + 16/cols), per decoder layer and for the
# table (with its head parts) on its own; at the survey's budget (4.5 bits by default) and at 6
# bits. The row-scaled palettes err less than the unscaled ones at fewer bits (coreml.recipes.
# palette), which were its options before.
MIXED_PALETTE = register_recipe(replace(
    MIXED, name="mixed-palette", options=("palette4-gptq-g32-pcs", "palette6-gptq-g16-pcs", "int8-pc")))
register_recipe(replace(MIXED_PALETTE, name="mixed-palette-6", bpw=6.0))


def _groups(weights: list[Weight]) -> dict[str, list[Weight]]:
    groups: dict[str, list[Weight]] = {}
    for weight in weights:
        if weight.hf_names and weight.size > WEIGHT_THRESHOLD:
            groups.setdefault(weight.group, []).append(weight)
    return groups


def choose_mixed(
    weights: list[Weight],
    measure: Callable[[str, str], float],
    budget_bits: float,
    options: tuple[str, ...] = MIXED.options,
    measure_whole: Callable[[dict[str, str]], float] | None = None,
) -> dict:
    """Choose one option per group (decoder layer, or the embedding) under `budget_bits`.

    `measure(group, option)` is the error (logit KL on calibration text) of the model with
    only that group coded by that option. The plan minimises the sum of these errors within
    the budget, exactly: a multiple-choice knapsack solved on its Pareto front of (bits,
    error) over the groups taken one by one. `measure_whole(choices)` is the error of the
    model with every group coded as `choices` says; given, it measures the plan and every
    option that fits the budget applied to all groups, and the lowest error wins (a uniform
    option on a tie), so interactions between groups the sum misses cannot make the chooser
    lose to one of its own options. Raises `RecipePrecondition` when nothing fits.
    """
    groups = _groups(weights)
    names = sorted(groups)
    cost = _require_budget(groups, budget_bits, options)
    error = {(g, o): float(measure(g, o)) if np.isfinite(cost[g, o]) else np.inf for g in names for o in options}
    plan = _knapsack(names, options, cost, error, budget_bits)
    uniform = {o: {g: o for g in names} for o in options if sum(cost[g, o] for g in names) <= budget_bits}
    candidates = {**uniform, PLAN: plan}
    bits = {name: sum(cost[g, c[g]] for g in names) for name, c in candidates.items()}
    summed = {name: sum(error[g, c[g]] for g in names) for name, c in candidates.items()}
    if measure_whole is None:
        chosen, whole = PLAN, {}
    else:
        measured: dict[tuple, float] = {}  # a plan that is one option everywhere is measured once
        for c in candidates.values():
            key = tuple(sorted(c.items()))
            if key not in measured:
                measured[key] = float(measure_whole(c))
        whole = {name: measured[tuple(sorted(c.items()))] for name, c in candidates.items()}
        # A tie goes to the uniform option (one recipe, and its own survey row says what it costs).
        chosen = min(candidates, key=lambda name: (whole[name], name == PLAN, bits[name]))
    return {
        "choices": dict(candidates[chosen]),
        "chosen": chosen,
        "candidates": {name: {"estimated_bits": bits[name], "summed_group_error": summed[name],
                              **({"measured_error": whole[name]} if whole else {})} for name in candidates},
        "plan": plan,
        # None: the option cannot code that group (its block does not divide an input axis).
        "measured_error": {g: {o: error[g, o] if np.isfinite(error[g, o]) else None for o in options} for g in names},
        "budget_bits": budget_bits,
        "estimated_bits": bits[chosen],
    }


def _budget_bits(selected: list[Weight], bpw: float, below_elements: int) -> float:
    """Bits the selected weights may take for `bpw` over every bundle parameter, the uncompressed
    ones (norms and matrices of at most WEIGHT_THRESHOLD elements, `below_elements`) at 32 bits."""
    total = sum(w.size for ws in _groups(selected).values() for w in ws) + below_elements
    return bpw * total - 32 * below_elements


def _require_budget(groups: dict[str, list[Weight]], budget_bits: float, options: tuple[str, ...]) -> dict:
    """(group, option) -> bits; raises `RecipePrecondition` when the smallest choice per group exceeds the budget."""
    cost = {(g, o): sum(_bits(RECIPES[o], w) for w in ws) for g, ws in groups.items() for o in options}
    least = sum(min(cost[g, o] for o in options) for g in groups)
    if least > budget_bits:
        smallest = min(options, key=lambda o: sum(cost[g, o] for g in groups))
        raise RecipePrecondition(
            f"recipe mixed: the smallest choice ({smallest} everywhere, or the smallest option per group) needs "
            f"{least:.0f} bits, over the budget of {budget_bits:.0f}"
        )
    return cost


def _bits(recipe: StepRecipe, weight: Weight) -> float:
    """`weight`'s storage under `recipe`, infinite where its step cannot code it (a block that
    does not divide the input axis): that option is not one the group can take."""
    (step,) = recipe.steps(weight).values()
    return np.inf if precondition(weight, step.record()) else recipe.estimated_bits(weight)


def _knapsack(names: list[str], options: tuple[str, ...], cost: dict, error: dict, budget: float) -> dict[str, str]:
    """The choice per group of least summed error with summed cost within `budget`.

    The front after each group holds, for every reachable total cost, the least total error,
    pruned to the plans no other plan beats on both; a plan's choices are read back through
    each front's parent links. Among plans of equal error the cheaper one is kept.
    """
    front_cost, front_error = np.zeros(1), np.zeros(1)
    links = []
    for g in names:
        c = (front_cost[:, None] + np.array([cost[g, o] for o in options])[None, :]).ravel()
        e = (front_error[:, None] + np.array([error[g, o] for o in options])[None, :]).ravel()
        parent, option = np.divmod(np.arange(c.size), len(options))
        fits = np.flatnonzero(c <= budget)
        order = fits[np.lexsort((e[fits], c[fits]))]
        best_before = np.minimum.accumulate(np.concatenate([[np.inf], e[order]]))[:-1]
        keep = order[e[order] < best_before]
        front_cost, front_error = c[keep], e[keep]
        links.append((parent[keep], option[keep]))
    index = int(np.argmin(front_error))  # the front is sorted by cost: the cheapest of the least errors
    plan = {}
    for g, (parent, option) in zip(reversed(names), reversed(links)):
        plan[g] = options[option[index]]
        index = parent[index]
    return dict(sorted(plan.items()))


def _decoded(code) -> np.ndarray:
    return code.decode() if hasattr(code, "decode") else np.asarray(code, np.float32)


def _held(code, scratch: ScratchFile):
    """`code` (a code dataclass, or a plain array) with its arrays in `scratch`."""
    if not is_dataclass(code):
        return scratch.hold(code)
    return replace(code, **{f.name: scratch.hold(getattr(code, f.name)) for f in fields(code)
                            if isinstance(getattr(code, f.name), np.ndarray)})


def _released(code) -> None:
    """Drop the pages of `code`'s arrays (held in a scratch file) from this process: they stay
    in the file's page cache, and a later read maps them again. Every option's codes stayed
    resident once written or read, 2.2 GB of the process's total RSS on SmolLM2-135M."""
    arrays = [getattr(code, f.name) for f in fields(code)] if is_dataclass(code) else [code]
    for array in arrays:
        if isinstance(array, np.ndarray):
            release_pages(array)


def _step_key(recipe: StepRecipe, weight: Weight) -> str:
    """What the option's step for `weight` is: options that give a weight the same step share its codes."""
    (step,) = recipe.steps(weight).values()
    return f"{type(step).__name__}:{sorted(step.record().items())}"


class OptionCodes:
    """Each option's codes for the selected weights, computed once from the reference model's
    tensors by the option's own encoder (GPTQ with the calibration Hessians where the option
    is GPTQ), and the calibration KL of the model with a choice of them swapped in.

    Every option's codes of every weight are kept for the measurements, and each measurement
    swaps in a whole model's decoded weights: on Gemma 3, 5 options' codes and a 1 GB decoded
    model. Both are held in scratch files' maps (pipeline.ground.scratch), each made one weight
    at a time, so the process's own memory holds one weight's worth of them."""

    def __init__(self, weights: list[Weight], calib: Calibration, options: tuple[str, ...]):
        self.calib, self.options = calib, options
        self.groups = _groups(weights)
        self.selected = [w for ws in self.groups.values() for w in ws]
        self._encoders: dict[tuple[str, str], Encoder] = {}
        for option in options:
            recipe = RECIPES[option]
            fits = [w for w in self.selected if np.isfinite(_bits(recipe, w))]
            calibrated = recipe.encoders(fits, calib)
            for w in fits:
                (step,) = recipe.steps(w).values()
                self._encoders.setdefault((w.name, _step_key(recipe, w)), calibrated.get(w.name, step.encode))
        self._codes: dict[tuple[str, str], object] = {}
        self._codes_file = ScratchFile()
        self._group_errors: dict[tuple, float] = {}

    def code(self, weight: Weight, option: str):
        key = (weight.name, _step_key(RECIPES[option], weight))
        if key not in self._codes:
            self._codes[key] = _held(self._encoders[key](_value(self.calib, weight)), self._codes_file)
            _released(self._codes[key])
        return self._codes[key]

    def decoded(self, choices: dict[str, str]) -> dict[str, np.ndarray]:
        """HF name -> the decoded weight of every group `choices` names, coded by its choice
        (in a scratch file of this call's own, gone with the arrays); the parts of a split head
        written into their rows of the whole tensor."""
        scratch, decoded = ScratchFile(), {}
        for group, weights in self.groups.items():
            for w in weights if group in choices else ():
                code = self.code(w, choices[group])
                if w.rows is None:
                    array = scratch.hold(_decoded(code))
                else:
                    name = w.hf_names[0]
                    if name not in decoded:
                        decoded[name] = scratch.empty(self.calib.original[name].shape, np.float32)
                    array = decoded[name]
                    array[w.rows[0]:w.rows[1]] = _decoded(code)
                _released(code)
                decoded.update((name, array) for name in w.hf_names)
        return decoded

    def group_error(self, group: str, option: str) -> float:
        """Calibration KL with only `group` coded by `option` (options that code it alike: measured once)."""
        key = (group, tuple(_step_key(RECIPES[option], w) for w in self.groups[group]))
        if key not in self._group_errors:
            self._group_errors[key] = self.calib.kl_with(self.decoded({group: option}))
        return self._group_errors[key]

    def whole_error(self, choices: dict[str, str]) -> float:
        return self.calib.kl_with(self.decoded(choices))

    def plan(self, bpw: float, below_elements: int, options: tuple[str, ...] | None = None) -> tuple[dict, dict]:
        """(the chooser's record, MIL name -> code for `code` steps) for `bpw` bits per weight
        among `options` (default: all of this object's); the budget counts every bundle
        parameter, the uncompressed ones (norms and matrices of at most WEIGHT_THRESHOLD
        elements, `below_elements`) at their 32 bits."""
        chosen = choose_mixed(self.selected, self.group_error, _budget_bits(self.selected, bpw, below_elements),
                              options or self.options, measure_whole=self.whole_error)
        chosen["bpw_budget"] = bpw
        codes_by_name = {w.name: self.code(w, chosen["choices"][w.group]) for w in self.selected
                         if "code" in RECIPES[chosen["choices"][w.group]].steps(w)}
        return chosen, codes_by_name


def mixed_plan(weights: list[Weight], calib: Calibration, bpw: float, below_elements: int,
               options: tuple[str, ...] = MIXED.options) -> tuple[dict, dict]:
    """(the chooser's record, MIL name -> code for `code` steps) for `bpw` bits per weight
    (`OptionCodes.plan`)."""
    return OptionCodes(weights, calib, options).plan(bpw, below_elements)
