"""What a running command opens from its arguments: the cache, the KV options, the tokenizer.

Shared by ``runtime`` (generate, import-mlx-lm, ...) and ``chat``, which ``runtime`` registers: here, so neither
imports the other's module for them (``chat`` importing ``runtime`` made an import circle). MLX-free until a
function runs.
"""

from __future__ import annotations

from pathlib import Path

from spec_cache.apps.cli.common import CliError
from spec_cache.naming.namespace import KVOptions

__all__ = ["open_cache", "kv_options", "load_tokenizer"]


def open_cache(args, **kwargs):
    """``SpecCache.open`` on ``--cache`` with ``--memory-bytes`` (passed only when given, so the library's default
    memory tier applies otherwise) and any other keyword in ``kwargs``."""
    from spec_cache.tiers.cache import SpecCache  # loads MLX

    if getattr(args, "memory_bytes", None) is not None:
        kwargs["memory_bytes"] = args.memory_bytes
    return SpecCache.open(args.cache, **kwargs)


def kv_options(args) -> KVOptions:
    """``--kv-bits`` / ``--kv-group-size`` / ``--quantized-kv-start`` as ``KVOptions`` (a bad value: CliError)."""
    try:
        return KVOptions(kv_bits=args.kv_bits, kv_group_size=args.kv_group_size,
                         quantized_kv_start=args.quantized_kv_start)
    except (TypeError, ValueError) as exc:
        raise CliError(str(exc)) from None


def load_tokenizer(model: str):
    """The tokenizer of the model directory ``model`` (mlx-lm's loader; loads MLX), else a CliError."""
    try:
        from mlx_lm.utils import load_tokenizer as mlx_lm_load_tokenizer  # loads MLX

        return mlx_lm_load_tokenizer(Path(model))
    except Exception as exc:
        raise CliError(f"cannot load a tokenizer from {model} ({type(exc).__name__}); use --tokens") from None
