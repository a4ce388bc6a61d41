"""Write ``target_namespaces.json``: golden vectors for the target-only namespace (issue 38), one per case of
``namespaces.json`` (whose seed namespaces node computed from mlx-bun's own functions).

Each vector is computed from the documented formula, never by ``spec_cache``: the target-only namespace of a case
is ``"spec-cache/target-only/v1:"`` followed by the case's seed namespace with its ``"method"`` member removed
(the seed writes ``method`` first, so the method-less namespace is ``{`` plus what follows the method's JSON
string and its comma; a case without a method is its own method-less namespace). Its key is the documented
``namespace_key`` framing (blake3) over that string, the case's target identity and tenant. Cases with the same
adapters, options, target and tenant but different methods share one target-only namespace and key: that is
the point. Run: ``python tests/golden/make_target_namespaces.py`` (``--check``: compare, write nothing).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import blake3

HERE = Path(__file__).parent
SOURCE = HERE / "namespaces.json"
GOLDEN = HERE / "target_namespaces.json"
TAG = "spec-cache/target-only/v1:"


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


def method_less(namespace: str, method) -> str:
    """The seed namespace without its method member (the method's JSON text is whatever the seed wrote)."""
    if method is None:
        assert namespace.startswith('{"adapters":'), namespace
        return namespace
    assert namespace.startswith('{"method":"'), namespace
    decoder = json.JSONDecoder()
    decoded, end = decoder.raw_decode(namespace, len('{"method":'))
    assert decoded == method and namespace[end] == ",", namespace
    return "{" + namespace[end + 1:]


def vectors() -> list[dict]:
    out = []
    for case in json.loads(SOURCE.read_text(encoding="ascii")):
        target_ns = TAG + method_less(case["namespace"], case["method"])
        out.append({"name": case["name"], "adapters": case["adapters"], "options": case["options"],
                    "target_identity": case["target_identity"], "tenant": case["tenant"],
                    "seed_namespace": case["namespace"], "target_namespace": target_ns,
                    "target_namespace_key": key_hex(case["target_identity"], target_ns, case["tenant"])})
    return out


def dump(cases) -> str:
    return "[\n" + ",\n".join(json.dumps(c) for c in cases) + "\n]\n"


def main(argv: list[str]) -> int:
    out = dump(vectors())
    if "--check" in argv:
        same = GOLDEN.read_text(encoding="ascii") == out
        print("target_namespaces.json matches the formula" if same else "target_namespaces.json differs")
        return 0 if same else 1
    GOLDEN.write_text(out, encoding="ascii")
    print(f"wrote {out.count(chr(10)) - 2} vectors")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
