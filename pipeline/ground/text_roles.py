"""The disjoint roles one text plays: gate fixtures, calibration, quality.

Compression that looks at text (sensitivity, GPTQ) must never be judged on that text, and
the quality part of a gate must not reuse the exactness fixtures. A text is cut by line
(the Botchan text keeps its hard wraps, so a line is the unit) into:

- `held_out`: the last tenth of the lines (the default fixture model never trained on it);
  its first FIXTURE_LINES lines hold the default fixture's gate cases
  (`fixtures/make_reference.py`), the rest is `quality`;
- `calibration`: train-side lines from CALIBRATION_START on, past the lines any model's
  gate fixtures read from the start of a text (`pipeline.stages.gates.fixtures` reads lines
  0..230).

    roles = text_roles(lines)      # {"calibration": [...], "quality": [...]}
"""

from pipeline.ground.errors import CmfdeployError

HELDOUT_FRACTION = 10  # the last 1/10 of the lines (fixtures/corpus.py cuts the same way)
FIXTURE_LINES = 240  # gates.fixtures reads lines 0 .. FUTURE_LINE + LINES_PER_CASE = 230
CALIBRATION_START = 400


class TextRoleError(CmfdeployError):
    """The text is too short to give every role its own lines."""


def held_out(lines: list[str]) -> list[str]:
    """The last tenth of `lines`, which no calibration reads (the parity checks against
    transformers compare logits over it)."""
    return lines[len(lines) - len(lines) // HELDOUT_FRACTION:]


def text_roles(lines: list[str], where: str = "text") -> dict[str, list[str]]:
    """`calibration` and `quality` lines of `lines`, disjoint from each other and from any gate fixture."""
    tail = held_out(lines)
    calibration, quality = lines[CALIBRATION_START:len(lines) - len(tail)], tail[FIXTURE_LINES:]
    if not calibration or not quality:
        raise TextRoleError(f"{where}: {len(lines)} lines leave calibration {len(calibration)} and quality "
                            f"{len(quality)} lines; need more than {CALIBRATION_START + FIXTURE_LINES} lines "
                            f"with the last tenth held out")
    return {"calibration": calibration, "quality": quality}
