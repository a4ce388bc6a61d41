"""Add golden prefix-namespace vectors to ``namespaces.json``, each namespace computed by node from mlx-bun's own
functions (``seed_cache_identity.js``) and each key from the documented framing (blake3), never by
``spec_cache``. Existing cases are never rewritten: the script re-checks every one of them against node and the
formula, then appends the cases below whose names are new. Run: ``python tests/golden/make_namespaces.py``.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import blake3

HERE = Path(__file__).parent
GOLDEN = HERE / "namespaces.json"
ORACLE = HERE / "seed_cache_identity.js"
T1 = "a115b9dadc623e4efb8598c5b871de35376f708a98a8fac2f33267df767681af"  # sha256(b"target-one"), as the file has
NGRAM = "ngram-history-v1:3:1"
STYLE = "style@2aa599feabfbf647090fd138ff37b2315fdf9572803d81b174c4efd3ee8c340b"
TONE = "tone@8f42a36c51bc46a269bfd9d5b8b4b75a2970830f2320d3ed7aa92f459eda7f62"
MAX_SAFE = 2**53 - 1


def case(name, method=NGRAM, adapters="", options=None, tenant=None):
    return {"name": name, "method": method, "adapters": adapters, "options": options or {},
            "target_identity": T1, "tenant": tenant}


# Added for issue 11 ("namespace contract, all of it"): adapters as mlx-bun's string[] (a JSON array, any
# strings), kvConfig naming a layer twice (kept, sorted stably), and option values that cannot run but that
# mlx-bun writes all the same.
NEW_CASES = [
    case("adapters-list-two-is-a-json-array", adapters=[STYLE, TONE]),
    case("adapters-list-two-reversed", adapters=[TONE, STYLE]),
    case("adapters-list-empty", adapters=[]),
    case("adapters-list-one-empty-string", adapters=[""]),
    case("adapters-list-one-entry", adapters=[STYLE]),
    case("adapters-list-entries-with-plus", adapters=["a+b", "+", "", "c@1+d@2"]),
    case("adapters-list-escapes-and-non-ascii", method=None,
         adapters=['"', "\\", "\x00\x1f", "\u2028", "\u00fc\u65e5", "\U0001F600", "\ud800", "\udc00x"]),
    case("adapters-string-plus-only", adapters="+"),
    case("adapters-string-leading-trailing-plus", adapters="+a@1+"),
    case("kv-config-layer-twice", options={"kvConfig": [{"layerIdx": 3, "bits": 4}, {"layerIdx": 1},
                                                        {"layerIdx": 3, "bits": 8}]}),
    case("kv-config-layer-twice-other-order", options={"kvConfig": [{"layerIdx": 3, "bits": 8}, {"layerIdx": 1},
                                                                    {"layerIdx": 3, "bits": 4}]}),
    case("kv-config-layer-twice-identical", options={"kvConfig": [{"layerIdx": 0, "bits": 4, "groupSize": 32},
                                                                  {"layerIdx": 0, "bits": 4, "groupSize": 32}]}),
    case("kv-config-layer-three-times-extra-fields", options={"kvConfig": [
        {"layerIdx": 2, "groupSize": 64, "note": "dropped"}, {"layerIdx": 0, "bits": 8},
        {"layerIdx": 2}, {"layerIdx": 2, "bits": 2, "extra": [1]}]}),
    case("kv-bits-zero", options={"kvBits": 0}),
    case("kv-group-size-zero-is-not-the-default", options={"kvGroupSize": 0}),
    case("negative-values", options={"kvBits": -4, "kvGroupSize": -64, "quantizedKvStart": -1}),
    case("smallest-safe-integers", options={"kvBits": -MAX_SAFE, "kvGroupSize": -MAX_SAFE,
                                            "quantizedKvStart": -MAX_SAFE}),
    case("kv-config-negative-and-zero", options={"kvConfig": [{"layerIdx": 0, "bits": 0, "groupSize": 0},
                                                              {"layerIdx": -1, "bits": -2},
                                                              {"layerIdx": -MAX_SAFE, "groupSize": MAX_SAFE}]}),
    case("everything-list-adapters-layer-twice", adapters=["a@1", "b+c@2"], tenant="acme", options={
        "kvBits": 4, "kvGroupSize": 32, "quantizedKvStart": 0, "turboQuant": {"vBits": 3, "kBits": 8, "2": [1.5]},
        "kvConfig": [{"layerIdx": 5, "bits": 8}, {"layerIdx": 1, "groupSize": 128}, {"layerIdx": 5, "bits": 4}]}),
]


def frame(tag: bytes, data: bytes) -> bytes:
    return struct.pack("<B", len(tag)) + tag + struct.pack("<Q", len(data)) + data


def key_hex(target: str, namespace: str, tenant) -> str:
    if isinstance(tenant, dict):
        tenant = bytes.fromhex(tenant["bytes_hex"])
    tail = frame(b"shared", b"") if tenant is None else frame(
        b"tenant", tenant.encode("utf-8") if isinstance(tenant, str) else tenant)
    message = (b"spec-cache/namespace-key/v1\x00" + frame(b"target", target.encode())
               + frame(b"prefix", namespace.encode("utf-8")) + tail)
    return blake3.blake3(message).hexdigest()


def dump(cases) -> str:
    return "[\n" + ",\n".join(json.dumps(c) for c in cases) + "\n]\n"


def main() -> int:
    node = shutil.which("node")
    if node is None:
        print("node is not installed", file=sys.stderr)
        return 1
    raw = GOLDEN.read_text(encoding="ascii")
    cases = json.loads(raw)
    assert dump(cases) == raw, "namespaces.json is not in the layout this script writes"
    proc = subprocess.Popen([node, str(ORACLE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            encoding="utf-8", bufsize=1)

    def namespace(c) -> str:
        request = {"op": "namespace", "method": c["method"], "adapters": c["adapters"], "options": c["options"]}
        proc.stdin.write(json.dumps(request, ensure_ascii=True, allow_nan=False) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    for c in cases:
        assert namespace(c) == c["namespace"], c["name"]
        assert key_hex(c["target_identity"], c["namespace"], c["tenant"]) == c["namespace_key"], c["name"]
    names = {c["name"] for c in cases}
    added = 0
    for c in NEW_CASES:
        if c["name"] in names:
            continue
        text = namespace(c)
        cases.append({**c, "namespace": text, "namespace_key": key_hex(c["target_identity"], text, c["tenant"])})
        added += 1
    proc.stdin.close()
    proc.wait(timeout=10)
    out = dump(cases)
    assert out.startswith(raw[: -len("\n]\n")]), "an existing case would change"
    GOLDEN.write_text(out, encoding="ascii")
    print(f"checked {len(cases) - added} existing cases against node; added {added}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
