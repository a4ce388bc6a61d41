"""The import-layer rule (tools/check_layers.py): this tree keeps it (0 circles, 0 upward imports), and each kind
of violation seeded into a small tree of the same shape is caught, whether the import sits at module level or inside
a function: a layer or floor importing one above it, MLX where it may not be, an import circle."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import check_layers  # noqa: E402

CLEAN = {
    "schemas/__init__.py": "from .core import Schema\n",
    "schemas/core.py": "import json\n\nclass Schema:\n    pass\n",
    "store/__init__.py": "from .codec import encode\nfrom spec_cache.schemas import Schema\n",
    "store/codec.py": ("from ..schemas.core import Schema\nfrom spec_cache import schemas\n\n"
                       "def encode():\n    from spec_cache.store import codec\n    return codec, Schema, schemas\n"),
    "spec_cache/__init__.py": "",
    "spec_cache/naming/__init__.py": "",
    "spec_cache/runtime.py": "import mlx.core as mx\nfrom spec_cache.store import encode\n",
    "spec_cache/naming/identity.py": ("from typing import TYPE_CHECKING\nfrom spec_cache.store import encode\n"
                               "if TYPE_CHECKING:\n    from ..runtime import mx\n\n"
                               "def load():\n    import mlx.core\n    from .. import runtime\n"),
    "spec_cache/naming/namespace.py": "from .jsjson import dumps\n",
    "spec_cache/naming/jsjson.py": "import json\ndumps = json.dumps\n",
    "spec_cache/apps/__init__.py": "",
    "spec_cache/apps/cli/__init__.py": "from . import inspect\n",
    "spec_cache/apps/cli/inspect.py": "from spec_cache.naming.identity import load\n",
    "spec_cache/apps/demo.py": "from spec_cache.testing.tiny import mx\nfrom spec_cache.apps.cli import inspect\n",
    "spec_cache/testing/__init__.py": "",
    "spec_cache/testing/tiny.py": ("from spec_cache.runtime import mx\n\n"
                                   "def build():\n    from spec_cache import cache\n"),
    "spec_cache/cache.py": "def load():\n    from spec_cache.runtime import mx\n    return mx\n",
    "spec_cache/__main__.py": "from spec_cache.apps.cli import inspect\n",  # an entry point may import the apps
    # rooms of the library: naming < state < ... < tiers < decode < convert | training
    "spec_cache/errors.py": "class Refused(ValueError):\n    pass\n",
    "spec_cache/naming/ids.py": "from spec_cache.errors import Refused\n",
    "spec_cache/tiers/__init__.py": "",
    "spec_cache/tiers/store_face.py": "from spec_cache.naming import ids\nfrom spec_cache.errors import Refused\n",
    "spec_cache/decode/__init__.py": "",
    "spec_cache/decode/loop.py": "from spec_cache.tiers import store_face\nfrom spec_cache.naming.ids import Refused\n",
    "spec_cache/convert/__init__.py": "",
    "spec_cache/convert/gguf.py": "from spec_cache.decode import loop\n",
    "spec_cache/training/__init__.py": "",
    "spec_cache/training/train.py": "from spec_cache.decode import loop\n",
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_this_tree_keeps_the_layers():
    assert check_layers.check(REPO) == []


def test_the_script_runs_on_this_tree():
    out = subprocess.run([sys.executable, str(REPO / "tools" / "check_layers.py")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert " 0 circles, 0 upward imports, 0 other violations" in out.stdout.splitlines()[-1], out.stdout


def test_a_clean_seeded_tree_passes(tmp_path):
    assert check_layers.check(write_tree(tmp_path, CLEAN)) == []


SEEDED = [
    # (file, text appended, words expected in the one violation line)
    ("schemas/core.py", "from spec_cache.store import encode\n", ["schemas/core.py:5", "spec_cache.store"]),
    ("schemas/core.py", "def f():\n    from ..store import codec\n", ["schemas/core.py:6", "spec_cache.store.codec"]),
    ("schemas/core.py", "def f():\n    import spec_cache.naming.identity\n", ["spec_cache.naming.identity"]),
    ("schemas/core.py", "def f():\n    import mlx.core\n", ["schemas/core.py:6", "mlx.core", "no MLX"]),
    ("store/codec.py", "def g():\n    from spec_cache.runtime import mx\n", ["store/codec.py:8", "spec_cache.runtime"]),
    ("store/codec.py", "from spec_cache.naming import identity\n", ["store/codec.py:7", "spec_cache.naming.identity"]),
    ("store/codec.py", "from ..naming import namespace\n", ["spec_cache.naming.namespace"]),
    ("store/codec.py", "import mlx_lm\n", ["store/codec.py:7", "mlx_lm"]),
    ("store/codec.py", "def g():\n    from mlx_lm.models import cache\n", ["mlx_lm.models"]),
    ("spec_cache/runtime.py", "from store import encode\n", ["spec_cache/runtime.py:3", "spec_cache.store"]),
    ("spec_cache/naming/jsjson.py", "import mlx.core\n",
     ["spec_cache/naming/jsjson.py:3", "spec_cache.naming.jsjson", "MLX"]),
    ("spec_cache/naming/jsjson.py", "from .. import runtime\n",
     ["spec_cache.naming.jsjson", "spec_cache.runtime", "mlx"]),
    ("spec_cache/naming/identity.py", "from ..runtime import mx as loaded\n",
     ["spec_cache.naming.identity", "spec_cache.runtime"]),
    ("spec_cache/apps/cli/inspect.py", "try:\n    from ...runtime import mx\nexcept ImportError:\n    pass\n",
     ["spec_cache.apps.cli.inspect", "spec_cache.runtime"]),
    # the floors of spec_cache: the library <- testing <- apps
    ("spec_cache/runtime.py", "from spec_cache.apps import demo\n",
     ["spec_cache/runtime.py:3", "spec_cache.apps.demo", "above the library"]),
    ("spec_cache/runtime.py", "def f():\n    from spec_cache.apps.cli.inspect import load\n",
     ["spec_cache/runtime.py:4", "spec_cache.apps.cli.inspect", "above the library"]),
    ("spec_cache/naming/identity.py", "def g():\n    import spec_cache.testing.tiny\n",
     ["spec_cache/naming/identity.py:", "spec_cache.testing.tiny", "spec_cache.testing stands above the library"]),
    ("spec_cache/testing/tiny.py", "def g():\n    from spec_cache.apps import cli\n",
     ["spec_cache/testing/tiny.py:6", "spec_cache.apps.cli", "above spec_cache.testing"]),
    ("store/codec.py", "def g():\n    from spec_cache.apps import demo\n",
     ["store/codec.py:8", "spec_cache.apps.demo"]),
    # rooms: a room importing one above it (at module level or inside a function), or one beside it
    ("spec_cache/naming/ids.py", "from spec_cache.tiers import store_face\n",
     ["spec_cache/naming/ids.py:2", "room spec_cache.tiers stands above spec_cache.naming"]),
    ("spec_cache/tiers/store_face.py", "def f():\n    from spec_cache.decode.loop import store_face\n",
     ["spec_cache/tiers/store_face.py:4", "room spec_cache.decode stands above spec_cache.tiers"]),
    ("spec_cache/training/train.py", "def f():\n    from spec_cache.convert import gguf\n",
     ["room spec_cache.convert stands beside spec_cache.training"]),
    ("spec_cache/errors.py", "def f():\n    from spec_cache.naming import ids\n",
     ["spec_cache/errors.py:4", "stands above the ground"]),
    # a folder circle no module circle shows: naming.ids -> tiers.a, tiers.b -> naming.other
    ("spec_cache/naming/__init__.py", "def f():\n    from spec_cache.tiers import store_face\n",
     ["folder circle of 2 folders", "spec_cache.naming", "spec_cache.tiers"]),
    # circles: two modules importing each other inside functions (directly, through a name a package exports)
    ("spec_cache/runtime.py", "def h():\n    from spec_cache.testing import tiny\n    return tiny\n",
     ["import circle of 3 modules", "spec_cache.runtime", "spec_cache.testing.tiny", "spec_cache.cache"]),
    ("spec_cache/runtime.py", "def h():\n    from .naming import identity\n",
     ["spec_cache/naming/identity.py:4", "import circle of 2 modules",
      "spec_cache.naming.identity (line 4) -> spec_cache.runtime (line 4) -> spec_cache.naming.identity"]),
    ("spec_cache/apps/cli/inspect.py", "def f():\n    from spec_cache.apps import demo\n",
     ["import circle of 2 modules", "spec_cache.apps.cli.inspect", "spec_cache.apps.demo"]),
    ("spec_cache/apps/cli/inspect.py", "def f():\n    from spec_cache.apps.demo import mx\n",
     ["import circle of 2 modules", "spec_cache.apps.cli.inspect (line 3) -> spec_cache.apps.demo"]),
]


@pytest.mark.parametrize("rel, extra, words", SEEDED, ids=[f"{r}+{e.strip().splitlines()[-1]}" for r, e, _ in SEEDED])
def test_a_seeded_violation_is_caught(tmp_path, rel, extra, words):
    files = dict(CLEAN)
    files[rel] = files[rel] + extra
    problems = check_layers.check(write_tree(tmp_path, files))
    assert problems, f"{rel} + {extra!r} was not caught"
    hits = [p for p in problems if all(w in p for w in words)]
    assert hits, problems
    out = subprocess.run([sys.executable, str(REPO / "tools" / "check_layers.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and hits[0] in out.stdout


def test_the_summary_counts_each_circle_once(tmp_path):
    """Two loops through the same modules are one circle (one line); an upward import is counted apart."""
    files = dict(CLEAN)
    files["spec_cache/runtime.py"] += "def h():\n    from spec_cache import cache\n"
    files["spec_cache/cache.py"] += "def back():\n    from spec_cache import runtime\n"
    files["spec_cache/naming/jsjson.py"] += "def f():\n    from spec_cache.testing import tiny\n"
    out = subprocess.run([sys.executable, str(REPO / "tools" / "check_layers.py"), str(write_tree(tmp_path, files))],
                         capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert out.returncode == 1
    assert lines[-1] == "layers: 28 modules, 1 circles, 1 upward imports, 0 other violations", out.stdout
    assert len([line for line in lines if "import circle" in line]) == 1, out.stdout
    assert "import circle of 2 modules" in out.stdout, out.stdout
