"""Record a golden: the greedy continuation, then for each K the reference feed (or the drafter feed, with
an MTP head) through the shared loop, its rows written as the run lets them go, then one publish.

The greedy continuation is computed for both feeds, by one-token decode through the same loop (a run at
K = 1), and its rows are stored (the decode group): the reference drafts from it, a verify row whose input
is the continuation can be compared with the decode row of the same position (`vd.equivalence`), and for
either feed the golden notes whether each K's committed sequence equals it (it must, unless a verify row's
argmax differs from plain decode's). A reference that never had both a full and a partial accept at some K is not
written (it could not tell a broken commit or rewind from a working one) unless the caller allows it;
the caller learns why. This module leaves out comparison and verdicts: those are the replayer's.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from vd import env, protocol
from vd.batch import BatchPlan, BatchView, batched
from vd.coverage import coverage_reason, thin_reason
from vd.digest import Summary
from vd.dtypes import of_torch
from vd.equivalence import Accumulator, Equivalence, KeptDecode, decode_map, of_golden
from vd.equivalence import describe as describe_equivalence
from vd.errors import GoldenError, GoldenExistsError, ModelOutputError, UsageError
from vd.layout import RowLayout, StepLog
from vd.loop import DrafterFeed, Hold, ReferenceFeed, Run, generated, hold_bytes, prepare, reference_accepts, run_verify
from vd.models import DEFAULT_MODEL, load_model, require_forwards
from vd.models.inductor import caches_off, compiles, keep_artifacts
from vd.models.specs import golden_dir, portable
from vd.outputs import brief, size_text
from vd.policy import Policy, Spec
from vd.preflight import check_batch, check_record_widths, check_threads
from vd.progress import SILENT, Progress
from vd.protocol import VerifyModel, require_model
from vd.store import GoldenWriter, Location, check_target, journal, locate
from vd.store import format as F
from vd.store.processes import pool_for
from vd.store.read import open_golden
from vd.store.write import KRows
from vd.tracing import Point, check_traceable, trace_k, trace_meta

# An ordinary instruction for the instruct model. (With an earlier two-sentence prompt SmolLM2's
# continuation was one its draft head rarely predicted: no full accept at K=4 in 16 steps.)
DEFAULT_PROMPT = "Explain how speculative decoding speeds up a large language model."
DEFAULT_KS = (2, 3, 4)
DEFAULT_STEPS = 16
FEEDS = ("reference", "mtp")


@dataclass(frozen=True, slots=True)
class RecordSettings:
    """What a recording asks for: the model and its head, the prompt, the verify widths and steps, the
    forward, feed, device, dtype and threads, determinism, the policy stored as the golden's default
    (``tolerances``), and what makes a reference acceptable (``require_coverage``, ``allow_thin``;
    ``allow_nonfinite`` stores NaN or Inf logits rather than refuse the recording); ``batch`` records the
    sequence as one member of a batch of that many (`vd.batch`: at ``slot``, default every slot in turn, its
    companions from ``batch_seed``, default 0), which every replay of the golden then runs again;
    ``decode_forward`` computes the decode rows (the greedy continuation's one-token decodes, which the verify
    rows are measured against) with another forward than ``forward`` (an engine that decodes with another
    kernel than it verifies), which every replay then computes them with unless told otherwise."""

    model: str = DEFAULT_MODEL
    head: str | None = None
    prompt: str = DEFAULT_PROMPT
    ks: tuple[int, ...] = DEFAULT_KS
    steps: int = DEFAULT_STEPS
    forward: str | None = None
    decode_forward: str | None = None
    feed: str = "reference"
    device: str = "cpu"
    dtype: str = "bfloat16"
    threads: int | None = None
    deterministic: bool = False
    tolerances: tuple[str, ...] = ()
    require_coverage: bool = False
    allow_thin: bool = False
    allow_nonfinite: bool = False
    batch: int | None = None
    slot: int | None = None
    batch_seed: int | None = None
    trace: bool = False

    def check(self) -> Policy:
        """Refuse settings that cannot work, before any work; the policy they ask for."""
        check_record_widths(self.ks)
        if self.feed not in FEEDS:
            raise UsageError(f"unknown feed {self.feed!r} (choose from {', '.join(FEEDS)})")
        if self.steps < 1:
            raise UsageError(f"--steps must be at least 1; got {self.steps}")
        check_threads(self.threads)
        check_batch(self.batch, self.slot, self.batch_seed, self.feed == "mtp", recording=True)
        if self.trace and self.batch is not None:
            raise UsageError("--trace runs the sequence alone: it cannot trace a recording with --batch")
        return Policy.parse(self.tolerances)

    @classmethod
    def of_golden(cls, meta: Mapping) -> RecordSettings:
        """What recorded the golden with metadata ``meta``: recording these settings again re-records it."""
        model, env = meta.get("model") or {}, meta.get("environment") or {}
        policy = Policy.parse((), meta.get("policy"))
        return cls(model=model.get("spec", DEFAULT_MODEL), head=model.get("head"),
                   prompt=meta.get("prompt_text", DEFAULT_PROMPT), ks=tuple(meta.get("k") or DEFAULT_KS),
                   steps=meta.get("steps", DEFAULT_STEPS), forward=meta.get("forward"),
                   decode_forward=(meta.get("decode") or {}).get("forward"),
                   feed=meta.get("feed", "reference"), device=meta.get("device", "cpu"),
                   dtype=meta.get("dtype", "bfloat16"), threads=env.get("threads"),
                   deterministic=(meta.get("determinism") or {}).get("applied") is not None,
                   tolerances=policy.terms(),
                   require_coverage=bool(meta.get("require_coverage")), allow_thin=bool(meta.get("thin")),
                   trace=meta.get("trace") is not None, **_batch_settings(meta.get("batch")))

    def changes_from(self, other: RecordSettings) -> list[str]:
        """What these settings change from ``other``, one ``field: old -> new`` line each. A setting left
        unset here (None: the model's forward, torch's threads, no head) asks for no change and is not listed;
        but ``batch`` None is a recording alone, and a change from a batch."""
        out = []
        for f in fields(self):
            a, b = getattr(other, f.name), getattr(self, f.name)
            if f.name == "tolerances" and b is not None:  # as the policies they make (prefill=exact is the default)
                a, b = Policy.parse(a or ()).terms(), Policy.parse(b).terms()
            if (b is not None or f.name == "batch") and a != b:  # batch None: alone, a setting of its own
                out.append(f"{f.name}: {_listed(a)} -> {_listed(b)}")
        return out


def _listed(v) -> str:
    """A setting as a change line names it (`vd.outputs.brief`; a tuple as the list a declaration writes)."""
    return brief(list(v) if isinstance(v, tuple) else v)


def _batch_settings(batch: Mapping | None) -> dict:
    """The batch settings of a golden's ``batch`` metadata (none where it was recorded alone)."""
    if batch is None:
        return {}
    return {"batch": batch["n"], "slot": batch["slot"], "batch_seed": batch["seed"]}


@dataclass(slots=True)
class RecordResult:
    """What a recording did: where it went (None when refused), its accept counts and timings, why its
    reference is too thin (``thin``; stored anyway with ``allow_thin``) and, with ``require_coverage``,
    which K misses an accept count (``short``; never stored)."""

    location: Location | None
    accepted: dict[int, list[int]]
    thin: list[str]
    committed_is_greedy: dict[int, bool]
    seconds: dict[str, float] = field(default_factory=dict)
    # Where ``seconds["store"]`` and ``seconds["write"]`` went (parts of them, not added to the total): the
    # rows' hand-over at a run's end, the K's small files, its own verify-vs-decode figures; the metadata, the
    # Inductor artifacts, the wait for the writer processes, the seal and the golden's placing
    # (`vd.store.write.GoldenWriter.seconds`).
    parts: dict[str, float] = field(default_factory=dict)
    short: list[str] = field(default_factory=list)
    resumed_checked: int = 0  # blocks a resumed recording found equal to its journal
    left_greedy: dict[int, int] = field(default_factory=dict)  # per K, the step where committed left greedy
    # per K, its verify rows against the decode rows of the same positions (`vd.equivalence`), once stored
    equivalence: dict[int, Equivalence] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # what a stored golden lacks that a user would expect

    @property
    def path(self) -> str | None:
        return None if self.location is None else self.location.url

    def accept_lines(self) -> list[str]:
        """Each K's accept counts, and where its committed sequence left the greedy continuation."""
        out = []
        for k, acc in self.accepted.items():
            same = "" if self.committed_is_greedy[k] else (
                f"  (committed sequence left the greedy continuation at step {self.left_greedy.get(k)}: there the "
                "verify rows chose another token than the engine's own one-token decode)")
            out.append(f"K={k}: accepted {acc}{same}")
            if k in self.equivalence:
                out.append(f"K={k}: verify vs decode: {describe_equivalence(self.equivalence[k])}")
        return out

    def stored_line(self) -> str | None:
        """Where the golden went, its size and the recording's time (None: nothing was stored)."""
        if self.location is None:
            return None
        resumed = (f"; resumed: {self.resumed_checked} journaled blocks computed again and equal"
                   if self.resumed_checked else "")
        return (f"recorded {self.location.url} ({size_text(self.location.nbytes())}) in "
                f"{sum(self.seconds.values()):.1f} s{resumed}")

    def problems(self) -> list[str]:
        """Why the reference is too thin or short of coverage, for stderr: warnings where it was stored anyway,
        else the refusal."""
        if self.location is not None:
            return [f"warning: {reason}" for reason in [*self.thin, *self.warnings]]
        return [*self.thin, *self.short, "reference too thin or short of coverage; nothing written"
                + ("" if self.short else " (pass --allow-thin to store it anyway)")]


def record(out: str | os.PathLike, settings: RecordSettings = RecordSettings(), *, refresh: bool = False,
           model: VerifyModel | None = None, progress: Progress = SILENT,
           reason: str = "first recording", resume: bool = False) -> RecordResult:
    """Record ``settings`` into the golden at ``out`` (a directory, a ``.zip`` file or an ``s3://`` URL);
    ``refresh`` replaces a golden already there (without comparing or keeping its history: that is
    `vd.workflow.refresh`). A passed-in ``model`` is used as it is (its device and dtype win over the
    settings'). ``reason`` starts the golden's history. Another process writing ``out`` meanwhile is refused
    at once (a `vd.errors.GoldenError`): one writer at a time (`vd.store.atomic`).

    A recording into a directory or a zip file keeps a journal as it goes (`vd.store.journal`); ``resume``
    continues one a crash cut short: ``settings``, ``refresh`` and ``reason`` are then the journal's, every
    block computed again is checked against it, and the golden is the one the uninterrupted run would have
    written."""
    require_model(model, "vd.recorder.record()")
    location = locate(out)
    jpath = journal.of_location(location)
    header, frames = None, None
    if resume:
        if jpath is None:
            raise UsageError(f"{location.url}: goldens on an object store keep no journal to resume from")
        header, frames = journal.read(jpath)
        settings, refresh, reason = _from_header(header, jpath)
    policy = settings.check()
    with location.writer():
        try:
            check_target(location, refresh)  # before the expensive part, holding the lock the writer is made under
        except GoldenExistsError:
            if not resume:
                raise
            raise GoldenExistsError(f"{location.url} holds a golden now, and the recording its journal continues was a "
                                    "first recording, not a refresh: --resume cannot replace it (vd record "
                                    f"{location.url} --refresh records afresh over it)") from None
        return _record(location, settings, policy, refresh, model, progress, reason,
                       (jpath, header, frames))


def _from_header(header: dict, jpath) -> tuple[RecordSettings, bool, str]:
    """The settings, ``refresh`` and ``reason`` a journal's header (`vd.store.journal.read`, its other fields
    checked) holds, each setting's type checked against `RecordSettings`'."""
    s = dict(header["settings"])
    fields = {f.name: str(f.type) for f in dataclasses.fields(RecordSettings)}
    for name, v in s.items():  # one left out takes its default, as it did when the journal was written
        if not isinstance(name, str) or name not in fields or not _typed(v, fields[name]):
            raise journal.damaged(jpath, f"setting {name!r} is {v!r}, expected {fields.get(name, 'no such setting')}")
    s.update({name: tuple(s[name]) for name in ("ks", "tolerances") if name in s})
    return RecordSettings(**s), header["refresh"], header["reason"]


def _typed(v: object, annotation: str) -> bool:
    """Whether ``v`` (as msgpack gives it back) has the type a `RecordSettings` field is annotated with."""
    kinds = {"str": str, "int": int, "bool": bool}
    for alt in annotation.split(" | "):
        if alt == "None" and v is None:
            return True
        if alt.startswith("tuple[") and isinstance(v, list):
            return all(_typed(x, alt[len("tuple["):].split(",")[0]) for x in v)
        if alt in kinds and isinstance(v, kinds[alt]) and (alt == "bool") == isinstance(v, bool):
            return True
    return False


def _record(location: Location, settings: RecordSettings, policy: Policy, refresh: bool, model: VerifyModel | None,
            progress: Progress, reason: str, resuming: tuple) -> RecordResult:
    t, seconds = time.perf_counter(), (result := RecordResult(None, {}, [], {}, {})).seconds
    # The writer processes (a CUDA recording's) start first: they import while the model loads.
    pool_for(model.device if model is not None else settings.device)
    model = _model(settings, model, progress, policy)
    pool = pool_for(model.device)
    seconds["load"] = time.perf_counter() - t
    forward = _set_forward(model, settings)
    tokens = model.encode(settings.prompt)
    if not tokens:
        raise UsageError("the prompt encodes to no tokens")
    prepare(model, len(tokens), settings.steps, settings.ks)
    runner = _runner(model, settings, forward, tokens)
    # On threads the writer never works beside a run (finishing a run's rows behind the next one slowed the
    # runs, whose step times the golden keeps: tools/h200/record-behind-ab.json); writer processes do, sharing
    # no interpreter lock with them (`vd.store.processes`).
    with GoldenWriter(location, refresh=refresh, pool=pool, checked=True) as writer:
        writer.write_prompt(tokens)  # (in the decode run's host slack)
        greedy, decode, decode_points = _record_decode(runner, writer, tokens, settings, progress, result)
        writer.journal = _journal(resuming, settings, refresh, reason, model, tokens, greedy)
        ahead = _Ahead(model, settings, forward, greedy, golden_dir(location), writer)  # (in the K runs' slack)
        points = _record_ks(runner, model, forward, writer, tokens, (greedy, decode), settings, progress, result,
                            policy.equivalence)
        if result.short or (result.thin and not settings.allow_thin):
            if writer.journal is not None:
                writer.journal.close(remove=True)  # refused: nothing to resume
            return result
        t = time.perf_counter()
        progress.phase("writing golden", 0)
        meta = {**ahead.meta(result.thin),
                "left_greedy": {str(k): s for k, s in result.left_greedy.items()},
                "decode": F.decode_meta(settings.steps * max(settings.ks), forward, settings.decode_forward),
                "policy": policy.to_json(), "require_coverage": settings.require_coverage,
                **({"batch": runner.describe()} if isinstance(runner, BatchView) else {}),
                **({"trace": trace_meta(points, decode_points)} if settings.trace else {})}
        at = _part(result, "write_describe", t)  # the metadata
        meta.update(_artifacts(forward, writer, result, ahead.compiled))
        _part(result, "write_artifacts", at)  # a compiled forward's Inductor artifacts (written by a process)
        writer.publish(meta, tokens, reason=reason)
    if writer.journal is not None:
        result.resumed_checked = writer.journal.checked
        writer.journal.close(remove=True)  # published: nothing left to resume
    seconds["write"] = time.perf_counter() - t
    result.parts.update({f"write_{n}": sec for n, sec in writer.seconds.items()})
    result.location = location
    t = time.perf_counter()
    _read_back_equivalence(location, settings.ks, result, policy)
    seconds["equivalence"] = time.perf_counter() - t  # the golden's own verify-vs-decode figures read back
    return result


class _Ahead:
    """What a recording makes once its greedy continuation is known, as the writer's `later` work in its K runs'
    host slack (`make`), not after them: the metadata no K run decides (`_meta`: the model's identity, the
    environment's packages, ...) and a compiled forward's Inductor artifacts handed to the writer (on an H200 host
    0.15-0.3 and 0.7-1 ms of a 0.5B recording's publish, whose own work, not its writer processes', was what it
    waited for in tools/h200/writer_timeline_05b_cg_planes.json; on an H100 host, where the processes' last job
    ended the tail, the wait for them grew by what moved: tools/h200/h100-6e5810d-ahead-ab_05b.json)."""

    def __init__(self, model: VerifyModel, settings: RecordSettings, forward: str, greedy: list[int],
                 where: Path | None, writer: GoldenWriter):
        self.model, self.settings, self.forward, self.greedy, self.where = model, settings, forward, greedy, where
        self.writer = writer
        self.static: dict | None = None
        self.compiled: dict | None = None  # the artifacts' field as `make` handed them (None: not made yet)
        writer.later([self.make])

    def make(self) -> None:
        self.static = _meta(self.model, self.settings, self.forward, self.greedy, [], self.where)
        self.compiled = keep_artifacts(self.forward, self.writer.add_file, F.INDUCTOR_ARTIFACTS)

    def meta(self, thin: list[str]) -> dict:
        """The golden's metadata (`_meta`), ``thin`` as the K runs found it."""
        if self.static is None:
            self.make()
        assert self.static is not None
        return {**self.static, "thin": thin}


def _artifacts(forward: str, writer: GoldenWriter, result: RecordResult, handed: dict | None = None) -> dict:
    """A compiled forward's Inductor artifacts handed to the writer (`vd.models.inductor.keep_artifacts`; not again
    where ``handed``, an earlier call's field, names the same), and the golden's metadata field for them; where
    Inductor's caches are off there are none, and a warning says so."""
    kept = keep_artifacts(forward, writer.add_file, F.INDUCTOR_ARTIFACTS, handed)
    why = caches_off() if compiles(forward) and not kept else None
    if why is not None:
        result.warnings.append(f"no Inductor artifacts stored ({why}): a replay in another process compiles afresh "
                               "and may run other kernels than this recording's")
    return kept


def _set_forward(model: VerifyModel, settings: RecordSettings) -> str:
    """Set the forward the recording runs (refused unless the model offers it, and with ``--trace`` traces it);
    its name."""
    forward = settings.forward or model.default_forward()
    require_forwards(model, [forward])
    if settings.trace:  # (the decode forward's decode rows are traced too)
        for name in dict.fromkeys([forward, settings.decode_forward or forward]):
            check_traceable(model, name, "--trace")
    model.set_forward(forward)
    return forward


def _read_back_equivalence(location: Location, ks: Sequence[int], result: RecordResult, policy: Policy) -> None:
    """The verify-vs-decode figures of the K runs that let verify rows go before their end (the others were
    measured from the rows they held), read back from the published golden; ``result.equivalence`` in K order,
    judged under the ``policy``'s ``equivalence=``: a K whose own pairs fail it is a warning (every replay with
    this forward would FAIL on it)."""
    if missing := [k for k in ks if k not in result.equivalence]:
        stored = open_golden(location)
        try:
            result.equivalence.update({k: e for k in missing
                                       if (e := of_golden(stored, k, policy.equivalence)) is not None})
        finally:
            stored.close()
    result.equivalence = {k: result.equivalence[k] for k in ks if k in result.equivalence}
    spec = policy.equivalence
    for k, e in result.equivalence.items():
        if spec is not None and not e.passed:
            result.warnings.append(f"K={k}: the golden's own verify rows fail its equivalence={spec.text} against its "
                                   f"decode rows ({len(e.failing)} of {e.rows}): every replay with its forward fails "
                                   "on that; loosen equivalence= or record a forward whose verify rows equal its "
                                   "decode rows")


def _record_ks(runner: VerifyModel, model: VerifyModel, forward: str, writer: GoldenWriter, tokens: list[int],
               continuation: tuple[list[int], KeptDecode], settings: RecordSettings, progress: Progress,
               result: RecordResult, equivalence: Spec | None) -> list:
    """Every K's run (`_record_k`, against the greedy ``continuation`` and its kept decode rows, its own pairs
    judged under ``equivalence``, the policy's) and, with ``--trace``, its traced pass (`vd.tracing.trace_k`); the
    traced points (none without ``--trace``)."""
    seconds = result.seconds
    seconds["verify"] = 0.0
    seconds.setdefault("store", 0.0)
    points: list = []
    for k in settings.ks:
        progress.phase(f"recording K={k}", settings.steps)
        # A K's files are written in the next K run's host slack (`GoldenWriter.later`), the last K's at once.
        later = k != settings.ks[-1] and not settings.trace
        log, summary = _record_k(runner, writer, tokens, continuation, k, settings, progress, result, equivalence,
                                 later)
        if settings.trace:
            t = time.perf_counter()
            progress.phase(f"tracing K={k}", 0)
            points = trace_k(model, forward, writer, tokens, log, summary, settings.feed == "mtp")
            seconds["trace"] = seconds.get("trace", 0.0) + time.perf_counter() - t
    return points


def _runner(model: VerifyModel, settings: RecordSettings, forward: str, tokens: list[int]) -> VerifyModel:
    """What the runs step: the model, or with ``--batch`` the view that runs the sequence as one member of the
    model's batch (`vd.batch.BatchView`). The decode forward, where one is asked, is checked to be offered (and
    to run the batch)."""
    decoder = _decoder(settings, forward)
    if decoder is not None:
        require_forwards(model, [decoder])
    if settings.batch is None:
        return model
    for name in [forward, *([decoder] if decoder else [])]:
        batched(model, name)
    return BatchView(model, BatchPlan(settings.batch, settings.slot, settings.batch_seed or 0), tokens,
                     generated(settings.steps, settings.ks))


def _decoder(settings: RecordSettings, forward: str) -> str | None:
    """The forward that computes the decode rows where it is not the recording's ``forward``, else None."""
    return None if settings.decode_forward in (None, forward) else settings.decode_forward


def _select(model: VerifyModel, name: str, tokens: list[int], settings: RecordSettings) -> None:
    """Forward ``name`` selected and prepared (its graphs captured, its cache sized), as a replay's runs are."""
    model.set_forward(name)
    prepare(model, len(tokens), settings.steps, settings.ks)


def _journal(resuming: tuple, settings: RecordSettings, refresh: bool, reason: str, model: VerifyModel,
             tokens: list[int], greedy: list[int]) -> journal.Journal | None:
    """The recording's journal (None on an object store); resuming, the old one's model and greedy
    continuation checked first, its blocks handed over to be checked as they are computed again."""
    jpath, header, frames = resuming
    if jpath is None:
        return None
    fingerprint = model.identity().fingerprint
    if header is not None and (header["fingerprint"] != fingerprint or header["greedy"] != greedy
                               or header["prompt"] != tokens):
        raise GoldenError(f"{jpath}: the journaled recording had another model, prompt or greedy continuation; "
                          "record afresh (without --resume)")
    return journal.Journal(jpath, {"settings": dataclasses.asdict(settings), "refresh": refresh, "reason": reason,
                                   "fingerprint": fingerprint, "prompt": tokens, "greedy": greedy}, frames)


def _model(settings: RecordSettings, model: VerifyModel | None, progress: Progress, policy: Policy) -> VerifyModel:
    """The model to record, loaded if not given, with the settings' threads and determinism applied and their
    ``policy`` checked against its vocabulary (`Policy.check_vocab`)."""
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    if settings.deterministic:
        env.apply_determinism(env.DETERMINISTIC)
    if model is None:
        progress.phase("loading model", 0)
        model = load_model(settings.model, device=settings.device, dtype=settings.dtype, head=settings.head)
    if settings.feed == "mtp" and protocol.draft_head(model) is None:
        raise UsageError(f"model {settings.model} has no MTP draft head: use an -mtp preset, a checkpoint with MTP "
                         "layers, or --head FILE")
    policy.check_vocab(model.vocab_size)
    return model


def _record_decode(model: VerifyModel, writer: GoldenWriter, tokens: list[int], settings: RecordSettings,
                   progress: Progress, result: RecordResult) -> tuple[list[int], KeptDecode, list[Point] | None]:
    """The greedy continuation by one-token decode: a run at K = 1 (each step verifies the token the last one
    chose, accepting nothing, as plain decode does), its rows written to ``writer`` as the decode group
    (`vd.store.format.DECODE_K`) and kept for the verify-against-decode figures (`_own_equivalence`); the
    continuation's ``steps + 1`` tokens (``steps``: the settings' steps times their widest K) and those rows; a
    non-finite row refused as a K's are (unless ``allow_nonfinite``); with ``--trace``, the points its traced pass
    traced (`vd.tracing.trace_k`), else None. Its run's seconds into ``result.seconds["continuation"]``, the
    writes after it into ``result.seconds["store"]``, the traced pass's into ``result.seconds["trace"]``."""
    seconds, steps = result.seconds, settings.steps * max(settings.ks)
    forward = settings.forward or model.default_forward()
    decoder = _decoder(settings, forward)
    if decoder is not None:  # (the K runs go back to the recording's forward)
        _select(model, decoder, tokens, settings)
    t = time.perf_counter()
    progress.phase("greedy continuation" + ("" if decoder is None else f" ({decoder})"), steps)
    layout = RowLayout(len(tokens), steps, F.DECODE_K)
    settled = _Settled(layout, writer.rows(layout, model.vocab_size, model.dtype), KeptDecode())
    run = run_verify(model, tokens, F.DECODE_K, steps, ReferenceFeed([]), on_step=progress.step,
                     hold=settled.hold(model.device),
                     on_last=settled.queue if model.device.type == "cuda" else None)
    t, seconds["continuation"] = time.perf_counter(), time.perf_counter() - t
    greedy = [*run.committed(), run.last]
    log, summary, _ = _finished(run, True, settled)
    if not settings.allow_nonfinite:  # (the decode rows were stored with NaN, and replayed as the reference)
        _refuse_nonfinite(layout, summary[1], F.DECODE_K)
    at = _part(result, "store_rows", t)
    settled.rows.finish(log, summary, None, later=True)  # its files written in the first K run's host slack
    _part(result, "store_files", at)
    seconds["store"] = seconds.get("store", 0.0) + time.perf_counter() - t
    assert settled.kept is not None
    points = None
    if settings.trace:  # (a recording with --trace runs no batch: ``model`` is the model itself)
        t = time.perf_counter()
        progress.phase("tracing the decode rows", 0)
        points = trace_k(model, decoder or forward, writer, tokens, log, summary, False)
        seconds["trace"] = time.perf_counter() - t
    if decoder is not None:
        _select(model, forward, tokens, settings)
    return greedy, settled.kept, points


def _record_k(model: VerifyModel, writer: GoldenWriter, tokens: list[int],
              continuation: tuple[list[int], KeptDecode], k: int, settings: RecordSettings, progress: Progress,
              result: RecordResult, equivalence: Spec | None, later: bool = False
              ) -> tuple[StepLog, tuple[np.ndarray, np.ndarray]]:
    """One K's run, its rows written to ``writer`` as the run lets them go and once it ends (its small files as
    the writer's `later` work with ``later``), its accept counts, checks and verify-against-decode figures
    (judged under ``equivalence``, as a replay judges: a failing pair is warned of) into ``result``; its time
    into ``result.seconds``: the run's (``verify``) and the writes after it (``store``). Its step log and its
    rows' digests and statistics."""
    greedy, steps, mtp = continuation[0], settings.steps, settings.feed == "mtp"
    chooser = DrafterFeed(k, steps) if mtp else ReferenceFeed(greedy)
    layout = RowLayout(len(tokens), steps, k, mtp)
    settled = _Settled(layout, writer.rows(layout, model.vocab_size, model.dtype))
    t = time.perf_counter()
    run = run_verify(model, tokens, k, steps, chooser, on_step=progress.step,
                     hold=settled.hold(model.device),
                     on_last=settled.queue if model.device.type == "cuda" else None)
    t, result.seconds["verify"] = time.perf_counter(), result.seconds["verify"] + time.perf_counter() - t
    committed = run.committed()
    same = committed == greedy[:len(committed)]
    # Written here, between runs: the writer's threads touch no GPU (a CUDA call of theirs during a graph
    # captured mid-run, such as a draft head's first propose of a shape, would invalidate that capture).
    log, summary, drafts = _finished(run, same, settled)
    at = _part(result, "store_rows", t)
    if not settings.allow_nonfinite:
        _refuse_nonfinite(layout, summary[1], k)
    settled.rows.finish(log, summary, drafts, later)
    at = _part(result, "store_files", at)
    if (own := _own_equivalence(log, settled, len(tokens), continuation, of_torch(model.dtype).name, equivalence)
            ) is not None:
        result.equivalence[k] = own
    _part(result, "store_own", at)
    result.seconds["store"] += time.perf_counter() - t
    accepted = log.accepted.tolist()
    result.accepted[k], result.committed_is_greedy[k] = accepted, same
    if not same:
        result.left_greedy[k] = _left_at(run, greedy)
    if (reason := thin_reason(k, accepted)) is not None:
        result.thin.append(reason)
    made = None if mtp else reference_accepts(k)  # (the counts the feed can make)
    if settings.require_coverage and (reason := coverage_reason(k, accepted, made)) is not None:
        result.short.append(reason)
    return log, summary


def _part(result: RecordResult, name: str, since: float) -> float:
    """Add the seconds since ``since`` to ``result.parts[name]``; now."""
    now = time.perf_counter()
    result.parts[name] = result.parts.get(name, 0.0) + now - since
    return now


def _left_at(run: Run, greedy: list[int]) -> int:
    """The step whose verify rows first chose another token than the engine's own one-token decode: where the
    committed sequence first leaves the greedy continuation (a step's first committed token was chosen by the
    step before it; its accepted drafts by its own rows)."""
    at = len(run.committed_before)
    for s, st in enumerate(run.steps):
        for j, t in enumerate(st.tokens[: st.accepted + 1]):
            if t != greedy[at + j]:
                return max(s - 1, 0) if j == 0 else s
        at += st.accepted + 1
    return len(run.steps) - 1


def _refuse_nonfinite(layout: RowLayout, stats: np.ndarray, k: int) -> None:
    """A recording whose logits hold NaN or Inf is refused (its rows' statistics say so: the largest |logit|
    of such a row is not finite), naming where."""
    where = []
    for kind, rows in layout.split(stats).items():
        for i in np.flatnonzero(~np.isfinite(rows).all(axis=1)).tolist():
            step = layout.locate(kind, i)[0]
            where.append(f"{kind} row {i}" if step is None else f"{kind} step {step}")
    if where:
        at = "in its one-token decodes (the greedy continuation)" if k == F.DECODE_K else f"at K={k}"
        raise ModelOutputError(f"the model computed non-finite logits (NaN or Inf) {at}: {', '.join(where[:5])}"
                               f"{' ...' if len(where) > 5 else ''}; nothing stored (--allow-nonfinite stores them)")


class _Settled:
    """Where a recording's rows go as its run lets them go (`vd.loop.Hold`) and once it ends: their digests
    and statistics into a `vd.digest.Summary`, the rows themselves to the store (`vd.store.write.KRows`) and,
    for the decode run, to ``kept`` (`vd.equivalence.KeptDecode`). ``last``: the rows held at the run's end,
    by kind (their first row, the rows)."""

    def __init__(self, layout: RowLayout, rows: KRows, kept: KeptDecode | None = None):
        self.summary = Summary(list(layout.counts))
        self.rows, self.kept = rows, kept
        self.last: dict[str, tuple[int, torch.Tensor]] = {}

    def hold(self, device: torch.device) -> Hold:
        """The run's `vd.loop.Hold`: rows let go past `vd.loop.hold_bytes` (`add`); with writer processes each
        step's rows handed to them as it is logged (`vd.store.write.KRows.hand`), so that they write them beside
        the run."""
        return Hold(hold_bytes(device), self.add, self.rows.hand if self.rows.writer.pool is not None else None)

    def add(self, kind: str, start: int, rows: torch.Tensor) -> None:
        self.summary.add({kind: rows})
        self.rows.write(kind, start, rows)
        if self.kept is not None:
            self.kept.observe(kind, start, rows)

    def queue(self, run: Run, last: torch.Tensor) -> None:
        """On CUDA, while the last step runs: the rows still held summarised on a side stream behind it."""
        self.summary.queue(last.device, lambda: {kind: rows for kind, _, rows in run.held(last)})


def _finished(run: Run, same: bool, settled: _Settled) -> tuple[StepLog, tuple[np.ndarray, np.ndarray],
                                                               np.ndarray | None]:
    """A finished run's step log, every row's digest and statistics (the rows still held summarised on the
    run's device, read back once) and, for the drafter feed, the head's drafts; the rows still held written."""
    log = StepLog(k=run.k, bootstrap=run.bootstrap, committed_is_greedy=same,
                  tokens=np.array([s.tokens for s in run.steps], dtype=np.int32).reshape(-1, run.k),
                  accepted=np.array([s.accepted for s in run.steps], dtype=np.int32),
                  step_ms=np.array(run.step_ms, dtype=np.float64),
                  decoded=run.committed_before[0] if run.bootstrap_row is not None else None)
    held = run.held()
    if not settled.summary.queued:  # else summarised behind the last step already
        settled.summary.add({kind: rows for kind, _, rows in held})
    for kind, start, rows in held:
        settled.rows.write(kind, start, rows)
        if settled.kept is not None:
            settled.kept.observe(kind, start, rows)
        settled.last[kind] = (start, rows)
    if run.bootstrap_row is None:
        return log, settled.summary.result(), None
    return log, settled.summary.result(), np.array(run.drafts, dtype=np.int32).reshape(len(run.steps), run.k - 1)


def _own_equivalence(log: StepLog, settled: _Settled, prompt: int, continuation: tuple[list[int], KeptDecode],
                     logical: str, spec: Spec | None = None) -> Equivalence | None:
    """A K's verify rows against the decode rows of the same positions, measured on the run's device as a
    replay measures its candidate's (`vd.equivalence.Accumulator`), from the rows the run held at its end: the
    golden's own figures without reading it back. None for a run that let verify rows go before its end (one
    longer than its hold, `vd.loop.hold_bytes`): `_record` reads those from the published golden
    (`vd.equivalence.of_golden`), as a replay does."""
    start, rows = settled.last.get("verify", (-1, None))
    if start != 0 or rows is None:
        return None
    greedy, decode = continuation
    acc = Accumulator(log.k, decode_map(log, prompt, greedy, decode.count), decode.result(), logical, spec)
    acc.add(0, rows)
    return acc.result()


def _meta(model: VerifyModel, settings: RecordSettings, forward: str, greedy: list[int], thin: list[str],
          where: Path | None = None) -> dict:
    """The golden's metadata; ``where``: the local folder that holds it (`vd.models.specs`: file specs are
    stored relative to the project or to it)."""
    ident = model.identity()
    logical = of_torch(model.dtype).name
    graphs = protocol.uses_graphs(model, forward)
    drafter = protocol.draft_head(model) if settings.feed == "mtp" else None
    (spec, spec_base), (head, head_base) = portable(settings.model, where), portable(settings.head, where)
    return {
        "model": {"spec": spec, "head": head, "name": ident.name, "fingerprint": ident.fingerprint,
                  "details": dict(ident.details), **({"spec_base": spec_base} if spec_base else {}),
                  **({"head_base": head_base} if head_base else {})},
        "forward": forward,
        "forward_description": model.forwards()[forward],
        "graphs": "graphed" if graphs else "eager",
        "feed": settings.feed,
        "mtp": dict(drafter.head_info()) if drafter is not None else None,
        "dtype": logical,
        "device": model.device.type,
        "k": list(settings.ks),
        "steps": settings.steps,
        "vocab_size": model.vocab_size,
        "prompt_text": settings.prompt,
        "greedy": greedy,
        "thin": thin,
        "logits": F.logits_meta(logical),
        "environment": env.of_model(model),
        "determinism": {"applied": env.DETERMINISTIC if settings.deterministic else None,
                        "settings": env.determinism()},
    }

