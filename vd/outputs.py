"""Writing an output file (a report, JUnit XML, an HTML page, a summary, a bundle's files) without following a
link at its path: the bytes go to a new temporary file in the same directory, renamed onto the path at once
(`os.replace` replaces a link rather than writing through it), so a link planted there, into a golden say,
is never written through and a reader never sees half a file."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import sys
import tempfile
from pathlib import Path

from vd.errors import naming

_UMASK = os.umask(0o022)  # read once (os.umask sets as it reads): what a new file's permissions lose
os.umask(_UMASK)


def write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """``data`` at ``path`` (its directory made); ``mode`` its permissions (default: a new file's, umask applied).
    A path that is no file to put in place (`_through`: ``-`` or /dev/stdout, /dev/null, a named pipe) is written
    through."""
    path = Path(path)
    fd = _through(path)
    if fd is not None:
        with naming("standard output" if to_stdout(path) else path):  # (/dev/full, a full disk under `> file`)
            _write_all(fd, data)
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:  # named as the user named it, not as the temporary file it could not make
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f, naming(path):  # (the user's path, not the temporary file's)
            f.write(data)
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_UMASK)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


_STD = re.compile(r"-|/dev/std(out|err)|/dev/fd/(\d+)|/proc/self/fd/(\d+)")


def to_stdout(path: str | os.PathLike | None) -> bool:
    """Whether an output path names standard output: ``-``, /dev/stdout, /dev/fd/1 or /proc/self/fd/1."""
    m = None if path is None else _STD.fullmatch(str(path))
    return m is not None and (m[0] == "-" or m[1] == "out" or "1" in (m[2], m[3]))


def stream(path: str | os.PathLike) -> bool:
    """Whether ``path`` is written through rather than put in place as a file (`_through`): a standard stream
    (``-`` is stdout), or an existing device, FIFO or socket. Nothing beside it is made (no bundle folder)."""
    if _STD.fullmatch(str(path)):
        return True
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _through(path: Path) -> int | None:
    """A descriptor to write ``path``'s bytes on, where ``path`` is no file to put in place: a standard stream,
    ``-`` or named by its /dev or /proc path (``--report -``: the descriptor itself, so a redirection to a file
    keeps its offset), or an existing device, FIFO or socket (``/dev/null``, a named pipe), opened as it is.
    Renamed over, as root, /dev/null became a regular file for every process on the machine. None: a file (a
    link at the path is then replaced, never written through: it cannot lead to a device into a golden)."""
    if not stream(path):
        return None
    std = _STD.fullmatch(str(path))
    try:
        if std:
            n = 1 if std[0] == "-" else {"out": 1, "err": 2}[std[1]] if std[1] else int(std[2] or std[3])
            printed = {1: sys.stdout, 2: sys.stderr}.get(n)
            with contextlib.suppress(ValueError, OSError):
                if printed is not None:
                    printed.flush()  # what was printed before comes first
            return os.dup(n)
        fd = os.open(path, os.O_WRONLY)  # a FIFO's reader is waited for, as a shell's `>` waits
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    if stat.S_ISREG(os.fstat(fd).st_mode):  # a file put there since it was looked at: put a file in place
        os.close(fd)
        return None
    return fd


def _write_all(fd: int, data: bytes) -> None:
    """``data`` on ``fd``, then ``fd`` closed; a reader that went away (a broken pipe) drops the rest, as
    `ReaderGone` drops a command's printed output."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except BrokenPipeError:
        pass
    finally:
        os.close(fd)


def write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> None:
    """``text`` (UTF-8) at ``path``, as `write_bytes`."""
    write_bytes(path, text.encode("utf-8"), mode)


class ReaderGone:
    """A standard stream (stdout, stderr) that outlives its reader: once a write or flush meets a broken pipe
    (``vd replay GOLDEN | head``), the stream's descriptor is pointed at /dev/null and what follows is dropped,
    so the command finishes its work (a suite's other goldens, its report files) and exits with its own code.
    Left alone, the broken pipe ended the command wherever it printed, with click's exit code 1: vd's code
    for a real difference."""

    def __init__(self, stream, name: str):
        self.stream, self.name = stream, name  # (``name``: how an error writing it names it, "standard output")

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def write(self, text):
        try:
            with naming(self.name):  # a refused write (``> /dev/full``, a full disk) says where it went
                return self.stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        try:
            with naming(self.name):
                self.stream.flush()
        except BrokenPipeError:
            self._gone()

    def _gone(self) -> None:
        """Point the descriptor at /dev/null; the text still buffered above it then flushes there, so nothing
        fails again, at exit included (a failed flush at exit makes Python's status 120)."""
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError):  # no descriptor (a test's captured stream): nothing to point elsewhere
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()


def json_text(data: object) -> str:
    """``data`` as the JSON vd writes (reports, bundles): indented, ending in a newline, anything JSON cannot hold
    as its ``str``, and NaN and infinities as the strings ``"nan"``, ``"inf"``, ``"-inf"`` (JSON has none; strict
    parsers refuse Python's ``NaN``)."""
    return json.dumps(_finite(data), indent=2, default=str) + "\n"


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def size_text(nbytes: int) -> str:
    """A size as a line says it: ``12.3 MB``, or below a tenth of a MB ``30.3 kB`` (not ``0.0 MB``)."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes / 1e3:.1f} kB"


def brief(value: object, width: int = 60) -> str:
    """A value as a line names it: its ``repr``, cut to ``width`` characters (``...`` where cut)."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


# The files a bundle holds (`vd.replayer.render.write_bundle`), and the report and bundle its command.sh writes
# beside them when run.
BUNDLE_FILES = ("rows.npz", "failure.json", "environment.json", "command.sh", "replay.json")
BUNDLE_NAMES = (*BUNDLE_FILES, "replay.json.bundle")

# What a bundle's failure.json holds (every version of it): what tells a bundle from a user's files of these names.
_FAILURE_KEYS = {"k", "forward", "kind", "step", "policy", "golden", "verdict", "reasons"}


def is_bundle(directory: Path) -> bool:
    """Whether ``directory`` holds a replay's first-divergence bundle: a ``failure.json`` as `write_bundle` writes
    it (written first, so a bundle cut short is one too)."""
    failure = directory / "failure.json"
    try:
        if failure.is_symlink() or not failure.is_file() or failure.stat().st_size > 1 << 20:
            return False
        doc = json.loads(failure.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and _FAILURE_KEYS <= doc.keys()


def check_bundle_place(what: str, place: Path | None, others: dict[str, str | os.PathLike | None]) -> str | None:
    """Why a first-divergence bundle cannot go to ``place`` (``what`` names it in the line: ``--bundle DIR``, or the
    place beside a report), or None where it can: a file there; a folder holding no earlier bundle but files (or
    folders) of a bundle's names, which it would overwrite (and a passing replay then remove); another output
    (``others``, by flag) at one of those names there, which the bundle would overwrite. Other files in the folder
    are left alone (a CI job's artifacts folder)."""
    if place is None:
        return None
    if place.exists() and not place.is_dir():
        return f"{what} is a file; a bundle is a folder"
    if place.is_dir() and not is_bundle(place):
        theirs = [n for n in BUNDLE_NAMES if os.path.lexists(place / n)]
        if theirs:
            return (f"{what} holds {', '.join(theirs)} and no earlier bundle: a bundle would overwrite "
                    f"{'it' if len(theirs) == 1 else 'them'}; give an empty or new folder")
    home = os.path.realpath(place)
    for flag, path in others.items():
        if path is None or stream(path):
            continue
        if os.path.dirname(os.path.realpath(path)) == home and Path(path).name in BUNDLE_NAMES:
            return f"{flag} {path} is where the bundle ({what}) writes its {Path(path).name}; write it elsewhere"
    return None

