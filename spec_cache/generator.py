"""``Generator``: batched speculative decoding that resumes from stored prefixes.

Per row: look up the longest usable prefix of ``prompt[:-1]`` under (target identity, prefix namespace of the
drafter + adapters + captured KV options); restore the target state and this drafter's row (or a cold drafter
row when only the target part is stored); prefill the rest; decode; and write checkpoints back at the prompt
boundary and when the row finishes, so the next turn of the conversation resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .cache import SpecCache
from .identity import model_identity
from .namespace import KVOptions, capture_options, prefix_namespace


@dataclass
class Result:
    """One row's outcome. ``cached_tokens``: prompt tokens restored instead of prefilled."""

    tokens: list[int]
    cached_tokens: int
    drafted: int
    accepted: int
    ttft_s: float
    prompt_tokens: int = 0
    restored_drafter: bool = False


class Generator:
    """A loaded target (+ optional drafter) bound to a cache and captured KV options."""

    def __init__(self, engine, *, cache: SpecCache | None, target_identity: str, drafter_namespace: str | None,
                 prefix_ns: str, ns_key: bytes | None, eos_token_ids: Sequence[int] = ()):
        self.engine = engine
        self.cache = cache
        self.target_identity = target_identity
        self.drafter_namespace = drafter_namespace
        self.prefix_namespace = prefix_ns
        self.ns_key = ns_key
        self.eos_token_ids = tuple(eos_token_ids)

    @classmethod
    def load(cls, target_dir, drafter_dir=None, method: str | None = None, cache: SpecCache | None = None,
             kv: KVOptions = KVOptions(), adapters: str | Sequence[str] = "", draft_depth: int = 4,
             tenant: str | bytes | None = None) -> "Generator":
        """Load a target directory (mlx-lm: config.json + safetensors) and a drafter (directory or ``ngram``)."""
        from .drafters import load_provider
        from .engine import SpeculativeEngine
        from .target import TargetModel

        options = capture_options(kv)
        target_dir = Path(target_dir)
        target = TargetModel.load(target_dir)
        memo = cache.store.memo() if cache is not None else None
        identity = model_identity(target_dir, memo=memo)
        provider = None
        if drafter_dir is not None:
            provider = load_provider(drafter_dir, method)
        elif method == "ngram":
            from .drafters.ngram import NgramProvider

            provider = NgramProvider()
        elif method is not None:
            raise ValueError(f"method {method!r} needs a drafter directory")
        drafter_ns = getattr(provider, "namespace", None)
        if provider is not None and adapters and not getattr(provider, "supports_target_adapters", False):
            drafter_ns = None  # the drafter is not valid under a target adapter: cache the target part only
        prefix_ns = prefix_namespace(drafter_ns, adapters, options)
        engine = SpeculativeEngine(target, provider, draft_depth=draft_depth, kv=options)  # refuses bad options
        ns_key = cache.namespace(identity, prefix_ns, tenant) if cache is not None else None
        eos = _eos_ids(target_dir)
        return cls(engine, cache=cache, target_identity=identity, drafter_namespace=drafter_ns, prefix_ns=prefix_ns,
                   ns_key=ns_key, eos_token_ids=eos)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 32, temperature: float = 0.0,
                 seed: int = 0) -> list[Result]:
        """Decode every prompt (one batch); rows resume from the cache where they can."""
        from .engine import RowRequest

        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError("max_tokens must be a positive int")
        rows = []
        for i, prompt in enumerate(prompts):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            rows.append(prompt)
        requests, restored_flags = [], []
        for prompt in rows:
            hit = None
            if self.cache is not None and len(prompt) > 1:
                hit = self.cache.restore(self.ns_key, prompt[:-1], drafter_namespace=self.drafter_namespace)
            if hit is None:
                requests.append(RowRequest(prompt=prompt, max_tokens=max_tokens))
                restored_flags.append(False)
            else:
                requests.append(RowRequest(prompt=prompt, restored_caches=hit.caches, restored_tokens=hit.length,
                                           draft_checkpoint=hit.draft_checkpoint, max_tokens=max_tokens))
                restored_flags.append(hit.draft_checkpoint is not None)

        def on_checkpoint(row, tokens, caches, draft_checkpoint):
            if self.cache is None:
                return
            self.cache.save(self.ns_key, tokens, caches,
                            drafter_namespace=self.drafter_namespace,
                            draft_checkpoint=draft_checkpoint if self.drafter_namespace else None)

        out = self.engine.run(requests, temperature=temperature, seed=seed, eos_token_ids=self.eos_token_ids,
                              on_checkpoint=on_checkpoint)
        if self.cache is not None:
            self.cache.store.flush()
        return [Result(r.tokens, r.cached_tokens, r.drafted, r.accepted, r.ttft_s, len(p), flag)
                for r, p, flag in zip(out, rows, restored_flags)]


def _eos_ids(target_dir: Path) -> tuple[int, ...]:
    import json

    try:
        config = json.loads((target_dir / "config.json").read_text())
    except (OSError, ValueError):
        return ()
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
