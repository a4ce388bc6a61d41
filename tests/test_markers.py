"""The automatic markers (tests/markers.py): a test earns ``redis`` / ``real_model`` / ``server`` from what its code,
its fixtures and the tests-package helpers they call name, and nothing from names it does not reach.

The samples are reached through a dict (a subscript is no name), so these tests themselves earn no marker."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

from tests.markers import AUTOMATIC, SLOW_LIST, earned, is_listed, item_markers, listed_slow, markers_for

ROOT = Path(__file__).resolve().parents[1]


def _start_a_server(path):
    return Server(path)  # noqa: F821  (never called: only its compiled names are read)


def _recurses(n):
    return _recurses(n - 1) if n else 0


def _redis_by_global():
    return ThrowawayCluster  # noqa: F821


def _redis_by_local_import():
    from tests.redis_servers import ThrowawayServer

    return ThrowawayServer


def _weights_by_attribute(demo_real):
    return demo_real.find_smollm2_gguf()


def _calls_a_helper(tmp_path):
    return _start_a_server(tmp_path)


def _nested(tmp_path):
    def inner():
        return [_start_a_server(tmp_path)]
    return inner


def _plain(tmp_path):
    import os

    import pytest

    return os.path.join(str(tmp_path), "Server"), _recurses(3), pytest.approx(1)


def _fixture_with_weights():
    from spec_cache.apps.demo_real import find_smollm2_gguf

    return find_smollm2_gguf()


def _test(fixture_with_weights):
    return _start_a_server(fixture_with_weights)


SAMPLES = {f.__name__.lstrip("_"): f for f in (_redis_by_global, _redis_by_local_import, _weights_by_attribute,
                                               _calls_a_helper, _nested, _plain, _fixture_with_weights, _test)}


def test_names_in_the_code_earn_their_marker():
    assert earned(SAMPLES["redis_by_global"]) == {"redis"}
    assert earned(SAMPLES["redis_by_local_import"]) == {"redis"}
    assert earned(SAMPLES["weights_by_attribute"]) == {"real_model"}


def test_helpers_of_the_tests_package_are_followed_and_others_are_not():
    assert earned(SAMPLES["calls_a_helper"]) == {"server"}
    assert earned(SAMPLES["nested"]) == {"server"}
    assert earned(SAMPLES["plain"]) == set()  # a string is no name; os and pytest are not followed; recursion ends


def test_an_item_earns_what_its_fixtures_earn_and_is_marked(request):
    fixture = SimpleNamespace(func=SAMPLES["fixture_with_weights"])
    item = SimpleNamespace(function=SAMPLES["test"],
                           _fixtureinfo=SimpleNamespace(name2fixturedefs={"fixture_with_weights": [fixture]}))
    assert markers_for(item) == {"real_model", "server", "slow"} <= AUTOMATIC  # both kinds are slow
    assert markers_for(request.node) == set()  # this test reaches the samples through a dict only
    assert not any(request.node.get_closest_marker(name) for name in AUTOMATIC)


def test_registered_markers_cover_the_automatic_ones(pytestconfig):
    registered = {line.split(":", 1)[0] for line in pytestconfig.getini("markers")}
    assert AUTOMATIC <= registered


def test_the_slow_list_names_files_and_functions_that_exist():
    """A renamed or removed test would silently leave the slow set: every line must still name something."""
    listed = listed_slow()
    assert "tests/apps/test_cli.py" in listed and len(listed) > 20
    for entry in sorted(listed):
        path, _, function = entry.partition("::")
        assert (ROOT / path).is_file(), f"{SLOW_LIST.name}: no file {path}"
        if function:
            tree = ast.parse((ROOT / path).read_text())
            names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
            assert function in names, f"{SLOW_LIST.name}: no test {function} in {path}"


def test_a_listed_file_or_function_covers_its_parameters_and_nothing_else():
    listed = frozenset({"tests/a/test_f.py", "tests/b/test_g.py::test_h"})
    assert is_listed("tests/a/test_f.py::test_x[1-2]", listed)
    assert is_listed("tests/b/test_g.py::test_h[p::q]", listed)
    assert is_listed("tests/b/test_g.py::test_h", listed)
    assert not is_listed("tests/b/test_g.py::test_h2", listed)
    assert not is_listed("tests/b/test_g.py::test_other", listed)


def test_a_written_server_mark_makes_the_test_slow_and_so_does_the_list():
    def item(nodeid, *written):
        return SimpleNamespace(nodeid=nodeid, function=SAMPLES["plain"], _fixtureinfo=None,
                               iter_markers=lambda: [SimpleNamespace(name=name) for name in written])

    listed = frozenset({"tests/a/test_f.py::test_listed"})
    assert item_markers(item("tests/a/test_f.py::test_x", "server"), listed) == {"slow"}  # server itself is on it
    assert item_markers(item("tests/a/test_f.py::test_x", "parametrize"), listed) == set()
    assert item_markers(item("tests/a/test_f.py::test_listed[1]"), listed) == {"slow"}
