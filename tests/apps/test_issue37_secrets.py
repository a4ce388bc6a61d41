"""Secrets come from files or the environment only (issue 37 item 10): every local user reads any process's command
line (/proc/PID/cmdline, ps), so ``--api-key KEY``, ``--operator-key KEY`` and a password inside ``--shared URL``
are refused with one line naming the file option and the environment variable to use instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spec_cache.apps.cli.common import CliError
from spec_cache.apps.cli.shared import shared_url, url_has_password, with_password

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPEC_CACHE_")}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**clean, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.parametrize("option, instead", [("--api-key", "--api-keys-file"),
                                             ("--operator-key", "--operator-key-file")])
def test_serve_refuses_a_key_on_the_command_line(tmp_path, option, instead):
    done = _run("-m", "spec_cache.apps.server", "--model", str(tmp_path), "--port", "0", option, "sk-secret")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spec-cache serve: error: "), done.stderr
    assert "command line" in lines[0] and instead in lines[0] and "$SPEC_CACHE_" in lines[0]
    assert "sk-secret" not in done.stderr


def test_serve_refuses_a_password_in_the_shared_url(tmp_path):
    done = _run("-m", "spec_cache.apps.server", "--model", str(tmp_path), "--port", "0", "--shared",
                "redis://:hunter2@127.0.0.1:1/0")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--shared-password-file" in lines[0] and "SPEC_CACHE_SHARED_PASSWORD" in lines[0]
    assert "hunter2" not in done.stderr


def test_the_cli_and_the_mlx_lm_launcher_refuse_a_password_in_the_shared_url(tmp_path):
    done = _run("-m", "spec_cache", "--shared", "redis://user:hunter2@127.0.0.1:1/0", "shared-stats")
    assert done.returncode == 2 and "--shared-password-file" in done.stderr and "hunter2" not in done.stderr
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    done = _run("-m", "spec_cache.apps.mlx_lm_server", "--model", str(model), "--shared",
                "redis+cluster://:hunter2@127.0.0.1:1,127.0.0.1:2")
    assert done.returncode == 2, done.stderr
    assert "--shared-password-file" in done.stderr and "hunter2" not in done.stderr


def test_the_shared_password_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("SPEC_CACHE_SHARED", raising=False)
    monkeypatch.delenv("SPEC_CACHE_SHARED_PASSWORD", raising=False)
    secret = tmp_path / "password"
    secret.write_text("p@ss:/word\n")
    args = argparse.Namespace(shared="redis://127.0.0.1:6379/0", shared_password_file=str(secret))
    assert shared_url(args) == "redis://:p%40ss%3A%2Fword@127.0.0.1:6379/0"
    import redis

    assert redis.connection.parse_url(shared_url(args))["password"] == "p@ss:/word"
    monkeypatch.setenv("SPEC_CACHE_SHARED_PASSWORD", "envpw")
    args = argparse.Namespace(shared="redis://admin@h:1/2")
    assert shared_url(args) == "redis://admin:envpw@h:1/2"
    monkeypatch.setenv("SPEC_CACHE_SHARED", "redis://:inenv@h:1/0")  # the environment may carry the whole URL
    assert shared_url(argparse.Namespace()) == "redis://:envpw@h:1/0"
    with pytest.raises(CliError, match="--shared-password-file"):
        shared_url(argparse.Namespace(shared="redis://h:1/0?password=x"))
    with pytest.raises(CliError, match="cannot read --shared-password-file"):
        shared_url(argparse.Namespace(shared="redis://h:1/0", shared_password_file=str(tmp_path / "missing")))
    assert url_has_password("rediss+cluster://u:p@a:1,b:2") and not url_has_password("redis://u@h:1/0")
    assert with_password("unix:///tmp/r.sock?db=1", "x") == "unix:///tmp/r.sock?db=1&password=x"


def test_keys_come_from_the_environment_and_files(tmp_path, monkeypatch):
    from spec_cache.apps.server import cli

    for name in ("SPEC_CACHE_API_KEY", "SPEC_CACHE_API_KEYS", "SPEC_CACHE_OPERATOR_KEY", "SPEC_CACHE_OPERATOR_KEYS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SPEC_CACHE_API_KEYS", "k1, k2\nk3")
    monkeypatch.setenv("SPEC_CACHE_API_KEY", "k0")
    monkeypatch.setenv("SPEC_CACHE_OPERATOR_KEYS", "o1,o2")
    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenants\nk4\n")
    args = argparse.Namespace(api_key=[], operator_key=[], api_keys_file=str(keys_file), operator_key_file=None)
    assert cli._keys(args) == (["k0", "k1", "k2", "k3", "k4"], ["o1", "o2"])
    with pytest.raises(CliError, match="--api-key puts the key on the command line"):
        cli._keys(argparse.Namespace(**{**vars(args), "api_key": ["sk"]}))
