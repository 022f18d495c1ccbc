"""torch_fsdp_ext's modules import one another without a cycle: every import counts, at module level, inside a
function (a late import) and under ``if TYPE_CHECKING:`` (a type-only import).

A cycle works at run time only as long as no module of it uses a name of another while that one is still
half imported, which depends on who imports first; the graph is read from the source with ``ast``, so an import
that never runs in a test counts too.
"""

from __future__ import annotations

import ast
import os
import tempfile
import textwrap

from torch.testing._internal.common_utils import TestCase, run_tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_files(package_dir: str, package: str) -> dict[str, str]:
    """{dotted module name: file} of every ``.py`` file under ``package_dir``, the package ``package``."""
    files = {}
    for directory, _, names in os.walk(package_dir):
        parts = [package, *os.path.relpath(directory, package_dir).split(os.sep)]
        parts = [part for part in parts if part != "."]
        for name in names:
            if name.endswith(".py"):
                stem = name[: -len(".py")]
                files[".".join(parts if stem == "__init__" else [*parts, stem])] = os.path.join(directory, name)
    return files


def import_graph(package_dir: str, package: str) -> dict[str, set[str]]:
    """{module: the package's modules it imports}, every ``import`` and ``from ... import`` of its source.

    ``from A import b`` is an edge to ``A.b`` where that is a module, else to ``A``. The parent packages that
    importing ``A.b`` runs first are not edges: a module inside the package finds them already importing.
    """
    files = module_files(package_dir, package)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        here = module.split(".") if is_package else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(tree):  # module level, function bodies and `if TYPE_CHECKING:` alike
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    targets.add(submodule if submodule in files else source)
        graph[module] = {target for target in targets if target in files and target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` through each group of modules that import one another (strongly connected)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph.get(node, ())):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [cycle_in(graph, set(group), group[0]) for group in groups]


def cycle_in(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``group`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & group):
                if successor == start:
                    path = [node]  # back from the last module to start
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"{start} is in no cycle of {sorted(group)}")


def write_package(root: str, files: dict[str, str]) -> str:
    package_dir = os.path.join(root, "pkg")
    for name, source in files.items():
        path = os.path.join(package_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(source))
    return package_dir


class TestImportGraph(TestCase):
    """The graph and cycle functions on small packages written for the test."""

    ACYCLIC = {
        "__init__.py": "from . import a\nfrom .b import thing\n",
        "a.py": """
            from typing import TYPE_CHECKING
            from . import c
            if TYPE_CHECKING:
                from .sub.d import D
            def late():
                import pkg.c
            """,
        "b.py": "import os\nfrom .sub import d\nthing = 1\n",
        "c.py": "import torch\n",
        "sub/__init__.py": "",
        "sub/d.py": "from .. import c\nclass D: ...\n",
    }

    def graph(self, files: dict[str, str]) -> dict[str, set[str]]:
        with tempfile.TemporaryDirectory() as tmp:
            return import_graph(write_package(tmp, files), "pkg")

    def test_every_kind_of_import_is_an_edge_and_an_acyclic_package_has_no_cycle(self):
        graph = self.graph(self.ACYCLIC)
        self.assertEqual(
            graph,
            {
                "pkg": {"pkg.a", "pkg.b"},
                "pkg.a": {"pkg.c", "pkg.sub.d"},  # module level, TYPE_CHECKING and late (absolute) imports
                "pkg.b": {"pkg.sub.d"},
                "pkg.c": set(),
                "pkg.sub": set(),
                "pkg.sub.d": {"pkg.c"},  # relative, two levels up
            },
        )
        self.assertEqual(cycles(graph), [])

    def test_a_late_import_closes_a_cycle(self):
        files = dict(self.ACYCLIC, **{"c.py": "def f():\n    from .a import late\n"})
        self.assertEqual(cycles(self.graph(files)), [["pkg.a", "pkg.c", "pkg.a"]])

    def test_a_type_only_import_closes_a_cycle(self):
        files = dict(
            self.ACYCLIC,
            **{"c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import d\n"},
        )
        self.assertEqual(cycles(self.graph(files)), [["pkg.c", "pkg.sub.d", "pkg.c"]])

    def test_each_cycle_is_reported(self):
        files = dict(
            self.ACYCLIC,
            **{"c.py": "from . import b\n", "sub/d.py": "import pkg.b\n", "b.py": "from . import c\nfrom .sub import d\n"},
        )
        self.assertEqual(cycles(self.graph(files)), [["pkg.b", "pkg.c", "pkg.b"]])
        files["a.py"] = "from . import sub\n"
        files["sub/__init__.py"] = "from .. import a\n"
        self.assertEqual(
            sorted(cycles(self.graph(files))), [["pkg.a", "pkg.sub", "pkg.a"], ["pkg.b", "pkg.c", "pkg.b"]]
        )


class TestPackageImports(TestCase):
    def test_torch_fsdp_ext_has_no_import_cycle(self):
        graph = import_graph(os.path.join(ROOT, "torch_fsdp_ext"), "torch_fsdp_ext")
        self.assertIn("torch_fsdp_ext._install", graph["torch_fsdp_ext"])  # the graph was read
        found = cycles(graph)
        if found:
            self.fail("import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found))


if __name__ == "__main__":
    run_tests()
