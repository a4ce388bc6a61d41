"""Content identity of model and drafter artifacts (the digest that enters cache namespaces).

Why one file of ~460 lines: the framing is a public contract and is easiest to audit in one place (framing,
mmap hashing, the memo that keys on file metadata); golden vectors in tests/golden/identity.json pin it.

A cache entry is only valid for the exact weights and config that produced it, so every namespace
carries a digest of those files. The digest is a **public contract**: it appears in stored
namespaces, so the framing below must never change (a change needs a new domain string, ``v2``).

Framing of ``artifact_identity(seed, files)``
---------------------------------------------
``u64le(n)`` is ``n`` as 8 bytes little-endian. Names are UTF-8; a ``str`` seed is UTF-8 encoded
(so ``"x"`` and ``b"x"`` give the same digest). Files are sorted by the UTF-8 bytes of their name,
so the order the caller gives them in does not matter; two files with the same name are an error::

    digest = blake3(
        b"spec-cache/artifact-identity/v1\\x00"
        || u64le(len(seed)) || seed
        || u64le(number_of_files)
        || for each file, by name bytes:
               u64le(len(name)) || name || u64le(len(content)) || content
    ).hexdigest()                      # 32 bytes -> 64 lowercase hex characters

Every variable-length field is length-prefixed, so no two different (seed, {name: content})
inputs frame to the same bytes (``("ab", "c")`` and ``("a", "bc")`` differ). Only names and
contents count: the paths, the directory name and file metadata do not.

``model_identity(model_dir)`` is ``artifact_identity(MODEL_IDENTITY_SEED, files)`` with seed
``b"spec-cache/model-identity/v1"`` over ``config.json`` (or ``dspark.json`` for the DFlash/DSpark
family), ``model.safetensors.index.json`` when present, and every ``*.safetensors`` directly in the
directory, each named by its file name (not its path).

Memo
----
Hashing a multi-GB model costs seconds, so a digest is memoized under a key that changes whenever
any file might have: ``blake3(b"spec-cache/artifact-identity-memo/v1\\x00" || field(seed) ||
u64le(n) || per file: field(name) field(realpath) field(st_dev) field(st_ino) field(st_size)
field(st_mtime_ns) field(st_ctime_ns))`` in hex, where ``field(b) = u64le(len(b)) || b`` and the
integers are written as decimal ASCII. The memo is written only when a fresh stat after hashing
matches the one taken before. A memoized call costs a stat and a realpath per file plus one
small read. Limits: a same-size in-place rewrite inside one filesystem timestamp tick is not
seen (model tools replace files rather than rewrite them); truncating a file *while* it is being
hashed ends the process with SIGBUS (content is read through mmap, as blake3's own mmap path does).

Content is read through ``mmap`` and fed to blake3's multithreaded hasher in 256 MiB slices; that
runs at the speed of ``blake3.update_mmap`` (measured by ``tools/bench_identity.py``) and lets
``progress`` report within a large file, with ``fstat`` on the same descriptor that is hashed.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import stat
import struct
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import blake3

from spec_cache.errors import InvalidRequest, ModelLoadError

__all__ = [
    "ARTIFACT_DOMAIN",
    "MEMO_DOMAIN",
    "MODEL_IDENTITY_SEED",
    "FileChangedError",
    "FileMemo",
    "IdentityMemo",
    "ModelDirError",
    "artifact_identity",
    "default_memo",
    "model_identity",
    "model_identity_files",
]

ARTIFACT_DOMAIN = b"spec-cache/artifact-identity/v1\x00"
MEMO_DOMAIN = b"spec-cache/artifact-identity-memo/v1\x00"
MODEL_IDENTITY_SEED = b"spec-cache/model-identity/v1"

CONFIG_NAME = "config.json"
DSPARK_CONFIG_NAME = "dspark.json"
INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_SUFFIX = ".safetensors"

_PIECE = 256 << 20  # bytes per hasher.update() of an mmap'd file; also the progress granularity
_HEX64 = re.compile(r"[0-9a-f]{64}")
_log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


class ModelDirError(ModelLoadError):
    """A model directory is not a directory, or lacks its config or its weights."""


class FileChangedError(RuntimeError):
    """A file changed (size, mtime, ctime or inode) while it was being hashed."""


class IdentityMemo(Protocol):
    """Where memoized digests live: ``get`` returns a stored digest or None; ``put`` stores one.

    Implementations may fail; failures are treated as a miss (``get``) or ignored (``put``).
    """

    def get(self, key: str) -> str | None: ...

    def put(self, key: str, digest: str) -> None: ...


class FileMemo:
    """One small file per memo key under ``directory`` (created 0700 on the first put).

    Reads and writes never raise: an unreadable or corrupt entry is a miss, a failed write is
    dropped. Writes go through a temporary file and ``os.replace``, so readers see whole entries.
    """

    def __init__(self, directory: os.PathLike | str) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"FileMemo({str(self.directory)!r})"

    def get(self, key: str) -> str | None:
        if not _is_hex64(key):
            return None
        try:
            with open(self.directory / key, "rb") as fh:
                raw = fh.read(66)
        except (OSError, ValueError):
            return None
        value = raw.decode("ascii", "replace").strip()
        return value if _is_hex64(value) else None

    def put(self, key: str, digest: str) -> None:
        if not (_is_hex64(key) and _is_hex64(digest)):
            return
        tmp = None
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(digest.encode("ascii"))
            os.replace(tmp, self.directory / key)
            tmp = None
        except OSError as exc:
            _log.debug("identity memo write to %s failed: %s", self.directory, exc)
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass


def default_memo() -> FileMemo:
    """The per-user memo: ``$SPEC_CACHE_IDENTITY_DIR``, else ``$XDG_CACHE_HOME/spec-cache/identity``,
    else ``~/.cache/spec-cache/identity`` (read from the environment at each call)."""
    explicit = os.environ.get("SPEC_CACHE_IDENTITY_DIR")
    if explicit:
        return FileMemo(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return FileMemo(base / "spec-cache" / "identity")


@dataclass(frozen=True)
class _Entry:
    """One input file: its framed name, where it is, and its state when the call began."""

    name: str
    name_bytes: bytes
    path: str
    realpath: str
    st: os.stat_result


def artifact_identity(
    seed: str | bytes,
    files: Iterable[tuple[str, os.PathLike | str]],
    *,
    memo: IdentityMemo | None | bool = None,
    progress: Progress | None = None,
) -> str:
    """Digest of ``seed`` and the named file contents, 64 lowercase hex (framing: module docstring).

    ``files`` holds ``(name, path)`` pairs; only the name and the bytes count. ``memo=None`` uses
    ``default_memo()``, ``memo=False`` disables memoization, anything else must provide
    ``get``/``put``. ``progress(done_bytes, total_bytes)`` is called with 0 first, then as content
    is hashed (after each file and each 256 MiB piece), and with ``total_bytes`` last; a memo hit
    reports 0 then total. An exception from ``progress`` aborts the call.

    Raises ``TypeError`` on a seed, name or memo of the wrong type, ``ValueError`` on duplicate or
    non-UTF-8 names and non-regular files, ``FileNotFoundError`` (naming the file) for a missing
    file, ``FileChangedError`` when a file changes while it is hashed. Cost: about the speed of
    ``blake3.update_mmap`` on a miss; a stat and realpath per file plus one small read on a hit.
    """
    seed_bytes = _seed_bytes(seed)
    memo_obj = _resolve_memo(memo)
    entries = _snapshot(_sorted_names(files))
    total = sum(e.st.st_size for e in entries)
    report = progress if progress is not None else _no_progress
    report(0, total)

    key = _memo_key(seed_bytes, entries) if memo_obj is not None else None
    if key is not None:
        cached = _memo_get(memo_obj, key)
        if cached is not None:
            report(total, total)
            return cached

    digest = _digest_files(seed_bytes, entries, report, total)
    _check_unchanged(entries)
    if key is not None:
        _memo_put(memo_obj, key, digest)
    return digest


def model_identity_files(
    model_dir: os.PathLike | str, *, config_name: str | None = None
) -> list[tuple[str, str]]:
    """The ``(name, path)`` pairs ``model_identity`` hashes, sorted by name.

    ``config_name=None`` picks ``config.json`` if present, else ``dspark.json``. Weights are the
    non-hidden ``*.safetensors`` entries directly in the directory (like the shell glob); a
    dangling weight symlink is kept, so hashing it raises ``FileNotFoundError`` rather than
    silently skipping a shard. Raises ``ModelDirError`` naming the directory and what is missing.
    """
    directory = os.fspath(model_dir)
    if isinstance(directory, bytes):
        directory = os.fsdecode(directory)
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.lexists(directory) else "does not exist"
        raise ModelDirError(f"model directory {directory} {what}")

    if config_name is None:
        for candidate in (CONFIG_NAME, DSPARK_CONFIG_NAME):
            if os.path.lexists(os.path.join(directory, candidate)):
                config_name = candidate
                break
        else:
            raise ModelDirError(
                f"model directory {directory} has no {CONFIG_NAME} (nor {DSPARK_CONFIG_NAME})"
            )
    else:
        if not isinstance(config_name, str):
            raise TypeError(f"config_name must be a str, got {type(config_name).__name__}")
        if not config_name or os.path.basename(config_name) != config_name or config_name in (".", ".."):
            raise InvalidRequest(f"config_name must be a plain file name, got {config_name!r}")
        if not os.path.lexists(os.path.join(directory, config_name)):
            raise ModelDirError(f"model directory {directory} has no {config_name}")

    names = {config_name}
    if os.path.lexists(os.path.join(directory, INDEX_NAME)):
        names.add(INDEX_NAME)
    weights = []
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if (
                    entry.name.endswith(WEIGHTS_SUFFIX)
                    and not entry.name.startswith(".")
                    and not entry.is_dir()
                ):
                    weights.append(entry.name)
    except OSError as exc:
        raise ModelDirError(f"model directory {directory} cannot be listed: {exc}") from exc
    if not weights:
        raise ModelDirError(f"model directory {directory} has no *{WEIGHTS_SUFFIX} weights")
    names.update(weights)
    return [(name, os.path.join(directory, name)) for name in sorted(names, key=_utf8_or_raw)]


def model_identity(
    model_dir: os.PathLike | str,
    *,
    config_name: str | None = None,
    memo: IdentityMemo | None | bool = None,
    progress: Progress | None = None,
) -> str:
    """Digest of a model directory's config, shard index and safetensors weights.

    ``artifact_identity(MODEL_IDENTITY_SEED, model_identity_files(model_dir, config_name=...))``:
    README, tokenizer files, subdirectories and the directory's own name do not count.
    Raises ``ModelDirError`` (a ``ValueError``) when the directory, its config or its weights
    are missing; see ``artifact_identity`` for the rest.
    """
    files = model_identity_files(model_dir, config_name=config_name)
    return artifact_identity(MODEL_IDENTITY_SEED, files, memo=memo, progress=progress)


# --- framing -------------------------------------------------------------------------------


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _field(b: bytes) -> bytes:
    return _u64(len(b)) + b


def _seed_bytes(seed: str | bytes) -> bytes:
    if isinstance(seed, str):
        try:
            return seed.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"seed is not encodable as UTF-8: {exc}") from None
    if isinstance(seed, (bytes, bytearray, memoryview)):
        return bytes(seed)
    raise TypeError(f"seed must be str or bytes, got {type(seed).__name__}")


def _utf8_or_raw(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def _sorted_names(files: Iterable[tuple[str, os.PathLike | str]]) -> list[tuple[str, bytes, str]]:
    """Validate names, encode them, and sort by the encoded bytes; duplicates are an error."""
    if isinstance(files, (str, bytes)) or not isinstance(files, Iterable):
        raise TypeError("files must be an iterable of (name, path) pairs")
    out = []
    for item in files:
        try:
            name, path = item
        except (TypeError, ValueError):
            raise TypeError(f"files must hold (name, path) pairs, got {item!r}") from None
        if not isinstance(name, str):
            raise TypeError(f"file name must be a str, got {type(name).__name__}: {name!r}")
        try:
            name_bytes = name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f"file name {name!r} is not encodable as UTF-8: {exc}") from None
        out.append((name, name_bytes, os.fspath(path)))
    out.sort(key=lambda t: t[1])
    for (a, _, _), (b, _, _) in zip(out, out[1:]):
        if a == b:
            raise InvalidRequest(f"duplicate file name {a!r} in artifact identity input")
    return out


def _snapshot(named: list[tuple[str, bytes, str]]) -> list[_Entry]:
    entries = []
    for name, name_bytes, path in named:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                errno.ENOENT, f"artifact file {name!r} not found", os.fsdecode(path)
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise ModelLoadError(f"artifact file {name!r} is not a regular file: {os.fsdecode(path)}")
        entries.append(_Entry(name, name_bytes, path, os.path.realpath(path), st))
    return entries


def _same_file_state(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns, a.st_ctime_ns) == (
        b.st_dev,
        b.st_ino,
        b.st_size,
        b.st_mtime_ns,
        b.st_ctime_ns,
    )


def _check_unchanged(entries: list[_Entry]) -> None:
    """Stat every path again: a replaced, re-linked, edited or deleted file fails the call."""
    for e in entries:
        try:
            st = os.stat(e.path)
        except FileNotFoundError:
            raise _changed(e) from None
        if not _same_file_state(e.st, st) or os.path.realpath(e.path) != e.realpath:
            raise _changed(e)


def _changed(e: _Entry) -> FileChangedError:
    return FileChangedError(
        f"file changed while hashing: {e.name!r} at {os.fsdecode(e.path)} "
        "(its size, mtime, ctime, inode or link target differ before and after hashing, or it was "
        "removed); retry once it is stable"
    )


def _digest_files(seed: bytes, entries: list[_Entry], report: Progress, total: int) -> str:
    """Hash the framed input; checks each file's descriptor against the snapshot before and after."""
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO)
    hasher.update(ARTIFACT_DOMAIN + _field(seed) + _u64(len(entries)))
    done = 0
    for e in entries:
        size = e.st.st_size
        hasher.update(_field(e.name_bytes) + _u64(size))
        with open(e.path, "rb") as fh:
            if not _same_file_state(e.st, os.fstat(fh.fileno())):
                raise _changed(e)
            if size:
                with mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ) as mapped:
                    with memoryview(mapped) as view:
                        for start in range(0, size, _PIECE):
                            with view[start : start + _PIECE] as piece:
                                hasher.update(piece)
                            done += min(_PIECE, size - start)
                            if done < total:
                                report(done, total)
            if not _same_file_state(e.st, os.fstat(fh.fileno())):
                raise _changed(e)
    report(total, total)
    return hasher.hexdigest()


# --- memo ----------------------------------------------------------------------------------


def _is_hex64(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and _HEX64.fullmatch(value) is not None


def _no_progress(done: int, total: int) -> None:
    pass


def _resolve_memo(memo: IdentityMemo | None | bool) -> IdentityMemo | None:
    if memo is None:
        return default_memo()
    if memo is False:
        return None
    if memo is True or not (callable(getattr(memo, "get", None)) and callable(getattr(memo, "put", None))):
        raise TypeError(f"memo must be None, False or an object with get/put, got {memo!r}")
    return memo


def _memo_key(seed: bytes, entries: list[_Entry]) -> str:
    parts = [MEMO_DOMAIN, _field(seed), _u64(len(entries))]
    for e in entries:
        st = e.st
        parts.append(_field(e.name_bytes))
        parts.append(_field(os.fsencode(e.realpath)))
        for n in (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns):
            parts.append(_field(str(n).encode("ascii")))
    return blake3.blake3(b"".join(parts)).hexdigest()


def _memo_get(memo: IdentityMemo, key: str) -> str | None:
    try:
        value = memo.get(key)
    except Exception as exc:  # a broken memo must never fail an identity; it only costs a re-hash
        _log.debug("identity memo get failed: %r", exc)
        return None
    return value if _is_hex64(value) else None


def _memo_put(memo: IdentityMemo, key: str, digest: str) -> None:
    try:
        memo.put(key, digest)
    except Exception as exc:
        _log.debug("identity memo put failed: %r", exc)
