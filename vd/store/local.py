"""Goldens on a local file system: a directory (`Directory`) or one ``.zip`` file (`ZipFile`), each published
in one rename (`vd.store.atomic`), and the helpers an object store's location shares with them."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import zarr
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import Buffer
from zarr.core.sync import sync

from vd.errors import GoldenCorruptError, GoldenError, NotAGoldenError
from vd.preflight import MAX_FILE, MAX_META, check_inside, check_zip_names, file_kind, read_regular
from vd.store import atomic, manifest
from vd.store.format import FORMAT


def is_golden(doc: bytes | None) -> bool:
    """Whether ``doc`` (a root ``zarr.json``'s bytes, None where there is none) is a golden's of this format."""
    if doc is None:
        return False
    try:
        meta = json.loads(doc)["attributes"]["vd"]
    except (TypeError, ValueError, KeyError):
        return False
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def staged_keys(staged: Path) -> Iterator[str]:
    """The keys of a golden staged in a directory, its root ``zarr.json`` last."""
    keys = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    yield from (k for k in keys if k != "zarr.json")
    yield "zarr.json"


def _check_parent(path: Path) -> None:
    """Refuse, before any work, a destination whose folder cannot be created or written."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise GoldenError(f"cannot write {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise GoldenError(f"cannot write {path}: {parent} is not writable")


def _read(path: Path, name: str, dir_fd: int | None = None) -> bytes | None:
    """A file's bytes (None where absent or a directory); anything but a regular file of bounded size refused
    (`vd.preflight.read_regular`)."""
    limit = MAX_META if path.name == "zarr.json" else MAX_FILE
    return read_regular(path, name, dir_fd=dir_fd, limit=limit)


class _LocalStore(zarr.storage.LocalStore):
    """zarr's ``LocalStore``, each key it reads checked first to be a regular file inside the golden (zarr
    reads the chunks of an array whose metadata vd does not read itself: `vd.store.chunks.Array`)."""

    async def get(self, key, prototype=None, byte_range=None):
        name = f"{self.root}/{key}"
        check_inside(self.root, key, name)
        try:
            mode = os.stat(self.root / key).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            raise GoldenCorruptError(f"{name} is {file_kind(mode)}, not a regular file")
        return await super().get(key, prototype, byte_range)


class Directory:
    """A golden as a directory (a zarr ``LocalStore``). Its first read opens the version then at the path and
    every later read comes from that version (`vd.store.atomic.hold`), whatever a refresh publishes meanwhile;
    writing goes through the symlink when the path is one, to the directory it names."""

    def __init__(self, path: Path):
        self.path, self.url = path, str(path)
        self._fd: int | None = None
        self._inside: set[str] = set()  # folders found inside the golden (`_check_links`)

    @property
    def target(self) -> Path:
        """The path written: the directory a symlink at ``path`` names, else ``path``."""
        return Path(os.path.realpath(self.path)) if self.path.is_symlink() else self.path

    def _held(self) -> int | None:
        if self._fd is None and self.path.is_dir():
            self._fd = atomic.hold(self.path)
            self._inside = set()
        return self._fd

    def _check_links(self, key: str, fd: int) -> None:
        """Refuse a key that is, or lies under, a symbolic link leading outside the golden: one ``lstat`` for
        the file, one for each folder the first time it is met."""
        parts = key.split("/")
        for i in range(1, len(parts) + 1):
            rel = "/".join(parts[:i])
            if i < len(parts) and rel in self._inside:
                continue
            try:
                mode = os.lstat(rel, dir_fd=fd).st_mode
            except (FileNotFoundError, NotADirectoryError):
                return  # absent: get says so
            if stat.S_ISLNK(mode):
                check_inside(self.path, rel, f"{self.url}/{rel}")
            if i < len(parts):
                self._inside.add(rel)

    def get(self, key):
        # What LocalStore.get does, without its event-loop round trip (a GPU replay reads many small arrays).
        fd = self._held()
        if fd is None:
            return None
        self._check_links(key, fd)
        return _read(Path(key), f"{self.url}/{key}", fd)

    def sizes(self):
        fd = self._held()
        if fd is None:
            return None
        out = {}
        for root, dirs, files, rfd in os.fwalk(".", dir_fd=fd):
            out.update((os.path.normpath(os.path.join(root, name)), manifest.DIRECTORY) for name in dirs)
            for name in files:
                key = os.path.normpath(os.path.join(root, name))
                st = os.stat(name, dir_fd=rfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):  # a link: inside the golden, to a regular file (`_read`)
                    check_inside(self.path, key, f"{self.url}/{key}")
                    try:
                        st = os.stat(name, dir_fd=rfd)
                    except OSError as e:  # it leads nowhere, or round in a loop (ELOOP)
                        raise GoldenCorruptError(f"{self.url}/{key} is a symbolic link to "
                                                 f"{os.readlink(name, dir_fd=rfd)}, which "
                                                 + ("does not exist" if isinstance(e, FileNotFoundError)
                                                    else f"cannot be read: {e.strerror or e}")) from None
                if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
                    raise GoldenCorruptError(f"{self.url}/{key} is {file_kind(st.st_mode)}, not a regular file")
                out[key] = st.st_size
        return out

    def store(self):
        return _LocalStore(self.path, read_only=True)

    def state(self):
        if not self.path.exists() and not self.path.is_symlink():
            return "absent"
        if not self.path.is_dir():
            return "other"
        try:
            check_inside(self.path, "zarr.json", f"{self.url}/zarr.json")
            return "golden" if is_golden(_read(self.path / "zarr.json", f"{self.url}/zarr.json")) else "other"
        except GoldenError:
            return "other"

    def staging(self):
        target = self.target
        _check_parent(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.parent / f".{target.name}.partial-{uuid.uuid4().hex[:8]}"
        staged.mkdir()
        return staged

    def writer(self):
        _check_parent(self.target)
        return atomic.writer_lock(self.target)

    def wait_writer(self, timeout):
        return atomic.wait_writer(self.target, timeout)

    def publish(self, staged, replace):
        old = atomic.replace(staged, self.target)
        self.close()  # later reads open the new version
        if old is not None and atomic.unused(old):  # else the next writer's clean removes it
            # Removed beside the caller, who has its golden in place already; the thread is not a daemon, so
            # the process finishes the removal before it exits.
            t = threading.Thread(target=shutil.rmtree, args=(old,), kwargs={"ignore_errors": True},
                                 name="vd-remove-replaced")
            t.start()
            _REMOVING.append(t)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()

    def nbytes(self):
        return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())


_REMOVING: list[threading.Thread] = []  # replaced versions being removed (`Directory.publish`)


def finish_removals() -> None:
    """Wait until the replaced versions this process is removing are gone."""
    while _REMOVING:
        _REMOVING.pop().join()


class ZipFile:
    """A golden as one ``.zip`` file (zarr's ``ZipStore``, members stored uncompressed: the chunks are
    compressed already)."""

    def __init__(self, path: Path):
        self.path, self.url = path, str(path)
        self._store: zarr.storage.ZipStore | None = None

    def store(self):
        """The zip opened for reading, its member names checked once (`vd.preflight.check_zip_names`)."""
        if self._store is None:
            store = sync(zarr.storage.ZipStore.open(self.path, mode="r"))
            try:
                check_zip_names(store._zf, self.url)
            except BaseException:
                store.close()
                raise
            self._store = store
        return self._store

    def get(self, key):
        if not self.path.is_file():
            return None
        try:
            buf = sync(self.store().get(key, default_buffer_prototype()))  # opening it may fail too
        except GoldenError:
            raise
        except Exception as e:  # not a zip file, or a damaged one (zipfile.BadZipFile and kin)
            raise NotAGoldenError(f"{self.path} is not a readable zip file: {type(e).__name__}: {e}") from e
        return None if buf is None else buf.to_bytes()

    def state(self):
        if not self.path.exists() and not self.path.is_symlink():
            return "absent"
        if not self.path.is_file():
            return "other"
        try:
            return "golden" if is_golden(self.get("zarr.json")) else "other"
        except GoldenError:
            return "other"

    def staging(self):
        _check_parent(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{self.path.name}.partial-", dir=self.path.parent))

    def publish(self, staged, replace):
        tmp = self.path.parent / f".{self.path.name}.partial-{uuid.uuid4().hex[:8]}.zip"
        try:
            out = sync(zarr.storage.ZipStore.open(tmp, mode="w"))
            for key in staged_keys(staged):
                sync(out.set(key, Buffer.from_bytes((staged / key).read_bytes())))
            out.close()
            if self._store is not None:
                self._store.close()
                self._store = None
            os.replace(tmp, self.path)  # one rename: the old zip until here, the new one after
        finally:
            tmp.unlink(missing_ok=True)
            shutil.rmtree(staged, ignore_errors=True)

    def nbytes(self):
        return self.path.stat().st_size

    def sizes(self):
        if not self.path.is_file():
            return None
        zf = getattr(self.store(), "_zf", None)  # ZipStore's zipfile.ZipFile: the members' sizes at no cost
        if zf is None:
            return None
        try:
            return {i.filename: i.file_size for i in zf.infolist() if not i.is_dir()}
        except Exception as e:  # not a zip file, or a damaged one
            raise NotAGoldenError(f"{self.path} is not a readable zip file: {type(e).__name__}: {e}") from e

    def writer(self):
        _check_parent(self.path)
        return atomic.writer_lock(self.path)

    def wait_writer(self, timeout):
        return atomic.wait_writer(self.path, timeout)

    def close(self):
        if self._store is not None:
            self._store.close()
            self._store = None
