"""Module traces of a run: each traced point's output rows (`vd.protocol.ModuleTrace`) digested as a golden's
logits rows are (`vd.digest`), with their largest |x| and L2 norm, call by call (``vd record --trace``,
``vd locate``).

A run's traced rows are numbered as its forward calls append them: the prefill's ``P`` rows, the bootstrap
decode's one (drafter feed), then each step's ``K``. For each row and each traced point the trace holds the
6-lane digest of that point's output row for the token and ``[max |x|, ||x||_2]`` in float32 (computed in
float32 from the row's values). FORMAT.md "Module traces" is the layout a golden stores them in.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from vd import protocol
from vd.digest import LANES, digest, summarise
from vd.errors import ModelOutputError, UsageError
from vd.layout import StepLog
from vd.loop import DrafterFeed, ReplayFeed, Run, run_verify
from vd.protocol import VerifyModel
from vd.store.format import DECODE_K

if TYPE_CHECKING:
    from vd.store.write import GoldenWriter

TRACE_STATS = ("absmax", "norm")

Point = tuple[str, str]  # (module path, what it is)


PENDING_BYTES = 1 << 26  # a call's traced rows held before they are digested together (64 MB)


@dataclass(slots=True)
class Call:
    """One traced forward call: its points in the order computed, their rows' digests ``[n, 6]`` (float64, exact
    integers) and statistics ``[n, 2]`` on the model's device, one pair per point, and (where kept) the rows.

    Rows are digested in groups of one width (`_flush`: one matrix product and two reductions for every point of
    that width, not a few kernels per point), at the end of the call or when `PENDING_BYTES` of them wait."""

    points: list[Point] = field(default_factory=list)
    digests: list[torch.Tensor | None] = field(default_factory=list)
    stats: list[torch.Tensor | None] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    pending_bytes: int = 0

    def add(self, name: str, what: str, x: torch.Tensor, keep: bool, rows: int) -> None:
        if x.dim() == 0 or x.shape[0] != rows:  # not one row per token of the call: not a traced point
            return
        x = x.reshape(x.shape[0], -1) if x.dim() != 2 else x
        self.points.append((name, what))
        self.digests.append(None)
        self.stats.append(None)
        x = x.detach().clone()  # the step may write over its intermediates (a cache, an in-place add) later on
        self.pending.append((len(self.points) - 1, x))
        self.pending_bytes += x.numel() * x.element_size()
        if keep:
            self.rows.append(x)
        if self.pending_bytes > PENDING_BYTES:
            self.flush()

    def flush(self) -> None:
        """Digest the rows waiting, width by width."""
        groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
        for i, x in self.pending:
            groups.setdefault((x.shape[1], x.dtype), []).append((i, x))
        for group in groups.values():
            both = torch.cat([x for _, x in group])
            d = digest(both)
            f = both.float()
            st = torch.stack([f.abs().amax(1), f.norm(dim=1)], 1)
            at = 0
            for i, x in group:
                n = x.shape[0]
                self.digests[i], self.stats[i] = d[at:at + n], st[at:at + n]
                at += n
        self.pending, self.pending_bytes = [], 0

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Digests ``int64 [n, M, 6]`` and statistics ``float32 [n, M, 2]``, read back."""
        self.flush()
        if not self.digests:
            return np.zeros((0, 0, LANES), np.int64), np.zeros((0, 0, len(TRACE_STATS)), np.float32)
        d = torch.stack(self.digests, 1).cpu().numpy().astype(np.int64)  # type: ignore[arg-type]
        return d, torch.stack(self.stats, 1).cpu().numpy().astype(np.float32)  # type: ignore[arg-type]


class Traced:
    """``model`` stepped as it is, its forward calls numbered from its last `reset` (0: the prefill), those in
    ``calls`` (None: every one) traced into `traced`; ``keep`` keeps the traced rows themselves too."""

    def __init__(self, model: VerifyModel, trace: protocol.ModuleTrace, calls: Collection[int] | None = None,
                 keep: bool = False):
        self.model, self.trace, self.calls, self.keep = model, trace, calls, keep
        self.vocab_size, self.device, self.dtype = model.vocab_size, model.device, model.dtype
        self.count = 0
        self.traced: dict[int, Call] = {}

    def reset(self) -> None:
        self.count = 0
        self.model.reset()

    def forward(self, tokens):
        call, self.count = self.count, self.count + 1
        if self.calls is not None and call not in self.calls:
            return self.model.forward(tokens)
        c = self.traced[call] = Call()
        with self.trace.trace(lambda name, what, x: c.add(name, what, x, self.keep, len(tokens))):
            rows = self.model.forward(tokens)
        c.flush()
        return rows

    def rewind(self, n: int) -> None:
        self.model.rewind(n)

    def __getattr__(self, name):  # identity, forwards, encode, the draft head: the model's
        return getattr(self.model, name)

    def points(self) -> list[Point]:
        """The points every traced call traced, in the first call's order (a point some call did not hand over,
        such as one without a row per token there, is left out of every call)."""
        calls = [self.traced[c] for c in sorted(self.traced)]
        if not calls:
            return []
        common = set.intersection(*(set(c.points) for c in calls))
        return [p for p in calls[0].points if p in common]

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every traced call's digests and statistics at `points`, call after call: ``[T, M, 6]``, ``[T, M, 2]``."""
        points = self.points()
        parts = []
        for c in sorted(self.traced):
            call = self.traced[c]
            d, st = call.arrays()
            at = {p: i for i, p in enumerate(call.points)}
            idx = [at[p] for p in points]
            parts.append((d[:, idx], st[:, idx]))
        return np.concatenate([d for d, _ in parts]), np.concatenate([s for _, s in parts])


def check_traceable(model: VerifyModel, forward: str, what: str) -> protocol.ModuleTrace:
    """The model as a `vd.protocol.ModuleTrace` that traces ``forward``; else a one-line `UsageError` saying why."""
    trace = protocol.tracer(model)
    can = [] if trace is None else list(trace.trace_forwards())
    if trace is None:
        raise UsageError(f"{what}: forward {forward!r} cannot be traced: the model (a {type(model).__name__}) "
                         "implements no vd.protocol.ModuleTrace, which tracing its modules needs")
    if forward not in can:
        raise UsageError(f"{what}: forward {forward!r} cannot be traced: the model (a {type(model).__name__}) "
                         f"traces the modules of {', '.join(can) or 'no forward'} only")
    return trace


def steps_run(model: VerifyModel, prompt: Sequence[int], log: StepLog, steps: int, drafted: bool) -> Run:
    """The first ``steps`` steps of a stored step log run again through ``model`` (its tokens, accept counts and
    rewinds forced, as a replay drives them), the run's rows kept."""
    feed = ReplayFeed(log.steps[:steps], log.bootstrap, log.decoded)
    return run_verify(model, list(prompt), log.k, steps, DrafterFeed(log.k, steps, feed) if drafted else feed)


def trace_k(model: VerifyModel, forward: str, writer: GoldenWriter, prompt: Sequence[int], log: StepLog,
            summary: tuple[np.ndarray, np.ndarray], drafted: bool) -> list[Point]:
    """``vd record --trace`` for one recorded K: its steps run again with every call traced, its rows checked
    equal to the recorded ones bit for bit (so the traces are the recorded forward's: a graphed forward's
    traced pass runs the same kernels without the graph), the traces written to ``writer``; the points."""
    traced = Traced(model, protocol.tracer(model))  # type: ignore[arg-type]
    run = steps_run(traced, prompt, log, len(log.accepted), drafted)
    digests = summarise(run.rows_by_kind())[0]
    differ = np.flatnonzero((digests != summary[0]).any(1))
    if differ.size:
        group = "the decode rows" if log.k == DECODE_K else f"K={log.k}"
        raise ModelOutputError(f"--trace: forward {forward!r} run again traced did not reproduce its own rows at "
                               f"{group} ({row_name(run, int(differ[0]))}): its module traces would not be its "
                               "own; nothing stored")
    d, st = traced.arrays()
    writer.add_trace(log.k, d, st)
    return traced.points()


def row_name(run: Run, flat: int) -> str:
    """Row ``flat`` of a run's rows (every kind's, in layout order) in words: "verify step 3 row 1"."""
    layout = run.layout
    for kind, n in layout.counts.items():
        if flat < n:
            step, j = layout.locate(kind, flat)
            return f"{kind} row {j}" if step is None else f"{kind} step {step} row {j}"
        flat -= n
    raise IndexError(flat)


def trace_meta(points: Sequence[Point], decode: Sequence[Point] | None = None) -> dict:
    """The golden's ``trace`` metadata (FORMAT.md "Module traces"): the K groups' points and, where the decode
    rows were traced too, the decode forward's (``decode``)."""
    return {"points": [[n, w] for n, w in points], "stats": list(TRACE_STATS), "lanes": LANES,
            **({} if decode is None else {"decode": [[n, w] for n, w in decode]})}
