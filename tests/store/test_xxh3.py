"""The GIL-free XXH3-128 (``store/xxh3.py``) gives python-xxhash's digests, so records written by either verify
with the other, and the record checksum is unchanged (golden vectors in tests/golden pin it too)."""

import sys

import numpy as np
import pytest
import xxhash

from spec_cache.store import codec, xxh3


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 128, 129, 240, 241, 1023, 65536, (1 << 20) + 13, 3 << 20])
def test_digest_matches_python_xxhash(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = xxhash.xxh3_128(data).digest()
    assert xxh3.xxh3_128_digest(data) == want
    h = xxh3.Hasher()
    for lo, hi in [(0, n // 5), (n // 5, n // 5 + 1), (n // 5 + 1, n)]:  # uneven updates, one of a single byte
        h.update(memoryview(data)[lo:hi])
    assert h.digest() == want
    h.close()
    with pytest.raises(ValueError):
        h.update(b"x")  # never hashes through a freed state


def test_fallback_gives_the_same_digests(monkeypatch):
    data = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8)
    fast = xxh3.xxh3_128_digest(data[:7], data[7:])
    monkeypatch.setattr(xxh3, "_LIB", None)
    assert xxh3.xxh3_128_digest(data[:7], data[7:]) == fast == xxhash.xxh3_128(data).digest()
    h = xxh3.Hasher()
    h.update(data)
    assert h.digest() == fast


def test_record_checksum_unchanged():
    """A format-2 record's checksum field is python-xxhash's XXH3-128 over bytes 0..15 and 48.. (big records too,
    which now go through the GIL-free route)."""
    big = np.arange(1 << 19, dtype=np.float32).reshape(1, -1)
    rec = codec.encode_record("chunk", [("L0.0", "float32", big)], meta={"key": b"k" * 32})
    raw = rec.tobytes()
    assert raw[16:32] == xxhash.xxh3_128(raw[:16] + raw[48:]).digest() and raw[32:48] == bytes(16)
    assert codec.checksum(memoryview(raw)) == raw[16:48]


@pytest.mark.skipif(sys.platform != "linux", reason="python-xxhash's Linux wheels export xxHash's C API")
def test_the_gil_free_route_is_in_use_here():
    assert xxh3.NOGIL
