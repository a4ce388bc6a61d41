"""The store and schemas packages install under ``spec_cache``: a user's own ``store/`` or ``schemas/`` folder
beside their script must not shadow them, and no generic top-level name is added to site-packages."""

import subprocess
import sys


def test_user_folders_named_store_and_schemas_do_not_shadow(tmp_path):
    for name in ("store", "schemas"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('the user\\'s own package was imported')\n")
    code = ("import spec_cache.store, spec_cache.schemas, sys\n"
            "from spec_cache.store import Store\n"
            "from spec_cache.schemas import DraftRowCheckpoint\n"
            "print('mlx' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # inspection stays MLX-free


def test_no_top_level_store_or_schemas_installed(tmp_path):
    code = "import importlib.util as u; print(u.find_spec('store'), u.find_spec('schemas'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None None"


def test_library_log_lines_are_not_printed_by_default(tmp_path):
    """A warning is reported once (as a CacheWarning), not again by logging's last-resort handler."""
    code = ("import logging, spec_cache.store\n"
            "logging.getLogger('spec_cache.store').warning('dropping corrupt record')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == ""
