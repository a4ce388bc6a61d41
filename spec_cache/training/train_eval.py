"""Drafting acceptance of a trained head, measured through the real engine (``Generator`` with the drafter
directory, greedy, a fixed draft depth), against the untrained head and plain greedy decoding.

Why through ``Generator.load``: that is how a user runs the drafter (``--drafter DIR --method qwen-mtp``), so the
figure covers loading it by its identity and the engine's rows, and the tokens are checked against plain greedy
(the exactness contract: a drafter may change speed, never tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["acceptance", "compare"]


def _run(model_dir: Path, drafter_dir: Path | None, prompts: Sequence[Sequence[int]], max_tokens: int,
         depth: int) -> tuple[list[list[int]], int, int]:
    from spec_cache.decode.generator import Generator

    method = None if drafter_dir is None else "qwen-mtp"
    generator = Generator.load(model_dir, drafter_dir, method=method, cache=None, draft_depth=depth,
                               adaptive=False)
    results = generator.generate([list(p) for p in prompts], max_tokens=max_tokens)
    return ([list(r.tokens) for r in results], sum(r.drafted for r in results), sum(r.accepted for r in results))


def acceptance(drafted: int, accepted: int, depth: int) -> dict:
    """Acceptance (accepted / drafted) and the mean tokens a round yields (the pending one + accepted drafts)."""
    rounds = drafted / depth if depth else 0
    return {"drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 4) if drafted else 0.0,
            "tokens_per_round": round(1 + accepted / rounds, 3) if rounds else 1.0}


def compare(model_dir: str | Path, drafters: dict[str, Path], prompts: Sequence[Sequence[int]], max_tokens: int = 64,
            depth: int = 3) -> dict:
    """``{name: acceptance(...) + identical}`` for each drafter directory, plus ``plain_tokens``; ``identical`` says
    whether its tokens equal plain greedy decoding's on every prompt."""
    model_dir = Path(model_dir)
    plain, _, _ = _run(model_dir, None, prompts, max_tokens, depth)
    out: dict = {"prompts": len(prompts), "max_tokens": max_tokens, "depth": depth,
                 "plain_tokens": sum(len(t) for t in plain)}
    for name, directory in drafters.items():
        tokens, drafted, accepted = _run(model_dir, Path(directory), prompts, max_tokens, depth)
        out[name] = dict(acceptance(drafted, accepted, depth), identical=tokens == plain)
    return out
