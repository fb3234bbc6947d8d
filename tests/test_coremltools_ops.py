"""The executor held to coremltools' own MIL op tests (tests/_coremltools_op_tests.py).

`CMFDEPLOY_OP_TESTS=sample` (default) runs a fixed sample of the cases, `=all` every one.
"""

import pytest

from _coremltools_op_tests import collect, run_case


@pytest.mark.parametrize("case", collect())
def test_coremltools_op(case, monkeypatch, record_property):
    predicted = run_case(case, monkeypatch)
    record_property("executor_predictions", len(predicted))
