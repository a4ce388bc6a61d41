"""The drafter method list is defined once (``spec_cache.drafters.METHODS``); every other list of methods agrees
with it, and ``open_provider`` is the one way from (directory, method) to a provider."""

from __future__ import annotations

import argparse
import importlib

import pytest

from spec_cache import drafters
from spec_cache.drafters import METHODS, load_provider, open_provider
from spec_cache.drafters.ngram import NgramProvider
from tests.runtime_fixtures import _identity_memo, tiny  # noqa: F401


def test_methods_are_the_provider_table():
    assert METHODS == ("assistant", "draft-model", "ngram", "deepspec", "dflash", "qwen-mtp", "dflash2")
    for method in METHODS:
        module, name = drafters._PROVIDERS[method]
        loaded = importlib.import_module(f"spec_cache.drafters.{module}")
        assert loaded.METHOD == method  # each provider module names its own method the same way
        assert hasattr(getattr(loaded, name), "load")


def _method_choices(parser: argparse.ArgumentParser) -> dict[str, tuple]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for inner in sub._actions:
                    if "--method" in inner.option_strings:
                        found[name] = tuple(inner.choices)
    return found


def test_cli_method_choices_are_methods():
    from spec_cache.apps.cli import build_parser

    choices = _method_choices(build_parser())
    assert choices, "no --method option found in the CLI"
    for command, methods in choices.items():
        assert methods == METHODS, command


def test_open_provider(tiny):  # noqa: F811
    assert open_provider() is None
    assert open_provider(None, None) is None
    ngram = open_provider(None, "ngram")
    assert isinstance(ngram, NgramProvider) and ngram.namespace == "ngram-history-v1:3:1"
    for name in ("assistant", "deepspec", "dflash", "draft-model"):
        with pytest.raises(ValueError, match="needs a drafter directory"):
            open_provider(None, name)
        assert open_provider(tiny.drafter_dir(name)).namespace == load_provider(tiny.drafter_dir(name)).namespace
    assert open_provider(tiny.drafter_dir("draft-model"), "draft-model").namespace.startswith("standalone-draft-v1:")
    with pytest.raises(ValueError, match="unknown drafter method 'nope'"):
        open_provider(tiny.drafter_dir("assistant"), "nope")
    with pytest.raises(ValueError, match="unknown drafter method 'nope'"):
        open_provider(None, "nope")
