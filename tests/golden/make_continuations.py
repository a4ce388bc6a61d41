"""Write ``continuations.json``: golden continuation keys and records (store/continuations.py), each computed here
from the documented framing with blake3 and struct, never by ``spec_cache``. Existing cases are never rewritten:
the script re-checks them and appends only cases whose names are new.
Run: ``python tests/golden/make_continuations.py``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import blake3

HERE = Path(__file__).parent
GOLDEN = HERE / "continuations.json"
NS = "dd34f09d987eb665cc0020209b2ff17d91358609ba02a72e87a5263e3cfb4743"  # namespaces.json "base-no-method-no-options"

CASES = [
    {"name": "greedy-eos", "ns_key": NS, "prompt": [5, 6, 7, 8, 9, 10, 11], "temperature": 0.0, "top_p": 1.0,
     "seed": 0, "eos_ids": [2], "tokens": [125, 3, 230, 197], "finished": False, "written_ns": 1764614400000000000},
    {"name": "greedy-ignores-seed-and-top-p", "ns_key": NS, "prompt": [5, 6, 7, 8, 9, 10, 11], "temperature": 0.0,
     "top_p": 0.5, "seed": 99, "eos_ids": [2], "tokens": [125], "finished": False, "written_ns": 1},
    {"name": "greedy-eos-ignored", "ns_key": NS, "prompt": [5, 6, 7, 8, 9, 10, 11], "temperature": 0.0,
     "top_p": 1.0, "seed": 0, "eos_ids": None, "tokens": [125, 3], "finished": True, "written_ns": 2},
    {"name": "sampled-seeded", "ns_key": NS, "prompt": [1, 4294967295], "temperature": 0.7, "top_p": 0.9,
     "seed": 12345, "eos_ids": [2, 1], "tokens": [0, 4294967295, 7], "finished": True, "written_ns": 3},
    {"name": "sampled-other-seed", "ns_key": NS, "prompt": [1, 4294967295], "temperature": 0.7, "top_p": 0.9,
     "seed": 12346, "eos_ids": [2, 1], "tokens": [], "finished": False, "written_ns": 4},
]


def params(case) -> bytes:
    if case["temperature"] == 0:
        sampling = "greedy"
    else:
        sampling = {"seed": case["seed"], "temperature": float(case["temperature"]), "top_p": float(case["top_p"])}
    eos = None if case["eos_ids"] is None else sorted(set(case["eos_ids"]))
    return json.dumps({"eos": eos, "sampling": sampling}, sort_keys=True, separators=(",", ":")).encode()


def key(case) -> bytes:
    p = params(case)
    prompt = b"".join(struct.pack("<I", t) for t in case["prompt"])
    return blake3.blake3(b"spec-cache/continuation/v1\x00" + bytes.fromhex(case["ns_key"]) + struct.pack("<I", len(p))
                         + p + struct.pack("<Q", len(case["prompt"])) + prompt).digest()


def record(case) -> bytes:
    body = (b"SCCN" + struct.pack("<HHI", 1, 0, 1 if case["finished"] else 0) + key(case)
            + bytes.fromhex(case["ns_key"]) + struct.pack("<QII", case["written_ns"], len(case["prompt"]),
                                                         len(case["tokens"]))
            + b"".join(struct.pack("<I", t) for t in case["tokens"]))
    return body + blake3.blake3(b"spec-cache/continuation-record/v1\x00" + body).digest()


def main() -> None:
    old = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else []
    for case in old:
        assert (params(case).decode(), key(case).hex(), record(case).hex()) == (
            case["params"], case["key"], case["record"]), case["name"]
    names = {case["name"] for case in old}
    for case in CASES:
        if case["name"] not in names:
            old.append({**case, "params": params(case).decode(), "key": key(case).hex(),
                        "record": record(case).hex()})
    GOLDEN.write_text("[\n" + ",\n".join(json.dumps(c) for c in old) + "\n]\n")


if __name__ == "__main__":
    main()
