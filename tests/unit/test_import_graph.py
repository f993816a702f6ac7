"""The product's import graph: every module imports, dependencies point one way, no loops.

Two checks, both over the product packages a wheel ships (`pyproject.toml`'s package list):

- every module imports in this interpreter, so an undeclared or broken import fails here, fast,
  instead of in the middle of a test or a user's `pdserve` command;
- the module graph read from the source (`ast`, every import statement: those inside
  functions and inside `if TYPE_CHECKING:` blocks too, relative ones resolved) has no loop,
  neither between modules nor between top-level packages (an edge `a.x -> b.y` is an edge
  `a -> b`), and the layering rules hold:
  the product never imports `benchmarks` or `tests`, `benchmarks` never imports `tests`,
  the role packages (`prefill_worker`, `decode_worker`, `colocated_worker`) never import each
  other, the worker host never imports a role package (only its composition root
  `worker_main`, above both, does), and the router never imports torch.
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


def _resolve(name: str, known: set[str]) -> str:
    """The longest project module that `name` is or lies in; else its top-level name."""
    probe = name
    while probe and probe not in known:
        probe = probe.rpartition(".")[0]
    return probe or name.split(".")[0]


def _imports(module: str, path: Path, known: set[str]) -> Iterator[str]:
    """Every module `path` imports, counting every import statement (function-local ones and
    `TYPE_CHECKING` ones too: a loop hidden from the interpreter is still a loop of ideas)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (_resolve(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[: len(parts) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                yield _resolve(f"{base}.{alias.name}", known)


def _graph() -> dict[str, set[str]]:
    modules = _modules([*PRODUCT, "benchmarks", "tests"])
    known = set(modules)
    graph = {name: set(_imports(name, path, known)) for name, path in modules.items()}
    # a module importing a package it lies in (its own `__init__`) is not a loop of ideas
    return {
        name: {t for t in targets if t != name and not name.startswith(t + ".")}
        for name, targets in graph.items()
    }


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


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges = packages.setdefault(_top(module), set())
        edges.update(_top(t) for t in targets if _top(t) != _top(module))
    return packages


def test_no_import_loop_between_packages() -> None:
    assert _loops(_package_graph(GRAPH)) == []


def test_tooling_sits_below_deploy() -> None:
    """deploy's commands run tooling; tooling takes deploy's launchers as parameters."""
    assert _violations({"tooling"}, {"deploy"}) == []


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


ROLE_PACKAGES = {"prefill_worker", "decode_worker", "colocated_worker"}


@pytest.mark.parametrize("package", sorted(ROLE_PACKAGES))
def test_the_role_packages_never_import_each_other(package: str) -> None:
    """Roles are composed above them (`worker_main`), never by one importing another."""
    assert _violations({package}, ROLE_PACKAGES - {package}) == []


@pytest.mark.parametrize("package", sorted(ROLE_PACKAGES))
def test_roles_never_touch_a_transport_or_the_scheduler(package: str) -> None:
    """Roles are RPC -> sink adapters: every KV hand-off goes through the worker's hand-off
    owner (`worker.kv_handoff`), so no role imports `kvtransfer` or reads an engine's
    `scheduler`."""
    assert _violations({package}, {"kvtransfer"}) == []
    reaches = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in sorted((REPO / package).rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "scheduler"
    ]
    assert reaches == []


def test_the_worker_host_core_knows_no_role_package() -> None:
    """The host takes its roles from the composition root above it (`worker_main`)."""
    assert _violations({"worker"}, ROLE_PACKAGES | {"worker_main"}) == []


def test_model_runtime_kernels_import_nothing_above_them() -> None:
    """The compiled kernels and their bindings sit below the model and the runner: a kernel
    module that imported `model_runtime.model` (a back-arrow) would make the kernels package
    depend on what depends on it."""
    found = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module.startswith("model_runtime.kernels")
        for target in targets
        if _top(target) == "model_runtime" and not target.startswith("model_runtime.kernels")
    )
    assert found == []


def test_the_router_never_imports_torch() -> None:
    assert _violations({"router"}, {"torch", "triton"}) == []


def test_the_reader_sees_hidden_and_relative_imports(tmp_path: Path) -> None:
    """A `TYPE_CHECKING` import, a function-local one and a relative one are all edges."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.b import B\n"
        "def f():\n    import p.c\nfrom . import d\nfrom .e import E\n"
    )
    known = {"p", "p.a", "p.b", "p.c", "p.d", "p.e"}
    found = set(_imports("p.a", pkg / "a.py", known))
    assert found >= {"p.b", "p.c", "p.d", "p.e"}, found


def test_the_loop_finder_finds_a_loop() -> None:
    """The check above is only as good as `_loops`: a planted loop must show."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _loops(graph) == [["a", "b", "c"]]
