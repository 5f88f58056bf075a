"""The package layering, checked on the imports (Python's `ast`, no code run).

One row of RULES a rule: the files it covers (`where`: a folder or a file, relative to the
repository root), the module prefix they may not import (`forbidden`), optionally only
some names from it (`names`: then only `from <forbidden...> import <name>` counts), what
may all the same (`allowed`: pairs of a folder or file and a module prefix; a package
importing itself is one), and why. Imports inside functions count too. To add a rule, add
a row.

Tests may use the controller for what is the controller's (running it, its builders);
every label, annotation and environment name they take from `weightship.api.names` and
`weightship.api.env`, the Kubernetes access layer (client, retries, the list-then-watch
cache) from `weightship.kube`, as the product does. Devtools and benches do not import
the controller at all.

Besides the rules, no package imports in a circle among its own modules
(`test_no_package_imports_in_a_circle`): a circle is what once made a module spell out a
label rather than import it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT = "operator/weightship"


@dataclass(frozen=True)
class Rule:
    where: str
    forbidden: str
    why: str
    names: frozenset[str] = frozenset()
    allowed: tuple[tuple[str, str], ...] = ()


def defined_names(path: str) -> frozenset[str]:
    """The names a module defines at its top level (assignments, functions, classes)."""
    tree = ast.parse((REPO / path).read_text(), path)
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
    return frozenset(names)


API_NAMES = defined_names(f"{PRODUCT}/api/names.py") | defined_names(f"{PRODUCT}/api/env.py")
KUBE_LAYER = frozenset({"PLURAL", "load_client", "api_retry", "Informer"})
TESTS = ("e2e", "tests")
RIG = ("devtools", "bench")

RULES = (
    Rule(
        PRODUCT,
        "weightship.controller",
        "the controller sits on top: the agent, the CLI and the rest share weightship.api "
        "and weightship.kube with it, never borrow from it",
        allowed=(
            (f"{PRODUCT}/controller", "weightship.controller"),
            # `weightship operator` runs the controller: registering its handlers, reading
            # its settings, its elector.
            (f"{PRODUCT}/cli.py", "weightship.controller.handlers"),
            (f"{PRODUCT}/cli.py", "weightship.controller.settings"),
            (f"{PRODUCT}/cli.py", "weightship.controller.leader"),
        ),
    ),
    Rule(
        f"{PRODUCT}/kube",
        "weightship",
        "weightship.kube is the bottom layer: Kubernetes' grammars, client and cache",
        allowed=((f"{PRODUCT}/kube", "weightship.kube"),),
    ),
    *(
        Rule(
            tests,
            "weightship.controller",
            "labels, annotations and environment names come from weightship.api.names and "
            "weightship.api.env, the client, retries and the list-then-watch cache from "
            "weightship.kube",
            names=API_NAMES | KUBE_LAYER,
        )
        for tests in TESTS
    ),
    Rule(
        f"{PRODUCT}/integrations/sglang",
        "weightship.integrations.vllm",
        "the SGLang adapter and the vLLM plugin share the contract (weightship.api.inference) "
        "and its server side (weightship.integrations.serving), never each other's code",
    ),
    Rule(
        f"{PRODUCT}/integrations/vllm",
        "weightship.integrations.sglang",
        "the vLLM plugin and the SGLang adapter share weightship.integrations.serving",
    ),
    *(
        Rule(
            rig,
            "weightship.controller",
            "the dev rig and the benches drive the operator as a user does: names from "
            "weightship.api, the Kubernetes access layer from weightship.kube",
        )
        for rig in RIG
    ),
)


@dataclass(frozen=True)
class Found:
    path: str
    line: int
    module: str
    name: str | None  # the name imported from `module`; None for a plain import

    @property
    def target(self) -> str:
        """What the import names: the module, or the module's `name` (maybe a module)."""
        return f"{self.module}.{self.name}" if self.name else self.module

    def __str__(self) -> str:
        what = f"from {self.module} import {self.name}" if self.name else f"import {self.module}"
        return f"{self.path}:{self.line}: {what}"


def module_of(path: str) -> str | None:
    """The dotted module of a product file (`operator/weightship/a/b.py`: weightship.a.b)."""
    if not path.startswith("operator/"):
        return None
    parts = Path(path).with_suffix("").parts[1:]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: str, source: str) -> Iterator[Found]:
    """Every import of the file: `import a.b` as a.b; `from a import b, c` as a with the
    name b and a with the name c; relative imports resolved."""
    package = (module_of(path) or "").split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Found(path, node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            parts = node.module.split(".") if node.module else []
            if node.level:
                parts = [*package[: len(package) - node.level + 1], *parts]
            for alias in node.names:
                yield Found(path, node.lineno, ".".join(parts), alias.name)


def _under(name: str, prefix: str, sep: str = ".") -> bool:
    return name == prefix or name.startswith(prefix + sep)


def breaks(rule: Rule, found: Found) -> bool:
    if not _under(found.target, rule.forbidden):
        return False
    if rule.names and found.name not in rule.names:
        return False
    return not any(
        _under(found.path, path, "/") and _under(found.target, module)
        for path, module in rule.allowed
    )


def files(where: str) -> list[str]:
    root = REPO / where
    paths = [root] if root.is_file() else sorted(root.rglob("*.py"))
    return [p.relative_to(REPO).as_posix() for p in paths if "__pycache__" not in p.parts]


def violations(rule: Rule) -> list[Found]:
    return [
        found
        for path in files(rule.where)
        for found in imports(path, (REPO / path).read_text())
        if breaks(rule, found)
    ]


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.where}-x-{r.forbidden}")
def test_the_layering_holds(rule: Rule) -> None:
    assert files(rule.where), f"{rule.where} has no Python files: a stale rule"
    found = violations(rule)
    assert not found, f"{rule.why}:\n" + "\n".join(map(str, found))


def test_the_check_catches_what_each_form_of_import_names() -> None:
    agent = f"{PRODUCT}/agent/x.py"
    source = (
        "import weightship.controller.kube\n"
        "from weightship.controller import builders\n"
        "from weightship import controller\n"
        "def f():\n"
        "    from ..controller.kube import VERSION\n"
    )
    rule = RULES[0]
    found = [f for f in imports(agent, source) if breaks(rule, f)]
    assert {f.line for f in found} == {1, 2, 3, 5}
    assert not [f for f in imports(f"{PRODUCT}/controller/x.py", source) if breaks(rule, f)]
    runs = imports(f"{PRODUCT}/cli.py", "import weightship.controller.handlers")
    assert not [f for f in runs if breaks(rule, f)]
    kube = next(r for r in RULES if r.where == f"{PRODUCT}/kube")
    below = "from weightship.kube import selector\nfrom weightship.api import names\n"
    assert [f.line for f in imports(f"{PRODUCT}/kube/x.py", below) if breaks(kube, f)] == [2]
    tests = next(r for r in RULES if r.where == "tests")
    mixed = "from weightship.controller.builders import VERIFIED_GATE, replicaset_body\n"
    assert [f.name for f in imports("tests/x.py", mixed) if breaks(tests, f)] == ["VERIFIED_GATE"]
    rig = next(r for r in RULES if r.where == "devtools")
    found = [f.name for f in imports("devtools/x.py", mixed) if breaks(rig, f)]
    assert found == ["VERIFIED_GATE", "replicaset_body"]


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module to the product modules it imports (`from a import b` counts as a.b where b
    is a module), from ``sources``: file path to its text. Imports under TYPE_CHECKING
    and inside functions count: a circle through them is still a circle of knowledge."""
    modules = {m: path for path in sources if (m := module_of(path))}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for found in imports(path, sources[path]):
            target = found.target if found.target in modules else found.module
            if target in modules and target != module:
                graph[module].add(target)
    return graph


def package_of(module: str) -> str:
    return module.rpartition(".")[0]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles among the modules of one package each (Tarjan's strongly
    connected components, on the edges that stay inside a package)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if package_of(target) != package_of(module):
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component: list[str] = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_package_imports_in_a_circle() -> None:
    sources = {path: (REPO / path).read_text() for path in files(PRODUCT)}
    found = circles(import_graph(sources))
    assert not found, "modules of one package import each other in a circle:\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def test_the_circle_check_sees_a_circle_through_type_checking_imports() -> None:
    sources = {
        f"{PRODUCT}/p/a.py": "from weightship.p.b import X\n",
        f"{PRODUCT}/p/b.py": "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from weightship.p import c\n",
        f"{PRODUCT}/p/c.py": "def f():\n    from .a import Y\n",
        f"{PRODUCT}/q/d.py": "from weightship.p.a import Z\n",  # another package: no circle
        f"{PRODUCT}/p/e.py": "from weightship.q.d import Z\n",
    }
    assert circles(import_graph(sources)) == [
        ["weightship.p.a", "weightship.p.b", "weightship.p.c"]
    ]
    del sources[f"{PRODUCT}/p/c.py"]
    assert circles(import_graph(sources)) == []


# -- the seams between processes -----------------------------------------------------------

CONTRACT = f"{PRODUCT}/api/inference.py"


def contract_strings() -> dict[str, str]:
    """The inference-server contract's paths, headers and failure reasons: name to value."""
    from weightship.api import inference

    named = {
        name: getattr(inference, name)
        for name in dir(inference)
        if name.endswith(("_PATH", "_HEADER"))
    }
    return named | {f"FailureReason.{r.name}": r.value for r in inference.FailureReason}


def literals(path: str, source: str) -> Iterator[tuple[int, str]]:
    """Every string literal of the file (f-strings' literal parts too), with its line."""
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def spelled(values: set[str], paths: list[str]) -> dict[str, list[str]]:
    """Where each of ``values`` is written as a whole string literal: value to places."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for line, text in literals(path, (REPO / path).read_text()):
            if text in values:
                found.setdefault(text, []).append(f"{path}:{line}")
    return found


def test_the_inference_server_contract_is_spelled_once() -> None:
    """Its paths, headers and reasons are written once, in the contract; the product
    imports them (the prose of docstrings aside)."""
    strings = contract_strings()
    assert {"LOADED_PATH", "FailureReason.CHECKSUM_MISMATCH", "VERIFY_HEADER"} <= set(strings)
    found = spelled(set(strings.values()), files(PRODUCT))
    again = {
        value: places
        for value, places in found.items()
        if len(places) > 1 or not places[0].startswith(f"{CONTRACT}:")
    }
    assert not again, "written again outside weightship.api.inference:\n" + "\n".join(
        f"{value!r}: {', '.join(places)}" for value, places in sorted(again.items())
    )


def test_the_spelling_check_finds_a_reason_written_out() -> None:
    sources = {
        "a.py": 'raise LoadFailure("ChecksumMismatch", f"{x} is not /weightship/v1/loaded")\n',
        "b.py": '"""A docstring that says ChecksumMismatch."""\nX = f"{Y}ChecksumMismatch"\n',
    }
    found = [
        text
        for path, source in sources.items()
        for _line, text in literals(path, source)
        if text in {"ChecksumMismatch", "/weightship/v1/loaded"}
    ]
    assert found == ["ChecksumMismatch", "ChecksumMismatch"]


# Kubernetes' writing verbs, as the client and the controller's Kube name their methods.
WRITE_VERBS = ("patch_", "create_", "delete_", "replace_", "label_", "scale_", "set_")


def kube_writes() -> frozenset[str]:
    """The methods of the controller's Kube that write: each calls a client method with a
    writing verb, or another of its own that does."""
    tree = ast.parse((REPO / PRODUCT / "controller/kube.py").read_text())
    kube = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Kube")
    methods = {m.name: m for m in kube.body if isinstance(m, ast.FunctionDef)}

    def calls(method: ast.FunctionDef) -> set[str]:
        return {
            n.func.attr
            for n in ast.walk(method)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        }

    writes = {
        name
        for name, method in methods.items()
        if any(c.startswith(WRITE_VERBS) for c in calls(method) if c not in methods)
    }
    while more := {n for n, m in methods.items() if n not in writes and calls(m) & writes}:
        writes |= more
    return frozenset(writes)


def attributes(path: str) -> dict[str, list[int]]:
    """Every attribute the file reads or calls (``x.name``), with its lines."""
    found: dict[str, list[int]] = {}
    source = (REPO / path).read_text()
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Attribute):
            found.setdefault(node.attr, []).append(node.lineno)
    return found


def test_the_swapper_writes_nothing_to_kubernetes() -> None:
    """The swapper reports, the core decides, apply writes (as for the verifier): it uses
    none of Kube's writes, and no Kubernetes client at all."""
    writes = kube_writes()
    assert {"patch_pod_condition", "patch_pod_conditions", "delete_pod", "label_node"} <= writes
    assert {"pod", "secret_data"}.isdisjoint(writes)
    swapper = f"{PRODUCT}/controller/swapper.py"
    used = {name: lines for name, lines in attributes(swapper).items() if name in writes}
    assert not used, f"{swapper} writes: {used}"
    clients = [
        f for f in imports(swapper, (REPO / swapper).read_text()) if _under(f.target, "kubernetes")
    ]
    assert not clients, "\n".join(map(str, clients))


def test_pods_are_written_by_apply_alone() -> None:
    """In the controller, only apply calls Kube's pod writes (Kube itself aside)."""
    pod_writes = {name for name in kube_writes() if "pod" in name}
    assert {"patch_pod_condition", "patch_pod_conditions", "delete_pod"} <= pod_writes
    writers = {
        path for path in files(f"{PRODUCT}/controller") if pod_writes & set(attributes(path))
    }
    assert writers == {f"{PRODUCT}/controller/apply.py", f"{PRODUCT}/controller/kube.py"}
