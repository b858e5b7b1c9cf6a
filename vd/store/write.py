"""Writing a golden (`GoldenWriter`): staged in a local directory while it is recorded, published complete.

A K's rows are written as its run lets them go (`KRows.write`: the run's `vd.loop.Hold` settles, and the
run's end), a slice at a time (the files are `vd.chunkfiles`'). With writer processes (a GPU recording's:
`vd.store.processes`) each step's rows are handed over as the run logs the step, while the next step's
forward runs (`KRows.hand`: a copy into their arena issued on a stream of its own, a job sent once it is
done), and the processes write them beside the run; the run's end leaves only its last step's rows, and
`publish` waits for them after making the metadata. Without processes, rows are copied to the host and
each chunk encoded and written on the writer's threads (zstd, CRC32C and SHA-256 run without the
interpreter lock), every chunk waited for before ``write`` returns, never while a run steps. Either way a
recording's step loop runs as fast as a bare one; what the store costs is a tail after each run (bounded by
what the run holds, `vd.loop.hold_bytes`) plus the publish. Metadata is written as zarr's own
documents (`vd.store.nodes`), without zarr's event loop. `GoldenWriter.publish` writes the prompt and the
metadata, ``complete`` set last, and hands the staged golden to its `vd.store.location.Location`, which puts
it in place whole. Nothing reaches the destination
before that; `GoldenWriter.abort` (or leaving a ``with`` block on an error) removes the staged copy, so an
existing golden is never touched by a failed recording. Rows are stored as byte planes (`vd.store.format`).
"""

from __future__ import annotations

import collections
import datetime as _dt
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from vd import digest as _digest
from vd import preflight
from vd.chunkfiles import PLANES, row_chunk, write_file
from vd.dtypes import to_storage, to_tensor
from vd.errors import UsageError, naming
from vd.layout import RowLayout, StepLog
from vd.store import format as F
from vd.store import history, manifest, nodes
from vd.store.chunks import chunk_key, encode_chunk
from vd.store.journal import Journal
from vd.store.journal import differs as journal_differs
from vd.store.location import Location, locate
from vd.store.processes import WriterError, WriterPool

# Threads encoding and writing chunks (never beside a run: `KRows.write` waits for them): on an H200 host
# (16 cores) a 0.5B K=2 run's 12 MB of rows took 37 ms on 4, 31 on 8 and 39 on 16
# (tools/h200/writer-threads.json).
WRITERS = max(1, min(8, os.cpu_count() or 2))
# Rows copied to the host at a time by `KRows.write` (whole chunks): the host memory a GPU run's rows take.
SLICE_BYTES = 32 << 20
# Files of at most this size `GoldenWriter._put` leaves to the writer processes (a K's small arrays and zarr
# documents, some 20 a K: 8-22 ms on an H200 host's disk when written here, between runs); larger ones (a
# compiled recording's Inductor artifacts) are written by the recording's own thread.
FILE_JOB_BYTES = 1 << 20
_OS_ERRORS = {"OSError", *(c.__name__ for c in OSError.__subclasses__())}


def check_target(location: Location, refresh: bool) -> None:
    """Refuse a record destination before any work: an existing golden without ``refresh``, anything else
    already there (which even ``refresh`` never replaces), or an object-store prefix inside a golden (a local
    path inside one is the command line's to refuse, before anything is imported: `vd.preflight.golden_over`)."""
    above = golden_above(location.url)
    if above is not None:
        raise UsageError(f"{location.url} is inside the golden {above}; write it elsewhere")
    preflight.check_target(location.url, location.state(), refresh)


def golden_above(url: str) -> str | None:
    """The golden an ``s3://bucket/a/b/c`` prefix lies inside (``s3://bucket/a`` or ``s3://bucket/a/b``), if any;
    None for a local path."""
    if not url.startswith("s3://"):
        return None
    bucket, _, prefix = url[len("s3://"):].rstrip("/").partition("/")
    parts = prefix.split("/")
    for i in range(1, len(parts)):
        above = f"s3://{bucket}/{'/'.join(parts[:i])}"
        if locate(above).state() == "golden":
            return above
    return None


class _RowArray:
    """Row array ``name`` of the K group staged at ``where``: its two byte planes' chunks encoded and written
    straight to their files, the bytes zarr's codecs would write (`vd.store.chunks.encode_chunk`)."""

    def __init__(self, where: Path, name: str, shape: tuple[int, ...], chunk_rows: int, itemsize: int,
                 put: Callable[[Path, bytes], None]):
        self.where, self.name, self.shape, self.rows, self.itemsize = where, name, shape, chunk_rows, itemsize
        self.put = put  # writes a file of the staged golden (`GoldenWriter._put`)

    def write_chunk(self, index: int, data: np.ndarray) -> None:
        """Chunk ``index`` along the first axis: ``data`` as stored (`vd.chunkfiles.row_chunk`)."""
        for key, part in row_chunk(self.name, index, data, self.rows, self.shape):
            self.put(self.where / key, part)

    def create(self) -> None:
        """The two planes' zarr metadata (their chunks are `write_chunk`'s)."""
        hi, lo = F.planes(self.name)
        chunks = (self.rows, *self.shape[1:])
        self.put(self.where / hi / "zarr.json", nodes.array(self.shape, "u1", chunks, "zstd"))
        self.put(self.where / lo / "zarr.json",
                 nodes.array((*self.shape, self.itemsize - 1), "u1", (*chunks, self.itemsize - 1)))


def _row_arrays(where: Path, layout: RowLayout, vocab: int, itemsize: int, put: Callable[[Path, bytes], None]
                ) -> dict[str, _RowArray]:
    """K's row arrays, by name."""
    chunks = F.row_chunks(layout, vocab, itemsize)
    return {name: _RowArray(where, name, shape, chunks[name][0], itemsize, put)
            for name, shape in F.row_shapes(layout, vocab).items()}


class GoldenWriter:
    """Writes a golden for ``where`` (a path or URL: `vd.store.location.locate`), one K at a time, then
    publishes it (see the module's docstring). ``pool``: writer processes that write the rows (else
    ``background``: chunks are encoded on the writer's threads, several at once, or in the caller).

    `rows` takes a K's rows as its run lets them go; `add` a whole K at once.
    """

    def __init__(self, where: str | os.PathLike | Location, *, refresh: bool = False, background: bool = True,
                 pool: WriterPool | None = None, checked: bool = False):
        """``checked``: the caller has run `check_target` holding the location's writer lock, and holds it still
        (the recorder, which checks before its model loads)."""
        self.location = where if isinstance(where, Location) else locate(where)
        if not checked:
            check_target(self.location, refresh)
        self.refresh, self.background = refresh, background
        self.pool = pool  # writer processes (`vd.store.processes`): rows are written beside the next run
        self._jobs: list[tuple[int, int]] = []  # (pool job id, K) sent, answers not taken
        self.staged = self.location.staging()
        self._pool = ThreadPoolExecutor(max_workers=WRITERS, thread_name_prefix="vd-writer")
        self._futures: list[Future[None]] = []
        self.logs: list[StepLog] = []
        self.digests: dict[int, np.ndarray] = {}
        self.journal: Journal | None = None  # the recorder sets it: every block written goes into it
        self.stored_rows = True
        self.known: dict[str, list] = {}  # files written whole by this writer: [size, SHA-256] for the manifest
        # Files `_put` left to the writer processes, not sent yet, by key (a file put again before it is sent is
        # sent once, with its last bytes: two jobs writing one file could race).
        self._files: dict[str, bytes] = {}
        self._large: set[str] = set()  # files `_send_large` sent
        self.seconds: dict[str, float] = {}  # where `publish` went: its metadata, the wait, the seal, the placing
        # Work that can wait for a run's host slack (`later`): done a unit at a time by the runs' hand-overs
        # (`idle`), the rest by `catch_up` (a K's finish, the publish).
        self._later: collections.deque[Callable[[], None]] = collections.deque()
        self._prompt: list[int] | None = None  # the prompt `write_prompt` wrote ahead
        try:
            self._put(self.staged / "zarr.json", nodes.group())
        except BaseException:  # SIGTERM (SystemExit) or an error before the writer exists to abort itself
            self.abort()
            raise

    def later(self, units: list[Callable[[], None]]) -> None:
        """Work a run's step loop may do in its host slack, a unit at a time (`idle`), in order: with writer
        processes, whose hand-overs run while the next step's forward computes (on an H200 host a 0.5B step
        left the loop's thread some 1 ms of waiting for the GPU: `tools/h200/step_host.py`); without them, now."""
        self._later.extend(units)
        if self.pool is None:
            self.catch_up()

    def write_prompt(self, prompt: list[int]) -> None:
        """The prompt's array, written ahead of `publish` as `later` work (a recording knows it before its
        runs: on this project's CPU machines its two files took 1 ms of the publish's own writes)."""
        self._prompt = [int(t) for t in prompt]
        data = np.asarray(self._prompt, dtype="<i4")
        self.later([lambda: self._small("prompt", data)])

    def idle(self, rows: torch.Tensor) -> None:
        """`later`'s work (`KRows.hand`, after handing ``rows`` over): for rows on a GPU, a unit at a time for as long
        as the step issued after them still computes (once it is done, the run's next read-back would wait for the
        unit in hand; one unit a hand-over left a 0.5B recording's K run some of its units for the publish to do);
        elsewhere one unit."""
        if not rows.is_cuda:
            if self._later:
                self._later.popleft()()
            return
        stream = torch.cuda.current_stream(rows.device)
        while self._later and not stream.query():
            self._later.popleft()()

    def catch_up(self) -> None:
        """Every unit of `later`'s work still left, in order."""
        while self._later:
            self._later.popleft()()

    def _submit(self, fn: Callable, *args) -> None:
        if self.background:
            self._futures.append(self._pool.submit(fn, *args))
        else:
            fn(*args)

    def rows(self, layout: RowLayout, vocab: int, dtype: torch.dtype) -> KRows:
        """A K whose rows are written as its run lets them go (`KRows.write`), the rest when it ends
        (`KRows.finish`)."""
        return KRows(self, layout, vocab, torch.empty((), dtype=dtype).element_size())

    def add(self, layout: RowLayout, log: StepLog, rows: Mapping[str, np.ndarray] | None,
            summary: tuple[np.ndarray, np.ndarray] | None = None, drafts: np.ndarray | None = None) -> None:
        """A whole K: its step log, its rows by kind as stored (None: a slim golden's K, which stores none),
        their digests and statistics (computed from ``rows`` when None) and, for the drafter feed, the
        head's drafts."""
        if summary is None:
            assert rows is not None, "a K without rows comes with their summary"
            summary = _digest.summarise({kind: to_tensor(a) for kind, a in rows.items()})
        if rows is None:
            self.stored_rows = False
            self._finish_k(layout, [], log, summary, drafts)
            return
        vocab, itemsize = rows["prefill"].shape[1], rows["prefill"].dtype.itemsize
        k_rows = KRows(self, layout, vocab, itemsize)
        for kind, a in rows.items():
            k_rows.write(kind, 0, a)
        k_rows.finish(log, summary, drafts)

    def _put(self, path: Path, data: bytes, digest: str | None = None) -> None:
        """Write a file of the staged golden whole, and remember its size and hash (the manifest lists every
        file so written: `seal`). With writer processes a small file is theirs to write (`_send_files`), and
        so is a larger one, copied into their arena and sent at once (`_send_large`)."""
        key = path.relative_to(self.staged).as_posix()
        if self.pool is not None and len(data) <= FILE_JOB_BYTES:
            self._files[key] = data
            return
        if self.pool is not None:
            self._send_large(key, data, digest)
            return
        self.known[key] = write_file(path, data, digest)

    def _send_large(self, key: str, data: bytes, digest: str | None) -> None:
        """A file of more than `FILE_JOB_BYTES` copied into the writer processes' arena and written by one of
        them (a compiled recording's Inductor artifacts, some MB, written beside the publish's metadata). A file
        sent again replaces the earlier one, once that is written."""
        assert self.pool is not None
        if key in self._large:
            self._drain()
        offset, _, _ = self.pool.copy_in(np.frombuffer(data, dtype=np.uint8))
        job = {"staged": str(self.staged), "file": (key, offset, len(data), digest)}
        self._jobs.extend((i, -1) for i in self.pool.submit([job]))
        self._large.add(key)

    def _send_files(self) -> None:
        """The files `_put` left to the writer processes, sent to them, a share each (written beside the next
        run, or beside the publish's metadata)."""
        if not self._files:
            return
        assert self.pool is not None
        files, self._files, n = list(self._files.items()), {}, self.pool.n
        jobs = [{"staged": str(self.staged), "files": files[j::n]} for j in range(min(n, len(files)))]
        self._jobs.extend((i, -1) for i in self.pool.submit(jobs, rows=False))

    def _write_files(self) -> None:
        """The files `_put` left to the writer processes, written here: the publish's last few small files, which
        a process would write only after the rows it has, and whose answer the publish would then wait for."""
        files, self._files = self._files, {}
        for key, data in files.items():
            self.known[key] = write_file(self.staged / key, data)

    def _small(self, rel: str, data: np.ndarray, documented: bool = False) -> None:
        """A small array of the golden at ``rel``, its metadata (unless ``documented`` already) and its one
        chunk."""
        if not documented:
            self._small_document(rel, data.shape, data.dtype)
        self._put(self.staged / rel / chunk_key(0, data.ndim), encode_chunk(data, None))

    def _small_document(self, rel: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._put(self.staged / rel / "zarr.json", nodes.array(shape, dtype, tuple(max(n, 1) for n in shape)))

    def _finish_k(self, layout: RowLayout, arrays: list[_RowArray], log: StepLog,
                  summary: tuple[np.ndarray, np.ndarray], drafts: np.ndarray | None,
                  documented: Mapping[str, tuple[int, ...]] | None = None) -> None:
        """K's group with its attributes, its row arrays' metadata (their chunks written already), its step
        log, its rows' digests and statistics and the drafter's drafts (one chunk each). ``documented``: the
        small arrays whose metadata was written ahead, by name, with the shape it gives (`KRows.document`:
        the row arrays' metadata then too); an array of another shape gets its own again."""
        self.catch_up()
        for unit in self._finish_units(layout, arrays, log, summary, drafts, documented):
            unit()

    def _finish_units(self, layout: RowLayout, arrays: list[_RowArray], log: StepLog,
                      summary: tuple[np.ndarray, np.ndarray], drafts: np.ndarray | None,
                      documented: Mapping[str, tuple[int, ...]] | None) -> list[Callable[[], None]]:
        """`_finish_k`'s work as units that `later` may spread over the next run's hand-overs: the group, each
        small array, then the files sent and the K noted (its digests and log, the journal's frame)."""
        k, journal = layout.k, self.journal  # (the journal as it is now: a decode run's finish precedes it)
        attrs = {"k": log.k, "steps": int(log.accepted.shape[0]), "bootstrap": int(log.bootstrap),
                 "committed_is_greedy": log.committed_is_greedy, "decoded": log.decoded}

        def group() -> None:
            self._put(self.staged / f"k{k}" / "zarr.json", nodes.group(attrs))
            if documented is None:
                for a in arrays:
                    a.create()

        def small(name: str, data: np.ndarray) -> Callable[[], None]:
            def unit() -> None:
                a = np.ascontiguousarray(data, dtype=F.SMALL_DTYPES[name])
                self._small(f"k{k}/{name}", a, documented=(documented or {}).get(name) == a.shape)
            return unit

        def noted() -> None:
            self._send_files()
            self.digests[k] = summary[0]
            self.logs.append(log)
            if journal is not None:
                journal.finished(k, log.tokens, log.accepted)

        data = {**{n: getattr(log, n) for n in F.step_log_arrays(F.FORMAT_VERSION)}, "digests": summary[0],
                "stats": summary[1], **({"drafts": drafts} if drafts is not None else {})}
        return [group, *(small(name, a) for name, a in data.items()), noted]

    def _drain(self) -> None:
        try:
            for f in self._futures:
                f.result()
        finally:
            self._futures = []
        if self._jobs:
            jobs, self._jobs = self._jobs, []
            assert self.pool is not None
            answers = self.pool.collect([i for i, _ in jobs])
            for (_, k), answer in zip(jobs, answers):
                self._take(k, answer)

    def _take(self, k: int, answer: dict) -> None:
        """A writer process's answer to a job of K ``k``: the files it wrote, the blocks it hashed."""
        if "error" in answer:
            kind, message, trace = answer["error"]
            if kind == "Differs":
                raise journal_differs(k, message)
            if kind in _OS_ERRORS:  # a refusal of the system's (space, permissions): bad input, as on a thread
                raise OSError(*answer["os"])  # (`vd.chunkfiles.serve` sends every OSError's fields)
            raise WriterError(f"a writer process failed: {kind}: {message}\n{trace}")
        self.known.update(answer["files"])
        if self.journal is not None:  # (the process appended the blocks' frames)
            self.journal.checked += answer["checked"]

    def add_trace(self, k: int, digests: np.ndarray, stats: np.ndarray) -> None:
        """K's module traces (`vd.tracing`; FORMAT.md "Module traces"), one chunk each."""
        self._small(f"k{k}/{F.TRACE_DIGESTS}", np.ascontiguousarray(digests, dtype="<i8"))
        self._small(f"k{k}/{F.TRACE_STATS}", np.ascontiguousarray(stats, dtype="<f4"))

    def add_file(self, key: str, data: bytes, digest: str | None = None) -> None:
        """A file of the golden beside its arrays (``key`` relative to its root), covered by its manifest
        (``digest``: its SHA-256, when the caller has it)."""
        self._put(self.staged / key, data, digest)

    def publish(self, meta: Mapping, prompt: list[int], *, reason: str = "first recording") -> None:
        """Write the prompt (unless `write_prompt` did: then it must be that one) and the metadata, wait for
        everything queued, seal (``complete`` last), and put the golden in place. The metadata gets the
        golden's content digest and, unless ``meta`` brings a ``history`` already (a slim form's, a refresh's),
        its first history entry, giving ``reason``; then the manifest of every file and the golden's ID (`seal`)."""
        t = time.perf_counter()
        try:
            self.catch_up()
            if self._prompt is None:
                self._small("prompt", np.asarray(prompt, dtype="<i4"))
            elif self._prompt != [int(t) for t in prompt]:
                raise ValueError("the prompt published is not the one written ahead (write_prompt)")
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
            self._put(self.staged / F.RUN_GROUP / "zarr.json", nodes.group({"vd_run": volatile}))
            self._write_files()
            t = self._lap("meta", t)
            self._drain()  # (the writer processes' last rows were written beside the metadata's making)
            t = self._lap("wait", t)
            seal(self.staged, stable, known=self.known, listed=False)
            t = self._lap("seal", t)
            self.location.publish(self.staged, self.refresh)
            self._lap("place", t)
        finally:
            self.abort()

    def _lap(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[name] = now - since
        return now

    def abort(self) -> None:
        """Stop and remove the staged copy (a no-op after `publish`)."""
        self._later.clear()
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

    def __exit__(self, kind, e, tb) -> None:
        self.abort()
        if isinstance(e, Exception) and self.journal is not None:
            # An error (a full disk, a crashing engine), not a cut (Ctrl-C, a signal, a kill): what to do is run the
            # command again once it is mended, which journals afresh, so its journal is not left beside the golden.
            self.journal.close(remove=True)
            self.journal = None


def seal(staged: Path, meta: Mapping, known: Mapping[str, list] | None = None, listed: bool = True) -> None:
    """Write the root metadata of the golden staged at ``staged``: ``meta`` with the manifest of every other
    file (``known``: files a writer hashed as it wrote them; `vd.store.manifest`; ``listed`` False: every file,
    as `GoldenWriter` knows them, the folder not listed), the golden's ID hashed from both, and ``complete``,
    in one write: the folder is not the golden until it is put in place, and an object store uploads the root
    last (`vd.store.objects`). The root's other attributes are kept."""
    meta = {k: v for k, v in meta.items() if k not in ("complete", "golden_id", "manifest")}
    meta["manifest"] = manifest.build(staged, known, listed)
    meta["golden_id"] = manifest.golden_id(meta)
    with naming(staged / "zarr.json"):
        (staged / "zarr.json").write_bytes(nodes.group({**_root_attributes(staged), "vd": {**meta, "complete": True}}))


def _root_attributes(staged: Path) -> dict:
    path = staged / "zarr.json"
    return dict(json.loads(path.read_bytes()).get("attributes") or {}) if path.is_file() else {}


def reseal(staged: Path, updates: Mapping, drop: tuple[str, ...] = ()) -> None:
    """`seal` a staged copy of a golden again after a change: its root metadata with ``updates`` applied and
    ``drop`` left out, every file hashed anew."""
    meta = {k: v for k, v in _root_attributes(staged)["vd"].items() if k not in drop}
    meta.update(json.loads(json.dumps(dict(updates), default=str)))
    seal(staged, meta)


def small_shapes(layout: RowLayout) -> dict[str, tuple[int, ...]]:
    """The shapes of a K's small arrays (`GoldenWriter._finish_k`'s), by name, for ``layout``."""
    shapes = {"tokens": (layout.steps, layout.k), "accepted": (layout.steps,), "step_ms": (layout.steps,),
              "digests": (layout.total, _digest.LANES), "stats": (layout.total, len(_digest.STATS))}
    names = (*F.step_log_arrays(F.FORMAT_VERSION), "digests", "stats")
    if layout.drafted:
        shapes["drafts"], names = (layout.steps, layout.k - 1), (*names, "drafts")
    return {n: shapes[n] for n in names}


class KRows:
    """One K's row arrays, written as its run lets its rows go (`GoldenWriter.rows`; see the module's
    docstring): what is held stays a slice of rows whatever the number of steps."""

    def __init__(self, writer: GoldenWriter, layout: RowLayout, vocab: int, itemsize: int):
        self.writer, self.layout, self.vocab, self.itemsize = writer, layout, vocab, itemsize
        self.arrays = _row_arrays(writer.staged / f"k{layout.k}", layout, vocab, itemsize, writer._put)
        self.written = dict.fromkeys(layout.counts, 0)  # rows written, per kind
        self.documented: dict[str, tuple[int, ...]] | None = None  # `document`'s small arrays, once it ran

    def write(self, kind: str, start: int, rows: torch.Tensor | np.ndarray) -> None:
        """Rows ``[n, V]`` of ``kind`` from the kind's row ``start`` (whole steps; on any device, or as stored),
        written before this returns (but for writer processes, which `GoldenWriter.publish` waits for); rows
        handed over already (`hand`) are skipped."""
        start, rows = self._unwritten(kind, start, rows)
        if not rows.shape[0]:
            return
        journal = self.writer.journal
        whole = journal.digest if journal is not None and kind == "prefill" else None  # one block, all slices
        h, slices = None, self._slices(F.chunk_spans(self.layout, kind, start, rows.shape[0], self.vocab,
                                                     self.itemsize))
        for take in slices:
            lo, hi = take[0][2], take[-1][3]
            if self.writer.pool is not None:
                stored = self._send(take, rows[lo:hi], self._digest(kind, len(slices)))
            else:
                part = rows[lo:hi]
                stored = to_storage(part) if isinstance(part, torch.Tensor) else np.ascontiguousarray(part)
                for name, index, a, b in take:
                    self.writer._submit(self._chunk, name, index, stored[a - lo:b - lo])
            if whole is not None and (self.writer.pool is None or len(slices) > 1):
                h = whole(stored, h)
            if self.writer.pool is None:
                self.writer._drain()
        if journal is not None and h is not None:  # (h is hashed only with a journal)
            journal.block(self.layout.k, None, h.hexdigest())
        self.written[kind] += rows.shape[0]

    def hand(self, kind: str, start: int, rows: torch.Tensor) -> None:
        """While a run steps (`vd.loop.Hold`'s ``each``): rows it goes on holding, handed to the writer
        processes without waiting for their copy (`vd.store.processes.WriterPool.copy_in`), so that they
        write them beside the run and the run's end leaves only its last rows to write; the first queues the
        K's metadata (`document`); then one unit of the writer's `later` work, if the GPU still computes the
        step issued before. Nothing is handed without processes, or for rows of more than one slice
        (`SLICE_BYTES`): `write` writes those."""
        start, part = self._unwritten(kind, start, rows)
        if self.writer.pool is None or not part.shape[0]:
            return
        slices = self._slices(F.chunk_spans(self.layout, kind, start, part.shape[0], self.vocab, self.itemsize))
        if len(slices) == 1:
            self._send(slices[0], part, self._digest(kind, 1), wait=False)
            self.written[kind] += part.shape[0]
        if self.documented is None:
            self.document()
        self.writer.idle(rows)

    def document(self) -> None:
        """The metadata of K's arrays, written ahead of `finish` as the writer's `later` work, a document a unit
        (queued by `hand`: on an H200 host a 0.5B recording's documents took 2-3 ms between and after its runs,
        then 0.7-1.2 ms in one hand-over, longer than the step computing beside it): the row arrays', and the
        small arrays' at the shapes the layout gives them (`small_shapes`)."""
        shapes = small_shapes(self.layout)
        k = self.layout.k

        def small(name: str, shape: tuple[int, ...]) -> Callable[[], None]:
            return lambda: self.writer._small_document(f"k{k}/{name}", shape, F.SMALL_DTYPES[name])

        self.writer.later([*(a.create for a in self.arrays.values()), *(small(n, sh) for n, sh in shapes.items())])
        self.documented = shapes

    def _unwritten(self, kind: str, start: int, rows: torch.Tensor | np.ndarray
                   ) -> tuple[int, torch.Tensor | np.ndarray]:
        """``rows`` from ``start`` without those written already (a gap before them is a ValueError)."""
        done = self.written[kind]
        if start > done:
            raise ValueError(f"K={self.layout.k}: {kind} rows from {start}, but only {done} written")
        return max(start, done), rows[done - start:] if done > start else rows

    def _digest(self, kind: str, slices: int) -> str | None:
        """What the writer processes hash of a ``kind``'s rows in ``slices`` slices for the journal
        (`vd.chunkfiles.do_job`): each step's chunk, or the prefill whole when it is one slice (else the
        recording hashes it)."""
        if self.writer.journal is None:
            return None
        return "chunk" if kind == "verify" else "whole" if kind == "prefill" and slices == 1 else None

    def _slices(self, spans: list[tuple[str, int, int, int]]) -> list[list[tuple[str, int, int, int]]]:
        """``spans`` in runs of whole chunks of at most `SLICE_BYTES` (at least one chunk each)."""
        out: list[list[tuple[str, int, int, int]]] = []
        size = 0
        for span in spans:
            n = (span[3] - span[2]) * self.vocab * self.itemsize
            if not out or size + n > SLICE_BYTES:
                out.append([])
                size = 0
            out[-1].append(span)
            size += n
        return out

    def _send(self, take: list[tuple[str, int, int, int]], part: torch.Tensor | np.ndarray, digest: str | None,
              wait: bool = True) -> np.ndarray:
        """Chunks ``take`` of ``part`` (its rows from the first chunk's) copied into the writer processes' arena
        and sent to them, a share of the chunks each (``digest``: `vd.chunkfiles.do_job`'s, ``"whole"`` a job
        of its own); the copy, as stored (not to be read unless ``wait``: `WriterPool.copy_in`). Rows handed
        while a run steps (not ``wait``) go as one job a share; rows written once it ended (``wait``), which
        the publish waits for, as one job a share and plane."""
        pool = self.writer.pool
        assert pool is not None
        offset, dtype, shape = pool.copy_in(part, wait)
        lo, n = take[0][2], -(-len(take) // pool.n)
        journal, k = self.writer.journal, self.layout.k
        base = {"staged": str(self.writer.staged), "group": f"k{k}", "offset": offset, "dtype": dtype.str,
                "shape": shape, "k": k, "journal": None if journal is None else str(journal.path)}

        def expect(blocks) -> dict:  # a resumed recording's journaled digests of the blocks a job hashes
            want = {} if journal is None else journal.expected
            return {s: want[(k, s)] for s in blocks if (k, s) in want}

        def job(share, planes: list[str]) -> dict:  # the job writing the last plane hashes the rows for the journal
            hashed = digest == "chunk" and PLANES[-1] in planes
            return {**base, "planes": planes, "digest": "chunk" if hashed else None,
                    "expect": expect(index for _, index, _, _ in share) if hashed else {},
                    "chunks": [(name, index, a - lo, b - lo, self.arrays[name].rows, self.arrays[name].shape)
                               for name, index, a, b in share]}

        # Once the run ended, each share's planes go as two jobs, to two processes: a step's one job took 2-4 ms on
        # an H200 host (the high bytes' Zstd about half of it), and the run's last step's was what the publish
        # waited for (tools/h200/writer_timeline.py).
        planes = [[p] for p in PLANES] if wait else [list(PLANES)]
        jobs = [job(share, ps) for share in (take[j:j + n] for j in range(0, len(take), n)) for ps in planes]
        if digest == "whole":
            jobs.append({**base, "digest": "whole", "expect": expect([None]), "chunks": []})
        self.writer._jobs.extend((i, k) for i in pool.submit(jobs))
        return pool.view(offset, dtype, shape)

    def _chunk(self, name: str, index: int, stored: np.ndarray) -> None:
        self.arrays[name].write_chunk(index, stored)
        journal = self.writer.journal
        if journal is not None and name == "logits":  # a step's block (the prefill's is `write`'s)
            journal.block(self.layout.k, index, journal.digest(stored).hexdigest())

    def finish(self, log: StepLog, summary: tuple[np.ndarray, np.ndarray], drafts: np.ndarray | None = None,
               later: bool = False) -> None:
        """The run is over and its rows written: its step log, every row's digests and statistics and, for the
        drafter feed, the head's drafts. Refused (ValueError) unless every row was written. ``later``: their
        files are the writer's `later` work (written during the next run, or by the publish)."""
        if self.written != self.layout.counts:
            raise ValueError(f"K={self.layout.k}: rows written {self.written}, the layout has {self.layout.counts}")
        if later:
            self.writer.later(self.writer._finish_units(self.layout, list(self.arrays.values()), log, summary,
                                                         drafts, self.documented))
        else:
            self.writer._finish_k(self.layout, list(self.arrays.values()), log, summary, drafts, self.documented)
