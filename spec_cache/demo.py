"""``spec-cache demo``: the README's main job.

Until the MLX runtime lands this demo exercises the storage half end to end on local files: it writes a tiny
model directory (config.json + random safetensors weights), computes its artifact identity, builds the prefix
namespace for an n-gram drafter, stores the per-layer KV state of a few multi-turn conversations (shared
system prompt, growing turns) and looks every follow-up turn up again, then prints what the store holds.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 64


def _write_tiny_model(path: str, seed: int = 0) -> None:
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    config = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": 256,
              "vocab_size": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({"model.embed_tokens.weight": rng.standard_normal((512, 128), dtype=np.float32)},
              os.path.join(path, "model.safetensors"))


def _kv_state(tokens: list[int]):
    """Deterministic per-token K/V rows (a stand-in for a forward pass: same tokens -> same bytes)."""
    from store import LayerState, Tensor

    t = np.asarray(tokens, dtype=np.float32)[None, None, :, None]
    layers = []
    for layer in range(LAYERS):
        base = np.arange(KV_HEADS * HEAD_DIM, dtype=np.float32).reshape(1, KV_HEADS, 1, HEAD_DIM)
        k = np.sin(t * 0.01 + base * 0.001 + layer).astype(np.float32)
        v = np.cos(t * 0.02 + base * 0.002 + layer).astype(np.float32)
        layers.append(LayerState("kv", {}, [Tensor.from_numpy(k), Tensor.from_numpy(v)], token_axis=2))
    return layers


def main(args) -> int:
    from schemas import CheckpointAttachment, NGRAM_HISTORY_V1
    from spec_cache.identity import model_identity
    from spec_cache.namespace import KVOptions, namespace_key, ngram_namespace, prefix_namespace
    from store import Store, maintenance

    work = tempfile.mkdtemp(prefix="spec-cache-demo-")
    cache_dir = args.cache if getattr(args, "cache_given", False) else os.path.join(work, "store")
    model_dir = os.path.join(work, "tiny-llama")
    _write_tiny_model(model_dir)
    target = model_identity(model_dir, memo=False)
    drafter_ns = ngram_namespace(3, 1)
    prefix_ns = prefix_namespace(drafter_ns, "", KVOptions())
    ns = namespace_key(target, prefix_ns)
    print(f"target identity   {target}")
    print(f"prefix namespace  {prefix_ns}")
    print(f"store             {cache_dir}\n")
    rng = np.random.default_rng(1)
    system = rng.integers(3, 512, 700).tolist()
    conversations = [system + rng.integers(3, 512, 40 + 30 * i).tolist() for i in range(3)]
    rows = []
    with Store.open(cache_dir) as store:
        store.register_namespace(ns, target=target, prefix_namespace=prefix_ns)
        for turn in range(3):
            for c, prompt in enumerate(conversations):
                t0 = time.perf_counter()
                hit = store.fetch(ns, prompt[:-1], drafter=drafter_ns)
                t_lookup = time.perf_counter() - t0
                answer = rng.integers(3, 512, 16).tolist()
                full = prompt + answer
                history = CheckpointAttachment(NGRAM_HISTORY_V1, {"max": 3, "min": 1},
                                               (np.asarray(prompt[:-1], dtype=np.int32),))
                store.put(ns, prompt[:-1], _kv_state(prompt[:-1]), drafter=(drafter_ns, history))
                rows.append([f"conv {c} turn {turn}", len(prompt), hit.length if hit else 0,
                             "target+drafter" if hit and hit.attachment else ("target" if hit else "miss"),
                             f"{t_lookup * 1e3:.2f}"])
                conversations[c] = full + rng.integers(3, 512, 20).tolist()
        from spec_cache.cli import human_bytes, table
        print(table(rows, ["REQUEST", "PROMPT", "CACHED", "PARTS", "FETCH MS"]))
        s = maintenance.stats(store)
        print(f"\nstore: {s['entries']} entries, {s['chunks']} shared chunks of {s['chunk_tokens']} tokens, "
              f"{human_bytes(s['bytes'])}; verify: {maintenance.verify(store).as_dict()['ok']} records ok")
    return 0
