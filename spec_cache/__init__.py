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
    "KVOptions": ("spec_cache.naming.namespace", "KVOptions"),
    "capture_options": ("spec_cache.naming.namespace", "capture_options"),
    "prefix_namespace": ("spec_cache.naming.namespace", "prefix_namespace"),
    "resolve_prefix_namespace": ("spec_cache.naming.namespace", "resolve_prefix_namespace"),
    "check_runnable": ("spec_cache.naming.namespace", "check_runnable"),
    "namespace_key": ("spec_cache.naming.namespace", "namespace_key"),
    "artifact_identity": ("spec_cache.naming.identity", "artifact_identity"),
    "model_identity": ("spec_cache.naming.identity", "model_identity"),
    "SpecCache": ("spec_cache.tiers.cache", "SpecCache"),
    "Generator": ("spec_cache.decode.generator", "Generator"),
    "Result": ("spec_cache.decode.generator", "Result"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'spec_cache' has no attribute {name!r}")


__all__ = sorted(_LAZY)
