"""Canonical dtype names, sizes and safetensors codes.

Checkpoint tensors arrive as ``mx.array`` at run time, ``store.Tensor`` when
persisted and numpy arrays in tests. Schemas and the store compare dtypes by one
canonical name, so this module turns any of those spellings into it without
importing mlx or numpy (duck typing on ``str()``, ``.name`` and ``.dtype``).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from .errors import SchemaError

__all__ = [
    "DTYPE_NAMES",
    "DTYPE_ITEMSIZE",
    "SAFETENSORS_DTYPE",
    "DTYPE_FROM_SAFETENSORS",
    "FLOAT_DTYPES",
    "dtype_name",
]

#: Bytes per element for every canonical dtype name.
DTYPE_ITEMSIZE: Mapping[str, int] = MappingProxyType({
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
})

#: The canonical names, in a fixed order (also the order used in messages).
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_ITEMSIZE)

#: Canonical name -> safetensors header dtype code.
SAFETENSORS_DTYPE: Mapping[str, str] = MappingProxyType({
    "bool": "BOOL",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
})

#: safetensors header dtype code -> canonical name.
DTYPE_FROM_SAFETENSORS: Mapping[str, str] = MappingProxyType(
    {code: name for name, code in SAFETENSORS_DTYPE.items()}
)

#: Dtypes a drafter activation (hidden state, K/V rows) may have.
FLOAT_DTYPES: frozenset[str] = frozenset({"float16", "bfloat16", "float32"})

# Spellings other libraries print for the same dtype.
_ALIASES = {"bool_": "bool"}
_PREFIXES = ("mlx.core.", "numpy.", "np.")


def _from_text(text: str) -> str | None:
    name = text.strip()
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    name = _ALIASES.get(name, name)
    return name if name in DTYPE_ITEMSIZE else None


def _lookup(x: Any, depth: int = 0) -> str | None:
    """Canonical name of ``x`` or ``None``; never raises."""
    try:
        if isinstance(x, str):
            return _from_text(x)
        if isinstance(x, type):
            # numpy scalar types such as np.float32 (their str() is "<class ...>").
            if getattr(x, "__module__", "") == "numpy":
                return _from_text(x.__name__)
            return None
        # A tensor-like object: look at its dtype, one level deep. (Checked
        # before str(): a 0-d string array could print as "float32".)
        if hasattr(x, "dtype"):
            return _lookup(x.dtype, depth + 1) if depth == 0 else None
        # A dtype object: numpy's str() is "float32" (or ">f4" when byte-swapped,
        # which we refuse), mlx's str() is "mlx.core.float32".
        return _from_text(str(x))
    except Exception:  # any odd object: treat as unknown, never leak its error
        return None
    return None


def dtype_name(x: Any) -> str:
    """Canonical dtype name of ``x``.

    ``x`` may be a name (``"float32"``, ``"mlx.core.float32"``), a numpy or mlx
    dtype, a numpy scalar type, or any object with a ``.dtype`` attribute.

    Returns one of :data:`DTYPE_NAMES`.
    Raises :class:`SchemaError` (field ``"dtype"``) for anything else, including
    byte-swapped numpy dtypes.
    """
    found = _lookup(x)
    if found is None:
        try:
            shown = repr(x)
        except Exception:
            shown = f"<{type(x).__name__}>"
        if len(shown) > 80:
            shown = shown[:77] + "..."
        raise SchemaError(None, "dtype", f"unknown dtype {shown}; known: {', '.join(DTYPE_NAMES)}")
    return found
