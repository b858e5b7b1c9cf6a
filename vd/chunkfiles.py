"""A row chunk's files, made the same way by a recording's writer threads and by its writer processes.

Imports neither torch nor zarr (nor the rest of `vd.store`), so that ``python -m vd.chunkfiles`` starts in a
fraction of a second: the writer process of `vd.store.processes`, which encodes, hashes and writes a GPU
recording's row chunks beside its next run. It serves jobs read from its standard input (pickled, one
list of jobs a message) and answers each on its standard output, in order; the rows it reads lie in a
shared file mapping (the arena) the recording copied them into. End of input ends it.

The bytes are zarr's for the codecs vd writes (`encode_chunk`), in byte planes (`split_planes`; FORMAT.md).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path

import google_crc32c
import msgpack
import numcodecs
import numpy as np

from vd.errors import naming


def split_planes(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A stored row array as its (high byte, other bytes) planes: ``[...]`` and ``[..., itemsize - 1]``."""
    n = a.dtype.itemsize
    u = a.view(f"<u{n}")
    hi = (u >> (8 * n - 8)).astype(np.uint8)  # a shift and a cast: faster than copying a strided view
    if n == 2:
        return hi, u.astype(np.uint8)[..., None]
    return hi, np.ascontiguousarray(u.view(np.uint8).reshape(*a.shape, n)[..., :-1])


def chunk_key(index: int, ndim: int) -> str:
    """The key of chunk ``index`` along the first axis of an array of ``ndim`` dimensions chunked along that
    axis only (zarr's default chunk key encoding, ``/`` separated)."""
    return "/".join(["c", str(index), *("0" * (ndim - 1))])


def encode_chunk(values: np.ndarray, compressor: str | None) -> bytes:
    """A chunk's stored bytes as zarr writes them for the codecs vd writes: the values' little-endian bytes,
    Zstd level 1 when ``compressor`` is ``"zstd"``, then their CRC32C (`vd.store.chunks.Array` reads them)."""
    data = np.ascontiguousarray(values).tobytes()
    if compressor == "zstd":
        data = numcodecs.Zstd(level=1).encode(data)
    return data + google_crc32c.value(data).to_bytes(4, "little")


def sha256(data) -> str:
    """The SHA-256 (hex) a golden's manifest lists for a file, and its journal for a block of rows."""
    return hashlib.sha256(data).hexdigest()  # lets go of the interpreter lock


PLANES = (".hi", ".lo")  # a row array's planes, as its arrays' names end (FORMAT.md)


def row_chunk(name: str, index: int, data: np.ndarray, rows: int, shape: tuple[int, ...],
              planes: tuple[str, ...] = PLANES) -> list[tuple[str, bytes]]:
    """Chunk ``index`` of the row array ``name`` (its shape ``shape``, ``rows`` a chunk along the first axis):
    ``data`` as stored, a short last chunk padded with the fill value as zarr stores it; its ``planes``' files
    (both by default) as (key under the K's group, bytes)."""
    data = data.reshape(-1, *shape[1:])
    if len(data) < rows:
        data = np.concatenate([data, np.zeros((rows - len(data), *data.shape[1:]), data.dtype)])
    hi, lo = split_planes(data)
    return [(f"{name}{plane}/{chunk_key(index, part.ndim)}", encode_chunk(part, compressor))
            for (plane, compressor), part in zip(((".hi", "zstd"), (".lo", None)), (hi, lo)) if plane in planes]


def write_file(path: Path, data: bytes | memoryview, digest: str | None = None) -> list:
    """Write ``data`` to ``path`` (its folders made); its [size, SHA-256] for the manifest (``digest``: that
    SHA-256, when the caller has it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with naming(path):
        path.write_bytes(data)
    return [len(data), digest or sha256(data)]


class _Arenas:
    """The arena files this process has mapped, by path."""

    def __init__(self):
        self.maps: dict[tuple[str, int], mmap.mmap] = {}

    def rows(self, arena: tuple[str, int], offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        """Rows in ``arena`` (its path and serial: a larger arena can reuse a path; the older one is let go)."""
        m = self.maps.get(arena)
        if m is None:
            self.maps.clear()  # (views into it are gone with the job that made them)
            with open(arena[0], "r+b") as f:
                m = self.maps[arena] = mmap.mmap(f.fileno(), 0)
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(m, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)


class Differs(Exception):
    """A block computed again is not the one a resumed recording's journal holds (`vd.store.journal.differs`)."""


def do_job(job: dict, arenas: _Arenas) -> dict:
    """One job: the rows at the arena's ``offset`` written as chunks (their ``planes``, both unless the job
    names one: a recording sends the rows it writes once a run ended as a job per plane, `vd.store.write.KRows`)
    and, with a ``journal``, their SHA-256 (``digest``: ``"chunk"`` per chunk, ``"whole"`` one over every row
    of the job) checked against ``expect`` and appended to it (`vd.store.journal`); or ``files``, (key, bytes)
    written as they are; or a ``file``, (key, offset, size, SHA-256 or None), its bytes in the arena. The files
    written, the blocks hashed and how many were checked."""
    staged = Path(job["staged"])
    if "files" in job:  # a K's small arrays and metadata documents
        return {"files": {key: write_file(staged / key, data) for key, data in job["files"]}, "checked": 0}
    if "file" in job:  # a larger file, in the arena
        key, offset, size, digest = job["file"]
        whole = arenas.rows(job["arena"], offset, "|u1", (size,))
        return {"files": {key: write_file(staged / key, whole.data, digest)}, "checked": 0}
    rows = arenas.rows(job["arena"], job["offset"], job["dtype"], job["shape"])
    group = job["group"]
    files, digests = {}, {}
    for name, index, a, b, chunk_rows, shape in job["chunks"]:
        part = rows[a:b]
        for key, data in row_chunk(name, index, part, chunk_rows, shape, tuple(job.get("planes", PLANES))):
            files[f"{group}/{key}"] = write_file(staged / group / key, data)
        if job.get("digest") == "chunk":
            digests[index] = sha256(np.ascontiguousarray(part).data)
    if job.get("digest") == "whole":
        digests[None] = sha256(np.ascontiguousarray(rows).data)
    checked = 0
    if job.get("journal") is not None:
        for s, digest in digests.items():
            want = job.get("expect", {}).get(s)
            if want is not None and want != digest:
                raise Differs(s)
            checked += want is not None
            fd = os.open(job["journal"], os.O_WRONLY | os.O_APPEND)
            try:
                with naming(job["journal"]):
                    os.write(fd, msgpack.packb({"k": job["k"], "s": s, "sha256": digest}, use_bin_type=True))
            finally:
                os.close(fd)
    return {"files": files, "digests": digests, "checked": checked}


def serve(inp, out) -> None:
    """Answer every message of jobs on ``inp`` on ``out``, in order: per job its result, or an error's
    ``{"error": (type name, message, traceback)}`` (`Differs`: the step; an `OSError`'s ``"os"``: its errno,
    strerror and filename too). A recording that died leaves its
    jobs done all the same (its journal complete for the resume), unanswered."""
    arenas = _Arenas()
    while True:
        try:
            jobs = pickle.load(inp)
        except EOFError:
            return
        for job in jobs:
            try:
                answer = do_job(job, arenas)
            except BaseException as e:  # noqa: BLE001  every failure goes back to the recording to raise
                answer = {"error": (type(e).__name__, str(e) if not isinstance(e, Differs) else e.args[0],
                                    traceback.format_exc())}
                if isinstance(e, OSError):  # raised again as the system said it (`GoldenWriter._take`)
                    answer["os"] = (e.errno, e.strerror, e.filename)
            if out is not None:
                try:
                    pickle.dump(answer, out, protocol=pickle.HIGHEST_PROTOCOL)
                except BrokenPipeError:
                    out = None
        if out is not None:
            try:
                out.flush()
            except BrokenPipeError:
                out = None


if __name__ == "__main__":
    # Ctrl-C reaches the recording's whole process group: the recording stops, and ends this by closing its input.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(sys.stdin.buffer, sys.stdout.buffer)
