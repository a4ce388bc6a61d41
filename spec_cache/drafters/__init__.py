"""Draft providers: each one is loaded from a directory and opens grouped draft rows (see ``spec_cache.rows.protocol``).

| method        | provider             | row checkpoint schema   | namespace                                  |
|---------------|----------------------|-------------------------|--------------------------------------------|
| ``assistant``   | AssistantProvider    | ``gemma-assistant-v1``    | ``gemma-assistant-v1:<model identity>``      |
| ``draft-model`` | DraftModelProvider   | ``standalone-draft-v1``   | ``standalone-draft-v1:<model identity>``     |
| ``ngram``       | NgramProvider        | ``ngram-history-v1``      | ``ngram-history-v1:<max>:<min>``             |
| ``deepspec``    | DeepSpecProvider     | ``deepspec-context-v1``   | ``deepspec-context-v1:<model identity>``     |
| ``dflash``      | DFlashProvider       | ``dflash-context-v1``     | ``dflash-context-v1:<identity over dspark.json or a published config.json>`` |
| ``qwen-mtp``    | QwenMTPProvider      | ``qwen-mtp-v1``           | ``qwen-mtp-v1:<model identity>``             |
| ``dflash2``     | DFlash2Provider      | ``dflash2-context-v1``    | ``dflash2-context-v1:<model identity>:b<bits>`` |

GLM native MTP (``glm52-native-mtp-v1``) has a schema but no provider: mlx-lm 0.32's ``glm4_moe_lite`` drops
its MTP layers at load and there is no GLM target port.

Architectures and config keys: docs/DRAFTERS.md.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from spec_cache.drafters.dflash_config import is_published_dflash
from spec_cache.errors import InvalidRequest

__all__ = ["METHODS", "detect_method", "load_provider", "open_provider"]

#: method -> (module, provider class): the one list of drafter methods (the CLI's ``--method`` choices too)
_PROVIDERS = {
    "assistant": ("assistant", "AssistantProvider"),
    "draft-model": ("draft_model", "DraftModelProvider"),
    "ngram": ("ngram", "NgramProvider"),
    "deepspec": ("deepspec", "DeepSpecProvider"),
    "dflash": ("dflash", "DFlashProvider"),
    "qwen-mtp": ("qwen_mtp", "QwenMTPProvider"),
    "dflash2": ("dflash2", "DFlash2Provider"),
}
#: the drafter methods, in the order the docs list them
METHODS: tuple[str, ...] = tuple(_PROVIDERS)


def detect_method(model_dir: str | Path) -> str:
    """The drafter method of a directory: ``dflash`` when it holds a ``dspark.json`` or a published DFlash
    ``config.json`` (``dflash_config``), else its ``config.json``'s ``"method"``, else ``draft-model`` for an
    mlx-lm model."""
    if (Path(model_dir) / "dspark.json").is_file():
        return "dflash"
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"drafter directory {model_dir} has no config.json (nor a DFlash dspark.json)")
    config = json.loads(path.read_text())
    method = config.get("method")
    if is_published_dflash(config):  # a DFlash drafter's config.json as published (dflash_config)
        return "dflash"
    if method is None and "model_type" in config:
        return "draft-model"
    if method not in METHODS:
        raise InvalidRequest(f"unknown drafter method {method!r} in {path}; known: {', '.join(METHODS)}")
    return method


def _provider_class(method: str) -> Any:
    if method not in _PROVIDERS:
        raise InvalidRequest(f"unknown drafter method {method!r}; known: {', '.join(METHODS)}")
    module, name = _PROVIDERS[method]
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def load_provider(model_dir: str | Path, method: str | None = None) -> Any:
    """Load the draft provider in ``model_dir`` (``method`` None: :func:`detect_method`)."""
    method = detect_method(model_dir) if method is None else method
    return _provider_class(method).load(model_dir)


def open_provider(drafter_dir: str | Path | None = None, method: str | None = None) -> Any:
    """The draft provider of a (directory, method) choice, or None for no drafter: what ``Generator.load`` and the
    mlx-lm import both take.

    A directory: :func:`load_provider` (``method`` None: detected). No directory: ``ngram`` gives the default
    n-gram provider, None gives None, any other method raises ValueError (it needs a directory; an unknown
    method is named as such).
    """
    if drafter_dir is not None:
        return load_provider(drafter_dir, method)
    if method is not None and method not in _PROVIDERS:
        raise InvalidRequest(f"unknown drafter method {method!r}; known: {', '.join(METHODS)}")
    if method == "ngram":
        return _provider_class("ngram")()
    if method is not None:
        raise InvalidRequest(f"method {method!r} needs a drafter directory")
    return None
