"""The product's import graph: every module imports, dependencies point one way, no loops.

Two checks, both over the product packages a wheel ships (`pyproject.toml`'s package list):

- every module imports in this interpreter, so an undeclared or broken import fails here, fast,
  instead of in the middle of a test or a user's `pdserve` command;
- the module graph read from the source (`ast`, every import statement, also those inside
  functions; `if TYPE_CHECKING:` blocks excluded) has no loop, and the layering rules hold:
  the product never imports `benchmarks` or `tests`, `benchmarks` never imports `tests`,
  `prefill_worker` and `decode_worker` never import each other, the worker host's core never
  imports a role package (only its composition root `worker.server` does), and the router
  never imports torch.
"""

from __future__ import annotations

import ast
import importlib
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _product_packages() -> list[str]:
    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    return sorted(p.rstrip("*") for p in find["find"]["include"])


PRODUCT = _product_packages()


def _modules(packages: list[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `packages` (generated stubs included)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _imports(path: Path, known: set[str]) -> Iterator[str]:
    """Every module `path` imports: a project module where one matches, else the top name."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            submodules = [f"{node.module}.{a.name}" for a in node.names]
            yield from [m for m in submodules if m in known] or [node.module]


def _graph() -> dict[str, set[str]]:
    modules = _modules([*PRODUCT, "benchmarks", "tests"])
    known = set(modules)
    return {name: set(_imports(path, known)) - {name} for name, path in modules.items()}


GRAPH = _graph()


def _top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("module", sorted(_modules(PRODUCT)))
def test_every_product_module_imports(module: str) -> None:
    importlib.import_module(module)


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root] & graph.keys())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = counter
                    counter += 1
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step] & graph.keys()))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))
    return loops


def test_no_import_loop_between_modules() -> None:
    assert _loops(GRAPH) == []


def _violations(source_tops: set[str], forbidden_tops: set[str]) -> list[str]:
    return sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _top(module) in source_tops
        for target in targets
        if _top(target) in forbidden_tops
    )


def test_the_product_never_imports_benchmarks_or_tests() -> None:
    assert _violations(set(PRODUCT), {"benchmarks", "tests"}) == []


def test_benchmarks_never_import_tests() -> None:
    assert _violations({"benchmarks"}, {"tests"}) == []


def test_the_two_roles_never_import_each_other() -> None:
    assert _violations({"prefill_worker"}, {"decode_worker"}) == []
    assert _violations({"decode_worker"}, {"prefill_worker"}) == []


def test_the_worker_host_core_knows_no_role_package() -> None:
    roots = {"worker.server", "worker.cli", "worker.__main__"}
    bad = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if _top(module) == "worker" and module not in roots
        for target in targets
        if _top(target) in {"prefill_worker", "decode_worker"}
    ]
    assert bad == []


def test_the_router_never_imports_torch() -> None:
    assert _violations({"router"}, {"torch", "triton"}) == []


def test_the_loop_finder_finds_a_loop() -> None:
    """The check above is only as good as `_loops`: a planted loop must show."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _loops(graph) == [["a", "b", "c"]]
