"""The one verify step loop that recording and replaying share, and the feeds that choose its tokens.

One function, `run_verify`, owns prefill → verify K tokens in one forward → accept → rewind the rejected
rows → commit → next `last`, as in the seed (``met circuit diff --verify``). A feed only decides tokens:

* `ReferenceFeed`: drafts are the model's own greedy continuation, with draft ``1 + s % (K-1)`` bumped by
  one (mod vocab) on every odd step ``s``, so full and partial accepts both occur;
* `ReplayFeed`: exactly the stored tokens, accept counts and bootstrap token;
* `DrafterFeed`: drafts from the model's MTP draft head (`vd.protocol.DraftHead`): a bootstrap decode,
  then after every verify the hidden save, the proposer trim and a propose. Wrapped around a
  `ReplayFeed` it still runs the head (so its drafts and logits are diffed) but verifies the stored
  tokens.

Feeds act through two hooks, `Feed.start` after the prefill and `Feed.after_commit` after each step.
The loop leaves out storage and comparison: it returns the rows it computed.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from vd import protocol
from vd.digest import digest
from vd.errors import AdapterError, ModelOutputError, PluginError, UsageError
from vd.layout import RowLayout, Step, accepted
from vd.protocol import VerifyModel


@dataclass(frozen=True, slots=True)
class Hold:
    """How much of its rows a run holds: past ``limit`` bytes, `Run.settle` hands every held row to
    ``settle(kind, start, rows)`` (each kind's consecutive rows from row ``start`` of the kind, whole steps)
    and lets them go, so a long run's memory stays flat (a recorder summarises them, a replay measures them)."""

    limit: int
    settle: Callable[[str, int, torch.Tensor], None]
    # Called with the rows each step brings (and the prefill's, the draft head's) once it is logged, while the
    # next step's forward runs; the run goes on holding them (a recorder's writer processes copy them then).
    each: Callable[[str, int, torch.Tensor], None] | None = None


# On the CPU held rows count in the process's peak memory, and so do the copies made when they are let go
# (summaries, kept decode rows, the writer's planes): with 16 MB a 128-step SmolLM2 recording peaked 73 MB
# above a 16-step one, with 4 MB 29 MB (the 16-step run never filled the larger hold).
CPU_HOLD_BYTES = 1 << 22
GPU_HOLD_BYTES = 1 << 30  # a GPU holds a short run whole, so its rows are handled in one go behind its last step


def hold_bytes(device: torch.device) -> int:
    """The `Hold` limit on ``device``."""
    return GPU_HOLD_BYTES if device.type == "cuda" else CPU_HOLD_BYTES


@dataclass(slots=True)
class Run:
    """What one pass of the loop computed.

    ``prefill`` is ``[P, V]``; ``rows[s]`` is step ``s``'s ``[K, V]``; both stay on the model's device
    and dtype. With a ``hold``, rows the run let go (`settle`) are gone from them: ``settled`` counts them
    per kind, and ``rows`` holds the steps after them. ``computed`` holds the accept count the run's own
    argmaxes gave at each step (equal to ``steps[s].accepted`` except where a replay forced the stored
    count). ``step_ms`` times each verify forward including its argmax read-back.
    """

    k: int
    prefill: torch.Tensor
    rows: list[torch.Tensor] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    computed: list[int] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    bootstrap: int = -1
    # With a draft head: the bootstrap decode's row [1, V], and for each step the head's proposal that
    # step verifies (drafts[s], draft_rows[s] [K-1, V]).
    bootstrap_row: torch.Tensor | None = None
    drafts: list[tuple[int, ...]] = field(default_factory=list)
    draft_rows: list[torch.Tensor] = field(default_factory=list)
    # A replay's: each proposal's rows' argmax, on their device (`mismatched_drafts`).
    draft_argmax: list[torch.Tensor] = field(default_factory=list)
    # Generated tokens committed before the first step (the drafter's bootstrap decode commits one).
    committed_before: list[int] = field(default_factory=list)
    hold: Hold | None = None
    last: int = -1  # the token the run would commit next, after its last step
    settled: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("prefill", "verify", "draft"), 0))
    prompt: int = 0  # prefill rows (``prefill`` is empty once settled)
    storages: set[int] = field(default_factory=set)  # the memory of the rows held, to refuse a reused buffer
    handed: dict[str, tuple[int, int]] = field(default_factory=dict)  # per kind: held parts and rows given to `each`
    # For an adapter that does not vouch for its rows (`vd.protocol.owns_rows`): each held step's rows' digests when
    # they were returned (the prefill's first), checked before the rows are let go or judged (`check_returned`).
    returned: list[torch.Tensor] | None = None
    adapter: str = ""  # how errors name the adapter (`vd.protocol.adapter_name`)

    def __post_init__(self):
        self.prompt = self.prefill.shape[0]
        self.storages.add(self.prefill.untyped_storage().data_ptr())

    def check_returned(self) -> None:
        """Refuse (`vd.errors.AdapterError`) held rows whose digests are no longer those they had when the
        adapter returned them: it changed them afterwards (a buffer it kept writing to)."""
        if self.returned is None:
            return
        held = [self.prefill, *self.rows] if self.prefill.shape[0] else list(self.rows)
        for i, (rows, then) in enumerate(zip(held, self.returned)):
            if not torch.equal(digest(rows), then):
                step = i - 1 if self.prefill.shape[0] else i + self.settled["verify"] // self.k
                what = "the prefill's rows" if step < 0 else f"step {step}'s rows"
                raise AdapterError(f"the model adapter {self.adapter} changed {what} after returning them: vd "
                                   "keeps every row it is given until the run lets it go, so forward must return a "
                                   "tensor it does not change afterwards")

    def own(self, model, rows: torch.Tensor) -> None:
        """Refuse (`vd.errors.AdapterError`) rows a forward returned in memory the run still holds: the
        adapter reuses its output buffer, so rows held for the golden or the comparison would change."""
        ptr = rows.untyped_storage().data_ptr()
        if ptr in self.storages:
            raise AdapterError(f"the model adapter {protocol.adapter_name(model)} returned rows in memory holding rows "
                               "it returned earlier (a reused output buffer): vd keeps every row it is given until "
                               "the run lets it go, so forward must return a tensor it does not reuse (clone it)")
        self.storages.add(ptr)

    @property
    def layout(self) -> RowLayout:
        """How this run's rows are laid out (`vd.layout.RowLayout`)."""
        return RowLayout(self.prompt, len(self.steps), self.k, self.bootstrap_row is not None)

    def _parts(self) -> dict[str, list[torch.Tensor]]:
        """The rows still held, per kind in layout order, as the run holds them (some may be empty)."""
        parts = {"prefill": [self.prefill], "verify": self.rows}
        if self.bootstrap_row is not None:
            parts["draft"] = [self.bootstrap_row, *self.draft_rows]
        return parts

    def held(self, last: torch.Tensor | None = None) -> list[tuple[str, int, torch.Tensor]]:
        """The rows still held, per kind in layout order: (kind, the kind's row it starts at, rows ``[n, V]``);
        with ``last``, as if those verify rows were one more step's (a run's last, not logged yet)."""
        parts = self._parts()
        if last is not None:
            parts["verify"] = [*self.rows, last]
        out = []
        for kind, ps in parts.items():
            ps = [t for t in ps if t.shape[0]]
            if ps:
                out.append((kind, self.settled[kind], torch.cat(ps) if len(ps) > 1 else ps[0]))
        return out

    def rows_by_kind(self) -> dict[str, torch.Tensor]:
        """The computed rows ``[R, V]`` per kind, of a run that let none go."""
        assert not any(self.settled.values()), "a run that let rows go has them no more"
        held = {kind: rows for kind, _, rows in self.held()}
        return {kind: held.get(kind, self.prefill.new_empty((0, self.prefill.shape[1]))) for kind in self.layout.counts}

    def held_bytes(self) -> int:
        """Bytes of the rows held."""
        n = self.prefill.shape[0] + self.k * len(self.rows) + (self.k - 1) * len(self.draft_rows)
        n += 0 if self.bootstrap_row is None else self.bootstrap_row.shape[0]
        return n * self.prefill.shape[1] * self.prefill.element_size()

    def hand_on(self) -> None:
        """Give the hold's ``each`` the rows held that it has not had yet, and go on holding them."""
        assert self.hold is not None and self.hold.each is not None
        for kind, parts in self._parts().items():
            i, at = self.handed.get(kind, (0, 0))
            for part in parts[i:]:
                if part.shape[0]:
                    self.hold.each(kind, self.settled[kind] + at, part)
                at += part.shape[0]
            self.handed[kind] = (len(parts), at)

    def settle(self) -> None:
        """Hand every held row to the hold's ``settle`` and let them go."""
        assert self.hold is not None, "a run without a hold keeps every row"
        self.check_returned()
        held = int(self.prefill.shape[0] > 0) + len(self.rows)
        for kind, start, rows in self.held():
            self.hold.settle(kind, start, rows)
            self.settled[kind] = start + rows.shape[0]
        self.prefill = self.prefill.new_empty((0, self.prefill.shape[1]))  # not a view: its memory goes too
        self.rows.clear()
        self.storages.clear()
        self.handed.clear()
        if self.returned is not None:  # the digests of rows returned but not logged yet stay
            self.returned = self.returned[held:]
        self.draft_rows.clear()
        if self.bootstrap_row is not None:
            self.bootstrap_row = self.bootstrap_row.new_empty((0, self.bootstrap_row.shape[1]))

    def committed(self) -> list[int]:
        """The generated sequence this run committed: each step's ``last`` and accepted drafts."""
        out: list[int] = list(self.committed_before)
        for st in self.steps:
            out.extend(st.tokens[: st.accepted + 1])
        return out


def corrupted_draft(s: int, k: int) -> int | None:
    """The draft (1 .. K-1) the reference feed corrupts at step ``s``: ``1 + s % (k-1)`` on an odd step, none on
    an even one (the seed's rule), nor where a step has no drafts (a one-token decode, K = 1)."""
    return 1 + s % (k - 1) if s % 2 == 1 and k > 1 else None


def reference_drafts(greedy: Sequence[int], p: int, s: int, k: int, vocab: int) -> list[int]:
    """The drafts of step ``s`` at committed position ``p``: ``greedy[p+1 .. p+k-1]``, with the
    `corrupted_draft` bumped by one (a position past ``greedy`` drafts token 0)."""
    bad = corrupted_draft(s, k)
    out = []
    for j in range(1, k):
        t = greedy[p + j] if p + j < len(greedy) else 0
        out.append((t + 1) % vocab if j == bad else t)
    return out


def reference_accepts(k: int) -> set[int]:
    """The accept counts the reference feed's drafts make at ``k`` when the model accepts its own greedy drafts:
    all K-1 on an even step, those before the `corrupted_draft` on an odd one (it cycles with period 2(K-1)):
    every count at an even K, only the odd ones below K-1 at an odd K."""
    return {k - 1 if (bad := corrupted_draft(s, k)) is None else bad - 1 for s in range(2 * (k - 1))}


class Feed:
    """How a run picks each step. The base class is the neutral hook set; subclasses choose tokens."""

    def start(self, model: VerifyModel, run: Run, first: Callable[[], int]) -> int:
        """After the prefill (``run.prefill``): the token the first step starts from (the bootstrap).
        ``first()`` reads back the prefill's greedy token (a feed that knows its bootstrap token need not:
        the GPU then runs on without waiting for the host)."""
        return first()

    def tokens(self, s: int, last: int, p: int, k: int, vocab: int) -> list[int]:
        """Step ``s``'s verify input, given ``last`` and the committed count ``p`` of generated tokens."""
        raise NotImplementedError

    def accept(self, s: int, computed: int) -> int:
        """The accept count to commit at step ``s``, given what the argmaxes accepted."""
        return computed

    def next_last(self, s: int, computed: int) -> int:
        """The ``last`` of step ``s + 1``, given the argmax of row ``accepted``."""
        return computed

    def after_commit(self, model: VerifyModel, run: Run, s: int, accepted: int, last: int) -> None:
        """After step ``s`` is committed (a drafter saves hidden state, trims and proposes here)."""


class ReferenceFeed(Feed):
    """Drafts from the model's greedy continuation, one corrupted on odd steps."""

    def __init__(self, greedy: Sequence[int]):
        self.greedy = list(greedy)

    def tokens(self, s: int, last: int, p: int, k: int, vocab: int) -> list[int]:
        return [last, *reference_drafts(self.greedy, p, s, k, vocab)]


class ReplayFeed(Feed):
    """Exactly these steps, after this bootstrap token (and, for a drafter golden, after this token
    decoded to bootstrap: ``decoded``)."""

    def __init__(self, steps: Sequence[Step], bootstrap: int, decoded: int | None = None):
        self.steps = list(steps)
        self.bootstrap, self.decoded = bootstrap, decoded

    def start(self, model: VerifyModel, run: Run, first: Callable[[], int]) -> int:
        return self.bootstrap

    def tokens(self, s: int, last: int, p: int, k: int, vocab: int) -> list[int]:
        return list(self.steps[s].tokens)

    def accept(self, s: int, computed: int) -> int:
        return self.steps[s].accepted

    def next_last(self, s: int, computed: int) -> int:
        return self.steps[s + 1].tokens[0] if s + 1 < len(self.steps) else computed


class DrafterFeed(Feed):
    """Drafts from the model's MTP head, as a speculative scheduler runs it.

    ``forced`` (a `ReplayFeed`) replays stored steps instead: the head still runs and its proposals are
    recorded for comparison, but the verify tokens, accept counts and bootstrap token are the stored ones.
    """

    def __init__(self, k: int, steps: int, forced: ReplayFeed | None = None):
        self.k, self.steps, self.forced = k, steps, forced
        self.next: list[int] = []

    def _propose(self, model, run: Run, last: int) -> None:
        drafts, rows = checked_proposal(model, self.k - 1, model.propose(last, self.k - 1))  # rows: [K-1, V]
        self.next = drafts
        run.drafts.append(tuple(drafts))
        run.draft_rows.append(rows)
        if self.forced is not None:  # a replay's check (`mismatched_drafts`), read after the run: no wait here
            run.draft_argmax.append(rows.argmax(dim=-1))

    def start(self, model, run: Run, first: Callable[[], int]) -> int:
        # Bootstrap decode: commit the prefill's rows and its greedy token, then the first propose.
        decoded = self.forced.decoded if self.forced is not None else None
        last = decoded if decoded is not None else first()
        model.save_hidden(run.prefill.shape[0] - 1)
        row = checked(model, [last], model.forward([last]))  # [1, V]
        run.bootstrap_row, run.committed_before = row, [last]
        boot = self.forced.bootstrap if self.forced else _argmax(row)[0]
        model.save_hidden(0)
        self._propose(model, run, boot)
        return boot

    def tokens(self, s: int, last: int, p: int, k: int, vocab: int) -> list[int]:
        return self.forced.tokens(s, last, p, k, vocab) if self.forced else [last, *self.next]

    def accept(self, s: int, computed: int) -> int:
        return self.forced.accept(s, computed) if self.forced else computed

    def next_last(self, s: int, computed: int) -> int:
        return self.forced.next_last(s, computed) if self.forced else computed

    def after_commit(self, model, run: Run, s: int, accepted: int, last: int) -> None:
        if s + 1 < self.steps:  # the proposal after the last step would never be verified
            model.save_hidden(accepted)
            model.trim_proposer()
            self._propose(model, run, last)


def mismatched_drafts(run: Run) -> list[tuple[int, list[int]]]:
    """The proposals of a replay's run (by the step they precede, with the tokens their rows imply) whose drafts are
    not their own rows' argmaxes, as a greedy draft head's are (what `vd.testing.DraftHeadConformance` asks): a head
    proposing other tokens than its rows say, with the rows right."""
    if not run.draft_argmax:
        return []
    flat = torch.cat([a.reshape(-1) for a in run.draft_argmax]).tolist()  # one read-back, after the run
    out, at = [], 0
    for s, (drafts, a) in enumerate(zip(run.drafts, run.draft_argmax)):
        implied, at = flat[at:at + a.numel()], at + a.numel()
        if list(drafts) != implied:
            out.append((s, implied))
    return out


def generated(steps: int, ks: Sequence[int]) -> int:
    """The most positions runs of ``steps`` steps at the widths ``ks`` append after their prompt: a K's last verify
    may reach K past its ``steps * K`` committed tokens (a decode run's ``steps * max(ks)`` one-token steps stay
    within it)."""
    return steps * max(ks) + max(ks)


def prepare(model: VerifyModel, prompt_len: int, steps: int, ks: Sequence[int], decode: bool = True) -> None:
    """Refuse runs longer than the model's context (`vd.protocol.context_length`, optional in the protocol),
    before any step; let a model that can (`vd.protocol.prepare`, optional too) size its static cache for the
    longest sequence these runs build and capture its step graphs (the prefill's, each K's and, with
    ``decode``, the one-token decode's, which a greedy continuation and a drafter's bootstrap run), largest
    first, before any timing."""
    longest = prompt_len + generated(steps, ks) + 2
    context = protocol.context_length(model)
    if context is not None and longest > context:
        raise UsageError(f"{prompt_len} prompt tokens and {steps} steps at K={max(ks)} need {longest} positions; "
                         f"the model's context holds {context} (fewer --steps, or a shorter prompt)")
    protocol.prepare(model, longest, sorted({prompt_len, *ks, *([1] if decode else [])}, reverse=True))


def _on(rows: torch.Tensor, device: torch.device) -> bool:
    """Whether ``rows`` are on ``device`` (a device named without an index, ``cuda``, takes any of its kind's)."""
    have = rows.device
    return have.type == device.type and (device.index is None or have.index in (None, device.index))


def checked(model: VerifyModel, tokens: Sequence[int], rows) -> torch.Tensor:
    """A forward's rows, refused (`vd.errors.ModelOutputError`, exit 2) unless they are what the protocol
    promises: a tensor ``[len(tokens), vocab_size]`` of the model's dtype, on the model's device."""
    want = (len(tokens), model.vocab_size)
    if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != want or rows.dtype != model.dtype:
        got = (f"a {type(rows).__name__}" if not isinstance(rows, torch.Tensor)
               else f"{rows.dtype} rows of shape {list(rows.shape)}")
        raise ModelOutputError(f"{protocol.adapter_name(model)}: forward of {len(tokens)} token(s) returned {got}; "
                               f"the protocol wants {str(model.dtype)} rows of shape {list(want)}")
    if not _on(rows, model.device):
        raise ModelOutputError(f"{protocol.adapter_name(model)}: forward returned rows on {rows.device}, not on "
                               f"the model's device {model.device}; the protocol wants them where it computes")
    return rows


def checked_proposal(model, n: int, proposal) -> tuple[list[int], torch.Tensor]:
    """A draft head's proposal of ``n`` drafts, refused (`vd.errors.ModelOutputError`, exit 2) unless it is what
    `vd.protocol.DraftHead.propose` promises: ``n`` token ids and their ``[n, vocab_size]`` rows as a forward's."""
    name = protocol.adapter_name(model)
    if not (isinstance(proposal, tuple | list) and len(proposal) == 2):
        raise ModelOutputError(f"{name}: propose returned a {type(proposal).__name__}; the protocol wants a pair "
                               "(drafts, rows)")
    drafts, rows = proposal
    try:
        ids = [int(d) for d in drafts]
    except (TypeError, ValueError):
        raise ModelOutputError(f"{name}: propose's drafts are not token ids ({type(drafts).__name__})") from None
    if len(ids) != n or any(not 0 <= d < model.vocab_size for d in ids):
        raise ModelOutputError(f"{name}: propose was asked for {n} draft(s) and returned {ids}; the protocol "
                               f"wants {n} token id(s) below the vocabulary size {model.vocab_size}")
    want = (n, model.vocab_size)
    if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != want or rows.dtype != model.dtype \
            or not _on(rows, model.device):
        got = (f"a {type(rows).__name__}" if not isinstance(rows, torch.Tensor)
               else f"{rows.dtype} rows of shape {list(rows.shape)} on {rows.device}")
        raise ModelOutputError(f"{name}: propose of {n} draft(s) returned {got}; the protocol wants "
                               f"{str(model.dtype)} rows of shape {list(want)} on {model.device}")
    return ids, rows


def _argmax(rows: torch.Tensor) -> list[int]:
    # torch.argmax returns the first maximal index, so ties resolve the same way everywhere.
    return rows.argmax(dim=-1).tolist()


@torch.inference_mode()
def continuation(model: VerifyModel, prompt: Sequence[int], n: int,
                 on_token: Callable[[int], None] | None = None) -> list[int]:
    """The model's greedy continuation of ``prompt``, ``n`` tokens, by plain one-token decode: a run at K = 1
    through this loop (each step verifies the token the last chose and accepts nothing), its rows let go as
    they come; ``on_token(s)`` after each of its ``n - 1`` decode steps (a recording stores these rows: the
    recorder runs the same with a hold that writes them)."""
    run = run_verify(model, prompt, 1, n - 1, ReferenceFeed([]), on_step=on_token,
                     hold=Hold(0, lambda kind, start, rows: None))
    return [*run.committed(), run.last]


def _log(run: Run, s: int, tokens: Sequence[int], rows: torch.Tensor, na: int, computed: int,
         on_step: Callable[[int], None] | None) -> None:
    run.rows.append(rows)
    run.steps.append(Step(tuple(int(t) for t in tokens), na))
    run.computed.append(computed)
    if run.hold is not None and run.hold.each is not None:
        run.hand_on()
    if run.hold is not None and run.held_bytes() > run.hold.limit:
        run.settle()
    if on_step is not None:
        on_step(s)


def _prefill(model: VerifyModel, prompt: Sequence[int], k: int, hold: Hold | None) -> tuple[torch.Tensor, Run]:
    """Start a sequence with ``prompt``: its rows ``[P, V]`` and the run holding them, which watches the rows
    of an adapter whose class does not vouch for them (`vd.protocol.owns_rows`)."""
    model.reset()
    prefill = checked(model, prompt, model.forward(prompt))  # [P, V]
    run = Run(k=k, prefill=prefill, hold=hold)
    if not protocol.owns_rows(model):
        run.returned, run.adapter = [digest(prefill)], protocol.adapter_name(model)
    return prefill, run


def _issue(model: VerifyModel, run: Run, tokens: Sequence[int]) -> torch.Tensor:
    """Issue one verify forward: its rows ``[K, V]``, refused unless the protocol's and in memory of their own."""
    rows = checked(model, tokens, model.forward(tokens))  # [K, V]
    run.own(model, rows)
    if run.returned is not None:
        run.returned.append(digest(rows))
    return rows


def _read_back(run: Run, rows: torch.Tensor, t0: float) -> list[int]:
    """The argmax of each of a step's rows, read back to the host; the step's time since ``t0`` (its forward's
    issue) is logged."""
    outs = _argmax(rows)  # reads back to the host, so the forward has finished
    run.step_ms.append((time.perf_counter() - t0) * 1e3)
    return outs


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused (as it was after): a collection that falls inside a run stops
    its step loop for as long as it walks the heap (a process holding torch and transformers tracks some 400
    thousand objects), time a golden would keep as its steps' and a replay would judge. Objects the loop frees
    go by reference counting as ever; what cycles it makes wait for the collector's next pass after the run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@gc_paused()
@torch.inference_mode()
def run_verify(
    model: VerifyModel,
    prompt: Sequence[int],
    k: int,
    steps: int,
    feed: Feed,
    on_step: Callable[[int], None] | None = None,
    on_last: Callable[[Run, torch.Tensor], None] | None = None,
    hold: Hold | None = None,
) -> Run:
    """Prefill ``prompt``, then ``steps`` verify steps of width ``k`` as ``feed`` chooses them.

    ``on_last(run, rows)`` is called once the last step's forward is issued,
    before its result is read back, with the run so far and that step's rows (a replay queues its comparison
    behind it); the rows held then stay held (a ``hold`` lets none go after it).
    ``on_step(s)`` ticks once step ``s`` is logged. ``hold``: how many rows the run holds before it lets
    them go (`Hold`; None: it keeps every row).
    """
    s: int | None = None  # the step running (None: the prefill), which a plug-in's error names
    try:
        prefill, run = _prefill(model, prompt, k, hold)
        last = run.bootstrap = feed.start(model, run, lambda: _argmax(prefill[-1:])[0])
        p = 0  # generated tokens committed so far
        logged = None  # a step's record, logged once the next step's forward is issued (off the critical path)
        for s in range(steps):
            tokens = feed.tokens(s, last, p, k, model.vocab_size)
            assert len(tokens) == k, f"feed gave {len(tokens)} tokens for K={k}"
            t0 = time.perf_counter()
            rows = _issue(model, run, tokens)  # [K, V]
            if logged is not None:
                _log(run, *logged, on_step)
            if on_last is not None and s == steps - 1:
                on_last(run, rows)
                run.hold = None  # what is held now is on_last's: nothing more is let go
            outs = _read_back(run, rows, t0)
            computed = accepted(tokens, outs)
            na = feed.accept(s, computed)
            model.rewind(k - 1 - na)  # as a scheduler does: the rejected rows go, [last, accepted drafts] stay
            last = feed.next_last(s, outs[na])
            p += na + 1
            logged = (s, tokens, rows, na, computed)
            feed.after_commit(model, run, s, na, last)  # a drafter proposes the next step's drafts here
        if logged is not None:
            _log(run, *logged, on_step)
        run.last = last
        run.check_returned()
    except PluginError as e:  # (a plug-in's method that raised: which call of the run it was)
        e.where = e.where or _call_name(k, s)
        raise
    return run


def _call_name(k: int, step: int | None) -> str:
    """A call of a run at ``k`` as an error names it: ``the prefill of K=2``, ``K=2 step 4``, ``decode step 4``."""
    group = "decode" if k == 1 else f"K={k}"
    return f"the prefill of {'the decode rows' if k == 1 else group}" if step is None else f"{group} step {step}"
