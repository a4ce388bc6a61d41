"""The projected drafters as the seed runs them (issue 24, row 7):

* on ``gemma4_text`` targets (the seed's ``gemmaTaps``: taps index decoder layers, KV-shared ones included, and
  tap ``depth`` is the post-final-norm hidden): deepspec, dflash and dflash2 == plain greedy, restored == cold;
* DeepSpec with the seed's ``block_size``: one block forward per round, sliced to the round's depth;
* DSpark's ``sts.thresholds`` / ``minConf``: the drafted block stops at the first low-confidence draft;
* a DFlash drafter configured by a published ``config.json`` (z-lab's layout) is the same drafter as its
  ``dspark.json`` twin, under its own identity.
Tokens always equal plain greedy (float32)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from spec_cache.decode.engine import RowRequest, SpeculativeEngine
from spec_cache.decode.generator import Generator
from spec_cache.drafters import detect_method, load_provider
from spec_cache.drafters.dflash import DFlashProvider, block_logits
from spec_cache.drafters.projected import ContextKV, ProjectedConfig
from spec_cache.naming.identity import model_identity
from spec_cache.rows.target import TargetRows
from spec_cache.testing.tiny import write_tiny_drafter
from spec_cache.testing.tiny_writers import set_block_size
from spec_cache.tiers.cache import SpecCache
from tests.runtime_fixtures import CheckpointRecorder, _identity_memo, build_tiny, plain_greedy, tiny  # noqa: F401

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21], list(range(30, 44))]
MAX = 12


def run(target, provider, requests, depth=3, **kwargs):
    return SpeculativeEngine(target, provider, draft_depth=depth, adaptive=False).run(requests, **kwargs)


def assert_greedy_and_restored_equals_cold(target, provider, prompts=PROMPTS):
    """== plain greedy; then each row restored from its prompt boundary (target + draft row) and from its finish
    (an extended turn), beside a cold row: == plain greedy, and the restored tokens are reported as cached."""
    recorder = CheckpointRecorder()
    first = run(target, provider, [RowRequest(p, max_tokens=7) for p in prompts], on_checkpoint=recorder)
    for prompt, result in zip(prompts, first):
        assert result.tokens == plain_greedy(target, prompt, 7)
    requests = []
    for index, prompt in enumerate(prompts):
        _, tokens, caches, draft = recorder.boundary(index)
        assert draft is not None and draft.processed_tokens == len(tokens) == len(prompt) - 1
        requests.append(RowRequest(prompt, caches, len(tokens), draft, max_tokens=MAX))
    for index, (prompt, result) in enumerate(zip(prompts, first)):
        _, tokens, caches, draft = recorder.finish(index)
        requests.append(RowRequest(prompt + result.tokens + [3 + index, 50], caches, len(tokens), draft,
                                   max_tokens=MAX))
    requests.append(RowRequest(list(range(60, 75)), max_tokens=MAX))  # a cold row beside the warm ones
    results = run(target, provider, requests)
    for request, result in zip(requests, results):
        assert result.tokens == plain_greedy(target, request.prompt, MAX)
        assert result.cached_tokens == request.restored_tokens
    return results


def opened(provider, target, prompts):
    """A draft group over rows that hold ``prompt[:-1]`` each (prefilled with the target's taps)."""
    rows = TargetRows.from_row_caches(target, [None] * len(prompts))
    group = provider.open(rows, [None] * len(prompts))
    heads = [p[:-1] for p in prompts]
    group.prefill(heads, rows.prefill(heads, tap_layers=group.tap_layers))
    return group


class Counting:
    """Wraps a drafter network and counts its drafting forwards (``context_kv`` passes through)."""

    def __init__(self, network):
        self.network, self.calls = network, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.network(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.network, name)


# -- 1. gemma4_text targets ---------------------------------------------------------------------------------------

GEMMA4_DRAFTERS = {"deepspec": ("deepspec", {}), "dflash": ("dflash", {}), "dflash2": ("dflash2", {}),
                   "deepspec-final": ("deepspec", {"taps": [1, 4]})}


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    """4 decoder layers (sliding, global, then a KV-shared sliding and a KV-shared global layer), window 6."""
    return build_tiny(tmp_path_factory.mktemp("tiny-gemma4-projected"), "gemma4_text", num_layers=4,
                      kv_shared_layers=2, sliding_window=6, drafters=GEMMA4_DRAFTERS)


@pytest.mark.parametrize("name", list(GEMMA4_DRAFTERS))
def test_projected_drafters_run_on_gemma4(gemma4, name):
    provider = gemma4.provider(name)
    assert provider.config.num_target_layers == gemma4.target.depth == 4 and gemma4.target.num_layers == 2
    results = assert_greedy_and_restored_equals_cold(gemma4.target, provider)
    assert sum(r.drafted for r in results) > 0


@pytest.mark.parametrize("name", ["deepspec", "dflash"])
def test_gemma4_projected_generator_restores_after_reopen(gemma4, tmp_path, name):
    """Through the store: a new SpecCache over the same directory restores the prompt boundary (target + the
    drafter's context) and an extended turn, beside a cold prompt; tokens == plain greedy."""
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9, 10]]
    expected = [plain_greedy(gemma4.target, p, MAX) for p in prompts]
    target_dir, drafter_dir = gemma4.root / "target", gemma4.drafter_dir(name)
    with SpecCache.open(tmp_path / "store", chunk_tokens=16) as cache:
        assert [r.tokens for r in Generator.load(target_dir, drafter_dir, cache=cache).generate(
            prompts, max_tokens=MAX)] == expected
    with SpecCache.open(tmp_path / "store") as cache:
        gen = Generator.load(target_dir, drafter_dir, cache=cache)
        again = gen.generate(prompts, max_tokens=MAX)
        assert [r.tokens for r in again] == expected
        assert [r.cached_tokens for r in again] == [len(p) - 1 for p in prompts]
        follow = [p + e + [7, 8] for p, e in zip(prompts, expected)]
        mixed = follow + [list(range(100, 120))]
        results = gen.generate(mixed, max_tokens=MAX)
        for prompt, result in zip(mixed, results):
            assert result.tokens == plain_greedy(gemma4.target, prompt, MAX)
        assert [r.cached_tokens for r in results] == [len(f) - 3 for f in follow] + [0]


def test_gemma4_taps_include_kv_shared_layers_and_the_final_norm(gemma4):
    """Tap 3 is the last (KV-shared) decoder layer's output and tap 4 (= depth) the post-final-norm hidden; the
    drafter's context is exactly their projection."""
    target = gemma4.target
    ids = mx.array([[5, 9, 30, 31, 7, 8, 40, 41]])  # past the window of 6
    out = target.forward(ids, target.make_caches(), tap_layers=[1, 3, 4])
    assert mx.array_equal(out.taps[4], out.hidden).item()
    assert not mx.allclose(out.taps[3], out.hidden).item()
    provider = gemma4.provider("deepspec-final")
    assert provider.config.target_layer_ids == (1, 4)
    group = opened(provider, target, [ids[0].tolist() + [50]])
    joined = mx.concatenate([out.taps[1], out.hidden], axis=-1)
    expected = provider.network.context_kv(joined, mx.array([0]))
    keys = group.capture(0).attachment.tensors[0]
    assert mx.allclose(keys, expected[0][0], atol=1e-5).item()


# -- 2. DeepSpec drafts a block (block_size) and slices it -------------------------------------------------------


@pytest.fixture(scope="module")
def block_deepspec(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("deepspec-block") / "deepspec"
    write_tiny_drafter(path, "deepspec", tiny.root / "target")
    return load_provider(set_block_size(path, 4, mask_token_id=3))


def test_deepspec_drafts_one_block_and_slices_it(tiny, block_deepspec):
    provider = block_deepspec
    assert (provider.config.block_size, provider.config.mask_token_id) == (4, 3)
    prompt = PROMPTS[0]
    group = opened(provider, tiny.target, [prompt])
    # the reference: one non-causal forward over [pending, mask, mask, mask] at positions p..p+3
    out = tiny.target.forward(mx.array([prompt[:-1]]), tiny.target.make_caches(),
                              tap_layers=provider.config.target_layer_ids)
    taps = mx.concatenate([out.taps[t] for t in provider.config.target_layer_ids], axis=-1)
    context = [ContextKV(k, v, mx.ones((1, k.shape[2]), dtype=mx.bool_))
               for k, v in provider.network.context_kv(taps, mx.array([0]))]
    block = tiny.target.embed(mx.array([[prompt[-1], 3, 3, 3]]))
    hidden, _ = provider.network(block, mx.array([len(prompt) - 1]), context, causal=False)
    expected = mx.argmax(tiny.target.logits(hidden), axis=-1)[0].tolist()
    counting = group.network = Counting(group.network)
    assert group.draft([prompt[-1]], 4) == [expected]
    assert group.draft([prompt[-1]], 2) == [expected[:2]]
    assert group.draft([prompt[-1]], 9) == [expected]  # never more than the block
    assert counting.calls == 3  # one forward per round, whatever the depth


def test_deepspec_without_block_size_still_drafts_step_by_step(tiny):
    provider = tiny.provider("deepspec")
    assert provider.config.block_size == 0
    group = opened(provider, tiny.target, [PROMPTS[0]])
    counting = group.network = Counting(group.network)
    assert len(group.draft([PROMPTS[0][-1]], 3)[0]) == 3 and counting.calls == 3


def test_block_deepspec_equals_plain_greedy_and_restores(tiny, block_deepspec):
    results = assert_greedy_and_restored_equals_cold(tiny.target, block_deepspec)
    assert sum(r.drafted for r in results) > sum(r.accepted for r in results)


@pytest.mark.parametrize(("change", "message"), [
    ({"block_size": 0}, "block_size"), ({"block_size": 4, "mask_token_id": None}, "needs mask_token_id"),
    ({"sts": {"thresholds": [0.5]}}, "block drafters"),
])
def test_bad_deepspec_block_config_is_refused(block_deepspec, change, message):
    config = block_deepspec.config.to_dict()
    assert ProjectedConfig.from_dict(config, "deepspec") == block_deepspec.config  # round trip
    config.update(change)
    config = {key: value for key, value in config.items() if value is not None}
    with pytest.raises(ValueError, match=message):
        ProjectedConfig.from_dict(config, "deepspec")


# -- 3. DSpark early stop: sts.thresholds / minConf --------------------------------------------------------------


def dflash_with(tmp_path, tiny, **extra):
    path = tmp_path / "dflash"
    if not path.exists():
        write_tiny_drafter(path, "dflash", tiny.root / "target", gamma=4)
    config = json.loads((path / "dspark.json").read_text())
    config.pop("sts", None), config.pop("minConf", None)
    config.update(extra)
    (path / "dspark.json").write_text(json.dumps(config))
    return load_provider(path)


def test_dspark_thresholds_stop_the_block_at_low_confidence(tiny, tmp_path):
    prompts = [PROMPTS[0], PROMPTS[2]]
    plain = dflash_with(tmp_path, tiny)
    group = opened(plain, tiny.target, prompts)
    full = group.draft([p[-1] for p in prompts], 3)
    assert [len(d) for d in full] == [3, 3]
    # the drafter's probability of each draft (what the early stop compares)
    logits = block_logits(group, [p[-1] for p in prompts], 4, 0)[:, 1:, :]
    probs = mx.softmax(logits, axis=-1)
    conf = [[probs[row, k, full[row][k]].item() for k in range(3)] for row in range(2)]
    # a threshold between the rows' second-draft confidences: the less confident row keeps 1 draft, the other 3
    assert conf[0][1] != conf[1][1]
    middle = (conf[0][1] + conf[1][1]) / 2
    cases = [({"sts": {"thresholds": [0.0, 1.01, 1.01], "target": 0.5}}, [1, 1]),
             ({"minConf": 1.01}, [1, 1]),
             ({"sts": {"thresholds": [1.01, 0.0, 0.0]}}, [3, 3]),  # draft 0 is always kept
             ({"sts": {"thresholds": [0.0, 0.0]}, "minConf": 1.01}, [2, 2]),  # minConf past the list
             ({"sts": {"thresholds": [0.0, middle, 0.0]}}, [1 if row[1] < middle else 3 for row in conf])]
    for extra, lengths in cases:
        provider = dflash_with(tmp_path, tiny, **extra)
        drafts = opened(provider, tiny.target, prompts).draft([p[-1] for p in prompts], 3)
        assert [len(d) for d in drafts] == lengths, extra
        assert [d == f[: len(d)] for d, f in zip(drafts, full)] == [True, True]  # a prefix of the full block


def test_dspark_early_stop_drafts_fewer_tokens_and_keeps_them(tiny, tmp_path):
    requests = [RowRequest(p, max_tokens=MAX) for p in PROMPTS]
    full = run(tiny.target, dflash_with(tmp_path, tiny), requests)
    stopped = run(tiny.target, dflash_with(tmp_path, tiny, sts={"thresholds": [0.0, 0.99, 0.99]}), requests)
    for prompt, a, b in zip(PROMPTS, full, stopped):
        assert a.tokens == b.tokens == plain_greedy(tiny.target, prompt, MAX)
    assert sum(r.drafted for r in stopped) < sum(r.drafted for r in full)


@pytest.mark.parametrize("extra", [{"sts": {"thresholds": "high"}}, {"sts": [0.5]}, {"minConf": "0.5"},
                                   {"minConf": float("nan")}])
def test_bad_early_stop_config_is_refused(tiny, tmp_path, extra):
    with pytest.raises(ValueError, match="thresholds|minConf"):
        dflash_with(tmp_path, tiny, **extra)


# -- 4. Published DFlash config.json ------------------------------------------------------------------------------


def published_layout(project: dict, nested: bool = False) -> dict:
    """``project`` (dspark.json keys) written as a published DFlash ``config.json``: the legacy layout (top-level
    ``block_size``, ``rope_theta``) or the nested revision (``dflash_config.block_size``, ``rope_parameters``)."""
    out = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "float32",
        "layer_types": ["full_attention"] * project["num_hidden_layers"],
        "dflash_config": {"mask_token_id": project["mask_token_id"],
                          "target_layer_ids": project["target_layer_ids"]},
    }
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "rms_norm_eps", "num_target_layers"):
        out[key] = project[key]
    if nested:
        out["dflash_config"]["block_size"] = project["gamma"]
        out["rope_parameters"] = {"rope_theta": project["rope_theta"], "rope_type": "default"}
    else:
        out.update(block_size=project["gamma"], rope_theta=project["rope_theta"])
    return out


@pytest.fixture(scope="module")
def dflash_pair(tiny, tmp_path_factory):
    """A q/k-normed tiny DFlash drafter (as published DFlash drafters are) in this project's ``dspark.json``."""
    root = tmp_path_factory.mktemp("dflash-published")
    write_tiny_drafter(root / "dspark", "dflash", tiny.root / "target", gamma=4)
    config = json.loads((root / "dspark" / "dspark.json").read_text())
    config["qk_norm"] = True
    (root / "dspark" / "dspark.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    weights = mx.load(str(root / "dspark" / "model.safetensors"))
    for layer in range(config["num_hidden_layers"]):
        for norm, scale in (("q_norm", 1.0), ("k_norm", 0.5)):
            weights[f"layers.{layer}.self_attn.{norm}.weight"] = mx.full((config["head_dim"],), scale)
    mx.save_safetensors(str(root / "dspark" / "model.safetensors"), weights)
    return root, config


@pytest.mark.parametrize("nested", [False, True])
def test_published_dflash_config_is_the_same_drafter(tiny, dflash_pair, nested):
    root, project = dflash_pair
    published = root / ("nested" if nested else "legacy")
    published.mkdir(exist_ok=True)
    shutil.copy(root / "dspark" / "model.safetensors", published / "model.safetensors")
    (published / "config.json").write_text(json.dumps(published_layout(project, nested), indent=2))
    assert detect_method(published) == "dflash"
    ours, theirs = load_provider(root / "dspark"), load_provider(published)
    assert isinstance(theirs, DFlashProvider) and theirs.config == ours.config
    assert theirs.namespace == "dflash-context-v1:" + model_identity(published, config_name="config.json")
    assert theirs.namespace != ours.namespace
    drafts = [opened(p, tiny.target, PROMPTS).draft([p[-1] for p in PROMPTS], 3) for p in (ours, theirs)]
    assert drafts[0] == drafts[1]
    assert_greedy_and_restored_equals_cold(tiny.target, theirs)


@pytest.mark.parametrize(("change", "message"), [
    ({"conv_kernel_size": 4}, "conv_kernel_size"),
    ({"layer_types": ["sliding_attention"]}, "sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type"),
    ({"dflash_config": {"mask_token_id": 0}}, "target_layer_ids"),
])
def test_published_dflash_config_it_cannot_run_is_refused(dflash_pair, tmp_path, change, message):
    root, project = dflash_pair
    shutil.copy(root / "dspark" / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({**published_layout(project), **change}))
    assert detect_method(tmp_path) == "dflash"
    with pytest.raises(ValueError, match=message):
        load_provider(tmp_path)


def test_dspark_json_wins_over_a_published_config(dflash_pair, tmp_path):
    root, project = dflash_pair
    shutil.copytree(root / "dspark", tmp_path / "both")
    (tmp_path / "both" / "config.json").write_text(json.dumps(published_layout(project)))
    assert load_provider(tmp_path / "both").namespace == load_provider(root / "dspark").namespace


@pytest.mark.parametrize("window", [2, 3])
def test_published_sliding_window_layers_attend_as_z_lab_does(tiny, dflash_pair, tmp_path, window):
    """A sliding layer (window W) lets block position i see the positions within W of it: the last W - 1 - i
    context positions and the block causally: each draft equals a causal forward over exactly those."""
    root, project = dflash_pair
    shutil.copy(root / "dspark" / "model.safetensors", tmp_path / "model.safetensors")
    layers = project["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps(
        {**published_layout(project), "layer_types": ["sliding_attention"] * layers, "sliding_window": window}))
    sliding = load_provider(tmp_path)
    assert sliding.config.layer_window(0) == window and sliding.config.layer_causal(0, False)
    causal = load_provider(root / "dspark").network
    causal.config = ProjectedConfig.from_dict({**project, "is_causal": True}, "dflash", block=True)
    assert layers == 1  # one layer: output i depends only on block 0..i and what i attends to
    prompt = PROMPTS[2]
    drafts = opened(sliding, tiny.target, [prompt]).draft([prompt[-1]], 3)[0]
    out = tiny.target.forward(mx.array([prompt[:-1]]), tiny.target.make_caches(),
                              tap_layers=sliding.config.target_layer_ids)
    taps = mx.concatenate([out.taps[t] for t in sliding.config.target_layer_ids], axis=-1)
    (keys, values), = causal.context_kv(taps, mx.array([0]))
    expected = []
    ids = [prompt[-1]] + [project["mask_token_id"]] * 3
    for i in range(1, 4):
        seen, first = max(window - 1 - i, 0), max(i - window + 1, 0)
        context = ContextKV(keys[:, :, -seen:], values[:, :, -seen:], mx.ones((1, seen), dtype=mx.bool_)) \
            if seen else ContextKV(None, None, None)
        block = tiny.target.embed(mx.array([ids[first: i + 1]]))
        hidden, _ = causal(block, mx.array([len(prompt) - 1 + first]), [context], causal=True)
        expected.append(mx.argmax(tiny.target.logits(hidden[:, -1]), axis=-1).item())
    assert drafts == expected
    full = opened(load_provider(root / "dspark"), tiny.target, [prompt]).draft([prompt[-1]], 3)[0]
    assert drafts != full  # the window changes what the drafter sees
    assert_greedy_and_restored_equals_cold(tiny.target, sliding)


def test_published_revisions_map_onto_the_drafter_config():
    """Both published layouts of a 5-tap Qwen3-style DFlash drafter (geometry of z-lab's 4B drafters): the
    legacy one (top-level block_size, rope_theta) and the later one (dflash_config.block_size, rope_parameters,
    mostly sliding layers) give the same drafter config but for the layers' windows."""
    from spec_cache.drafters.dflash_config import is_published_dflash, published_to_projected

    geometry = {"model_type": "qwen3", "architectures": ["DFlashDraftModel"], "hidden_size": 2560,
                "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "intermediate_size": 9728, "vocab_size": 151936, "rms_norm_eps": 1e-6, "num_target_layers": 36,
                "tie_word_embeddings": True, "max_position_embeddings": 40960}
    legacy = {**geometry, "block_size": 16, "rope_theta": 1e6,
              "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}
    later = {**geometry, "sliding_window": 2048, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
             "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
             "dflash_config": {"block_size": 16, "mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}
    configs = [ProjectedConfig.from_dict(published_to_projected(c), "dflash", block=True) for c in (legacy, later)]
    assert all(is_published_dflash(c) for c in (legacy, later))
    assert (configs[0].gamma, configs[0].mask_token_id, configs[0].target_layer_ids, configs[0].rope_theta,
            configs[0].qk_norm) == (16, 151669, (1, 9, 17, 25, 33), 1e6, True)
    assert [configs[1].layer_window(i) for i in range(6)] == [2048] * 5 + [None]
    assert configs[1].layer_causal(0, False) and not configs[1].layer_causal(5, False)
    assert configs[0] == ProjectedConfig.from_dict(
        {**configs[1].to_dict(), "layer_types": None, "sliding_window": None}, "dflash", block=True)
    assert not is_published_dflash({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]})
