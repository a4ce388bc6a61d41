"""Issue 37, attacker's pass: ``serve --help`` tells the default ``--max-bytes`` as it is computed
(``spec_cache.store.directory.default_budget``: half of the free space + the store's and its damaged copies'
bytes), not the old "what the store holds + half the disk's free space" (which grew at every restart)."""

from __future__ import annotations

import argparse

from spec_cache.apps.server.cli import add_arguments


def _help(option: str) -> str:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    action = next(a for a in parser._actions if option in a.option_strings)
    return " ".join(action.help.split())


def test_max_bytes_help_names_the_default_budget_as_computed():
    text = _help("--max-bytes")
    assert "what the store holds + half" not in text
    assert "half of the disk's free space + the bytes of the store and of its damaged copies" in text


def test_max_queue_help_tells_the_share_of_each_key():
    assert "several API keys" in _help("--max-queue")
