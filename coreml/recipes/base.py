"""The recipe unit: a typed, registered compression recipe and the steps it gives each weight.

    register_recipe(CodeRecipe("int4-b32", code=Affine(4)))
    RECIPES["int4-b32"].params_record()     # what the manifest records, verbatim
    RECIPES["int4-b32"].steps(weight)       # {"code": Affine(4)}

A step is a `Code` (numpy codes from `coreml.codes`, written as constexpr ops by
`coreml.recipes.emit`) or coremltools' own linear quantizer (`coreml.recipes.linear`).
`Recipe.prepare` readies a recipe for one package's weights, measuring on calibration text
through `Context` when it must, and returns a `Prepared`: how each weight is selected, the
encoders that replace a code step's data-free fit, and what the recipe adds to the
selection record. `coreml.recipes.compress` applies every recipe the same way.
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np

from coreml import calibration
from coreml.cache import ResultCache
from coreml.calibration import Calibration
from pipeline.ground.errors import CmfdeployError
from pipeline.ground.registry import Registry

WEIGHT_THRESHOLD = 2048
EMBEDDING = "model.embed_tokens.weight"
# Ops whose weight axes are (output 0, input 1), as coremltools' own axis inference has it.
WEIGHT_CONSUMERS = ("linear", "gather")
# The numpy dtype a code stores its scales, offsets or LUT in.
STORAGE = {"fp16": np.float16, "fp32": np.float32}

Encoder = Callable[[np.ndarray], object]


class RecipePrecondition(CmfdeployError):
    """A recipe cannot be applied as written to this package (never silently skipped)."""


class UnknownRecipe(CmfdeployError):
    """The recipe name is not in the table."""


class RecipeRegistry(CmfdeployError):
    """The recipe order does not list every registered recipe once."""


@dataclass(frozen=True)
class Weight:
    """A constant of the program: its MIL name, the HF names it carries, shape and consumers.

    `rows`: a part of a split head (`package.head_split`) holds rows [start, stop) of its HF
    tensor, not the whole of it. A step codes it as it codes that tensor (each output row's
    code depends on its own row alone, and a Hessian or moments on the input columns, which
    the parts share); a recipe that needs the whole tensor refuses it (`whole_tensors`)."""

    name: str
    hf_names: tuple[str, ...]
    shape: tuple[int, ...]
    consumers: tuple[str, ...]  # op types
    uses: tuple[tuple[str, str], ...]  # (consumer op name, input parameter) pairs
    rows: tuple[int, int] | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def group(self) -> str:
        """The decoder layer (`layers.3`) this weight belongs to, or its own name."""
        name = self.hf_names[0] if self.hf_names else self.name
        parts = name.split(".")
        return ".".join(parts[1:3]) if parts[:2] == ["model", "layers"] else name


class Step(ABC):
    """One way a weight is compressed. `kind` names the mechanism that writes it (`code`:
    our numpy codes, `quantize`: coremltools); `record()` is its params as recorded."""

    kind: ClassVar[str]

    @abstractmethod
    def record(self) -> dict:
        """The step's params as the manifest records them."""

    @abstractmethod
    def bits(self, shape: tuple[int, ...]) -> float:
        """Storage of a weight of `shape`: codes plus every scale, offset and LUT."""

    @abstractmethod
    def encode(self, value: np.ndarray) -> object:
        """What the step stores for `value`: a `coreml.codes` code or a float16 array (for
        coremltools' quantizer, the values its step decodes to)."""

    def for_shape(self, shape: tuple[int, ...]) -> "Step":
        """The step as it applies to a weight of `shape` (itself, unless its params follow the shape)."""
        return self


class Code(Step):
    """A step whose codes are computed in numpy and written as constexpr ops."""

    kind = "code"


def whole_tensors(recipe: str, weights: list[Weight]) -> None:
    """Refuse a head split into parts for `recipe`, which codes or measures whole HF tensors
    (the CMF's own codes, a plan whose KL swaps whole tensors into the reference)."""
    parts = [w for w in weights if w.rows is not None]
    if parts:
        raise RecipePrecondition(
            f"recipe {recipe}: {parts[0].name} holds rows {list(parts[0].rows)} of {parts[0].hf_names[0]} "
            f"(a head split into {len(parts)} parts for the Neural Engine's axis limit), and this recipe codes "
            "whole tensors; convert with a part width of at least the vocabulary, or take a per-row recipe")


def precondition(weight: Weight, params: dict) -> str | None:
    """Why a step of `params` cannot compress `weight`, or None when it can."""
    unknown = sorted(set(weight.consumers) - set(WEIGHT_CONSUMERS))
    if unknown or len(weight.shape) != 2:
        return f"rank {len(weight.shape)}, consumers {list(weight.consumers)}: axes unknown for ops {unknown}"
    if "block_size" in params and weight.shape[1] % params["block_size"]:
        return f"input axis {weight.shape[1]} not divisible by block_size {params['block_size']}"
    for axis, size in enumerate(params.get("tile", ())):
        if weight.shape[axis] % size:
            return f"{('output', 'input')[axis]} axis {weight.shape[axis]} not divisible by LUT tile {size}"
    return None


def describe(steps: Mapping[str, Step]) -> str:
    """`code kind=affine,nbits=4,...` per step, as the selection record's `how` says it."""
    return " + ".join(f"{kind} {describe_params(step.record())}" for kind, step in steps.items())


def describe_params(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items() if k != "weight_threshold")


def carried(name: str, code, reference: np.ndarray) -> Encoder:
    """An encoder that returns `code`, made from `reference`, for a constant that must equal it."""
    def encode(value: np.ndarray):
        if value.shape != reference.shape or not np.array_equal(value, reference):
            raise RecipePrecondition(f"constant {name}: the package's value differs from the tensor its code was "
                                     f"made from (a package of other weights than its upstream's)")
        return code
    return encode


class Selected(NamedTuple):
    """What a recipe does to one weight: its steps (none: left as it is) and the fields its
    selection record adds (`compressed`, and `how` or `reason`)."""

    steps: dict[str, Step]
    entry: dict


@dataclass
class Prepared:
    """A recipe readied for one package's weights."""

    select: Callable[[Weight], Selected]
    encoders: dict[str, Encoder] = field(default_factory=dict)  # MIL name -> replaces its code step's fit
    record: dict = field(default_factory=dict)  # added to the manifest's `selection`


@dataclass(frozen=True)
class Context:
    """What a recipe may look at beyond the program's weights: the package, its verified
    manifest, and calibration text, measured only when a recipe asks."""

    package_dir: Path
    manifest: dict
    calibration_ids: np.ndarray | None
    bpw: float  # the mixed recipe's budget in bits per weight
    shared_cache: Path | None = None  # Hessians, codes and centres shared with other recipes' (`coreml.cache`)

    def results(self) -> ResultCache | None:
        """The folder of results shared with the other recipes of one survey; None outside one."""
        return None if self.shared_cache is None else ResultCache(self.shared_cache)

    def calibration(self, windows: int = calibration.WINDOWS) -> Calibration:
        """The reference model of the package's upstream on `windows` calibration windows."""
        return Calibration.from_package(self.package_dir, self.manifest, self.calibration_ids, windows, self.results())


@dataclass(frozen=True)
class Recipe(ABC):
    """A named compression recipe. `params()` is its table row as the manifest records it;
    `calibration` recipes measure on calibration text and refuse without it."""

    name: str
    calibration: ClassVar[bool] = False

    @abstractmethod
    def params(self) -> dict:
        """The recipe's table row: what each of its steps records."""

    def params_record(self) -> dict:
        """The params the manifest and the survey record, verbatim."""
        return {**self.params(), **({"calibration": True} if self.calibration else {})}

    @abstractmethod
    def prepare(self, weights: list[Weight], context: Context) -> Prepared:
        """This recipe readied for `weights`: how it selects each one, with any encoders it
        computed from `context` (calibration, the source CMF)."""

    def after_codes(self, program) -> bool:
        """A pass over `program` once its code steps are written (none by default); whether it
        changed what the codes decode to (then what they decode to is coremltools', and the
        recipe's own record of each decoding, `decoded_sha256`, is dropped)."""
        return False


@dataclass(frozen=True)
class StepRecipe(Recipe):
    """A recipe that gives each weight fixed steps (the mixed recipe picks among these)."""

    @abstractmethod
    def steps(self, weight: Weight) -> dict[str, Step]:
        """The steps this recipe gives `weight`, before any calibration."""

    def estimated_bits(self, weight: Weight) -> float:
        """Storage of `weight` under this recipe (the tied embedding by its own step, if any)."""
        (step,) = self.steps(weight).values()
        return step.bits(weight.shape)

    def encoders(self, weights: list[Weight], calib: Calibration) -> dict[str, Encoder]:
        """MIL name -> an encoder fitted on `calib` that replaces the code step's data-free fit
        (none by default; the mixed recipe codes its options' weights through these)."""
        return {}

    def describe(self, steps: Mapping[str, Step]) -> str:
        return describe(steps)

    def select(self, weight: Weight, as_part_of: str | None = None) -> Selected:
        """`weight`'s steps, checked up front; raises `RecipePrecondition` naming the weight and
        the recipe (`as_part_of`: the recipe that chose this one for the weight)."""
        steps = self.steps(weight)
        for kind, step in steps.items():
            reason = precondition(weight, step.record())
            if reason:
                raise RecipePrecondition(
                    f"recipe {as_part_of or self.name}: weight {weight.name} ({', '.join(weight.hf_names)}, "
                    f"shape {list(weight.shape)}) cannot be compressed by step {kind}: {reason}"
                )
        return Selected(steps, {"compressed": True, "how": self.describe(steps)})

    def prepare(self, weights: list[Weight], context: Context) -> Prepared:
        """Data-free: each weight's steps are fixed, and nothing is read from `context`."""
        return Prepared(self.select)


@dataclass(frozen=True)
class CodeRecipe(StepRecipe):
    """One code step for every selected weight, and the tied embedding/head's own if given."""

    code: Code
    embedding: Code | None = None

    def params(self) -> dict:
        return {"code": self.code.record(), **({"embedding": self.embedding.record()} if self.embedding else {})}

    def steps(self, weight: Weight) -> dict[str, Step]:
        if self.embedding is not None and EMBEDDING in weight.hf_names:
            return {"code": self.embedding.for_shape(weight.shape)}
        return {"code": self.code.for_shape(weight.shape)}


# name -> recipe, in the order surveys list them (`order_recipes`).
RECIPES: Registry[Recipe] = Registry("recipe", UnknownRecipe)


def register_recipe(recipe: Recipe) -> Recipe:
    return RECIPES.add(recipe.name, recipe)


def order_recipes(names: Iterable[str]) -> None:
    """Put RECIPES in the order of `names`, which lists every registered recipe once."""
    names = list(names)
    if sorted(names) != sorted(RECIPES):
        raise RecipeRegistry(f"coreml/recipes: recipe order {names} does not list the registered recipes "
                             f"{sorted(RECIPES)} once each")
    ordered = {name: RECIPES[name] for name in names}
    RECIPES.clear()
    RECIPES.update(ordered)
