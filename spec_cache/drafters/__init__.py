"""Draft providers: each one is loaded from a directory and opens grouped draft rows (see ``spec_cache.rows``).

| method        | provider             | row checkpoint schema   | namespace                                  |
|---------------|----------------------|-------------------------|--------------------------------------------|
| ``assistant``   | AssistantProvider    | ``gemma-assistant-v1``    | ``gemma-assistant-v1:<model identity>``      |
| ``draft-model`` | DraftModelProvider   | ``standalone-draft-v1``   | ``standalone-draft-v1:<model identity>``     |
| ``ngram``       | NgramProvider        | ``ngram-history-v1``      | ``ngram-history-v1:<max>:<min>``             |
| ``deepspec``    | DeepSpecProvider     | ``deepspec-context-v1``   | ``deepspec-context-v1:<model identity>``     |
| ``dflash``      | DFlashProvider       | ``dflash-context-v1``     | ``dflash-context-v1:<identity over dspark.json>`` |

Architectures and config keys: docs/DRAFTERS.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["METHODS", "detect_method", "load_provider"]

METHODS = ("assistant", "draft-model", "ngram", "deepspec", "dflash")


def detect_method(model_dir: str | Path) -> str:
    """The drafter method of a directory: ``dflash`` when it holds a ``dspark.json``, else its ``config.json``'s
    ``"method"``, else ``draft-model`` for an mlx-lm model."""
    if (Path(model_dir) / "dspark.json").is_file():
        return "dflash"
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"drafter directory {model_dir} has no config.json (nor a DFlash dspark.json)")
    config = json.loads(path.read_text())
    method = config.get("method")
    if method is None and "model_type" in config:
        return "draft-model"
    if method not in METHODS:
        raise ValueError(f"unknown drafter method {method!r} in {path}; known: {', '.join(METHODS)}")
    return method


def load_provider(model_dir: str | Path, method: str | None = None) -> Any:
    """Load the draft provider in ``model_dir`` (``method`` None: :func:`detect_method`)."""
    method = detect_method(model_dir) if method is None else method
    if method == "assistant":
        from .assistant import AssistantProvider

        return AssistantProvider.load(model_dir)
    if method == "draft-model":
        from .draft_model import DraftModelProvider

        return DraftModelProvider.load(model_dir)
    if method == "ngram":
        from .ngram import NgramProvider

        return NgramProvider.load(model_dir)
    if method == "deepspec":
        from .deepspec import DeepSpecProvider

        return DeepSpecProvider.load(model_dir)
    if method == "dflash":
        from .dflash import DFlashProvider

        return DFlashProvider.load(model_dir)
    raise ValueError(f"unknown drafter method {method!r}; known: {', '.join(METHODS)}")
