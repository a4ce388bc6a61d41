"""``Generator``: batched speculative decoding that resumes from stored prefixes.

Per row: look up the longest usable prefix of ``prompt[:-1]`` under (target identity, prefix namespace of the
drafter + adapters + captured KV options); restore the target state and this drafter's row (or a cold drafter
row when only the target part is stored); prefill the rest; decode; and write checkpoints back at the prompt
boundary and when the row finishes, so the next turn of the conversation resumes.

Under KV quantization a stored state is usable only if a cold run of *this* prompt would hold the same thing
(``spec_cache.rows.kv_quant.reusable``): full precision up to the prompt's conversion point, or converted at exactly
that point. A quantized checkpoint records its conversion point as the entry's minimum reusable offset; the
lookup passes that rule down (``usable_rule``) so every tier returns only a prefix this request can use.

Adapters (LoRA, through mlx-lm) enter the namespace as ``id@<blake3 of adapter config and weights>`` joined
with ``+``. A drafter that is not valid under a target adapter (``supports_target_adapters`` false) still
drafts, but only the target part is cached: such drafters (and a generator without one) share that namespace,
and each restores the target part the others stored (its own row opens cold beside it).

Target-only lookups across drafters (issue 38): the target part of a checkpoint depends on the target, the adapters
and the KV options, never on the drafter. So when this generator's own namespace holds no prefix as long as one
stored under another prefix namespace of the same target-only namespace (``naming.namespace.target_namespace``:
another drafter of this target, none, ngram, ...), that prefix's target part is restored and the drafter row opens
cold beside it (``SpecCache.restore(target_only=...)``). Its checkpoints go under this generator's own namespace,
so the next turn of the conversation finds them there.
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

from spec_cache.decode.cached_session import CachedSession, PreparedRow  # PreparedRow re-exported
from spec_cache.errors import InvalidRequest, ModelLoadError
from spec_cache.naming.identity import ModelDirError, model_identity
from spec_cache.naming.namespace import (
    KVOptions,
    cached_drafter_namespace,
    check_runnable,
    resolve_prefix_namespace,
    resolve_target_namespace,
)
from spec_cache.rows.generation import Result, check_prompts  # re-exported (spec_cache.Result)
from spec_cache.rows.kv_quant import converted_at, reusable
from spec_cache.tiers.cache import CacheWarning, SpecCache
from spec_cache.tiers.namespaces import MAX_NAMESPACES


class Generator:
    """A loaded target (+ optional drafter) bound to a cache, adapters and captured KV options."""

    def __init__(self, engine, *, cache: SpecCache | None, target_identity: str, drafter_namespace: str | None,
                 prefix_ns: str, ns_key: bytes | None, eos_token_ids: Sequence[int] = (), adapters: tuple = (),
                 target_dir: str | Path | None = None, target_ns: str | None = None,
                 tenant: str | bytes | None = None):
        self.engine = engine
        self.target_dir = None if target_dir is None else Path(target_dir)
        self._tokenizer = None
        self.cache = cache
        self.target_identity = target_identity
        self.drafter_namespace = drafter_namespace
        self.prefix_namespace = prefix_ns
        self.ns_key = ns_key
        #: the target-only namespace (``naming.namespace.target_namespace``); None: no lookups across drafters
        self.target_namespace = target_ns
        #: namespace key -> the tenant it was made for (``namespace_key``): a target-only lookup reads the other
        #: members of the target-only namespace under the same tenant only
        self._tenants: dict[bytes, str | bytes | None] = {} if ns_key is None else {ns_key: tenant}
        self._tenants_lock = threading.Lock()
        self.eos_token_ids = tuple(eos_token_ids)
        self.adapters = adapters
        #: write checkpoints to LMDB behind the request (the memory tier holds them meanwhile); False: before
        #: ``generate`` returns
        self.write_behind = True

    @classmethod
    def load(cls, target_dir, drafter_dir=None, method: str | None = None, cache: SpecCache | None = None,
             kv: KVOptions = KVOptions(), adapters: Any = "", draft_depth: int = 4,
             tenant: str | bytes | None = None, prefill_step_size: int = 512, adaptive: bool = True) -> "Generator":
        """Load a target directory (mlx-lm: config.json + safetensors) and a drafter (directory or ``ngram``).

        ``drafter_dir``: a drafter directory, None (no drafter), or the string ``"ngram"`` (prompt lookup, no
        directory; same as ``method="ngram"``) unless a directory of that name exists.

        ``adapters``: ``""`` for the base model, or mlx-lm LoRA adapter directories (one, or a sequence of
        directories / ``(id, directory)`` pairs, applied in order; see ``spec_cache.rows.adapters``).
        ``prefill_step_size`` is the engine's prefill chunk; with KV quantization it also fixes where rows
        convert, as ``generate_step``'s does. ``adaptive``: draft only as deep as measured acceptance and costs pay
        (``draft_depth`` is the most; False: always ``draft_depth``; see ``spec_cache.decode.depth``).
        Refused options (``turbo_quant``, an unsupported ``kv_config``)
        raise before anything is registered in the cache.
        """
        from spec_cache.decode.engine import SpeculativeEngine
        from spec_cache.drafters import open_provider
        from spec_cache.rows.adapters import resolve_adapters
        from spec_cache.rows.target import TargetModel

        options = check_runnable(kv)
        if isinstance(drafter_dir, str) and drafter_dir == "ngram" and not Path(drafter_dir).is_dir():
            if method not in (None, "ngram"):
                raise InvalidRequest(f"drafter 'ngram' with method {method!r}: 'ngram' names the n-gram drafter, "
                                     "which takes no directory")
            drafter_dir, method = None, "ngram"
        target_dir = Path(target_dir)
        _check_model_dir(target_dir, "target")
        if drafter_dir is not None and Path(drafter_dir).is_dir():  # some providers take other paths: theirs to check
            _check_model_dir(Path(drafter_dir), "drafter")
        memo = cache.memo() if cache is not None else None
        stack = resolve_adapters(adapters, memo)
        target = TargetModel.load(target_dir, adapters=stack)
        identity = model_identity(target_dir, memo=memo)
        try:
            provider = open_provider(drafter_dir, method)
        except FileNotFoundError as exc:  # a drafter path its provider could not find: the documented error, named
            raise ModelDirError(f"drafter {drafter_dir}: {exc.filename or exc} does not exist") from None
        except KeyError as exc:  # a config without a key this method reads: the wrong kind of drafter
            kind = f"a {method!r}" if method else "a recognisable"
            raise ModelLoadError(f"drafter directory {drafter_dir} is not {kind} drafter: its config has no "
                                 f"{exc.args[0]!r} (check the method)") from None
        drafter_ns = cached_drafter_namespace(provider, stack)
        prefix_ns = resolve_prefix_namespace(provider, stack, options)
        target_ns = resolve_target_namespace(stack, options)
        engine = SpeculativeEngine(target, provider, draft_depth=draft_depth, kv=options,
                                   prefill_step_size=prefill_step_size, adaptive=adaptive)  # refuses bad options
        ns_key = cache.namespace(identity, prefix_ns, tenant, keep=True) if cache is not None else None
        eos = _eos_ids(target_dir)
        return cls(engine, cache=cache, target_identity=identity, drafter_namespace=drafter_ns, prefix_ns=prefix_ns,
                   ns_key=ns_key, eos_token_ids=eos, adapters=stack, target_dir=target_dir, target_ns=target_ns,
                   tenant=tenant)

    # -- text: the target's tokenizer ----------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The target directory's tokenizer (mlx-lm's ``TokenizerWrapper``), loaded on first use: ``encode`` /
        ``decode`` / ``apply_chat_template``. ``ValueError`` when the directory has no tokenizer files."""
        if self._tokenizer is None:
            if self.target_dir is None:
                raise InvalidRequest("this generator was built without its target directory: no tokenizer")
            from mlx_lm.utils import load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.target_dir)
            except Exception as exc:
                raise ModelLoadError(f"cannot load a tokenizer from {self.target_dir} ({type(exc).__name__}); "
                                     "pass token ids instead") from None
        return self._tokenizer

    def encode(self, text: str, *, chat: bool = True) -> list[int]:
        """``text`` as prompt token ids: as one user message through the model's chat template when it has one
        and ``chat`` (what ``mlx_lm.generate`` does by default), else the plain encoding."""
        return encode_prompt(self.tokenizer, text, chat=chat)

    def decode(self, tokens: Sequence[int]) -> str:
        """Generated ``tokens`` as text: an end-of-sequence id and other special tokens are not shown."""
        eos = set(self.eos_token_ids) | set(getattr(self.tokenizer, "eos_token_ids", None) or ())
        ids = [int(t) for t in tokens]
        while ids and ids[-1] in eos:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate_text(self, prompts: Sequence[str], max_tokens: int = 32, *, chat: bool = True,
                      **options) -> list[str]:
        """Text in, text out: ``encode`` each prompt, ``generate`` (``options``: temperature, seed, top_p), and
        ``decode`` each result."""
        if isinstance(prompts, str):
            raise InvalidRequest("generate_text takes a list of prompts: wrap one prompt as [text]")
        results = self.generate([self.encode(p, chat=chat) for p in prompts], max_tokens=max_tokens, **options)
        return [self.decode(r.tokens) for r in results]

    # -- seams for servers and other schedulers ------------------------------------------------------------
    def namespace_key(self, tenant: str | bytes | None = None) -> bytes | None:
        """The store key of this generator's namespace for ``tenant`` (None: the key ``load`` was given); None
        without a cache. Prefixes never cross keys: a server maps each API key / cache salt to a tenant."""
        if self.cache is None:
            return None
        if tenant is None:
            return self.ns_key
        key = self.cache.namespace(self.target_identity, self.prefix_namespace, tenant)
        if key not in self._tenants:
            with self._tenants_lock:  # one key per cache_salt seen: bounded, oldest out (issue 37, sixth pass)
                while len(self._tenants) >= MAX_NAMESPACES:
                    del self._tenants[next(k for k in self._tenants if k != self.ns_key)]
                self._tenants[key] = tenant
        return key

    def target_members(self, ns_key: bytes | None = None) -> list[bytes]:
        """The other namespace keys whose target part a request under ``ns_key`` (default this generator's) may
        restore (``SpecCache.target_members``, same tenant); ``[]`` without a cache, a target-only namespace, or
        for a key this generator did not make."""
        key = self.ns_key if ns_key is None else ns_key
        if self.cache is None or self.target_namespace is None or key not in self._tenants:
            return []
        members = self.cache.target_members(self.target_identity, self.target_namespace, self._tenants[key])
        return [member for member in members if member != key]

    def prepare(self, prompt: Sequence[int], max_tokens: int = 32, *, sampling: Any = None,
                ns_key: bytes | None = None, lookup: bool = True, limit: int | None = None) -> PreparedRow:
        """Look up the longest usable stored prefix of ``prompt[:-1]`` (under ``ns_key``, default this
        generator's) and build the engine request for ``prompt``: restored when the cache had one, cold
        otherwise (always cold with ``lookup=False``). ``sampling``: a ``spec_cache.rows.sampling.RowSampling``
        (None: the run's). ``limit``: restore at most this many tokens (None: no limit; below 1: cold), e.g. only
        as far as a caller already knows the prompt's logprobs."""
        from spec_cache.decode.engine import RowRequest

        prompt = [int(t) for t in prompt]
        key = self.ns_key if ns_key is None else ns_key
        hit = self.restore_for_prompt(prompt, ns_key=key, limit=limit) if lookup else None
        if hit is None:
            return PreparedRow(RowRequest(prompt=prompt, max_tokens=max_tokens, sampling=sampling), key)
        request = RowRequest(prompt=prompt, restored_caches=hit.caches, restored_tokens=hit.length,
                             draft_checkpoint=hit.draft_checkpoint, max_tokens=max_tokens, sampling=sampling)
        with_drafter = hit.draft_checkpoint is not None
        return PreparedRow(request, key, hit.length, with_drafter,
                           (hit.length, with_drafter or not self.drafter_namespace), getattr(hit, "tier", None))

    def restore_for_prompt(self, prompt: Sequence[int], *, ns_key: bytes | None = None, limit: int | None = None):
        """The longest stored prefix of ``prompt[:-1]`` this request may continue from (a
        ``cache.RestoredPrefix``), or None; ``ns_key`` defaults to this generator's; ``limit``: at most this many
        tokens (``prepare``)."""
        return self._restore([int(t) for t in prompt], self.ns_key if ns_key is None else ns_key, limit)

    def save_checkpoint(self, tokens: Sequence[int], caches: Sequence[Any], draft_checkpoint=None, *,
                        ns_key: bytes | None = None, background: bool | None = None, then=None,
                        rider=None) -> None:
        """Store an engine checkpoint (``on_checkpoint``'s ``tokens, target_caches, draft_checkpoint``) under
        ``ns_key`` (default this generator's): the memory tier at once, LMDB behind the request when
        ``background`` (default ``write_behind``). No cache: nothing. Failures are ``CacheWarning``s."""
        if self.cache is None or len(tokens) == 0:
            return  # no cache; or the boundary of a 1-token prompt (an empty prefix: nothing to resume from)
        self.cache.save(self.ns_key if ns_key is None else ns_key, list(tokens), caches,
                        drafter_namespace=self.drafter_namespace,
                        draft_checkpoint=draft_checkpoint if self.drafter_namespace else None,
                        minimum_reusable=converted_at(caches) or 0,
                        background=self.write_behind if background is None else background, then=then,
                        rider=rider)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int = 32, temperature: float = 0.0,
                 seed: int = 0, top_p: float = 1.0, *, checkpoint_every: int | None = None,
                 resume: bool = False, top_k: int = 0, min_p: float = 0.0, **processors: Any) -> list[Result]:
        """Decode every prompt (one batch); rows resume from the cache where they can.

        ``prompts`` is a list of prompts, each a non-empty list of token ids (ints in ``[0, vocab_size)``);
        anything else raises ``ValueError`` naming the prompt and position before any lookup. ``temperature``
        0 is greedy; ``top_p`` < 1 samples from the nucleus, ``min_p`` / ``top_k`` filter further
        (``spec_cache.rows.sampling.RowSampling``); ``seed`` makes sampled rows reproducible (a row's tokens depend
        only on its own prompt, parameters and seed). ``processors``: mlx-lm's logits processors, greedy rows
        included, by ``RowSampling``'s names (``logit_bias={id: value}``, ``repetition_penalty``,
        ``repetition_context_size``, ``presence_penalty``, ``frequency_penalty`` and their ``*_context_size``): the
        tokens equal ``generate_step``'s with ``make_logits_processors`` of the same values.

        ``checkpoint_every=N`` checkpoints each row every N generated tokens with a continuation record, and
        ``resume=True`` continues a row from the record an earlier identical call left (killed part-way, or
        finished): see ``spec_cache.tiers.continuations`` (results then carry ``resumed``, the tokens replayed)."""
        if resume or checkpoint_every is not None:
            from spec_cache.tiers.continuations import generate

            return generate(self, prompts, max_tokens, temperature=temperature, seed=seed, top_p=top_p,
                            checkpoint_every=checkpoint_every, resume=resume, top_k=top_k, min_p=min_p,
                            **processors)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise InvalidRequest("max_tokens must be a positive int")
        rows = check_prompts(prompts, self.engine.target.vocab_size)
        from spec_cache.rows.sampling import RowSampling, Sampling

        sampling = None
        if top_p != 1.0 or top_k or min_p or processors:
            # raises on values out of range (and TypeError on a name RowSampling does not have)
            sampling = RowSampling(temperature, top_p, seed, top_k, min_p, **processors)
        started = time.perf_counter()  # TTFT counts the lookups and restores too, not only the engine
        run = Sampling(temperature, seed)
        default = None if run.greedy else RowSampling(temperature, 1.0, seed)  # rows without their own sampling
        session = self.session(draft_sampling=run, default_sampling=default)
        try:
            handles = [session.prepare(prompt, max_tokens, sampling) for prompt in rows]
            engine_started = time.perf_counter()
            for handle in handles:
                session.admit(handle, submitted_at=engine_started)
            session.run()
        finally:
            session.close()  # then its checkpoints: memory tier now, LMDB behind the request (off the TTFT path)
        before_engine = engine_started - started
        return [Result(h.result.tokens, h.result.cached_tokens, h.result.drafted, h.result.accepted,
                       before_engine + h.result.ttft_s, len(prompt), h.restored_drafter)
                for h, prompt in zip(handles, rows)]

    def session(self, **options: Any) -> CachedSession:
        """A ``CachedSession`` on this generator (``spec_cache.decode.cached_session``): rows that restore from its
        cache, decode in one engine session and checkpoint back. ``options``: ``CachedSession``'s."""
        return CachedSession(self, **options)

    def _restore(self, prompt: list[int], ns_key: bytes | None = None, limit: int | None = None):
        """The longest stored prefix of ``prompt[:-1]`` (of ``prompt[:limit]`` when ``limit`` is shorter) this
        request may continue from, or None: one call down to the cache with this request's usability rule
        (``usable_rule``, for the whole prompt), one result up."""
        end = len(prompt) - 1 if limit is None else min(int(limit), len(prompt) - 1)
        if self.cache is None or end < 1:
            return None
        usable = self.usable_rule(len(prompt))
        if usable is None:
            return None
        key = self.ns_key if ns_key is None else ns_key
        restored = self.cache.restore(key, prompt[:end], drafter_namespace=self.drafter_namespace,
                                      usable=usable, next_token=prompt[end],  # a stored whole prompt serves too
                                      target_only=self.target_members(key))  # other drafters' target parts
        if restored is None:
            return None
        conversion = self.engine.conversion_point(len(prompt))
        if conversion is not None:  # the stored point was checked by the rule; the restored caches must agree
            try:
                point = converted_at(restored.caches)
            except ValueError as exc:
                point, why = None, str(exc)
            else:
                why = None if reusable(restored.length, point, conversion) else (
                    f"it was converted at {point}, this request converts at {conversion}")
            if why is not None:
                warnings.warn(f"spec-cache: restored state is unusable, treated as a miss: {why}", CacheWarning,
                              stacklevel=3)
                return None
        return restored

    def usable_rule(self, prompt_tokens: int):
        """The rule a stored prefix must meet for a prompt of ``prompt_tokens`` (a predicate over candidates with
        ``length``, ``has_drafter``, ``minimum_reusable``; callers also accept None: nothing stored can help).

        Under KV quantization only prefixes a cold run of this prompt would hold count (full precision up to its
        conversion point, or converted exactly there). A prefix without this drafter's row (a target-only hit)
        is usable with every drafter: the engine opens the drafter row cold beside the restored target (see
        ``engine.DecodeSession._admit``); among prefixes of one length, the store offers one with the row first.
        """
        conversion = self.engine.conversion_point(prompt_tokens)

        def usable(candidate) -> bool:
            return conversion is None or reusable(candidate.length, candidate.minimum_reusable or None, conversion)
        return usable


def has_chat_template(tokenizer) -> bool:
    """Whether ``tokenizer`` (mlx-lm wrapper or Hugging Face tokenizer) carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None) or getattr(tokenizer, "has_chat_template", False))


def encode_prompt(tokenizer, text: str, *, chat: bool = True, system: str | None = None) -> list[int]:
    """``text`` as token ids: one user message (after a ``system`` message when given, as mlx_lm.generate's
    ``--system-prompt``) through the chat template when ``chat`` and the tokenizer has one, else
    ``tokenizer.encode(text)``."""
    if chat and has_chat_template(tokenizer):
        messages = [{"role": "system", "content": system}] if system is not None else []
        ids = tokenizer.apply_chat_template(messages + [{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer.encode(text)]


def _check_model_dir(path: Path, what: str) -> None:
    """A missing directory or an unreadable ``config.json`` named by its path (mlx-lm's errors do not name it), as
    the documented ``ModelLoadError`` (``ModelDirError``), not the bare ``FileNotFoundError`` the loaders raise."""
    import json

    if not path.is_dir():
        raise ModelDirError(f"{what} directory {path} {'is not a directory' if path.exists() else 'does not exist'}")
    config = path / "config.json"
    if not config.is_file():
        if what == "target":  # an mlx-lm model always has one
            raise ModelDirError(f"{what} directory {path} has no config.json")
        return  # dspark.json drafters, ngram: their loaders say what is missing
    try:
        value = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"cannot read {config}: {exc}") from None
    except ValueError as exc:
        raise ModelLoadError(f"{config} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{config} is not a JSON object")


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
