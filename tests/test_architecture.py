"""The floors of docs/ARCHITECTURE.md, read from the source: every module is on one floor, and
nothing it reaches, directly or through any chain of imports, is on a floor above it.

An import counts wherever it is written (inside a function, under TYPE_CHECKING), and so does
a "module:function" string, the form in which dispatch tables (the chain's verifiers, the
worker pool's entries) name what they import later."""

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP_FOLDERS = ("pipeline", "coreml", "mlx_runtime", "manifests")
# Lowest first. A module is on the first floor whose root holds it; a floor may import its own
# floor and those before it. The ground has floors of its own: errors under everything, the
# manifests (identity, outputs, schemas) under the CMF library, which is under the reference model.
FLOORS = (
    ("ground: errors", ("pipeline/__init__.py", "pipeline/ground/__init__.py", "pipeline/ground/errors.py")),
    ("ground: manifests", ("manifests",)),
    ("ground: CMF library", ("pipeline/ground/cmf",)),
    ("ground: reference model, bundle format, Backend protocol", ("pipeline/ground",)),
    ("runtimes", ("coreml", "mlx_runtime")),
    ("stages", ("pipeline/stages",)),
    ("CLI", ("pipeline/cli",)),
)
# Runtimes are peers: neither knows the other exists.
PEERS = ("coreml", "mlx_runtime")
IMPORT_STRING = re.compile(r"^([a-z_]\w*(?:\.\w+)+):\w+$")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for top in TOP_FOLDERS for p in sorted((ROOT / top).rglob("*.py"))}


def _floor(name: str) -> int | None:
    relative = MODULES[name].relative_to(ROOT).as_posix()
    for index, (_, roots) in enumerate(FLOORS):
        if any(relative == root or relative.startswith(root + "/") for root in roots):
            return index
    return None


def _project_module(dotted: str) -> str | None:
    """The project module `dotted` names (a module, or a name inside one), if any."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


@cache
def _direct(name: str, strings: bool = True) -> frozenset[str]:
    """The project modules `name` imports (with `strings`, also those its import strings name)."""
    names = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(), str(MODULES[name]))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_STRING.match(node.value):
            names.add(IMPORT_STRING.match(node.value).group(1))
    return frozenset(filter(None, map(_project_module, names))) - {name}


@cache
def _reached(name: str, strings: bool = True) -> dict[str, tuple[str, ...]]:
    """Every module `name` reaches (itself too, when a chain leads back), with one chain there."""
    chains, frontier = {}, [(name,)]
    while frontier:
        chain = frontier.pop()
        for module in sorted(_direct(chain[-1], strings)):
            if module not in chains:
                chains[module] = chain + (module,)
                frontier.append(chains[module])
    return chains


def test_every_module_is_on_a_floor():
    assert [name for name in MODULES if _floor(name) is None] == []


@pytest.mark.parametrize("floor", range(len(FLOORS)), ids=[name for name, _ in FLOORS])
def test_nothing_reaches_a_floor_above_its_own(floor):
    upward = {}
    for name in (n for n in MODULES if _floor(n) == floor):
        for module, chain in _reached(name).items():
            if _floor(module) > floor:
                upward.setdefault(name, " -> ".join(chain))
    assert upward == {}, f"{FLOORS[floor][0]} reaching above itself"


def test_the_runtimes_never_reach_each_other():
    crossing = {name: " -> ".join(chain) for name in MODULES for peer in PEERS if name.split(".")[0] in PEERS
                for module, chain in _reached(name).items() if module.split(".")[0] == peer != name.split(".")[0]}
    assert crossing == {}


def test_no_import_circle():
    # A dispatch table's strings are looked up when a call needs them, by a module that was
    # already imported, so they cannot close a circle; the import statements can.
    circles = {name: " -> ".join(_reached(name, False)[name]) for name in MODULES if name in _reached(name, False)}
    assert circles == {}
