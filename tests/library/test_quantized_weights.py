"""Quantized-weight targets end to end: the real SmolLM2-135M-Instruct (Q4_1 linear layers, Q8_0 tied embeddings,
converted by spec_cache.convert.gguf) through Generator + SpecCache: cold == mlx-lm's ``generate_step`` greedy,
restored == cold, B in {1, 3}, per drafter.

Why bit-exactness holds here: MLX's CPU ``quantized_matmul`` computes every output row on its own, in the same
order whatever the number of rows, so a verify window of ``depth + 1`` tokens, a batch of left-padded rows and
one-token decoding give bit-identical logits (``test_quantized_kernels_are_shape_independent_on_cpu`` checks the
property the exactness rests on). GPU kernels pick different code paths by shape (matrix-vector for one token,
matrix-matrix for a window), so there the property is not asserted bit for bit.

Speed: MLX's CPU quantized kernels do not batch rows, so most tests run on a 2-layer slice of the real model (the
real quantized tensors, the real 49152-token 8-bit head); one test runs the whole model on a chat question.
Skipped only when the GGUF file is absent (see tests/library/test_gguf.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import pytest

from spec_cache.decode.generator import Generator
from spec_cache.rows.target import TargetModel
from spec_cache.testing.tiny import write_tiny_drafter
from spec_cache.tiers.cache import SpecCache
from tests.library.test_gguf import FRANCE, smollm2_dir, smollm2_gguf, smollm2_root  # noqa: F401  (fixtures)
from tests.runtime_fixtures import _identity_memo, plain_greedy  # noqa: F401  (fixtures)

#: real chat text (SmolLM2 ids): the system line, a user turn, and an assistant header
PROMPTS = [FRANCE[:12], FRANCE[20:33], FRANCE[:5] + FRANCE[30:37]]
MAX = 6
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


@dataclass
class Sliced:
    root: Path
    target_dir: Path
    target: TargetModel

    def drafter_dir(self, name: str) -> Path:
        return self.root / name


def _dequantized_copy(source: Path, out: Path) -> Path:
    """``source`` (a quantized mlx-lm directory) with every packed module as a float32 weight (``mx.dequantize``)."""
    config = json.loads((source / "config.json").read_text())
    quantization = config.pop("quantization")
    config.pop("quantization_config", None)
    weights = mx.load(str(source / "model.safetensors"))
    floats = {}
    for name, value in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name[: -len(".weight")]
        if f"{module}.scales" in weights:
            setting = quantization.get(module) or quantization
            value = mx.dequantize(value, weights[f"{module}.scales"], weights[f"{module}.biases"],
                                  group_size=setting["group_size"], bits=setting["bits"])
        floats[name] = value.astype(mx.float32)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), floats)
    (out / "config.json").write_text(json.dumps(dict(config, torch_dtype="float32")))
    return out


@pytest.fixture(scope="module")
def sliced(smollm2_dir, tmp_path_factory) -> Sliced:
    """The first two layers of the real 4-bit model (still quantized, real head) and its drafters: ngram,
    draft-model (its first layer, 4-bit), draft-model-full (itself: every draft accepted); the learned-drafter
    layouts (assistant, deepspec, dflash) are written from a float copy (their networks are float; they read the
    quantized target's KV and hiddens)."""
    root = tmp_path_factory.mktemp("quantized-slice")
    target_dir = write_tiny_drafter(root / "target", "draft-model", smollm2_dir, layers=2)
    write_tiny_drafter(root / "ngram", "ngram", target_dir)
    write_tiny_drafter(root / "draft-model", "draft-model", target_dir, layers=1)
    write_tiny_drafter(root / "draft-model-full", "draft-model", target_dir, layers=2)
    floats = _dequantized_copy(target_dir, root / "float-copy")
    for method in ("assistant", "deepspec", "dflash"):
        write_tiny_drafter(root / method, method, floats)
    return Sliced(root, target_dir, TargetModel.load(target_dir))


def test_the_slice_is_a_quantized_target(sliced):
    from mlx.nn import QuantizedEmbedding, QuantizedLinear

    model = sliced.target.model
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding) and model.model.embed_tokens.bits == 8
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.q_proj, QuantizedLinear) and attention.q_proj.bits == 4
    assert attention.q_proj.group_size == 32
    assert sliced.target.kv_geometry(0) == (3, 64)


def _cache_rows(target: TargetModel, rows: list[list[int]], prefix: int):
    """Logits of ``rows`` (equal length) decoded token by token after a ``prefix``-token prefill, as one window,
    and as a left-padded batch of 3 (the engine's layout)."""
    from mlx_lm.models.cache import BatchKVCache

    model = target.model
    single = []
    for i, row in enumerate(rows):  # row i holds i tokens of left padding in the batch: it starts at token i
        caches = target.make_caches()
        mx.eval(model(mx.array([row[i:prefix]]), cache=caches))
        single.append(mx.concatenate([model(mx.array([[t]]), cache=caches)[:, -1] for t in row[prefix:]]))
    caches = target.make_caches()
    mx.eval(model(mx.array([rows[0][:prefix]]), cache=caches))
    window = model(mx.array([rows[0][prefix:]]), cache=caches)[0]
    padded = [[0] * i + row[i:] for i, row in enumerate(rows)]
    batch = [BatchKVCache(list(range(len(rows)))) for _ in range(target.num_layers)]
    mx.eval(model(mx.array([r[:prefix] for r in padded]), cache=batch))
    batched = model(mx.array([r[prefix:] for r in padded]), cache=batch)
    return single, window, batched


def test_quantized_kernels_are_shape_independent_on_cpu(sliced):
    """The property exactness rests on: one-token decoding, a verify window and a left-padded batch give the
    same logits. Bit for bit on the CPU; elsewhere kernels differ by shape (checked to float16 tolerance)."""
    rows = [PROMPTS[0], PROMPTS[1][:12], PROMPTS[2]]
    single, window, batched = _cache_rows(sliced.target, rows, 6)
    pairs = [(window, single[0])] + [(batched[i], single[i]) for i in range(3)]
    if mx.default_device() == mx.cpu:
        assert all(mx.array_equal(a, b).item() for a, b in pairs)
    else:
        assert all(mx.allclose(a, b, atol=5e-2, rtol=0).item() for a, b in pairs)
        pytest.xfail("not asserted bit for bit off the CPU: quantized kernels differ by shape")


def _load(sliced: Sliced, cache: SpecCache, method: str, **options) -> Generator:
    return Generator.load(sliced.target_dir, sliced.drafter_dir(method), cache=cache, **options)


@pytest.mark.parametrize("method", ["ngram", "draft-model"])
@pytest.mark.parametrize("batch", [1, 3])
def test_quantized_target_restored_equals_cold_equals_plain_greedy(sliced, tmp_path, method, batch):
    prompts = PROMPTS[:batch]
    expected = [plain_greedy(sliced.target, p, MAX) for p in prompts]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = _load(sliced, cache, method)
        cold = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in cold] == expected
        assert all(r.cached_tokens == 0 for r in cold)
        warm = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in warm] == expected
        assert all(r.cached_tokens == len(p) - 1 and r.restored_drafter for p, r in zip(prompts, warm))
        follow = [p + e + [198, 1] for p, e in zip(prompts, expected)]
        for prompt, r in zip(follow, gen.generate(follow, max_tokens=MAX)):
            assert r.tokens == plain_greedy(sliced.target, prompt, MAX)
            assert r.cached_tokens >= len(prompt) - 3 - 1


def test_quantized_draft_model_that_is_the_target_accepts_every_draft(sliced, tmp_path):
    expected = [plain_greedy(sliced.target, p, MAX) for p in PROMPTS]
    with SpecCache.open(tmp_path / "store") as cache:
        cold = _load(sliced, cache, "draft-model-full", adaptive=False).generate(PROMPTS, max_tokens=MAX)
    assert [r.tokens for r in cold] == expected
    assert all(r.drafted > 0 and r.accepted == r.drafted for r in cold)


@pytest.mark.parametrize("method", ["assistant", "deepspec", "dflash"])
def test_learned_drafters_over_a_quantized_target(sliced, tmp_path, method):
    """Float drafter networks reading a 4-bit target's KV / hiddens: cold == plain greedy, restored == cold."""
    assert sliced.target.dtype in FLOAT_DTYPES  # a quantized embedding's dtype is its scales', not packed uint32
    expected = [plain_greedy(sliced.target, p, 4) for p in PROMPTS]
    with SpecCache.open(tmp_path / "store") as cache:
        gen = _load(sliced, cache, method)
        assert [r.tokens for r in gen.generate(PROMPTS, max_tokens=4)] == expected
        warm = gen.generate(PROMPTS, max_tokens=4)
        assert [r.tokens for r in warm] == expected
        assert all(r.cached_tokens == len(p) - 1 for p, r in zip(PROMPTS, warm))


def test_real_model_answers_and_speculation_is_exact(smollm2_dir, tmp_path):
    """The whole 135M 4-bit model on the chat-templated question: ngram speculation gives mlx-lm's greedy
    tokens, the answer names Paris, and the next call restores the prompt and answers identically."""
    from mlx_lm.utils import load_tokenizer

    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(smollm2_dir, None, method="ngram", cache=cache)
        (cold,) = gen.generate([FRANCE], max_tokens=7)
        assert cold.tokens == plain_greedy(gen.engine.target, FRANCE, 7)
        assert "Paris" in load_tokenizer(smollm2_dir).decode(cold.tokens)
        (warm,) = gen.generate([FRANCE], max_tokens=7)
        assert warm.tokens == cold.tokens and warm.cached_tokens == len(FRANCE) - 1
