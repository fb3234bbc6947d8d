"""The layers of docs/ARCHITECTURE.md, read from the source: imports go one way, from the CLI
through stages and runtimes down to the ground, never back up."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("pipeline.stages.bundle", "pipeline.stages.align", "pipeline.stages.survey", "pipeline.stages.scoring", "pipeline.stages.release")
RUNTIMES = ("coreml", "mlx_runtime")
GROUND = ("pipeline/ground/cmf", "pipeline/ground/models", "pipeline/ground/backend_protocol.py", "pipeline/ground/errors.py", "manifests")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (function-level imports count)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _modules(*roots: str) -> list[Path]:
    return sorted(p for root in roots for p in ([ROOT / root] if root.endswith(".py") else
                                                (ROOT / root).rglob("*.py")))


def _reaching(paths: list[Path], targets: tuple[str, ...]) -> dict[str, list[str]]:
    hits = {str(p.relative_to(ROOT)): sorted(n for n in _imports(p) if n.split(".")[0] in targets or
                                             any(n == t or n.startswith(t + ".") for t in targets))
            for p in paths}
    return {path: names for path, names in hits.items() if names}


@pytest.mark.parametrize("layer, roots, above", [
    ("runtimes", RUNTIMES, STAGES),
    ("ground", GROUND, STAGES + RUNTIMES),
])
def test_no_layer_imports_a_layer_above_it(layer, roots, above):
    # The CLI modules of a runtime (pipeline/cli/coreml_commands.py, pipeline/cli/mlx_commands.py) are the CLI layer.
    paths = [p for p in _modules(*roots) if p.name != "commands.py" or layer == "ground"]
    assert _reaching(paths, above) == {}, f"{layer} importing a layer above it"
