"""The weight format's layering, checked on the imports (Python's `ast`, no code run).

`weightship.weightformat` sits below the data plane and the loader; `data` and `loader`
do not import each other; `api` imports nothing from `core`; no import cycle joins two
top-level packages of weightship, nor two modules of the weight format, the data plane or
the loader. Imports inside functions and under TYPE_CHECKING count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PRODUCT = Path(__file__).resolve().parents[2] / "operator" / "weightship"

# (package, prefix it may not import, why)
RULES = (
    ("data", "weightship.loader", "the data plane stages weights; it never loads them"),
    ("loader", "weightship.data", "the loader reads the format, not the data plane"),
    ("api", "weightship.core", "the core decides on the API's models: api sits below it"),
    ("weightformat", "weightship", "the weight format is the bottom of data and loader"),
)


def module_of(path: Path) -> str:
    parts = path.relative_to(PRODUCT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, source: str | None = None) -> Iterator[str]:
    """What each import of ``path`` (or of ``source`` as if it were there) names:
    `import a.b` a.b; `from a import b` a.b (b a module or a name in a); relative
    imports resolved."""
    package = module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text() if source is None else source, str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = node.module.split(".") if node.module else []
            if node.level:
                parts = [*package[: len(package) - node.level + 1], *parts]
            yield from (".".join([*parts, alias.name]) for alias in node.names)


def sources(package: str = "") -> list[Path]:
    root = PRODUCT / package
    return [p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts]


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("package, forbidden, why", RULES, ids=lambda v: str(v)[:20])
def test_a_package_does_not_import_what_sits_above_it(
    package: str, forbidden: str, why: str
) -> None:
    own = f"weightship.{package}"
    found = [
        f"{path.relative_to(PRODUCT)}: {name}"
        for path in sources(package)
        for name in imported(path)
        if _under(name, forbidden) and not _under(name, own)
    ]
    assert sources(package) and not found, f"{why}:\n" + "\n".join(found)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return list(exc.args[1])
    return None


def test_no_import_cycle_between_top_level_packages() -> None:
    graph: dict[str, set[str]] = {}
    for path in sources():
        own = module_of(path).split(".")
        if len(own) == 1:
            continue  # weightship/__init__.py
        top = own[1]
        for name in imported(path):
            parts = name.split(".")
            if parts[0] == "weightship" and len(parts) > 1 and parts[1] != top:
                graph.setdefault(top, set()).add(parts[1])
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


@pytest.mark.parametrize("package", ["weightformat", "data", "loader"])
def test_no_import_cycle_between_modules_of(package: str) -> None:
    modules = {module_of(p): p for p in sources(package)}
    graph = {
        module: {
            target
            for name in imported(path)
            for target in modules
            if target != module and (name == target or name.rsplit(".", 1)[0] == target)
        }
        for module, path in modules.items()
    }
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def test_the_checks_see_a_deferred_relative_import() -> None:
    deferred = "def begin():\n    from .modelstaging import ModelStaging\n"
    names = set(imported(PRODUCT / "data" / "chunkstore.py", deferred))
    assert names == {"weightship.data.modelstaging.ModelStaging"}
    assert _cycle({"a": {"b"}, "b": {"a"}}) is not None
    assert _cycle({"a": {"b"}, "b": set()}) is None
