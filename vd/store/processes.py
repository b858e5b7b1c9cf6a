"""Writer processes: a GPU recording's rows encoded, hashed and written beside its next run.

A recording's store work used to be a tail after each run: its rows copied to the host, then zstd, CRC32C,
SHA-256 and the file writes on the writer's threads, waited for before the next run (threads finishing
them behind the next run slowed its steps through the interpreter lock: tools/h200/record-behind-ab.json).
A `WriterPool` moves that work into processes of their own (``python -m vd.chunkfiles``), which share no
interpreter lock with the recording: after a run, its rows are copied once into the pool's arena (a shared
file mapping, page-locked for the device's copies) and handed over as jobs; the recording goes on to its
next run while the processes write, and waits for them only when it publishes (or when the arena is full).

The pool is the process's (`pool_for`): started once, by `vd record` before its model loads (the processes
import while it loads) or by the first recording that wants one, and kept until the process exits. It
writes for a CUDA model's recording (its host cores are free while the device steps); a CPU recording keeps
its threads, whose cores the model's own threads use, unless ``VD_WRITER_PROCESSES`` asks for processes
(a number; ``0`` never). A process that dies or fails a job fails the recording that gave it the job.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import mmap
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import vd
from vd.errors import UsageError, naming

ENV = "VD_WRITER_PROCESSES"
# Processes a pool runs by default: the writer threads' best on a 16-core H200 host was 8
# (tools/h200/writer-threads.json); the recording's own thread keeps a core.
DEFAULT = max(1, min(8, (os.cpu_count() or 2) - 2))
# The arena's size (larger when one copy needs it): a 16-step 0.5B-shape recording at K=4 copies 41 MB.
ARENA_BYTES = 256 << 20


class WriterError(RuntimeError):
    """A writer process died, or could not be started."""


class _Arena:
    """A shared file mapping the recording copies rows into and the writer processes read them from; on a
    CUDA host page-locked (`cudaHostRegister`) so that a device's copy into it runs at full speed."""

    serials = itertools.count()

    def __init__(self, size: int):
        self.serial = next(self.serials)  # the writer processes tell arenas apart by it (a path can come back)
        fd, self.path = tempfile.mkstemp(prefix="vd-arena-", dir=_arena_dir())
        self.fd: int | None = fd
        try:
            with naming(self.path):
                # Its blocks taken now: a mapping past what its file system can hold faults (SIGBUS) when written,
                # ending the recording without a word; a full /tmp refuses it here instead, named.
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
                else:  # (macOS: no such call)
                    os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            Path(self.path).unlink(missing_ok=True)
            raise
        if os.path.isdir(f"/proc/{os.getpid()}/fd"):  # Linux: the file goes with this process, even a killed one;
            Path(self.path).unlink()  # the writer processes open it through this process's descriptor
            self.path = f"/proc/{os.getpid()}/fd/{fd}"
        else:
            os.close(fd)
            self.fd = None
        self.size, self.pinned = size, False
        self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        if torch.cuda.is_initialized():  # (a CUDA recording's: its model is on the device by now)
            self.bytes.fill_(0)  # pages in before they are locked
            self.pinned = int(torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), size, 0)) == 0

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        del self.bytes
        try:
            self.map.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass
        if self.fd is not None:
            os.close(self.fd)
        else:
            Path(self.path).unlink(missing_ok=True)


def _arena_dir() -> str | None:
    """Where arenas are made: memory-backed ``/dev/shm`` when it has room for a large one, else the temporary
    folder (a container's ``/dev/shm`` is often 64 MB, and a mapping past its end faults)."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize >= 4 * ARENA_BYTES:
            return "/dev/shm"
    except OSError:
        pass
    return None


class _Worker:
    def __init__(self):
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(Path(vd.__file__).resolve().parent.parent),
                                                         os.environ.get("PYTHONPATH")) if p)}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "vd.chunkfiles"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, env=env)
        except OSError as e:
            raise WriterError(f"cannot start a writer process: {e}") from e
        self.pending: collections.deque[int] = collections.deque()  # job ids sent, answers not read

    def send(self, jobs: list[tuple[int, dict]]) -> None:
        assert self.proc.stdin is not None
        try:
            pickle.dump([job for _, job in jobs], self.proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise self.died() from e
        self.pending.extend(i for i, _ in jobs)

    def receive(self) -> tuple[int, dict]:
        """The answer to the oldest job sent."""
        assert self.proc.stdout is not None
        try:
            answer = pickle.load(self.proc.stdout)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            raise self.died() from e
        return self.pending.popleft(), answer

    def died(self) -> WriterError:
        code = self.proc.poll()
        return WriterError(f"a writer process (pid {self.proc.pid}) died"
                           + (f" with exit status {code}" if code is not None else ""))

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class WriterPool:
    """``n`` writer processes and their arena (see the module's docstring). Jobs go out with `submit`,
    answers come back with `collect`; one recording at a time uses it (`vd.store.write.GoldenWriter`)."""

    def __init__(self, n: int = DEFAULT):
        self.n = n
        self.workers = [_Worker() for _ in range(n)]
        self.arena: _Arena | None = None
        self.used = 0  # where the next copy goes
        # The arena's copies in the order they were made: (start, end, the ids of the jobs reading it).
        self.regions: collections.deque[tuple[int, int, list[int]]] = collections.deque()
        self.answers: dict[int, dict] = {}
        # Copies still running on `stream` (`copy_in` without waiting): (done, their rows, their jobs by process).
        self.in_flight: collections.deque[tuple[torch.cuda.Event, torch.Tensor, dict]] = collections.deque()
        self.stream: torch.cuda.Stream | None = None
        self.copying: tuple[torch.cuda.Event, torch.Tensor] | None = None  # the last copy's, until `submit`
        self._next_id = 0
        self._turn = 0

    def copy_in(self, rows: torch.Tensor | np.ndarray, wait: bool = True) -> tuple[int, np.dtype, tuple[int, ...]]:
        """``rows`` (on any device, or as stored) copied into the arena as stored (bf16 as uint16 bits): their
        offset, stored dtype and shape (`_alloc` may wait for jobs reading what it overwrites). The copy is
        finished, unless ``wait`` is False and it runs from a CUDA device into a page-locked arena: then it
        runs on a stream of its own, after what the current stream was given so far, and the jobs `submit`
        sends for it go once it is done (`poll`); such rows must stay unchanged until they go."""
        if not isinstance(rows, torch.Tensor):
            a = np.ascontiguousarray(rows)
            offset = self._alloc(a.nbytes)
            self.view(offset, a.dtype, a.shape)[...] = a
            return offset, a.dtype, a.shape
        src = rows.detach()
        if src.dtype == torch.bfloat16:
            src, dtype = src.view(torch.int16), np.dtype("<u2")
        else:
            dtype = torch.empty(0, dtype=src.dtype).numpy().dtype
        offset = self._alloc(src.numel() * src.element_size())
        assert self.arena is not None
        dst = self.arena.bytes[offset:offset + src.numel() * src.element_size()].view(src.dtype).view(src.shape)
        if src.is_cuda and self.arena.pinned and not wait:
            if self.stream is None:
                self.stream = torch.cuda.Stream(src.device)
            self.stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
                self.copying = (torch.cuda.Event(), src)  # the rows kept until the copy is done
                self.copying[0].record(self.stream)
        else:
            dst.copy_(src, non_blocking=self.arena.pinned and src.is_cuda)
            if src.is_cuda:
                torch.cuda.current_stream(src.device).synchronize()
        return offset, dtype, tuple(src.shape)

    def view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """Rows `copy_in` put at ``offset``, as stored (until a later copy overwrites them)."""
        assert self.arena is not None
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(self.arena.map, dtype=dtype, count=count, offset=offset).reshape(shape)

    def _alloc(self, nbytes: int) -> int:
        """``nbytes`` of the arena, taken as a ring: past its end the next copy starts again at its beginning,
        after the jobs reading what it overwrites (the oldest) are done; a copy larger than the arena waits
        for every job and makes a larger one."""
        need = -(-nbytes // 64) * 64
        if self.arena is None or need > self.arena.size:
            self.poll(wait=True)
            self._wait({i for w in self.workers for i in w.pending})
            self.regions.clear()
            self.used = 0
            if self.arena is not None:
                self.arena.close()
            self.arena = _Arena(max(ARENA_BYTES, 1 << (need - 1).bit_length()))
        if self.used + need > self.arena.size:
            # The copies still listed past this point (the last round's, older than any made since the ring last
            # started again) go first: the ring starts again at 0, where the oldest copy must then be the first
            # listed. (Left listed, a copy made at 0 since went unchecked, and was overwritten under its job.)
            while self.regions and self.regions[0][0] >= self.used:
                self._wait(set(self.regions.popleft()[2]))
            self.used = 0
        while self.regions and self.regions[0][0] < self.used + need and self.regions[0][1] > self.used:
            self._wait(set(self.regions.popleft()[2]))
        offset, self.used = self.used, self.used + need
        self.regions.append((offset, self.used, []))
        return offset

    def submit(self, jobs: list[dict], rows: bool = True) -> list[int]:
        """Send ``jobs`` (`vd.chunkfiles.do_job`'s, their ``arena`` filled in here) reading the last copy's rows
        over the processes (once that copy is done, if it still runs: `copy_in`); their ids. ``rows`` False:
        jobs that read no rows (files given whole), sent at once."""
        ids, by_worker = [], collections.defaultdict(list)
        for job in jobs:
            i, self._next_id = self._next_id, self._next_id + 1
            if rows:
                assert self.arena is not None
                job = {**job, "arena": (self.arena.path, self.arena.serial)}
            by_worker[self._turn].append((i, job))
            self._turn = (self._turn + 1) % self.n
            ids.append(i)
        # The jobs of copies done by now go first: a run's last handed copy has no later step to send its jobs,
        # and left in flight they waited for the publish, whose wait then began with them (3.5-4.5 ms of an H200
        # host's 0.5B recording: tools/h200/tail_parts_05b_cg_after.json).
        self.poll()
        if not rows:
            self._send(by_worker)
            return ids
        self.regions[-1][2].extend(ids)  # the jobs read the last copy's rows
        if self.copying is not None:
            self.in_flight.append((*self.copying, by_worker))
            self.copying = None
            self.poll()
        else:
            self._send(by_worker)
        return ids

    def _send(self, by_worker: dict[int, list[tuple[int, dict]]]) -> None:
        for w, batch in by_worker.items():
            self.workers[w].send(batch)

    def poll(self, wait: bool = False) -> None:
        """Send the jobs of the copies done by now, in order (``wait``: every copy waited for)."""
        while self.in_flight and (wait or self.in_flight[0][0].query()):
            event, _, by_worker = self.in_flight.popleft()
            event.synchronize()
            self._send(by_worker)

    def collect(self, ids: list[int]) -> list[dict]:
        """The answers to jobs ``ids``, waited for (and forgotten here)."""
        self._wait(set(ids))
        return [self.answers.pop(i) for i in ids]

    def _wait(self, want: set[int]) -> None:
        """Every answer to jobs ``want`` read into `answers` (each process answers its jobs in order)."""
        self.poll(wait=True)
        want = want - set(self.answers)
        for w in self.workers:
            while want and w.pending and not want.isdisjoint(w.pending):
                i, answer = w.receive()
                self.answers[i] = answer
                want.discard(i)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        if self.arena is not None:
            self.arena.close()
            self.arena = None


_POOL: WriterPool | None = None


def wanted(device: torch.device | str) -> int:
    """How many writer processes a recording on ``device`` uses (0: the writer's threads)."""
    asked = os.environ.get(ENV, "").strip()
    if asked:
        if not asked.isdigit():
            raise UsageError(f"{ENV}={asked!r}: give a number of writer processes (0: the writer's threads)")
        return int(asked)
    return DEFAULT if torch.device(device).type == "cuda" else 0


def pool_for(device: torch.device | str) -> WriterPool | None:
    """The process's pool for a recording on ``device``, started if need be; None when it writes on threads."""
    global _POOL
    n = wanted(device)
    if n == 0:
        return None
    if _POOL is None or _POOL.n != n or any(w.proc.poll() is not None for w in _POOL.workers):
        if _POOL is not None:
            _POOL.close()
        _POOL = WriterPool(n)
    if _POOL.arena is None and torch.cuda.is_initialized():  # made here, after the model's load, not in a run's tail
        _POOL.arena = _Arena(ARENA_BYTES)  # (256 MB page-locked: 0.12 s on an H200 host)
    return _POOL


@atexit.register
def _close() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None
