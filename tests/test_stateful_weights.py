"""A stateful package's prefill and decode functions share one copy of the weights (issue 50):
ANEMLL and Apple's tools report multifunction packages whose functions each carry their own.
Read from the saved program: each function's weight consts name their blobs by offset."""

from pathlib import Path

from coreml.mil.loader import program_spec


def _blobs_by_function(package: Path) -> dict[str, dict[tuple[str, int], tuple]]:
    """function -> {(weight file, offset): the const's shape} of its top-level weight consts."""
    _, model = program_spec(package)
    found = {}
    for name, fn in model.mlProgram.functions.items():
        ops = fn.block_specializations[fn.opset].operations
        found[name] = {(v.blobFileValue.fileName, v.blobFileValue.offset): tuple(d.constant.size for d in v.type.tensorType.dimensions)
                       for v in (op.attributes["val"] for op in ops if op.type == "const" and "val" in op.attributes)
                       if v.WhichOneof("value") == "blobFileValue"}
    return found


def _weight_bytes(package: Path) -> int:
    return sum(p.stat().st_size for p in package.rglob("weight*.bin"))


def test_prefill_and_decode_read_the_same_blobs_stored_once(fixture_stateful, fixture_packages):
    stateful = _blobs_by_function(fixture_stateful / "model.mlpackage")
    assert set(stateful) >= {"prefill", "decode"}
    # Every weight the decode function reads is a blob the prefill function reads: one copy.
    assert stateful["decode"] and stateful["decode"].items() <= stateful["prefill"].items()
    # The stored weights are a single function's: at most 1.02x the stateless package's weight
    # file (which also keeps a few positional tables as blobs that the stateful kind computes).
    assert _weight_bytes(fixture_stateful) <= 1.02 * _weight_bytes(fixture_packages / "stateless")
