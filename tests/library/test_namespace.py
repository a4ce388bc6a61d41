"""Tests for spec_cache.naming.namespace: golden vectors, a node oracle for JSON.stringify, stability, isolation."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spec_cache.naming import jsjson
from spec_cache.naming import namespace as ns_module
from spec_cache.naming.namespace import (
    JS_NULL,
    FrozenJSONObject,
    KVLayerConfig,
    KVOptions,
    adapter_namespace,
    cached_drafter_namespace,
    capture_options,
    check_runnable,
    drafter_namespace,
    js_json_dumps,
    js_number_to_string,
    namespace_key,
    namespace_key_hex,
    ngram_namespace,
    prefix_namespace,
    resolve_prefix_namespace,
)

GOLDEN = Path(__file__).parents[1] / "golden" / "namespaces.json"
REPO_ROOT = Path(ns_module.__file__).resolve().parents[1]
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed (the JSON.stringify oracle)")

T1 = hashlib.sha256(b"target-one").hexdigest()
T2 = hashlib.sha256(b"target-two").hexdigest()

# ---------------------------------------------------------------------------------------------------------
# The oracle: mlx-bun's two functions, verbatim, run by node. One process per test session, JSON lines.

ORACLE_JS = Path(__file__).parents[1] / "golden" / "seed_cache_identity.js"  # shared with make_namespaces.py

_NONFINITE = {"nan": "\u0000NaN", "inf": "\u0000Infinity", "-inf": "\u0000-Infinity"}


def to_oracle(value: Any) -> Any:
    """A JSON-safe copy for node: floats travel as repr (exact), non-finite floats as sentinel strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return _NONFINITE[repr(value)]
    if isinstance(value, dict):
        return {key: to_oracle(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_oracle(v) for v in value]
    return value


class Oracle:
    def __init__(self, node: str) -> None:
        self.proc = subprocess.Popen([node, str(ORACLE_JS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, encoding="utf-8", bufsize=1)

    def ask(self, request: dict[str, Any]) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request, ensure_ascii=True, allow_nan=False) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "node oracle died"
        return json.loads(line)

    def namespace(self, method: str | None, adapters: str | list[str], options: dict[str, Any]) -> str:
        if not isinstance(adapters, str):
            adapters = list(adapters)
        return self.ask({"op": "namespace", "method": method, "adapters": adapters, "options": to_oracle(options)})

    def stringify(self, value: Any) -> str:
        return self.ask({"op": "stringify", "value": to_oracle(value)})

    def numbers(self, values: list[float | int]) -> list[str]:
        return self.ask({"op": "numbers", "values": to_oracle(values)})

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def oracle():
    if NODE is None:
        pytest.skip("node is not installed (the JSON.stringify oracle)")
    running = Oracle(NODE)
    yield running
    running.close()


# ---------------------------------------------------------------------------------------------------------
# Strategies

SPECIAL_CHARS = ['"', "\\", "/", "\x00", "\x08", "\x0b", "\x1f", "\x7f", "\x80", "\u2028", "\u2029", "é", "日",
                 "😀", "\ud800", "\udbff", "\udc00", "\udfff", "\ud83d", "\ude00", "\ufeff", "\uffff", "1", "a"]
chars = st.one_of(st.characters(exclude_categories=()), st.sampled_from(SPECIAL_CHARS))
texts = st.text(chars, max_size=12)
keys = st.one_of(
    texts,
    st.integers(0, 2**33).map(str),
    st.sampled_from(["0", "00", "01", "-1", "-0", "1.0", "1e3", " 1", "+1", "4294967294", "4294967295",
                     "9007199254740993", "__proto__", "constructor", ""]),
)


def _bits_to_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.integers(0, 2**64 - 1).map(_bits_to_float),
    st.sampled_from([0.0, -0.0, 100.0, 1e21, 1e-7, 1e-6, 0.1, 5e-324, 1.7976931348623157e308, 1e20, 9.5e20,
                     123456789012345680000.0, 2.0**53, 2.0**53 + 2, -1.5e-7, 0.000001234]),
)
ints = st.one_of(
    st.integers(-(2**60), 2**60),
    st.integers(-(2**1100), 2**1100),
    st.sampled_from([2**53, 2**53 + 1, 10**21, 10**21 - 1, 2**1024 - 2**970, 2**1024 - 2**970 - 1,
                     -(2**1024), 123456789012345678901]),
)
json_leaves = st.one_of(st.none(), st.booleans(), ints, floats, texts)


def _js_distinct_keys(d: dict) -> bool:
    return len({jsjson._js_string(k) for k in d}) == len(d)


json_values = st.recursive(
    json_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(keys, children, max_size=5).filter(_js_distinct_keys),
    ),
    max_leaves=14,
)
json_objects = st.dictionaries(keys, json_values, max_size=6).filter(_js_distinct_keys)

MAX_SAFE = ns_module.MAX_SAFE_INTEGER
# The whole domain capture and the namespace accept: any JavaScript-exact int, runnable or not (0, negatives)
safe_ints = st.one_of(st.integers(1, 16), st.integers(-2, 2), st.integers(-MAX_SAFE, MAX_SAFE),
                      st.sampled_from([MAX_SAFE, -MAX_SAFE, 64]))
# Any JavaScript number the seed's types allow: floats (64.0, 4.5, NaN, infinities) and ints beyond 2**53 too
kv_numbers = st.one_of(safe_ints, safe_ints, ints, floats, st.sampled_from([64.0, 4.5, 2**53 + 1, -0.0, 1e21]))
layer_indices = st.one_of(st.integers(0, 6), st.integers(-3, 200), st.integers(-MAX_SAFE, MAX_SAFE),
                          st.sampled_from([MAX_SAFE, -MAX_SAFE, 2**53 + 1, 1.5, 3.0, math.inf]),
                          ints, floats.filter(lambda x: not math.isnan(x)))
# bits / groupSize: absent, a number, or an explicit null (written as null, unlike an absent key)
layer_fields = st.one_of(kv_numbers, st.none())


def _layer_entries(indices):
    return st.fixed_dictionaries({"layerIdx": indices},
                                 optional={"bits": layer_fields, "groupSize": layer_fields, "extra": json_leaves})


layer_entries = _layer_entries(layer_indices)
# A layer may be named more than once: small index ranges make repeats common
small_layer_entries = _layer_entries(st.one_of(st.integers(0, 2), st.sampled_from([0.0, 1.0, 2.0, 1.5])))
layer_lists = st.one_of(st.lists(layer_entries, max_size=6), st.lists(small_layer_entries, max_size=6))
options_mappings = st.fixed_dictionaries(
    {},
    optional={
        "kvBits": st.none() | kv_numbers,
        "kvGroupSize": st.none() | kv_numbers,
        "quantizedKvStart": st.none() | st.integers(0, 10_000) | kv_numbers,
        "turboQuant": st.none() | json_objects,
        "kvConfig": st.none() | layer_lists,
        "temperature": floats,  # not a KV key: ignored
        "maxTokens": st.integers(0, 100),
    },
)
methods = st.one_of(
    st.none(),
    texts,
    st.just("ngram-history-v1:3:1"),
    st.builds(lambda s, h: f"{s}:{h}", st.sampled_from(["gemma-assistant-v1", "qwen-mtp-v1"]),
              st.binary(min_size=32, max_size=32).map(bytes.hex)),
)
adapter_entries = st.one_of(texts, st.sampled_from(["", "+", "a@1", "a@1+b@2", "+a@1", "@", "[", '"]']))
# mlx-bun's string | string[]: a string (the adapter namespace), or a list of any strings, written as a JSON array
adapter_inputs = st.one_of(
    st.just(""),
    texts,
    st.lists(adapter_entries, min_size=1, max_size=3).map("+".join),
    st.lists(adapter_entries, max_size=4),
    st.lists(adapter_entries, max_size=4).map(tuple),
)

oracle_settings = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------------
# Golden vectors: the public contract. The file never changes; the code must match it.

def _golden_cases() -> list[dict[str, Any]]:
    return json.loads(GOLDEN.read_text(encoding="ascii"))


def _golden_tenant(raw: Any) -> str | bytes | None:
    if isinstance(raw, dict):
        return bytes.fromhex(raw["bytes_hex"])
    return raw


def _golden_results() -> list[list[str]]:
    """[namespace, key hex] per golden case, computed by this process."""
    out = []
    for case in _golden_cases():
        text = prefix_namespace(case["method"], case["adapters"], case["options"])
        out.append([text, namespace_key_hex(case["target_identity"], text, _golden_tenant(case["tenant"]))])
    return out


def test_golden_file_shape():
    cases = _golden_cases()
    assert len(cases) >= 40
    names = [case["name"] for case in cases]
    assert len(set(names)) == len(names)
    for case in cases:
        assert set(case) == {"name", "method", "adapters", "options", "target_identity", "tenant", "namespace",
                             "namespace_key"}, case["name"]


@pytest.mark.parametrize("case", _golden_cases(), ids=lambda case: case["name"])
def test_golden_vector(case):
    text = prefix_namespace(case["method"], case["adapters"], case["options"])
    assert text == case["namespace"]
    assert prefix_namespace(case["method"], case["adapters"], KVOptions.from_mapping(case["options"])) == text
    tenant = _golden_tenant(case["tenant"])
    assert namespace_key_hex(case["target_identity"], text, tenant) == case["namespace_key"]
    assert namespace_key(case["target_identity"], text, tenant) == bytes.fromhex(case["namespace_key"])


@needs_node
def test_golden_namespaces_agree_with_node(oracle):
    for case in _golden_cases():
        assert oracle.namespace(case["method"], case["adapters"], case["options"]) == case["namespace"], case["name"]


def test_golden_keys_follow_the_documented_framing():
    """Recompute every golden key from the formula, independently of the module's helpers."""
    def frame(tag: bytes, data: bytes) -> bytes:
        return struct.pack("<B", len(tag)) + tag + struct.pack("<Q", len(data)) + data

    for case in _golden_cases():
        tenant = _golden_tenant(case["tenant"])
        tail = frame(b"shared", b"") if tenant is None else frame(
            b"tenant", tenant.encode("utf-8") if isinstance(tenant, str) else tenant)
        message = (b"spec-cache/namespace-key/v1\x00" + frame(b"target", case["target_identity"].encode())
                   + frame(b"prefix", case["namespace"].encode("utf-8")) + tail)
        assert blake3.blake3(message).hexdigest() == case["namespace_key"], case["name"]


def test_blake3_is_the_reference_function():
    # BLAKE3 spec test vector: the hash of the empty input.
    assert blake3.blake3(b"").hexdigest() == "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


# ---------------------------------------------------------------------------------------------------------
# Bytes are stable across processes and hash seeds

_BATCH_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
from spec_cache.naming.namespace import prefix_namespace, namespace_key_hex
cases = json.load(open(sys.argv[2], encoding="ascii"))
out = []
for case in cases:
    tenant = case["tenant"]
    if isinstance(tenant, dict):
        tenant = bytes.fromhex(tenant["bytes_hex"])
    text = prefix_namespace(case["method"], case["adapters"], case["options"])
    out.append([text, namespace_key_hex(case["target_identity"], text, tenant)])
print(json.dumps(out))
"""


@pytest.mark.parametrize("seed", ["0", "1", "4242"])
def test_bytes_stable_across_processes_and_hash_seeds(seed):
    env = {**os.environ, "PYTHONHASHSEED": seed}
    done = subprocess.run([sys.executable, "-c", _BATCH_SCRIPT, str(REPO_ROOT), str(GOLDEN)], env=env,
                          capture_output=True, text=True, encoding="utf-8", timeout=60, check=True)
    assert json.loads(done.stdout) == _golden_results()


# ---------------------------------------------------------------------------------------------------------
# JavaScript number formatting

@pytest.mark.parametrize("value, text", [
    (100.0, "100"), (-0.0, "0"), (0.0, "0"), (0, "0"), (1e21, "1e+21"), (1e-7, "1e-7"), (1e-6, "0.000001"),
    (123456789012345680000, "123456789012345680000"), (123456789012345678901, "123456789012345680000"),
    (0.1, "0.1"), (5e-324, "5e-324"), (1.7976931348623157e308, "1.7976931348623157e+308"),
    (-1.5e-7, "-1.5e-7"), (1.5, "1.5"), (123.456, "123.456"), (1e20, "100000000000000000000"),
    (2**53 + 1, "9007199254740992"), (10**21, "1e+21"), (0.000001234, "0.000001234"), (1.234e-7, "1.234e-7"),
    (2.5e21, "2.5e+21"), (-7, "-7"), (float("nan"), "NaN"), (float("inf"), "Infinity"),
    (float("-inf"), "-Infinity"), (10**400, "Infinity"), (-(10**400), "-Infinity"),
])
def test_js_number_to_string_table(value, text):
    assert js_number_to_string(value) == text


def test_js_number_to_string_refuses_non_numbers():
    for bad in (True, False, "1", None, [1]):
        with pytest.raises(TypeError):
            js_number_to_string(bad)


@needs_node
@oracle_settings
@given(st.lists(st.one_of(floats, ints), min_size=1, max_size=40))
def test_js_number_to_string_matches_node(oracle, values):
    assert [js_number_to_string(v) for v in values] == oracle.numbers(values)


@needs_node
def test_js_number_to_string_matches_node_on_random_bit_patterns(oracle):
    rng = random.Random(20260701)
    values: list[float | int] = [_bits_to_float(rng.getrandbits(64)) for _ in range(20_000)]
    values += [_bits_to_float(rng.getrandbits(52)) for _ in range(2_000)]  # subnormals
    values += [rng.uniform(-1e22, 1e22) for _ in range(2_000)]
    values += [rng.randrange(-(2**80), 2**80) for _ in range(2_000)]
    values += [float(10**e) for e in range(-20, 23)] + [10.0**e for e in range(-330, 309)]
    assert [js_number_to_string(v) for v in values] == oracle.numbers(values)


# ---------------------------------------------------------------------------------------------------------
# JSON.stringify

def test_js_json_dumps_examples():
    assert js_json_dumps({}) == "{}"
    assert js_json_dumps([]) == "[]"
    assert js_json_dumps({"a": [1, 2.0, None, True, False, "x"]}) == '{"a":[1,2,null,true,false,"x"]}'
    assert js_json_dumps({"b": 1, "2": 2, "10": 3, "1": 4, "a": 5, "01": 6}) == \
        '{"1":4,"2":2,"10":3,"b":1,"a":5,"01":6}'
    assert js_json_dumps({"4294967295": 0, "4294967294": 1, "x": 2}) == '{"4294967294":1,"4294967295":0,"x":2}'
    assert js_json_dumps("\"\\/\b\f\n\r\t\x00\x1f\x7f") == '"\\"\\\\/\\b\\f\\n\\r\\t\\u0000\\u001f\x7f"'
    assert js_json_dumps("ñ日😀\u2028") == '"ñ日😀\u2028"'
    assert js_json_dumps("\ud800|\udfff|\ud83d\ude00") == '"\\ud800|\\udfff|😀"'
    assert js_json_dumps("\ud83d\ud83d\ude00") == '"\\ud83d😀"'
    assert js_json_dumps([float("nan"), float("inf"), -0.0, 10**400]) == "[null,null,0,null]"


def test_js_json_dumps_refuses_what_json_cannot_hold():
    with pytest.raises(TypeError, match="set"):
        js_json_dumps({"a": {1, 2}})
    with pytest.raises(TypeError, match="keys must be str"):
        js_json_dumps({1: "a"})
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="cyclic"):
        js_json_dumps(loop)
    deep: Any = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError, match="deeper"):
        js_json_dumps(deep)
    with pytest.raises(ValueError, match="same JavaScript string"):
        js_json_dumps({"\ud83d\ude00": 1, "😀": 2})


@needs_node
@oracle_settings
@given(json_values)
def test_js_json_dumps_matches_node(oracle, value):
    assert js_json_dumps(value) == oracle.stringify(value)


# ---------------------------------------------------------------------------------------------------------
# The prefix namespace

def test_prefix_namespace_defaults():
    assert prefix_namespace(None, "", KVOptions()) == \
        '{"adapters":"","kvBits":null,"kvGroupSize":64,"quantizedKvStart":null,"turboQuant":null}'
    assert prefix_namespace("", "", {}) == \
        '{"method":"","adapters":"","kvBits":null,"kvGroupSize":64,"quantizedKvStart":null,"turboQuant":null}'


def test_prefix_namespace_full():
    options = {"kvBits": 8, "kvGroupSize": 32, "quantizedKvStart": 0, "turboQuant": {},
               "kvConfig": [{"layerIdx": 7, "groupSize": 64, "note": "dropped"}, {"layerIdx": 2, "bits": 4}]}
    assert prefix_namespace("ngram-history-v1:3:1", "a@r1+b@r2", options) == (
        '{"method":"ngram-history-v1:3:1","adapters":"a@r1+b@r2","kvBits":8,"kvGroupSize":32,'
        '"quantizedKvStart":0,"turboQuant":{},"kvConfig":[{"layerIdx":2,"bits":4},{"layerIdx":7,"groupSize":64}]}')


def test_empty_kv_config_is_left_out_and_empty_turbo_quant_is_an_object():
    assert '"kvConfig"' not in prefix_namespace(None, "", {"kvConfig": []})
    assert prefix_namespace(None, "", {"kvConfig": []}) == prefix_namespace(None, "", {})
    assert '"turboQuant":{}' in prefix_namespace(None, "", {"turboQuant": {}})
    assert '"turboQuant":null' in prefix_namespace(None, "", {"turboQuant": None})


def test_adapter_list_is_a_json_array():
    # mlx-bun's adapters: string | string[]; JSON.stringify writes a string[] as an array, entries as they are
    assert prefix_namespace(None, ["x@1", "y@2"], {}).startswith('{"adapters":["x@1","y@2"],"kvBits"')
    assert prefix_namespace(None, ["x@1", "y@2"], {}) != prefix_namespace(None, "x@1+y@2", {})
    assert prefix_namespace(None, ("x@1", "y@2"), {}) == prefix_namespace(None, ["x@1", "y@2"], {})
    assert prefix_namespace(None, [], {}).startswith('{"adapters":[],')
    assert prefix_namespace(None, [""], {}).startswith('{"adapters":[""],')
    assert prefix_namespace(None, ["y+z", "+", ""], {}).startswith('{"adapters":["y+z","+",""],')
    assert prefix_namespace(None, ['"', "\ud800"], {}).startswith('{"adapters":["\\"","\\ud800"],')
    texts = {prefix_namespace(None, adapters, {}) for adapters in
             ["", [], [""], ["", ""], "+", ["+"], ["a", "b"], ["a+b"], "a+b", ["b", "a"], '["a"]', ["a"]]}
    assert len(texts) == 12
    with pytest.raises(TypeError, match="adapters"):
        prefix_namespace(None, b"x@1", {})
    with pytest.raises(TypeError, match="adapters"):
        prefix_namespace(None, {"x@1": 1}, {})
    with pytest.raises(TypeError, match="adapters"):
        prefix_namespace(None, None, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"adapters\[0\]"):
        prefix_namespace(None, [1], {})
    with pytest.raises(TypeError, match=r"adapters\[1\]"):
        prefix_namespace(None, ["a", None], {})
    with pytest.raises(TypeError, match="method"):
        prefix_namespace(b"m", "", {})


def test_kv_config_layer_named_twice_is_kept_in_stable_order():
    first = {"kvConfig": [{"layerIdx": 3, "bits": 4}, {"layerIdx": 1}, {"layerIdx": 3, "bits": 8}]}
    second = {"kvConfig": [{"layerIdx": 3, "bits": 8}, {"layerIdx": 1}, {"layerIdx": 3, "bits": 4}]}
    assert prefix_namespace(None, "", first).endswith(
        '"kvConfig":[{"layerIdx":1},{"layerIdx":3,"bits":4},{"layerIdx":3,"bits":8}]}')
    assert prefix_namespace(None, "", second).endswith(
        '"kvConfig":[{"layerIdx":1},{"layerIdx":3,"bits":8},{"layerIdx":3,"bits":4}]}')
    captured = capture_options(first)
    assert [(layer.layer_idx, layer.bits) for layer in captured.kv_config] == [(1, None), (3, 4), (3, 8)]
    assert captured != capture_options(second)
    twice = KVOptions(kv_config=(KVLayerConfig(0, 4), KVLayerConfig(0, 4)))
    assert len(twice.kv_config) == 2 and twice != KVOptions(kv_config=(KVLayerConfig(0, 4),))


# What the seed's types allow is written as the seed writes it (issue 24, row 2): each of these was refused before
SEED_INPUTS = [
    ({"kvGroupSize": 64.0}, '"kvBits":null,"kvGroupSize":64,'),
    ({"kvBits": 4.5}, '"kvBits":4.5,'),
    ({"kvConfig": [{"layerIdx": 0, "bits": None}]}, '"kvConfig":[{"layerIdx":0,"bits":null}]}'),
    ({"kvConfig": [{"layerIdx": 1.0, "groupSize": None, "bits": 4}]},
     '"kvConfig":[{"layerIdx":1,"bits":4,"groupSize":null}]}'),
    ({"quantizedKvStart": 2**53 + 1}, '"quantizedKvStart":9007199254740992,'),
    ({"kvBits": 2**70, "kvGroupSize": 10**400}, '"kvBits":1.1805916207174113e+21,"kvGroupSize":null,'),
    ({"kvBits": math.nan, "kvGroupSize": math.inf, "quantizedKvStart": -math.inf},
     '"kvBits":null,"kvGroupSize":null,"quantizedKvStart":null,'),
    ({"kvConfig": [{"layerIdx": math.nan, "bits": 8}]}, '"kvConfig":[{"layerIdx":null,"bits":8}]}'),
    ({"kvConfig": [{"layerIdx": 2**53 + 1, "bits": 8}, {"layerIdx": 2**53, "bits": 4}]},
     '"kvConfig":[{"layerIdx":9007199254740992,"bits":8},{"layerIdx":9007199254740992,"bits":4}]}'),
]


@pytest.mark.parametrize("options, fragment", SEED_INPUTS)
def test_seed_numbers_are_written_as_the_seed_writes_them(options, fragment):
    text = prefix_namespace(None, "", options)
    assert fragment in text
    assert prefix_namespace(None, "", capture_options(options)) == text


@needs_node
@pytest.mark.parametrize("options, fragment", SEED_INPUTS)
def test_seed_numbers_match_node(oracle, options, fragment):
    assert prefix_namespace("m", "a@1", options) == oracle.namespace("m", "a@1", options)


def test_explicit_null_differs_from_an_absent_key():
    null = capture_options({"kvConfig": [{"layerIdx": 0, "bits": None}]})
    absent = capture_options({"kvConfig": [{"layerIdx": 0}]})
    assert null.kv_config[0].bits is JS_NULL and absent.kv_config[0].bits is None
    assert null != absent and prefix_namespace(None, "", null) != prefix_namespace(None, "", absent)
    assert pickle.loads(pickle.dumps(null)) == null and copy.deepcopy(null) == null
    assert KVLayerConfig(0, JS_NULL) == null.kv_config[0]


def test_integral_floats_are_the_int_javascript_holds():
    assert capture_options({"kvGroupSize": 64.0, "kvBits": 8.0}) == KVOptions(kv_bits=8, kv_group_size=64)
    assert check_runnable({"kvGroupSize": 64.0, "kvBits": 8.0}) == KVOptions(kv_bits=8, kv_group_size=64)
    assert isinstance(capture_options({"kvBits": 8.0}).kv_bits, int)
    assert capture_options({"kvBits": 2**53 + 1}) == capture_options({"kvBits": 2**53})  # one double, one namespace


def test_values_that_cannot_run_are_captured_and_written():
    assert prefix_namespace(None, "", {"kvBits": 0, "kvGroupSize": 0, "quantizedKvStart": -1}) == \
        '{"adapters":"","kvBits":0,"kvGroupSize":0,"quantizedKvStart":-1,"turboQuant":null}'
    assert prefix_namespace(None, "", {"kvGroupSize": 0}) != prefix_namespace(None, "", {})  # 0 ?? 64 is 0
    assert KVOptions(kv_bits=-MAX_SAFE).kv_bits == -MAX_SAFE
    assert KVLayerConfig(-1, 0, -5) == KVLayerConfig(layer_idx=-1, bits=0, group_size=-5)


@needs_node
@oracle_settings
@given(methods, adapter_inputs, options_mappings)
def test_prefix_namespace_matches_node(oracle, method, adapters, options):
    expected = oracle.namespace(method, adapters, options)
    assert prefix_namespace(method, adapters, options) == expected
    assert prefix_namespace(method, adapters, capture_options(options)) == expected


@needs_node
@oracle_settings
@given(st.lists(small_layer_entries, min_size=2, max_size=8), adapter_inputs)
def test_repeated_layers_match_node(oracle, layers, adapters):
    options = {"kvBits": 8, "kvConfig": layers}
    assert prefix_namespace("m", adapters, options) == oracle.namespace("m", adapters, options)


# ---------------------------------------------------------------------------------------------------------
# Options: validation, immutability, capture

@pytest.mark.parametrize("options, error, message", [
    ({"kvBits": True}, TypeError, "kvBits must be a number \\(int or float\\), not bool"),
    ({"kvBits": "8"}, TypeError, "kvBits must be a number \\(int or float\\), not str"),
    ({"kvGroupSize": [64]}, TypeError, "kvGroupSize must be a number"),
    ({"turboQuant": [8, 3]}, TypeError, "turboQuant must be a mapping"),
    ({"turboQuant": {"kBits": object()}}, TypeError, r"turboQuant\.kBits"),
    ({"turboQuant": {3: 8}}, TypeError, "keys must be str"),
    ({"kvConfig": {"layerIdx": 0}}, TypeError, "kvConfig must be a list"),
    ({"kvConfig": [3]}, TypeError, r"kvConfig\[0\] must be a mapping"),
    ({"kvConfig": [{"bits": 4}]}, ValueError, r"kvConfig\[0\]\.layerIdx is required"),
    ({"kvConfig": [{"layerIdx": False}]}, TypeError, r"kvConfig\[0\]\.layerIdx must be a number"),
    ({"kvConfig": [{"layerIdx": None}]}, TypeError, r"kvConfig\[0\]\.layerIdx must be a number"),
    ({"kvConfig": [{"layerIdx": 0, "groupSize": "64"}]}, TypeError, r"kvConfig\[0\]\.groupSize must be a number"),
    ({"kvConfig": [{"layerIdx": 0}, {"layerIdx": math.nan}]}, ValueError, "NaN layerIdx among 2 layers"),
    ({"kv_bits": 8}, ValueError, "'kv_bits' is not read; mlx-bun spells it 'kvBits'"),
])
def test_from_mapping_errors_name_the_key(options, error, message):
    with pytest.raises(error, match=message):
        KVOptions.from_mapping(options)
    with pytest.raises(error, match=message):
        prefix_namespace(None, "", options)


def test_dataclass_validation_names_the_field():
    with pytest.raises(TypeError, match="kv_bits must be a number"):
        KVOptions(kv_bits=True)
    with pytest.raises(TypeError, match="kv_group_size must be a number"):
        KVOptions(kv_group_size="64")
    with pytest.raises(TypeError, match="turbo_quant must be a mapping"):
        KVOptions(turbo_quant=3)
    with pytest.raises(TypeError, match=r"kv_config\[0\] must be a KVLayerConfig"):
        KVOptions(kv_config=({"layerIdx": 0},))
    with pytest.raises(TypeError, match="layer_idx must be a number"):
        KVLayerConfig(layer_idx=None)
    with pytest.raises(TypeError, match="bits must be a number"):
        KVLayerConfig(layer_idx=0, bits=True)
    with pytest.raises(TypeError, match="options must be KVOptions or a mapping"):
        capture_options([("kvBits", 8)])


def test_from_mapping_reads_camel_case_and_ignores_the_rest():
    options = KVOptions.from_mapping({
        "kvBits": 4, "kvGroupSize": 32, "quantizedKvStart": 100, "turboQuant": {"kBits": 8, "vBits": 3},
        "kvConfig": [{"layerIdx": 9, "bits": 8, "extra": [1]}, {"layerIdx": 1, "groupSize": 128}],
        "temperature": 0.7, "kvBitz": 3,
    })
    assert options == KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=100,
                                turbo_quant={"kBits": 8, "vBits": 3},
                                kv_config=(KVLayerConfig(1, group_size=128), KVLayerConfig(9, bits=8)))
    assert [layer.layer_idx for layer in options.kv_config] == [1, 9]
    assert options.turbo_quant["kBits"] == 8 and list(options.turbo_quant) == ["kBits", "vBits"]
    assert KVOptions.from_mapping({"kvBits": None, "kvConfig": None, "turboQuant": None}) == KVOptions()


def test_options_are_immutable_and_hashable():
    options = KVOptions(kv_bits=8, turbo_quant={"kBits": 8, "nested": {"a": [1, {"b": 2}]}},
                        kv_config=[KVLayerConfig(3, 4), KVLayerConfig(1)])
    assert isinstance(options.kv_config, tuple)
    assert [layer.layer_idx for layer in options.kv_config] == [1, 3]
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.kv_bits = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        options.turbo_quant["kBits"] = 4  # type: ignore[index]
    nested = options.turbo_quant["nested"]
    assert isinstance(nested, FrozenJSONObject) and isinstance(nested["a"], tuple)
    twin = KVOptions(kv_bits=8, turbo_quant={"kBits": 8, "nested": {"a": [1, {"b": 2}]}},
                     kv_config=[KVLayerConfig(1), KVLayerConfig(3, 4)])
    assert options == twin and hash(options) == hash(twin)
    assert {options: "x"}[twin] == "x"
    assert pickle.loads(pickle.dumps(options)) == options
    assert copy.deepcopy(options) == options
    assert options.turbo_quant.to_dict() == {"kBits": 8, "nested": {"a": [1, {"b": 2}]}}


def test_turbo_quant_equality_is_json_equality():
    assert FrozenJSONObject({"a": 1}) == FrozenJSONObject({"a": 1.0})
    assert FrozenJSONObject({"a": 1}) != FrozenJSONObject({"a": True})
    assert FrozenJSONObject({"a": 1, "b": 2}) != FrozenJSONObject({"b": 2, "a": 1})
    assert FrozenJSONObject({"1": 1, "2": 2}) == FrozenJSONObject({"2": 2, "1": 1})  # JS sorts index keys
    assert FrozenJSONObject({"a": [1]}) == {"a": [1]}
    assert FrozenJSONObject({"a": [1]}) != {"a": {1}}
    assert KVOptions(turbo_quant={"k": 1}) != KVOptions(turbo_quant={"k": True})


def test_capture_returns_snapshots():
    options = KVOptions(kv_bits=4)
    assert capture_options(options) is options
    caller = {"kvBits": 4, "turboQuant": {"kBits": 8, "list": [1, 2]}, "kvConfig": [{"layerIdx": 2, "bits": 4}]}
    captured = capture_options(caller)
    before = prefix_namespace("m", "", captured)
    caller["kvBits"] = 8
    caller["turboQuant"]["kBits"] = 2
    caller["turboQuant"]["list"].append(3)
    caller["kvConfig"][0]["bits"] = 2
    caller["kvConfig"].append({"layerIdx": 0})
    assert prefix_namespace("m", "", captured) == before
    assert captured.turbo_quant.to_dict() == {"kBits": 8, "list": [1, 2]}


def _mutate_everything(value: Any, rng: random.Random) -> None:
    """Change every dict and list reachable from ``value``, in place."""
    if isinstance(value, dict):
        children = list(value.values())
        for key in list(value):
            if rng.random() < 0.5:
                value[key] = "mutated"
        value["\x00mutated"] = [1]
        if "layerIdx" in value:
            value["layerIdx"] = 999_999
        for child in children:
            _mutate_everything(child, rng)
    elif isinstance(value, list):
        children = list(value)
        value.reverse()
        value.append({"layerIdx": 1_000_000, "bits": 2})
        for child in children:
            _mutate_everything(child, rng)


@settings(max_examples=150, deadline=None)
@given(options_mappings, st.randoms(use_true_random=False))
def test_capture_is_immune_to_later_mutation(options, rng):
    pristine = copy.deepcopy(options)
    captured = capture_options(options)
    text = prefix_namespace("m", "", captured)
    _mutate_everything(options, rng)
    assert capture_options(captured) is captured
    assert prefix_namespace("m", "", captured) == text == prefix_namespace("m", "", pristine)
    assert captured == capture_options(pristine)


# ---------------------------------------------------------------------------------------------------------
# Isolation: different options, targets or tenants never share a namespace or key

def _effective(options: KVOptions) -> tuple:
    """Options as the namespace sees them: kv_group_size None is the default 64; NaN, infinities and an explicit
    null are all JSON's null (absent kvBits / quantizedKvStart are written as null too)."""
    def json_value(value, absent="absent"):
        if value is None:
            return absent
        if value is JS_NULL or not math.isfinite(value):
            return "null"
        return value

    group = ns_module.DEFAULT_KV_GROUP_SIZE if options.kv_group_size is None else options.kv_group_size
    layers = tuple((json_value(layer.layer_idx), json_value(layer.bits), json_value(layer.group_size))
                   for layer in options.kv_config)
    return (json_value(options.kv_bits, "null"), json_value(group), json_value(options.quantized_kv_start, "null"),
            options.turbo_quant, layers)


def test_namespace_is_injective_over_a_grid_of_options():
    turbos = [None, {}, {"kBits": 8, "vBits": 3}, {"vBits": 3, "kBits": 8}, {"kBits": 8.0, "vBits": 3},
              {"kBits": True}, {"kBits": 1}, {"kBits": "8"}, {"kBits": [8]}, {"kBits": None}]
    layer_sets = [(), (KVLayerConfig(0),), (KVLayerConfig(0, 4),), (KVLayerConfig(0, None, 4),),
                  (KVLayerConfig(0, 4, 64),), (KVLayerConfig(1, 4),), (KVLayerConfig(0, 4), KVLayerConfig(1, 4))]
    seen: dict[str, KVOptions] = {}
    count = 0
    for bits, group, start, turbo, layers in itertools.product(
            [None, 4, 8], [None, 32, 64], [None, 0, 5000], turbos, layer_sets):
        options = KVOptions(bits, group, start, turbo, layers)
        text = prefix_namespace(None, "", options)
        if text in seen:
            assert _effective(seen[text]) == _effective(options)
        else:
            seen[text] = options
        count += 1
    # None and 64 collapse (3 group sizes -> 2); {"kBits": 8} and {"kBits": 8.0} collapse (10 turbos -> 9)
    assert len(seen) == count * 2 // 3 * 9 // 10


@settings(max_examples=300, deadline=None)
@given(options_mappings, options_mappings)
def test_distinct_options_give_distinct_namespaces(a, b):
    first, second = capture_options(a), capture_options(b)
    same_text = prefix_namespace("m", "", first) == prefix_namespace("m", "", second)
    assert same_text == (_effective(first) == _effective(second))


@settings(max_examples=100, deadline=None)
@given(options_mappings)
def test_equal_options_give_equal_namespaces(options):
    reordered = dict(reversed(list(options.items())))
    if isinstance(options.get("kvConfig"), list):  # another order, but a repeated layer's entries keep theirs
        # ordered as JavaScript compares them: a huge int and inf are one double, so they keep their order
        reordered["kvConfig"] = sorted(options["kvConfig"],
                                       key=lambda entry: -ns_module._js_number("layerIdx", entry["layerIdx"]))
    assert prefix_namespace(None, "", reordered) == prefix_namespace(None, "", options)
    assert capture_options(reordered) == capture_options(options)
    assert hash(capture_options(reordered)) == hash(capture_options(options))


def test_method_and_adapters_isolate():
    texts = {
        prefix_namespace(None, "", {}),
        prefix_namespace("", "", {}),
        prefix_namespace("m", "", {}),
        prefix_namespace(None, "m", {}),
        prefix_namespace("m", "a@1", {}),
        prefix_namespace("m", "a@2", {}),
        prefix_namespace("m", "a@1+b@1", {}),
        prefix_namespace("m", "b@1+a@1", {}),
    }
    assert len(texts) == 8


tenants = st.one_of(st.none(), st.text(max_size=6), st.binary(max_size=6))
namespaces_text = st.one_of(st.text(max_size=10), st.sampled_from(["", "\x00", "shared", "tenant", '{"a":1}']))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([T1, T2]), namespaces_text, tenants), min_size=2, max_size=60))
def test_distinct_inputs_give_distinct_keys(triples):
    def identity(triple):
        target, text, tenant = triple
        return target, text, tenant.encode("utf-8") if isinstance(tenant, str) else tenant

    keys: dict[bytes, tuple] = {}
    for triple in triples:
        key = namespace_key(*triple)
        assert len(key) == 32
        if key in keys:
            assert identity(keys[key]) == identity(triple)
        keys[key] = triple


def test_framing_keeps_fields_apart():
    text = prefix_namespace(None, "", {})
    keys = [
        namespace_key(T1, text),
        namespace_key(T1, text, ""),
        namespace_key(T1, text, "acme"),
        namespace_key(T1, text + "acme"),
        namespace_key(T1, text + "acme", ""),
        namespace_key(T1, text[:-1], text[-1:] + "acme"),
        namespace_key(T2, text),
        namespace_key(T1, "", "shared"),
        namespace_key(T1, "", ""),
        namespace_key(T1, ""),
        namespace_key(T1, "\x00"),
        namespace_key(T1, "", "\x00"),
    ]
    assert len(set(keys)) == len(keys)
    assert namespace_key(T1, text, "") == namespace_key(T1, text, b"")  # a str tenant is its UTF-8 bytes
    assert namespace_key(T1, text, "acme") == namespace_key(T1, text, b"acme") == namespace_key(T1, text,
                                                                                              bytearray(b"acme"))
    assert namespace_key_hex(T1, text, "ü") == namespace_key(T1, text, "ü".encode()).hex()


def test_namespace_key_validation():
    with pytest.raises(ValueError, match="target_identity"):
        namespace_key(T1.upper(), "x")
    with pytest.raises(ValueError, match="target_identity"):
        namespace_key(T1[:-1], "x")
    with pytest.raises(TypeError, match="target_identity"):
        namespace_key(bytes.fromhex(T1), "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prefix_namespace"):
        namespace_key(T1, b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tenant"):
        namespace_key(T1, "x", 7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tenant"):
        namespace_key(T1, "x", "\ud800")
    # A namespace with a lone surrogate in it is written escaped, so it is always encodable
    assert len(namespace_key(T1, prefix_namespace("\ud800", "", {}))) == 32


# ---------------------------------------------------------------------------------------------------------
# Drafter and adapter namespaces

def test_drafter_namespace():
    assert drafter_namespace("gemma-assistant-v1", T1) == f"gemma-assistant-v1:{T1}"
    assert drafter_namespace("dflash2-context-v12", T2) == f"dflash2-context-v12:{T2}"
    for bad in ["Gemma-assistant-v1", "gemma-assistant", "gemma-assistant-v", "gemma_assistant-v1",
                "gemma-assistant-v1\n", "-v1", "gemma-assistant-v\u0661"]:
        with pytest.raises(ValueError, match="schema"):
            drafter_namespace(bad, T1)
    for bad in [T1.upper(), T1[:-1], T1 + "0", T1[:-1] + "g", T1 + "\n"]:
        with pytest.raises(ValueError, match="artifact_identity"):
            drafter_namespace("qwen-mtp-v1", bad)
    with pytest.raises(TypeError):
        drafter_namespace(b"qwen-mtp-v1", T1)  # type: ignore[arg-type]


def test_ngram_namespace():
    assert ngram_namespace() == "ngram-history-v1:3:1"
    assert ngram_namespace(5, 2) == "ngram-history-v1:5:2"
    assert ngram_namespace(1, 1) == "ngram-history-v1:1:1"
    with pytest.raises(ValueError, match="min_n must be <= max_n"):
        ngram_namespace(2, 3)
    with pytest.raises(ValueError, match="min_n must be >= 1"):
        ngram_namespace(3, 0)
    with pytest.raises(TypeError, match="max_n must be an int, not bool"):
        ngram_namespace(True, 1)
    with pytest.raises(TypeError, match="max_n must be an int, not float"):
        ngram_namespace(3.0, 1)


def test_adapter_namespace():
    assert adapter_namespace([]) == ""
    assert adapter_namespace([("style", "abc")]) == "style@abc"
    assert adapter_namespace([("a", "1"), ("b", "2")]) == "a@1+b@2"
    assert adapter_namespace([("b", "2"), ("a", "1")]) == "b@2+a@1"
    assert prefix_namespace(None, adapter_namespace([("a", "1"), ("b", "2")]), {}) == \
        prefix_namespace(None, "a@1+b@2", {}) != prefix_namespace(None, ["a@1", "b@2"], {})
    for bad in [("a@b", "1"), ("a+b", "1"), ("", "1"), ("a", ""), ("a", "1+2"), ("a", "1@2")]:
        with pytest.raises(ValueError, match=r"adapters\[0\]"):
            adapter_namespace([bad])
    with pytest.raises(TypeError):
        adapter_namespace("a@1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"adapters\[0\]"):
        adapter_namespace([("a", "1", "x")])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"adapters\[1\] id"):
        adapter_namespace([("a", "1"), (2, "1")])  # type: ignore[list-item]


# ---------------------------------------------------------------------------------------------------------
# Execution: check_runnable refuses what capture keeps; resolve_prefix_namespace is the runtime's one path

@pytest.mark.parametrize("options, message", [
    ({"kvBits": 0}, "kv_bits must be >= 1, got 0"),
    ({"kvGroupSize": -64}, "kv_group_size must be >= 1, got -64"),
    ({"kvGroupSize": 0}, "kv_group_size must be >= 1, got 0"),
    ({"quantizedKvStart": -1}, "quantized_kv_start must be >= 0, got -1"),
    ({"kvConfig": [{"layerIdx": 0}, {"layerIdx": -1}]}, r"kv_config\[0\]\.layer_idx must be >= 0, got -1"),
    ({"kvConfig": [{"layerIdx": 0, "bits": 0}]}, r"kv_config\[0\]\.bits \(layer 0\) must be >= 1"),
    ({"kvConfig": [{"layerIdx": 2, "groupSize": 0}]}, r"kv_config\[0\]\.group_size \(layer 2\) must be >= 1"),
    ({"kvConfig": [{"layerIdx": 3}, {"layerIdx": 3, "bits": 4}]}, "layer 3 more than once"),
    ({"kvBits": 4.5}, "kv_bits must be an integer to run, got 4.5"),
    ({"kvGroupSize": math.nan}, "kv_group_size must be an integer to run, got NaN"),
    ({"quantizedKvStart": math.inf}, "quantized_kv_start must be an integer to run, got Infinity"),
    ({"kvConfig": [{"layerIdx": 0.5}]}, r"kv_config\[0\]\.layer_idx must be an integer to run, got 0.5"),
    ({"kvConfig": [{"layerIdx": 0, "bits": None}]}, r"kv_config\[0\]\.bits \(layer 0\) is null"),
    ({"kvConfig": [{"layerIdx": 0, "groupSize": 32.5}]}, r"kv_config\[0\]\.group_size \(layer 0\) must be an integer"),
])
def test_check_runnable_refuses_what_capture_keeps(options, message):
    text = prefix_namespace(None, "", options)  # the pure functions accept it ...
    assert capture_options(options) is not None
    with pytest.raises(ValueError, match=message):  # ... execution does not
        check_runnable(options)
    with pytest.raises(ValueError, match=message):
        check_runnable(capture_options(options))
    assert text == prefix_namespace(None, "", capture_options(options))


def _runnable(options: KVOptions) -> bool:
    def at_least(value, minimum: int, absent_ok: bool = True) -> bool:
        if value is None:
            return absent_ok
        return value is not JS_NULL and isinstance(value, int) and value >= minimum

    layers = [layer.layer_idx for layer in options.kv_config]
    return (at_least(options.kv_bits, 1) and at_least(options.kv_group_size, 1)
            and at_least(options.quantized_kv_start, 0)
            and all(at_least(idx, 0, False) for idx in layers) and len(set(layers)) == len(layers)
            and all(at_least(v, 1) for layer in options.kv_config for v in (layer.bits, layer.group_size)))


@settings(max_examples=300, deadline=None)
@given(options_mappings)
def test_check_runnable_is_the_range_rule(options):
    captured = capture_options(options)
    if _runnable(captured):
        assert check_runnable(options) == captured
        assert check_runnable(captured) is captured
    else:
        with pytest.raises(ValueError):
            check_runnable(options)


def test_check_runnable_passes_what_runs():
    for options in (KVOptions(), KVOptions(kv_bits=4, kv_group_size=32, quantized_kv_start=0),
                    KVOptions(kv_config=(KVLayerConfig(0, 4), KVLayerConfig(1, group_size=64))),
                    KVOptions(turbo_quant={"kBits": 8})):  # turbo_quant is plan_kv's to refuse, per model
        assert check_runnable(options) is options
    assert check_runnable({"kvBits": 8}) == KVOptions(kv_bits=8)
    with pytest.raises(TypeError, match="options must be KVOptions or a mapping"):
        check_runnable(None)  # type: ignore[arg-type]


@dataclasses.dataclass
class _Provider:
    namespace: str
    supports_target_adapters: bool = False


@dataclasses.dataclass
class _Adapter:
    id: str
    revision: str


def test_resolve_prefix_namespace():
    assistant = _Provider(f"gemma-assistant-v1:{T1}")
    ngram = _Provider("ngram-history-v1:3:1", supports_target_adapters=True)
    stack = (_Adapter("style", T2), _Adapter("tone", T1))
    kv = KVOptions(kv_bits=8, quantized_kv_start=0)
    assert resolve_prefix_namespace(None, (), KVOptions()) == prefix_namespace(None, "", {})
    assert resolve_prefix_namespace(assistant, (), kv) == prefix_namespace(assistant.namespace, "", kv)
    assert resolve_prefix_namespace(ngram, stack, kv) == \
        prefix_namespace(ngram.namespace, f"style@{T2}+tone@{T1}", kv)
    # a drafter not valid under a target adapter: only the target part is cached, under no method
    assert resolve_prefix_namespace(assistant, stack, kv) == prefix_namespace(None, f"style@{T2}+tone@{T1}", kv)
    assert resolve_prefix_namespace(assistant, [], {"kvBits": 8, "quantizedKvStart": 0}) == \
        resolve_prefix_namespace(assistant, (), kv)
    assert cached_drafter_namespace(None, stack) is None
    assert cached_drafter_namespace(assistant, ()) == assistant.namespace
    assert cached_drafter_namespace(assistant, stack) is None
    assert cached_drafter_namespace(ngram, stack) == ngram.namespace
    with pytest.raises(TypeError, match="adapter stack"):
        resolve_prefix_namespace(None, "style@x", kv)
    with pytest.raises(ValueError, match="adapters"):
        resolve_prefix_namespace(None, (_Adapter("a+b", T1),), kv)
    with pytest.raises(TypeError, match="provider.namespace"):
        resolve_prefix_namespace(_Provider(None), (), kv)  # type: ignore[arg-type]
    # capture, not the run check: the pure path writes options that cannot run
    assert '"kvBits":0' in resolve_prefix_namespace(None, (), {"kvBits": 0})


def test_module_does_not_import_mlx():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import spec_cache.naming.namespace; "
            "print(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code, str(REPO_ROOT)], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------------------
# Drafter namespaces added for issue 15 (DFlash 2, Qwen MTP, GLM native MTP): golden vectors written from
# mlx-bun's formulas by tests/golden/make_drafter_namespaces.py (prefix namespaces by node).

DRAFTER_GOLDEN = Path(__file__).parents[1] / "golden" / "drafter_namespaces.json"


def _drafter_cases() -> list[dict[str, Any]]:
    return json.loads(DRAFTER_GOLDEN.read_text(encoding="ascii"))


@pytest.mark.parametrize("case", _drafter_cases(), ids=lambda case: case["name"])
def test_drafter_namespace_golden_vector(case):
    from spec_cache.naming.namespace import GLM52_NATIVE_MTP_NAMESPACE, dflash2_namespace

    kind = case["kind"]
    if kind == "dflash2":
        text = dflash2_namespace(case["identity"], case["bits"])
    elif kind == "qwen-mtp":
        text = drafter_namespace("qwen-mtp-v1", case["identity"])
    else:
        text = GLM52_NATIVE_MTP_NAMESPACE
    assert text == case["drafter_namespace"]
    prefix = prefix_namespace(text, "", case["options"])
    assert prefix == case["prefix_namespace"]
    assert namespace_key_hex(case["target_identity"], prefix) == case["namespace_key"]


def test_drafter_golden_cases_cover_each_family():
    assert {case["kind"] for case in _drafter_cases()} == {"dflash2", "qwen-mtp", "glm52"}
    assert {case["bits"] for case in _drafter_cases() if case["kind"] == "dflash2"} >= {0, 4}


@pytest.mark.parametrize("bits", [-1, 17, True, 4.0, "4"])
def test_dflash2_namespace_refuses_bad_bits(bits):
    from spec_cache.naming.namespace import dflash2_namespace

    with pytest.raises((TypeError, ValueError), match="bits"):
        dflash2_namespace("ab" * 32, bits)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        dflash2_namespace("AB" * 32, 4)
