"""Writing a golden (`GoldenWriter`): staged in a local directory while it is recorded, published complete.

Each K's prefill and verify rows arrive while the K runs (`KStream`): on CUDA each block is copied into a
page-locked host buffer on the computing stream and a writer thread encodes and stores it once the copy
is done, so neither the copy nor the encoding holds up the next step; on the CPU everything is written in
line (a thread would take the cores the model runs on). `GoldenWriter.publish` writes the prompt and the
metadata, ``complete`` set last, and hands the staged golden to its `vd.store.location.Location`, which
puts it in place whole. Nothing reaches the destination before that; `GoldenWriter.abort` (or leaving a
``with`` block on an error) removes the staged copy, so an existing golden is never touched by a failed
recording. Rows are stored as byte planes (`vd.store.format`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zarr

from vd import digest as _digest
from vd.dtypes import to_storage, to_tensor
from vd.errors import GoldenError, GoldenExistsError
from vd.layout import RowLayout, StepLog
from vd.store import format as F
from vd.store import history, manifest
from vd.store.chunks import chunk_key, encode_chunk
from vd.store.location import Location, locate

# Threads encoding and writing a CUDA recording's chunks while it runs (zstd runs without the interpreter
# lock); a CPU recording writes in line, as a thread would take the cores the model runs on.
WRITERS = max(1, min(4, (os.cpu_count() or 2) - 1))


def check_target(location: Location, refresh: bool) -> None:
    """Refuse a record destination before any work: an existing golden without ``refresh``, or anything
    else already there (which even ``refresh`` never replaces)."""
    state = location.state()
    if state == "other":
        raise GoldenError(f"{location.url} exists and is not a vd golden; refusing to replace it")
    if state == "golden" and not refresh:
        raise GoldenExistsError(f"{location.url} already holds a golden; pass --refresh to replace it")


def _array(group: zarr.Group, name: str, shape, dtype, chunks, codecs: list) -> zarr.Array:
    """A golden array: every chunk written, even one that holds only zeros."""
    return group.create_array(name, shape=shape, dtype=dtype, chunks=chunks, compressors=codecs, fill_value=0,
                              config={"write_empty_chunks": True})


class _RowArray:
    """Row array ``name`` of the K group staged at ``where``: its two byte planes' chunks encoded and written
    straight to their files, the bytes zarr's codecs would write (`vd.store.chunks.encode_chunk`), so that
    several chunks can be encoded at once (zstd runs without the interpreter lock); its metadata is made
    through zarr (`create`)."""

    def __init__(self, where: Path, name: str, shape: tuple[int, ...], chunk_rows: int, itemsize: int,
                 put: Callable[[Path, bytes], None]):
        self.where, self.name, self.shape, self.rows, self.itemsize = where, name, shape, chunk_rows, itemsize
        self.put = put  # writes a file of the staged golden (`GoldenWriter._put`)

    def write(self, first: int, data: np.ndarray) -> None:
        """Rows ``first ..`` of the array as stored (``first`` on a chunk boundary; the last chunk padded with
        the fill value, as zarr stores it)."""
        hi, lo = F.split_planes(data)
        for (plane, compressor), part in zip(((".hi", "zstd"), (".lo", None)), (hi, lo)):
            for j in range(0, len(part), self.rows):
                block = part[j:j + self.rows]
                if len(block) < self.rows:
                    block = np.concatenate([block, np.zeros((self.rows - len(block), *block.shape[1:]), np.uint8)])
                self.put(self.where / f"{self.name}{plane}" / chunk_key((first + j) // self.rows, block.ndim),
                         encode_chunk(block, compressor))

    def create(self, group: zarr.Group) -> None:
        """The two planes' zarr metadata (their chunks are `write`'s)."""
        hi, lo = F.planes(self.name)
        chunks = (self.rows, *self.shape[1:])
        _array(group, hi, self.shape, "u1", chunks, F.hi_codecs())
        _array(group, lo, (*self.shape, self.itemsize - 1), "u1", (*chunks, self.itemsize - 1), F.plain_codecs())


def _row_arrays(where: Path, layout: RowLayout, vocab: int, itemsize: int, put: Callable[[Path, bytes], None]
                ) -> dict[str, _RowArray]:
    """K's row arrays, by name."""
    chunks = F.row_chunks(layout, vocab, itemsize)
    return {name: _RowArray(where, name, shape, chunks[name][0], itemsize, put)
            for name, shape in F.row_shapes(layout, vocab).items()}


class GoldenWriter:
    """Writes a golden for ``where`` (a path or URL: `vd.store.location.locate`), one K at a time, on a
    background thread when ``background``, then publishes it (see the module's docstring).

    `stream` takes a K's rows step by step while it runs; `add` a whole K at once.
    """

    def __init__(self, where: str | os.PathLike | Location, *, refresh: bool = False, background: bool = True):
        self.location = where if isinstance(where, Location) else locate(where)
        check_target(self.location, refresh)
        self.refresh, self.background = refresh, background
        self.staged = self.location.staging()
        try:
            self.root = zarr.create_group(zarr.storage.LocalStore(self.staged), zarr_format=3)
        except BaseException:  # SIGTERM (SystemExit) or an error before the writer exists to abort itself
            shutil.rmtree(self.staged, ignore_errors=True)
            raise
        self._pool = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="vd-writer")
        self._futures = []
        self.logs: list[StepLog] = []
        self.digests: dict[int, np.ndarray] = {}
        self.journal = None  # a `vd.store.journal.Journal` the recorder sets: every block written goes into it
        self.stored_rows = True
        self.known: dict[str, list] = {}  # files written whole by this writer: [size, SHA-256] for the manifest
        self._groups: dict[int, object] = {}  # each K's group, made (or being made: a Future) ahead of its end
        self._prompt: list[int] | None = None  # written ahead by `write_prompt`

    def write_prompt(self, prompt: list[int]) -> None:
        """The prompt's array, written now (on the writer's thread where it works in the background) rather
        than at `publish`, which must then be given the same prompt."""
        self._prompt = list(prompt)
        self._submit(self._write_prompt, self._prompt)

    def _write_prompt(self, prompt: list[int]) -> None:
        tokens = np.asarray(prompt, dtype=np.int32)
        _array(self.root, "prompt", tokens.shape, "<i4", (max(len(prompt), 1),), F.plain_codecs())[...] = tokens

    def _submit(self, fn: Callable, *args) -> None:
        if self.background:
            self._futures.append(self._pool.submit(fn, *args))
        else:
            fn(*args)

    def stream(self, layout: RowLayout, vocab: int, dtype: torch.dtype, device: torch.device | None = None
               ) -> KStream:
        """A K whose prefill and verify rows arrive while it runs (`KStream.put`), the rest when it ends
        (`KStream.finish`); ``device``: where they are computed (on CUDA, step buffers are made ahead)."""
        return KStream(self, layout, vocab, dtype, device)

    def add(self, layout: RowLayout, log: StepLog, rows: Mapping[str, np.ndarray] | None,
            summary: tuple[np.ndarray, np.ndarray] | None = None, drafts: np.ndarray | None = None) -> None:
        """Queue a whole K: its step log, its rows by kind as stored (None: a slim golden's K, which stores
        none), their digests and statistics (computed from ``rows`` when None) and, for the drafter feed,
        the head's drafts."""
        if summary is None:
            summary = _digest.summarise({kind: to_tensor(a) for kind, a in rows.items()})
        if rows is None:
            self.stored_rows = False
        self._submit(self._write_k, layout, log, rows, summary, drafts)

    def _put(self, path: Path, data: bytes) -> None:
        """Write a file of the staged golden whole, and remember its size and hash (`seal` lists it without
        reading it back)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        self.known[path.relative_to(self.staged).as_posix()] = [len(data), manifest.file_digest(data)]

    def prepare_k(self, layout: RowLayout, arrays: list[_RowArray]) -> None:
        """Make K's group and its arrays' metadata now (on the writer's thread, while K runs), so that its end
        writes only the step log, digests and statistics."""
        if self.background:
            self._groups[layout.k] = future = self._pool.submit(self._make_k, layout, arrays)
            self._futures.append(future)  # waited for by `publish` and `abort` as every other write
        else:
            self._groups[layout.k] = self._make_k(layout, arrays)

    def _make_k(self, layout: RowLayout, arrays: list[_RowArray]) -> zarr.Group:
        g = self.root.create_group(f"k{layout.k}")
        for a in arrays:
            a.create(g)
        shapes = F.small_shapes(layout)
        for name in (*F.step_log_arrays(F.FORMAT_VERSION), *F.SUMMARY, *(["drafts"] if layout.drafted else [])):
            shape = shapes[name]
            _array(g, name, shape, F.SMALL_DTYPES[name], tuple(max(n, 1) for n in shape), F.plain_codecs())
        return g

    def _write_k(self, layout, log, rows, summary, drafts) -> None:
        arrays = []
        if rows is not None:
            vocab, itemsize = rows["prefill"].shape[1], rows["prefill"].dtype.itemsize
            row_arrays = _row_arrays(self.staged / f"k{layout.k}", layout, vocab, itemsize, self._put)
            for name, data in F.to_arrays(layout, rows, vocab).items():
                row_arrays[name].write(0, data)
                arrays.append(row_arrays[name])
        self._finish_k(layout, arrays, log, summary, drafts)

    def _finish_k(self, layout: RowLayout, arrays: list[_RowArray], log: StepLog,
                  summary: tuple[np.ndarray, np.ndarray], drafts: np.ndarray | None) -> None:
        """K's group (made now unless `prepare_k` made it): its step log, its rows' digests and statistics, the
        drafter's drafts, written as their one chunk each, and its attributes."""
        k = layout.k
        g = self._groups.pop(k, None)
        if g is None:
            g = self._make_k(layout, arrays)
        elif not isinstance(g, zarr.Group):
            g = g.result()
        small = {**{n: getattr(log, n) for n in F.step_log_arrays(F.FORMAT_VERSION)}, "digests": summary[0],
                 "stats": summary[1], **({"drafts": drafts} if drafts is not None else {})}
        for name, data in small.items():
            data = np.ascontiguousarray(data, dtype=F.SMALL_DTYPES[name])
            self._put(self.staged / f"k{k}" / name / chunk_key(0, data.ndim), encode_chunk(data, None))
        self.digests[k] = summary[0]
        g.attrs.update({"k": log.k, "steps": int(log.accepted.shape[0]), "bootstrap": int(log.bootstrap),
                        "committed_is_greedy": log.committed_is_greedy, "decoded": log.decoded})
        self.logs.append(log)
        if self.journal is not None:
            self.journal.finished(k, log.tokens, log.accepted)

    def _drain(self) -> None:
        try:
            for f in self._futures:
                f.result()
        finally:
            self._futures = []

    def add_file(self, key: str, data: bytes) -> None:
        """A file of the golden beside its arrays (``key`` relative to its root), covered by its manifest."""
        self._put(self.staged / key, data)

    def publish(self, meta: Mapping, prompt: list[int], *, reason: str = "first recording") -> None:
        """Wait for everything queued, write the prompt and the metadata (``complete`` last), and put the
        golden in place. The metadata gets the golden's content digest and, unless ``meta`` brings a
        ``history`` already (a slim form's, a refresh's), its first history entry, giving ``reason``; then
        the manifest of every file and the golden's ID (`seal`)."""
        try:
            self._drain()
            if self._prompt is None:
                self._write_prompt(prompt)
            elif self._prompt != list(prompt):
                raise ValueError("publish was given another prompt than write_prompt")
            full = dict(meta)
            scheme = F.digest_meta(full.get("vocab_size"), (full.get("logits") or {}).get("dtype"))
            full.update(digest=scheme, logs={str(log.k): log.to_json() for log in sorted(self.logs, key=lambda x: x.k)},
                        prompt_tokens=[int(t) for t in prompt], format=F.FORMAT, format_version=F.FORMAT_VERSION,
                        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
            full.setdefault("rows", {"stored": self.stored_rows})
            full["content_digest"] = F.content_digest(full, prompt, {log.k: log for log in self.logs}, self.digests)
            if not full.get("history"):
                full["history"] = [history.entry(full, full["content_digest"], reason=reason)]
            stable, volatile = F.split_volatile(json.loads(json.dumps(full, default=str)))
            self.root.create_group(F.RUN_GROUP, attributes={"vd_run": volatile})
            seal(self.root, self.staged, stable, known=self.known)
            self.location.publish(self.staged, self.refresh)
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop and remove the staged copy (a no-op after `publish`)."""
        try:
            self._drain()
        except Exception:  # the copy is being thrown away; its write error does not matter now
            pass
        self._pool.shutdown(wait=True)
        if self.staged.exists():
            shutil.rmtree(self.staged, ignore_errors=True)
            # A zarr write still in flight on zarr's event-loop thread (the caller interrupted by SIGTERM while
            # it waited for one) can land after the removal and make the folder again: remove it once more.
            time.sleep(0.05)
            shutil.rmtree(self.staged, ignore_errors=True)

    def __enter__(self) -> GoldenWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


def seal(root: zarr.Group, staged: Path, meta: Mapping, known: Mapping[str, list] | None = None) -> None:
    """Write the root metadata of the golden staged at ``staged`` (its group ``root``): ``meta`` with the
    manifest of every other file (``known``: files a writer hashed as it wrote them; `vd.store.manifest`), the
    golden's ID hashed from both, and ``complete``, in one write: the folder is not the golden until it is
    put in place, and an object store uploads the root last (`vd.store.objects`)."""
    meta = {k: v for k, v in meta.items() if k not in ("complete", "golden_id", "manifest")}
    meta["manifest"] = manifest.build(staged, known)
    meta["golden_id"] = manifest.golden_id(meta)
    root.attrs["vd"] = {**meta, "complete": True}


def reseal(staged: Path, updates: Mapping, drop: tuple[str, ...] = ()) -> None:
    """`seal` a staged copy of a golden again after a change: its root metadata with ``updates`` applied and
    ``drop`` left out, every file hashed anew."""
    root = zarr.open_group(zarr.storage.LocalStore(staged), mode="r+")
    meta = {k: v for k, v in dict(root.attrs["vd"]).items() if k not in drop}
    meta.update(json.loads(json.dumps(dict(updates), default=str)))
    seal(root, staged, meta)


# Page-locked step buffers already written, by (shape, dtype): reused by every K stream of the process, and
# `PINNED_AHEAD` of a K's step shape made before its run.
_PINNED: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
PINNED_AHEAD = 4


class KStream:
    """One K's rows written as they are computed (`GoldenWriter.stream`). Rows on the host are written from
    where they are; rows on a GPU are copied into page-locked step buffers first, reused once written, so
    what is held stays a few steps' rows whatever the number of steps."""

    def __init__(self, writer: GoldenWriter, layout: RowLayout, vocab: int, dtype: torch.dtype,
                 device: torch.device | None = None):
        self.writer, self.layout, self.vocab = writer, layout, vocab
        self.pinned = device is not None and device.type == "cuda"
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.arrays = _row_arrays(writer.staged / f"k{layout.k}", layout, vocab, itemsize, writer._put)
        writer.prepare_k(layout, list(self.arrays.values()))  # its group and arrays made while it runs
        if self.pinned:  # allocating page-locked memory takes a millisecond or so: not between steps
            free = _PINNED.setdefault(((layout.k, vocab), dtype), [])
            free.extend(torch.empty((layout.k, vocab), dtype=dtype, pin_memory=True)
                        for _ in range(PINNED_AHEAD - len(free)))

    @staticmethod
    def _host(rows: torch.Tensor) -> torch.Tensor:
        """A page-locked buffer for ``rows``: one written already, else a new one."""
        free = _PINNED.get((tuple(rows.shape), rows.dtype))
        return free.pop() if free else torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)

    def put(self, kind: str, index: int | None, rows: torch.Tensor) -> None:
        """Hand over the prefill's rows (``index`` None) or step ``index``'s verify rows (not changed after:
        the loop keeps them)."""
        dst, event = rows, None
        if self.pinned and rows.is_cuda:
            dst = self._host(rows)
            dst.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.writer._submit(self._write, kind, index, dst, event)

    def _write(self, kind: str, index: int | None, block: torch.Tensor, event) -> None:
        if event is not None:
            event.synchronize()
        stored = to_storage(block)
        if kind == "prefill":
            self.arrays["prefill"].write(0, stored)
        else:
            self.arrays["logits"].write(index, stored[None])
        if self.writer.journal is not None:
            self.writer.journal.block(self.layout.k, index, stored)
        if event is not None:
            _PINNED.setdefault((tuple(block.shape), block.dtype), []).append(block)  # list.append: thread-safe

    def finish(self, log: StepLog, summary: tuple[np.ndarray, np.ndarray], draft_rows: np.ndarray | None = None,
               drafts: np.ndarray | None = None) -> None:
        """The run is over: its step log, every row's digests and statistics and, for the drafter feed, the
        draft kind's rows as stored (the bootstrap row, then each step's) and the head's drafts."""
        self.writer._submit(self._finish, log, summary, draft_rows, drafts)

    def _finish(self, log, summary, draft_rows, drafts) -> None:
        if draft_rows is not None:
            s, k, v = self.layout.steps, self.layout.k, self.vocab
            self.arrays["bootstrap_logits"].write(0, draft_rows[:1])
            self.arrays["draft_logits"].write(0, draft_rows[1:].reshape(s, k - 1, v))
        self.writer._finish_k(self.layout, list(self.arrays.values()), log, summary, drafts)
