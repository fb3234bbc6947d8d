"""The Neural Engine's layout of a package, as its manifest's `package` block records it: the
token counts a function takes (enumerated, never a range) and the head in parts (no output
axis wider than the part width). What the kinds write, `coreml.crosscheck` checks and the
runners read; like the precisions it imports neither torch nor coremltools.

    chunk_lengths(128)              # (1, 8, 64, 128)
    head_rows(49152, 16384)         # ((0, 16384), (16384, 32768), (32768, 49152))
    enumerated_lengths(block)       # (1, 8, 64, 128), or None where T is a range
    logit_outputs(block)            # ["logits_0", "logits_1", "logits_2"], or ["logits"]
"""

from __future__ import annotations

# The chunk lengths a package of a Neural Engine precision takes, besides its context. The Neural
# Engine compiles a program per shape and takes a flexible input only as enumerated shapes
# (coremltools, "Flexible Input Shapes"), so the set stays small: 1 is decode and makes every
# token count reachable exactly (a runner splits n tokens greedily, largest first: no padding),
# 64 is ANEMLL's prefill batch (https://github.com/Anemll/Anemll docs/convert_model.md), 8 bounds
# the single-token calls of a prompt's remainder to 7 + 7, and the context prefills a whole
# window in one call. Lengths past the context are dropped.
CHUNK_LENGTHS = (1, 8, 64)


def chunk_lengths(context: int) -> tuple[int, ...]:
    """The enumerated token counts of a package of `context` tokens (CHUNK_LENGTHS)."""
    return tuple(sorted({n for n in CHUNK_LENGTHS if n <= context} | {context}))


# Why a package's head is split (the manifest's `package.head_split.why`).
HEAD_SPLIT_REASON = (
    "the Neural Engine takes no tensor axis wider than 16384 in H or W (coreml.ane.dimension_limits): "
    "a vocabulary wider than the part width is computed by one linear per part over row slices of the "
    "head weight, each part an output of its own in vocabulary order; a runner concatenates them. The "
    "slices are constants of their own. A tied table is stored once, as the parts: the token lookup "
    "gathers each token's row from its part (head_split.token_lookup); an untied head's parts sit beside "
    "the embedding table, and a split package's first piece holds the table its lookup reads"
)


def head_rows(vocab: int, width: int | None) -> tuple[tuple[int, int], ...] | None:
    """The head's parts as (first row, end row) in vocabulary order, each at most `width` rows;
    None where the head is not split (no width, or a vocabulary no wider than it)."""
    if width is None or vocab <= width:
        return None
    return tuple((start, min(start + width, vocab)) for start in range(0, vocab, width))


def logit_outputs(block: dict) -> list[str]:
    """The outputs whose concatenation (last axis, in this order) is the logits [1, T, vocab]."""
    split = block.get("head_split")
    return [part["output"] for part in split["parts"]] if split else ["logits"]


def enumerated_lengths(block: dict, function: str | None = None) -> tuple[int, ...] | None:
    """The token counts function `function` of the package (`block`: its manifest's `package`)
    takes, when they are enumerated; None where T is a range (or fixed)."""
    spec = block.get("functions", {}).get(function) if function else None
    lengths = (spec if spec is not None else block).get("enumerated", {}).get("T")
    return tuple(lengths) if lengths else None
