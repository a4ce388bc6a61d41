"""The drafting bench's figures are medians over repeated rounds, each against the plain runs around it (one ratio
on a loaded 2-core VM swings +-10%, and ``drafting_vs_plain_worst`` is the minimum of several)."""

from __future__ import annotations

import statistics

import pytest


def test_figures_are_medians_of_rounds_between_plain_runs():
    from spec_cache.apps.bench import drafting

    figures = drafting.run(rows=1, new_tokens=4, tiny=True, drafters=("ngram",), copy=False,
                           random_text=False, repeats=3)
    block = figures["tiny"]
    assert block["repeats"] == 3 and len(block["plain_runs_tok_s"]) == 4  # plain, then a plain after each round
    for label in ("adaptive", "fixed"):
        for clock in ("", "_cpu"):
            runs = block["ngram"][f"{label}_vs_plain{clock}_runs"]
            assert len(runs) == 3 and all(r > 0 for r in runs)
            assert block["ngram"][f"{label}_vs_plain{clock}"] == statistics.median(runs)
    assert figures["drafting_vs_plain_worst"] == figures["drafting_vs_plain_ngram"]
    with pytest.raises(ValueError, match="repeats"):
        drafting.run(tiny=True, repeats=0)
