"""Loader interfaces, one registered unit each: the input, state and output names, dtypes and
metadata a Swift loader asserts of a stateful package (`cmfdeploy coreml --interface NAME`,
make's `INTERFACE=`). docs/INTERFACES.md has what each loader reads, with the file and line of
its source where it does.

    INTERFACES["causal-lm"].mask_input      # "causal_mask": an additive fp16 mask instead of `position`
    INTERFACES["swift-transformers"].key_cache   # "keyCache"
    step_inputs(unit, ids, position)        # one call's inputs, the mask built from the position

A mask interface's package derives the position of its first query from the mask's shape:
key columns - T - `mask_extra_columns`, and adds the mask over the slots it covers on top of its
own causal (and sliding-window) mask, so a loader's mask can hide more than causality does,
never less. The gates feed every interface through `step_inputs`, the mask a causal one built
from the position, so a package of any interface is held to the same torch reference. Like the
precisions, this imports neither torch nor coremltools.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from coreml.precisions import POSITION_INPUT
from pipeline.ground.errors import CmfdeployError
from pipeline.ground.registry import Registry

DEFAULT_INTERFACE = "cmfdeploy"
# Both Swift recipes declare their mask fp16; CoreMLPipelines fills it with 0 (attend) and
# -Float16.greatestFiniteMagnitude (hide), fp16's lowest finite value (docs/INTERFACES.md).
MASK_DTYPE = "float16"
HIDDEN = np.finfo(np.float16).min


class UnknownInterface(CmfdeployError):
    """An interface no unit of coreml.interfaces registers."""


class InterfaceMismatch(CmfdeployError):
    """An interface asked of a conversion it cannot shape (no kind it shapes, or a precision whose
    float outputs its loader does not read)."""


@dataclass(frozen=True)
class Interface:
    """The names a loader reads, and what it fixes beyond them."""

    name: str
    description: str
    loader: str  # the code that loads a package of this interface
    token_input: str
    mask_input: str | None  # None: the `position` input, int32 [1]
    key_cache: str
    value_cache: str
    # Key columns the loader's mask has beyond the keys it attends (swift-transformers 1.3: one).
    mask_extra_columns: int = 0
    # The logits dtype the loader reads; None: the precision's float dtype.
    logits_dtype: str | None = None
    # One function ("main", Core ML's default) taking 1..context tokens as a range and returning
    # one `logits` output, where the loader calls the default function with any token count;
    # otherwise `prefill` and `decode` functions in the precision's layout.
    single_function: bool = False
    # User-defined metadata keys the loader reads, each set to the model's name.
    name_metadata: tuple[str, ...] = ()
    # Swift lines running a loaded `model` in the loader (RELEASE.md's sketch; `{tokenizer}`: the
    # release's tokenizer folder).
    swift_usage: tuple[str, ...] = ()
    # The package kinds it shapes; None: every kind.
    kinds: tuple[str, ...] | None = ("stateful",)

    def shapes(self, kind: str) -> bool:
        return self.kinds is None or kind in self.kinds


INTERFACES: Registry[Interface] = Registry("interface", UnknownInterface)


def register_interface(interface: Interface) -> Interface:
    return INTERFACES.add(interface.name, interface)


register_interface(Interface(
    name=DEFAULT_INTERFACE,
    description="cmfdeploy's own: input_ids and position; stateful packages have prefill and decode functions",
    loader="cmfdeploy (coreml.runner) and RELEASE.md's examples",
    token_input="input_ids", mask_input=None, key_cache="key_cache", value_cache="value_cache",
    kinds=None,
))
register_interface(Interface(
    name="causal-lm",
    description="Apple's stateful Llama recipe as the Swift CausalLMModel sample loads it: input_ids, causal_mask "
                "[1, 1, T, past + T] fp16, states key_cache/value_cache, fp16 logits",
    loader="finnvoor/CoreMLPipelines CausalLMModel (Apple's 'On Device Llama 3.1 with Core ML' recipe)",
    token_input="input_ids", mask_input="causal_mask", key_cache="key_cache", value_cache="value_cache",
    logits_dtype="float16", single_function=True,
    swift_usage=("let lm = CausalLMModel(model: model)  // the sample's class; its pipeline builds causal_mask",),
))
register_interface(Interface(
    name="swift-transformers",
    description="huggingface/swift-transformers 1.3 LanguageModelWithStatefulKVCache: inputIds, causalMask "
                "[1, 1, 1, tokens + 1] fp16, states keyCache/valueCache, logits, co.huggingface.exporters.name",
    loader="huggingface/swift-transformers 1.3 LanguageModel (Sources/Models/LanguageModel.swift)",
    token_input="inputIds", mask_input="causalMask", key_cache="keyCache", value_cache="valueCache",
    mask_extra_columns=1, single_function=True, name_metadata=("co.huggingface.exporters.name",),
    swift_usage=("// import Models, Tokenizers (swift-transformers 1.3)",
                 'let tokenizer = try await AutoTokenizer.from(modelFolder: URL(fileURLWithPath: "{tokenizer}"))',
                 "// a tokenizer given, LanguageModel asks the Hub for nothing",
                 "let lm = LanguageModelWithStatefulKVCache(model: model, tokenizer: tokenizer)",
                 'let text = try await lm.generate(config: lm.defaultGenerationConfig, prompt: "I was sent to")'),
))


def loader_interface(name: str, where: object = "--interface") -> Interface:
    """The registered interface `name`; UnknownInterface naming `where` and the known ones otherwise."""
    return INTERFACES.lookup(name, where)


def package_interface(block: dict, where: object = "package") -> Interface:
    """The interface a manifest's `package` block names (packages made before interfaces were
    recorded are cmfdeploy's)."""
    return loader_interface(block.get("interface", DEFAULT_INTERFACE), f"{where}: field 'package.interface'")


def causal_mask(unit: Interface, position: int, count: int) -> np.ndarray:
    """The additive fp16 mask [1, 1, count, position + count + extra] a loader of `interface` gives
    `count` tokens at `position`: 0 where a query may attend a key, HIDDEN where the key is later."""
    columns = position + count + unit.mask_extra_columns
    later = np.arange(columns)[None, :] > position + np.arange(count)[:, None]
    return np.where(later, HIDDEN, 0).astype(np.float16)[None, None]


def step_inputs(unit: Interface, ids: np.ndarray, position: int) -> dict[str, np.ndarray]:
    """One call's inputs besides the states: tokens `ids` [1, T] at `position`, and the mask the
    interface takes in place of the position where it takes one."""
    ids = np.asarray(ids, dtype=np.int32)
    if unit.mask_input is None:
        return {unit.token_input: ids, POSITION_INPUT: np.array([position], dtype=np.int32)}
    return {unit.token_input: ids, unit.mask_input: causal_mask(unit, position, ids.shape[1])}


def shaping(name: str, kinds: tuple[str, ...], float_dtype: str, where: object) -> Interface:
    """The interface `name` for a conversion of `kinds` whose float I/O dtype is `float_dtype`;
    InterfaceMismatch naming `where` when it shapes none of the kinds, or its loader reads logits
    of another dtype."""
    unit = loader_interface(name)
    if not any(unit.shapes(kind) for kind in kinds):
        raise InterfaceMismatch(f"{where}: conversion field 'interface' (--interface) is {name!r}, which shapes the "
                                f"{', '.join(unit.kinds or ())} kind; the package kinds {list(kinds)} do not include it")
    if unit.logits_dtype not in (None, float_dtype):
        raise InterfaceMismatch(
            f"{where}: conversion field 'interface' (--interface) is {name!r}, whose loader reads "
            f"{unit.logits_dtype} logits and no other, but "
            f"the precision's float outputs are {float_dtype}; convert it at a precision of {unit.logits_dtype} "
            "I/O (--precision fp16, make TARGET=gpu)")
    return unit
