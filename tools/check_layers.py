"""The import-layer rule: ``schemas`` <- ``store`` <- the library <- ``testing`` <- ``apps``, no import circles,
and no MLX below the runtime.

Reads every ``.py`` file of ``schemas/``, ``store/`` and ``spec_cache/`` with ``ast`` (nothing is imported) and
checks each import statement, at module level and inside functions alike (an import inside a function is a
dependency all the same: it only runs later, which is how circles hide):

- ``schemas`` (installed as ``spec_cache.schemas``) imports nothing else of spec-cache;
- ``store`` (``spec_cache.store``) imports only itself and ``spec_cache.schemas``, never a runtime module;
- the library (every other module of ``spec_cache``, ``spec_cache.drafters`` included) imports neither
  ``spec_cache.testing`` (tiny models and their writers) nor ``spec_cache.apps`` (CLI, servers, bench, demos);
  ``spec_cache.testing`` does not import ``spec_cache.apps``. Entry points (``spec_cache/__main__.py``, which
  runs the CLI) sit above every floor and may import the applications;
- inside the library, rooms in one order (``ROOMS``): naming < state < rows < drafters < tiers < decode <
  convert | training. A module imports its own room, the rooms below it and the ground (modules directly in
  ``spec_cache/``: ``errors``); never a room above it or beside it (convert and training share a rank);
- neither ``schemas`` nor ``store`` imports ``mlx`` or ``mlx_lm``;
- nothing imports the bare top-level names ``store`` or ``schemas`` (they install as ``spec_cache.*``);
- no import circles among the modules of the three packages: module A imports B, directly or through a chain, and
  B imports A. Every import counts (inside functions and under ``TYPE_CHECKING`` too), as a dependency on the
  module it names (not on the packages above it, whose ``__init__`` also runs). Each strongly connected group
  of modules is one circle, reported on one line with a shortest loop through it; the same at folder level
  (packages as nodes) for every folder below the applications;
- which names of the store the runtime may import (its face: ``spec_cache.store``'s ``__all__`` and the
  ``maintenance`` and ``shared`` sub-APIs; ``spec_cache/apps/bench`` may reach inside, to measure internals) is
  ``tests/store/test_store_face.py``'s rule, not this script's: it needs the store's ``__all__``, not the graph;
- the inspection modules (``spec_cache``, ``identity``, ``namespace``, ``jsjson``, the CLI package and its
  inspection path) reach no ``mlx``/``mlx_lm`` through their module-level imports, followed transitively through
  spec-cache's own modules (an import inside a function runs only when called, so it is not followed).

Why one file: a script CI runs by path (``.ci/run``), one rule read top to bottom; its parts (the import parser,
the layer, floor and room rules, the circle search) share the ``Module`` records and nothing else would import them.

Usage: ``python tools/check_layers.py [ROOT]`` (default: this repository). Prints one line per violation,
``path:line: message``, then a summary, ``layers: N modules, C circles, U upward imports, O other violations``,
and exits 1 if there is any violation, else 0. Costs a parse of each file (well under a second).
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

# folder at the root of the repository -> the package it installs as (pyproject's package-dir mapping)
PACKAGES = {"spec_cache": "spec_cache", "store": "spec_cache.store", "schemas": "spec_cache.schemas"}
MLX = ("mlx", "mlx_lm")
INSPECTION = ("spec_cache", "spec_cache.naming", "spec_cache.naming.identity", "spec_cache.naming.namespace",
              "spec_cache.naming.jsjson", "spec_cache.apps",
              "spec_cache.apps.cli", "spec_cache.apps.cli.common", "spec_cache.apps.cli.inspect",
              "spec_cache.apps.cli.shared", "spec_cache.apps.cli.repair")


@dataclass(frozen=True)
class Import:
    target: str       # absolute dotted name of the imported module (or of the module a name is taken from)
    line: int
    module_level: bool  # runs when the importing module is imported (not inside a function)


@dataclass(frozen=True)
class Module:
    name: str         # dotted name as installed, e.g. spec_cache.store.codec
    path: Path
    is_package: bool  # an __init__.py
    imports: tuple[Import, ...]


def _module_name(root: Path, path: Path) -> tuple[str, bool]:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGES[parts[0]]
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of ``from <level dots><name> import ...`` written in ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool, names: set[str]) -> list[Import]:
    """Each import in ``tree``; ``from pkg import x`` counts as importing ``pkg.x`` when that is a module in
    ``names``, else as importing ``pkg``."""
    found: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, module_level) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            targets = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names}
            found.extend(Import(target, node.lineno, module_level) for target in sorted(targets))
        inner = module_level and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(node, ast.If) and _is_type_checking(node):
            inner = False  # never runs
        for child in ast.iter_child_nodes(node):
            visit(child, inner)
    visit(tree, True)
    return found


def load_modules(root: Path) -> dict[str, Module]:
    """Every module of the three packages under ``root``, by installed name."""
    paths = {}
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            paths[path] = _module_name(root, path)
    names = {name for name, _ in paths.values()}
    modules = {}
    for path, (name, is_package) in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        modules[name] = Module(name, path, is_package, tuple(_imports(tree, name, is_package, names)))
    return modules


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _layer(name: str) -> str:
    return next((p for p in ("spec_cache.schemas", "spec_cache.store") if _within(name, p)), "spec_cache")


def _floor(name: str) -> str:
    """Which floor of ``spec_cache`` a module stands on: the applications, the test fixtures or the library."""
    return next((p for p in ("spec_cache.apps", "spec_cache.testing") if _within(name, p)), "the library")


# layer -> the spec-cache packages it may import
ALLOWED = {"spec_cache.schemas": ("spec_cache.schemas",),
           "spec_cache.store": ("spec_cache.store", "spec_cache.schemas")}
# floor of spec_cache -> the floors above it, which it may not import
FORBIDDEN = {"the library": ("spec_cache.testing", "spec_cache.apps"), "spec_cache.testing": ("spec_cache.apps",)}
# modules above every floor: they start an application (``python -m spec_cache`` runs the CLI)
ENTRY_POINTS = ("spec_cache.__main__",)


# The library's rooms, lowest first: a room may import its own modules and those of the rooms below it. Rooms on
# one rank (convert, training) stand side by side and import neither. Modules directly in spec_cache/ (errors, the
# package's lazy public face) are the ground every room stands on; they import no room.
ROOMS = (("spec_cache.naming",), ("spec_cache.state",), ("spec_cache.rows",), ("spec_cache.drafters",),
         ("spec_cache.tiers",), ("spec_cache.decode",), ("spec_cache.convert", "spec_cache.training"))


def room(name: str) -> str | None:
    """The library room a module stands in (``spec_cache.tiers`` for ``spec_cache.tiers.cache``); None for the
    ground (modules directly in ``spec_cache/``) and for modules outside the library."""
    if _layer(name) != "spec_cache" or _floor(name) != "the library":
        return None
    return next((r for rank in ROOMS for r in rank if _within(name, r)), None)


def _rank(name: str) -> int:
    """0 for the ground, else 1 + the index of the module's room in ``ROOMS``."""
    here = room(name)
    return 0 if here is None else 1 + next(i for i, rank in enumerate(ROOMS) if here in rank)


def _room_violation(module: Module, imp: Import) -> str | None:
    """Why a library module's import of another library module runs up (or across) the room order, or None."""
    if _floor(imp.target) != "the library" or _layer(imp.target) != "spec_cache" or imp.target == "spec_cache":
        return None
    mine, theirs = room(module.name), room(imp.target)
    if mine == theirs:
        return None
    here, there = _rank(module.name), _rank(imp.target)
    if there < here:
        return None
    where = mine or "the ground (spec_cache/)"
    relation = "stands beside" if there == here else "stands above"
    return f"{module.name} imports {imp.target}: room {theirs} {relation} {where}"


def _upward(module: Module, imp: Import) -> str | None:
    """Why ``imp`` runs up a layer, a floor or a room, or None."""
    layer = _layer(module.name)
    if layer in ALLOWED:
        if not any(_within(imp.target, p) for p in ALLOWED[layer]):
            return f"{layer} imports {imp.target} (it may import only {' and '.join(ALLOWED[layer])})"
        return None
    if module.name in ENTRY_POINTS or module.name == "spec_cache":
        return None
    floor = _floor(module.name)
    above = next((p for p in FORBIDDEN.get(floor, ()) if _within(imp.target, p)), None)
    if above:
        return f"{module.name} imports {imp.target}: {above} stands above {floor}"
    if floor == "the library":
        return _room_violation(module, imp)
    return None


def _direct_problems(module: Module) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(upward imports, other violations) of ``module``, each as (line, message)."""
    upward, other = [], []
    layer = _layer(module.name)
    for imp in module.imports:
        top = imp.target.split(".")[0]
        if top in ("store", "schemas"):
            other.append((imp.line, f"imports '{imp.target}': the package installs as spec_cache.{top}"))
        elif top in MLX and layer != "spec_cache":
            other.append((imp.line, f"{layer} imports {imp.target} (no MLX below the runtime)"))
        elif top == "spec_cache" and (why := _upward(module, imp)):
            upward.append((imp.line, why))
    return upward, other


def _edges(module: Module, known: dict[str, Module]) -> list[tuple[str, int]]:
    """Modules run when ``module`` is imported: its module-level imports, each with its parent packages."""
    out = []
    for imp in module.imports:
        if not imp.module_level:
            continue
        parts = imp.target.split(".")
        if parts[0] in MLX:
            out.append((parts[0], imp.line))
            continue
        out += [(name, imp.line) for name in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                if name in known and name != module.name]
    return out


def mlx_chain(start: str, known: dict[str, Module]) -> list[tuple[str, int]] | None:
    """The shortest chain of module-level imports from ``start`` to mlx/mlx_lm, as (module, line) hops."""
    seen = {start: None}
    queue = deque([start])
    while queue:
        name = queue.popleft()
        for target, line in _edges(known[name], known):
            if target in seen:
                continue
            seen[target] = (name, line)
            if target in MLX:
                chain, node = [], target
                while seen[node] is not None:
                    parent, at = seen[node]
                    chain.append((parent, at))
                    node = parent
                return list(reversed(chain)) + [(target, 0)]
            if target in known:
                queue.append(target)
    return None


def import_graph(known: dict[str, Module]) -> dict[str, dict[str, int]]:
    """module -> {module it depends on: first line}, over every import (function-level and TYPE_CHECKING too).
    The module named is the dependency (``from a.b import c``: ``a.b.c`` when that is a module, else ``a.b``), not
    the packages above it whose ``__init__`` Python runs first: a package importing its own submodules would
    otherwise make a circle of every package."""
    graph: dict[str, dict[str, int]] = {name: {} for name in known}
    for module in known.values():
        for imp in module.imports:
            if imp.target in known and imp.target != module.name:
                graph[module.name].setdefault(imp.target, imp.line)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's groups of modules that reach each other (iterative: no recursion limit), those of 2 or more."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return sorted(groups)


def shortest_loop(graph: dict[str, dict[str, int]], group: list[str]) -> list[str]:
    """The shortest loop from the group's first module back to itself, inside the group."""
    members, start = set(group), group[0]
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph[node]):
            if child == start:
                loop = [node]
                while loop[-1] != start:
                    loop.append(parent[loop[-1]])
                return [*reversed(loop), start]
            if child in members and child not in parent:
                parent[child] = node
                queue.append(child)
    raise AssertionError(f"{group} is not strongly connected")


def circles(known: dict[str, Module], root: Path) -> list[str]:
    """One ``path:line: message`` line per import circle (a strongly connected group of modules)."""
    graph = import_graph(known)
    out = []
    for group in strongly_connected(graph):
        loop = shortest_loop(graph, group)
        hops = " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(loop, loop[1:])) + f" -> {loop[0]}"
        rest = sorted(set(group) - set(loop))
        also = f"; also in this circle: {', '.join(rest)}" if rest else ""
        rel = known[loop[0]].path.relative_to(root)
        out.append(f"{rel}:{graph[loop[0]][loop[1]]}: import circle of {len(group)} modules: {hops}{also}")
    return out


def folder_of(module: Module) -> str:
    """The folder (package) a module lies in: itself for a package's ``__init__``."""
    return module.name if module.is_package else module.name.rpartition(".")[0]


def folder_circles(known: dict[str, Module], root: Path) -> list[str]:
    """One line per circle among the folders below the applications: folder A holds a module importing one of
    folder B, and B (through a chain of folders) back into A. Module circles are reported apart; this catches two
    folders leaning on each other through different modules, which no module circle shows."""
    graph: dict[str, dict[str, int]] = {}
    where: dict[tuple[str, str], Module] = {}
    for module in known.values():
        if module.name in ENTRY_POINTS or _floor(module.name) == "spec_cache.apps":
            # an entry point stands above every floor (``python -m spec_cache`` runs the CLI); the applications'
            # folders are not yet in an order of their own (cli and server share cli.common), so only the library,
            # the store, the schemas and the test fixtures are held to it
            continue
        mine = folder_of(module)
        graph.setdefault(mine, {})
        for imp in module.imports:
            if imp.target in known and (theirs := folder_of(known[imp.target])) != mine:
                graph[mine].setdefault(theirs, imp.line)
                where.setdefault((mine, theirs), module)
    for edges in list(graph.values()):
        for folder in edges:
            graph.setdefault(folder, {})
    out = []
    for group in strongly_connected(graph):
        loop = shortest_loop(graph, group)
        hops = " -> ".join(f"{a} ({where[a, b].name} line {graph[a][b]})" for a, b in zip(loop, loop[1:]))
        rel = where[loop[0], loop[1]].path.relative_to(root)
        out.append(f"{rel}:{graph[loop[0]][loop[1]]}: folder circle of {len(group)} folders: {hops} -> {loop[0]}")
    return out


@dataclass
class Report:
    modules: int
    circles: list[str]
    upward: list[str]
    other: list[str]  # bare package names, MLX below the runtime or on an inspection path

    @property
    def lines(self) -> list[str]:
        return self.circles + self.upward + self.other

    @property
    def summary(self) -> str:
        return (f"layers: {self.modules} modules, {len(self.circles)} circles, {len(self.upward)} upward imports, "
                f"{len(self.other)} other violations")


def analyse(root: Path) -> Report:
    """Every violation under ``root``, sorted by kind."""
    known = load_modules(root)
    upward, other = [], []
    for module in known.values():
        rel = module.path.relative_to(root)
        up, rest = _direct_problems(module)
        upward += [f"{rel}:{line}: {message}" for line, message in up]
        other += [f"{rel}:{line}: {message}" for line, message in rest]
    for name in INSPECTION:
        if name not in known:
            continue
        chain = mlx_chain(name, known)
        if chain:
            hops = " -> ".join(f"{m} (line {at})" if at else m for m, at in chain)
            rel = known[name].path.relative_to(root)
            other.append(f"{rel}:{chain[0][1]}: inspection module {name} imports MLX at module level: {hops}")
    return Report(len(known), circles(known, root) + folder_circles(known, root), upward, other)


def check(root: Path) -> list[str]:
    """Every violation under ``root`` as ``path:line: message`` lines (empty: the tree keeps the rule)."""
    return analyse(root).lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[1])
    report = analyse(root)
    for line in report.lines:
        print(line)
    print(report.summary)
    return 1 if report.lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
