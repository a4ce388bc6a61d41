"""The store's public face (issue 34 item 4): the runtime and the CLI import ``spec_cache.store`` only through the
names it exports (``store/__init__.py``'s ``__all__``) and its two named sub-APIs, ``spec_cache.store.maintenance``
(operator work) and ``spec_cache.store.shared`` (the shared tier), each through its own ``__all__``: never keys,
cursors, record rows, the background queue's module or any other store module.

Read with ``ast`` (nothing is imported), every import statement, at module level and inside functions alike.
``spec_cache/apps/bench`` is the one exception: benchmarks of the store's internals (the allocator, a record
database, raw eviction) measure those internals and may reach inside.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STORE = "spec_cache.store"
# the sub-APIs the runtime may import from, each by the file whose ``__all__`` is its face
FACES = {STORE: ROOT / "store" / "__init__.py", f"{STORE}.maintenance": ROOT / "store" / "maintenance.py",
         f"{STORE}.shared": ROOT / "store" / "shared" / "__init__.py"}
# may reach inside the store: benchmarks of its internals
EXEMPT = (ROOT / "spec_cache" / "apps" / "bench",)


def exported(path: Path) -> set[str]:
    """The names in the module's ``__all__`` (a literal list or tuple of strings)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def runtime_files() -> list[Path]:
    return [p for p in sorted((ROOT / "spec_cache").rglob("*.py")) if not any(p.is_relative_to(e) for e in EXEMPT)]


def _within_store(name: str) -> bool:
    return name == STORE or name.startswith(STORE + ".")


def violations(path: Path, faces: dict[str, set[str]]) -> list[str]:
    """``path:line: what`` for every import in ``path`` that goes behind the store's face."""
    out = []
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [f"{rel}:{node.lineno}: import {a.name} (a store module behind its face)" for a in node.names
                    if _within_store(a.name) and a.name not in faces]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _within_store(node.module):
            if node.module not in faces:
                out.append(f"{rel}:{node.lineno}: from {node.module} import ... (a store module behind its face; "
                           f"import what it needs from {STORE})")
                continue
            out += [f"{rel}:{node.lineno}: from {node.module} import {a.name} (not in its __all__)"
                    for a in node.names if a.name not in faces[node.module]]
    return out


@pytest.fixture(scope="module")
def faces() -> dict[str, set[str]]:
    return {name: exported(path) for name, path in FACES.items()}


def test_the_runtime_and_the_cli_use_only_the_stores_face(faces):
    found = [line for path in runtime_files() for line in violations(path, faces)]
    assert not found, "imports behind the store's face:\n" + "\n".join(found)


def test_the_rule_sees_imports_behind_the_face(tmp_path, faces):
    """The checker itself: each way of reaching inside is caught (lines 1-3, 5, 8), the face is not."""
    source = tmp_path / "probe.py"
    source.write_text("from spec_cache.store.keys import pack_tokens\n"
                      "import spec_cache.store.env as env\n"
                      "from spec_cache.store import keys\n"
                      "def f():\n    from spec_cache.store.shared.tier import SharedTier\n"
                      "from spec_cache.store import Store, WriteBehind, pack_tokens, maintenance\n"
                      "from spec_cache.store.shared import SharedTier\n"
                      "from spec_cache.store.maintenance import Index\n"
                      "from spec_cache.store.maintenance import evict\n")
    lines = violations(source, faces)
    assert sorted(int(line.split(":")[1]) for line in lines) == [1, 2, 3, 5, 8], lines


def test_every_exported_name_exists():
    import importlib

    for name, path in FACES.items():
        module = importlib.import_module(name)
        missing = sorted(n for n in exported(path) if not hasattr(module, n))
        assert not missing, f"{name}.__all__ names what it lacks: {missing}"


def test_bench_is_the_only_exception_and_still_needs_it(faces):
    """The exemption is not stale: the benchmarks do reach inside (else drop it from ``EXEMPT``)."""
    bench = [line for e in EXEMPT for path in sorted(e.rglob("*.py")) for line in violations(path, faces)]
    assert bench


def test_store_says_readonly_closed_and_drops_an_entry(open_store, store_dir, store_invariants):
    """What the runtime asked ``store.env`` and ``store._forget_corrupt`` for, as ``Store``'s own API."""
    import numpy as np

    from spec_cache.store import LayerState, Tensor

    ns = bytes(range(32))
    tokens = list(range(1, 20))
    store = open_store()
    store.register_namespace(ns, target="a" * 64, prefix_namespace="p")
    kv = np.zeros((1, 1, len(tokens), 2), np.float32)
    store.put(ns, tokens, [LayerState("kv", {}, [Tensor.from_numpy(kv), Tensor.from_numpy(kv)], token_axis=2)])
    assert not store.readonly and not store.closed
    key = store.entry_key(ns, tokens)
    assert key is not None and store.lookup(ns, tokens) is not None
    store.drop_entry(key)
    assert store.lookup(ns, tokens) is None and store.entry_key(ns, tokens) is None
    store_invariants(store)
    store.close()
    assert store.closed
    with open_store(readonly=True) as reader:
        assert reader.readonly and not reader.closed
