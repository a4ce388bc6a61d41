"""``SPEC_CACHE_LAYER_TIMES``: per-layer times of multi-token forwards, off by default, values unchanged (a
diagnostic for issue 35's slow sixth agent turn on the GPU)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from spec_cache.rows.target import TargetRows
from tests.runtime_fixtures import _identity_memo, tiny  # noqa: F401


def _prefill(tiny):  # noqa: F811
    rows = TargetRows.from_row_caches(tiny.target, [None, None])
    out = rows.prefill([[1, 2, 3, 4, 5, 6], [7, 8, 9]], need_hidden=True)
    caches = rows.extract(0)
    mx.eval(caches[0].keys)
    return out, caches


def test_off_by_default_and_on_it_writes_one_line_per_forward_with_the_same_values(tiny, tmp_path,  # noqa: F811
                                                                                   monkeypatch):
    monkeypatch.delenv("SPEC_CACHE_LAYER_TIMES", raising=False)
    before, caches_before = _prefill(tiny)
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv("SPEC_CACHE_LAYER_TIMES", str(tmp_path / "layers"))
    after, caches_after = _prefill(tiny)
    (written,) = list(tmp_path.iterdir())
    lines = [json.loads(line) for line in written.read_text().splitlines()]
    depth = tiny.target.depth
    assert lines and all(len(line["ms"]) == depth and line["rows"] == 2 for line in lines)
    assert {line["mask"] for line in lines} <= {"none", "causal", "array"}
    assert all(line["queued_ms"] >= 0 and all(ms >= 0 for ms in line["ms"]) for line in lines)
    for a, b in zip(caches_before, caches_after):  # an evaluation only waits: the same bytes
        assert np.array_equal(np.array(a.keys), np.array(b.keys))
        assert np.array_equal(np.array(a.values), np.array(b.values))
