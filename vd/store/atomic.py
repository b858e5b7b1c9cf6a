"""File-system steps that keep a golden whole whatever happens to the process writing it (`vd.store.location`
uses them for directory and zip goldens).

* **One writer at a time**: `writer_lock` takes an exclusive ``flock`` on ``.NAME.lock`` beside the golden for a
  whole recording or refresh; a second writer is refused at once (exit 2) instead of racing the first. Holding
  it, the writer removes what killed writers left behind (`clean`): staging folders (``.NAME.partial-*``) and
  replaced versions no reader holds (``.NAME.replaced-*``). A caller that would rather wait for the writer
  (pytest workers updating one golden: `vd.workflow.plugin`) waits with `wait_writer`.
* **One step to publish**: a new version is swapped with the old in one ``renameat2(RENAME_EXCHANGE)``
  (`exchange`), so at every moment a complete golden is at its path, the old one or the new one. Where the
  kernel or file system cannot exchange (or ``VD_PUBLISH_FALLBACK=1`` asks, as the tests do), three renames
  (`_renames`): the complete new version to ``.NAME.next-*``, the old one away, the new one in. Between the
  last two the path is empty for microseconds, and a process killed there leaves the new version at
  ``.NAME.next-*``: the next reader or writer of the path installs it (`recover`), so a golden is never lost.
  (A zip golden is one file, replaced by one ``rename``: always atomic.)
* **Readers keep their version**: a reader opens the golden's directory once and reads every file relative to
  that descriptor, holding a shared ``flock`` on it (`hold`); the version a refresh swaps out stays on disk
  (renamed ``.NAME.replaced-*``) until no reader holds it, so a replay judges one version from start to end.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from vd.errors import GoldenBusyError

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
FALLBACK = "VD_PUBLISH_FALLBACK"  # "1": publish by renames where the exchange would work (the tests force it)
PAUSE = "VD_PUBLISH_PAUSE"  # seconds between the fallback's renames (the tests kill a writer between them)


def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_EXCHANGE = _renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step; False where this kernel or file system cannot (nothing done then)."""
    if _EXCHANGE is None:
        return False
    if _EXCHANGE(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace(staged: Path, target: Path) -> Path | None:
    """Put the complete version at ``staged`` at ``target``; the replaced version's new path (None when there
    was none), for `clean` to remove once no reader holds it."""
    if not os.path.lexists(target):
        os.replace(staged, target)
        return None
    old = target.parent / f".{target.name}.replaced-{uuid.uuid4().hex[:8]}"
    if os.environ.get(FALLBACK) != "1" and exchange(staged, target):
        os.replace(staged, old)  # the old version, under a name readers never open
        return old
    return _renames(staged, target, old)


def _renames(staged: Path, target: Path, old: Path) -> Path:
    """Publish without an exchange, recoverable at every moment (see the module's docstring): the old version's
    new path."""
    ready = target.parent / f".{target.name}.next-{uuid.uuid4().hex[:8]}"
    os.replace(staged, ready)  # complete and about to be published: a writer that dies now leaves the old golden
    _pause()
    os.replace(target, old)  # from here until the next rename the path is empty: `recover` installs ``ready``
    _pause()
    try:
        os.replace(ready, target)
    except OSError:
        os.replace(old, target)  # put the old golden back
        raise
    return old


def _pause() -> None:
    seconds = os.environ.get(PAUSE)
    if seconds:
        time.sleep(float(seconds))


def recover(target: Path) -> bool:
    """Where a fallback publish died with the path empty, install the complete version it left at
    ``.NAME.next-*``; True when one was installed (two processes recovering at once: the first rename wins)."""
    if os.path.lexists(target) or not target.parent.is_dir():
        return False
    for p in sorted(target.parent.glob(f".{target.name}.next-*")):
        try:
            os.rename(p, target)
            return True
        except OSError:  # another process installed it (or another one) first
            if os.path.lexists(target):
                return False
    return False


def hold(path: Path) -> int:
    """A descriptor of the directory at ``path`` with a shared lock on it: files read relative to it come from
    this version, which `clean` leaves on disk while the descriptor is open."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _lock(target: Path) -> Path:
    """The writers' lock file of the golden at ``target`` (`writer_lock`)."""
    return target.parent / f".{target.name}.lock"


def wait_writer(target: Path, timeout: float) -> bool:
    """Wait until no process holds ``target``'s writers' lock (`writer_lock`), ``timeout`` seconds at most: whether
    none does now. A writer that dies lets go of it with its descriptor, so only a live one is waited for."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            fd = os.open(_lock(target), os.O_RDONLY)
        except FileNotFoundError:  # (its last holder removed it)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
        finally:
            os.close(fd)
        time.sleep(0.2)


def unused(path: Path) -> bool:
    """Whether no reader holds the directory (or file) at ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def clean(target: Path) -> None:
    """Remove what earlier writers of ``target`` left: staging folders and files, versions a publish that died
    did not put in place (installed instead where the path is empty: `recover`), and replaced versions no reader
    holds. Call it holding the `writer_lock`."""
    if not target.parent.is_dir():
        return
    recover(target)  # a fallback publish that died with the path empty: its new version goes in first
    for p in target.parent.glob(f".{target.name}.*"):
        kind = p.name[len(target.name) + 2:].split("-", 1)[0]
        # a `.next-*` left with a golden at the path: its publish died before the old version moved
        if kind in ("partial", "next") or kind == "replaced" and unused(p):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


@contextlib.contextmanager
def writer_lock(target: Path) -> Iterator[None]:
    """Hold the exclusive lock of ``target``'s writers (see the module's docstring); refuse at once, with a
    `GoldenError`, when another process holds it."""
    lock = _lock(target)
    while True:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # named as the user named it, not as the lock file beside it
            raise OSError(e.errno, f"cannot write {target}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GoldenBusyError(f"{target} is being written by another vd process (it holds {lock}); try again "
                                  "when it has finished") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino  # not a lock file its last holder removed
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        clean(target)
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)
