"""Small tensor checks shared by the schema families.

Each helper reads a tensor-like object through duck typing only (``.shape``,
``.dtype``) and turns any surprise into a SchemaError naming the field, so a
malformed tensor never leaks a TypeError from deep inside a validator.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

from .dtypes import FLOAT_DTYPES, _lookup
from .spec import AttachmentSchema

__all__ = ["shape_of", "dtype_of", "expect_count", "expect_rank", "expect_float", "expect_hidden", "expect_pair"]


def shape_of(schema: AttachmentSchema, tensors: Sequence[Any], index: int) -> tuple[int, ...]:
    """``tensors[index].shape`` as a tuple of non-negative ints."""
    field = f"tensors[{index}].shape"
    try:
        raw = tensors[index].shape
        dims = tuple(raw)
    except Exception as error:
        raise schema.error(field, f"unreadable shape ({type(error).__name__})") from None
    shape = []
    for dim in dims:
        if isinstance(dim, bool):
            raise schema.error(field, f"dimensions must be ints, got {dims!r}")
        try:
            value = operator.index(dim)
        except TypeError:
            raise schema.error(field, f"dimensions must be ints, got {dims!r}") from None
        if value < 0:
            raise schema.error(field, f"dimensions must be non-negative, got {dims!r}")
        shape.append(value)
    return tuple(shape)


def dtype_of(schema: AttachmentSchema, tensors: Sequence[Any], index: int) -> str:
    """Canonical dtype name of ``tensors[index]``."""
    field = f"tensors[{index}].dtype"
    try:
        raw = tensors[index].dtype
    except Exception as error:
        raise schema.error(field, f"unreadable dtype ({type(error).__name__})") from None
    name = _lookup(raw)
    if name is None:
        raise schema.error(field, f"unknown dtype {str(raw)[:60]!r}")
    return name


def expect_count(schema: AttachmentSchema, tensors: Sequence[Any], count: int, layout: str, prefix: str = "") -> None:
    if len(tensors) != count:
        raise schema.error("tensors", f"{prefix}expected {count} tensor(s) {layout}, got {len(tensors)}")


def expect_rank(
    schema: AttachmentSchema, tensors: Sequence[Any], index: int, rank: int, layout: str, prefix: str = ""
) -> tuple[int, ...]:
    shape = shape_of(schema, tensors, index)
    if len(shape) != rank:
        raise schema.error(f"tensors[{index}].shape", f"{prefix}expected rank {rank} {layout}, got shape {list(shape)}")
    return shape


def expect_float(schema: AttachmentSchema, tensors: Sequence[Any], index: int) -> str:
    name = dtype_of(schema, tensors, index)
    if name not in FLOAT_DTYPES:
        raise schema.error(
            f"tensors[{index}].dtype", f"expected a float dtype ({', '.join(sorted(FLOAT_DTYPES))}), got {name}"
        )
    return name


def expect_hidden(schema: AttachmentSchema, tensors: Sequence[Any], index: int) -> None:
    """Tensor ``index`` is one hidden state: shape ``[1, 1, hiddenSize]`` with ``hiddenSize > 0``, a float dtype."""
    shape = expect_rank(schema, tensors, index, 3, "[1, 1, hiddenSize]")
    if shape[0] != 1 or shape[1] != 1 or shape[2] < 1:
        raise schema.error(f"tensors[{index}].shape",
                           f"expected [1, 1, hiddenSize] with hiddenSize > 0, got {list(shape)}")
    expect_float(schema, tensors, index)


def expect_pair(
    schema: AttachmentSchema, tensors: Sequence[Any], k: int, v: int, length: int, prefix: str = ""
) -> tuple[int, ...]:
    """K and V rows ``[1, kvHeads, length, headDim]``, same shape, same float dtype."""
    layout = "[1, kvHeads, tokens, headDim]"
    k_shape = expect_rank(schema, tensors, k, 4, layout, prefix)
    v_shape = expect_rank(schema, tensors, v, 4, layout, prefix)
    for index, shape in ((k, k_shape), (v, v_shape)):
        if shape[0] != 1 or shape[1] < 1 or shape[3] < 1:
            raise schema.error(
                f"tensors[{index}].shape", f"expected {layout} with kvHeads, headDim > 0, got {list(shape)}"
            )
        if shape[2] != length:
            raise schema.error(
                f"tensors[{index}].shape", f"{prefix}axis 2 must be {length} (covered tokens), got shape {list(shape)}"
            )
    if k_shape != v_shape:
        raise schema.error(
            f"tensors[{v}].shape", f"V shape {list(v_shape)} differs from K (tensors[{k}]) {list(k_shape)}"
        )
    k_dtype = expect_float(schema, tensors, k)
    v_dtype = expect_float(schema, tensors, v)
    if k_dtype != v_dtype:
        raise schema.error(f"tensors[{v}].dtype", f"V dtype {v_dtype} differs from K (tensors[{k}]) {k_dtype}")
    return k_shape


def expect_processed_tokens(schema: AttachmentSchema, metadata: Any, processed_tokens: int, alignment: str) -> None:
    """``metadata.processedTokens`` must equal the checkpoint's ``processed_tokens``; ``alignment`` opens the
    message (each schema keeps mlx-bun's own phrase)."""
    stored = metadata["processedTokens"]
    if stored != processed_tokens:
        raise schema.error(
            "metadata.processedTokens",
            f"{alignment}: metadata.processedTokens={stored}, checkpoint processed_tokens={processed_tokens}",
        )
