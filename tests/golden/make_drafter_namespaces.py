"""Write ``drafter_namespaces.json``: golden vectors for the drafter namespaces issue 15 adds, each string
built by mlx-bun's own formulas (the template literals of ``Dflash2Provider.load``, the Qwen MTP and GLM
native MTP providers), the prefix namespace around it by node from mlx-bun's ``speculativePrefixNamespace``
(``seed_cache_identity.js``) and the key by the documented framing; never by ``spec_cache``. The file is
written once; an existing file is only re-checked. Run: ``python tests/golden/make_drafter_namespaces.py``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from make_namespaces import T1, dump, key_hex

HERE = Path(__file__).parent
GOLDEN = HERE / "drafter_namespaces.json"
ORACLE = HERE / "seed_cache_identity.js"
IDENTITY = "5b0b3c3f1e9fd0a1c1f0e7f2a2d6c8b4e3a1f9d7c5b3a19f8e7d6c5b4a3f2e1d"  # any 64 lowercase hex
OTHER = "00" * 32


def seed_drafter_namespace(kind: str, identity: str | None, bits: int | None) -> str:
    """mlx-bun's formulas, verbatim as Python f-strings."""
    if kind == "dflash2":
        return f"dflash2-context-v1:{identity}:b{bits}"  # `dflash2-context-v1:${identity}:b${bits}`
    if kind == "qwen-mtp":
        return "qwen-mtp-v1:" + identity  # "qwen-mtp-v1:" + artifact identity
    if kind == "glm52":
        return "glm52-native-mtp-v1"  # a constant, no artifact hash
    raise ValueError(kind)


CASES = [
    {"name": "dflash2-b4", "kind": "dflash2", "identity": IDENTITY, "bits": 4, "options": {}},
    {"name": "dflash2-b0-unquantized", "kind": "dflash2", "identity": IDENTITY, "bits": 0, "options": {}},
    {"name": "dflash2-b8-other-identity", "kind": "dflash2", "identity": OTHER, "bits": 8, "options": {}},
    {"name": "dflash2-b4-kv4", "kind": "dflash2", "identity": IDENTITY, "bits": 4,
     "options": {"kvBits": 4, "kvGroupSize": 32, "quantizedKvStart": 0}},
    {"name": "qwen-mtp", "kind": "qwen-mtp", "identity": IDENTITY, "bits": None, "options": {}},
    {"name": "qwen-mtp-kv8", "kind": "qwen-mtp", "identity": IDENTITY, "bits": None, "options": {"kvBits": 8}},
    {"name": "glm52-native-mtp", "kind": "glm52", "identity": None, "bits": None, "options": {}},
]


def main() -> int:
    node = shutil.which("node")
    if node is None:
        print("node is not installed", file=sys.stderr)
        return 1
    proc = subprocess.Popen([node, str(ORACLE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            encoding="utf-8", bufsize=1)

    def namespace(method: str, options: dict) -> str:
        request = {"op": "namespace", "method": method, "adapters": "", "options": options}
        proc.stdin.write(json.dumps(request, ensure_ascii=True, allow_nan=False) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    cases = []
    for case in CASES:
        drafter = seed_drafter_namespace(case["kind"], case["identity"], case["bits"])
        prefix = namespace(drafter, case["options"])
        cases.append({**case, "drafter_namespace": drafter, "target_identity": T1, "prefix_namespace": prefix,
                      "namespace_key": key_hex(T1, prefix, None)})
    proc.stdin.close()
    proc.wait(timeout=10)
    out = dump(cases)
    if GOLDEN.exists():
        assert GOLDEN.read_text(encoding="ascii") == out, "drafter_namespaces.json differs from the formulas"
        print(f"checked {len(cases)} cases")
        return 0
    GOLDEN.write_text(out, encoding="ascii")
    print(f"wrote {len(cases)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
