"""What a command checks before anything heavy is imported (no torch, no zarr, no numpy), so that a mistyped
command answers in a fraction of a second: a local golden's root metadata read as plain JSON (`peek`), the
verify widths a golden holds, a CPU thread count, whether this machine can run CUDA at all, and whether a
destination may be written. The command line makes these checks first; the store, the recorder and the
replayer make the same ones through these same functions where they are called without it, so each check
and its words exist once. What needs a model (a plug-in's forwards, a fingerprint) is checked once it loads.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import re
import shlex
import stat
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vd.errors import GoldenCorruptError, GoldenError, GoldenExistsError, NotAGoldenError, UsageError

FORMAT = "vd-golden"  # the root metadata's ``format`` (FORMAT.md)
MAX_META = 1 << 30  # bytes a metadata document (a ``zarr.json``, a journal) may have
MAX_FILE = 1 << 34  # bytes any other file of a golden may have


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def read_regular(path: str | os.PathLike, name: str, *, dir_fd: int | None = None, limit: int = MAX_FILE,
                 missing_ok: bool = True) -> bytes | None:
    """The bytes of the regular file at ``path`` (relative to ``dir_fd`` where given); None where there is none
    (``missing_ok``). Anything else there (a FIFO, a device, a socket, a link to one) or a file over ``limit``
    bytes is a `GoldenCorruptError` naming it as ``name``, before a byte is read: a FIFO would block the read
    for ever, ``/dev/zero`` never end it. Stat first, so no device is even opened; then opened without blocking
    and stat again, in case it was swapped between."""
    try:
        mode = os.stat(path, dir_fd=dir_fd).st_mode
    except (FileNotFoundError, NotADirectoryError):
        if missing_ok:
            return None
        raise
    except OSError as e:  # a link loop (ELOOP), a name too long: named as the golden's file, not the link's target
        raise GoldenCorruptError(f"{name} cannot be read: {e.strerror or e}") from None
    if stat.S_ISDIR(mode) and missing_ok:
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=dir_fd) if stat.S_ISREG(mode) else -1
    try:
        st = os.fstat(fd) if fd >= 0 else None
        if st is None or not stat.S_ISREG(st.st_mode):
            raise GoldenCorruptError(f"{name} is {file_kind(mode if st is None else st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise GoldenCorruptError(f"{name} has {st.st_size} bytes, more than a golden's file may ({limit})")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(limit + 1)
        if len(data) > limit:
            raise GoldenCorruptError(f"{name} grew past {limit} bytes as it was read")
        return data
    finally:
        if fd >= 0:
            os.close(fd)


def golden_meta(doc: bytes, url: str) -> Mapping[str, Any]:
    """The vd metadata of a golden's root ``zarr.json`` (its bytes ``doc``); a `GoldenError` naming what is wrong
    where it is not a zarr v3 group holding vd's metadata."""
    try:
        if not doc.strip():
            raise ValueError("it is empty")
        node = json.loads(doc)
        if not isinstance(node, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(node),
                                                                                              "a number")
            raise ValueError(f"{kind} where a zarr group's document is a JSON object")
        if node.get("zarr_format") != 3 or node.get("node_type") != "group":
            raise ValueError("not a zarr v3 group")
    except json.JSONDecodeError as e:  # (a ValueError: worded as what it is, not as Python's message)
        raise GoldenCorruptError(f"{url}/zarr.json is unreadable: not valid JSON ({e.msg} at line {e.lineno}, "
                                 f"column {e.colno})") from e
    except (ValueError, UnicodeDecodeError) as e:  # malformed zarr.json
        raise GoldenCorruptError(f"{url}/zarr.json is unreadable: {str(e).splitlines()[0]}") from e
    attributes = node.get("attributes")
    meta = attributes.get("vd") if isinstance(attributes, Mapping) else None
    if not isinstance(meta, Mapping):
        raise NotAGoldenError(f"{url} is a zarr group but not a vd golden (no vd metadata)")
    if meta.get("format") != FORMAT:  # (an edited marker was "no vd metadata", beside the vd metadata)
        raise NotAGoldenError(f"{url} is a zarr group but not a vd golden: its vd metadata's 'format' is "
                              f"{meta.get('format')!r}, not {FORMAT!r}")
    return meta


@dataclass(frozen=True, slots=True)
class Peek:
    """What a local path holds, from its root ``zarr.json`` alone: ``absent``, ``golden`` (``meta`` its vd
    metadata), ``other`` (something that is not a golden: ``why``); ``remote`` for a URL (asked when opened)."""

    state: str
    meta: Mapping[str, Any] | None = None
    why: str | None = None


def stored_rows(meta: Mapping[str, Any]) -> bool:
    """Whether a golden with this vd metadata stores its rows (a slim golden does not); a ``rows`` entry that is
    not a mapping (the schema's to refuse, `vd.store.schema`) is read as the default, stored."""
    rows = meta.get("rows")
    return not isinstance(rows, Mapping) or rows.get("stored", True) is not False


def slim_refusal(url: str, meta: Mapping[str, Any], candidate: str | None = None) -> UsageError | None:
    """Why a refresh of the golden at ``url`` (its vd metadata ``meta``), or the promotion of a full ``candidate``
    over it, is refused where it is slim: it would put a full golden in the slim one's place, the full golden it
    was made from left behind, stale; the way on names both (`vd.workflow.refresh`). None for a full golden."""
    if stored_rows(meta):
        return None
    full = made_from(url, meta) or "FULL"
    of = f" of {full}" if full != "FULL" else ""
    how = ["vd", "refresh", full] + (["--from", candidate] if candidate is not None else [])
    return UsageError(f"{url} is slim (a vd slim form{of}), so a refresh would put a full golden in its place: "
                      f"refresh the full golden ({shlex.join(how)} --reason TEXT) and write its slim form again "
                      f"({shlex.join(['vd', 'slim', full, url])} --refresh)")


def made_from(url: str, meta: Mapping[str, Any]) -> str | None:
    """The full golden the slim golden at ``url`` (its vd metadata ``meta``) was made from, named from here: a
    path stored from the slim golden's folder (``"base": "slim"``) joined to it (relative to the working directory
    where it lies inside it); a path stored before that, as typed when it was made; None where none is stored."""
    slim_of = (meta.get("rows") or {}).get("slim_of")
    if not isinstance(slim_of, Mapping) or not slim_of.get("golden"):
        return None
    golden = slim_of["golden"]
    if slim_of.get("base") != "slim" or "://" in url:
        return str(golden)
    path = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(url)), str(golden)))
    here = os.path.relpath(path)
    return path if here.startswith("..") else here


def check_named(text: str) -> str:
    """``text``, a golden's path or URL, unless it is empty: ``Path("")`` is the working directory, never what an
    empty argument (an unset variable in a CI script, say) meant."""
    if not text:
        raise UsageError("'': an empty path names no golden")
    if _MISTYPED_URL.match(text):  # (a local folder named s3:, which a CI log shows as an upload)
        raise UsageError(f"{text}: a URL needs two slashes after its scheme (s3://bucket/prefix); a local path "
                         f"starting so: ./{text}")
    return text


_MISTYPED_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:(?!//)/|^[sS]3:(?!//)")


def peek(where: str | os.PathLike) -> Peek:
    """The golden (or not) at ``where``, a directory or a ``.zip`` file, read without zarr."""
    url = check_named(os.fspath(where))
    if "://" in url:
        return Peek("remote")
    path = Path(where)
    if not os.path.lexists(path):
        return Peek("absent")
    try:
        if path.is_dir():
            check_inside(path, "zarr.json", f"{url}/zarr.json")
            doc = read_regular(path / "zarr.json", f"{url}/zarr.json", limit=MAX_META)
        elif url.endswith(".zip") and _regular(path, url):
            if not zipfile.is_zipfile(path):  # a zip golden cut short (a copy, an upload) or another file
                return Peek("other", why=f"{url} is not a readable zip file (no zip directory at its end: "
                            "truncated, damaged or not a zip)")
            doc = _zip_member(path, "zarr.json", url)
        else:
            return Peek("other", why=f"{url} is not a vd golden (a golden is a zarr directory, a .zip file or an "
                        "s3:// prefix)")
        if doc is None:
            return Peek("other", why=f"{url} is not a vd golden (no zarr.json)")
        return Peek("golden", golden_meta(doc, url))
    except GoldenError as e:
        return Peek("other", why=str(e))
    except OSError as e:
        return Peek("other", why=f"{url} cannot be read: {e.strerror or e}")


def tensor_parallel(meta: Mapping[str, Any] | None) -> tuple[int, str | None]:
    """The degree over which a golden with metadata ``meta`` was recorded and its collectives (its environment's
    ``tp`` and ``collectives``): (1, None) for one process."""
    env = (meta or {}).get("environment") or {}
    tp, collectives = env.get("tp"), env.get("collectives")
    return (tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1 else 1,
            collectives if isinstance(collectives, str) else None)


def golden_over(path: str | os.PathLike, *, follow: bool = False) -> tuple[str, bool] | None:
    """The vd golden an output at the local ``path`` would be written into or over: ``(golden, itself)``,
    ``itself`` where ``path`` is that golden (replaced) rather than inside it; None where none is (or for a URL).
    Every ancestor is looked at, a directory holding a golden's ``zarr.json`` or a golden ``.zip``, both as
    written and with links resolved; ``path`` itself resolved where ``follow`` (a directory written into), else
    left a link (a file written by `vd.outputs.write_text` replaces a link at its path, never follows it)."""
    if "://" in str(path):
        return None
    given = Path(os.path.abspath(path))
    real = Path(os.path.realpath(given)) if follow else Path(os.path.realpath(given.parent)) / given.name
    for p in dict.fromkeys((given, real)):
        for where in (p, *p.parents):
            if where == p and not follow and os.path.islink(where):
                continue
            if peek(where).state == "golden":
                return str(where), where == p
    return None


def check_inside(root: str | os.PathLike, rel: str, name: str) -> None:
    """Refuse ``rel`` under the directory ``root`` where it is a symbolic link (or lies under one) that leads
    outside ``root``: a golden's files are its own (a link to ``/dev/zero``, or to another golden's file)."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(root, rel))
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise GoldenCorruptError(f"{name} is a symbolic link to {real}, outside the golden")


def _regular(path: Path, url: str) -> bool:
    """Whether ``path`` is a regular file (a link to one included); a FIFO or a device: refused, never opened."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise GoldenCorruptError(f"{url} is {file_kind(mode)}, not a regular file")
    return stat.S_ISREG(mode)


def check_member(name: str, where: str) -> None:
    """Refuse a golden's file name (a zip member, a manifest key) that could name a file outside the golden:
    an absolute one, one with a drive or a ``..`` part, or an empty one."""
    parts = name.replace("\\", "/").split("/")
    if not name or name.startswith(("/", "\\")) or ":" in parts[0] or ".." in parts:
        raise GoldenCorruptError(f"{where} holds a file named {name!r}, outside the golden: refused")


def check_zip_names(z: zipfile.ZipFile, where: str) -> None:
    """Refuse a zip golden whose member names repeat (a later copy shadows the one the manifest hashed) or
    escape it (`check_member`): checked once, when the zip is opened."""
    seen: set[str] = set()
    for name in z.namelist():
        check_member(name, where)
        if name in seen:
            raise GoldenCorruptError(f"{where} holds two members named {name!r} (one shadows the other): refused")
        seen.add(name)
    _check_zip_bounds(z, where)


def _check_zip_bounds(z: zipfile.ZipFile, where: str) -> None:
    """Refuse a zip golden holding bytes outside the archive vd wrote: before its first member (a file cat'ed in
    front, another zip) or after its end-of-archive record, which vd writes without a comment (anything
    appended). Its members and manifest still checked, so a user test's `verify` said "intact" of a file that
    is not what was written."""
    first = min((i.header_offset for i in z.infolist()), default=0)
    if first:
        raise GoldenCorruptError(f"{where} has {first} bytes before its first member, no part of a golden: refused")
    if z.fp is None:
        return
    z.fp.seek(0, os.SEEK_END)
    size = z.fp.tell()
    z.fp.seek(max(0, size - _EOCD))
    tail = z.fp.read(_EOCD)
    if len(tail) < _EOCD or tail[:4] != b"PK\x05\x06" or tail[-2:] != b"\x00\x00":
        raise GoldenCorruptError(f"{where} has bytes after its end-of-archive record, no part of a golden: refused")


_EOCD = 22  # bytes: a zip's end-of-central-directory record without a comment, the last of the file


def _zip_member(path: Path, key: str, url: str) -> bytes | None:
    """Member ``key`` of the zip golden at ``path`` (None where it has none); a zip damaged within (its directory
    or a member's header: what `zipfile` raises BadZipFile, NotImplementedError or EOFError for) refused as one."""
    try:
        with zipfile.ZipFile(path) as z:
            check_zip_names(z, url)
            try:
                info = z.getinfo(key)
            except KeyError:
                return None
            if info.file_size > MAX_META:
                raise GoldenCorruptError(f"{url}/{key} has {info.file_size} bytes, more than a golden's file may "
                                         f"({MAX_META})")
            return z.read(info)
    except (zipfile.BadZipFile, NotImplementedError, EOFError) as e:
        raise NotAGoldenError(f"{url} is not a readable zip file: {type(e).__name__}: {e}") from e


def recovered(where: str) -> bool:
    """A local golden that a publish killed mid-way left beside its path, put in place (`vd.store.atomic.recover`;
    imported only then: it brings zarr)."""
    if "://" in where:
        return False
    target = Path(os.path.realpath(where)) if os.path.islink(where) else Path(where)
    if not target.parent.is_dir() or not any(target.parent.glob(f".{target.name}.next-*")):
        return False
    from vd.store.atomic import recover

    return recover(target)


def check_readable(where: str) -> Mapping[str, Any] | None:
    """A golden to read: refused in one line where a local path holds none; its metadata (None for a URL)."""
    p = peek(where)
    if p.state == "absent" and recovered(where):
        p = peek(where)
    if p.state == "absent":
        from vd.errors import GoldenNotFoundError

        raise GoldenNotFoundError(f"{where} does not exist")
    if p.state == "other":
        raise NotAGoldenError(p.why)
    return p.meta


def check_target(url: str, state: str, refresh: bool) -> None:
    """Refuse a destination before any work (``state`` as `peek` or a store's location says): an existing golden
    without ``refresh``, or anything else already there (which even ``refresh`` never replaces)."""
    if state == "other":
        raise GoldenError(f"{url} exists and is not a vd golden; refusing to replace it")
    if state == "golden" and not refresh:
        raise GoldenExistsError(f"{url} already holds a golden; pass --refresh to replace it")
    if state == "absent" and url == "-":  # (standard output to a report's flag; here a directory named "-")
        raise UsageError("-: a golden is a directory, a .zip file or an s3:// prefix; it is not written to standard "
                         "output (name a path)")
    if state == "absent" and url.lower().endswith(_ARCHIVES):  # would be a directory of that name
        raise UsageError(f"{url}: vd writes a golden as a directory, a .zip file or an s3:// prefix, not a "
                         f"{next(a for a in _ARCHIVES if url.lower().endswith(a))} archive")
    if state == "absent" and "://" not in url and url.lower().endswith(".zip") and not url.endswith(".zip"):
        raise UsageError(f"{url}: a zip golden's name ends in .zip, in lower case; with {url[-4:]} vd would write "
                         "a directory of that name")


_ARCHIVES = (".tar.gz", ".tar.bz2", ".tar.xz", ".tar.zst", ".tar", ".tgz", ".gz", ".bz2", ".xz", ".zst", ".7z",
             ".rar")  # (a directory golden so named, made before, is still read and refreshed)


def check_widths(url: str, asked: Sequence[int], held: Sequence[int]) -> None:
    """Verify widths asked of a golden that it does not hold."""
    absent = [k for k in asked if k not in held]
    if absent:
        raise UsageError(f"{url} has no verify width {absent}; it holds K = {list(held)}")


MAX_K = 16  # the widest verify a recording takes, and a golden's reader allows (`vd.store.schema`)


def check_record_widths(ks: Sequence[int]) -> None:
    """The verify widths a recording is asked for, refused unless each is 2..`MAX_K`, once (before torch loads)."""
    if not ks:
        raise UsageError("--k needs at least one verify width")
    bad = [k for k in ks if not 2 <= k <= MAX_K]
    if bad:
        raise UsageError(f"verify width K must be 2..{MAX_K}; got {bad}")
    if len(set(ks)) != len(ks):
        raise UsageError(f"repeated verify width in --k {list(ks)}")


MAX_BATCH = 64  # sequences ``--batch`` may ask for


def check_batch(n: int | None, slot: int | None, seed: int | None = None, drafted: bool = False,
                recording: bool = False) -> None:
    """A batch plan (``--batch N``, ``--slot I``, ``--batch-seed S``; `vd.batch`) refused where it cannot run,
    before anything loads: a slot or seed without a batch, a size past `MAX_BATCH`, a slot outside the batch, a
    drafter golden or (``recording``) a drafter feed to record (its MTP head steps one sequence)."""
    if n is None:
        if slot is not None or seed is not None:
            raise UsageError(f"--{'slot' if slot is not None else 'batch-seed'} places the golden's sequence in a "
                             "batch: pass --batch N too")
        return
    if not 1 <= n <= MAX_BATCH:
        raise UsageError(f"--batch {n}: a batch holds 1 to {MAX_BATCH} sequences")
    if slot is not None and not 0 <= slot < n:
        raise UsageError(f"--slot {slot}: a batch of {n} has slots 0 to {n - 1}")
    if seed is not None and seed < 0:
        raise UsageError(f"--batch-seed {seed}: a seed is a non-negative integer")
    if drafted:
        whose, verb = ("the drafter feed's", "record") if recording else ("this golden's", "replay")
        raise UsageError(f"--batch runs a reference feed's steps in a batch; {whose} drafts come from an MTP head, "
                         f"which steps one sequence ({verb} it without --batch)")


def check_threads(threads: int | None) -> None:
    """Refuse a CPU thread count below 1 or above this machine's cores (torch crashes far above them)."""
    if threads is None:
        return
    cores = os.cpu_count() or 1
    if not 1 <= threads <= cores:
        raise UsageError(f"--threads must be 1 to {cores} (this machine's cores); got {threads}")


def cuda_here() -> bool | None:
    """Whether torch can run CUDA here, known without importing it: False where the installed torch is a CPU
    build or no CUDA driver loads, None where it may (torch itself decides)."""
    try:
        if "+cpu" in importlib.metadata.version("torch"):
            return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return None


def no_cuda(url: str, asked: str | None, recorded: str, cpu_forward_hint: str = "") -> UsageError:
    """The error for a CUDA device on a machine without one: the flag asked for it (``asked``), or the golden's
    recording did (``recorded``; ``cpu_forward_hint`` adds what else to pass)."""
    if asked is not None:
        return UsageError(f"--device {asked}: this machine has no CUDA device ({url} was recorded on {recorded})")
    return UsageError(f"{url} was recorded on {recorded} and this machine has no CUDA device; pass --device cpu to "
                      f"replay it on the CPU{cpu_forward_hint}")


# ``vd locate --between``: besides a second forward, an axis
DECODE = "decode"  # a forward's verify rows against its own one-token decode rows
BATCH = "batch:"  # ``--between batch:N``: the sequence alone against it as one member of a batch of N


def batch_size(between: str) -> int:
    """N of ``--between batch:N`` (2 .. `MAX_BATCH`), or a one-line `UsageError`."""
    n = between[len(BATCH):]
    if not n.isdigit() or not 2 <= int(n) <= MAX_BATCH:
        raise UsageError(f"--between {between}: batch:N takes a batch size N of 2 to {MAX_BATCH}")
    return int(n)


def untraced(where: str, flag: str = "") -> UsageError:
    """The refusal of ``vd locate`` (``flag`` empty) or ``--locate`` on a golden recorded without ``--trace``."""
    return UsageError(f"{flag + ': ' if flag else ''}{where} holds no module traces: record it with vd record "
                      f"--trace ({shlex.join(['vd', 'record', where, '--refresh', '--trace'])} --reason TEXT), or "
                      "compare two forwards here with vd locate --between NAME")


def axis(between: str | None) -> bool:
    """Whether ``--between`` names an axis (decode, batch:N) rather than a second forward."""
    return between is not None and (between == DECODE or between.startswith(BATCH))
