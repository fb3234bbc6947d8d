"""coremltools' own MIL op tests, run through the numpy executor instead of Core ML.

The coremltools wheel ships the op tests its developers run against Core ML
(`coremltools/converters/mil/mil/ops/tests/iOS14..iOS18`): each builds a MIL program, converts
it (`ct.convert`, which saves an .mlpackage), predicts with `MLModel.predict` and compares with
its own `compare_backend`, at the test's own atol/rtol. Here the prediction step is the only
thing replaced: `MLModel.predict` (and `make_state`) run the saved package with
`open_package(path, backend="executor")`, and `compare_backend`'s macOS guard is opened so its
comparison runs on Linux. Conversion, expected values and tolerances stay coremltools'.

Only the ML Program fp32 backend runs: the executor computes fp32 programs exactly as written,
and the tests' fp16 backend compares at a tolerance loosened 100x for Core ML's fp16 units.
A case whose saved program holds an op the executor does not implement is skipped with that op
named (`UNIMPLEMENTED`), never passed. `CMFDEPLOY_OP_TESTS=all` runs every case; the default,
`sample`, at most `SAMPLE_PER_CLASS` cases of each coremltools test class (one class per op or
op family), picked by a hash of the case's id, so the same cases run on every machine.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import os
import pkgutil
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pytest
from _pytest.mark.structures import Mark, ParameterSet, get_unpacked_marks

MODE_ENV = "CMFDEPLOY_OP_TESTS"
MODES = ("sample", "all")
SAMPLE_PER_CLASS = 1
OPSETS = ("iOS14", "iOS15", "iOS16", "iOS17", "iOS18")
TESTS = "coremltools.converters.mil.mil.ops.tests"
UNIMPLEMENTED = "executor lacks MIL op(s): "
# The macOS the tests are told they run on: one whose Core ML runs every opset they test (iOS18 is macOS 15).
MACOS = (15, 5)

# Cases whose own expected value is wrong: (test, parameters the case has, the evidence).
WRONG_TESTS: list[tuple[str, dict, str]] = [
    ("iOS18.test_compression::TestConstexprSparseToDense::test_builder_to_backend_stress", {"data_dtype": "fp16"},
     "the program adds 1 in fp32 to the fp16 weights cast to fp32, but the expected value "
     "`decompress(nonzero_data, mask) + 1` is computed in fp16 (nonzero_data is float16) and rounded "
     "to fp16: it differs from the exact fp32 sum by up to half an fp16 ulp of values in [1, 2) "
     "(4.9e-4), above the test's atol 1e-4 + rtol 1e-5"),
]

# Test classes (or class::method) that test an op the executor does not implement, with that op:
# skipped when collected, with the op named, where running them would only convert (at 0.1-0.5 s
# each: 6,000 of the 10,000 cases) to find the op missing. Each case of another test is skipped
# the same way when its saved program holds an op missing from the executor (`executor_prediction`).
# An entry stops applying once the executor implements its ops.
UNIMPLEMENTED_TESTS: dict[str, tuple[str, ...]] = {
    "TestLSTM": ("lstm",),
    "TestGRU": ("gru",),
    "TestRNN": ("rnn",),
    "TestQuantize": ("quantize",),
    "TestDequantize": ("dequantize",),
    "TestNormalizationLocalResponseNorm": ("local_response_norm",),
    "TestNonMaximumSuppression": ("non_maximum_suppression",),
    "TestConstexprLutToSparse": ("constexpr_lut_to_sparse",),
    "TestConstexprSparseBlockwiseShiftScale": ("constexpr_sparse_blockwise_shift_scale",),
    "TestJointCompressionOps::test_sparse_lut": ("constexpr_lut_to_sparse",),
    "TestJointCompressionOps::test_sparse_quant": ("constexpr_sparse_blockwise_shift_scale",),
    "TestJointCompressionOps::test_quant_sparse_lut": (
        "constexpr_lut_to_sparse", "constexpr_sparse_blockwise_shift_scale"),
}


def mode() -> str:
    value = os.environ.get(MODE_ENV, "sample")
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={value!r} is not one of {', '.join(MODES)}")
    return value


@dataclass(frozen=True)
class Case:
    """One parametrized call of a coremltools test method."""

    module: str  # e.g. "iOS17.test_reduction"
    cls: str
    method: str
    kwargs: tuple[tuple[str, object], ...]

    @property
    def test(self) -> str:
        return f"{self.module}::{self.cls}::{self.method}"


def _fp32_backends_only() -> None:
    """Point coremltools' test backends at ML Program fp32 before any test module reads them.

    The op test modules parametrize over `testing_reqs.backends_internal` (through each opset
    package's `clean_up_backends`) and `compute_units` when they are imported, so the lists
    are set in place first; a test module imported earlier would hold the default ones."""
    import coremltools as ct
    from coremltools.converters.mil import testing_reqs

    stale = [name for name in list(sys.modules) if name.startswith(TESTS + ".iOS")]
    if stale:
        raise RuntimeError(f"coremltools op test modules imported before their backends were set: {stale}")
    testing_reqs.backends_internal[:] = [
        testing_reqs.BackendConfig(backend="mlprogram", precision="fp32", opset_version=v)
        for v in testing_reqs._SUPPORTED_OPSET_VERSIONS_MLPROGRAM
    ]
    testing_reqs.backends[:] = [("mlprogram", "fp32")]
    testing_reqs.compute_units[:] = [ct.ComputeUnit.CPU_ONLY]


@contextmanager
def _on_macos() -> Iterator[None]:
    """coremltools' macOS version as `MACOS` while the test modules are imported: their
    `skipif(_macos_version() < ...)` marks skip cases for Core ML bugs of older macOS, which
    the executor runs."""
    import coremltools.models.utils as ct_utils

    real = ct_utils._macos_version
    ct_utils._macos_version = lambda: MACOS
    try:
        yield
    finally:
        ct_utils._macos_version = real


def _test_modules() -> Iterator[types.ModuleType]:
    with _on_macos():
        modules = []
        for opset in OPSETS:
            package = importlib.import_module(f"{TESTS}.{opset}")
            for info in pkgutil.iter_modules(package.__path__):
                if info.name.startswith("test_"):
                    modules.append(importlib.import_module(f"{package.__name__}.{info.name}"))
    return iter(modules)


# parametrize mark -> its values: some are given as an iterator (itertools.product), which a
# second reading (a subclass inheriting the method) would find empty.
_VALUES: dict[int, tuple[Mark, list]] = {}


def _argvalues(mark: Mark) -> list:
    if id(mark) not in _VALUES:
        _VALUES[id(mark)] = (mark, list(mark.args[1] if len(mark.args) > 1 else mark.kwargs["argvalues"]))
    return _VALUES[id(mark)][1]


def _parameter_sets(marks: list[Mark]) -> list[tuple[dict, list, list[str]]]:
    """The product of the `parametrize` marks, as pytest expands them: (kwargs, marks, ids)."""
    axes = []
    for mark in marks:
        if mark.name != "parametrize":
            continue
        names, values = mark.args[0] if mark.args else mark.kwargs["argnames"], _argvalues(mark)
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        axis = []
        for value in values:
            ps = ParameterSet.extract_from(value, force_tuple=len(names) == 1)
            kwargs = dict(zip(names, ps.values))
            ident = ps.id or "-".join(f"{n}={_id_value(v)}" for n, v in kwargs.items())
            axis.append((kwargs, list(ps.marks), ident))
        axes.append(axis)
    combos = []
    for parts in itertools.product(*axes):
        kwargs, marks, ids = {}, [], []
        for part_kwargs, part_marks, ident in parts:
            kwargs.update(part_kwargs)
            marks += part_marks
            ids.append(ident)
        combos.append((kwargs, marks, ids))
    return combos


def _id_value(value) -> str:
    """A parameter as coremltools' conftest names it (`str`), shorter for the fixed backend."""
    from coremltools.converters.mil.testing_reqs import BackendConfig

    if isinstance(value, BackendConfig):
        return f"{value.backend}-{value.precision}-{value.opset_version.name}"
    if isinstance(value, type):
        return value.__name__
    return str(value).replace(" ", "")


def _unimplemented(case: Case) -> list[str]:
    from coreml.mil.ops import OPS

    ops = UNIMPLEMENTED_TESTS.get(f"{case.cls}::{case.method}") or UNIMPLEMENTED_TESTS.get(case.cls, ())
    return sorted(o for o in ops if o not in OPS)


def _wrong(case: Case) -> str | None:
    kwargs = dict(case.kwargs)
    for test, params, reason in WRONG_TESTS:
        if case.test == test and all(str(kwargs.get(k)) == v for k, v in params.items()):
            return reason
    return None


def _stable(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _test_classes() -> Iterator[list[tuple[str, Case, list[Mark]]]]:
    """Per coremltools test class, its cases as pytest would collect them: (id, case, marks)."""
    for module in _test_modules():
        short = module.__name__.removeprefix(TESTS + ".")
        module_marks = get_unpacked_marks(module)
        for cls_name, cls in sorted(vars(module).items()):
            # Classes imported from another opset's module run there; their subclasses run here.
            if not (cls_name.startswith("Test") and isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            class_marks = get_unpacked_marks(cls)
            cases = []
            for method in sorted(name for name in dir(cls) if name.startswith("test")):
                fn = getattr(cls, method)
                if not callable(fn):
                    continue
                marks = module_marks + class_marks + get_unpacked_marks(fn)
                other_marks = [m for m in marks if m.name != "parametrize"]
                for kwargs, combo_marks, ids in _parameter_sets(marks):
                    case = Case(short, cls_name, method, tuple(kwargs.items()))
                    ident = f"{case.test}[{'-'.join(ids)}]" if ids else case.test
                    cases.append((ident, case, other_marks + combo_marks))
            yield cases


def collect(which: str | None = None) -> list[ParameterSet]:
    """The fp32 ML Program cases of coremltools' op tests (`which`: "all" or "sample")."""
    which = which or mode()
    _fp32_backends_only()
    params = []
    for cases in _test_classes():
        if which == "sample":
            cases = sorted(cases, key=lambda c: _stable(c[0]))[:SAMPLE_PER_CLASS]
        for ident, case, marks in cases:
            missing, wrong = _unimplemented(case), _wrong(case)
            if missing:
                marks = [pytest.mark.skip(reason=UNIMPLEMENTED + ", ".join(missing)).mark]
            elif wrong:
                marks = marks + [pytest.mark.xfail(strict=True, reason=wrong).mark]
            params.append(pytest.param(case, id=ident, marks=marks))
    return params


def _missing_ops(program) -> list[str]:
    from coreml.mil.ops import OPS

    missing = set()
    for function in program.functions.values():
        for op in function.block.operations:
            if op.blocks or (op.type != "const" and op.type not in OPS):
                missing.add(op.type)
    return sorted(missing)


@contextmanager
def executor_prediction(monkeypatch) -> Iterator[list[str]]:
    """Within: `MLModel.predict`/`make_state` run the saved package with the executor, and
    coremltools' comparison runs as on macOS. Yields the list of packages predicted."""
    import coremltools.models.utils as ct_utils
    from coremltools.converters.mil import testing_utils
    from coremltools.models import MLModel

    from coreml.mil import MilError, load_program
    from coreml.package import open_package

    predicted: list[str] = []
    packages: dict[str, object] = {}

    def package(model):
        path = model.package_path
        if path is None:  # coremltools' assert_model_is_valid converts to a neural network by default
            pytest.skip("executor runs ML Programs; this test predicts with a neural network model")
        if path not in packages:
            # A program the loader refuses is a failure, not a skip: no case of the full run hit one.
            missing = _missing_ops(load_program(path))
            if missing:
                pytest.skip(UNIMPLEMENTED + ", ".join(missing))
            packages[path] = open_package(path, backend="executor")
        return packages[path]

    def predict(model, data, state=None):
        pkg = package(model)
        predicted.append(model.package_path)
        # Core ML converts a multi-array to the input's declared type, as coremltools' test
        # helper counts on: it hands every input over as float32.
        feed = {}
        for name, value in data.items():
            spec = pkg.spec_inputs.get(name)
            feed[name] = np.asarray(value).astype(spec.dtype.numpy) if spec is not None and spec.dtype else value
        try:
            return pkg.predict(feed, state=state)
        except MilError as exc:
            # What MLModel.predict raises when Core ML fails to compute a prediction.
            raise RuntimeError(f"Unable to compute the prediction using ML Program (executor): {exc}") from exc

    class OnMacOS(types.ModuleType):
        """coremltools.models.utils as compare_backend sees it: on a macOS that runs ML Programs."""

        def __getattr__(self, name):
            return getattr(ct_utils, name)

        @staticmethod
        def _macos_version():
            return MACOS

    monkeypatch.setattr(MLModel, "predict", predict)
    monkeypatch.setattr(MLModel, "make_state", lambda model: package(model).make_state())
    monkeypatch.setattr(testing_utils, "_IS_MACOS", True)
    monkeypatch.setattr(testing_utils, "coremltoolsutils", OnMacOS(ct_utils.__name__))
    yield predicted


def run_case(case: Case, monkeypatch) -> list[str]:
    """Run one coremltools test case with the executor predicting; the packages it predicted."""
    module = importlib.import_module(f"{TESTS}.{case.module}")
    instance = getattr(module, case.cls)()
    with executor_prediction(monkeypatch) as predicted:
        getattr(instance, case.method)(**dict(case.kwargs))
    return predicted
