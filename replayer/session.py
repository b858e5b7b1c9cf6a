"""What a replay sets up before its first run (`open_golden_for`, `set_up`): the golden opened and checked
against what the settings ask, the model loaded (or given) and checked against the golden, the golden's
reader started (it reads and hashes the golden while the model loads: `open_for_replay`), the forwards to
replay and a candidate writer where one is asked for. The result, a `Session`, is what every run of the
replay shares; `Clock` times the phases.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import torch

from vd import env, preflight, protocol
from vd.batch import BatchPlan, BatchView, batched
from vd.dtypes import of_torch
from vd.equivalence import of_golden
from vd.errors import GoldenCorruptError, GoldenError, ModelMismatchError, UsageError
from vd.loop import generated
from vd.models import check_device, check_forward_names, import_code, load_model, require_forwards
from vd.models.device import cpu_forward_hint
from vd.models.inductor import compiles, held, load_artifacts
from vd.models.specs import golden_dir, stored
from vd.policy import Policy
from vd.progress import Progress
from vd.protocol import VerifyModel
from vd.replayer.candidate import CandidateWriter
from vd.store import Golden, Location, Prefetcher, open_golden
from vd.store.format import DECODE_K, DECODE_SINCE
from vd.tracing import check_traceable

PHASES = ("open", "load", "setup", "prepare", "run", "wait_golden", "compare", "control", "batch", "write", "finish")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """What a replay asks for; every field left at its default means: as the golden recorded it.

    ``ks`` limits the replay to some of the golden's verify widths; ``tolerances`` (``[KIND=]SPEC`` items)
    override the golden's policy; ``require_coverage`` fails a golden missing an accept count;
    ``rows`` names the full golden a slim one was made from, to measure its rows; ``save_candidate`` a
    path to keep the replayed forward's rows at, as a golden (`vd.replayer.candidate`; one forward only);
    ``decode_forward`` the forward that computes the decode rows each forward's verify rows are measured
    against (default: the forward itself; another where decode runs another kernel); ``batch`` runs every step
    once more as one member of a batch of that many sequences (`vd.batch`), at ``slot`` (default: every slot in
    turn), its companions made from ``batch_seed`` (default 0).
    """

    model: str | None = None
    head: str | None = None
    forwards: tuple[str, ...] = ()
    ks: tuple[int, ...] = ()
    device: str | None = None
    threads: int | None = None
    allow_model_mismatch: bool = False
    control: bool = True
    tolerances: tuple[str, ...] = ()
    require_coverage: bool = False
    rows: str | None = None
    save_candidate: str | None = None
    decode_forward: str | None = None  # the forward the decode rows are computed with (default: each forward)
    batch: int | None = None
    slot: int | None = None
    batch_seed: int | None = None
    locate: bool = False  # where a forward's rows differ, name the first module (`vd.replayer.locate`)
    pin: str | None = None  # the content digest the golden must have (a suite declaration's ``pin``)
    verify: bool = False  # read every row and check it against its digest and statistics first

    def decoder(self, forward: str) -> str:
        """The forward that computes the decode rows ``forward``'s verify rows are measured against."""
        return self.decode_forward or forward


@dataclass(slots=True)
class Clock:
    """Seconds by phase (`PHASES`) and of parts within them (``within``: ``model_code`` in ``load``,
    ``fingerprint`` in ``setup``), ``started``: from the process's start to the clock's (the replay's), and
    ``first_step``: from the process's start to its first run."""

    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    first_step: float | None = None
    started: float | None = field(default_factory=env.process_age)
    within: dict[str, float] = field(default_factory=dict)

    def timed(self, phase: str, work: Callable[[], T]) -> T:
        """``work()``, its seconds added to ``phase``."""
        t = time.perf_counter()
        try:
            return work()
        finally:
            self.phases[phase] += time.perf_counter() - t


@dataclass(frozen=True, slots=True)
class Opened:
    """The golden (its metadata read and checked), the verify widths to replay and the policy to judge by."""

    golden: Golden
    ks: tuple[int, ...]
    policy: Policy
    reader: Prefetcher | None = None  # started by `open_for_replay`: the golden read and hashed beside the caller


@dataclass(frozen=True, slots=True)
class Session:
    """Everything a replay's runs share: the golden, what was asked, the model and its forwards, the golden's
    reader (which also checks its files), the candidate writer (None unless asked for), progress and the clock; and
    what the report says of the setup (``notes``, the recording's environment and determinism)."""

    golden: Golden
    settings: ReplaySettings
    policy: Policy
    ks: tuple[int, ...]
    model: VerifyModel
    forwards: tuple[str, ...]
    offered: Mapping[str, str]
    reader: Prefetcher
    candidate: CandidateWriter | None
    progress: Progress
    clock: Clock
    notes: tuple[str, ...]
    recorded_env: Mapping[str, Any]
    determinism: Mapping[str, Any] | None
    batch: BatchView | None = None  # with --batch: the model's batch, the golden's sequence one member of it
    # A golden recorded in a batch (its ``batch`` metadata): every run replays its sequence in that batch again.
    recorded_batch: BatchView | None = None

    def served_by(self, decoder: str) -> list[str]:
        """The forwards replayed whose verify rows ``decoder``'s decode rows are measured against."""
        return [n for n in self.forwards if self.settings.decoder(n) == decoder]

    @property
    def runner(self) -> VerifyModel:
        """What the golden's own runs step: the model, or the batch the golden was recorded in."""
        return self.recorded_batch or self.model


def check_pin(g: Golden, pin: str | None) -> None:
    """Refuse (`vd.errors.GoldenError`, exit 2) a golden whose content digest, computed from its step logs and row
    digests (not read from its metadata), is not ``pin``."""
    if pin is None:
        return
    have = g.content_digest()
    if have != pin:
        raise GoldenError(f"{g.url}: its content digest {have} is not the one its declaration pins ({pin}): it was "
                          "changed outside a reviewed refresh (vd refresh updates the pin with the golden)")


def open_golden_for(where: str | os.PathLike | Location, s: ReplaySettings) -> Opened:
    """Open the golden (its metadata only) and check what the settings ask of it (`check_asked`)."""
    g = open_golden(where, rows=s.rows, sizes=False)  # the files' listing is checked by the reader (`_reader`)
    try:
        return check_asked(g, s)
    except BaseException:
        g.close()
        raise


def check_asked(g: Golden, s: ReplaySettings) -> Opened:
    """What the settings ask of the open golden ``g``, checked before any model loads (its widths, the batch,
    its pin, the policy): refused with a `vd.errors.VdError`; else ``g`` opened for a replay under them."""
    preflight.check_threads(s.threads)
    ks = tuple(s.ks) or tuple(g.ks)
    preflight.check_widths(g.url, ks, g.ks)
    if s.save_candidate is not None and sorted(set(ks)) != sorted(g.ks):  # (one of a part opened as damaged)
        raise UsageError(f"--save-candidate keeps a whole next version of the golden, every K it holds "
                         f"({', '.join(map(str, g.ks))}), to review and promote: it does not go with --k "
                         f"{','.join(map(str, ks))}")
    preflight.check_batch(s.batch, s.slot, s.batch_seed, g.info.drafted)
    check_pin(g, s.pin)
    if s.verify:
        g.check_contents()  # every step log, and every row against its digest and statistics (vd verify's)
    policy = Policy.parse(s.tolerances, g.meta.get("policy"))
    policy.check_vocab(g.info.vocab)
    needs = policy.needs_rows
    if g.rows_source is None and needs:
        raise UsageError(f"{g.url} is slim: judging {', '.join(needs)} rows under "
                         f"{', '.join(sorted({policy[k].text for k in needs}))} needs its rows; "
                         "name the full golden with --rows, or judge exact or argmax")
    return Opened(g, ks, policy)


def set_up(opened: Opened, s: ReplaySettings, model: VerifyModel | None, progress: Progress,
           clock: Clock) -> Session:
    """The model (loaded unless given), checked against the golden; the forwards to replay; the reader."""
    t = time.perf_counter()
    g = opened.golden
    recorded_env = g.meta.get("environment") or {}
    determinism = (g.meta.get("determinism") or {}).get("applied")
    env.apply_determinism(determinism)  # what the recording applied, before the model is loaded
    # CPU kernels can split work by thread count: replay with the recording's unless told otherwise
    # (the recorded count, bounded by this machine's cores: more threads than cores only slows it down).
    torch.set_num_threads(s.threads or min(recorded_env.get("threads") or torch.get_num_threads(),
                                           os.cpu_count() or 1))
    artifacts = _artifacts(g, s)  # before anything compiles
    if model is None:
        reader, model = clock.timed("load", lambda: _load_model(opened, s, clock, progress))
    else:
        reader = opened.reader or _reader(opened, model.device)
    try:
        s = _decode_forward(g, model, s)
        forwards, offered, notes = _forwards(g, model, s, clock.within)
        candidate = CandidateWriter(s.save_candidate, g) if s.save_candidate is not None else None
    except BaseException as e:
        try:
            if isinstance(e, GoldenError):
                reader.check_files()  # a damaged file, named, before whatever it broke
        finally:
            reader.close()  # refused: the thread reads no more (`_load_model`)
        raise
    clock.phases["setup"] = time.perf_counter() - t - clock.phases["load"]
    asked = BatchPlan(s.batch, s.slot, s.batch_seed or 0) if s.batch is not None else None
    equivalence = opened.policy.equivalence
    if not g.decoded and (s.decode_forward or equivalence is not None):  # (a PASS said nothing of it)
        asked_for = " and ".join([*([f"equivalence={equivalence.text}"] if equivalence else []),
                                  *(["--decode-forward"] if s.decode_forward else [])])
        notes.append(f"{asked_for} judged nothing: this golden stores no decode rows (format {g.info.version}; "
                     f"they are stored since format {DECODE_SINCE}): record it again to check verify against decode")
    recorded = g.meta.get("batch")
    if recorded is not None:
        notes.append(f"the golden was recorded as one member of a batch of {recorded['n']}: its runs replay it in "
                     "that batch again (the same companions and slots)")
    return Session(g, s, opened.policy, opened.ks, model, forwards, offered, reader, candidate, progress,
                   clock, tuple(notes + artifacts), recorded_env, determinism, _batch(g, model, forwards, s, asked),
                   _batch(g, model, forwards, s, _recorded_plan(recorded)))


def _decode_forward(g: Golden, model: VerifyModel, s: ReplaySettings) -> ReplaySettings:
    """``s`` with the forward the golden's decode rows were computed with (``decode.forward``, where another
    than the golden's) as its decode forward, unless one was asked: refused, naming --decode-forward, where
    this model does not offer it (a CUDA golden's graphed decode on a CPU)."""
    recorded = g.decode_forward
    if s.decode_forward is not None or recorded is None or not g.decoded:
        return s
    offered = model.forwards()
    if recorded not in offered:
        raise UsageError(f"pass --decode-forward NAME: the golden's decode rows were computed with forward "
                         f"{recorded!r}, which this model on {model.device.type} does not offer (it offers "
                         f"{', '.join(offered)})")
    return dataclasses.replace(s, decode_forward=recorded)


def _recorded_plan(batch: Mapping[str, Any] | None) -> BatchPlan | None:
    return None if batch is None else BatchPlan(batch["n"], batch["slot"], batch["seed"])


def _batch(g: Golden, model: VerifyModel, forwards: tuple[str, ...], s: ReplaySettings, plan: BatchPlan | None
           ) -> BatchView | None:
    """With a ``plan`` (``--batch``, or the batch the golden was recorded in): the view that runs the golden's
    sequence in the model's batch (`vd.batch`); each forward to replay (and the decode forward) checked to run
    one."""
    if plan is None:
        return None
    for name in [*forwards, *([s.decode_forward] if s.decode_forward and g.decoded else [])]:
        batched(model, name)
    return BatchView(model, plan, g.prompt, generated(g.info.steps, g.ks))  # the decode group's steps stay within


def _forwards(g: Golden, model: VerifyModel, s: ReplaySettings, seconds: dict[str, float]
              ) -> tuple[tuple[str, ...], Mapping[str, str], list[str]]:
    """The forwards to replay, those the model offers, and the notes the model's check leaves (the
    fingerprint's seconds into ``seconds``)."""
    offered = model.forwards()
    lacks = None if s.forwards or g.info.forward in offered else (  # e.g. a CUDA golden on a CPU
        f"--forward NAME: the golden was recorded with forward {g.info.forward!r}, which this model on "
        f"{model.device.type} does not offer (it offers {', '.join(offered)})")
    notes = check_model(g, model, s.allow_model_mismatch, lacks, seconds=seconds)
    if lacks is not None:
        raise UsageError(f"pass {lacks}")
    forwards = tuple(s.forwards) or (g.info.forward,)
    require_forwards(model, [*forwards, *([s.decode_forward] if s.decode_forward else [])])
    if s.save_candidate is not None and len(forwards) > 1:
        raise UsageError("--save-candidate keeps one forward's rows; replay one --forward")
    if s.locate and not g.traced:  # a suite's untraced golden: said, not refused (one golden is, by the CLI)
        notes.append("--locate: this golden holds no module traces (record it with vd record --trace)")
    elif s.locate:  # (and the decode forwards, where the golden's decode rows were traced)
        decoders = [s.decoder(f) for f in forwards] if g.traced_at(DECODE_K) and g.decoded else []
        for f in dict.fromkeys([*forwards, *decoders]):
            check_traceable(model, f, "--locate")
    return forwards, offered, notes


def _artifacts(g: Golden, s: ReplaySettings) -> list[str]:
    """Load the Inductor artifacts a compiled golden's recording stored, when a compiled forward is to run,
    so that it compiles to the recording's kernels (`vd.models.inductor`); what happened, as a note."""
    about = g.meta.get("compiled")
    if about is None or not any(compiles(f) for f in (s.forwards or [g.info.forward])):
        return []
    if held(about["sha256"]):  # this process saved or loaded them already (its file is checked with the rest)
        return [f"compiled forwards reuse the recording's Inductor artifacts ({about['bytes'] / 1e6:.1f} MB, "
                f"{about.get('torch')}; held by this process already)"]
    data = g.location.get(about["artifacts"])
    if data is None or hashlib.sha256(data).hexdigest() != about["sha256"]:
        raise GoldenCorruptError(f"{g.url}/{about['artifacts']} is missing or does not match its hash")
    why = load_artifacts(data, about["sha256"])
    if why is not None:
        return [f"the recording's Inductor artifacts ({about.get('torch')}) could not be loaded ({why}): compiled "
                "forwards compiled afresh and may run other kernels than the recording's"]
    return [f"compiled forwards reuse the recording's Inductor artifacts ({len(data) / 1e6:.1f} MB, "
            f"{about.get('torch')})"]


def open_for_replay(where: str | os.PathLike | Location, s: ReplaySettings, device: torch.device) -> Opened:
    """Open the golden (`open_golden_for`) and start reading it for a replay on ``device``: its small arrays
    (on CUDA) and every file's hash, on a thread (`vd.store.prefetch`). The CLI's order, where this runs while
    the model loads; a caller holding a loaded model may open here first and hand the result to
    `vd.replayer.replay`, whose runs then find the golden read (`Prefetcher.ready` waits for what is left)."""
    opened = open_golden_for(where, s)
    return dataclasses.replace(opened, reader=_reader(opened, device))


OWN_EQUIVALENCE = "own equivalence"  # the reader's unit: the golden's verify rows against its decode rows


def _reader(opened: Opened, device: torch.device) -> Prefetcher:
    """The golden's reader, started: its arrays, every file's hash, and at each K the golden's own verify rows
    against its decode rows (`vd.equivalence.of_golden`: where they differ, rows read and decoded), all
    derived from the golden alone, so read with it rather than after the runs."""
    g = opened.golden
    reader = Prefetcher(g, device, files=True)
    if g.decoded:
        for k in opened.ks:
            reader.add(OWN_EQUIVALENCE, k, partial(of_golden, g, k, opened.policy.equivalence))
    reader.start_thread()
    return reader


def model_to_load(g: Golden, s: ReplaySettings) -> tuple[str, str | None]:
    """The model SPEC and MTP head file a replay of ``g`` loads: ``--model`` (with ``--head``, else no head) or
    the golden's own (its stored head with it), a file among them resolved from here (`vd.models.specs`)."""
    spec, stored_head = stored(g.meta["model"], golden_dir(g.location))  # a file spec from here
    if s.model is None:
        return spec, s.head if s.head is not None else stored_head
    return s.model, s.head


def _load_model(opened: Opened, s: ReplaySettings, clock: Clock, progress: Progress
                ) -> tuple[Prefetcher, VerifyModel]:
    """The golden's reader, started (the golden is read and hashed while the weights load), and the model. The
    golden's file listing is checked first: a missing, truncated or special file is refused before any model
    loads (a caller that hands a model in leaves that check to the reader, with the rest)."""
    g = opened.golden
    spec, head = model_to_load(g, s)
    dev = s.device or g.info.device
    check_forward_names(spec, list(s.forwards), dev)  # before the model loads
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise preflight.no_cuda(g.url, s.device, g.info.device, cpu_forward_hint(g.info.forward, s.forwards))
    device = check_device(dev)
    reader = opened.reader or _reader(opened, device)
    try:
        reader.check_listing()
        progress.phase("loading model", 0)
        t = time.perf_counter()
        import_code(spec)
        clock.within["model_code"] = time.perf_counter() - t
        return reader, load_model(spec, device=device, dtype=g.logical, head=head)
    except BaseException:
        # Refused (a listing that is off, a model that will not load) or interrupted: the reader stops here. In a
        # process that goes on (a suite's next golden, a test session) a thread still reading would copy to the
        # GPU beside the next model's graph capture, which CUDA refuses ("operation not permitted when stream
        # is capturing").
        reader.close()
        raise


def check_model(golden: Golden, model: VerifyModel, allow_mismatch: bool, lacks: str | None = None, *,
                seconds: dict[str, float] | None = None) -> list[str]:
    """Refuse a model that cannot be compared; a different fingerprint only with ``allow_mismatch``. ``lacks``:
    the other flag the replay needs (a forward), named in the same error so one attempt learns both.
    ``seconds["fingerprint"]``: how long the model's fingerprints took (the report's timing)."""
    if model.vocab_size != golden.info.vocab:
        raise ModelMismatchError(f"model has vocab {model.vocab_size}, golden {golden.url} has {golden.info.vocab}")
    computes = of_torch(model.dtype).name
    if computes != golden.logical:
        raise ModelMismatchError(f"model computes {computes} rows, golden {golden.url} holds {golden.logical} rows: "
                                 "a replay compares rows of the golden's dtype (load the model in it, or replay a "
                                 f"golden recorded in {computes})")
    notes = []
    t = time.perf_counter()
    pairs = _fingerprints(golden, model)
    if seconds is not None:
        seconds["fingerprint"] = time.perf_counter() - t
    for what, got, want in pairs:
        if got == want:
            continue
        if not allow_mismatch:
            also = "" if lacks is None else f", and {lacks}"
            raise ModelMismatchError(f"{what} fingerprint {got[:19]}… differs from golden's {want[:19]}… "
                                     f"(pass --allow-model-mismatch to compare anyway{also})")
        notes.append(f"{what} fingerprint differs from the golden's ({got} vs {want}); allowed by the user")
    return notes


def _fingerprints(golden: Golden, model: VerifyModel) -> list[tuple[str, str, str]]:
    """(what, the model's, the golden's) fingerprints: the model's, and its MTP head's for a drafter golden."""
    meta = golden.meta
    pairs = [("model", model.identity().fingerprint, meta["model"]["fingerprint"])]
    if golden.info.drafted:
        head = protocol.draft_head(model)
        if head is None:
            raise ModelMismatchError(f"{golden.url} was recorded with an MTP draft head and this model has none")
        pairs.append(("MTP head", head.head_info()["fingerprint"], meta["mtp"]["fingerprint"]))
    return pairs
