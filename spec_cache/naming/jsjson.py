"""JavaScript's ``JSON.stringify`` and ``Number.prototype.toString``, byte for byte, and immutable JSON values.

The prefix namespace is mlx-bun's ``JSON.stringify`` output, so these functions must agree with a JavaScript
engine on every input (``tests/library/test_namespace.py`` checks them against node).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterator, Mapping
from typing import Any, Union

from spec_cache.errors import InvalidRequest

__all__ = ["FrozenJSONObject", "JSONValue", "js_json_dumps", "js_number_to_string"]

_MAX_JSON_DEPTH = 100
_MAX_ARRAY_INDEX = 2**32 - 2  # ECMAScript "array index": the keys an object lists first, in numeric order

# ---------------------------------------------------------------------------------------------------------
# JavaScript JSON.stringify, byte for byte

_NEEDS_ESCAPE = re.compile("([\ud800-\udbff][\udc00-\udfff])|[\x00-\x1f\"\\\\\ud800-\udfff]")
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ARRAY_INDEX = re.compile("0|[1-9][0-9]{0,9}")


def _escape(match: re.Match[str]) -> str:
    pair = match.group(1)
    if pair:  # a well-formed surrogate pair is one character to JavaScript: written as-is
        return chr(0x10000 + ((ord(pair[0]) - 0xD800) << 10) + (ord(pair[1]) - 0xDC00))
    char = match.group(0)
    return _SHORT_ESCAPES.get(char) or f"\\u{ord(char):04x}"


def _js_quote(text: str) -> str:
    """A JSON string literal as ``JSON.stringify`` writes it (ES2019 well-formed output).

    Only ``"``, ``\\``, control characters below U+0020 and lone surrogates are escaped; everything else,
    non-ASCII included, is written as-is. A Python str is read as JavaScript reads its UTF-16 code units, so
    two adjacent surrogate code points that form a pair are the character they encode.
    """
    return '"' + _NEEDS_ESCAPE.sub(_escape, text) + '"'


def _as_double(value: float | int) -> float:
    """The IEEE double JavaScript holds for ``value`` (ints round to nearest, ties to even; overflow is infinite)."""
    if isinstance(value, float):
        return float(value)
    try:
        return float(int(value))
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _is_number(value: Any) -> bool:
    return isinstance(value, (float, numbers.Integral)) and not isinstance(value, bool)


def js_number_to_string(value: float | int) -> str:
    """JavaScript ``String(value)`` (ECMAScript Number::toString, radix 10).

    Ints are first rounded to the double JavaScript would hold. The digits are the shortest that read back to
    the same double (``repr(float)`` finds them; like JavaScript it takes the closest when several are that
    short); the layout follows the spec: plain notation while the decimal exponent n satisfies -6 < n <= 21,
    else ``d.ddde+x`` / ``de-x``. So 100.0 -> ``100``, -0.0 -> ``0``, 1e21 -> ``1e+21``, 1e-7 -> ``1e-7``.
    Non-finite values give ``NaN``, ``Infinity`` and ``-Infinity`` (``JSON.stringify`` writes ``null`` instead).

    Raises TypeError for anything that is not an int or a float (bool included).
    """
    if not _is_number(value):
        raise TypeError(f"expected an int or float, not {type(value).__name__}")
    x = _as_double(value)
    if math.isnan(x):
        return "NaN"
    if x == 0:
        return "0"  # both zeros
    if x < 0:
        return "-" + js_number_to_string(-x)
    if math.isinf(x):
        return "Infinity"
    # repr gives the shortest round-trip digits as "123.45", "1e+16" or "1.5e-07": x = 0.<digits> * 10**n
    mantissa, _, exponent = repr(x).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    n = len(whole) + (int(exponent) if exponent else 0)
    significant = digits.lstrip("0")
    n -= len(digits) - len(significant)
    digits = significant.rstrip("0")
    k = len(digits)
    if k <= n <= 21:
        return digits + "0" * (n - k)
    if 0 < n <= 21:
        return digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return "0." + "0" * -n + digits
    e = n - 1
    sign = "+" if e >= 0 else "-"
    head = digits if k == 1 else digits[0] + "." + digits[1:]
    return f"{head}e{sign}{abs(e)}"


def _js_key_order(keys: list[str]) -> list[str]:
    """Own-key order of a JavaScript object: array-index keys ascending, then the rest in insertion order."""
    index_keys = [key for key in keys if _ARRAY_INDEX.fullmatch(key) and int(key) <= _MAX_ARRAY_INDEX]
    if not index_keys:
        return keys
    taken = set(index_keys)
    return sorted(index_keys, key=int) + [key for key in keys if key not in taken]


def _enter_container(value: Any, where: str, active: set[int], depth: int) -> bool:
    """Check an array or object before descending into it (type, depth, cycles); True for an object.

    Marks it active: the caller discards ``id(value)`` from ``active`` when done.
    """
    is_object = isinstance(value, Mapping)
    if not is_object and not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: {type(value).__name__} is not a JSON value")
    if depth >= _MAX_JSON_DEPTH:
        raise InvalidRequest(f"{where}: nested deeper than {_MAX_JSON_DEPTH} levels")
    if id(value) in active:
        raise InvalidRequest(f"{where}: cyclic structure")
    active.add(id(value))
    return is_object


def js_json_dumps(value: Any) -> str:
    """``JSON.stringify(value)`` for a JSON-like Python value, byte for byte.

    Accepts None, bool, int, float, str, mappings with str keys and lists/tuples, nested up to 100 levels.
    Objects list their keys as JavaScript does (array-index keys such as ``"2"`` first, ascending; then the
    rest in insertion order); NaN and infinities become ``null``; ints become the nearest double.

    Raises TypeError for other types or non-str keys, ValueError for cycles or deeper nesting.
    """
    return _dump(value, "value", set(), 0)


def _dump(value: Any, where: str, active: set[int], depth: int) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return _js_quote(value)
    if _is_number(value):
        x = _as_double(value)
        return js_number_to_string(x) if math.isfinite(x) else "null"
    if isinstance(value, FrozenJSONObject):
        return value.json
    is_object = _enter_container(value, where, active, depth)
    try:
        if not is_object:
            return "[" + ",".join(_dump(v, f"{where}[{i}]", active, depth + 1) for i, v in enumerate(value)) + "]"
        keys = list(value.keys())
        for key in keys:
            if not isinstance(key, str):
                raise TypeError(f"{where}: object keys must be str, got {type(key).__name__} {key!r}")
        _check_distinct_js_keys(keys, where)
        return "{" + ",".join(
            _js_quote(key) + ":" + _dump(value[key], f"{where}.{key}", active, depth + 1)
            for key in _js_key_order(keys)
        ) + "}"
    finally:
        active.discard(id(value))


def _js_string(text: str) -> str:
    """The JavaScript string a Python str stands for (surrogate pairs combined into one character)."""
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "surrogatepass")


def _check_distinct_js_keys(keys: list[str], where: str) -> None:
    if any("\ud800" <= c <= "\udfff" for key in keys for c in key):
        seen = {_js_string(key) for key in keys}
        if len(seen) != len(keys):
            raise InvalidRequest(f"{where}: two keys are the same JavaScript string "
                                 "(a surrogate pair written two ways)")


# ---------------------------------------------------------------------------------------------------------
# Immutable JSON values (turboQuant is arbitrary JSON)

JSONValue = Union[None, bool, int, float, str, tuple, "FrozenJSONObject"]


class FrozenJSONObject(Mapping[str, Any]):
    """An immutable, hashable copy of a JSON object: nested objects frozen too, arrays as tuples.

    Iteration follows the insertion order of the copied mapping. Equality and hash follow the
    ``JSON.stringify`` text, which is all a namespace can see: ``{"a": 1}`` equals ``{"a": 1.0}`` but not
    ``{"a": True}``, and key order matters (except that array-index keys sort first, as in JavaScript).
    """

    __slots__ = ("_items", "_json")

    def __init__(self, value: Mapping[str, Any] | None = None, *, where: str = "value") -> None:
        if value is None:
            value = {}
        if not isinstance(value, Mapping):
            raise TypeError(f"{where} must be a mapping, not {type(value).__name__}")
        frozen = _freeze(value, where, set(), 0)
        assert isinstance(frozen, FrozenJSONObject)
        self._items: dict[str, Any] = frozen._items
        self._json: str = frozen._json

    @classmethod
    def _of(cls, items: dict[str, Any], json: str) -> FrozenJSONObject:
        obj = object.__new__(cls)
        obj._items = items
        obj._json = json
        return obj

    @property
    def json(self) -> str:
        """This object as ``JSON.stringify`` writes it."""
        return self._json

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FrozenJSONObject):
            return self._json == other._json
        if isinstance(other, Mapping):
            try:
                return self._json == js_json_dumps(other)
            except (TypeError, ValueError):
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._json)

    def __repr__(self) -> str:
        return f"FrozenJSONObject({self._json})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenJSONObject, (self.to_dict(),))

    def to_dict(self) -> dict[str, Any]:
        """A fresh, mutable deep copy (dicts and lists)."""
        return {key: _thaw(v) for key, v in self._items.items()}


def _thaw(value: Any) -> Any:
    if isinstance(value, FrozenJSONObject):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


def _freeze(value: Any, where: str, active: set[int], depth: int) -> JSONValue:
    """A deep, immutable copy of a JSON value; validates as :func:`js_json_dumps` does."""
    if value is None or value is True or value is False:
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, FrozenJSONObject):
        return value
    is_object = _enter_container(value, where, active, depth)
    try:
        if not is_object:
            return tuple(_freeze(v, f"{where}[{i}]", active, depth + 1) for i, v in enumerate(value))
        items: dict[str, Any] = {}
        for key, v in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: object keys must be str, got {type(key).__name__} {key!r}")
            items[str.__str__(key)] = _freeze(v, f"{where}.{key}", active, depth + 1)
        return FrozenJSONObject._of(items, js_json_dumps(items))
    finally:
        active.discard(id(value))
