"""The golden store: a zarr v3 group holding a recording's steps and every logits row, with metadata.

Layout (FORMAT.md is the reference; ``FORMAT_VERSION`` marks it):

    <golden>.zarr/            group; attrs["vd"] = metadata (model, forward, dtype, K list, environment, ...)
      prompt                  int32 (P,)
      k<K>/                   group; attrs: k, steps, bootstrap, committed_is_greedy (MTP: decoded)
        prefill               logits (P, V)      ~1 MiB a chunk
        logits                logits (S, K, V)   one chunk per step
        tokens                int32 (S, K)       each step's [last, d1 .. d_{K-1}]
        accepted              int32 (S,)
        step_ms               float64 (S,)
        bootstrap_logits      logits (1, V)      MTP feed only: the bootstrap decode's row
        drafts                int32 (S, K-1)     MTP feed only: the head's proposal each step verifies
        draft_logits          logits (S, K-1, V) MTP feed only: the head's logits for those drafts
        digests               int64 (R, 6)       each row's digest (`vd.digest`), every kind's rows in order
        stats                 float64 (R, 5)     each row's argmax, top-1, margin, largest |logit|, top-1 probability

bfloat16 logits are stored as their uint16 bit patterns (zarr has no bfloat16); float16/float32 as
themselves. Every chunk carries a CRC32C checksum; the values are stored as they are, or Blosc-LZ4 over
bit-shuffled values with ``compress`` (`codecs`). A golden is
written beside its destination and renamed into place when complete, so a reader never sees half of
one; readers still check the ``complete`` flag, every chunk's presence and every checksum, and refuse
instead of reading zeros. This module leaves out what the rows mean: it stores and loads arrays.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, Crc32cCodec

from vd import digest as _digest
from vd.errors import (
    GoldenCorruptError,
    GoldenError,
    GoldenExistsError,
    GoldenNotFoundError,
    NotAGoldenError,
)
from vd.loop import Step

FORMAT = "vd-golden"
FORMAT_VERSION = 3  # 3: each row's digest (`vd.digest`); 2: optional MTP arrays; older goldens read unchanged
PREFILL_CHUNK_BYTES = 1 << 20  # about how much of the prefill's rows one zarr chunk holds (`prefill_chunks`)

# logical dtype -> (numpy storage dtype, description)
ENCODINGS: dict[str, tuple[np.dtype, str]] = {
    "bfloat16": (np.dtype("<u2"), "bfloat16 as its uint16 bit pattern, little-endian"),
    "float16": (np.dtype("<f2"), "IEEE float16, little-endian"),
    "float32": (np.dtype("<f4"), "IEEE float32, little-endian"),
}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_TORCH_NAMES = {t: name for name, t in TORCH_DTYPES.items()}
_LOGICAL = {enc[0].str: name for name, enc in ENCODINGS.items()}  # storage dtype -> logical name


def dtype_name(dtype: torch.dtype) -> str:
    """The logical name vd stores for a torch logits dtype."""
    return _TORCH_NAMES[dtype]


def int_bits(a: np.ndarray) -> np.ndarray:
    """A storage array viewed as signed integers of its width (equal bits, equal integers), contiguous,
    ready for ``torch.from_numpy``."""
    return np.ascontiguousarray(a).view({2: np.int16, 4: np.int32}[a.dtype.itemsize])


def to_tensor(a: np.ndarray) -> torch.Tensor:
    """A storage array as a CPU tensor of its logical dtype, bits unchanged."""
    return torch.from_numpy(int_bits(a)).view(TORCH_DTYPES[_LOGICAL[a.dtype.str]])


def to_storage(t: torch.Tensor) -> np.ndarray:
    """Logits on any device to their storage array (bf16 becomes uint16 bits), on the host."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def to_float(a: np.ndarray, logical: str) -> np.ndarray:
    """A storage array's values as float32 (exact for every supported dtype)."""
    if logical == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _steps(tokens: np.ndarray, accepted: np.ndarray) -> list[Step]:
    # Through lists: numpy scalars one by one took 70 us for 16 steps on the 2-core machines, this 10.
    return [Step(tuple(row), a) for row, a in zip(tokens.tolist(), accepted.tolist())]


@dataclass(frozen=True, slots=True)
class KRecord:
    """One verify width's recording."""

    k: int
    bootstrap: int
    tokens: np.ndarray  # int32 [S, K]
    accepted: np.ndarray  # int32 [S]
    prefill: np.ndarray  # storage [P, V]
    logits: np.ndarray  # storage [S, K, V]
    step_ms: np.ndarray  # float64 [S]
    committed_is_greedy: bool | None = None
    bootstrap_logits: np.ndarray | None = None  # storage [1, V]      (MTP feed)
    drafts: np.ndarray | None = None  # int32 [S, K-1]                 (MTP feed)
    draft_logits: np.ndarray | None = None  # storage [S, K-1, V]      (MTP feed)
    decoded: int | None = None  # the token the bootstrap decode ran on  (MTP feed)
    digests: np.ndarray | None = None  # int64 [R, LANES]: `rows_by_kind`'s rows' digests, in order
    stats: np.ndarray | None = None  # float64 [R, len(STATS)]: the same rows' statistics (`vd.digest`)

    @property
    def steps(self) -> list[Step]:
        """The step log as `vd.loop.Step` values."""
        return _steps(self.tokens, self.accepted)

    def rows_by_kind(self) -> dict[str, np.ndarray]:
        """The logits rows ``[R, V]`` per kind a policy judges: prefill, verify (steps × K, flattened) and,
        for the MTP feed, draft (the bootstrap row, then each step's K-1 draft rows)."""
        v = self.logits.shape[-1]
        out = {"prefill": self.prefill, "verify": self.logits.reshape(-1, v)}
        if self.draft_logits is not None:
            out["draft"] = np.concatenate([self.bootstrap_logits, self.draft_logits.reshape(-1, v)])
        return out


@dataclass(frozen=True, slots=True)
class KLog:
    """One verify width's step log without its logits rows: what a replay needs to start."""

    k: int
    bootstrap: int
    tokens: np.ndarray
    accepted: np.ndarray
    step_ms: np.ndarray
    committed_is_greedy: bool | None = None
    decoded: int | None = None

    @property
    def steps(self) -> list[Step]:
        return _steps(self.tokens, self.accepted)


@dataclass(frozen=True, slots=True)
class Golden:
    """A golden read back: its metadata (``attrs["vd"]``), prompt tokens and one record per K."""

    path: Path
    meta: Mapping
    prompt: list[int]
    runs: Mapping[int, KRecord]

    @property
    def logical_dtype(self) -> str:
        return self.meta["logits"]["dtype"]

    def log(self, k: int) -> KLog | KRecord:
        """K's step log (tokens, accept counts, bootstrap): ready before its rows when opened lazily."""
        log = getattr(self.runs, "log", None)
        return log(k) if log is not None else self.runs[k]

    def gold(self, k: int):
        """K's side of a comparison (`vd.gold.Gold`): known by its rows' digests when the golden stores
        them in the scheme this vd computes (`vd.digest`), its rows read only where a candidate's differ;
        else every row, read (on CUDA, ahead of time: `prefetch`)."""
        gold = getattr(self.runs, "gold", None)
        if gold is not None:
            return gold(k)
        from vd.gold import InMemory  # vd.gold builds on this module

        return InMemory(self.runs[k])

    def prefetch(self, device: torch.device, background: bool = False) -> None:
        """For a replay on a CUDA ``device``: read a lazily opened golden ahead of use (`vd.reader.
        GoldenReader`: its step logs and digests, or for a golden without digests its rows, copied to the
        device; ``background``: on a thread too, until a run starts); a no-op otherwise."""
        if hasattr(self.runs, "prefetch"):
            self.runs.prefetch(device, background)

    def pause(self) -> None:
        """Let nothing of a prefetching reader touch the GPU until the next run or request (its thread
        stopped, its chunk copies done): before a model captures graphs."""
        reader = getattr(self.runs, "reader", None)
        if reader is not None:
            reader.pause()

    @property
    def idle(self) -> Callable[[float], bool] | None:
        """What a run hands its GPU's busy time to (`vd.loop.run_verify`'s ``idle``): the reader of a
        golden prefetched to CUDA, else None."""
        return self.runs.idle if getattr(self.runs, "reader", None) is not None else None

    def device_rows(self, k: int) -> dict[str, torch.Tensor] | None:
        """K's logits arrays already on the replay device, as integer bit patterns (after `prefetch`;
        the current stream waits for their copy); None when they were not uploaded ahead."""
        rows = getattr(self.runs, "device_rows", None)
        return rows(k) if rows is not None else None


def prefill_chunks(shape: tuple[int, int], itemsize: int) -> tuple[int, int]:
    """The prefill's rows are stored at most about `PREFILL_CHUNK_BYTES` to a chunk (at least one row):
    the size of a K=4 step's chunk on a 128k-150k vocabulary, so a replay's reader reads either in about
    the same time (`vd.reader`: a unit of reading must fit in a GPU step). The rows are spread evenly
    over as few chunks as that allows: zarr stores the last chunk whole, and uncompressed its padding
    would be stored too. Before issue 4's reader, 8 rows to a chunk; before that, all of them in one
    (both read unchanged)."""
    most = max(1, PREFILL_CHUNK_BYTES // max(1, shape[1] * itemsize))
    n = -(-shape[0] // most)  # chunks
    return (max(1, -(-shape[0] // max(1, n))), shape[1])


def row_summary(rows: Mapping[str, np.ndarray | torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The digests and statistics (`vd.digest.summarise`) of rows per kind: `KRecord.rows_by_kind`'s
    storage arrays, or `vd.loop.Run.rows_by_kind`'s tensors on any device."""
    return _digest.summarise({n: to_tensor(a) if isinstance(a, np.ndarray) else a for n, a in rows.items()})


def codecs(compress: bool) -> list:
    """A golden array's bytes-to-bytes codecs: a CRC32C checksum, after Blosc (LZ4 over bit-shuffled
    values) when ``compress``.

    Uncompressed is the default since issue 4: bf16 logits compress little (the low byte of each value
    is noise; shared notes, storage.md: 1.0-1.6x by distribution) and a replay on the GPU reads its
    golden in the time the GPU computes, where a chunk that needs no decoding is read straight into
    page-locked memory and checked on the replay's own thread, with no decoding threads beside the
    run (`vd.reader`). With ``compress`` (``vd record --compress``), measured on the 2-core machines
    on bf16 logits, one chunk per step: SmolLM2's real rows 1.48x smaller (zstd-1: 1.41x), decoding
    at 1.2-2.5 GB/s (zstd-1: 0.5-0.9); random-weight rows 1.18x. Goldens written with zstd before
    still read: zarr's metadata names each array's codecs."""
    blosc = [BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle")] if compress else []
    return [*blosc, Crc32cCodec()]


def _create_array(group: zarr.Group, name: str, chunks: tuple[int, ...], compress: bool, **kwargs) -> zarr.Array:
    """Every golden array: vd's codecs, and every chunk written even where it holds only zeros."""
    return group.create_array(name, chunks=chunks, compressors=codecs(compress), fill_value=0,
                              config={"write_empty_chunks": True}, **kwargs)


def _write_array(group: zarr.Group, name: str, data: np.ndarray, chunks: tuple[int, ...], compress: bool) -> None:
    _create_array(group, name, chunks, compress, data=data)


def _json_safe(obj):
    return json.loads(json.dumps(obj, default=str))


def _existing_golden_meta(path: Path) -> Mapping | None:
    """The vd metadata of the golden at ``path``; None when the path holds no golden."""
    try:
        attrs = zarr.open_group(zarr.storage.LocalStore(path, read_only=True), mode="r").attrs
        meta = attrs.get("vd")
    except Exception:  # anything unreadable is "not a golden" here; open_golden reports details
        return None
    return meta if isinstance(meta, Mapping) and meta.get("format") == FORMAT else None


def check_writable(path: Path) -> None:
    """Refuse, before any work, a destination whose folder cannot be created or written."""
    parent = Path(path).absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise GoldenError(f"cannot write {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise GoldenError(f"cannot write {path}: {parent} is not writable")


def check_target(path: Path, refresh: bool) -> None:
    """Refuse a record destination before any work: an unwritable place, an existing golden without
    ``refresh``, or an existing path that is not a golden (which even ``refresh`` never replaces)."""
    check_writable(path)
    if not path.exists() and not path.is_symlink():
        return
    if _existing_golden_meta(path) is None:
        raise GoldenError(f"{path} exists and is not a vd golden; refusing to replace it")
    if not refresh:
        raise GoldenExistsError(f"{path} already holds a golden; pass --refresh to replace it")


class KStream:
    """One K's rows written as they are computed (see `GoldenWriter.stream`).

    On CUDA every block is copied into a pinned host buffer with a non-blocking copy on the computing
    stream, and the writer thread waits for that copy before compressing and storing the chunk, so
    neither the copy nor the storage write holds up the next step.
    """

    def __init__(self, writer: GoldenWriter, k: int, steps: int, prompt_len: int, vocab: int, dtype: torch.dtype):
        self.writer, self.k, self.steps = writer, k, steps
        self.pinned = torch.cuda.is_available()
        self.host = {"prefill": torch.empty((prompt_len, vocab), dtype=dtype, pin_memory=self.pinned),
                     "verify": torch.empty((steps, k, vocab), dtype=dtype, pin_memory=self.pinned)}
        self.group = None
        writer._submit(self._create)

    def _create(self) -> None:
        g = self.writer.root.create_group(f"k{self.k}")
        prefill, verify = self.host["prefill"], self.host["verify"]
        storage = to_storage(prefill[:0]).dtype
        for name, shape, chunks in (("prefill", prefill.shape, prefill_chunks(prefill.shape, prefill.element_size())),
                                    ("logits", verify.shape, (1, self.k, verify.shape[2]))):
            _create_array(g, name, chunks, self.writer.compress, shape=shape, dtype=storage)
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
        if kind == "prefill":
            self.group["prefill"][...] = to_storage(block)
        else:
            self.group["logits"][index] = to_storage(block)

    def finish(self, record) -> None:
        """The run is over: ``record`` is the `KRecord` of its small arrays, MTP rows and row summaries, or a
        function giving it on the writer thread (its ``prefill`` and ``logits`` fields are ignored: they
        were streamed)."""
        self.writer._submit(self._finish, record)

    def _finish(self, record) -> None:
        r = record() if callable(record) else record
        if r.digests is None:  # the streamed rows are in the host buffers by now (each write waited for its copy)
            r = dataclasses.replace(r, prefill=to_storage(self.host["prefill"]), logits=to_storage(self.host["verify"]))
        self.writer._written.append(r)
        _write_small(self.group, r, self.steps, self.k, self.host["verify"].shape[2], self.writer.compress)


def _write_small(g: zarr.Group, r: KRecord, s: int, k: int, v: int, compress: bool) -> None:
    """K's step log, MTP arrays, row digests and statistics (``r.digests``, ``r.stats``: computed here
    from ``r``'s rows on the host when absent) and its attributes."""
    digests, stats = (r.digests, r.stats) if r.digests is not None else row_summary(r.rows_by_kind())
    _write_array(g, "digests", digests.astype(np.int64), digests.shape, compress)
    _write_array(g, "stats", stats.astype(np.float64), stats.shape, compress)
    _write_array(g, "tokens", r.tokens.astype(np.int32), (max(s, 1), k), compress)
    _write_array(g, "accepted", r.accepted.astype(np.int32), (max(s, 1),), compress)
    _write_array(g, "step_ms", r.step_ms.astype(np.float64), (max(s, 1),), compress)
    if r.draft_logits is not None:
        _write_array(g, "bootstrap_logits", r.bootstrap_logits, r.bootstrap_logits.shape, compress)
        _write_array(g, "drafts", r.drafts.astype(np.int32), (max(s, 1), k - 1), compress)
        _write_array(g, "draft_logits", r.draft_logits, (1, k - 1, v), compress)
    g.attrs.update({"k": r.k, "steps": s, "bootstrap": int(r.bootstrap),
                    "committed_is_greedy": r.committed_is_greedy, "decoded": r.decoded})


class GoldenWriter:
    """Writes a golden beside ``path`` on a background thread, one K at a time, then renames it into
    place: recording goes on while earlier widths are compressed and stored.

    `add` queues a whole K (a `KRecord`, or a function returning one, which then runs on the writer
    thread); `stream` takes a K's rows step by step while it runs (what `recorder.record` uses);
    `publish` waits for everything queued, writes the prompt and the metadata with ``complete`` set
    last, and renames. `abort` (or leaving a ``with`` block on an
    exception) removes the unfinished copy: an existing golden is never touched until `publish`.
    ``compress``: Blosc-compressed arrays (`codecs`).
    """

    def __init__(self, path: Path, *, refresh: bool = False, background: bool = True, compress: bool = False):
        from concurrent.futures import ThreadPoolExecutor

        self.background = background  # False: each write runs at once, in the caller's thread
        self.compress = compress
        self.path = Path(path)
        check_target(self.path, refresh)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.parent / f".{self.path.name}.partial-{uuid.uuid4().hex[:8]}"
        self.root = zarr.create_group(zarr.storage.LocalStore(self.tmp), zarr_format=3)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vd-writer")
        self._futures = []
        self._written: list[KRecord] = []

    def add(self, record) -> None:
        self._submit(self._write_k, record)

    def stream(self, k: int, steps: int, prompt_len: int, vocab: int, dtype: torch.dtype) -> KStream:
        """A K whose rows arrive while it runs: `KStream.put` each prefill and verify row block as it is
        computed, `KStream.finish` with the rest when the run ends."""
        return KStream(self, k, steps, prompt_len, vocab, dtype)

    def _submit(self, fn, *args) -> None:
        if self.background:
            self._futures.append(self._pool.submit(fn, *args))
        else:
            fn(*args)

    def _write_k(self, record) -> None:
        r = record() if callable(record) else record
        self._written.append(r)  # its step log goes into the metadata too (`logs`), for a fast replay start
        g = self.root.create_group(f"k{r.k}")
        s, k, v = r.logits.shape
        _write_array(g, "prefill", r.prefill, prefill_chunks(r.prefill.shape, r.prefill.itemsize), self.compress)
        _write_array(g, "logits", r.logits, (1, k, v), self.compress)
        _write_small(g, r, s, k, v, self.compress)

    def _drain(self) -> None:
        try:
            for f in self._futures:
                f.result()
        finally:
            self._pool.shutdown(wait=True)

    def publish(self, meta: Mapping, prompt: list[int]) -> None:
        try:
            self._drain()
            _write_array(self.root, "prompt", np.asarray(prompt, dtype=np.int32), (max(len(prompt), 1),), self.compress)
            full = dict(meta)
            scheme = digest_meta(full)
            if scheme is not None:  # every K was written with its rows' digests
                full["digest"] = scheme
            full.update(logs=logs_meta(self._written), prompt_tokens=[int(t) for t in prompt], format=FORMAT,
                        format_version=FORMAT_VERSION,
                        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))
            self.root.attrs["vd"] = _json_safe(full)
            self.root.attrs["vd"] = {**self.root.attrs["vd"], "complete": True}  # set last
            _publish(self.tmp, self.path)
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop and remove the unfinished copy (a no-op after `publish`)."""
        try:
            self._drain()
        except Exception:  # the copy is being thrown away; its write error does not matter now
            pass
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> GoldenWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.abort()


def write_golden(
    path: Path, meta: Mapping, prompt: list[int], records: list[KRecord], *, refresh: bool = False,
    compress: bool = False,
) -> None:
    """Write a complete golden beside ``path``, then rename it into place.

    With ``refresh`` an existing golden is replaced only once the new one is complete; without it an
    existing golden is refused and left intact. ``compress``: Blosc-compressed arrays (`codecs`).
    """
    with GoldenWriter(path, refresh=refresh, compress=compress) as w:
        for r in records:
            w.add(r)
        w.publish(meta, prompt)


def _publish(tmp: Path, path: Path) -> None:
    """Rename the complete ``tmp`` onto ``path``; an old golden is moved aside first, then removed."""
    if not path.exists():
        os.replace(tmp, path)
        return
    old = path.parent / f".{path.name}.replaced-{uuid.uuid4().hex[:8]}"
    os.replace(path, old)
    try:
        os.replace(tmp, path)
    except OSError:
        os.replace(old, path)  # put the old golden back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _present(group: zarr.Group, name: str, where: str) -> zarr.Array:
    try:
        arr = group[name]
    except KeyError as e:
        raise GoldenCorruptError(f"{where}: array {name!r} is missing") from e
    if not isinstance(arr, zarr.Array):
        raise GoldenCorruptError(f"{where}: {name!r} is not an array")
    # zarr 3.1 reads a missing chunk back as the fill value; a golden never has one, so refuse.
    if arr.nchunks_initialized != arr.nchunks:
        raise GoldenCorruptError(
            f"{where}/{name}: {arr.nchunks - arr.nchunks_initialized} of {arr.nchunks} chunks are missing"
        )
    return arr


def _read(group: zarr.Group, name: str, where: str) -> np.ndarray:
    arr = _present(group, name, where)
    try:
        return np.asarray(arr[...])
    except Exception as e:  # checksum mismatch (ValueError), truncated or undecodable chunk bytes
        raise GoldenCorruptError(f"{where}/{name}: cannot read its chunks: {str(e).splitlines()[0]}") from e


def open_golden(path: str | os.PathLike, *, lazy: bool = False) -> Golden:
    """Open and check a golden; raise a `GoldenError` subclass naming what is wrong.

    By default every array is read (and its chunks and checksums verified) before this returns. With
    ``lazy`` only ``zarr.json`` is read here (the metadata carries the prompt tokens and each K's step
    log, both checked against the arrays later), and each K's arrays when first used; after
    `Golden.prefetch` to a GPU they are read ahead by `vd.reader.GoldenReader`. A missing chunk or a
    checksum error surfaces as the same `GoldenCorruptError` when that K is first used.
    """
    path = Path(path)
    text = None
    if lazy:  # the metadata straight from zarr.json; zarr itself opens when an array is first needed
        try:
            text = (path / "zarr.json").read_text()
        except (OSError, UnicodeDecodeError):
            pass  # told apart below
    if text is None:
        if not path.exists():
            raise GoldenNotFoundError(f"{path} does not exist")
        if not path.is_dir():
            raise NotAGoldenError(f"{path} is not a vd golden (a golden is a zarr directory)")
        if not (path / "zarr.json").is_file():
            raise NotAGoldenError(f"{path} is not a vd golden (no zarr.json)")
    src = Source(path)
    try:
        if lazy:
            if text is None:
                raise ValueError("cannot read it")
            doc = json.loads(text)
            if doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
                raise ValueError("not a zarr v3 group")
            meta = (doc.get("attributes") or {}).get("vd")
        else:
            meta = src.root().attrs.get("vd")
    except Exception as e:  # malformed zarr.json: JSON or metadata errors of many kinds
        raise GoldenCorruptError(f"{path}/zarr.json is unreadable: {str(e).splitlines()[0]}") from e
    if not isinstance(meta, Mapping) or meta.get("format") != FORMAT:
        raise NotAGoldenError(f"{path} is a zarr group but not a vd golden (no vd metadata)")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise GoldenError(f"{path} has golden format {version}; this vd reads up to {FORMAT_VERSION}")
    if meta.get("complete") is not True:
        raise GoldenCorruptError(f"{path} is incomplete (its recording never finished)")
    logical = meta.get("logits", {}).get("dtype")
    if logical not in ENCODINGS:
        raise GoldenCorruptError(f"{path}: unknown logits dtype {logical!r}")
    src.meta = meta
    stored_prompt = meta.get("prompt_tokens")  # since issue 4: the prompt's tokens in the metadata too
    src.prompt = list(stored_prompt) if lazy and isinstance(stored_prompt, list) else src.read_prompt()
    if not src.ks:
        raise GoldenCorruptError(f"{path} holds no verify widths")
    known = _meta_logs(meta)
    if not lazy:
        return Golden(path=path, meta=meta, prompt=src.prompt, runs={k: src.load(k, known.get(k)) for k in src.ks})
    return Golden(path=path, meta=meta, prompt=src.prompt, runs=_Prefetched(src, known))


class Source:
    """An opened golden's store: its groups and arrays, read and checked on demand (`open_golden`)."""

    SMALL = ("tokens", "accepted", "step_ms")

    def __init__(self, path: Path):
        self.path, self.meta, self.prompt = path, {}, []
        self._root: zarr.Group | None = None
        self._groups: dict[int, zarr.Group] = {}
        self._stored_prompt: list[int] | None = None

    @property
    def ks(self) -> list[int]:
        return list(self.meta.get("k", []))

    @property
    def digested(self) -> bool:
        """Whether each K stores its rows' digests in the scheme this vd computes (`vd.digest`)."""
        return self.meta.get("digest") is not None and self.meta["digest"] == digest_meta(self.meta)

    def counts(self, k: int) -> dict[str, int]:
        """K's rows per kind, as `KRecord.rows_by_kind` lays them out."""
        s = self.meta["steps"]
        out = {"prefill": len(self.prompt), "verify": s * k}
        if self.meta.get("feed") == "mtp":
            out["draft"] = 1 + s * (k - 1)
        return out

    def summaries(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """K's row digests and statistics, checked against its row counts."""
        d, s = (_read(self.group(k), n, self.where(k)) for n in ("digests", "stats"))
        check_summaries(d, s, self.counts(k), self.where(k))
        return d, s

    @property
    def big(self) -> list[str]:
        """The arrays of rows (and, for the drafter feed, the head's drafts)."""
        mtp = ["bootstrap_logits", "draft_logits", "drafts"] if self.meta.get("feed") == "mtp" else []
        return ["prefill", "logits", *mtp]

    def where(self, k: int) -> str:
        return f"{self.path}/k{k}"

    def root(self) -> zarr.Group:
        if self._root is None:
            self._root = zarr.open_group(zarr.storage.LocalStore(self.path, read_only=True), mode="r")
        return self._root

    def read_prompt(self) -> list[int]:
        if self._stored_prompt is None:
            self._stored_prompt = _read(self.root(), "prompt", str(self.path)).astype(np.int64).tolist()
        return self._stored_prompt

    def group(self, k: int) -> zarr.Group:
        if k not in self._groups:
            try:
                self._groups[k] = self.root()[f"k{k}"]
            except KeyError as e:
                raise GoldenCorruptError(f"{self.where(k)} is missing") from e
        return self._groups[k]

    def load_log(self, k: int) -> KLog:
        """K's step log from its group's attributes and small arrays."""
        g = self.group(k)
        return log_from(k, g.attrs, {n: _read(g, n, self.where(k)) for n in self.SMALL})

    def checked_log(self, k: int, log: KLog | None) -> KLog:
        """K's stored step log, checked against the prompt and the metadata's copy (``log``) of both."""
        stored = self.load_log(k)
        self.check_log(k, log, stored, self.read_prompt())
        return stored

    def check_log(self, k: int, log: KLog | None, stored: KLog, stored_prompt: list[int]) -> None:
        """Refuse a golden whose metadata's prompt or step log (``log``) disagrees with its arrays'."""
        if stored_prompt != self.prompt:
            raise GoldenCorruptError(f"{self.path}: the prompt in the metadata disagrees with the stored prompt array")
        if log is not None and not (np.array_equal(log.tokens, stored.tokens)
                                    and np.array_equal(log.accepted, stored.accepted)
                                    and log.bootstrap == stored.bootstrap and log.decoded == stored.decoded):
            raise GoldenCorruptError(f"{self.where(k)}: the step log in the metadata disagrees with the stored arrays")

    def record(self, stored: KLog, arrays: Mapping[str, np.ndarray]) -> KRecord:
        """K's `KRecord` from its checked step log and its row arrays, checked against the metadata."""
        rec = KRecord(k=stored.k, bootstrap=stored.bootstrap, committed_is_greedy=stored.committed_is_greedy,
                      decoded=stored.decoded, tokens=stored.tokens, accepted=stored.accepted,
                      step_ms=stored.step_ms, **arrays)
        _check_shapes(rec, self.meta, len(self.prompt), ENCODINGS[self.meta["logits"]["dtype"]][0],
                      self.where(stored.k))
        return rec

    def load(self, k: int, log: KLog | None = None, verify: bool = True) -> KRecord:
        """K's record, every array read in this thread; with ``verify``, each row's stored digest checked
        against its bytes (a replay trusts the digests in place of the rows: `vd.gold.ByDigest`)."""
        stored = self.checked_log(k, log)
        g = self.group(k)
        arrays = {n: _read(g, n, self.where(k)) for n in self.big}
        d, s = self.summaries(k) if self.digested else (None, None)
        rec = self.record(stored, {**arrays, "digests": d, "stats": s})
        if verify and d is not None:
            # Digests alone (the statistics need not be checked against anything here).
            digests = torch.cat([_digest.digest(to_tensor(a)) for a in rec.rows_by_kind().values()]).numpy()
            def name(i: int) -> str:  # row i of every kind's rows in order, by its kind
                for kind, n in self.counts(k).items():
                    if i < n:
                        return f"{kind} row {i}"
                    i -= n
                return f"row {i}"

            check_digests(digests, d, self.where(k), name)
        return rec


def _meta_logs(meta: Mapping) -> dict[int, KLog]:
    """The step logs a golden's metadata carries (``logs``, written since issue 4): a replay starts on
    them without reading an array; the loader checks them against the arrays."""
    out = {}
    for key, e in (meta.get("logs") or {}).items():
        try:
            k = int(key)
            out[k] = KLog(k=k, bootstrap=int(e["bootstrap"]), decoded=e.get("decoded"),
                          committed_is_greedy=e.get("committed_is_greedy"),
                          tokens=np.asarray(e["tokens"], dtype=np.int32).reshape(-1, k),
                          accepted=np.asarray(e["accepted"], dtype=np.int32),
                          step_ms=np.asarray(e["step_ms"], dtype=np.float64))
        except (KeyError, TypeError, ValueError):
            continue  # a malformed copy is ignored: the arrays are read instead
    return out


def logs_meta(records) -> dict:
    """The ``logs`` metadata entry for a recording's `KRecord`s."""
    return {str(r.k): {"bootstrap": int(r.bootstrap), "decoded": r.decoded,
                       "committed_is_greedy": r.committed_is_greedy, "tokens": r.tokens.tolist(),
                       "accepted": r.accepted.tolist(), "step_ms": r.step_ms.tolist()}
            for r in records}




class _Prefetched(Mapping):
    """Each K's step log, record and comparison side (`gold`), read when first asked for, in the
    caller's thread; or, after `prefetch` to a CUDA device, by a `vd.reader.GoldenReader`: in the time
    the replay's GPU steps take (``idle``), on a thread while the model loads, and whatever is left when
    they are needed. A golden with row digests (`Source.digested`) is compared without reading its rows
    (`vd.gold.ByDigest`): only its step logs and digests are read ahead.

    On the CPU nothing is read ahead: the cores computing the model are the ones a reader would take
    (measured: a prefetch thread beside torch's two OpenMP threads on this project's 2-core machines
    made a SmolLM2 replay 1.7x as long as the bare loop, against 1.09x reading up front).
    """

    def __init__(self, source: Source, known: Mapping[int, KLog]):
        self._src, self._known = source, known
        self._keys = source.ks
        self._done: dict = {}  # (what, k) -> result or exception, computed in the caller's thread
        self.reader = None  # a vd.reader.GoldenReader after prefetch to CUDA

    def _get(self, what: str, k: int):
        if (what, k) not in self._done:
            try:
                self._done[(what, k)] = (self._compute(what, k), None)
            except Exception as e:
                self._done[(what, k)] = (None, e)
        value, error = self._done[(what, k)]
        if error is not None:
            raise error
        return value

    def _compute(self, what: str, k: int):
        if what == "log":
            return self._known[k] if k in self._known else self._src.load_log(k)
        if what == "record":
            return self._src.load(k, self._known.get(k))
        if what == "checked":  # the step log as stored, checked against the metadata's copy
            return self._src.checked_log(k, self._known.get(k))
        if what == "summaries":
            return self._src.summaries(k)
        if what == "gold":
            return self._gold(k)
        raise KeyError(what)

    def prefetch(self, device: torch.device, background: bool = False) -> None:
        """Make the digest weights for ``device`` (`vd.digest.weights`, tens of ms the first time in a
        process) when the golden has digests; on a CUDA ``device``, from now on read every K ahead of use
        (`vd.reader.GoldenReader`): on a thread while ``background`` (a replay loading its model), else
        in the runs' idle time."""
        if self._src.digested:
            _digest.weights(self._src.meta["digest"]["words"], device)
        if device.type != "cuda":
            return
        if self.reader is None:
            from vd.reader import GoldenReader  # the reader builds on this module

            self.reader = GoldenReader(self._src, self._known, device)
        if background:
            self.reader.start_thread()
        else:  # the model is ready: from now on only its runs' idle time (the replay pauses the reader
            # before each graph capture); the thread stops here, and the buffers it has not allocated
            # yet are allocated now: too slow for a step's idle time
            self.reader.allocate()

    def idle(self, seconds: float) -> bool:
        """The GPU is busy for about ``seconds`` more: read what fits (a no-op unless prefetched); False
        once nothing is left to read."""
        return self.reader is not None and self.reader.idle(seconds)

    def gold(self, k: int):
        """K's side of a comparison (`Golden.gold`), made once: every forward's comparison and the control's
        share it (and, for a golden without stored statistics, the statistics it computes)."""
        if k not in self._keys:
            raise KeyError(k)
        return self._get("gold", k)

    def _gold(self, k: int):
        from vd.gold import ByDigest, InMemory  # vd.gold builds on this module

        src = self._src
        if not src.digested:
            return InMemory(self[k], self.device_rows(k))
        if self.reader is not None:  # made in a run's idle time
            return self.reader.gold(k)
        return ByDigest.of(src, k, self._get("checked", k), *self._get("summaries", k))

    def log(self, k: int) -> KLog:
        return self._get("log", k)

    def __getitem__(self, k: int) -> KRecord:
        if k not in self._keys:
            raise KeyError(k)
        return self.reader.record(k) if self.reader is not None and not self._src.digested else self._get("record", k)

    def device_rows(self, k: int) -> dict[str, torch.Tensor] | None:
        """K's rows per kind (`KRecord.rows_by_kind`) as integer bits on the device, ordered after their
        upload; None unless prefetched to a CUDA device (and for a golden with digests: never read ahead)."""
        return self.reader.device_rows(k) if self.reader is not None and not self._src.digested else None

    def __contains__(self, k) -> bool:  # Mapping's would read the record
        return k in self._keys

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def rewrite_summaries(path: str | os.PathLike, k: int) -> None:
    """Recompute K's row digests and statistics from the rows stored in the golden at ``path`` and store
    them (for tools and tests that edit a golden's rows in place: a replay reads rows only where digests
    differ, so an edit without this goes unseen)."""
    src = Source(Path(path))
    g = zarr.open_group(zarr.storage.LocalStore(src.path), mode="r+")
    src.meta = dict(g.attrs["vd"])
    src.prompt = src.read_prompt()
    d, s = row_summary(src.load(k, verify=False).rows_by_kind())
    g[f"k{k}/digests"][...] = d
    g[f"k{k}/stats"][...] = s


def digest_meta(meta: Mapping) -> dict | None:
    """The ``digest`` metadata entry (`vd.digest.meta`) a golden with this metadata is written with, and
    must carry for a replay to compare by digests; None without a vocabulary or a known logits dtype."""
    v, logical = meta.get("vocab_size"), (meta.get("logits") or {}).get("dtype")
    return _digest.meta(v, ENCODINGS[logical][0].itemsize) if isinstance(v, int) and logical in ENCODINGS else None


def check_digests(computed: np.ndarray, stored: np.ndarray, where: str, name: Callable[[int], str]) -> None:
    """Refuse rows whose digests (``computed``, ``[R, LANES]``) disagree with the ``stored`` ones: the
    golden is corrupt, or its rows were edited without `rewrite_summaries`. ``name(i)`` names row ``i``."""
    bad = np.flatnonzero((computed != stored).any(axis=1))
    if bad.size:
        raise GoldenCorruptError(f"{where}/digests: {bad.size} row(s) disagree with the stored rows "
                                 f"(first: {name(int(bad[0]))})")


def check_summaries(d: np.ndarray, s: np.ndarray, counts: Mapping[str, int], where: str) -> None:
    """Refuse digests and statistics arrays that do not hold one digest (`vd.digest.LANES` int64) and one
    set of statistics (`vd.digest.STATS`, float64) per row."""
    rows = sum(counts.values())
    for name, a, want in (("digests", d, (np.int64, _digest.LANES)), ("stats", s, (np.float64, len(_digest.STATS)))):
        if a.shape != (rows, want[1]) or a.dtype != want[0]:
            raise GoldenCorruptError(f"{where}/{name}: {a.dtype} {a.shape}, expected {np.dtype(want[0])} "
                                     f"{(rows, want[1])}")


def log_from(k: int, attrs: Mapping, arrays: Mapping[str, np.ndarray]) -> KLog:
    """K's step log from its group's attributes and its small arrays (`Source.SMALL`)."""
    return KLog(k=k, bootstrap=int(attrs.get("bootstrap", -1)), decoded=attrs.get("decoded"),
                committed_is_greedy=attrs.get("committed_is_greedy"), **{n: arrays[n] for n in Source.SMALL})


def expected_shapes(meta: Mapping, p: int, k: int) -> dict[str, tuple[int, ...]]:
    """The shape every array of K's group must have, from the metadata and the prompt length ``p``
    (the MTP arrays' too, for either feed)."""
    s, v = meta.get("steps"), meta.get("vocab_size")
    return {"tokens": (s, k), "accepted": (s,), "prefill": (p, v), "logits": (s, k, v), "step_ms": (s,),
            "bootstrap_logits": (1, v), "drafts": (s, k - 1), "draft_logits": (s, k - 1, v)}


def _check_shapes(r: KRecord, meta: Mapping, p: int, storage: np.dtype, where: str) -> None:
    k = r.k
    for name, shape in expected_shapes(meta, p, k).items():
        if getattr(r, name) is None:  # the MTP arrays of a reference golden
            continue
        got = getattr(r, name).shape
        if got != shape:
            raise GoldenCorruptError(f"{where}/{name}: shape {got}, expected {shape}")
    for name in ("prefill", "logits", "bootstrap_logits", "draft_logits"):
        if getattr(r, name) is not None and getattr(r, name).dtype != storage:
            raise GoldenCorruptError(f"{where}/{name}: dtype {getattr(r, name).dtype}, expected {storage}")
    if ((r.accepted < 0) | (r.accepted > k - 1)).any():
        raise GoldenCorruptError(f"{where}/accepted: counts outside 0..{k - 1}")
