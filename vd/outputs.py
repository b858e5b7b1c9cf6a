"""Writing an output file (a report, JUnit XML, an HTML page, a summary, a bundle's files) without following a
link at its path: the bytes go to a new temporary file in the same directory, renamed onto the path at once
(`os.replace` replaces a link rather than writing through it), so a link planted there, into a golden say,
is never written through and a reader never sees half a file."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

_UMASK = os.umask(0o022)  # read once (os.umask sets as it reads): what a new file's permissions lose
os.umask(_UMASK)


def write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """``data`` at ``path`` (its directory made); ``mode`` its permissions (default: a new file's, umask applied)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # named as the user named it, not as the temporary file it could not make
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_UMASK)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> None:
    """``text`` (UTF-8) at ``path``, as `write_bytes`."""
    write_bytes(path, text.encode("utf-8"), mode)
