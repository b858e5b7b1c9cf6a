"""A golden read and checked before a replay runs (`Prefetcher`), so that nothing of it runs beside the steps.

A replay compares its rows by digest, so what it needs of a golden before judging a K is small: the K's
step log arrays (checked against the metadata's copy the run started from), the prompt array, and the
rows' digests and statistics, the digests copied to the GPU; and every file is hashed against the
golden's manifest. That work is cut into units (read one array, check the log, make the comparison side,
hash one file). A thread runs them while the model loads (`start_thread`, the CLI's order: the golden is
opened, read and hashed while the weights are built); `pause` stops it before graphs are captured, and
`ready` runs whatever is left on the replay's own thread before its first run. So no unit runs while steps
run: work beside a step, on its thread or another taking the interpreter lock between its launches, made
small graphed steps measurably slower (issue 34: the replay ratio of the 0.5B shape went from 1.08 to
1.14-2.39 when files were hashed in the steps' idle time).

On the CPU the K's arrays are not read ahead (each K is read in the caller's thread when it is asked for:
milliseconds, and between runs); its files are hashed by the thread all the same. A golden without
stored digests has its rows read and digested when a K is asked for, on either device.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from vd.layout import StepLog
from vd.store import format as F
from vd.store.read import Golden
from vd.store.side import GoldenSide
from vd.streams import side_stream

FILES = -1  # the pseudo-K of the file-hashing units


@dataclass(slots=True)
class _Unit:
    kind: str  # "read", "check", "side", "hash", or the name of a unit `Prefetcher.add` queued
    k: int
    fn: Callable[[], object]  # what it returns is not kept


@dataclass
class _K:
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    log: StepLog | None = None  # the step log read from ``arrays``, checked
    side: GoldenSide | None = None
    error: BaseException | None = None
    values: dict[str, object] = field(default_factory=dict)  # what units added by `add` computed


class Prefetcher:
    """Reads ``golden``'s K sides and hashes its files for a replay on ``device`` (see the module's docstring)."""

    def __init__(self, golden: Golden, device: torch.device, ahead: bool | None = None, files: bool = False):
        """``ahead``: read the K's arrays in units at all (default: on CUDA); a golden without stored digests
        never is. ``files``: also hash every file against the golden's manifest, a unit a file, after the K's
        units (`check_files`)."""
        self.golden, self.device = golden, device
        self.ks = {k: _K() for k in (*golden.groups, FILES)}
        self.ahead = ahead = (device.type == "cuda" if ahead is None else ahead) and golden.info.digested
        self.units: deque[_Unit] = deque(u for k in golden.groups for u in self._plan(k)) if ahead else deque()
        if files:
            self._plan_files(golden)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.timeline: list[tuple[str, str, float]] = []  # (who ran it, unit kind, seconds) of every unit
        self.thread: threading.Thread | None = None
        if ahead:
            from vd.digest import weights

            weights(golden.meta["digest"]["words"], device)  # tens of ms the first time in a process

    def _plan_files(self, golden: Golden) -> None:
        """The file units (`Golden.check_files`, cut a file a unit): the listing first of all (what `open_golden`
        checks unless a replay defers it), each file's hash after the K's units; a golden without a manifest
        (before format 6) has its every chunk and row checked instead, and a slim golden's full golden is checked
        as `check_files` checks it."""
        listed = golden.manifest
        if listed is not None:  # the hash units queued by the listing's own unit, on the thread that runs it
            self.units.appendleft(_Unit("sizes", FILES, partial(self._listing, listed)))
        else:
            self.units.append(_Unit("contents", FILES, golden.check_contents))
        source = golden.rows_source
        if source is not None and source is not golden:
            self.units.append(_Unit("rows source", FILES, source.check_files))

    def _listing(self, listed: Mapping[str, list]) -> None:
        """The file listing checked (`Golden.check_sizes`, and `Golden.check_traces`), then a unit per listed file
        to hash, after the units queued so far."""
        self.golden.check_sizes()
        self.golden.check_traces()  # (the trace arrays the metadata claims: a replay reads none of them)
        self.units.extend(_Unit("hash", FILES, partial(self.golden.check_file, key)) for key in listed)

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

    def add(self, name: str, k: int, fn: Callable[[], object]) -> None:
        """One more unit of K's reading: ``fn()`` (something a replay derives from the golden alone, such as
        its own verify-against-decode figures), run after the units queued so far, its value kept for
        `value`; an error it raises is K's, as `side` raises it."""
        self.units.append(_Unit(name, k, partial(self._keep, k, name, fn)))

    def _keep(self, k: int, name: str, fn: Callable[[], object]) -> None:
        self.ks[k].values[name] = fn()

    def value(self, k: int, name: str) -> object:
        """What unit ``name`` of K computed (run now if it has not run yet)."""
        self.side_units(k)
        kk = self.ks[k]
        if kk.error is not None:
            raise kk.error
        return kk.values[name]

    # -- who runs units ---------------------------------------------------------------------------
    def start_thread(self) -> None:
        """Run units on a thread until they are all done or `pause` stops it; one started before (stopped by
        `check_listing`) has ended first, so one thread at most reads and `close` has one to wait for."""
        if self.thread is not None:
            self.stop.set()
            self.thread.join()
        self.stop.clear()

        def work():
            # The starter first: `Thread.start` returns only once this thread runs, and a thread that went
            # straight on in Python would keep the interpreter lock for up to its switch interval (5 ms),
            # the starter (a replay's opening) waiting behind it.
            time.sleep(0)
            while not self.stop.is_set():
                with self.lock:
                    if not self.units or self.stop.is_set():
                        return
                    self._run(self.units[0], "thread")

        self.thread = threading.Thread(target=work, name="vd-golden", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Wait for the thread to run every unit (`start_thread`), as a model's load would (a benchmark
        handing a loaded model in waits here, beside nothing, to place the reading where the CLI does)."""
        if self.thread is not None:
            self.thread.join()

    def pause(self) -> None:
        """Stop the thread and wait out its unit: nothing of this reader touches the GPU until `ready` or
        `side` (a model can capture its graphs)."""
        self.stop.set()
        with self.lock:
            pass

    def close(self) -> None:
        """Stop the thread for good and wait for it to end (a replay refused before its runs): the unit in hand
        finished, nothing of this reader touches the GPU or the golden's files after on a thread of its own (what
        is left stays queued: `ready` or `check_files` would run it on the caller's thread)."""
        self.pause()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def ready(self) -> None:
        """Every unit left run now, on the caller's thread (a replay's, before its first run): after this the
        reader does nothing more until the runs are judged. Errors are kept for `side` and `check_files`."""
        self.stop.set()
        with self.lock:
            while self.units:
                self._run(self.units[0], "drain")

    def check_listing(self) -> None:
        """The file listing's unit (`Golden.check_sizes`) run now if it has not run, and its finding raised: what
        `open_golden` checks before any model loads, for a replay that loads its model (`start_thread` runs it
        first anyway)."""
        self.stop.set()
        with self.lock:
            unit = next((u for u in self.units if u.kind == "sizes"), None)
            if unit is not None:
                self._run(unit, "drain")
        self.start_thread()  # the rest while the model loads
        error = self.ks[FILES].error
        if error is not None:
            raise error

    def check_files(self) -> None:
        """The file units left run now; the first damaged file found raises (`vd.store.manifest`)."""
        self.side_units(FILES)
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

    def _run(self, u: _Unit, who: str) -> None:
        """Run ``u`` (queued) and take it off the queue; an error is kept for the K's `side` (or for
        `check_files`), as reading in line would raise it there, and the K's other units dropped."""
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
        self.timeline.append((who, u.kind, time.perf_counter() - t))

    def summary(self) -> dict:
        """Units and seconds by who ran them: the thread (while the model loaded) or the replay's own thread
        before its first run or when a K was judged (``drain``)."""
        out = {w: {"units": 0, "seconds": 0.0} for w in ("thread", "drain")}
        for who, _, sec in self.timeline:
            out[who]["units"] += 1
            out[who]["seconds"] += sec
        return out
