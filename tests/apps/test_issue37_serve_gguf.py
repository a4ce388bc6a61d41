"""``spec-cache serve --model FILE.gguf`` on a bad file (issue 37 item 5): one error line and exit 2, never a
native crash of the server; a SIGTERM while the model loads stops it at once.

Why a hook through ``sitecustomize``: the attacker's two hanging files no longer hang the converter (it refuses
them), so a hang is simulated: ``mx.load`` of a GGUF sleeps, as the native reader stuck on a hostile file did,
wherever the server runs the conversion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.library.test_gguf import write_synthetic_gguf

ROOT = Path(__file__).resolve().parents[2]


def _serve(model: Path, tmp_path: Path, extra_path: str = "") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (extra_path, str(ROOT)) if p),
           "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    return subprocess.Popen([sys.executable, "-m", "spec_cache.apps.server", "--model", str(model), "--port", "0",
                             "--no-cache"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)


@pytest.mark.server  # spec-cache serve in a subprocess of its own
def test_serve_refuses_a_crafted_gguf_in_one_line(tmp_path):
    import mlx.core as mx

    bad, _ = write_synthetic_gguf(tmp_path, **{"llama.block_count": mx.array(10**9, dtype=mx.uint32)})
    bad = bad.rename(tmp_path / "huge-blocks.gguf")
    server = _serve(bad, tmp_path)
    try:
        _, stderr = server.communicate(timeout=120)
    finally:
        server.kill()
    assert server.returncode == 2, (server.returncode, stderr[-3000:])
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("spec-cache serve: error: cannot convert") and "block_count" in last, last


@pytest.mark.server  # spec-cache serve in a subprocess of its own
def test_serve_stops_promptly_on_sigterm_while_converting(tmp_path):
    model, _ = write_synthetic_gguf(tmp_path)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import time\n"
        "import mlx.core as mx\n"
        "_load = mx.load\n"
        "def load(path, *args, **kwargs):\n"
        "    if str(path).endswith('.gguf'):\n"
        "        time.sleep(600)  # the GGUF reader stuck on a file\n"
        "    return _load(path, *args, **kwargs)\n"
        "mx.load = load\n")
    server = _serve(model, tmp_path, str(hook))
    try:
        deadline = time.monotonic() + 60
        seen = ""
        while "converting" not in seen and time.monotonic() < deadline:  # the server reached the conversion
            line = server.stderr.readline()
            if not line:
                break
            seen += line
        assert "converting" in seen, seen
        time.sleep(1.0)
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=20)
        took = time.monotonic() - started
    finally:
        server.kill()
    assert took < 10, took
    assert server.returncode in (0, -signal.SIGTERM), server.returncode
