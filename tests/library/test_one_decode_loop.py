"""Issue 34, item 1: one decode loop. The restore / open / checkpoint sequence (``.prepare(``,
``engine.session(`` or ``engine.run(``, ``.save_checkpoint(``) is written in ``spec_cache/decode/cached_session.py``
(``CachedSession``) and nowhere else: no caller is allowed to drive the engine session itself (``ALLOWED`` is
empty).

``Generator.generate``, ``tiers.continuations.generate``, the CLI's ``apps/cli/stream.decode_rows`` and the server's
scheduler (``apps/server/scheduler.py``: its thread, queues, back-pressure, prefill phases, retries and fault
isolation around ``CachedSession.prepare`` / ``admit`` / ``step`` / ``write_checkpoints``) are callers of
``CachedSession``. Reads the files with ``ast`` (nothing imported); a module counts when it calls all three, in one
function or across its functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOOP = "spec_cache/decode/cached_session.py"
#: callers allowed to write the sequence themselves, with the reason (module doc)
ALLOWED: dict[str, str] = {}
SCANNED = ("spec_cache", "store", "schemas", "tools")


def _steps(tree: ast.AST) -> set[str]:
    """Which steps of the sequence ``tree`` calls: ``restore`` (``x.prepare(...)``), ``open``
    (``engine.session(...)``, ``x.engine.session(...)``, or the engine's own loop ``engine.run(...)``),
    ``checkpoint`` (``x.save_checkpoint(...)``)."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name, owner = node.func.attr, node.func.value
        if name == "prepare":
            found.add("restore")
        elif name == "save_checkpoint":
            found.add("checkpoint")
        elif name in ("session", "run") and (isinstance(owner, ast.Name) and owner.id == "engine"
                                    or isinstance(owner, ast.Attribute) and owner.attr == "engine"):
            found.add("open")
    return found


def _writers() -> dict[str, set[str]]:
    """Module path -> the functions calling the whole sequence themselves (empty: only across functions)."""
    writers = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            if _steps(tree) != {"restore", "open", "checkpoint"}:
                continue
            functions = {node.name for node in ast.walk(tree)
                         if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and _steps(node) == {"restore", "open", "checkpoint"}}
            writers[path.relative_to(ROOT).as_posix()] = functions
    return writers


def test_the_sequence_is_written_once():
    writers = _writers()
    assert LOOP in writers, "the detector no longer finds the loop itself: update _steps"
    extra = sorted(set(writers) - {LOOP} - set(ALLOWED))
    assert not extra, f"restore/open/checkpoint written by hand outside {LOOP}: {extra} (use CachedSession)"


def test_the_scheduler_drives_cached_session():
    """The server's scheduler opens no engine session and writes no checkpoint itself: ``CachedSession`` does."""
    path = "spec_cache/apps/server/scheduler.py"
    source = (ROOT / path).read_text()
    steps = _steps(ast.parse(source))
    assert "open" not in steps and "checkpoint" not in steps, (path, steps)
    assert "CachedSession(" in source


def test_the_library_callers_are_thin():
    """The three library callers call ``CachedSession`` (through ``Generator.session``) and none of the steps'
    engine / cache calls themselves."""
    for path in ("spec_cache/decode/generator.py", "spec_cache/tiers/continuations.py",
                 "spec_cache/apps/cli/stream.py"):
        steps = _steps(ast.parse((ROOT / path).read_text()))
        assert "open" not in steps and "checkpoint" not in steps, (path, steps)


def test_the_detector_sees_a_hand_written_loop():
    source = ("def generate(generator, prompts):\n"
              "    rows = [generator.prepare(p) for p in prompts]\n"
              "    session = generator.engine.session(on_checkpoint=None)\n"
              "    generator.save_checkpoint([], [])\n")
    assert _steps(ast.parse(source)) == {"restore", "open", "checkpoint"}
