"""Where a store may be opened: the directory checks that run before LMDB touches anything.

A store is created only in a new directory (with at most one missing parent) or an empty one; a directory that
holds anything but a store's own files is refused untouched, and so is a 0-byte ``data.mdb``. Modes (directory
0700, files 0600) change only after every check passed, and only on what this user owns. Permission problems
are named as such.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time

from .errors import StoreDamaged, StoreOpenError, StoreUnsafe

RESERVE_NAME = "reserve"
COMPACT_WORK_NAME = "compact.tmp"  # ``spec-cache compact``'s work directory (left behind only by a crash)
STORE_FILES = frozenset({"data.mdb", "lock.mdb", RESERVE_NAME, COMPACT_WORK_NAME})


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


def check_data_file(path: str) -> None:
    data = os.path.join(path, "data.mdb")
    try:
        size = os.path.getsize(data)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreOpenError(f"cannot open store at {path}: {exc.strerror}") from None
    if size == 0:
        raise StoreDamaged(f"store at {path} is damaged: data.mdb is empty (0 bytes); delete the directory or "
                             "run 'spec-cache repair' on a copy that still has its data")
    if not os.access(data, os.R_OK):
        raise StoreOpenError(f"permission denied: cannot read {data}")


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


def move_aside(path: str) -> str:
    """Rename a damaged store directory to ``<path>.damaged-<UTC time>`` (``-N`` added if taken); its path."""
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
        return aside
    raise StoreOpenError(f"store at {path} is damaged and no free name {path}.damaged-{stamp}-N is left")


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
