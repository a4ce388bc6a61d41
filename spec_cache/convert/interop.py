"""mlx-lm interop: stored prefixes to and from mlx-lm prompt-cache files.

``export_mlx_lm`` writes what ``mlx_lm.generate --prompt-cache-file`` reads (``save_prompt_cache``: one
safetensors file of cache states, metadata ``model`` and ``tokenizer_config``), plus the covered token ids and the
target identity under ``spec_cache_*`` metadata keys. ``import_mlx_lm`` reads such a file into the store. mlx-lm
files carry no token ids, so the caller gives them; the cache must cover exactly that many tokens and fit the
model (layer count, KV geometry), and a file written by spec-cache must name the same target identity.

The namespace an import stores under is the one ``Generator.load`` would look up for the same drafter, adapters
and KV options: :func:`import_prefix_namespace` goes through ``spec_cache.naming.namespace.resolve_prefix_namespace``,
as ``Generator.load`` does.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from spec_cache.naming.identity import model_identity
from spec_cache.naming.namespace import KVOptions, check_runnable, resolve_prefix_namespace
from spec_cache.store import InvalidInput
from spec_cache.tiers.cache import SpecCache
from spec_cache.tiers.cache_controls import BadPrefixFile, NotStored, check_fits, token_ids


class InteropError(ValueError):
    """The file, tokens or model do not fit together; nothing was written."""


def read_tokens(path: str | Path) -> list[int]:
    """Token ids from a file: a JSON list, or integers separated by commas or whitespace."""
    text = Path(path).read_text().strip()
    try:
        tokens = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except (ValueError, RecursionError):
        raise InteropError(f"{path}: not a list of token ids (JSON list, or integers separated by commas/spaces)") \
            from None
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
        raise InteropError(f"{path}: token ids must be a non-empty list of non-negative 32-bit integers")
    return tokens


def export_mlx_lm(cache: SpecCache, ns_key: bytes, tokens: Sequence[int], out_path: str | Path, *,
                  model: str | None = None, exact: bool = False, granularity: int = 1) -> int:
    """Write the longest stored prefix of ``tokens`` in namespace ``ns_key`` as an mlx-lm prompt-cache file.

    Returns the number of tokens the file covers (``exact=True``: all of them, else ``InteropError``).
    ``model`` goes into the file's ``model`` metadata, which ``mlx_lm.generate`` compares with its ``--model``.
    ``granularity``: the file covers a multiple of it (the prefix cut down; none that long: ``InteropError``), so
    a server reporting ``cached_tokens`` rounded down to it tells no more through an export (the file's shapes
    would give the exact length back).
    """
    from mlx_lm.models.cache import can_trim_prompt_cache, save_prompt_cache, trim_prompt_cache

    info = _namespace_info(cache, ns_key)
    restored = cache.restore(ns_key, tokens)
    if restored is None:
        raise InteropError("no stored prefix of these tokens in this namespace")
    if exact and restored.length != len(tokens):
        raise InteropError(f"only {restored.length} of the {len(tokens)} tokens are stored")
    length = restored.length - restored.length % max(1, int(granularity))
    if length == 0:  # the same answer as nothing stored: shorter than one multiple is not told
        raise InteropError("no stored prefix of these tokens in this namespace")
    if length < restored.length:  # the restored caches are new objects over the tiers' arrays: trimmed in place
        if not can_trim_prompt_cache(restored.caches):
            raise InteropError(f"the stored prefix cannot be cut to a multiple of {granularity} tokens")
        trim_prompt_cache(restored.caches, restored.length - length)
        _drop_past_offset(restored.caches)
    covered = list(tokens[:length])
    metadata = {"model": model or f"spec-cache:{info.target}", "tokenizer_config": "{}",
                "spec_cache_tokens": json.dumps(covered, separators=(",", ":")),
                "spec_cache_target_identity": info.target, "spec_cache_prefix_namespace": info.prefix_namespace}
    out_path = str(out_path)
    if not out_path.endswith(".safetensors"):
        raise InteropError("the output file name must end in .safetensors (mlx-lm's prompt-cache format)")
    save_prompt_cache(out_path, restored.caches, metadata)
    return length


def _drop_past_offset(caches) -> None:
    """Cut trimmed caches' buffers to what they cover: ``save_prompt_cache`` writes a cache's whole buffer, and the
    rows past a trimmed offset are the K/V of the tokens the cut was meant to hide (and the file's size counts
    them)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

    for c in caches:
        if isinstance(c, (KVCache, QuantizedKVCache)) and c.keys is not None:
            end = int(c.offset)
            cut = (lambda a: tuple(x[..., :end, :] for x in a)) if isinstance(c.keys, tuple) else \
                (lambda a: a[..., :end, :])
            c.keys, c.values = cut(c.keys), cut(c.values)
        elif isinstance(c, RotatingKVCache) and c.keys is not None and c.offset < c.max_size:
            c.keys, c.values = c.keys[..., :c._idx, :], c.values[..., :c._idx, :]


def import_prefix_namespace(drafter_dir: str | Path | None = None, method: str | None = None, adapters: Any = "",
                            kv: KVOptions | Mapping[str, Any] = KVOptions(), memo: Any = None) -> str:
    """The prefix namespace ``Generator.load(target, drafter_dir, method, kv=kv, adapters=adapters)`` stores under,
    for :func:`import_mlx_lm`'s ``prefix_namespace``.

    ``drafter_dir``/``method`` as ``spec_cache.drafters.open_provider`` takes them (the drafter is loaded to learn
    its namespace); ``adapters`` as ``spec_cache.rows.adapters.resolve_adapters`` takes them (``""``/None: the base
    model); ``kv`` is checked with ``check_runnable`` (a namespace no generator can run is refused). ``memo``: an
    identity memo (``cache.store.memo()``), optional. Raises ValueError, TypeError or FileNotFoundError.
    """
    from spec_cache.drafters import open_provider
    from spec_cache.rows.adapters import resolve_adapters

    options = check_runnable(kv)
    stack = resolve_adapters(adapters, memo)
    provider = open_provider(drafter_dir, method)
    return resolve_prefix_namespace(provider, stack, options)


def recorded_tokens(file: str | Path) -> list[int] | None:
    """The token ids an mlx-lm prompt-cache file records (``spec_cache_tokens``, written by ``export_mlx_lm``), or
    None when it records none. Raises ``InteropError`` for a file mlx-lm cannot read."""
    from mlx_lm.models.cache import load_prompt_cache

    try:
        _caches, metadata = load_prompt_cache(str(file), return_metadata=True)
    except Exception as exc:  # mlx raises plain RuntimeError/ValueError for unreadable files
        raise InteropError(f"{file}: not an mlx-lm prompt-cache file ({_line(exc)})") from None
    except RecursionError:
        raise InteropError(f"{file}: not an mlx-lm prompt-cache file (its metadata nests too deeply)") from None
    return _recorded(metadata, file)


def _line(exc: BaseException) -> str:
    """An exception's message on one line (mlx's can span several)."""
    return " ".join(str(exc).split())[:200] or type(exc).__name__


def _recorded(metadata: Mapping[str, Any], file) -> list[int] | None:
    raw = metadata.get("spec_cache_tokens")
    if raw is None:
        return None
    try:  # a nested or huge list, floats, negative ids: one line (never a RecursionError)
        return token_ids(raw, None)
    except BadPrefixFile as exc:
        raise InteropError(f"{file}: unreadable spec_cache_tokens ({exc})") from None


def import_mlx_lm(cache: SpecCache, file: str | Path, model_dir: str | Path, tokens: Sequence[int] | None, *,
                  prefix_namespace: str, tenant: str | None = None) -> bytes:
    """Store an mlx-lm prompt-cache file as the checkpoint of ``tokens`` for the model in ``model_dir``.

    ``tokens`` None: the ones the file records (``spec_cache_tokens``, written by ``export_mlx_lm``); a file
    without them needs them given. Returns the namespace key it was stored under. Raises ``InteropError`` (nothing
    written) when the file does not cover exactly ``len(tokens)`` tokens, does not fit the model (every layer's
    kind, keys' and values' shapes, dtype, token length, a rotating layer's max_size/keep: the checks
    ``/v1/cache/import`` makes, ``prefix_files.check_fits``), names another target, or its token ids are not
    the model's. Why all before the put: a stored entry that does not fit fails every request that restores it.
    """
    from mlx_lm.models.cache import load_prompt_cache

    from spec_cache.rows.target import TargetModel

    try:
        caches, metadata = load_prompt_cache(str(file), return_metadata=True)
    except Exception as exc:  # mlx raises plain RuntimeError/ValueError for unreadable files
        raise InteropError(f"{file}: not an mlx-lm prompt-cache file ({_line(exc)})") from None
    except RecursionError:
        raise InteropError(f"{file}: not an mlx-lm prompt-cache file (its metadata nests too deeply)") from None
    identity = model_identity(model_dir, memo=cache.store.memo())
    named = metadata.get("spec_cache_target_identity")
    if named is not None and named != identity:
        raise InteropError(f"{file} was exported for target {str(named)[:16]}…, {model_dir} is {identity[:16]}…")
    recorded = _recorded(metadata, file)
    if tokens is None:
        if recorded is None:
            raise InteropError(f"{file} does not record its token ids (not written by spec-cache export-mlx-lm): "
                               "give them (--tokens)")
        tokens = recorded
    if recorded is not None and recorded != list(tokens):
        raise InteropError(f"{file} records other token ids than the ones given")
    target = TargetModel.load(Path(model_dir), lazy=True)
    if len(caches) != target.num_layers:
        raise InteropError(f"{file} holds {len(caches)} cache layers, {model_dir} has {target.num_layers}")
    for i, c in enumerate(caches):
        offset = getattr(c, "offset", None)
        if offset is not None and offset != len(tokens):
            raise InteropError(f"{file} layer {i} covers {offset} tokens, {len(tokens)} token ids were given")
    try:
        tokens = token_ids(list(tokens), target.vocab_size, "the token ids given")
        check_fits(target, caches, len(tokens), quantized=True)  # a quantized layer: checked for its shapes
    except BadPrefixFile as exc:
        raise InteropError(f"{file}: {exc}") from None
    ns_key = cache.namespace(identity, prefix_namespace, tenant)
    try:
        cache.store.put(ns_key, list(tokens), _layer_states(caches))
    except InvalidInput as exc:
        raise InteropError(str(exc)) from None
    return ns_key


def _layer_states(caches):
    from spec_cache.state.cache_state import capture_caches

    return capture_caches(caches)


def _namespace_info(cache: SpecCache, ns_key: bytes):
    info = cache.store.namespace_info(ns_key)
    if info is None:
        raise InteropError("unknown namespace")
    return info


def export_prefix(cache, ns_key: bytes, tokens: Sequence[int], *, model: str | None = None,
                  granularity: int = 1) -> tuple[bytes, int]:
    """The longest stored prefix of ``tokens`` (cut down to a multiple of ``granularity``) as the bytes of an
    mlx-lm prompt-cache file (``save_prompt_cache`` format, ``spec_cache_tokens`` metadata naming the tokens it
    covers) and the number of tokens it covers."""
    with tempfile.TemporaryDirectory(prefix="spec-cache-export-") as tmp:
        path = os.path.join(tmp, "prefix.safetensors")
        try:
            length = export_mlx_lm(cache, ns_key, [int(t) for t in tokens], path, model=model,
                                   granularity=granularity)
        except InteropError as exc:
            raise NotStored(str(exc)) from None
        with open(path, "rb") as f:
            return f.read(), length
