"""Seeded mutants of every reader beyond CMF: a typed error or a clean read, never another
exception, a hang or a huge allocation (see tests/_fuzz.py). 100 mutants per reader here;
benchmarks/fuzz_bench.py runs 1,000 and more and prints the counts."""

import zlib

import pytest
from _fuzz import fuzz
from _fuzz_targets import TARGETS
from conftest import FIXTURE_REFERENCE

CASES = 100


@pytest.fixture(scope="module")
def artifacts(fixture_packages, fixture_bundle, tmp_path_factory) -> dict:
    from pipeline.stages.gates import align_package

    gate = tmp_path_factory.mktemp("fuzz") / "gate"
    align_package(fixture_packages / "chunk_kv", FIXTURE_REFERENCE, gate)
    return {"bundle": fixture_bundle, "package": fixture_packages / "chunk_kv", "gate": gate}


@pytest.mark.parametrize("reader", sorted(TARGETS))
def test_mutants_give_typed_errors_or_clean_reads(artifacts, tmp_path, reader):
    mutate, exercise = TARGETS[reader](artifacts, tmp_path)
    tally = fuzz(reader, CASES, zlib.crc32(reader.encode()), mutate, exercise)
    assert tally.mutants == CASES and tally.typed + tally.clean == CASES, "\n".join(tally.defects[:10])
    assert tally.typed > 0  # the mutants reach the checks, not just bytes nobody reads
