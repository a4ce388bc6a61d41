"""A copy workload for prompt-lookup drafting (issue 28 item 2): tasks whose answer mostly repeats the prompt.

The tasks (``data/copy_workload.json``) ask the model to rewrite a passage with one word changed, to edit a code
block with one change and output it whole, to extract fields from an email copying each value, to answer from a
retrieved passage quoting its sentence, and to summarise a report quoting its source: input-copying work where a
prompt-lookup drafter should win. Each task names its ``kind`` and what its answer ``copies``. The texts were
written for this project (no third-party data; same license as the project). The first three (what a 3-row bench
decodes) are a rewrite, an extraction and a code edit: kinds SmolLM2-135M-Instruct really copies for (its greedy
answers, measured); it paraphrases the quote, summary and one-line-rename tasks, which follow.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["DATA", "copy_tasks", "copy_chats"]

DATA = Path(__file__).resolve().parent / "data" / "copy_workload.json"


def copy_tasks(path: str | Path = DATA) -> list[dict]:
    """The tasks in order: ``{"kind", "prompt", "copies"}`` each."""
    return json.loads(Path(path).read_text())["tasks"]


def copy_chats(kinds=None, path: str | Path = DATA) -> list[list[dict]]:
    """Single-turn chats whose answers copy the prompt (``kinds``: only tasks of these kinds)."""
    return [[{"role": "user", "content": task["prompt"]}] for task in copy_tasks(path)
            if kinds is None or task["kind"] in kinds]
