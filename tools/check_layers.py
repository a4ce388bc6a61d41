"""The import-layer rule: ``schemas`` <- ``store`` <- ``spec_cache``, and no MLX below the runtime.

Reads every ``.py`` file of ``schemas/``, ``store/`` and ``spec_cache/`` with ``ast`` (nothing is imported) and
checks each import statement, at module level and inside functions alike:

- ``schemas`` (installed as ``spec_cache.schemas``) imports nothing else of spec-cache;
- ``store`` (``spec_cache.store``) imports only itself and ``spec_cache.schemas``, never a runtime module;
- neither imports ``mlx`` or ``mlx_lm``;
- nothing imports the bare top-level names ``store`` or ``schemas`` (they install as ``spec_cache.*``);
- the inspection modules (``spec_cache``, ``identity``, ``namespace``, ``jsjson``, the CLI package and its
  inspection path) reach no ``mlx``/``mlx_lm`` through their module-level imports, followed transitively through
  spec-cache's own modules (an import inside a function runs only when called, so it is not followed).

Usage: ``python tools/check_layers.py [ROOT]`` (default: this repository). Prints one line per violation,
``path:line: message``, and exits 1 if there is any, else 0. Costs a parse of each file (well under a second).
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
INSPECTION = ("spec_cache", "spec_cache.identity", "spec_cache.namespace", "spec_cache.jsjson", "spec_cache.apps",
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


# layer -> the spec-cache packages it may import
ALLOWED = {"spec_cache.schemas": ("spec_cache.schemas",),
           "spec_cache.store": ("spec_cache.store", "spec_cache.schemas")}


def _direct_problems(module: Module) -> list[tuple[int, str]]:
    problems = []
    layer = _layer(module.name)
    for imp in module.imports:
        top = imp.target.split(".")[0]
        if top in ("store", "schemas"):
            problems.append((imp.line, f"imports '{imp.target}': the package installs as spec_cache.{top}"))
        elif top in MLX and layer != "spec_cache":
            problems.append((imp.line, f"{layer} imports {imp.target} (no MLX below the runtime)"))
        elif top == "spec_cache" and layer in ALLOWED and not any(_within(imp.target, p) for p in ALLOWED[layer]):
            problems.append((imp.line, f"{layer} imports {imp.target} (it may import only "
                                       f"{' and '.join(ALLOWED[layer])})"))
    return problems


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


def check(root: Path) -> list[str]:
    """Every violation under ``root`` as ``path:line: message`` lines (empty: the tree keeps the rule)."""
    known = load_modules(root)
    out = []
    for module in known.values():
        rel = module.path.relative_to(root)
        out += [f"{rel}:{line}: {message}" for line, message in _direct_problems(module)]
    for name in INSPECTION:
        if name not in known:
            continue
        chain = mlx_chain(name, known)
        if chain:
            hops = " -> ".join(f"{m} (line {at})" if at else m for m, at in chain)
            rel = known[name].path.relative_to(root)
            out.append(f"{rel}:{chain[0][1]}: inspection module {name} imports MLX at module level: {hops}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    root = Path(argv[0] if argv else Path(__file__).resolve().parents[1])
    problems = check(root)
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} import-layer violations (see tools/check_layers.py)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
