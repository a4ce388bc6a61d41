"""LoRA adapters on the target: loading through mlx-lm, and the adapter part of the prefix namespace.

An adapter is an mlx-lm adapter directory (``adapter_config.json`` + ``adapters.safetensors``, as written by
``mlx_lm.lora``). Its namespace entry is ``id@revision``, where ``id`` names it (the directory name unless given)
and ``revision`` is 64 hex of blake3 over its config and weights (``artifact_identity`` with the seed
``spec-cache/adapter-identity/v1``): retraining an adapter under the same name orphans its old prefixes. A stack
of adapters joins its entries with ``+`` in the order applied; the base model is ``""``. The runtime's prefix
namespace takes the resolved stack through ``spec_cache.naming.namespace.resolve_prefix_namespace`` (which also drops
the drafter part for a drafter not valid under a target adapter).

Applying: one adapter is loaded exactly as ``mlx_lm.utils.load(..., adapter_path=...)`` does
(``mlx_lm.tuner.utils.load_adapters``, LoRA layers left unfused), so generation matches mlx-lm's. A stack is
applied in order, each adapter fused into the weights before the next is loaded (mlx-lm cannot wrap a LoRA
layer twice).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from spec_cache.errors import InvalidRequest, ModelLoadError

__all__ = ["ADAPTER_IDENTITY_SEED", "Adapter", "resolve_adapters", "adapters_namespace", "apply_adapters"]

ADAPTER_IDENTITY_SEED = "spec-cache/adapter-identity/v1"
ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


@dataclass(frozen=True)
class Adapter:
    """One adapter directory with its namespace id and content revision."""

    id: str
    path: Path
    revision: str

    @property
    def namespace_entry(self) -> str:
        return f"{self.id}@{self.revision}"


def _adapter(spec: Any, memo: Any) -> Adapter:
    from spec_cache.naming.identity import artifact_identity

    if isinstance(spec, Adapter):
        return spec
    if isinstance(spec, tuple) and len(spec) == 2:
        adapter_id, path = spec
    elif isinstance(spec, (str, os.PathLike)):
        adapter_id, path = None, spec
    else:
        raise TypeError(f"an adapter is a directory, an (id, directory) pair or an Adapter, not {spec!r}")
    path = Path(path)
    missing = [name for name in ADAPTER_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"adapter directory {path} lacks {', '.join(missing)} (an mlx-lm adapter has both)")
    adapter_id = path.resolve().name if adapter_id is None else adapter_id
    if not isinstance(adapter_id, str) or not adapter_id or "@" in adapter_id or "+" in adapter_id:
        raise InvalidRequest(f"adapter id must be a non-empty str free of '@' and '+', got {adapter_id!r}")
    revision = artifact_identity(ADAPTER_IDENTITY_SEED, [(name, path / name) for name in ADAPTER_FILES], memo=memo)
    return Adapter(adapter_id, path, revision)


def resolve_adapters(adapters: Any, memo: Any = None) -> tuple[Adapter, ...]:
    """The adapters of ``adapters``: ``""``/None/``()`` (the base model), one directory, or a sequence of
    directories, ``(id, directory)`` pairs or :class:`Adapter` values.

    A string that is not an adapter directory is refused: a namespace string alone would store base-model
    output under an adapter's name. Raises FileNotFoundError, TypeError or ValueError.
    """
    if adapters is None or adapters == "" or adapters == ():
        return ()
    if isinstance(adapters, (str, os.PathLike)):
        if not Path(adapters).is_dir():
            raise ModelLoadError(f"adapters {str(adapters)!r} is not an adapter directory; pass mlx-lm adapter "
                                 "directories (the namespace entry id@revision is computed from their files)")
        adapters = [adapters]
    resolved = tuple(_adapter(spec, memo) for spec in adapters)
    ids = [a.id for a in resolved]
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"adapter ids must be distinct, got {ids}")
    return resolved


def adapters_namespace(adapters: Sequence[Adapter]) -> str:
    """``id@revision`` joined with ``+`` (``""`` for none): the adapter part of the prefix namespace."""
    from spec_cache.naming.namespace import adapter_namespace

    return adapter_namespace([(a.id, a.revision) for a in adapters])


def apply_adapters(model: Any, paths: Sequence[str | Path | Adapter]) -> None:
    """Load the adapters into ``model`` in order (the last one unfused, earlier ones fused; see module doc)."""
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.utils import load_adapters

    paths = [p.path if isinstance(p, Adapter) else Path(p) for p in paths]
    for index, path in enumerate(paths):
        load_adapters(model, str(path))
        if index < len(paths) - 1:
            fused = [(name, module.fuse()) for name, module in model.named_modules() if hasattr(module, "fuse")]
            model.update_modules(tree_unflatten(fused))
    model.eval()
