"""Drafter bytes stored for conversations sharing a system prompt: whole drafter records vs shared pieces.

N conversations = one shared system prompt + a distinct user turn each, generated through the real runtime
(``Generator`` + ``SpecCache``, tiny local llama target, greedy) with a draft-model drafter and with a projected
(DeepSpec) drafter. Each run is done twice into fresh stores: once writing drafter records whole (the layout
before store format 1.2, ``pieces.WRITE_PIECES = False``) and once with shared pieces; the figure is the bytes
the drafter parts take (drafter records plus pieces) before / after, and the stores' total bytes the same way.
Restores are checked: every conversation run again on the pieced store restores its whole prompt and gives the
same tokens. Sharing rests on equal bytes only: prompt positions a drafter computed the same way in two
conversations are stored once; nothing is assumed about positions.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def _drafter_bytes(store) -> int:
    with store.reading() as txn:
        return sum(len(v) for _k, v in txn.cursor(db=store.env.dbs["drafts"]))


def _run_once(work: Path, method: str, prompts: list[list[int]], max_tokens: int, pieces: bool) -> dict:
    from spec_cache.decode.generator import Generator
    from spec_cache.store import maintenance
    from spec_cache.store import pieces as P
    from spec_cache.tiers.cache import SpecCache

    P.WRITE_PIECES = pieces
    try:
        path = work / f"store-{method}-{'pieces' if pieces else 'whole'}"
        cache = SpecCache.open(path)
        gen = Generator.load(work / "target", work / method, cache=cache)
        outputs = [gen.generate([p], max_tokens=max_tokens)[0].tokens for p in prompts]
        cache.drain(60.0)  # write-behind: every checkpoint on disk before counting
        store = cache.store
        drafter = _drafter_bytes(store)
        total = maintenance.stats(store)["bytes"]
        replay = [gen.generate([p], max_tokens=max_tokens)[0] for p in prompts] if pieces else []
        restored = [r.cached_tokens for r in replay]
        replay = [r.tokens for r in replay] if pieces else None
        cache.close()
    finally:
        P.WRITE_PIECES = True
    return {"drafter_bytes": drafter, "store_bytes": total, "outputs": outputs, "replay": replay,
            "restored": restored}


def run(conversations: int = 8, system: int = 1536, user: int = 64, max_tokens: int = 8, *, hidden: int = 256,
        layers: int = 4, vocab: int = 1024) -> dict:
    import numpy as np

    from spec_cache.testing.tiny import write_tiny_drafter, write_tiny_target

    work = Path(tempfile.mkdtemp(prefix="bench-dedup-drafters-"))
    old = os.environ.get("SPEC_CACHE_IDENTITY_DIR")
    os.environ["SPEC_CACHE_IDENTITY_DIR"] = str(work / "identity")
    try:
        target = write_tiny_target(work / "target", "llama", seed=0, tokenizer=False, hidden_size=hidden,
                                   num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=64,
                                   intermediate_size=2 * hidden, vocab_size=vocab)
        write_tiny_drafter(work / "draft-model", "draft-model", target, layers=2)
        write_tiny_drafter(work / "deepspec", "deepspec", target, layers=2)
        rng = np.random.default_rng(0)
        shared = rng.integers(3, vocab, system).tolist()
        prompts = [shared + rng.integers(3, vocab, user).tolist() for _ in range(conversations)]
        out: dict = {"conversations": conversations, "system_tokens": system, "user_tokens": user}
        for method in ("draft-model", "deepspec"):
            whole = _run_once(work, method, prompts, max_tokens, pieces=False)
            shared_run = _run_once(work, method, prompts, max_tokens, pieces=True)
            same = whole["outputs"] == shared_run["outputs"] == shared_run["replay"]
            key = method.replace("-", "_")
            out[key] = {"drafter_bytes_whole": whole["drafter_bytes"], "drafter_bytes_pieces":
                        shared_run["drafter_bytes"], "store_bytes_whole": whole["store_bytes"],
                        "store_bytes_pieces": shared_run["store_bytes"], "outputs_identical": same,
                        "drafter_ratio": whole["drafter_bytes"] / max(1, shared_run["drafter_bytes"]),
                        "store_ratio": whole["store_bytes"] / max(1, shared_run["store_bytes"]),
                        "replay_cached_tokens": shared_run["restored"]}
            if not same:
                raise AssertionError(f"{method}: outputs differ between whole and pieced drafter records")
        out["dedup_drafter_bytes_ratio"] = out["draft_model"]["drafter_ratio"]
        out["dedup_projected_drafter_bytes_ratio"] = out["deepspec"]["drafter_ratio"]
        return out
    finally:
        if old is None:
            os.environ.pop("SPEC_CACHE_IDENTITY_DIR", None)
        else:
            os.environ["SPEC_CACHE_IDENTITY_DIR"] = old
        shutil.rmtree(work, ignore_errors=True)
