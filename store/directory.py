"""Where a store may be opened: the directory checks that run before LMDB touches anything.

A store is created only in a new directory (with at most one missing parent) or an empty one; a directory that
holds anything but a store's own files is refused untouched, and so is a 0-byte ``data.mdb``. Modes (directory
0700, files 0600) change only after every check passed, and only on what this user owns. Permission problems
are named as such.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import time

from .errors import StoreDamaged, StoreOpenError, StoreUnsafe

RESERVE_NAME = "reserve"
#: where ``Environment._keep_reserve`` allocates the reserve before renaming it: seen by a process opening the store
#: while another makes its reserve (or left by a crash), so it is one of the store's own files
RESERVE_WORK_NAME = RESERVE_NAME + ".tmp"
COMPACT_WORK_NAME = "compact.tmp"  # ``spec-cache compact``'s work directory (left behind only by a crash)
STORE_FILES = frozenset({"data.mdb", "lock.mdb", RESERVE_NAME, RESERVE_WORK_NAME, COMPACT_WORK_NAME})
#: damaged copies ``move_aside`` keeps per store (the newest); older ones are deleted. Each can be as large as the
#: store, so more would eat the disk its budget was computed from (``open_environment(keep_aside=...)``)
KEEP_ASIDE = 2
_ASIDE = re.compile(r"(.+)\.damaged-([0-9]{8}T[0-9]{6}Z)(?:-([0-9]{1,2}))?")
log = logging.getLogger("spec_cache.store")


def prepare_dir(path: str) -> bool:
    """Make sure ``path`` may hold a store before anything is written; True if it holds one already.

    Created: a new directory, and at most one missing parent. Accepted: an empty directory, or one holding only a
    store's own files. Refused untouched (``StoreOpenError``): a file, a non-empty directory that is not a store,
    a directory we may not enter, a deeper missing path.
    """
    if os.path.lexists(path) and not os.path.isdir(path):
        raise StoreOpenError(f"store path {path} is not a directory")
    if not os.path.exists(path):
        parent = os.path.dirname(path)
        if not os.path.isdir(parent) and not os.path.isdir(os.path.dirname(parent)):
            raise StoreOpenError(f"cannot create store directory {path}: its parent {parent} does not exist "
                                 "(a store creates at most one missing parent)")
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StoreOpenError(f"cannot create store directory {path}: {exc.strerror}") from None
        check_safe(path)  # ours, unless another process created it in the meantime
        return False
    try:
        names = set(os.listdir(path))
    except PermissionError:
        raise StoreOpenError(f"permission denied: cannot read store directory {path}") from None
    except OSError as exc:
        raise StoreOpenError(f"cannot read store directory {path}: {exc.strerror}") from None
    if names - STORE_FILES:
        shown = ", ".join(sorted(names - STORE_FILES)[:3])
        raise StoreOpenError(f"{path} is not a spec-cache store and not empty ({shown}...): refusing to create a "
                             "store there; choose a new or empty directory")
    check_safe(path)
    check_data_file(path)
    return "data.mdb" in names


#: how long an opener waits for a just-created ``data.mdb`` to get LMDB's two meta pages (``check_data_file``)
CREATION_SETTLE_S = 2.0
#: a ``data.mdb`` modified longer ago than this is not being created by anyone: its size is final
CREATION_RECENT_S = 30.0


def check_data_file(path: str) -> None:
    """Refuse a ``data.mdb`` of 0 bytes (a full disk at creation, a truncated copy) before LMDB maps it.

    Why the wait: LMDB creates ``data.mdb`` empty and writes its meta pages a moment later, under its own lock
    file's exclusive lock, which this check (run before ``lmdb.open``) does not take. A process opening a new
    store while another creates it saw that moment's 0 bytes and called the store damaged (CI, three processes
    opening one new store). Taking LMDB's ``fcntl`` lock here is not an option: closing any descriptor of
    ``lock.mdb`` drops every lock this process holds on it, LMDB's own included. So a recently modified file
    shorter than the two meta pages gets ``CREATION_SETTLE_S`` to grow; one that stays empty is damaged."""
    data = os.path.join(path, "data.mdb")
    try:
        size = _settled_size(data)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreOpenError(f"cannot open store at {path}: {exc.strerror}") from None
    if size == 0:
        raise StoreDamaged(f"store at {path} is damaged: data.mdb is empty (0 bytes); delete the directory or "
                             "run 'spec-cache repair' on a copy that still has its data")
    if not os.access(data, os.R_OK):
        raise StoreOpenError(f"permission denied: cannot read {data}")


def _settled_size(data: str) -> int:
    """``data.mdb``'s size once a creator in another process has written LMDB's meta pages (or given up)."""
    st = os.stat(data)
    need = 2 * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 8192
    if st.st_size >= need or time.time() - st.st_mtime > CREATION_RECENT_S:
        return st.st_size
    deadline = time.monotonic() + CREATION_SETTLE_S
    size = st.st_size
    while size < need and time.monotonic() < deadline:
        time.sleep(0.01)
        size = os.path.getsize(data)
    return size


def check_safe(path: str) -> None:
    """Refuse (``StoreUnsafe``) a read-write open of a directory another user owns or group/other may write:
    they could swap ``data.mdb`` or ``lock.mdb`` under us, and a store we wrote into would be left with files
    its owner cannot use. Read-only opens never come here (inspection of another user's store stays allowed)."""
    st = os.stat(path)
    me = os.geteuid()
    if st.st_uid != me:
        raise StoreUnsafe(
            f"refusing to open store {path} read-write: it belongs to {_user(st.st_uid)}, not to this user "
            f"({_user(me)}); run as its owner, open it read-only to inspect it (spec-cache ls/show/verify), or "
            f"take it over with 'chown -R {me} {path}'")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if mode & bit)
        raise StoreUnsafe(
            f"refusing to open store {path} read-write: its directory is writable by {who} (mode {mode:04o}), "
            f"so another user could replace its files; fix with 'chmod 700 {path}' (read-only inspection works "
            "as it is)")


def _user(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def move_aside(path: str, *, keep: int = KEEP_ASIDE, budget: int | None = None) -> str | None:
    """Rename a damaged store directory to ``<path>.damaged-<UTC time>`` (``-N`` added if taken), then bound the
    copies set aside (``prune_aside``); the new copy's path, or None if the bound deleted it at once.

    Why a bound: every damage-and-restart kept one more copy, and the copies took the disk the fresh store's
    budget was computed from (5 cycles filled a 48 MiB tmpfs). ``keep`` copies stay, the newest first; with a
    ``budget`` (the fresh store's ``max_bytes``), copies also go, oldest first, while the file system has less
    free space than that budget: a copy never takes the room the store was promised."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for n in range(100):
        aside = f"{path}.damaged-{stamp}" + (f"-{n}" if n else "")
        if os.path.lexists(aside):
            continue
        try:
            os.rename(path, aside)
        except OSError as exc:
            if os.path.lexists(aside):
                continue
            raise StoreOpenError(f"store at {path} is damaged and cannot be moved aside to {aside}: "
                                 f"{exc.strerror}") from None
        with contextlib.suppress(OSError):  # disk held for the store's own recovery, not data: no use in a copy
            os.unlink(os.path.join(aside, RESERVE_NAME))
        deleted = prune_aside(path, keep=keep, budget=budget)
        return None if aside in deleted else aside
    raise StoreOpenError(f"store at {path} is damaged and no free name {path}.damaged-{stamp}-N is left")


def aside_copies(path: str) -> list[str]:
    """The damaged copies ``move_aside`` set aside for the store at ``path``, oldest first (by their stamp, then
    their ``-N``); only names ``move_aside`` makes are listed, so nothing else beside the store is ever touched."""
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    found = []
    for name in names:
        match = _ASIDE.fullmatch(name)
        if match is not None and match.group(1) == base and os.path.isdir(os.path.join(parent, name)):
            found.append((match.group(2), int(match.group(3) or 0), os.path.join(parent, name)))
    return [p for _stamp, _n, p in sorted(found)]


def prune_aside(path: str, *, keep: int = KEEP_ASIDE, budget: int | None = None) -> list[str]:
    """Delete the oldest aside copies of ``path`` beyond the newest ``keep``, and, with a ``budget``, more (oldest
    first, the newest last) while the file system holds less free space than ``budget``; one log line names
    what went. Returns the deleted paths. A copy that cannot be deleted is named in the line and left."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
        raise StoreOpenError(f"keep_aside must be an int >= 0, got {keep!r}")
    copies = aside_copies(path)
    doomed = copies[:max(0, len(copies) - keep)]
    left = copies[len(doomed):]
    deleted, failed = [], []
    for victim in doomed:
        (deleted if _remove(victim) else failed).append(victim)
    while budget is not None and left and _free_bytes(os.path.dirname(os.path.abspath(path))) < budget:
        victim = left.pop(0)
        (deleted if _remove(victim) else failed).append(victim)
    if deleted or failed:
        why = f"keeping at most {keep}" + (f" within the store's {budget}-byte budget" if budget is not None else "")
        log.warning("spec-cache: deleted %d older damaged cop%s of the store at %s (%s): %s%s", len(deleted),
                    "y" if len(deleted) == 1 else "ies", path, why, ", ".join(os.path.basename(d) for d in deleted)
                    or "none", f"; could not delete {', '.join(failed)}" if failed else "")
    return deleted


def default_budget(path: str) -> tuple[int, str]:
    """A byte budget for the store at ``path`` when none is given: half of the disk space the store could have,
    i.e. the file system's free space plus what the store's directory and its aside copies already hold.
    Returns (bytes, how it was computed).

    Why this shape: "what the store holds + half the free space" grows at every restart of a full store (24, 34,
    39 ... MiB on a 48 MiB disk, towards a full disk) and shrinks with every damaged copy set aside (their bytes
    are not free); counting the store's own files and copies as its room keeps the budget where the first start
    put it, and ``prune_aside`` deletes copies the budget needs the room of."""
    path = os.path.abspath(os.fspath(path))
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    free = _free_bytes(probe)
    own = _bytes_under(path) if os.path.isdir(path) else 0
    copies = sum(_bytes_under(copy) for copy in aside_copies(path))
    budget = max((free + own + copies) // 2, 1 << 20)
    return budget, (f"half of the {free} bytes free on {probe} + the store's {own} bytes + {copies} bytes of "
                    f"damaged copies set aside")


def _bytes_under(folder: str) -> int:
    """Disk blocks held by the files under ``folder`` (``data.mdb`` is sparse: its length says less)."""
    total = 0
    for where, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(where, name)).st_blocks * 512
    return total


def _remove(victim: str) -> bool:
    try:
        shutil.rmtree(victim)
    except OSError:
        return not os.path.lexists(victim)
    return True


def _free_bytes(folder: str) -> int:
    try:
        st = os.statvfs(folder)
    except OSError:
        return 1 << 62  # unknown: the count bound still holds
    return st.f_bavail * st.f_frsize


def secure(path: str) -> None:
    """Owner-only modes on a store we own: directory 0700, files 0600 (only after every check passed)."""
    st = os.stat(path)
    if st.st_uid != os.getuid():
        return
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    for name in ("data.mdb", "lock.mdb"):
        with contextlib.suppress(OSError):
            os.chmod(os.path.join(path, name), 0o600)


def first_unenterable(path: str) -> str | None:
    """The first ancestor of ``path`` this user may not search (why ``path`` looks absent), or None."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts)):
        ancestor = os.sep.join(parts[:i]) or os.sep
        try:
            os.listdir(ancestor)
        except PermissionError:
            return ancestor
        except OSError:
            return None
    return None
