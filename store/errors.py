"""Typed errors of the persistence layer.

Callers (the runtime, the CLI) catch these by type: a ``CorruptRecord`` is a miss, a ``StoreFormatError`` stops
the open with a message a person can act on, and nothing below raises a bare LMDB or msgpack exception.
"""


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class StoreFormatError(StoreError):
    """The directory holds a store this code cannot read (newer major format, not a spec-cache store)."""


class StoreOpenError(StoreError):
    """The store directory cannot be opened or created (permissions, not a directory, locked map)."""


class StoreDamaged(StoreOpenError):
    """The directory holds a store whose file is damaged beyond opening (truncated, empty): ``verify`` reports
    it as damage (exit 1), ``repair --to`` salvages what is left."""


class StoreUnsafe(StoreOpenError):
    """A read-write open refused because someone else could change the store under us: the directory belongs to
    another user, or group/other may write it. Read-only inspection stays allowed; the message names the fix."""


class StoreUnavailable(StoreError):
    """The open store's ``data.mdb`` was shrunk, removed or replaced underneath this process (found before LMDB
    read a page past its end: that would be SIGBUS). Sticky: every later read and write of this handle raises it
    at once (a miss to the runtime); reopening picks up whatever store is at the path then."""


class StoreFullError(StoreError):
    """A write does not fit: the record alone is over the byte budget, or the map cannot grow (disk full)."""


class CorruptRecord(StoreError):
    """A stored record failed its checksum or its structure checks; it is never returned, only dropped."""

    def __init__(self, message: str, key: bytes | None = None, piece: bytes | None = None):
        super().__init__(message)
        self.key = key
        self.piece = piece  # a damaged shared piece the record ``key`` names (store format 1.3), or None


class CorruptIndex(StoreError):
    """An index value (node, entry, namespace, totals) is not what the store wrote: damaged bytes or a wrong
    field. The lookup that met it is a miss; ``spec-cache gc`` removes it and rebuilds the counters."""

    def __init__(self, message: str, db: str | None = None, key: bytes | None = None):
        super().__init__(message)
        self.db = db
        self.key = key


class InvalidInput(StoreError, ValueError):
    """Bad arguments from the caller: wrong token values, tensor shapes that do not line up, and the like."""


class NamespaceNotRegistered(InvalidInput):
    """A put under a namespace key the store has no row for: call ``register_namespace`` first (and again
    if the store was replaced underneath an open handle)."""


class ChunkNotCopied(StoreError):
    """A put told that the store held its first ``copied_from`` tokens (``Store.put(copied_from=...)``: the caller
    left them uncopied) needed a chunk of them after all (evicted or dropped since ``Store.held_tokens``). The put
    wrote nothing; put the checkpoint again with every token copied."""
