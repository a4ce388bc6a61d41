"""Namespaces: the byte-stable strings and keys that decide which stored prefixes may be reused.

Three kinds of namespace string live here:

* a **drafter namespace** (``gemma-assistant-v1:<artifact identity>``, ``ngram-history-v1:3:1``) names the
  drafter whose row checkpoints an entry carries;
* an **adapter namespace** (``id@revision+id@revision``; ``""`` for the base model) names the LoRA stack;
* the **prefix namespace** joins a drafter namespace, an adapter namespace and the KV quantization options
  captured when a request was bound. It is byte-identical to mlx-bun's ``speculativePrefixNamespace``, which
  is JavaScript ``JSON.stringify``; so this module carries an exact ``JSON.stringify`` (:func:`js_json_dumps`)
  and an exact ``Number.prototype.toString`` (:func:`js_number_to_string`).

Capture and the namespace are pure and total over the seed's types: they write whatever mlx-bun would write for
any JavaScript number (``kvGroupSize: 64.0`` is ``64``, ``kvBits: 4.5`` is ``4.5``, NaN and infinities are
``null``, an int beyond 2**53 is the double JavaScript holds), an explicit ``null`` inside a ``kvConfig`` entry, a
``kvConfig`` naming a layer twice, a zero group size; they refuse only what is no number (str, bool), or where
JavaScript itself leaves the bytes undefined (a NaN ``layerIdx`` among several layers: ``Array.sort``'s order is then
implementation-defined). Whether options can *run* is :func:`check_runnable`'s question, asked at execution.
:func:`resolve_prefix_namespace` is the one way from (drafter provider, adapter stack, options) to the prefix
namespace; ``Generator.load`` and the mlx-lm import both use it.

:func:`namespace_key` turns (target identity, prefix namespace, tenant) into the 32-byte key the store roots a
namespace's prefix tree at. The target identity is not part of the namespace string (as in mlx-bun); it
enters here.

These strings and keys are public contracts: ``tests/golden/namespaces.json`` pins them, and a change that
alters one byte of either orphans every stored entry. Nothing here imports mlx.

Length (~450 lines): the whole namespace contract (options, capture, the strings, the run check, the key) is
kept in one file on purpose, so that one reading shows every byte a stored entry's namespace depends on.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import blake3

from spec_cache.errors import InvalidRequest
from spec_cache.naming.jsjson import FrozenJSONObject, _js_quote, js_json_dumps, js_number_to_string

__all__ = [
    "DEFAULT_KV_GROUP_SIZE",
    "MAX_SAFE_INTEGER",
    "FrozenJSONObject",
    "KVLayerConfig",
    "KVOptions",
    "adapter_namespace",
    "GLM52_NATIVE_MTP_NAMESPACE",
    "JS_NULL",
    "cached_drafter_namespace",
    "capture_options",
    "check_runnable",
    "dflash2_namespace",
    "drafter_namespace",
    "js_json_dumps",
    "js_number_to_string",
    "namespace_key",
    "namespace_key_hex",
    "ngram_namespace",
    "prefix_namespace",
    "resolve_prefix_namespace",
    "resolve_target_namespace",
    "TARGET_NAMESPACE_TAG",
    "target_namespace",
    "target_namespace_of",
]

#: The group size the prefix namespace writes when ``kv_group_size`` is None (mlx-bun: ``kvGroupSize ?? 64``).
DEFAULT_KV_GROUP_SIZE = 64
#: The largest int a JavaScript number holds exactly (namespace fields beyond it are written as the double).
MAX_SAFE_INTEGER = 2**53 - 1


# ---------------------------------------------------------------------------------------------------------
# KV quantization options, captured when a request is bound

class _JSNull:
    """JavaScript's ``null`` where it differs from an absent key: ``{layerIdx: 0, bits: null}`` writes
    ``"bits":null``, ``{layerIdx: 0}`` writes nothing for bits. A singleton (:data:`JS_NULL`)."""

    _instance: _JSNull | None = None

    def __new__(cls) -> _JSNull:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "JS_NULL"

    def __reduce__(self) -> str:
        return "JS_NULL"


#: An explicit ``null`` in a ``kvConfig`` entry's ``bits`` / ``groupSize`` (None there means the key is absent).
JS_NULL = _JSNull()

#: What a KV option field holds after capture: the JavaScript double of the number given, as an int when it is
#: integral (``64.0`` -> 64, ``2**53 + 1`` -> 2**53), else a float (4.5, NaN, +-inf).
KVNumber = Union[int, float]


def _js_number(label: str, value: Any) -> KVNumber:
    """``value`` as the number JavaScript would hold: the nearest double, as an int when integral and finite.

    Refuses bool and anything that is not a real number (TypeError naming ``label``): the seed's types say
    ``number``. Every number is accepted; whether it can run is :func:`check_runnable`'s question.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{label} must be a number (int or float), not {type(value).__name__}")
    if isinstance(value, numbers.Integral):
        try:
            double = float(int(value))
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    else:
        double = float(value)
    if math.isfinite(double) and double.is_integer():
        return int(double)
    return double


def _optional_js_number(label: str, value: Any) -> KVNumber | None:
    return None if value is None else _js_number(label, value)


def _layer_field(label: str, value: Any) -> KVNumber | _JSNull | None:
    """A ``kvConfig`` entry's ``bits`` / ``groupSize``: absent (None), an explicit null (:data:`JS_NULL`), a number."""
    if value is None or value is JS_NULL:
        return value
    return _js_number(label, value)


def _json_number(value: KVNumber) -> str:
    """A captured number as ``JSON.stringify`` writes it (non-finite: ``null``)."""
    return js_number_to_string(value) if math.isfinite(value) else "null"


def _check_int(label: str, value: Any, minimum: int = -MAX_SAFE_INTEGER) -> int:
    """``value`` as an int: refuses bool and non-integers, and ints outside [minimum, 2**53 - 1]."""
    if isinstance(value, bool):
        raise TypeError(f"{label} must be an int, not bool")
    if not isinstance(value, numbers.Integral):
        raise TypeError(f"{label} must be an int, not {type(value).__name__}")
    value = int(value)
    if value < minimum:
        if minimum == -MAX_SAFE_INTEGER:
            raise InvalidRequest(f"{label} must be at least -(2**53 - 1) (JavaScript's smallest exact integer), "
                                 f"got {value}")
        raise InvalidRequest(f"{label} must be >= {minimum}, got {value}")
    if value > MAX_SAFE_INTEGER:
        raise InvalidRequest(f"{label} must be at most 2**53 - 1 (JavaScript's largest exact integer), got {value}")
    return value


@dataclass(frozen=True)
class KVLayerConfig:
    """The KV quantization of one layer (an mlx-bun ``kvConfig`` entry).

    Fields hold what JavaScript would hold (see :func:`_js_number`): any number, integral ones as ints. For
    ``bits`` / ``group_size`` None means the key is absent and :data:`JS_NULL` an explicit ``null`` (written as
    ``null``). That ``layer_idx`` >= 0 and ``bits``/``group_size`` are ints >= 1 is checked when the options are
    run (:func:`check_runnable`).
    """

    layer_idx: KVNumber
    bits: KVNumber | _JSNull | None = None
    group_size: KVNumber | _JSNull | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_idx", _js_number("layer_idx", self.layer_idx))
        object.__setattr__(self, "bits", _layer_field("bits", self.bits))
        object.__setattr__(self, "group_size", _layer_field("group_size", self.group_size))

    @classmethod
    def from_mapping(cls, entry: Mapping[str, Any], *, where: str = "kvConfig entry") -> KVLayerConfig:
        """Read ``{layerIdx, bits, groupSize}``; other keys are dropped (mlx-bun's capture drops them too).

        ``layerIdx`` is required (a number). ``None`` for bits or groupSize is JavaScript's ``null``
        (:data:`JS_NULL`): mlx-bun writes ``"bits":null``, which differs from leaving the key out.
        """
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where} must be a mapping with layerIdx, bits, groupSize; not {type(entry).__name__}")
        if "layerIdx" not in entry:
            raise InvalidRequest(f"{where}.layerIdx is required")
        fields = {}
        for key, name in (("bits", "bits"), ("groupSize", "group_size")):
            if key in entry:
                fields[name] = JS_NULL if entry[key] is None else _js_number(f"{where}.{key}", entry[key])
        return cls(layer_idx=_js_number(f"{where}.layerIdx", entry["layerIdx"]), **fields)


_SNAKE_CASE_KEYS = {
    "kv_bits": "kvBits", "kv_group_size": "kvGroupSize", "quantized_kv_start": "quantizedKvStart",
    "turbo_quant": "turboQuant", "kv_config": "kvConfig",
}


@dataclass(frozen=True)
class KVOptions:
    """The KV quantization settings that enter a prefix namespace (mlx-bun ``GenerateOptions`` fields).

    Immutable and hashable: numbers are held as JavaScript holds them (the nearest double; integral ones as ints,
    so ``64.0`` is 64 and ``2**53 + 1`` is 2**53), ``turbo_quant`` as a :class:`FrozenJSONObject` (a deep copy)
    and ``kv_config`` as a tuple sorted by ``layer_idx``, stably (a layer named twice stays twice, in the order
    given, as mlx-bun's capture keeps it). Two options give the same prefix namespace exactly when they are
    equal, except that ``kv_group_size`` None and 64 are the same (the namespace writes the default), and that
    JSON writes NaN and infinities as ``null`` (so ``kv_bits`` NaN, inf and None share one namespace).
    ``quantized_kv_start`` None and its runtime default are *not* the same (mlx-bun writes ``null``), so do not
    fill in defaults before capturing.

    Raises TypeError naming the field for what is no number (str, bool) and ValueError for a NaN ``layer_idx``
    among several layers (JavaScript's sort order is undefined there). Values that cannot run (``kv_bits`` 0 or
    4.5, a layer named twice, a null bits) are held and written; :func:`check_runnable` refuses them at execution.
    """

    kv_bits: KVNumber | None = None
    kv_group_size: KVNumber | None = None
    quantized_kv_start: KVNumber | None = None
    turbo_quant: Mapping[str, Any] | None = None
    kv_config: tuple[KVLayerConfig, ...] = ()

    def __post_init__(self) -> None:
        setter = object.__setattr__
        setter(self, "kv_bits", _optional_js_number("kv_bits", self.kv_bits))
        setter(self, "kv_group_size", _optional_js_number("kv_group_size", self.kv_group_size))
        setter(self, "quantized_kv_start", _optional_js_number("quantized_kv_start", self.quantized_kv_start))
        setter(self, "turbo_quant", _frozen_turbo_quant("turbo_quant", self.turbo_quant))
        setter(self, "kv_config", _sorted_layers("kv_config", self.kv_config))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> KVOptions:
        """Read mlx-bun's camelCase option keys: ``kvBits``, ``kvGroupSize``, ``quantizedKvStart``,
        ``turboQuant`` and ``kvConfig`` (entries ``{layerIdx, bits, groupSize}``; extra entry keys dropped).

        Other keys (sampling settings and the like) are ignored, except the snake_case spellings of the five
        above, which are refused rather than silently ignored. None for a top-level key means absent.
        Errors name the camelCase key (``kvConfig[2].layerIdx``).
        """
        if not isinstance(options, Mapping):
            raise TypeError(f"options must be a mapping, not {type(options).__name__}")
        for snake, camel in _SNAKE_CASE_KEYS.items():
            if snake in options:
                raise InvalidRequest(f"options key {snake!r} is not read; mlx-bun spells it {camel!r}")
        raw_layers = options.get("kvConfig")
        if raw_layers is None:
            raw_layers = ()
        if not isinstance(raw_layers, (list, tuple)):
            raise TypeError(f"kvConfig must be a list of {{layerIdx, bits, groupSize}} objects, "
                            f"not {type(raw_layers).__name__}")
        layers = [entry if isinstance(entry, KVLayerConfig)
                  else KVLayerConfig.from_mapping(entry, where=f"kvConfig[{i}]")
                  for i, entry in enumerate(raw_layers)]
        return cls(
            kv_bits=_optional_js_number("kvBits", options.get("kvBits")),
            kv_group_size=_optional_js_number("kvGroupSize", options.get("kvGroupSize")),
            quantized_kv_start=_optional_js_number("quantizedKvStart", options.get("quantizedKvStart")),
            turbo_quant=_frozen_turbo_quant("turboQuant", options.get("turboQuant")),
            kv_config=_sorted_layers("kvConfig", layers),
        )


def _frozen_turbo_quant(label: str, value: Any) -> FrozenJSONObject | None:
    if value is None or isinstance(value, FrozenJSONObject):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"{label} must be a mapping or None, not {type(value).__name__}")
    return FrozenJSONObject(value, where=label)


def _sorted_layers(label: str, layers: Any) -> tuple[KVLayerConfig, ...]:
    if isinstance(layers, (str, bytes, Mapping)) or not isinstance(layers, Sequence):
        raise TypeError(f"{label} must be a sequence of KVLayerConfig, not {type(layers).__name__}")
    for i, layer in enumerate(layers):
        if not isinstance(layer, KVLayerConfig):
            raise TypeError(f"{label}[{i}] must be a KVLayerConfig, not {type(layer).__name__} "
                            f"(KVOptions.from_mapping reads kvConfig dicts)")
    if len(layers) > 1 and any(math.isnan(layer.layer_idx) for layer in layers):
        raise InvalidRequest(f"{label}: a NaN layerIdx among {len(layers)} layers has no defined order "
                             f"(JavaScript's sort comparator returns NaN); give each layer a number")
    return tuple(sorted(layers, key=lambda layer: layer.layer_idx))  # stable, like mlx-bun's Array.sort


def capture_options(options: KVOptions | Mapping[str, Any]) -> KVOptions:
    """Snapshot the KV options when a request is bound (mlx-bun ``captureSpeculativeOptions``).

    A mapping is read with :meth:`KVOptions.from_mapping`: ``kvConfig`` reduced to its three fields and sorted
    by ``layerIdx`` (stably: a layer named twice keeps both entries in the order given), ``turboQuant``
    deep-copied, so later changes to the caller's dicts and lists change nothing. A :class:`KVOptions` is
    already such a snapshot and is returned unchanged. Nothing is refused for being unrunnable
    (:func:`check_runnable` does that at execution).
    """
    if isinstance(options, KVOptions):
        return options
    if isinstance(options, Mapping):
        return KVOptions.from_mapping(options)
    raise TypeError(f"options must be KVOptions or a mapping, not {type(options).__name__}")


# ---------------------------------------------------------------------------------------------------------
# Namespace strings

def _adapters_json(adapters: str | Sequence[str]) -> str:
    """``adapters`` as ``JSON.stringify`` writes mlx-bun's ``string | string[]``: a string, or an array of them."""
    if isinstance(adapters, str):
        return _js_quote(adapters)
    if isinstance(adapters, (bytes, bytearray, Mapping)) or not isinstance(adapters, Sequence):
        raise TypeError(f"adapters must be a str or a sequence of str, not {type(adapters).__name__}")
    for i, entry in enumerate(adapters):
        if not isinstance(entry, str):
            raise TypeError(f"adapters[{i}] must be a str, not {type(entry).__name__}")
    return "[" + ",".join(_js_quote(entry) for entry in adapters) + "]"


def prefix_namespace(method: str | None, adapters: str | Sequence[str],
                     options: KVOptions | Mapping[str, Any]) -> str:
    """The prefix namespace, byte-identical to mlx-bun's ``speculativePrefixNamespace``::

        JSON.stringify({method, adapters, kvBits: kvBits ?? null, kvGroupSize: kvGroupSize ?? 64,
                        quantizedKvStart: quantizedKvStart ?? null, turboQuant: turboQuant ?? null,
                        ...(kvConfig.length ? {kvConfig} : {})})

    ``method`` is the drafter namespace; None leaves the key out (JavaScript ``undefined``). ``adapters`` is a
    str, written as a JSON string (what mlx-bun's call site passes: the adapter namespace, see
    :func:`adapter_namespace`), or a sequence of str, written as a JSON array of them, any strs at all (mlx-bun's
    ``string[]``). So ``["a@1", "b@2"]`` and ``"a@1+b@2"`` are different namespaces; the runtime passes the
    string (:func:`resolve_prefix_namespace`). ``options`` are captured first (:func:`capture_options`), so
    ``kvConfig`` is written sorted (stably), each entry as ``{layerIdx, bits, groupSize}`` with absent fields
    left out.

    Raises TypeError/ValueError for a non-str method, adapters that are not a str or a sequence of str, or
    options the namespace cannot write exactly (see :class:`KVOptions`); never for options that merely cannot
    run (that is :func:`check_runnable`).
    """
    if method is not None and not isinstance(method, str):
        raise TypeError(f"method must be a str or None, not {type(method).__name__}")
    adapters_json = _adapters_json(adapters)
    captured = capture_options(options)
    parts = [] if method is None else ['"method":' + _js_quote(method)]
    parts.append('"adapters":' + adapters_json)
    parts.append('"kvBits":' + _number_or_null(captured.kv_bits))
    group_size = captured.kv_group_size
    parts.append('"kvGroupSize":' + _json_number(DEFAULT_KV_GROUP_SIZE if group_size is None else group_size))
    parts.append('"quantizedKvStart":' + _number_or_null(captured.quantized_kv_start))
    turbo = captured.turbo_quant
    parts.append('"turboQuant":' + ("null" if turbo is None else js_json_dumps(turbo)))
    if captured.kv_config:
        parts.append('"kvConfig":[' + ",".join(_layer_json(layer) for layer in captured.kv_config) + "]")
    return "{" + ",".join(parts) + "}"


def _number_or_null(value: KVNumber | _JSNull | None) -> str:
    return "null" if value is None or value is JS_NULL else _json_number(value)


def _layer_json(layer: KVLayerConfig) -> str:
    """One entry as mlx-bun's ``{layerIdx, bits, groupSize}``: an absent (undefined) field is left out."""
    text = '{"layerIdx":' + _json_number(layer.layer_idx)
    if layer.bits is not None:
        text += ',"bits":' + _number_or_null(layer.bits)
    if layer.group_size is not None:
        text += ',"groupSize":' + _number_or_null(layer.group_size)
    return text + "}"


# ---------------------------------------------------------------------------------------------------------
# Execution: whether captured options can run, and the namespace the runtime stores under

def check_runnable(options: KVOptions | Mapping[str, Any]) -> KVOptions:
    """Capture ``options`` and refuse what no execution can run; returns the captured :class:`KVOptions`.

    Capture and :func:`prefix_namespace` write any options mlx-bun would; this is the execution-time check
    (``Generator.load`` calls it before anything is registered): every number an integer (4.5, NaN and
    infinities are written but cannot run), ``kv_bits`` and ``kv_group_size`` >= 1, ``quantized_kv_start`` >= 0,
    and per ``kv_config`` layer ``layer_idx`` >= 0, ``bits``/``group_size`` >= 1 (not null), each layer at most
    once. What a particular model supports (bit widths, group sizes, layer count,
    ``turbo_quant``) is checked later by ``spec_cache.rows.kv_quant.plan_kv``. Raises ValueError naming the field.
    """
    captured = capture_options(options)
    for label, value, minimum in (("kv_bits", captured.kv_bits, 1), ("kv_group_size", captured.kv_group_size, 1),
                                  ("quantized_kv_start", captured.quantized_kv_start, 0)):
        if value is not None:
            _check_runnable_int(label, value, minimum)
    seen: set[int] = set()
    for i, layer in enumerate(captured.kv_config):
        _check_runnable_int(f"kv_config[{i}].layer_idx", layer.layer_idx, 0)
        for label, value in (("bits", layer.bits), ("group_size", layer.group_size)):
            if value is JS_NULL:
                raise InvalidRequest(f"kv_config[{i}].{label} (layer {layer.layer_idx}) is null; give a number or "
                                     f"leave the key out")
            if value is not None:
                _check_runnable_int(f"kv_config[{i}].{label} (layer {layer.layer_idx})", value, 1)
        if layer.layer_idx in seen:
            raise InvalidRequest(f"kv_config lists layer {layer.layer_idx} more than once")
        seen.add(layer.layer_idx)
    return captured


def _check_runnable_int(label: str, value: KVNumber, minimum: int) -> None:
    if not isinstance(value, int):
        raise InvalidRequest(f"{label} must be an integer to run, got {js_number_to_string(value)}")
    if value < minimum:
        raise InvalidRequest(f"{label} must be >= {minimum}, got {value}")


def cached_drafter_namespace(provider: Any, adapters: Sequence[Any] = ()) -> str | None:
    """The drafter namespace stored entries carry for ``provider`` under the adapter stack ``adapters``.

    None without a provider, and None when adapters are applied and the provider is not valid under a target
    adapter (``supports_target_adapters`` false): its rows are still drafted but only the target part is cached.
    """
    if provider is None:
        return None
    if len(adapters) and not getattr(provider, "supports_target_adapters", False):
        return None
    namespace = provider.namespace
    if not isinstance(namespace, str):
        raise TypeError(f"provider.namespace must be a str, not {type(namespace).__name__}")
    return namespace


def resolve_prefix_namespace(provider: Any, adapters: Sequence[Any], options: KVOptions | Mapping[str, Any]) -> str:
    """The prefix namespace the runtime stores and looks up under: one definition for ``Generator.load`` and the
    mlx-lm import.

    ``provider``: the loaded draft provider (anything with ``namespace`` and ``supports_target_adapters``) or
    None; ``spec_cache.drafters.open_provider`` turns a method and directory into one. ``adapters``: the resolved
    adapter stack (``spec_cache.rows.adapters.resolve_adapters``: items with ``id`` and ``revision``), ``()`` for the
    base model. ``options``: KV options, captured here. Equals
    ``prefix_namespace(cached_drafter_namespace(provider, adapters), adapter_namespace(stack), options)``.
    """
    if isinstance(adapters, (str, bytes, Mapping)) or not isinstance(adapters, Sequence):
        raise TypeError(f"adapters must be the resolved adapter stack (a sequence), not {type(adapters).__name__}")
    adapter_text = adapter_namespace([(a.id, a.revision) for a in adapters])
    return prefix_namespace(cached_drafter_namespace(provider, adapters), adapter_text, capture_options(options))


# ---------------------------------------------------------------------------------------------------------
# The target-only namespace (issue 38): the target part of every drafter's checkpoints of one target

#: Opens every target-only namespace string. No prefix namespace (a JSON object: ``{``) and no drafter namespace
#: (``<schema>:``, ``ngram-history-v1:``) starts so: the two can never be the same string, nor the same key.
TARGET_NAMESPACE_TAG = "spec-cache/target-only/v1:"


def target_namespace(adapters: str | Sequence[str], options: KVOptions | Mapping[str, Any]) -> str:
    """The target-only namespace: ``"spec-cache/target-only/v1:" + prefix_namespace(None, adapters, options)``.

    It names what the target part of a checkpoint depends on besides the target's own identity (which
    :func:`namespace_key` adds, as for every namespace): the adapter stack (a LoRA changes the target's KV) and
    the captured KV options; never the drafter. Every prefix namespace of those adapters and options, whatever
    its ``method`` (:func:`target_namespace_of`), holds target state a lookup under this namespace may use: two
    drafters of one target share the target part of their prefixes through it (``SpecCache.target_members``).

    Domain-separated (the tag above; versioned by its ``v1``) and byte-stable: ``tests/golden/target_namespaces.json``.
    The seed's prefix namespace strings are untouched: this is a second name beside them, not a new spelling.
    """
    return TARGET_NAMESPACE_TAG + prefix_namespace(None, adapters, options)


def resolve_target_namespace(adapters: Sequence[Any], options: KVOptions | Mapping[str, Any]) -> str:
    """:func:`target_namespace` for a resolved adapter stack (items with ``id`` and ``revision``; ``()`` for the
    base model), as :func:`resolve_prefix_namespace` writes adapters."""
    if isinstance(adapters, (str, bytes, Mapping)) or not isinstance(adapters, Sequence):
        raise TypeError(f"adapters must be the resolved adapter stack (a sequence), not {type(adapters).__name__}")
    return target_namespace(adapter_namespace([(a.id, a.revision) for a in adapters]), capture_options(options))


_METHOD_OPEN = '{"method":'


def target_namespace_of(prefix_ns: str) -> str | None:
    """The target-only namespace a prefix namespace's target part belongs to: its ``method`` dropped, tagged
    (``target_namespace_of(prefix_namespace(m, a, o)) == target_namespace(a, o)`` for every method ``m``,
    None included). None for a string that is no prefix namespace this module writes (it then shares with none).

    Pure string work on the stored bytes (no JSON round trip that could respell a number): the method is the
    first member, a JSON string; what follows it is the method-less namespace after ``{``.
    """
    if not isinstance(prefix_ns, str) or not prefix_ns.startswith("{"):
        return None
    if not prefix_ns.startswith(_METHOD_OPEN):
        return TARGET_NAMESPACE_TAG + prefix_ns if prefix_ns.startswith('{"adapters":') else None
    end = _json_string_end(prefix_ns, len(_METHOD_OPEN))
    if end is None or prefix_ns[end:end + 1] != ",":
        return None
    rest = "{" + prefix_ns[end + 1:]
    return TARGET_NAMESPACE_TAG + rest if rest.startswith('{"adapters":') else None


def _json_string_end(text: str, start: int) -> int | None:
    """The index just past the JSON string literal opening at ``text[start]`` (None if there is none)."""
    if text[start:start + 1] != '"':
        return None
    i = start + 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"':
            return i + 1
        i += 1
    return None


_SCHEMA_NAME = re.compile("[a-z0-9-]+-v[0-9]+")
_HEX64 = re.compile("[0-9a-f]{64}")


def _check_hex64(label: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{label} must be a str of 64 lowercase hex digits, not {type(value).__name__}")
    if not _HEX64.fullmatch(value):
        raise InvalidRequest(f"{label} must be 64 lowercase hex digits, got {value!r}")
    return value


def drafter_namespace(schema: str, artifact_identity: str) -> str:
    """``<schema>:<artifact identity>``, e.g. ``gemma-assistant-v1:<64 hex>`` (mlx-bun ``checkpointNamespace``).

    ``schema`` must look like a versioned schema name (``[a-z0-9-]+-v<digits>``); ``artifact_identity`` is the
    64-lowercase-hex digest of the drafter's files. Raises TypeError/ValueError otherwise.
    """
    if not isinstance(schema, str):
        raise TypeError(f"schema must be a str, not {type(schema).__name__}")
    if not _SCHEMA_NAME.fullmatch(schema):
        raise InvalidRequest(f"schema must look like 'name-v1' ([a-z0-9-]+-v<digits>), got {schema!r}")
    return f"{schema}:{_check_hex64('artifact_identity', artifact_identity)}"


def dflash2_namespace(artifact_identity: str, bits: int) -> str:
    """``dflash2-context-v1:<artifact identity>:b<bits>`` (mlx-bun's ``Dflash2Provider``): the context a DFlash 2
    drafter projects depends on the width its projections were quantized to (``bits``, 0 for unquantized), so
    the width is part of the namespace. Raises TypeError/ValueError for a bad identity or bits outside [0, 16].
    """
    bits = _check_int("bits", bits, 0)
    if bits > 16:
        raise InvalidRequest(f"bits must be in [0, 16], got {bits}")
    return f"{drafter_namespace('dflash2-context-v1', artifact_identity)}:b{bits}"


#: GLM's native MTP namespace (mlx-bun): a constant, no artifact hash; the MTP layer is part of the target, whose
#: identity already scopes every stored entry.
GLM52_NATIVE_MTP_NAMESPACE = "glm52-native-mtp-v1"


def ngram_namespace(max_n: int = 3, min_n: int = 1) -> str:
    """``ngram-history-v1:<max_n>:<min_n>`` (mlx-bun defaults 3 and 1); requires ints with 1 <= min_n <= max_n."""
    max_n = _check_int("max_n", max_n, 1)
    min_n = _check_int("min_n", min_n, 1)
    if min_n > max_n:
        raise InvalidRequest(f"min_n must be <= max_n, got min_n={min_n}, max_n={max_n}")
    return f"ngram-history-v1:{max_n}:{min_n}"


def adapter_namespace(adapters: Sequence[tuple[str, str]]) -> str:
    """``id@revision`` per mounted adapter, joined with ``+`` in the order given; ``""`` for the base model.

    Order is kept (mlx-bun ``AdapterManager.cacheNamespace`` maps the ids as listed). Ids and revisions must be
    non-empty strs free of ``@`` and ``+``, so the string splits back unambiguously. Raises TypeError/ValueError.
    """
    if isinstance(adapters, (str, bytes, Mapping)) or not isinstance(adapters, Sequence):
        raise TypeError(f"adapters must be a sequence of (id, revision) pairs, not {type(adapters).__name__}")
    parts = []
    for i, pair in enumerate(adapters):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"adapters[{i}] must be an (id, revision) pair, got {pair!r}")
        for label, text in (("id", pair[0]), ("revision", pair[1])):
            if not isinstance(text, str):
                raise TypeError(f"adapters[{i}] {label} must be a str, not {type(text).__name__}")
            if not text or "@" in text or "+" in text:
                raise InvalidRequest(f"adapters[{i}] {label} must be non-empty and free of '@' and '+', got {text!r}")
        parts.append(f"{pair[0]}@{pair[1]}")
    return "+".join(parts)


# ---------------------------------------------------------------------------------------------------------
# The store key of a prefix namespace

_NAMESPACE_KEY_DOMAIN = b"spec-cache/namespace-key/v1\x00"


def _frame(tag: bytes, data: bytes) -> bytes:
    return bytes([len(tag)]) + tag + len(data).to_bytes(8, "little") + data


def _utf8(label: str, text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{label} is not encodable as UTF-8 (it holds a lone surrogate)") from None


def namespace_key(target_identity: str, prefix_namespace: str, tenant: str | bytes | None = None) -> bytes:
    """The 32-byte store key of a prefix namespace under one target model and tenant::

        blake3(b"spec-cache/namespace-key/v1\\0" + frame(b"target", target_identity)
               + frame(b"prefix", prefix_namespace)
               + (frame(b"tenant", tenant) if tenant is not None else frame(b"shared", b"")))

    with ``frame(tag, data) = u8 len(tag) + tag + u64le len(data) + data`` and strings UTF-8 encoded. Every
    field is framed, so no tenant salt can be mistaken for part of the namespace or an adapter id. A str
    tenant is its UTF-8 bytes (``"a"`` and ``b"a"`` are the same tenant); ``""`` is a tenant, distinct from None
    (shared). Raises ValueError unless ``target_identity`` is 64 lowercase hex; TypeError for wrong types.
    """
    _check_hex64("target_identity", target_identity)
    if not isinstance(prefix_namespace, str):
        raise TypeError(f"prefix_namespace must be a str, not {type(prefix_namespace).__name__}")
    if tenant is None:
        tail = _frame(b"shared", b"")
    elif isinstance(tenant, str):
        tail = _frame(b"tenant", _utf8("tenant", tenant))
    elif isinstance(tenant, (bytes, bytearray, memoryview)):
        tail = _frame(b"tenant", bytes(tenant))
    else:
        raise TypeError(f"tenant must be a str, bytes or None, not {type(tenant).__name__}")
    message = (_NAMESPACE_KEY_DOMAIN + _frame(b"target", target_identity.encode("ascii"))
               + _frame(b"prefix", _utf8("prefix_namespace", prefix_namespace)) + tail)
    return blake3.blake3(message).digest()


def namespace_key_hex(target_identity: str, prefix_namespace: str, tenant: str | bytes | None = None) -> str:
    """:func:`namespace_key` as 64 lowercase hex digits."""
    return namespace_key(target_identity, prefix_namespace, tenant).hex()
