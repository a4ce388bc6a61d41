"""Hostile-input harness: the record decoder, the record header parser and the index value decoder fed
malformed, truncated and oversized msgpack (random objects, mutated real headers, huge declared lengths, deep
nesting, raw random bytes), each wrapped in a record with a *valid* checksum so it reaches the parser.

What must hold: every input either decodes or raises the typed error (``CorruptRecord`` / ``CorruptIndex``);
nothing else escapes; no input takes more than 0.5 s; the parser's peak allocation stays under 32 MiB (on the
sampled inputs whose allocation is traced).

    python -m tools.faults.hostile --cases 20000
    python -m tools.faults.hostile --atheris -- -runs=200000      # coverage-guided, if atheris is installed
"""

from __future__ import annotations

import random
import struct
import sys
import time
import tracemalloc

import blake3
import msgpack
import numpy as np

from spec_cache.store.codec import ALIGN, PREFIX_SIZE, CorruptRecord, _unpack_header, decode_record, encode_record
from spec_cache.store.errors import CorruptIndex
from spec_cache.store.values import TOTALS_KEY, decode

INDEX_DBS = ("nodes", "entries", "nsinfo", "meta")
MAX_SECONDS = 0.5
MAX_PEAK = 32 << 20


def craft(header, payload: bytes = b"", *, header_len: int | None = None) -> bytes:
    """A record laid out as documented with a valid checksum around an arbitrary header (bytes or object)."""
    raw = header if isinstance(header, (bytes, bytearray)) else msgpack.packb(header, use_bin_type=True)
    hlen = len(raw) if header_len is None else header_len
    body = bytes(raw) + bytes((-(PREFIX_SIZE + len(raw))) % ALIGN) + payload
    first16 = b"SPCR" + struct.pack("<BBHII", 1, 0, 0, hlen, 0)
    return first16 + blake3.blake3(first16 + body).digest() + body


def _real_record() -> tuple[dict, bytes]:
    rec = bytes(encode_record("entry", [("tokens", "uint32", np.arange(5, dtype=np.uint32)),
                                         ("L0.0", "bfloat16", np.arange(24, dtype=np.uint16).reshape(2, 3, 4)),
                                         ("L0.1", "float32", np.ones((2, 3), np.float32))],
                                meta={"layers": [[0, "kv", {}, 2, [["bfloat16", [2, 3, 4]]]]], "length": 5,
                                      "key": bytes(32)}))
    hlen = struct.unpack_from("<I", rec, 8)[0]
    header = msgpack.unpackb(rec[PREFIX_SIZE:PREFIX_SIZE + hlen], raw=False)
    return header, rec[len(rec) - header["payload"]:]


REAL_HEADER, REAL_PAYLOAD = _real_record()
NODE = {"ns": bytes(32), "parent": None, "depth": 0, "refs": 1, "tails": {"3": 1}, "bytes": 0, "complete": True,
        "minr": 0, "sig": b""}
ENTRY = {"ns": bytes(32), "len": 3, "node": bytes(32), "tail": 3, "last_use": 1, "created": 1, "pinned": False,
         "bytes": 100, "drafters": {}, "minr": 0}
NSINFO = {"target": "a" * 64, "prefix": "p", "tenant": False, "created": 1, "entries": 0, "bytes": 0, "hits": 0,
          "misses": 0, "last_use": None, "sigs": []}


def random_object(rnd: random.Random, depth: int = 0):
    """Any msgpack-able value: scalars of every type and edge size, nested containers."""
    r = rnd.random()
    if depth > 6 or r < 0.45:
        return rnd.choice([None, True, False, 0, -1, 2**63 - 1, -2**63, 2**64 - 1, rnd.randrange(-10**9, 10**9),
                           1.5, float("inf"), float("nan"), "", "x" * rnd.randrange(300), "é\u2028", b"",
                           bytes(rnd.randrange(256) for _ in range(rnd.randrange(40))), "kv", "bfloat16"])
    if r < 0.7:
        return [random_object(rnd, depth + 1) for _ in range(rnd.randrange(6))]
    keys = ["kind", "schema", "meta", "tensors", "payload", "data", "ns", "len", "node", "tails", "refs", "sigs",
            "drafters", "bytes", "entries", "depth", "parent"]
    return {(rnd.choice(keys) if rnd.random() < 0.8 else random_object(rnd, 7)): random_object(rnd, depth + 1)
            for _ in range(rnd.randrange(6))}


def _mutate(obj, rnd: random.Random):
    """A copy of a valid value with one field replaced, deleted or nested wrongly."""
    obj = msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=False)
    if not isinstance(obj, dict) or not obj:
        return random_object(rnd)
    key = rnd.choice(list(obj))
    r = rnd.random()
    if r < 0.2:
        del obj[key]
    elif r < 0.6:
        obj[key] = random_object(rnd)
    elif isinstance(obj[key], list) and obj[key]:
        i = rnd.randrange(len(obj[key]))
        obj[key][i] = _mutate(obj[key][i], rnd) if isinstance(obj[key][i], dict) else random_object(rnd)
    else:
        obj[key] = [obj[key]]
    return obj


BOMBS = [b"\xdd\xff\xff\xff\xff\xc0", b"\xdf\xff\xff\xff\xff\xc0\xc0", b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
         b"\x91" * 100_000 + b"\xc0", b"\x81\xa4meta" + b"\x91" * 200_000 + b"\xc0", b"\xc1", b"",
         b"\xd4\x05\x00", b"\xc7\xff\x05" + b"x" * 10]


def random_input(rnd: random.Random) -> tuple[str, bytes]:
    """(what, bytes) for one case."""
    r = rnd.random()
    if r < 0.25:
        return "random object", msgpack.packb(random_object(rnd), use_bin_type=True)
    if r < 0.5:
        base = rnd.choice([REAL_HEADER, NODE, ENTRY, NSINFO])
        return "mutated value", msgpack.packb(_mutate(base, rnd), use_bin_type=True)
    if r < 0.65:
        raw = msgpack.packb(rnd.choice([REAL_HEADER, NODE, ENTRY, NSINFO]), use_bin_type=True)
        return "truncated value", raw[:rnd.randrange(len(raw) + 1)]
    if r < 0.75:
        raw = bytearray(msgpack.packb(rnd.choice([REAL_HEADER, NODE, ENTRY, NSINFO]), use_bin_type=True))
        for _ in range(rnd.randint(1, 4)):
            raw[rnd.randrange(len(raw))] ^= 1 << rnd.randrange(8)
        return "bit-flipped value", bytes(raw)
    if r < 0.85:
        return "bomb", rnd.choice(BOMBS)
    return "random bytes", bytes(rnd.randrange(256) for _ in range(rnd.randrange(200)))


def check_one(data: bytes, rnd: random.Random | None = None) -> list[str]:
    """Feed ``data`` to every parser; returns what went wrong (empty when only typed errors came out)."""
    problems = []
    payload = REAL_PAYLOAD if rnd is None or rnd.random() < 0.5 else b""
    cases = [("header", lambda: _unpack_header(data), CorruptRecord),
             ("record", lambda: decode_record(craft(data, payload)), CorruptRecord),
             ("record, lying header length", lambda: decode_record(craft(data, payload, header_len=(
                 len(data) * 3 + 7) & 0xFFFFFFFF)), CorruptRecord),
             ("raw record bytes", lambda: decode_record(data), CorruptRecord)]
    cases += [(f"index {db}", (lambda db=db: decode(db, data, TOTALS_KEY if db == "meta" else bytes(32))),
               CorruptIndex) for db in INDEX_DBS]
    for name, fn, typed in cases:
        start = time.perf_counter()
        try:
            fn()
        except typed:
            pass
        except Exception as exc:  # the failure this harness exists to find
            problems.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        elapsed = time.perf_counter() - start
        if elapsed > MAX_SECONDS:
            problems.append(f"{name}: took {elapsed:.2f} s")
    return problems


def run(cases: int = 20000, *, seed: int = 0, traced_every: int = 50) -> dict:
    rnd = random.Random(seed)
    result = {"harness": "hostile", "cases": 0, "inputs": {}, "max_peak_mib": 0.0, "failures": []}
    started = time.monotonic()
    for i in range(cases):
        what, data = random_input(rnd)
        result["inputs"][what] = result["inputs"].get(what, 0) + 1
        traced = i % traced_every == 0
        if traced:
            tracemalloc.start()
        try:
            problems = check_one(data, rnd)
        finally:
            if traced:
                _, peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
                result["max_peak_mib"] = max(result["max_peak_mib"], round(peak / 2**20, 2))
                if peak > MAX_PEAK:
                    problems = problems + [f"peak allocation {peak} bytes"]
        result["cases"] += 1
        result["failures"] += [f"{what} {data[:40]!r}: {p}" for p in problems]
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def atheris_main(argv: list[str]) -> None:
    """Coverage-guided fuzzing of the same parsers (``pip install atheris``)."""
    import atheris

    def target(data: bytes) -> None:
        problems = check_one(data)
        if problems:
            raise AssertionError("; ".join(problems))

    atheris.instrument_all()
    atheris.Setup([sys.argv[0], *argv], target)
    atheris.Fuzz()


def main(argv=None) -> int:
    from tools.faults.common import parser, report

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--atheris" in argv:
        rest = argv[argv.index("--atheris") + 1:]
        atheris_main([a for a in rest if a != "--"])
        return 0
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=20000)
    args = p.parse_args(argv)
    return report(run(args.cases, seed=args.seed), args.json)


if __name__ == "__main__":
    sys.exit(main())
