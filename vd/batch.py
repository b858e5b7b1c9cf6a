"""Batch composition: a golden's sequence run as one member of a batch of N (``vd replay --batch N``).

A serving engine verifies many requests in one forward call, and a kernel chosen by the batch's row count
(M = B·K) may sum in another order, so a request's rows can depend on who shares its batch. `BatchView` makes
that checkable with the replay machinery unchanged: it is a `vd.protocol.VerifyModel` whose one sequence is
member ``slot`` of a batch the model runs (`vd.protocol.BatchedForwards`). Each `forward` of the golden's
sequence is one `forward_batch` call in which every other member, a *companion*, takes its own next step:

* companions have other prompts of other lengths, made from the golden's prompt's tokens and a seed
  (`companion_prompts`: deterministic, so a report's seed reproduces the batch);
* each runs its own reference feed in lockstep (`vd.loop.reference_drafts` over its own greedy continuation,
  computed first by a batched decode of the companions alone): verify ``[last, drafts]``, accept what its rows'
  argmaxes accept, rewind the rest, so its accept counts, rewinds and length differ from the golden's sequence's;
* the golden's sequence sits at slot ``plan.slot`` for every call, or (no slot asked) at slot ``call % N``:
  every slot in turn, the prefill at slot 0. Moving it is a `reorder_batch` swap, as a scheduler reorders.

Only the golden's sequence's rows come back (a copy of its slot's rows: the view owns them). ``slots`` logs
the slot of every call since the last `reset` (call 0 is the prefill), for the report's first difference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vd import protocol
from vd.errors import ModelOutputError, UsageError
from vd.layout import accepted
from vd.loop import reference_drafts
from vd.protocol import BatchedForwards, ModelIdentity, VerifyModel


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """A batch of ``n`` sequences; the golden's at ``slot`` (None: every slot in turn); companions from ``seed``."""

    n: int
    slot: int | None = None
    seed: int = 0

    def slot_at(self, call: int) -> int:
        """The slot of the golden's sequence at its ``call``-th forward since a reset (0: the prefill)."""
        return self.slot if self.slot is not None else call % self.n

    def to_json(self) -> dict:
        return {"n": self.n, "slot": self.slot, "seed": self.seed}


def slots_text(slot: int | None) -> str:
    """Where a plan puts the golden's sequence, in words (``slot`` None: every slot in turn)."""
    return "every slot in turn" if slot is None else f"slot {slot}"


def batched(model: VerifyModel, forward: str) -> BatchedForwards:
    """``model`` as a `vd.protocol.BatchedForwards` that runs ``forward`` in a batch, else a one-line refusal."""
    b = protocol.batched(model)
    if b is None:
        raise UsageError(f"--batch: the model ({protocol.adapter_name(model)}) cannot run a batch (it lacks the "
                         "optional vd.protocol.BatchedForwards: forward_batch and its kin)")
    can = list(b.batch_forwards())
    if forward not in can:
        raise UsageError(f"--batch: forward {forward!r} of this model cannot run a batch (those that can: "
                         f"{', '.join(can) or 'none'})")
    return b


def companion_prompts(prompt: Sequence[int], n: int, seed: int) -> list[list[int]]:
    """The prompts of the ``n - 1`` companions of ``prompt`` in a batch of ``n``: tokens drawn from ``prompt``'s
    own (real ids of its tokenizer) by a generator seeded with ``seed`` and the companion's number, each of a
    length other than ``prompt``'s (from half of it to half again as long)."""
    p = len(prompt)
    out = []
    for c in range(1, n):
        rng = np.random.default_rng([seed, c])
        lengths = [x for x in range(max(2, p // 2), p + p // 2 + 3) if x != p]
        size = int(rng.choice(lengths))
        out.append([int(t) for t in rng.choice(np.asarray(prompt), size=size)])
    return out


class _Companion:
    """One companion's reference feed, stepped in lockstep with the golden's sequence."""

    def __init__(self, prompt: list[int], greedy: list[int], vocab: int):
        self.prompt, self.greedy, self.vocab = prompt, greedy, vocab
        self.last, self.p, self.s = -1, 0, 0
        self.pending: list[int] = []

    def tokens(self, k: int | None) -> list[int]:
        """Its next input: its prompt (``k`` None, the prefill's call) or a verify of width ``k``."""
        if k is None:
            self.pending = list(self.prompt)
        else:
            self.pending = [self.last, *reference_drafts(self.greedy, self.p, self.s, k, self.vocab)]
        return self.pending

    def took(self, argmax: list[int], prefill: bool) -> int:
        """Its rows' argmaxes came back: the positions it rewinds."""
        if prefill:
            self.last = argmax[-1]
            return 0
        na = accepted(self.pending, argmax)
        self.last, self.p, self.s = argmax[na], self.p + na + 1, self.s + 1
        return len(self.pending) - 1 - na


def greedy_batch(model: BatchedForwards, prompts: Sequence[list[int]], n: int, capacity: int) -> list[list[int]]:
    """Each prompt's greedy continuation of ``n`` tokens, by one-token decodes of all of them in one batch."""
    if not prompts:
        return []
    model.reset_batch(len(prompts), capacity)
    rows = model.forward_batch(list(prompts))
    out = [[int(r[-1].argmax())] for r in rows]
    for _ in range(n - 1):
        rows = model.forward_batch([[g[-1]] for g in out])
        for g, r in zip(out, rows):
            g.append(int(r[0].argmax()))
    return out


class BatchView:
    """A `vd.protocol.VerifyModel` whose sequence is one member of a batch of ``plan.n`` (see the module)."""

    owns_rows = True  # it returns a copy of its slot's rows

    def __init__(self, model: VerifyModel, plan: BatchPlan, prompt: Sequence[int], positions: int):
        """``positions``: the most a run appends after its prompt (the companions' greedy continuations are
        that long, and every member's capacity holds the longest prompt and them)."""
        self.model, self.plan = model, plan
        self.vocab_size, self.device, self.dtype = model.vocab_size, model.device, model.dtype
        self.prompts = companion_prompts(prompt, plan.n, plan.seed)
        self.greedy_len = positions
        self.capacity = max(len(p) for p in [list(prompt), *self.prompts]) + positions + 2
        self.greedy: list[list[int]] | None = None  # the companions', computed at the first reset
        self.order: list[int] = []  # the member each slot holds (0: the golden's sequence)
        self.companions: list[_Companion] = []
        self.slots: list[int] = []
        self._member = (0, 0)  # this call's slot and row count (`trace`)
        # Errors about rows this view returns name the model's adapter and its batch method (`protocol.adapter_name`).
        setattr(self, protocol.PLUGIN_SPEC, f"{protocol.adapter_name(model)} (its forward_batch)")

    def describe(self) -> dict:
        """The plan and the companions' prompt lengths, as a golden's ``batch`` metadata and a report state them."""
        return {**self.plan.to_json(), "companion_prompt_tokens": [len(p) for p in self.prompts]}

    @property
    def batch(self) -> BatchedForwards:
        b = protocol.batched(self.model)
        assert b is not None, "batched() checked the model before the view was made"
        return b

    def identity(self) -> ModelIdentity:
        return self.model.identity()

    def forwards(self) -> Mapping[str, str]:
        return self.model.forwards()

    def default_forward(self) -> str:
        return self.model.default_forward()

    def set_forward(self, name: str) -> None:
        self.model.set_forward(name)

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)

    def reset(self) -> None:
        if self.greedy is None:
            self.greedy = greedy_batch(self.batch, self.prompts, self.greedy_len, self.capacity)
        self.batch.reset_batch(self.plan.n, self.capacity)
        self.order = list(range(self.plan.n))
        self.companions = [_Companion(p, g, self.vocab_size) for p, g in zip(self.prompts, self.greedy)]
        self.slots = []

    def _place(self) -> int:
        """Move the golden's sequence to its slot for this call (a swap); that slot."""
        want, at = self.plan.slot_at(len(self.slots)), self.order.index(0)
        if want != at:
            order = list(range(self.plan.n))
            order[want], order[at] = at, want
            self.batch.reorder_batch(order)
            self.order = [self.order[i] for i in order]
        self.slots.append(want)
        return want

    def trace_forwards(self) -> list[str]:
        """The forwards whose modules a batch of two or more traces (the model's traced forwards that run a batch;
        its batch runner hands each point over for every member, ``[n, L, width]``): `trace` keeps this
        sequence's rows."""
        trace = protocol.tracer(self.model)
        if trace is None or self.plan.n < 2:
            return []
        return [f for f in trace.trace_forwards() if f in self.batch.batch_forwards()]

    @contextlib.contextmanager
    def trace(self, record: Callable[[str, str, torch.Tensor], None]) -> Iterator[None]:
        """`vd.protocol.ModuleTrace.trace` for this sequence: each point's rows of its slot, in each call."""
        trace = protocol.tracer(self.model)
        assert trace is not None, "trace_forwards says which forwards trace"

        handed = kept = 0

        def member(name: str, what: str, x: torch.Tensor) -> None:
            nonlocal handed, kept
            handed += 1
            if x.dim() == 3 and x.shape[0] == self.plan.n:
                kept += 1
                record(name, what, x[self._member[0], : self._member[1]])

        with trace.trace(member):
            yield
        if handed and not kept:  # (its points would be compared with nothing, and the rows said to differ outside)
            raise ModelOutputError(f"{protocol.adapter_name(self.model)}: in a batch of {self.plan.n} its trace "
                                   f"handed {handed} output(s), none of them [{self.plan.n}, L, ...]: a batch's trace "
                                   "hands each point once for the whole batch, member by member along its first "
                                   "dimension (vd.protocol.ModuleTrace)")

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        slot = self._place()
        self._member = (slot, len(tokens))
        prefill = len(self.slots) == 1
        k = None if prefill else len(tokens)
        inputs = [list(tokens) if m == 0 else self.companions[m - 1].tokens(k) for m in self.order]
        rows = self.batch.forward_batch(inputs)
        for i, m in enumerate(self.order):
            if m:
                back = self.companions[m - 1].took(rows[i].argmax(-1).tolist(), prefill)
                self.batch.rewind_batch(i, back)
        return rows[slot].clone()

    def rewind(self, n: int) -> None:
        self.batch.rewind_batch(self.order.index(0), n)
