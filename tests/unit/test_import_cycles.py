"""No import cycles between modules of ``tokenfleet/`` and ``services/`` (installed as ``tokenfleet.services``).

The graph has one node per module (a package is its ``__init__``) and one edge per import, found on the source as
the layering test finds them (``test_layering.module_files`` and ``imports``): every ``import`` and
``from ... import`` counts, function-level and ``TYPE_CHECKING`` ones included (a lazy import still ties two
modules together, and only hides the cycle until the call). Relative imports are resolved. An import's edge goes to
the most specific module it names:

- ``import a.b.c`` -> ``a.b.c`` (the longest prefix that is a module when it is not one);
- ``from pkg import name`` -> ``pkg.name`` when that is a module, else ``pkg`` (a name defined in, or re-exported
  by, ``pkg/__init__.py`` depends on that ``__init__``);
- ``from pkg.mod import name`` -> ``pkg.mod``.

Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, but that is not an edge: a package's
``__init__`` that re-exports from its children (``tokenfleet.cli`` re-exports ``cli.parser.main``) is no cycle
with them unless a child imports the package's ``__init__`` itself (``from pkg import name`` of a name that is not
a module). Imports outside the two trees are not nodes.

A cycle is a strongly connected component of more than one module; the test names one path through each. A test
of the test plants cycles in a scratch tree and expects them reported.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_layering import ROOT, SOURCES, imports, module_files


def _target(reached: str, modules: set[str]) -> str | None:
    """The module an imported dotted name lands on: itself, else its longest prefix that is a module."""
    parts = reached.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in modules:
            return name
    return None


def import_graph(root: Path) -> dict[str, set[str]]:
    files = module_files(root)
    modules = set(files)
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in files.items():
        for _name, reached in imports(path, module):
            for r in reached:
                target = _target(r, modules)
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one node, each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One cycle through the component's first module, as a path that returns to it (breadth first: a shortest one)."""
    start, members = component[0], set(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def cycles(root: Path) -> list[str]:
    """Each cycle, as ``a -> b -> a`` (the whole component after it)."""
    graph = import_graph(root)
    return [" -> ".join(cycle_path(graph, component)) + f"  (component: {', '.join(component)})"
            for component in strongly_connected(graph)]


def test_no_module_imports_itself_back():
    assert cycles(ROOT) == []


def _plant(root: Path, files: dict[str, str]) -> None:
    for folder in SOURCES.values():
        (root / folder).mkdir(parents=True, exist_ok=True)
    for where, text in files.items():
        (root / where).parent.mkdir(parents=True, exist_ok=True)
        (root / where).write_text(text + "\n")


@pytest.mark.parametrize("files", [
    {"tokenfleet/a.py": "from tokenfleet import b", "tokenfleet/b.py": "def f():\n    import tokenfleet.a"},
    {"tokenfleet/p/__init__.py": "from tokenfleet.p.child import f",  # the child imports a name of the __init__
     "tokenfleet/p/child.py": "from tokenfleet.p import g\ndef f(): ..."},
    {"tokenfleet/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B",
     "tokenfleet/b.py": "from tokenfleet.c import C", "tokenfleet/c.py": "from tokenfleet.a import A"},
    {"services/gateway/app.py": "from . import batch_api", "services/gateway/batch_api.py": "from .app import router"},
])
def test_a_planted_cycle_is_reported(tmp_path, files):
    _plant(tmp_path, files)
    found = cycles(tmp_path)
    assert len(found) == 1, found
    path = found[0].partition("  ")[0].split(" -> ")
    assert path[0] == path[-1] and len(path) == len(files) + 1, found


def test_a_package_init_that_re_exports_its_children_is_no_cycle(tmp_path):
    _plant(tmp_path, {"tokenfleet/p/__init__.py": "from tokenfleet.p.main import main",
                      "tokenfleet/p/main.py": "from tokenfleet.p import other\ndef main(): ...",
                      "tokenfleet/p/other.py": "import tokenfleet.p.main as m"})
    graph = import_graph(tmp_path)
    assert graph["tokenfleet.p"] == {"tokenfleet.p.main"} and graph["tokenfleet.p.main"] == {"tokenfleet.p.other"}
    assert cycles(tmp_path) == ["tokenfleet.p.main -> tokenfleet.p.other -> tokenfleet.p.main  "
                                          "(component: tokenfleet.p.main, tokenfleet.p.other)"]
