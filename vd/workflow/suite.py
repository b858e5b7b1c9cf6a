"""A suite's goldens recorded and replayed together (`record_suite`, `replay_suite`), each model loaded once
per process however many goldens use it and let go after the last of them (`Models`), with one aggregated
verdict (`Outcome`, `verdict`).

A golden that cannot be replayed (missing, damaged, made by another model) is one ``ERROR`` outcome with its
one-line reason; the others still run. The suite's exit code is the worst of its goldens': 2 where any
golden could not be judged, else 1 where any FAILed, else 0.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from vd.errors import GoldenError, ModelMismatchError, VdError, system_refusal
from vd.models import check_forward_names
from vd.models.specs import golden_dir, names_stored, stored
from vd.policy import Policy
from vd.progress import SILENT, Progress
from vd.protocol import VerifyModel, require_model
from vd.recorder import DEFAULT_PROMPT, RecordSettings, record
from vd.replayer import ReplaySettings, replay
from vd.replayer.report import Report
from vd.replayer.session import check_asked
from vd.store import Golden, check_target, locate, open_golden
from vd.workflow.declare import Entry
from vd.workflow.refresh import refresh

# What a stale check compares: the golden's recorded setting against the declaration's (resolved).
_COMPARED = ("model", "head", "feed", "prompt", "ks", "steps", "dtype", "device", "forward", "decode_forward",
             "tolerances", "deterministic", "threads", "batch", "slot", "batch_seed", "trace")


Key = tuple[str, str, str, str | None]  # a model as `Models` holds it: (spec, device, dtype, head)


class Models:
    """Models by (spec, device, dtype, head), each loaded at its first use (``loads`` counts the loads).

    With a ``plan`` (each golden's key in the order they run; None for one that loads no model), each
    golden, whatever became of it, calls `done` once it is over, and a model no golden still to come needs
    is let go then: a suite of goldens of several models holds at once only those whose goldens are still to
    come (keep each model's goldens together and that is one), instead of every model until the suite ends,
    which runs a GPU out of memory. Without one (the pytest plugin, whose tests come in pytest's order), every
    model stays held."""

    def __init__(self, plan: Iterable[Key | None] = ()):
        self.held: dict[Key, VerifyModel] = {}
        self.loads = 0
        self.plan = list(plan)
        self.at = 0  # goldens of the plan done

    def get(self, spec: str, device: str, dtype: str, head: str | None, progress: Progress = SILENT) -> VerifyModel:
        key = (spec, device, dtype, head)
        if key not in self.held:
            from vd.models import check_device, load_model

            progress.phase(f"loading {spec}", 0)
            self.held[key] = load_model(spec, device=check_device(device), dtype=dtype, head=head)
            self.loads += 1
        return self.held[key]

    def done(self) -> None:
        """The plan's next golden is over: its model is let go unless a later golden needs it. Called once
        nothing of that golden's run refers to the model any more."""
        if self.at >= len(self.plan):
            return
        key = self.plan[self.at]
        self.at += 1
        model = self.held.pop(key, None) if key is not None and key not in self.plan[self.at:] else None
        if model is None:
            return
        cuda = model.device.type == "cuda"
        del model
        gc.collect()  # a model's modules and its forwards' closures refer to each other: counting frees none
        if cuda:
            import torch

            torch.cuda.empty_cache()  # what it held goes back to the device for the next model


def record_key(entry: Entry) -> Key:
    """The model an entry records with."""
    s = record_settings(entry)
    return (s.model, s.device, s.dtype, s.head)


def replay_key(settings: ReplaySettings, g: Golden) -> Key:
    """The model a golden replays with under ``settings``: its own, or the one they name."""
    spec, head = stored(g.meta["model"], golden_dir(g.location))  # a file spec from here
    return (settings.model or spec, settings.device or g.info.device, g.logical,
            settings.head if settings.model else head)


def plan_of(entries: Sequence[Entry], key_of: Callable[[Golden], Key]) -> list[Key | None]:
    """``key_of`` each entry's golden, opened for it and closed (None where it cannot be: its own run says
    why): a `Models` plan."""
    plan: list[Key | None] = []
    for e in entries:
        try:
            g = open_golden(e.path)
        except (VdError, OSError):
            plan.append(None)
            continue
        try:
            plan.append(key_of(g))
        except (VdError, KeyError, TypeError):
            plan.append(None)
        finally:
            g.close()
    return plan


def replay_plan(entries: Sequence[Entry], settings: ReplaySettings) -> list[Key | None]:
    """The models a replay of ``entries`` under ``settings`` uses, in order (`replay_key`)."""
    return plan_of(entries, partial(replay_key, settings))


def record_settings(entry: Entry) -> RecordSettings:
    """The settings an entry declares, over the recorder's defaults."""
    d = entry.declared()
    renames = {"k": "ks", "policy": "tolerances"}
    return RecordSettings(**{renames.get(key, key): v for key, v in d.items()})


def stale_reasons(entry: Entry, golden: Golden) -> list[str]:
    """How the golden differs from what its declaration would record now (empty: up to date). A setting the
    declaration leaves out is compared as the recorder's default, except the forward and thread count,
    which then mean "the model's default" and "torch's" and are not compared."""
    want, have = record_settings(entry), RecordSettings.of_golden(golden.meta)
    skip = {"forward"} if entry.forward is None else set()
    if entry.threads is None:
        skip.add("threads")
    skip.update(n for n in ("slot", "batch_seed") if getattr(entry, n) is None)  # the recorder's choice then
    out = []
    for name in _COMPARED:
        a, b = getattr(have, name), getattr(want, name)
        if name == "tolerances":  # as the policies they make: kl:1 is prefill=kl:1, verify=kl:1, draft=kl:1
            a, b = Policy.parse(a).terms(), Policy.parse(b).terms()
        if name == "model" and names_stored(b, golden.meta["model"], golden_dir(golden.location)):
            a = b  # its own model's file, named from its declaration's folder
        if name == "decode_forward":  # the golden's own forward named again is none other
            a = None if a == have.forward else a
            b = None if b == (want.forward or have.forward) else b
        if name not in skip and a != b:
            shown = "the default prompt" if b == DEFAULT_PROMPT else repr(list(b) if isinstance(b, tuple) else b)
            out.append(f"{name}: recorded {list(a) if isinstance(a, tuple) else a!r}, declared {shown}")
    return out


@dataclass(slots=True)
class Outcome:
    """One golden's result in a suite run: ``verdict`` PASS, FAIL, ERROR (could not be judged: ``error``),
    RECORDED, REFRESHED, PRESENT (left as it was) or REFUSED (a recording not stored: ``reasons``);
    ``content``: the content digest of the golden version a replay judged (`vd status` ties the verdict to it)."""

    name: str
    path: str
    verdict: str
    report: Report | None = None
    error: str | None = None
    reasons: list[str] = field(default_factory=list)
    seconds: float = 0.0
    content: str | None = None
    changes: str = ""  # a REFRESHED golden's change summary, without its title and reason (Markdown)
    of_golden: bool = False  # an ERROR the golden's state caused (damaged, not a golden, another model's), not
    # the settings or the model: recording it again can end it (the pytest plugin's way on says so)

    def to_json(self) -> dict:
        return {"name": self.name, "path": self.path, "verdict": self.verdict, "content_digest": self.content,
                "error": self.error,
                "reasons": self.reasons or ([r.text for r in self.report.reasons] if self.report else []),
                "seconds": self.seconds, "report": None if self.report is None else self.report.to_json()}


def exit_code(outcomes: Sequence[Outcome]) -> int:
    verdicts = {o.verdict for o in outcomes}
    return 2 if "ERROR" in verdicts else 1 if verdicts & {"FAIL", "REFUSED"} else 0


def _timed(entry: Entry, run: Callable[[], Outcome]) -> Outcome:
    t = time.perf_counter()
    try:
        out = run()
    except VdError as e:
        out = Outcome(entry.name, entry.path, "ERROR", error=str(e),
                      of_golden=isinstance(e, GoldenError | ModelMismatchError))
    except OSError as e:  # a path the system refused (a full disk): that golden's ERROR, and the suite goes on
        out = Outcome(entry.name, entry.path, "ERROR", error=system_refusal(e))
    out.seconds = time.perf_counter() - t
    return out


def replay_suite(entries: Sequence[Entry], settings: ReplaySettings = ReplaySettings(), *,
                 models: Models | None = None, progress: Progress = SILENT,
                 model: VerifyModel | None = None) -> list[Outcome]:
    """Replay each entry's golden under ``settings`` (forwards, tolerances, device ... for every golden);
    ``model``, when given, replays every golden (an engine under test), else each golden's own model. A golden
    stale against its declaration is not replayed (an ERROR naming what changed): what it holds is no longer
    what the suite declares."""
    require_model(model, "vd.workflow.suite.replay_suite()")
    models = models or Models(replay_plan(entries, settings) if model is None else ())

    def one(e: Entry) -> Outcome:
        pinned = settings if e.pin is None else dataclasses.replace(settings, pin=e.pin)  # (pytest: it was not)
        g = open_golden(e.path, rows=settings.rows, sizes=False)  # (its listing: the replay's reader checks it)
        try:
            stale = stale_reasons(e, g)
            if stale:
                raise GoldenError("stale, the declaration changed since it was recorded: " + "; ".join(stale)
                                  + f"; record it again: vd record --suite {e.name} --refresh --reason TEXT")
            opened = check_asked(g, pinned)  # a width it lacks, an unknown forward: refused before a model loads
            key = replay_key(settings, g)
            if model is None:
                check_forward_names(key[0], list(settings.forwards), key[1])
            content = g.content_digest()
            report = replay(opened, pinned, model=model or models.get(*key, progress), progress=progress)
        finally:
            g.close()  # a refresh in this process (pytest --vd-update) may then remove this version
        return Outcome(e.name, e.path, report.verdict, report=report, content=content)

    return _each(entries, one, models)


def _each(entries: Sequence[Entry], one: Callable[[Entry], Outcome], models: Models) -> list[Outcome]:
    """``one`` of each entry, timed; the models told after each, once its run's frames are gone."""
    out = []
    for e in entries:
        out.append(_timed(e, partial(one, e)))
        models.done()
    return out


def record_suite(entries: Sequence[Entry], *, refresh_existing: bool = False, reason: str = "first recording",
                 models: Models | None = None, progress: Progress = SILENT) -> list[Outcome]:
    """Record each entry's golden from its declaration: a missing one recorded, an existing one left as it is
    (PRESENT) or, with ``refresh_existing``, refreshed with ``reason`` (`vd.workflow.refresh`)."""
    models = models or Models([record_key(e) for e in entries])
    return _each(entries, partial(_record_one, refresh_existing=refresh_existing, reason=reason, models=models,
                                  progress=progress), models)


def _record_one(e: Entry, refresh_existing: bool, reason: str, models: Models, progress: Progress) -> Outcome:
    """One entry of `record_suite`."""
    s = record_settings(e)
    location = locate(e.path)
    present = location.state() not in ("absent", "partial")  # partial: an interrupted S3 write
    if present and not refresh_existing:
        check_target(location, refresh=True)  # a golden is left as it is (said if stale); anything else errs
        return Outcome(e.name, e.path, "PRESENT", reasons=_stale_note(e))
    m = models.get(*record_key(e), progress)  # (the key its plan holds)
    if present:
        done = refresh(e.path, s, reason=reason, name=e.name, model=m, progress=progress)
        return Outcome(e.name, e.path, "REFUSED" if done.refused else "REFRESHED",
                       reasons=done.refused or done.changes, changes=done.details)
    r = record(e.path, s, model=m, progress=progress, reason=reason)
    if r.location is None:
        store = [f"nothing written; declare allow_thin = true for {e.name} to store it anyway"] if r.thin else []
        return Outcome(e.name, e.path, "REFUSED", reasons=[*r.thin, *r.short, *store])
    return Outcome(e.name, e.path, "RECORDED", reasons=[f"K={k}: accepted {a}" for k, a in r.accepted.items()])


def stale_now(e: Entry) -> list[str]:
    """`stale_reasons` of the golden at the entry's path, opened and closed here."""
    g = open_golden(e.path)
    try:
        return stale_reasons(e, g)
    finally:
        g.close()


def _stale_note(e: Entry) -> list[str]:
    """What a golden left as it is says if its declaration has moved past it (one line), else nothing."""
    stale = stale_now(e)
    return [f"stale: {'; '.join(stale)}; vd record --suite {e.name} --refresh --reason TEXT records it again"] \
        if stale else []


def for_entry(settings: ReplaySettings, entry: Entry) -> ReplaySettings:
    """The settings one golden of a suite replays under: its declared pin, and a candidate, where asked, as
    ``DIR/NAME.zarr``."""
    settings = dataclasses.replace(settings, pin=entry.pin)
    if settings.save_candidate is None:
        return settings
    return dataclasses.replace(settings, save_candidate=str(Path(settings.save_candidate) / f"{entry.name}.zarr"))


@dataclass(frozen=True, slots=True)
class SuiteReport:
    """A suite replay's one verdict over its goldens' outcomes (``vd replay --suite --report``'s JSON)."""

    suite: str
    shard: str | None
    models_loaded: int
    seconds: float
    outcomes: tuple[Outcome, ...]

    @property
    def code(self) -> int:
        return exit_code(self.outcomes)

    @property
    def verdict(self) -> str:
        return {0: "PASS", 1: "FAIL", 2: "ERROR"}[self.code]

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "suite": self.suite, "shard": self.shard,
                "models_loaded": self.models_loaded, "seconds": self.seconds,
                "goldens": [o.to_json() for o in self.outcomes]}

    def details(self, o: Outcome) -> list[str]:
        """What one golden's line says below it: its error, or its report's reasons."""
        if o.error:
            return [o.error]
        return [] if o.report is None else [r.text for r in o.report.reasons]
