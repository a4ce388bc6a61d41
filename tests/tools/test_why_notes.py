"""Issue 23's house rule: a module over 400 lines says at its top why it stays one file.

The note is a sentence of the module docstring starting "Why one file" (or "kept in one file on purpose"); it names
what holds the file together, so a reader knows whether a split would help. This test fails, naming the file and its
length, when a module under ``spec_cache/``, ``store/``, ``schemas/`` or ``tools/`` grows past the limit without one.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 400
NOTE = re.compile(r"Why one file|kept in one file on purpose")


def long_modules_without_a_note(root: Path = ROOT, limit: int = LIMIT) -> list[str]:
    missing = []
    for top in ("spec_cache", "store", "schemas", "tools"):
        for path in sorted((root / top).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            lines = text.count("\n")
            if lines > limit and not NOTE.search(ast.get_docstring(ast.parse(text)) or ""):
                missing.append(f"{path.relative_to(root)} ({lines} lines)")
    return missing


def test_every_module_over_400_lines_says_why_it_stays_one_file():
    assert long_modules_without_a_note() == []


def test_the_check_finds_a_long_module_without_a_note(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "long.py").write_text('"""A module."""\n' + "x = 1\n" * 401)
    noted = '"""A module.\n\nWhy one file: one state machine."""\n'
    (tmp_path / "store" / "noted.py").write_text(noted + "x = 1\n" * 401)
    (tmp_path / "store" / "short.py").write_text('"""A module."""\n' + "x = 1\n" * 10)
    assert long_modules_without_a_note(tmp_path) == ["store/long.py (402 lines)"]
