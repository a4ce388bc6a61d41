"""What the store holds per layer, without knowing MLX.

``Tensor`` is a dtype name, a shape and a C-contiguous buffer (a ``memoryview`` of an ``mx.array``, a numpy
array, ``bytes``). ``LayerState`` is one target-cache layer as mlx-lm's ``state`` protocol gives it: a kind
string, length-independent scalars, its tensors, and ``token_axis`` when the state is a plain per-token
sequence that may be split at any token (KV and quantized KV). Layers without a token axis (rotating rings,
recurrent arrays) are stored whole at their exact boundary and never trimmed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spec_cache.schemas.dtypes import DTYPE_ITEMSIZE, dtype_name

from .errors import InvalidInput

_NUMPY_DTYPES = {
    "bool": np.bool_, "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64, "float16": np.float16,
    "bfloat16": np.uint16,  # numpy has no bfloat16: carried as its raw 16-bit words
    "float32": np.float32, "float64": np.float64, "complex64": np.complex64,
}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds ``name``'s bytes (bfloat16 -> uint16 words)."""
    return np.dtype(_NUMPY_DTYPES[name]).newbyteorder("<")


@dataclass(frozen=True)
class Tensor:
    """A named-dtype, shaped, contiguous little-endian buffer."""

    dtype: str
    shape: tuple[int, ...]
    data: Any = field(repr=False)

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        shape = tuple(self.shape)
        if any((not isinstance(d, (int, np.integer))) or isinstance(d, bool) or d < 0 for d in shape):
            raise InvalidInput(f"tensor shape must be non-negative ints, got {shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    @classmethod
    def checked(cls, dtype: str, shape: tuple[int, ...], data: Any) -> "Tensor":
        """A tensor whose canonical dtype name and shape of non-negative ints the caller already checked
        (``decode_record``: a restore makes hundreds, and ``__post_init__`` would check each again)."""
        t = object.__new__(cls)
        object.__setattr__(t, "dtype", dtype)
        object.__setattr__(t, "shape", shape)
        object.__setattr__(t, "data", data)
        return t

    @property
    def nbytes(self) -> int:
        n = DTYPE_ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def array(self) -> np.ndarray:
        """A numpy view of the data with this tensor's shape (bfloat16 as uint16 words)."""
        return as_numpy(self.data, self.dtype, self.shape)

    @classmethod
    def from_numpy(cls, arr: np.ndarray, dtype: str | None = None) -> "Tensor":
        arr = np.ascontiguousarray(arr)
        return cls(dtype or dtype_name(arr.dtype), arr.shape, arr)


def as_numpy(data: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """View any contiguous buffer as a numpy array of ``dtype``/``shape`` without copying."""
    if isinstance(data, np.ndarray):
        arr = data
        if arr.dtype != numpy_dtype(dtype):
            arr = np.ascontiguousarray(arr).view(np.uint8).view(numpy_dtype(dtype))
    else:
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise InvalidInput("tensor data must be C-contiguous")
        try:
            mv = mv.cast("B")
        except TypeError:  # formats memoryview cannot cast (e.g. bfloat16): go through numpy's byte view
            mv = memoryview(np.frombuffer(mv.tobytes(), dtype=np.uint8))
        arr = np.frombuffer(mv, dtype=numpy_dtype(dtype))
    expected = 1
    for d in shape:
        expected *= d
    if arr.size != expected:
        raise InvalidInput(f"tensor data holds {arr.size} {dtype} values, shape {list(shape)} needs {expected}")
    return arr.reshape(shape)


@dataclass(frozen=True)
class LayerState:
    """One target cache layer: kind (e.g. "kv", "qkv", "rotating", "arrays"), scalars, tensors."""

    kind: str
    meta: dict
    tensors: tuple[Tensor, ...]
    token_axis: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "tensors", tuple(self.tensors))
        object.__setattr__(self, "meta", dict(self.meta))
        if not isinstance(self.kind, str) or not self.kind:
            raise InvalidInput("layer kind must be a non-empty string")
        if self.token_axis is not None:
            for t in self.tensors:
                if not (0 <= self.token_axis < len(t.shape)):
                    raise InvalidInput(f"token_axis {self.token_axis} out of range for shape {list(t.shape)}")

    @property
    def tokens(self) -> int | None:
        """Tokens covered along the token axis (None for layers stored whole)."""
        if self.token_axis is None or not self.tensors:
            return None
        return self.tensors[0].shape[self.token_axis]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)
