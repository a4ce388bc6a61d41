"""Naming: what a model, a drafter and a prefix are called. Artifact identity (blake3 over config and weights),
namespaces (``<schema>:<artifact identity>``, the captured KV options) and the seed's byte-exact JSON (``jsjson``).

The lowest room of the runtime: it imports only ``spec_cache.errors`` and the store, and never MLX (the CLI's
inspection path stands on it).
"""
