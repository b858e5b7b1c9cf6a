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
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import zarr

from vd import digest as _digest
from vd.dtypes import to_storage, to_tensor
from vd.errors import GoldenError, GoldenExistsError
from vd.layout import RowLayout, StepLog
from vd.store import format as F
from vd.store.location import Location, locate


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


def _small(group: zarr.Group, name: str, data: np.ndarray) -> None:
    data = np.ascontiguousarray(data, dtype=F.SMALL_DTYPES[name])
    _array(group, name, data.shape, data.dtype, tuple(max(n, 1) for n in data.shape), F.plain_codecs())[...] = data


def _create_rows(group: zarr.Group, name: str, shape: tuple[int, ...], chunks: tuple[int, ...], itemsize: int
                 ) -> tuple[zarr.Array, zarr.Array]:
    """Row array ``name`` as its two byte planes (`vd.store.format.planes`)."""
    hi, lo = F.planes(name)
    return (_array(group, hi, shape, "u1", chunks, F.hi_codecs()),
            _array(group, lo, (*shape, itemsize - 1), "u1", (*chunks, itemsize - 1), F.plain_codecs()))


def _store_rows(arrays: tuple[zarr.Array, zarr.Array], where, data: np.ndarray) -> None:
    hi, lo = F.split_planes(data)
    arrays[0][where], arrays[1][where] = hi, lo


def _as_arrays(layout: RowLayout, rows: Mapping[str, np.ndarray], vocab: int) -> dict[str, np.ndarray]:
    """Rows by kind (`vd.layout.RowLayout`) as the row arrays that store them, by name."""
    s, k = layout.steps, layout.k
    out = {"prefill": rows["prefill"], "logits": rows["verify"].reshape(s, k, vocab)}
    if "draft" in rows:
        out.update(bootstrap_logits=rows["draft"][:1], draft_logits=rows["draft"][1:].reshape(s, k - 1, vocab))
    return out


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
        self.root = zarr.create_group(zarr.storage.LocalStore(self.staged), zarr_format=3)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vd-writer")
        self._futures = []
        self.logs: list[StepLog] = []
        self.stored_rows = True

    def _submit(self, fn: Callable, *args) -> None:
        if self.background:
            self._futures.append(self._pool.submit(fn, *args))
        else:
            fn(*args)

    def stream(self, layout: RowLayout, vocab: int, dtype: torch.dtype) -> KStream:
        """A K whose prefill and verify rows arrive while it runs (`KStream.put`), the rest when it ends
        (`KStream.finish`)."""
        return KStream(self, layout, vocab, dtype)

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

    def _write_k(self, layout, log, rows, summary, drafts) -> None:
        g = self.root.create_group(f"k{layout.k}")
        if rows is not None:
            arrays = _as_arrays(layout, rows, rows["prefill"].shape[1])
            chunks = F.row_chunks(layout, rows["prefill"].shape[1], rows["prefill"].dtype.itemsize)
            for name, data in arrays.items():
                _store_rows(_create_rows(g, name, data.shape, chunks[name], data.dtype.itemsize), Ellipsis, data)
        self._finish_k(g, log, summary, drafts)

    def _finish_k(self, g: zarr.Group, log: StepLog, summary: tuple[np.ndarray, np.ndarray],
                  drafts: np.ndarray | None) -> None:
        """K's step log, its rows' digests and statistics, the drafter's drafts, and its attributes."""
        for name in F.STEP_LOG:
            _small(g, name, getattr(log, name))
        _small(g, "digests", summary[0])
        _small(g, "stats", summary[1])
        if drafts is not None:
            _small(g, "drafts", drafts)
        g.attrs.update({"k": log.k, "steps": int(log.accepted.shape[0]), "bootstrap": int(log.bootstrap),
                        "committed_is_greedy": log.committed_is_greedy, "decoded": log.decoded})
        self.logs.append(log)

    def _drain(self) -> None:
        try:
            for f in self._futures:
                f.result()
        finally:
            self._futures = []

    def publish(self, meta: Mapping, prompt: list[int]) -> None:
        """Wait for everything queued, write the prompt and the metadata (``complete`` last), and put the
        golden in place."""
        try:
            self._drain()
            tokens = np.asarray(prompt, dtype=np.int32)
            _array(self.root, "prompt", tokens.shape, "<i4", (max(len(prompt), 1),), F.plain_codecs())[...] = tokens
            full = dict(meta)
            scheme = F.digest_meta(full.get("vocab_size"), (full.get("logits") or {}).get("dtype"))
            full.update(digest=scheme, logs={str(log.k): log.to_json() for log in sorted(self.logs, key=lambda x: x.k)},
                        prompt_tokens=[int(t) for t in prompt], format=F.FORMAT, format_version=F.FORMAT_VERSION,
                        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
            full.setdefault("rows", {"stored": self.stored_rows})
            self.root.attrs["vd"] = json.loads(json.dumps(full, default=str))
            self.root.attrs["vd"] = {**self.root.attrs["vd"], "complete": True}  # set last
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

    def __enter__(self) -> GoldenWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


class KStream:
    """One K's rows written as they are computed (`GoldenWriter.stream`)."""

    def __init__(self, writer: GoldenWriter, layout: RowLayout, vocab: int, dtype: torch.dtype):
        self.writer, self.layout, self.vocab = writer, layout, vocab
        self.pinned = torch.cuda.is_available()
        self.host = {"prefill": torch.empty((layout.prompt, vocab), dtype=dtype, pin_memory=self.pinned),
                     "verify": torch.empty((layout.steps, layout.k, vocab), dtype=dtype, pin_memory=self.pinned)}
        self.group, self.arrays = None, {}
        writer._submit(self._create)

    def _create(self) -> None:
        g = self.writer.root.create_group(f"k{self.layout.k}")
        itemsize = self.host["prefill"].element_size()
        chunks = F.row_chunks(self.layout, self.vocab, itemsize)
        for kind, name in (("prefill", "prefill"), ("verify", "logits")):
            self.arrays[kind] = _create_rows(g, name, tuple(self.host[kind].shape), chunks[name], itemsize)
        self.group = g

    def put(self, kind: str, index: int | None, rows: torch.Tensor) -> None:
        """Hand over the prefill's rows (``index`` None) or step ``index``'s verify rows."""
        dst = self.host["prefill"] if kind == "prefill" else self.host["verify"][index]
        dst.copy_(rows, non_blocking=self.pinned and rows.is_cuda)
        event = None
        if self.pinned and rows.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.writer._submit(self._write, kind, index, dst, event)

    def _write(self, kind: str, index: int | None, block: torch.Tensor, event) -> None:
        if event is not None:
            event.synchronize()
        _store_rows(self.arrays[kind], Ellipsis if index is None else index, to_storage(block))

    def finish(self, log: StepLog, summary: tuple[np.ndarray, np.ndarray], draft_rows: np.ndarray | None = None,
               drafts: np.ndarray | None = None) -> None:
        """The run is over: its step log, every row's digests and statistics and, for the drafter feed, the
        draft kind's rows as stored (the bootstrap row, then each step's) and the head's drafts."""
        self.writer._submit(self._finish, log, summary, draft_rows, drafts)

    def _finish(self, log, summary, draft_rows, drafts) -> None:
        if draft_rows is not None:
            s, k, v = self.layout.steps, self.layout.k, self.vocab
            chunks = F.row_chunks(self.layout, v, draft_rows.dtype.itemsize)
            for name, data in (("bootstrap_logits", draft_rows[:1]),
                               ("draft_logits", draft_rows[1:].reshape(s, k - 1, v))):
                _store_rows(_create_rows(self.group, name, data.shape, chunks[name], data.dtype.itemsize), Ellipsis,
                            data)
        self.writer._finish_k(self.group, log, summary, drafts)

