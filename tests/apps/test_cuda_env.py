"""MLX's CUDA caches throw "Cache thrashing is happening" once their lifetime misses pass twice their capacity; a
server meets a new attention shape at nearly every step, so its entry points turn the check off before the device
starts (``spec_cache.apps.cuda_env``), keeping any value the user set."""

from __future__ import annotations

import os
import subprocess
import sys

from spec_cache.apps import cuda_env


def test_the_check_is_turned_off_unless_the_user_set_it():
    env: dict = {}
    assert cuda_env.relax_cache_checks(env) and env == {cuda_env.THRASHING_CHECK: "0"}
    mine = {cuda_env.THRASHING_CHECK: "1"}
    assert not cuda_env.relax_cache_checks(mine) and mine == {cuda_env.THRASHING_CHECK: "1"}


def _env_after(code: str, user_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != cuda_env.THRASHING_CHECK}
    if user_value is not None:
        env[cuda_env.THRASHING_CHECK] = user_value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_every_entry_point_sets_it_before_it_runs(tmp_path):
    """The CLI (``spec-cache ...``: serve, mlx-lm-server, bench), ``python -m spec_cache.apps.server`` and the
    launcher's own ``main`` each turn it off first; a user's value survives all of them."""
    show = f"import os; print(os.environ.get({cuda_env.THRASHING_CHECK!r}, 'unset'))"
    store = str(tmp_path / "s")
    cli = ("import contextlib, io, os\nfrom spec_cache.apps import cli\n"
           "with contextlib.redirect_stdout(io.StringIO()):\n"
           f"    cli.main(['--json', 'ls', '--cache', {store!r}])\n" + show)
    assert _env_after(cli, None) == "0"
    assert _env_after(cli, "1") == "1"
    server = ("import argparse\nfrom spec_cache.apps.server import cli\n"
              "try:\n    cli.main(argparse.Namespace())\nexcept Exception:\n    pass\n" + show)
    assert _env_after(server, None) == "0"
    launcher = ("from spec_cache.apps import mlx_lm_server\n"  # an unknown option is refused after the call
                "try:\n    mlx_lm_server.main(['--no-such-option'])\nexcept BaseException:\n    pass\n" + show)
    assert _env_after(launcher, None) == "0"
