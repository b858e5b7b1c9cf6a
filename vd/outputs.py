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


class ReaderGone:
    """A standard stream (stdout, stderr) that outlives its reader: once a write or flush meets a broken pipe
    (``vd replay GOLDEN | head``), the stream's descriptor is pointed at /dev/null and what follows is dropped,
    so the command finishes its work (a suite's other goldens, its report files) and exits with its own code.
    Left alone, the broken pipe ended the command wherever it printed, with click's exit code 1: vd's code
    for a real difference."""

    def __init__(self, stream):
        self.stream = stream

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self._gone()

    def _gone(self) -> None:
        """Point the descriptor at /dev/null; the text still buffered above it then flushes there, so nothing
        fails again, at exit included (a failed flush at exit makes Python's status 120)."""
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, self.stream.fileno())
        finally:
            os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()
