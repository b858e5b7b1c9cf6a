"""A golden read beside a replay on the GPU without slowing it.

A golden of format 3 stores each row's digest and statistics (`vd.digest`): a replay compares digests
and reads rows only where they differ, after the run (`read_rows`, `vd.gold.ByDigest`). Here it reads
each K's small arrays (step log, prompt, digests, statistics), checks the step log and makes the K's
comparison side (its digests copied to the GPU); an older golden's rows are read and copied to the GPU
ahead of their comparison. Either way the reading must not cost the run:

A plain reader thread beside the run costs the run: zarr's reads run Python between their lock-free
decodes (its event loop and thread pool hand each chunk between threads), and each moment the run's own
Python waits for the interpreter lock adds to a step (measured on the H200, tools/h200/reader-ab.json:
such a thread made the 0.5B shape's 16-step K=4 loop 13-22 % slower, the 8B shape's 3-4 %). So
`GoldenReader` cuts the reading into units and runs each where it costs the run nothing:

* every unit (allocate a K's buffers, read an array's metadata, read a chunk, read a small array, check
  the step log, make the comparison side) runs on the replay's own thread in the time the GPU is busy
  with a step anyway: a run hands that time over (`vd.loop.run_verify`'s ``idle``, after a step's
  forward is issued and before its result is read back) and the reader runs, in order, the units it
  expects to end within it, timing each kind of unit to refine the expectation (a running mean kept
  across the process's readers). A chunk of an uncompressed array (what vd writes unless asked to
  compress, `vd.golden.codecs`) is read from its file straight into page-locked memory, its CRC32C
  checked there and its copy to the GPU issued on a side stream, all in one unit (0.4-0.6 ms for a 1.2
  MB chunk in a replay on the H200 host);
* a compressed chunk's bytes are read and checked in such a unit, and its decode (Blosc or Zstd into
  page-locked memory, no interpreter lock held) and copy run on a few worker threads
  (`READ_WORKERS`).

Measured there (16-step K=4 loops over the bare loop; tools/h200/reader-variants.json and
tools/h200/reader-inline.json): decoding on the workers but copying from pageable memory added 6.7 ms
(0.5B) and 7.5 ms (8B) to the run, the driver's staged copies holding up the run's own CUDA calls; with
page-locked copies 3.3-3.6 ms (0.5B) and 0.7-1.5 ms (8B) more than the same replay with every row read
before the run; reading and checking on the workers as well, 4.9 ms (0.5B); uncompressed chunks read in
the run's idle time, 0.2 ms (0.5B) and 0.25 ms (8B).

Chunks are read straight from their files when the array's codecs are ones vd writes or wrote (bytes,
then Blosc or Zstd, then CRC32C; `Chunks`), and array metadata straight from its ``zarr.json`` (`_plain`;
any other metadata through zarr's own class). Through zarr, opening an array took 1-3 ms and reading
one 1 MB chunk 0.7-2.3 ms on the H200 (tools/h200/reader-units.json; 1 and 2-3 ms on this project's
2-core machines), mostly hand-offs between its event loop and thread pool; through zarr's metadata
class alone 0.3-0.4 ms; this way, 0.08 ms to parse the metadata and 1 ms to read, check and decode a
chunk here. Any other codec chain reads through zarr. A missing chunk, a checksum mismatch or
undecodable bytes raise `GoldenCorruptError`, kept and raised when the K it belongs to is asked for, as
reading in line would. Before any run, while a replay loads its model, a thread may run every unit
(`start_thread`); `pause` stops it before graphs are captured. Whatever is left when a K is needed runs
then.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import google_crc32c
import numcodecs
import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.buffer.cpu import NDBuffer
from zarr.core.metadata.v3 import ArrayV3Metadata

from vd.errors import GoldenCorruptError
from vd.gold import ByDigest, side_stream
from vd.golden import ENCODINGS, KLog, KRecord, Source, check_summaries, expected_shapes, int_bits, log_from

READ_WORKERS = 4  # threads decoding compressed chunks (their work releases the interpreter lock)
# Where each array's rows go: (kind, first row of the kind). A kind is laid out as `KRecord.rows_by_kind`.
_LAYOUT = {"prefill": ("prefill", 0), "logits": ("verify", 0), "bootstrap_logits": ("draft", 0),
           "draft_logits": ("draft", 1)}
_POOL: ThreadPoolExecutor | None = None
UNIT_S = 1e-3  # seconds a unit of a kind not timed yet is expected to take
# Seconds a unit of each kind took, a running mean over this process's readers: a reader starts from it
# (a replay's second K, forward or golden packs its units as well as the first one's last steps did).
_EXPECT: dict[str, float] = {}


def pinned(shape: tuple[int, ...], dtype: np.dtype, device: torch.device) -> np.ndarray:
    """An uninitialised host array, page-locked when ``device`` is a GPU. It comes from torch's caching
    host allocator: locking fresh pages cost 12-33 ms for a 30 MB golden on the H200, so the next replay
    in the process reuses these once this reader is gone (nothing here holds on to it in a cycle)."""
    n = int(np.prod(shape)) * dtype.itemsize
    return torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda").numpy().view(dtype).reshape(shape)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=READ_WORKERS, thread_name_prefix="vd-chunks")
    return _POOL


def node(root: Path, rel: str, where: str) -> dict:
    """The ``zarr.json`` document of the node at ``rel`` under ``root``."""
    try:
        return json.loads((root / rel / "zarr.json").read_text())
    except FileNotFoundError as e:
        raise GoldenCorruptError(f"{where} is missing") from e
    except (OSError, ValueError) as e:
        raise GoldenCorruptError(f"{where}/zarr.json is unreadable: {str(e).splitlines()[0]}") from e


class Chunks:
    """Whole chunks of the zarr array at ``root/rel`` along its first axis, read into a destination.

    Straight from the chunk files when the array is chunked along its first axis only and its codecs
    are bytes (little-endian), optionally Blosc or Zstd, optionally CRC32C; through zarr otherwise
    (`direct` says which).
    """

    def __init__(self, root: Path, rel: str, where: str):
        self.root, self.rel, self.where = root, rel, where
        doc = node(root, rel, where)
        plain = _plain(doc)
        if plain is not None:  # what vd writes: read from the JSON (0.08 against 0.3-0.4 ms through zarr)
            self.shape, self.dtype, chunk, names = plain
        else:
            try:
                meta = ArrayV3Metadata.from_dict(doc)
            except Exception as e:
                raise GoldenCorruptError(f"{where}/zarr.json is not array metadata: {str(e).splitlines()[0]}") from e
            self.shape = tuple(meta.shape)
            self.dtype = np.dtype(meta.data_type.to_native_dtype())
            chunk = tuple(getattr(meta.chunk_grid, "chunk_shape", ()))
            key = meta.chunk_key_encoding
            names = [_CODEC_NAMES.get(type(c), "other") for c in meta.codecs]
            if names and names[0] == "bytes" and not (meta.codecs[0].endian is None
                                                       or meta.codecs[0].endian.value == "little"):
                names[0] = "other"
            if not (getattr(key, "name", None) == "default" and getattr(key, "separator", None) == "/"):
                names = ["other"]  # chunk files named otherwise: read through zarr
        self.step = chunk[0] if chunk else 1
        self.crc = bool(names) and names[-1] == "crc32c"
        inner = names[1:-1] if self.crc else names[1:]
        self.decoder = {("blosc",): _blosc_into, ("zstd",): _zstd_into}.get(tuple(inner))
        self.direct = (
            len(chunk) == len(self.shape) > 0 and chunk[1:] == self.shape[1:]
            and bool(names) and names[0] == "bytes" and np.little_endian
            and (not inner or self.decoder is not None)
        )
        self._array = None

    def ranges(self) -> list[tuple[int, int]]:
        n = self.shape[0]
        return [(i, min(i + self.step, n)) for i in range(0, n, self.step)]

    def check_present(self) -> None:
        """For zarr's path: refuse a missing chunk (zarr reads one back as zeros; the direct path
        refuses it when reading)."""
        if not self.direct:
            arr = self.array()
            if arr.nchunks_initialized != arr.nchunks:
                raise GoldenCorruptError(f"{self.where}: {arr.nchunks - arr.nchunks_initialized} of "
                                         f"{arr.nchunks} chunks are missing")

    def array(self) -> zarr.Array:
        if self._array is None:
            self._array = zarr.open_array(zarr.storage.LocalStore(self.root, read_only=True), path=self.rel, mode="r")
        return self._array

    def read(self, i: int, j: int, out: np.ndarray) -> None:
        """Rows ``i:j`` (whole chunks: ``i`` on a chunk boundary) into ``out`` (shape ``(j - i, ...)``)."""
        if not self.direct:
            try:
                self.array().get_basic_selection(slice(i, j), out=NDBuffer.from_numpy_array(out))
            except Exception as e:  # checksum mismatch (ValueError), truncated or undecodable chunk bytes
                raise GoldenCorruptError(f"{self.where}: cannot read its chunks: {str(e).splitlines()[0]}") from e
            return
        for c in range(i, j, self.step):
            rows = out[c - i:c - i + min(self.step, j - c)]
            if self.decoder is None:
                self.read_into(c // self.step, rows)
            else:
                self.decode(c // self.step, self.fetch(c // self.step), rows)

    def _key(self, index: int) -> str:
        """A chunk's file under the array (the default chunk key encoding, ``/`` separated: `direct`)."""
        return "/".join(["c", str(index), *("0" * (len(self.shape) - 1))])

    @contextlib.contextmanager
    def _chunk_file(self, key: str):
        """Chunk ``key``'s file, opened unbuffered; a missing or unreadable one is a corrupt golden."""
        try:
            with open(self.root / self.rel / key, "rb", buffering=0) as f:
                yield f
        except FileNotFoundError as e:  # zarr would read it back as zeros: a golden never lacks one
            raise GoldenCorruptError(f"{self.where}: chunk {key} is missing") from e
        except OSError as e:
            raise GoldenCorruptError(f"{self.where}: chunk {key} is unreadable: {e}") from e

    def _check_crc(self, key: str, computed: int, stored: bytes) -> None:
        if computed != int.from_bytes(stored, "little"):
            raise GoldenCorruptError(f"{self.where}: chunk {key} fails its CRC32C checksum")

    def read_into(self, index: int, out: np.ndarray) -> None:
        """An uncompressed chunk ``index`` (``decoder`` None, the direct path) read from its file straight
        into ``out`` (its rows; fewer for the array's last chunk where it runs past the end), its
        checksum checked there: no copy between the file and ``out``."""
        key = self._key(index)
        assert out.flags.c_contiguous, "read in place: the destination must be one block"
        flat = out.reshape(-1).view(np.uint8)
        whole = self.step * int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        pad, trailer = bytearray(whole - flat.nbytes), bytearray(4 * self.crc)
        with self._chunk_file(key) as f:
            size = os.fstat(f.fileno()).st_size
            if size != whole + len(trailer):
                raise GoldenCorruptError(f"{self.where}: chunk {key} holds {size - len(trailer)} bytes, "
                                         f"expected {whole}")
            for part in (flat, pad, trailer):
                _read_exact(f, memoryview(part))
        if self.crc:
            self._check_crc(key, google_crc32c.extend(google_crc32c.value(flat), bytes(pad)), trailer)

    def fetch(self, index: int) -> np.ndarray:
        """Chunk ``index``'s stored bytes, their checksum checked (the direct path, a chunk to decode).
        The check holds the interpreter lock (google-crc32c does not release it), the file read and
        `decode` do not."""
        key = self._key(index)
        with self._chunk_file(key) as f:
            data = np.fromfile(f, dtype=np.uint8)
        if self.crc:
            self._check_crc(key, google_crc32c.value(data[:-4]) if len(data) >= 4 else -1, data[-4:].tobytes())
            data = data[:-4]
        return data

    def decode(self, index: int, data: np.ndarray, out: np.ndarray) -> None:
        """`fetch`'s bytes of chunk ``index`` decoded (``decoder``) into ``out``: its rows, fewer for the
        array's last chunk where it runs past the end. Uncompressed chunks are read by `read_into`."""
        whole = out if out.shape[0] == self.step else np.empty((self.step,) + out.shape[1:], self.dtype)
        assert whole.flags.c_contiguous, "decoded in place: the destination must be one block"
        flat = whole.reshape(-1).view(np.uint8)
        try:
            got = self.decoder(data, flat)
        except Exception as e:  # undecodable bytes
            raise GoldenCorruptError(f"{self.where}: cannot decode chunk {index}: {str(e).splitlines()[0]}") from e
        if got != flat.size:
            raise GoldenCorruptError(f"{self.where}: chunk {index} holds {got} bytes, expected {flat.size}")
        if whole is not out:
            out[...] = whole[:out.shape[0]]


_CODEC_NAMES = {BytesCodec: "bytes", BloscCodec: "blosc", ZstdCodec: "zstd", Crc32cCodec: "crc32c"}
_PLAIN_TYPES = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
                "float32", "float64"}


def _plain(doc: dict) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...], list[str]] | None:
    """Shape, dtype, chunk shape and codec names of an array's metadata as vd writes it (a plain numeric
    type, regular chunks, default ``/`` chunk keys, bytes little-endian, then Blosc or Zstd, then
    CRC32C), read from its ``zarr.json`` document; None for anything else (zarr's metadata class reads
    it then)."""
    try:
        grid, codecs = doc["chunk_grid"], doc["codecs"]
        if (doc.get("zarr_format") != 3 or doc.get("node_type") != "array" or doc["data_type"] not in _PLAIN_TYPES
                or grid["name"] != "regular" or doc.get("storage_transformers")
                or doc["chunk_key_encoding"] != {"name": "default", "configuration": {"separator": "/"}}):
            return None
        shape = tuple(int(x) for x in doc["shape"])
        chunk = tuple(int(x) for x in grid["configuration"]["chunk_shape"])
        names = [c["name"] for c in codecs]
        if (len(chunk) != len(shape) or any(c < 1 for c in chunk) or any(n < 0 for n in shape)
                or names not in (["bytes", "crc32c"], ["bytes", "blosc", "crc32c"], ["bytes", "zstd", "crc32c"])
                or codecs[0].get("configuration", {}).get("endian", "little") != "little"):
            return None
        return shape, np.dtype(doc["data_type"]).newbyteorder("<"), chunk, names
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _read_exact(f, into: memoryview) -> None:
    """Fill ``into`` from the unbuffered file ``f`` (a read may return less than asked)."""
    done = 0
    while done < into.nbytes:
        n = f.readinto(into[done:])
        if not n:
            raise OSError("file ended early")
        done += n


def _blosc_into(data: np.ndarray, out: np.ndarray) -> int:
    """Decode a Blosc frame into ``out`` when it holds exactly ``out``'s size; the size it holds (the
    frame's header: version, flags, typesize, then the uncompressed size as little-endian uint32)."""
    size = int.from_bytes(data[4:8].tobytes(), "little") if data.size >= 16 else -1
    if size == out.size:
        numcodecs.blosc.decompress(data, out)
    return size


def _zstd_into(data: np.ndarray, out: np.ndarray) -> int:
    """The same for a Zstd frame (goldens written before vd used Blosc): decoded, then copied."""
    decoded = np.frombuffer(numcodecs.Zstd().decode(data), dtype=np.uint8)
    if decoded.size == out.size:
        out[...] = decoded
    return decoded.size


def row_chunks(src: Source, k: int, name: str) -> Chunks:
    """K's row array ``name``, its metadata read and checked against the golden's."""
    where = f"{src.where(k)}/{name}"
    chunks = Chunks(src.path, f"k{k}/{name}", where)
    expect = expected_shapes(src.meta, len(src.prompt), k)[name]
    if chunks.shape != expect:
        raise GoldenCorruptError(f"{where}: shape {chunks.shape}, expected {expect}")
    storage = ENCODINGS[src.meta["logits"]["dtype"]][0]
    if chunks.dtype != storage:
        raise GoldenCorruptError(f"{where}: dtype {chunks.dtype}, expected {storage}")
    chunks.check_present()
    return chunks


def read_rows(src: Source, k: int, kind: str, idx: np.ndarray) -> np.ndarray:
    """Rows ``idx`` of K's ``kind`` (laid out as `vd.golden.KRecord.rows_by_kind`) read from the store:
    only the chunks holding them, each checked (a golden with digests reads its rows this way, where a
    candidate's differ: `vd.gold.ByDigest`)."""
    v = src.meta["vocab_size"]
    out = np.empty((len(idx), v), ENCODINGS[src.meta["logits"]["dtype"]][0])
    if kind == "prefill":
        where = [("prefill", int(r), 0) for r in idx]
    elif kind == "verify":
        where = [("logits", int(r) // k, int(r) % k) for r in idx]
    else:
        where = [("bootstrap_logits", 0, 0) if r == 0 else ("draft_logits", (int(r) - 1) // (k - 1),
                                                            (int(r) - 1) % (k - 1)) for r in idx]
    arrays: dict[str, Chunks] = {}
    held: dict[tuple[str, int], np.ndarray] = {}  # (array, chunk) -> its rows, read once
    for i, (name, a0, within) in enumerate(where):
        if name not in arrays:
            arrays[name] = row_chunks(src, k, name)
        chunks = arrays[name]
        c = a0 // chunks.step
        if (name, c) not in held:
            lo, hi = c * chunks.step, min((c + 1) * chunks.step, chunks.shape[0])
            held[(name, c)] = np.empty((hi - lo,) + chunks.shape[1:], chunks.dtype)
            chunks.read(lo, hi, held[(name, c)])
        block = held[(name, c)][a0 - c * chunks.step]
        out[i] = block if block.ndim == 1 else block[within]
    return out


@dataclass(slots=True)
class _Unit:
    kind: str  # "alloc", "open", "read", "small", "check", "gold": how long it takes is learnt per kind
    k: int
    fn: Callable[[], None]


@dataclass
class _K:
    """One K's state: its buffers and results as units fill them in, and its first error."""

    k: int
    host: dict = field(default_factory=dict)  # kind -> [R, V] storage array (page-locked on CUDA)
    device: dict = field(default_factory=dict)  # kind -> [R, V] integer bits on the device
    reads: dict = field(default_factory=dict)  # kind -> [Future] of its chunk reads
    small: dict = field(default_factory=dict)  # tokens, accepted, step_ms (drafts, digests) as read; the log
    error: BaseException | None = None
    record: KRecord | None = None
    gold: ByDigest | None = None  # K's comparison side, for a golden with row digests


class GoldenReader:
    """Reads a lazily opened golden's rows to ``device`` unit by unit (see the module's docstring)."""

    def __init__(self, source: Source, known: Mapping[int, KLog], device: torch.device):
        self.src, self.known, self.device = source, known, device
        self.cuda = device.type == "cuda"
        self.stream = side_stream(device) if self.cuda else None
        self.logical = source.meta["logits"]["dtype"]
        self.storage = ENCODINGS[self.logical][0]
        self.ks = {k: _K(k) for k in source.ks}
        self.units: deque[_Unit] = deque(u for k in source.ks for u in self._plan(k))
        self.lock = threading.Lock()
        self.expect: dict[str, float] = dict(_EXPECT)  # seconds a unit of each kind takes (a running mean)
        self.stop = threading.Event()  # the thread's signal to stop
        self.timeline: list[tuple[str, str, float]] = []  # (who ran it, unit kind, seconds) of every unit
        self.current: _Unit | None = None  # the unit running
        self.stored_prompt: list[int] | None = None  # the prompt array, read once for every K's check

    # -- who runs units ---------------------------------------------------------------------------
    def start_thread(self) -> None:
        """Run units on a thread until they are all done or `pause` (or any other runner) stops it."""
        self.stop.clear()

        def work():
            while not self.stop.is_set():
                with self.lock:
                    if not self.units or self.stop.is_set():
                        return
                    self._run(self.units[0], "thread")

        threading.Thread(target=work, name="vd-golden", daemon=True).start()

    def pause(self) -> None:
        """Stop the thread and wait out its unit and the chunk reads under way: nothing of this reader
        touches the GPU until the next `idle` or request (so a model can capture its graphs)."""
        self.stop.set()
        with self.lock:
            for kk in self.ks.values():
                for futures in kk.reads.values():
                    for f in futures:
                        f.exception()  # waits; an error is raised when the K is asked for

    def allocate(self) -> None:
        """Stop the thread, then allocate every K's buffers not allocated yet (before a run: page-locked
        memory that torch's caching allocator holds no block for took 10-34 ms to allocate on the H200,
        longer than any step, and a K's other units queue behind its allocation)."""
        self.stop.set()
        with self.lock:
            for u in [u for u in self.units if u.kind == "alloc"]:
                self._run(u, "prefetch")

    def idle(self, seconds: float) -> bool:
        """The GPU is busy for about ``seconds`` more: run the units expected to end within that time,
        in order (a kind of unit never timed yet is expected to take `UNIT_S`). False once no unit is
        left (a run need not hand its time over any more)."""
        self.stop.set()
        until = time.perf_counter() + seconds
        if not self.lock.acquire(blocking=False):
            return True
        try:
            while self.units and time.perf_counter() + self.expect.get(self.units[0].kind, UNIT_S) <= until:
                self._run(self.units[0], "idle")
            return bool(self.units)
        finally:
            self.lock.release()

    def _drain(self, k: int) -> _K:
        """Run K's remaining units now, and wait for its chunk decodes on the workers."""
        self.stop.set()
        with self.lock:
            while any(u.k == k for u in self.units):  # an open unit queues its reads: more rounds
                self._run(next(u for u in self.units if u.k == k), "drain")
        kk = self.ks[k]
        for futures in kk.reads.values():
            for f in futures:
                if kk.error is None and f.exception() is not None:
                    kk.error = f.exception()
        if kk.error is not None:
            raise kk.error
        return kk

    def _run(self, u: _Unit, who: str) -> None:
        """Run ``u`` (queued) and take it off the queue."""
        kk = self.ks[u.k]
        t = time.perf_counter()
        self.current = u
        try:
            with torch.inference_mode():  # as the run that may call it: its tensors stay writable in both
                u.fn()
        except Exception as e:  # kept for the K's first use, as reading in line would raise it there
            kk.error = e
        self.current = None  # no reference from the reader to a unit's closure (a cycle) once it ran
        if kk.error is not None:  # the K's other units are moot
            self.units = deque(x for x in self.units if x.k != u.k)
        else:
            self.units.remove(u)
        dt = time.perf_counter() - t
        self.timeline.append((who, u.kind, dt))
        # A running mean that one slow unit moves at most 1.6x: a first CUDA allocation can take 10-50x
        # the usual, and a kind expected to take longer than a step runs only after the run, with every
        # unit queued behind it (on the H200 that left 24 of 37 units for after some replays' runs:
        # tools/h200/bench_gpu_history.json, the run of b71c000).
        old = self.expect.get(u.kind, UNIT_S)
        self.expect[u.kind] = _EXPECT[u.kind] = 0.7 * old + 0.3 * min(dt, 3 * old)

    # -- what a caller asks for -------------------------------------------------------------------
    def record(self, k: int) -> KRecord:
        kk = self._drain(k)
        if kk.record is None:
            s, v = self.src.meta["steps"], self.src.meta["vocab_size"]
            arrays = {"prefill": kk.host["prefill"], "logits": kk.host["verify"].reshape(s, k, v)}
            if "draft" in kk.host:
                arrays.update(bootstrap_logits=kk.host["draft"][:1], drafts=kk.small["drafts"],
                              draft_logits=kk.host["draft"][1:].reshape(s, k - 1, v))
            kk.record = self.src.record(kk.small["log"], arrays)
        return kk.record

    def log(self, k: int) -> KLog:
        """K's step log as stored, checked against the metadata's copy."""
        return self._drain(k).small["log"]

    def gold(self, k: int) -> ByDigest:
        """K's comparison side (a golden with row digests): made, with its digests on the device, in a
        run's idle time (`_gold`)."""
        return self._drain(k).gold

    def device_rows(self, k: int) -> dict[str, torch.Tensor]:
        kk = self._drain(k)
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.stream.record_event())  # every upload of K's was issued before this
            for t in kk.device.values():
                t.record_stream(current)  # used there now: not reused before that stream is done with it
        return kk.device

    # -- the units --------------------------------------------------------------------------------
    def _plan(self, k: int) -> list[_Unit]:
        """K's units, in order. A golden with row digests: the small arrays (step log, prompt, digests),
        the step log check and the comparison side (`_gold`); no rows (`vd.gold.ByDigest` reads those
        that differ, after the run). Otherwise: its buffers; each row array opened (queueing its chunk
        reads); the small arrays; the check."""
        if self.src.digested:
            return ([_Unit("small", k, lambda n=n: self._small(k, n))
                     for n in (*Source.SMALL, "prompt", "digests", "stats")]
                    + [_Unit("check", k, lambda: self._check(k)), _Unit("gold", k, lambda: self._gold(k))])
        big = [n for n in self.src.big if n in _LAYOUT]
        small = [*Source.SMALL, "prompt"] + (["drafts"] if "drafts" in self.src.big else [])
        return ([_Unit("alloc", k, lambda: self._alloc(k))]
                + [_Unit("open", k, lambda n=n: self._open(k, n)) for n in big]
                + [_Unit("small", k, lambda n=n: self._small(k, n)) for n in small]
                + [_Unit("check", k, lambda: self._check(k))])

    def _alloc(self, k: int) -> None:
        kk, s, v = self.ks[k], self.src.meta["steps"], self.src.meta["vocab_size"]
        rows = {"prefill": len(self.src.prompt), "verify": s * k}
        if self.src.meta.get("feed") == "mtp":
            rows["draft"] = 1 + s * (k - 1)
        for kind, n in rows.items():
            # Page-locked on CUDA: a copy from pageable memory is staged by the driver, and a worker's
            # staged copies held up the run's own CUDA calls (+5-6 ms a 16-step run on the H200).
            kk.host[kind] = pinned((n, v), self.storage, self.device)
            with self._on_stream():
                kk.device[kind] = torch.empty_like(torch.from_numpy(int_bits(kk.host[kind])), device=self.device)
            kk.reads[kind] = []

    def _open(self, k: int, name: str) -> None:
        """Read a row array's metadata, check it, and queue its chunk reads right after this unit."""
        chunks = row_chunks(self.src, k, name)
        queued = [_Unit("read", k, lambda i=i, j=j: self._submit(k, name, chunks, i, j))
                  for i, j in chunks.ranges()]
        at = self.units.index(self.current)  # this unit, still queued while it runs
        for offset, q in enumerate(queued, 1):
            self.units.insert(at + offset, q)

    def _submit(self, k: int, name: str, chunks: Chunks, i: int, j: int) -> None:
        """Rows ``i:j`` of array ``name`` (one chunk's) to the host buffer and the device. Uncompressed:
        read, checked and its copy issued here. Otherwise the bytes read and checked here, then decoded
        and copied on a worker (through zarr there, for a codec chain vd did not write)."""
        kk = self.ks[k]
        kind = _LAYOUT[name][0]
        if chunks.direct and chunks.decoder is None:
            rows = self._rows(kk, name, chunks, i, j)
            chunks.read_into(i // chunks.step, rows)
            self._upload(kk, name, chunks, i, j)
            return
        data = chunks.fetch(i // chunks.step) if chunks.direct else None
        kk.reads[kind].append(_pool().submit(self._read, kk, name, chunks, i, j, data))

    def _read(self, kk: _K, name: str, chunks: Chunks, i: int, j: int, data: np.ndarray | None) -> None:
        """On a worker: the chunk's ``data`` (its fetched bytes; None: read through zarr) decoded into
        the host buffer, then copied to the device."""
        rows = self._rows(kk, name, chunks, i, j)
        if data is None:
            chunks.read(i, j, rows)
        else:
            chunks.decode(i // chunks.step, data, rows)
        self._upload(kk, name, chunks, i, j)

    @staticmethod
    def _span(name: str, chunks: Chunks, i: int, j: int) -> tuple[str, int, int]:
        """The kind and the rows of it that array ``name``'s rows ``i:j`` are."""
        kind, first = _LAYOUT[name]
        per = int(np.prod(chunks.shape[1:-1]))  # rows of the kind per index of the array's first axis
        return kind, first + i * per, first + j * per

    def _rows(self, kk: _K, name: str, chunks: Chunks, i: int, j: int) -> np.ndarray:
        """The host buffer's rows for array ``name``'s rows ``i:j``, shaped as the array's."""
        kind, r0, r1 = self._span(name, chunks, i, j)
        return kk.host[kind][r0:r1].reshape((j - i,) + chunks.shape[1:])

    def _upload(self, kk: _K, name: str, chunks: Chunks, i: int, j: int) -> None:
        """Copy those rows to the device on the side stream (from page-locked memory: no wait here)."""
        kind, r0, r1 = self._span(name, chunks, i, j)
        with torch.inference_mode(), self._on_stream():
            kk.device[kind][r0:r1].copy_(torch.from_numpy(int_bits(kk.host[kind][r0:r1])), non_blocking=self.cuda)

    def _small(self, k: int, name: str) -> None:
        if name == "prompt":
            if self.stored_prompt is not None:  # read for an earlier K
                return
            rel, where = name, f"{self.src.path}/{name}"
        else:
            rel, where = f"k{k}/{name}", f"{self.src.where(k)}/{name}"
        chunks = Chunks(self.src.path, rel, where)
        chunks.check_present()
        out = np.empty(chunks.shape, dtype=chunks.dtype)
        chunks.read(0, chunks.shape[0], out)
        if name == "prompt":
            self.stored_prompt = out.astype(np.int64).tolist()
        else:
            self.ks[k].small[name] = out

    def _check(self, k: int) -> None:
        kk = self.ks[k]
        attrs = node(self.src.path, f"k{k}", self.src.where(k)).get("attributes") or {}
        if "digests" in kk.small:
            check_summaries(kk.small["digests"], kk.small["stats"], self.src.counts(k), self.src.where(k))
        log = log_from(k, attrs, kk.small)
        self.src.check_log(k, self.known.get(k), log, self.stored_prompt)
        kk.small["log"] = log

    def _gold(self, k: int) -> None:
        """K's `vd.gold.ByDigest`, its digests copied to the device on the side stream and its report
        figures made (so that after the run only the comparison itself is left)."""
        kk, src = self.ks[k], self.src
        kk.gold = ByDigest.of(src, k, kk.small["log"], kk.small["digests"], kk.small["stats"])
        kk.gold.prepare(self.device, self.stream)

    def _on_stream(self):
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

