"""A golden under an object-store prefix, ``s3://bucket/prefix`` (zarr's ``FsspecStore`` over s3fs), kept whole
where nothing renames:

* **Publishing** (`ObjectPrefix.publish`): the root ``zarr.json`` is first overwritten by a *placeholder*, a
  zarr group whose only attribute, ``vd_partial``, names the writer (host, process, start time); then every
  other key is uploaded, the replaced golden's keys the new one lacks are deleted, and the real root is
  written last. At no moment does the prefix open as a golden mixing two versions, and a write that died
  leaves the placeholder, which says who was writing.
* **Reading one version**: the first read copies the golden into a local temporary directory (the root, every
  key, then the root again; if the root changed meanwhile a publish began, and the copy is taken again), and
  every later read comes from that copy, whatever is published meanwhile: the guarantee `vd.store.atomic.hold`
  gives a directory golden. A reader that finds the placeholder waits for the publish to finish, at most
  ``VD_S3_WAIT_S`` seconds (default 60), then says who was writing (exit 2).
* **One writer** (`ObjectPrefix.writer`): ``.NAME.lock`` beside the prefix, created by a conditional put
  (``If-None-Match: *``); a second writer is refused at once (exit 2). A lock left by a killed writer on this
  host (its process gone) is taken over; one left on another host is named in the error, to be deleted by
  hand, since nothing tells a slow writer from a dead one there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import zarr
from zarr.abc.store import Store
from zarr.core.buffer import default_buffer_prototype
from zarr.core.buffer.cpu import Buffer
from zarr.core.sync import sync

from vd.errors import GoldenBusyError, GoldenError, NotAGoldenError, UsageError, naming
from vd.store.local import Directory, is_golden, staged_keys

WAIT_ENV, PARTIAL = "VD_S3_WAIT_S", "vd_partial"
_PARALLEL = 16  # requests in flight while copying or uploading a golden


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
            "since": datetime.now(UTC).isoformat(timespec="seconds")}


def _attributes(doc: bytes | None) -> dict:
    if doc is None:
        return {}
    try:
        attrs = json.loads(doc)["attributes"]
    except (TypeError, ValueError, KeyError):
        return {}
    return attrs if isinstance(attrs, dict) else {}


def _who(holder: dict) -> str:
    return f"{holder.get('host', '?')} pid {holder.get('pid', '?')} since {holder.get('since', '?')}"


def _lock(store) -> str:
    """The writers' lock object beside the golden under ``store``'s prefix (`ObjectPrefix.writer`)."""
    parent, _, name = store.path.rpartition("/")
    return f"{parent}/.{name}.lock"


def _dead_here(holder: dict) -> bool:
    """Whether ``holder`` was a process of this host that no longer runs."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _wait_s() -> float:
    text = os.environ.get(WAIT_ENV, "60")
    try:
        return max(0.0, float(text))
    except ValueError:
        raise UsageError(f"{WAIT_ENV}={text!r} is not a number of seconds") from None


_CREDENTIALS_HELP = ("S3 credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                     "~/.aws/credentials")


TIMEOUT_ENV = "VD_S3_TIMEOUT_S"


def _timeouts() -> dict:
    """s3fs's client settings: a connection and each read given ``VD_S3_TIMEOUT_S`` seconds (default 20; botocore
    waited 60 on each of its attempts and s3fs tried five times, so a hung endpoint held a command for minutes
    without a word), tried twice by each."""
    raw = os.environ.get(TIMEOUT_ENV, "20")
    try:
        seconds = float(raw)
        if not 0 < seconds < 1e6:
            raise ValueError
    except ValueError:
        raise UsageError(f"{TIMEOUT_ENV}={raw!r}: give seconds, a number above 0") from None
    return {"config_kwargs": {"connect_timeout": seconds, "read_timeout": seconds,
                              "retries": {"max_attempts": 2, "mode": "standard"}}}


def _failure(what: str, e: Exception) -> GoldenError:
    """The one line for an S3 call that failed: ``what`` ("read s3://…"), the error, and where credentials come
    from when none were found."""
    first = str(e).splitlines()[0] if str(e) else ""
    hint = f" ({_CREDENTIALS_HELP})" if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError") else ""
    if "Timeout" in type(e).__name__:
        hint = f" (the endpoint did not answer; each try waits {TIMEOUT_ENV} seconds)"
    return GoldenError(f"cannot {what}: {type(e).__name__}: {first}{hint}")


async def _all(coros: list) -> list:
    """Every coroutine run at once, their results; the first failure cancels the others and is raised once they are
    over. (`asyncio.gather` left them running: an upload whose server died printed a traceback per key still in
    flight when the process ended, a user test found.)"""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as e:
        first: BaseException = e
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


class ObjectPrefix:
    """A golden under ``s3://bucket/prefix`` (see the module's docstring)."""

    def __init__(self, url: str):
        self._copy: Directory | None = None
        self.url = url.rstrip("/")
        bucket, _, prefix = self.url[len("s3://"):].partition("/")
        if not bucket or not prefix:
            raise UsageError(f"{url}: an S3 golden needs a bucket and a prefix (s3://bucket/path/name.zarr)")
        if "" in prefix.split("/"):  # (written, then listed under another prefix than read: a golden never found)
            raise UsageError(f"{url}: an empty folder in an S3 prefix ('//'): s3://bucket/path/name.zarr")
        self._stores: dict[bool, Store] = {}

    # -- the live prefix ------------------------------------------------------------------------------------

    def _store(self, read_only: bool):
        if read_only not in self._stores:
            try:
                import s3fs  # noqa: F401  (zarr's FsspecStore needs it for s3://)
            except ImportError as e:
                raise UsageError(f"{self.url}: S3 goldens need s3fs (pip install 'vd-goldens[s3]')") from e
            store = zarr.storage.FsspecStore.from_url(self.url, read_only=read_only, storage_options=_timeouts())
            store.fs.retries = 2  # (s3fs's own, around botocore's: 5 by default, each waiting out a timeout)
            self._stores[read_only] = store
        return self._stores[read_only]

    def _call(self, what: str, coro):
        try:
            return sync(coro)
        except GoldenError:
            raise
        except Exception as e:  # network, credentials, a missing bucket: one line naming the URL
            raise _failure(f"{what} {self.url}", e) from e

    def _live(self, key: str) -> bytes | None:
        buf = self._call("read", self._store(True).get(key, default_buffer_prototype()))
        return None if buf is None else buf.to_bytes()

    def _list(self) -> list[str]:
        store = self._store(True)
        store.fs.invalidate_cache(store.path)  # another process may have written since this one listed

        async def keys():
            return [k async for k in store.list()]

        return self._call("list", keys())

    # -- reading one version --------------------------------------------------------------------------------

    def _opened(self) -> Directory | None:
        """The local copy of the version read (taken at the first read); None when no golden is there."""
        if self._copy is not None:
            return self._copy
        wait = _wait_s()
        deadline, pause = time.monotonic() + wait, 0.1
        while True:
            root = self._live("zarr.json")
            if root is None:
                return None  # nothing there, or not a golden: `state` says which
            holder = _attributes(root).get(PARTIAL)
            if not isinstance(holder, dict):
                copy = self._take(root) if is_golden(root) else self._only_root(root)  # the reader says what it is
                if copy is not None:
                    self._copy = copy
                    return copy
            if isinstance(holder, dict) and _dead_here(holder):  # nothing to wait for: its writer is gone
                raise NotAGoldenError(f"{self.url} holds a write cut short: its writer, {_who(holder)}, no longer "
                                      "runs; write it again (vd record --refresh, vd pack SOURCE DEST --refresh)")
            if time.monotonic() >= deadline:
                what = (f"is being written by {_who(holder)}, or that write was interrupted" if isinstance(holder, dict)
                        else "kept changing while it was read (a refresh is publishing it)")
                raise NotAGoldenError(f"{self.url} {what}: waited {wait:.0f} s ({WAIT_ENV}); write it again (vd "
                                      "record --refresh, vd pack SOURCE DEST --refresh) if the writer died")
            time.sleep(pause)
            pause = min(2.0, pause * 2)

    def _take(self, root: bytes) -> Directory | None:
        """Copy every key of the golden whose root is ``root`` into a temporary directory; None (and nothing
        kept) when the root changed meanwhile."""
        # A key ending in "/" is a folder marker (the AWS console's "Create folder", rclone), no file of a golden:
        # read, it is nothing, which looked like a publish under way until VD_S3_WAIT_S ran out.
        keys = [k for k in self._list() if k != "zarr.json" and k and not k.endswith("/")]
        where = Path(tempfile.mkdtemp(prefix="vd-s3-"))
        store = self._store(True)
        limit = asyncio.Semaphore(_PARALLEL)

        async def one(key: str) -> bool:
            async with limit:
                buf = await store.get(key, default_buffer_prototype())
            if buf is None:
                return False  # deleted since listed: a publish is under way
            path = where / key
            path.parent.mkdir(parents=True, exist_ok=True)
            with naming(path):
                path.write_bytes(buf.to_bytes())
            return True

        async def every() -> bool:
            return all(await _all([one(k) for k in keys]))

        try:
            complete = self._call("read", every())
        except BaseException:
            shutil.rmtree(where, ignore_errors=True)
            raise
        if complete and self._live("zarr.json") == root:
            (where / "zarr.json").write_bytes(root)
            return Directory(where)
        shutil.rmtree(where, ignore_errors=True)
        return None

    @staticmethod
    def _only_root(root: bytes) -> Directory:
        where = Path(tempfile.mkdtemp(prefix="vd-s3-"))
        (where / "zarr.json").write_bytes(root)
        return Directory(where)

    def root(self) -> bytes | None:
        """The root ``zarr.json`` at the prefix now (None: none), read without copying the golden (one GET)."""
        return self._live("zarr.json")

    def get(self, key):
        copy = self._opened()
        return None if copy is None else copy.get(key)

    def store(self):
        copy = self._opened()
        if copy is None:
            raise NotAGoldenError(f"{self.url} is not a vd golden (no zarr.json)")
        return copy.store()

    def sizes(self):
        copy = self._opened()
        return None if copy is None else copy.sizes()

    def close(self):
        """Let go of the copy read (a later read copies the version then at the prefix)."""
        if self._copy is not None:
            self._copy.close()
            shutil.rmtree(self._copy.path, ignore_errors=True)
            self._copy = None

    def __del__(self):
        self.close()

    # -- writing -------------------------------------------------------------------------------------------

    def state(self):
        root = self._live("zarr.json")
        if root is None:
            return "other" if self._list() else "absent"
        if isinstance(_attributes(root).get(PARTIAL), dict):
            return "partial"  # a publish under way or interrupted: no golden to lose, a writer may replace it
        return "golden" if is_golden(root) else "other"

    def staging(self):
        return Path(tempfile.mkdtemp(prefix="vd-golden-"))

    def publish(self, staged, replace):
        store = self._store(False)
        placeholder = {"zarr_format": 3, "node_type": "group", "attributes": {PARTIAL: _holder()}}
        limit = asyncio.Semaphore(_PARALLEL)

        async def put(key: str) -> None:
            async with limit:
                await store.set(key, Buffer.from_bytes((staged / key).read_bytes()))

        try:
            old = set(self._list())
            # From here on the prefix opens as no golden until the new root is written.
            self._call("write", store.set("zarr.json", Buffer.from_bytes(json.dumps(placeholder).encode())))
            keys = list(staged_keys(staged))

            async def upload():
                await _all([put(k) for k in keys[:-1]])

            self._call("write", upload())
            for key in sorted(old - set(keys)):  # the replaced golden's keys this one has not
                self._call("write", store.delete(key))
            self._call("write", put("zarr.json"))
        finally:
            shutil.rmtree(staged, ignore_errors=True)
            self.close()  # later reads copy the new version

    def nbytes(self):
        async def total():
            store = self._store(True)
            return await store.getsize_prefix("")

        return int(self._call("measure", total()))

    @contextlib.contextmanager
    def writer(self) -> Iterator[None]:
        """The only writer of this golden for the block (see the module's docstring)."""
        store = self._store(False)
        lock = _lock(store)
        lock_url = f"s3://{lock}"
        mine = _holder()
        for _ in range(2):
            try:
                self._call("lock", store.fs._pipe_file(lock, json.dumps(mine).encode(), mode="create"))
                held = self._lock_holder(store, lock)
                if held is None or held.get("token") != mine["token"]:  # a store that ignores If-None-Match
                    raise GoldenBusyError(f"{self.url} is being written by another vd process ({_who(held or {})}; "
                                          f"it holds {lock_url}); try again when it has finished")
                break
            except GoldenError:
                held = self._lock_holder(store, lock)
                if held is None:
                    raise  # not refused for an existing lock: the store's own error
                if not _dead_here(held):
                    raise GoldenBusyError(f"{self.url} is being written by another vd process ({_who(held)}; it "
                                          f"holds {lock_url}); try again when it has finished, or delete {lock_url} "
                                          "if that process is gone") from None
                self._call("lock", store.fs._rm_file(lock))  # its writer died on this host: take it over
        else:
            raise GoldenBusyError(f"{self.url}: cannot take {lock_url} (another writer took it first)")
        try:
            yield
        finally:
            held = self._lock_holder(store, lock)
            if held is not None and held.get("token") == mine["token"]:
                self._call("unlock", store.fs._rm_file(lock))

    def wait_writer(self, timeout):
        store = self._store(False)
        deadline = time.monotonic() + timeout
        while (held := self._lock_holder(store, _lock(store))) is not None and not _dead_here(held):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)
        return True

    def _lock_holder(self, store, lock: str) -> dict | None:
        try:
            doc = sync(store.fs._cat_file(lock))
        except FileNotFoundError:
            return None
        except Exception as e:
            raise _failure(f"read {self.url} (its writers' lock s3://{lock})", e) from e
        try:
            held = json.loads(doc)
        except ValueError:
            held = {}
        return held if isinstance(held, dict) else {}
