"""``tools/bench_serve.py`` (``bench_mlx_lm_server.main``) leaves nothing behind: its servers' logs and stores live
in a temporary folder that is removed after a run, kept only with ``--keep`` or when the run fails."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import bench_mlx_lm_server as bench  # noqa: E402

TINY = ["--servers", "serve", "--conversations", "1", "--turns", "1", "--max-tokens", "2", "--system-words", "8",
        "--user-words", "3"]


def _left(root: Path) -> list[Path]:
    return sorted(root.glob("bench-mlx-lm-server-*"))


def test_the_temporary_folder_goes_unless_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert bench.main(TINY) == 0
    assert _left(tmp_path) == []
    assert "logs and stores" not in capsys.readouterr().out
    assert bench.main(TINY + ["--keep"]) == 0
    kept = _left(tmp_path)
    assert len(kept) == 1 and (kept[0] / "store-serve").is_dir()
    assert f"logs and stores: {kept[0]}" in capsys.readouterr().out


def test_a_failed_run_keeps_its_logs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def broken(*_a, **_k):
        raise RuntimeError("a server did not start")

    monkeypatch.setattr(bench, "bench", broken)
    with pytest.raises(RuntimeError):
        bench.main(TINY)
    assert len(_left(tmp_path)) == 1
    assert "(kept: the run failed)" in capsys.readouterr().out
