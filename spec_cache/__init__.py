"""spec-cache: a prefix cache for MLX speculative decoding.

Importing this package does not import MLX: the store, identity, namespace and CLI inspection paths stay light;
the runtime (``SpecCache``, ``Generator``) loads MLX when first used.
"""

import logging

__version__ = "0.1.0"

# A library's log lines reach the user only through handlers the application configures: without this, Python's
# last-resort handler printed every store warning a second time beside the CacheWarning that reports it.
logging.getLogger("spec_cache").addHandler(logging.NullHandler())

_LAZY = {
    "KVOptions": ("spec_cache.namespace", "KVOptions"),
    "capture_options": ("spec_cache.namespace", "capture_options"),
    "prefix_namespace": ("spec_cache.namespace", "prefix_namespace"),
    "resolve_prefix_namespace": ("spec_cache.namespace", "resolve_prefix_namespace"),
    "check_runnable": ("spec_cache.namespace", "check_runnable"),
    "namespace_key": ("spec_cache.namespace", "namespace_key"),
    "artifact_identity": ("spec_cache.identity", "artifact_identity"),
    "model_identity": ("spec_cache.identity", "model_identity"),
    "SpecCache": ("spec_cache.cache", "SpecCache"),
    "Generator": ("spec_cache.generator", "Generator"),
    "Result": ("spec_cache.generator", "Result"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'spec_cache' has no attribute {name!r}")


__all__ = sorted(_LAZY)
