"""The runtime's typed errors: what went wrong, said so that a caller can act on it by catching a name.

The store has its own family (``spec_cache.store.StoreError``: format, damage, full, corrupt records); this is the
family of the library above it. Four kinds, each for a different reaction of the caller:

- ``InvalidRequest``: the caller's input is wrong (a prompt that is not token ids, a token outside the
  vocabulary, an option out of range). Fix the call. It is also the store's ``InvalidInput`` (one notion of bad
  input across both floors: ``except InvalidInput`` catches either).
- ``RestoreRefused``: a stored prefix (caches, drafter checkpoint) cannot continue in this model / drafter / KV
  plan. Never the caller's fault: run the prompt cold (the cache treats it as a miss, the server's scheduler
  prefills cold).
- ``UnsupportedCombination``: this model, drafter and KV options cannot run together (a drafter paired with a
  target of another geometry, a KV bit width the kernels lack, a drafter config asking for a feature its family
  lacks). Change the setup.
- ``ModelLoadError``: a model or drafter directory (its config, its weights, its tokenizer) cannot be read or is
  not what it claims. ``identity.ModelDirError`` and ``gguf.UnsupportedGGUF`` are of this kind.

Every class is ALSO a ``ValueError`` (the builtin the runtime raised before these existed), so existing
``except ValueError`` callers and ``pytest.raises(ValueError)`` tests keep working. A bare ``ValueError`` left in
the library is a Python-level argument bug (an internal invariant), not something a user can cause.

One place each maps these to what a person sees: ``spec_cache.apps.cli.common.exit_code`` (exit codes and the
one-line message) and ``spec_cache.apps.server.errors.api_error`` (HTTP statuses, for the OpenAI and Anthropic
routes alike). Importing this module does not import MLX.
"""

from __future__ import annotations

from spec_cache.store import InvalidInput

__all__ = ["InvalidRequest", "ModelLoadError", "RestoreRefused", "SpecCacheError", "UnsupportedCombination"]


class SpecCacheError(Exception):
    """Base class of every error the runtime raises on purpose (catch it to catch them all)."""


class InvalidRequest(SpecCacheError, InvalidInput):
    """Bad input from the caller: not token ids, a token outside the vocabulary, an option out of range."""


class RestoreRefused(SpecCacheError, ValueError):
    """A stored prefix cannot be restored into this model / drafter / KV plan: run the prompt cold."""


class UnsupportedCombination(SpecCacheError, ValueError):
    """This model / drafter / KV option combination cannot run (the message names the part that does not fit)."""


class ModelLoadError(SpecCacheError, ValueError):
    """A model or drafter directory, its config, weights or tokenizer cannot be read or is not valid."""
