"""From a difference to the first module that makes it (``vd locate GOLDEN --forward A --between B``).

Two forwards of one model run a golden's stored steps (its tokens, accept counts and rewinds, as a replay
drives them) at each K; the first forward call whose rows differ between them (the prefill, or a step) is run
again under both with every traced module's output recorded (`vd.protocol.ModuleTrace`), and the first module,
in the order the forward computes them, whose output differs is named: everything before it is bit-identical,
so it is where the difference starts. The path of the difference through the layers (per layer, its first
differing module and the largest |Δ| there) comes with it. Nothing is judged against the golden: the golden
gives the steps; the forwards are compared with each other (the common case: "my kernel differs from eager:
where?").
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vd import protocol
from vd.errors import UsageError
from vd.loop import DrafterFeed, ReplayFeed, Run, run_verify
from vd.models import check_device, load_model, require_forwards
from vd.models.specs import golden_dir, stored
from vd.protocol import VerifyModel
from vd.store import Golden, Location, open_golden


@dataclass(frozen=True, slots=True)
class Module:
    """One traced point at the located call: its path, what it is, and the largest |Δ| between the forwards."""

    name: str
    what: str
    max_abs: float

    @property
    def layer(self) -> int | None:
        m = re.search(r"\.layers\.(\d+)\.", self.name)
        return int(m.group(1)) if m else None


@dataclass(frozen=True, slots=True)
class Located:
    """One K: the first call whose rows differ (``step`` None: the prefill; no call: ``found`` False), the first
    module whose output differs there, how many points before it are identical, and per layer the first
    differing module (the path of the difference)."""

    k: int
    found: bool
    step: int | None = None
    rows_max_abs: float = 0.0
    first: Module | None = None
    identical_before: int = 0
    path: tuple[Module, ...] = ()

    def to_json(self) -> dict:
        def plain(m: Module | None):
            return None if m is None else {"name": m.name, "what": m.what, "layer": m.layer, "max_abs": m.max_abs}

        return {"k": self.k, "differs": self.found, "step": self.step, "rows_max_abs": self.rows_max_abs,
                "first_module": plain(self.first), "identical_before": self.identical_before,
                "path": [plain(m) for m in self.path]}


@dataclass(frozen=True, slots=True)
class LocateReport:
    golden: str
    forwards: tuple[str, str]
    ks: tuple[Located, ...] = field(default_factory=tuple)

    @property
    def found(self) -> bool:
        return any(x.found for x in self.ks)

    def to_json(self) -> dict:
        return {"golden": self.golden, "forwards": list(self.forwards), "differs": self.found,
                "verify": [x.to_json() for x in self.ks]}


class _TracedAt:
    """``model``'s forward with its modules traced (into ``points``) during the ``call``-th forward only."""

    def __init__(self, model: VerifyModel, trace: protocol.ModuleTrace, call: int):
        self.model, self.trace, self.call, self.calls = model, trace, call, 0
        self.vocab_size, self.device, self.dtype = model.vocab_size, model.device, model.dtype
        self.points: list[tuple[str, str, torch.Tensor]] = []

    def reset(self) -> None:
        self.calls = 0
        self.model.reset()

    def forward(self, tokens):
        self.calls += 1
        if self.calls - 1 != self.call:
            return self.model.forward(tokens)
        with self.trace.trace(lambda name, what, x: self.points.append((name, what, x))):
            return self.model.forward(tokens)

    def rewind(self, n: int) -> None:
        self.model.rewind(n)

    def __getattr__(self, name):  # identity, forwards, encode, the draft head: the model's
        return getattr(self.model, name)


def _run(model, g: Golden, k: int, steps: int) -> Run:
    log = g.log(k)
    feed = ReplayFeed(log.steps[:steps], log.bootstrap, log.decoded)
    return run_verify(model, g.prompt, k, steps, DrafterFeed(k, steps, feed) if g.info.drafted_at(k) else feed)


def _first_call(a: Run, b: Run) -> tuple[int, float] | None:
    """The first forward call (0: the prefill, s + 1: step s) whose rows differ between two runs, and its |Δ|."""
    for call, (x, y) in enumerate(zip([a.prefill, *a.rows], [b.prefill, *b.rows])):
        if not torch.equal(x, y):
            return call, (x.float() - y.float()).abs().max().item()
    return None


def _compare(pa: Sequence[tuple[str, str, torch.Tensor]], pb: Sequence[tuple[str, str, torch.Tensor]]
             ) -> tuple[Module | None, int, tuple[Module, ...]]:
    """The first point whose output differs, how many are identical before it, and per layer the first one."""
    first, before, path, seen = None, 0, [], set()
    for (name, what, x), (name_b, _, y) in zip(pa, pb):
        if name != name_b:
            raise UsageError(f"the two forwards traced other modules ({name} against {name_b}): cannot compare")
        if x.shape == y.shape and torch.equal(x, y):
            before += first is None
            continue
        m = Module(name, what, (x.float() - y.float()).abs().max().item() if x.shape == y.shape else float("inf"))
        first = first or m
        if m.layer not in seen:
            seen.add(m.layer)
            path.append(m)
    return first, before, tuple(path)


def locate_k(model: VerifyModel, g: Golden, k: int, forwards: tuple[str, str]) -> Located:
    """Forwards ``forwards`` through the golden's steps at ``k``; the first module where they part (`Located`)."""
    runs = []
    for name in forwards:
        model.set_forward(name)
        runs.append(_run(model, g, k, g.layout(k).steps))
    hit = _first_call(*runs)
    if hit is None:
        return Located(k, False)
    call, rows_max = hit
    trace = protocol.tracer(model)
    assert trace is not None, "locate checked the model traces before it ran"
    traced = []
    for name in forwards:
        model.set_forward(name)
        wrapped = _TracedAt(model, trace, call)
        _run(wrapped, g, k, call)  # up to and including the call (call c is step c - 1: c steps)
        traced.append(wrapped.points)
    first, before, path = _compare(*traced)
    return Located(k, True, None if call == 0 else call - 1, rows_max, first, before, path)


def _model(g: Golden, spec: str | None, device: str | None, forwards: tuple[str, str]) -> VerifyModel:
    """The golden's model (or ``spec``), checked to trace both forwards."""
    golden_spec, head = stored(g.meta["model"], golden_dir(g.location))
    model = load_model(spec or golden_spec, device=check_device(device or g.info.device), dtype=g.logical,
                       head=head if spec is None else None)
    require_forwards(model, list(forwards))
    trace = protocol.tracer(model)
    can = [] if trace is None else list(trace.trace_forwards())
    missing = [f for f in forwards if f not in can]
    if missing:
        why = ("it cannot trace its modules (vd.protocol.ModuleTrace)" if trace is None else
               f"it traces the modules of {', '.join(can) or 'no forward'} only")
        raise UsageError(f"vd locate: forward {missing[0]!r} cannot be traced: {why}")
    return model


def locate(where: str | os.PathLike | Location, forward: str, between: str, *, model_spec: str | None = None,
           ks: Sequence[int] = (), device: str | None = None, model: VerifyModel | None = None,
           on_k: Callable[[Located], None] | None = None) -> LocateReport:
    """``forward`` and ``between`` through the golden at ``where``, each K (or ``ks``); see the module."""
    g = open_golden(where)
    try:
        widths = tuple(ks) or tuple(g.ks)
        bad = [k for k in widths if k not in g.ks]
        if bad:
            raise UsageError(f"{g.url} has no K={bad[0]} (it holds {', '.join(map(str, g.ks))})")
        pair = (forward, between)
        m = model or _model(g, model_spec, device, pair)
        out = []
        with torch.inference_mode():
            for k in widths:
                out.append(locate_k(m, g, k, pair))
                if on_k is not None:
                    on_k(out[-1])
        return LocateReport(g.url, pair, tuple(out))
    finally:
        g.close()
