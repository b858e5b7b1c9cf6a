"""A golden read beside a GPU replay without slowing it (`Prefetcher`).

A replay compares its rows by digest, so what it needs of a golden before judging a K is small: the K's
step log arrays (checked against the metadata's copy the run started from), the prompt array, and the
rows' digests and statistics, the digests copied to the GPU. Read on a thread beside the run, that
reading would take the interpreter lock from the run's own Python between its steps; read after the run,
the GPU would wait for it. So the reading is cut into units (read one array, check the log, make the
comparison side), and the run hands over the time the GPU stays busy with each step
(`vd.loop.run_verify`'s ``idle``): the units expected to end within it run there, on the replay's own
thread, each kind of unit timed to refine the expectation (a running mean over the process). While a
replay loads its model, a thread may run units (`start_thread`); `pause` stops it before graphs are
captured. Whatever is left when a K is judged runs then (`side`).

On the CPU nothing is read ahead: a thread would take the cores the model runs on, and there is no idle
time to hand over; each K is read in the caller's thread when it is asked for. A golden without stored
digests has its rows read and digested when a K is asked for, on either device.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from vd.layout import StepLog
from vd.store import format as F
from vd.store.read import Golden
from vd.store.side import GoldenSide
from vd.streams import side_stream

UNIT_S = 1e-3  # seconds a unit of a kind not timed yet is expected to take
HASH_S_PER_BYTE = 1e-9  # a file's hash, per byte, until timed (reading and SHA-256 at 1 GB/s)
FILES = -1  # the pseudo-K of the file-hashing units
BIG_FILE = 1 << 18  # files of this size or more are hashed on a thread of their own (`Prefetcher._hash`)
_EXPECT: dict[str, float] = {}  # seconds a unit of each kind took: a running mean over this process's readers


@dataclass(slots=True)
class _Unit:
    kind: str  # "read", "check", "side", "hash": how long it takes is learnt per kind
    k: int
    fn: Callable[[], object]  # what it returns is not kept
    nbytes: int = 0  # a hash unit's file size: its time is learnt per byte (files range from 100 B to 40 MB)


@dataclass
class _K:
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    log: StepLog | None = None  # the step log read from ``arrays``, checked
    side: GoldenSide | None = None
    error: BaseException | None = None


class Prefetcher:
    """Reads ``golden``'s K sides for a replay on ``device`` unit by unit (see the module's docstring)."""

    def __init__(self, golden: Golden, device: torch.device, ahead: bool | None = None, files: bool = False):
        """``ahead``: read in units at all (default: on CUDA); a golden without stored digests never is.
        ``files``: reading ahead, also hash every file against the golden's manifest, a unit a file, after
        the K's units (`check_files`)."""
        self.golden, self.device = golden, device
        self.ks = {k: _K() for k in (*golden.groups, FILES)}
        self.ahead = ahead = (device.type == "cuda" if ahead is None else ahead) and golden.info.digested
        self.units: deque[_Unit] = deque(u for k in golden.groups for u in self._plan(k)) if ahead else deque()
        listed = golden.manifest if ahead and files else None
        self.hashing = listed is not None
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.timeline: list[tuple[str, str, float]] = []  # (who ran it, unit kind, seconds) of every unit
        self.hasher: threading.Thread | None = None
        if listed is not None:
            big = [key for key, (size, _) in listed.items() if size >= BIG_FILE]
            self.units.extend(_Unit("hash", FILES, partial(golden.check_file, key), size)
                              for key, (size, _) in listed.items() if size < BIG_FILE)
            if big:
                self.hasher = threading.Thread(target=self._hash, args=(big,), name="vd-hash", daemon=True)
                self.hasher.start()
        if golden.info.digested:
            from vd.digest import weights

            weights(golden.meta["digest"]["words"], device)  # tens of ms the first time in a process

    def _plan(self, k: int) -> list[_Unit]:
        names = [*F.step_log_arrays(self.golden.info.version), *F.SUMMARY]
        return ([_Unit("read", k, partial(self._read, k, n)) for n in names]
                + [_Unit("read", k, self.golden.stored_prompt), _Unit("check", k, lambda: self._check(k)),
                   _Unit("side", k, lambda: self._side(k))])

    def _read(self, k: int, name: str) -> None:
        self.ks[k].arrays[name] = self.golden.small(k, name)

    def _check(self, k: int) -> None:
        self.ks[k].log = self.golden.log_from(k, self.ks[k].arrays)

    def _side(self, k: int) -> None:
        kk = self.ks[k]
        side = self.golden.side(k, kk.log, (kk.arrays["digests"], kk.arrays["stats"]))
        side.prepare(self.device, side_stream(self.device) if self.device.type == "cuda" else None)
        self.ks[k].side = side

    # -- who runs units ---------------------------------------------------------------------------
    def start_thread(self) -> None:
        """Run units on a thread until they are all done or another runner stops it."""
        self.stop.clear()

        def work():
            while not self.stop.is_set():
                with self.lock:
                    if not self.units or self.stop.is_set():
                        return
                    self._run(self.units[0], "thread")

        threading.Thread(target=work, name="vd-golden", daemon=True).start()

    def pause(self) -> None:
        """Stop the thread and wait out its unit: nothing of this reader touches the GPU until the next
        `idle` or `side` (a model can capture its graphs)."""
        self.stop.set()
        with self.lock:
            pass

    def idle(self, seconds: float) -> bool:
        """The GPU is busy for about ``seconds`` more: run the units expected to end within that time, in
        order. False once no unit is left (a run need not hand its time over any more)."""
        self.stop.set()
        until = time.perf_counter() + seconds
        if not self.lock.acquire(blocking=False):
            return True
        try:
            while self.units and time.perf_counter() + self._expect(self.units[0]) <= until:
                self._run(self.units[0], "idle")
            return bool(self.units)
        finally:
            self.lock.release()

    def _hash(self, keys: list[str]) -> None:
        """The large files checked on a thread of their own: reading a file and hashing it let go of the
        interpreter lock, so the run's thread hardly notices."""
        for key in keys:
            t = time.perf_counter()
            try:
                self.golden.check_file(key)
            except Exception as e:
                self.ks[FILES].error = self.ks[FILES].error or e
                return
            finally:
                self.timeline.append(("hasher", "hash", time.perf_counter() - t))

    def check_files(self) -> None:
        """The file units left run now (and the large files' thread waited for); the first damaged file found
        raises (`vd.store.manifest`)."""
        self.side_units(FILES)
        if self.hasher is not None:
            self.hasher.join()
        error = self.ks[FILES].error
        if error is not None:
            raise error

    def side_units(self, k: int) -> None:
        """K's remaining units, run now."""
        self.stop.set()
        with self.lock:
            while any(u.k == k for u in self.units):
                self._run(next(u for u in self.units if u.k == k), "drain")

    def side(self, k: int) -> GoldenSide:
        """K's comparison side: its remaining units run now."""
        self.side_units(k)
        kk = self.ks[k]
        if kk.error is not None:
            raise kk.error
        return kk.side if kk.side is not None else self.golden.side(k)

    @staticmethod
    def _expect(u: _Unit) -> float:
        """Seconds ``u`` is expected to take: its kind's running mean, per byte for a file's hash (a large
        file is then left for after the run rather than overrunning a step's idle time)."""
        if u.nbytes:
            return UNIT_S + u.nbytes * _EXPECT.get("hash/byte", HASH_S_PER_BYTE)
        return _EXPECT.get(u.kind, UNIT_S)

    def _run(self, u: _Unit, who: str) -> None:
        """Run ``u`` (queued) and take it off the queue; an error is kept for the K's `side`, as reading in
        line would raise it there, and the K's other units dropped."""
        t = time.perf_counter()
        try:
            with torch.inference_mode():  # as the run that may call it: its tensors stay usable in both
                u.fn()
        except Exception as e:
            self.ks[u.k].error = e
        if self.ks[u.k].error is not None:
            self.units = deque(x for x in self.units if x.k != u.k)
        else:
            self.units.remove(u)
        dt = time.perf_counter() - t
        self.timeline.append((who, u.kind, dt))
        # A running mean that one slow unit moves at most 1.6x: a unit expected to take longer than a step
        # would run only after the run, with every unit queued behind it.
        key, dt = ("hash/byte", max(dt - UNIT_S, 0.0) / u.nbytes) if u.nbytes else (u.kind, dt)
        old = _EXPECT.get(key, HASH_S_PER_BYTE if u.nbytes else UNIT_S)
        _EXPECT[key] = 0.7 * old + 0.3 * min(dt, 3 * old)

    def summary(self) -> dict:
        """Units and seconds by who ran them: the thread while the model loaded, a run's idle time, when a K
        was judged (``drain``), or the large files' thread (``hasher``)."""
        out = {w: {"units": 0, "seconds": 0.0} for w in ("thread", "idle", "drain", "hasher")}
        for who, _, sec in self.timeline:
            out[who]["units"] += 1
            out[who]["seconds"] += sec
        return out
