"""vd's pytest plugin (entry point ``pytest11``; shipped in the package, active once vd is installed).

* The ``vd_golden`` fixture: ``vd_golden("smollm2-default").replay(model=my_engine)`` replays a declared
  golden (`vd.workflow.declare`) through any model and fails the test with vd's reasons in the assertion
  message; it returns the `vd.replayer.Report` on PASS.
* ``pytest --vd``: the suite's goldens are collected as test items (``vd.toml::NAME`` or
  ``pyproject.toml::NAME``), each replayed with its own model; each model is loaded once per session.
* ``--vd-update`` accepts what the run saw, with a reason naming the test: a golden whose replay failed
  becomes that replay's candidate (the engine's rows over the golden's own steps, `vd.workflow.refresh.promote`,
  no second run); a missing golden, or one stale against its declaration, is recorded from its declaration
  with the test's model (``--vd-update=all``: every golden the run touches is re-recorded so, once per run: its
  reason ends ``run ID``, pytest-xdist's ``PYTEST_XDIST_TESTRUNUID`` shared by its workers, and a later test of
  it, in any worker, replays what that recorded), as is one whose
  candidate's controls were inconclusive (its rows differ at their steps already) where it ran the golden's own
  forward. A thin reference or a blind control refuses the update and fails the test; the run's summary lists each
  refresh with its change headline. A golden another process is writing (another pytest-xdist worker updating
  it) is waited for (`WAIT_WRITER_S` at most) and judged again as that process left it. Put ``--vd-update`` last
  or write ``--vd-update=failed``: it takes an optional value.
* ``--vd-forward NAME`` (repeatable) and ``--vd-tolerance [KIND=]SPEC`` (repeatable) pass through to every
  replay whose test does not set ``forwards`` or ``tolerances`` itself (``replay(forwards=("sdpa",))``
  wins); ``--vd-config FILE`` names the declaring file (default: found from the rootdir).

A declared pin is checked by every replay and rewritten by an update (as ``vd refresh`` does: a test replaying
the golden after it, in any worker, reads the declaration again). A golden whose declaration changed since it was
recorded fails as stale (unless updated); the summary
lists orphan goldens, those on disk no declaration names, as syrupy lists unused snapshots.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from vd.errors import CandidateOutdatedError, GoldenBusyError, VdError, system_refusal

if TYPE_CHECKING:
    from vd.workflow.refresh import Refreshed

_KEY = pytest.StashKey["_Session"]()
# An update that met another process's: its writers' lock held, or a candidate saved against the version it replaced.
RACED = (GoldenBusyError, CandidateOutdatedError)
WAIT_WRITER_S = 3600.0  # how long an update waits for another process writing its golden (a live one: a dead one
#                         lets go of the lock at once)


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("vd", "vd golden files of the verify path")
    g.addoption("--vd", action="store_true", help="collect the suite's goldens (vd.toml or [tool.vd]) as tests")
    g.addoption("--vd-config", metavar="FILE", help="the file declaring the suite (default: found from the rootdir)")
    g.addoption("--vd-update", nargs="?", const="failed", choices=("failed", "all"), metavar="failed|all",
                help="re-record goldens whose replay failed, missing or stale ones (all: every golden run)")
    g.addoption("--vd-forward", action="append", default=[], metavar="NAME", help="forward to replay (repeatable)")
    g.addoption("--vd-tolerance", action="append", default=[], metavar="[KIND=]SPEC",
                help="tolerance policy item for every replay (repeatable)")


class GoldenFailure(AssertionError):
    """A golden's replay failed (or could not run); the message is vd's reasons, one per line."""


class _Session:
    """The plugin's state for one pytest session: the suite, the models loaded once, what was refreshed."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.update = config.getoption("vd_update")
        self._suite = None
        self._seen: int | None = None  # the declaration file's mtime when read
        from vd.workflow.suite import Models

        self.models = Models()
        self.refreshed: list[tuple[str, Refreshed]] = []
        # This run's ID, shared by pytest-xdist's workers: --vd-update=all re-records a golden once per run.
        self.run = (os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex)[:12]

    @property
    def suite(self):
        """The declaration, read again where its file changed since (an update wrote a golden's new pin: this
        process's, or another pytest-xdist worker's), so every replay checks the pin it holds now."""
        from vd.workflow.declare import find, load_suite

        file = self._suite.file if self._suite is not None else (self.config.getoption("vd_config")
                                                                 or find(self.config.rootpath))
        try:
            seen = os.stat(file).st_mtime_ns if file is not None else None
        except OSError:
            seen = None
        if self._suite is None or seen != self._seen:
            self._suite, self._seen = load_suite(file), seen
        return self._suite

    def settings(self, **over):
        """`vd.replayer.ReplaySettings` from the command line's --vd-forward and --vd-tolerance, then a test's own
        keywords, which win (they are the more specific: a test that asks for ``forwards=("sdpa",)`` means
        it). One name given where a tuple belongs (``forwards="sdpa"``, ``ks=2``) is that one item, not its
        letters; a keyword that is no field is a TypeError naming the fields."""
        from dataclasses import fields

        from vd.replayer import ReplaySettings

        known = [f.name for f in fields(ReplaySettings)]
        unknown = sorted(set(over) - set(known))
        if unknown:
            raise TypeError(f"vd_golden(...).replay() takes vd.replayer.ReplaySettings fields as keywords; "
                            f"{', '.join(unknown)} is none of them ({', '.join(known)})")
        for key in {"forwards", "ks", "tolerances"} & set(over):  # the tuple fields
            over[key] = (over[key],) if isinstance(over[key], str | int) else tuple(over[key])
        given = {"forwards": tuple(self.config.getoption("vd_forward")),
                 "tolerances": tuple(self.config.getoption("vd_tolerance"))}
        return ReplaySettings(**{**given, **over})

    def check(self, name: str, who: str, model=None, **over):
        """Replay golden ``name`` (refreshing it when asked to update); raise `GoldenFailure` with vd's
        reasons when it fails; the report when it passes (None after a refresh)."""
        __tracebackhide__ = True  # a failure shows the test's line and vd's reasons, not this function
        from vd.store import locate

        try:
            entry = self.suite.select([name])[0]
        except VdError as e:
            raise GoldenFailure(str(e)) from None
        try:
            return self._check(entry, who, model, dict(over))
        except RACED as e:
            # Another process writes it, or wrote it since this replay read it (pytest-xdist workers updating one
            # golden): judged again once it is done, as if this test had run after it (a golden recorded as this
            # test would record it then passes).
            if not locate(entry.path).wait_writer(WAIT_WRITER_S):
                raise GoldenFailure(f"vd golden {name!r}: the refresh was refused:\n  - {e} (waited "
                                    f"{WAIT_WRITER_S:.0f} s)") from None
        try:
            return self._check(entry, who, model, dict(over))
        except RACED as e:
            raise GoldenFailure(f"vd golden {name!r}: the refresh was refused:\n  - {e}") from None

    def _check(self, entry, who: str, model, over: dict):
        """`check` of the declared golden ``entry``; one of `RACED` where another process writes it or wrote it."""
        __tracebackhide__ = True
        from vd.replayer import words
        from vd.workflow.suite import replay_suite

        name = entry.name
        meta = _root_meta(entry) if model is None or self.update == "all" else None  # (read once, where asked)
        if model is None:
            _one_process(entry, meta)
        if self.update == "all" and not self._updates_in_run(meta):
            return self._refresh(entry, who, model, "--vd-update=all")
        problems, way_on = self._problems(entry, model is not None)
        if problems and self.update:
            self._not_updated_yet(entry, problems)
            return self._refresh(entry, who, model, "; ".join(problems)[:200])
        with tempfile.TemporaryDirectory(prefix="vd-candidate-") as tmp:
            if not problems:
                keep = over.pop("save_candidate", None)  # a test's own, kept; else one to promote from, if updating
                if keep is None and self.update:
                    keep = str(Path(tmp) / "candidate.zarr")
                outcome = replay_suite([entry], self.settings(save_candidate=keep, **over), models=self.models,
                                       model=model)[0]
                if outcome.verdict == "PASS":
                    return outcome.report
                problems = ([r.text for r in outcome.report.reasons] if outcome.report is not None
                            else [outcome.error or "the replay did not complete"])
                if outcome.report is None and outcome.of_golden:  # nothing judged, so no candidate to accept
                    way_on = (f"fix what the line above names; or record the golden again from its declaration: "
                              f"vd refresh {name} --reason TEXT")
                elif outcome.report is None:  # the test's replay() arguments or its model, not the golden
                    way_on = "fix what the line above names" + (
                        ": the test's replay() arguments or the model it hands in" if model is not None or over
                        else "")
                elif (forward := words.other_forward(outcome.report)) is not None:  # --vd-update refuses it
                    way_on = (f'accept an intended change: declare forward = "{forward}" in {name}\'s declaration, '
                              f"then vd refresh {name} --reason TEXT; pytest --vd-update takes a change of the "
                              f"golden's own forward, {outcome.report.golden_forward}, not another's")
                if self.update and outcome.report is not None and keep is not None:
                    self._not_updated_yet(entry, problems)
                    return self._promote(entry, who, keep, textwrap.shorten("; ".join(problems), 200,
                                                                             placeholder=" …"), model)
        raise GoldenFailure(f"vd golden {name!r} ({entry.path}) FAILED:\n" + "\n".join(f"  - {p}" for p in problems)
                            + f"\n  ({way_on})")

    def _not_updated_yet(self, entry, problems: list[str]) -> None:
        """Refuse (`GoldenFailure`) a second --vd-update of a golden in one run (this process or another worker:
        its history names the run): a test that fails against what an earlier test of the run accepted would
        undo that update, and both would be reported as updates. Two tests' engines disagree on one golden."""
        __tracebackhide__ = True
        by = self._updates_in_run(_root_meta(entry))
        if by:
            who = by[-1].removeprefix("pytest --vd-update (").split(f", run {self.run}): ")[0]
            raise GoldenFailure(f"vd golden {entry.name!r} ({entry.path}) FAILED against the update {who} made in this "
                                "run:\n" + "\n".join(f"  - {p}" for p in problems) + "\n  (two tests' engines give "
                                "this golden different rows; a second update would undo the first: give each engine "
                                "its own golden, or update them in separate runs)")

    def _updates_in_run(self, meta) -> list[str]:
        """The reasons of the versions this run's updates made, in this process or another worker (root metadata
        ``meta``'s history: each names the run, `_refresh`, `_promote`); --vd-update=all re-records a golden with
        none, and a second update is refused (`_not_updated_yet`)."""
        history = (meta or {}).get("history") or []
        return [str(v["reason"]) for v in history if isinstance(v, dict) and f", run {self.run}): " in str(v.get(
            "reason", ""))]

    def _problems(self, entry, own_model: bool) -> tuple[list[str], str]:
        """Why the golden cannot be replayed as declared: missing, unreadable or stale (none: it can); and the
        way on a failure names (a golden not recorded yet is recorded: vd refresh refuses one). Where the test
        hands in its own model (``own_model``), vd refresh would record the declared one, not the test's."""
        from vd.store import locate
        from vd.workflow.declare import recording_refusal
        from vd.workflow.suite import record_settings, stale_now

        if locate(entry.path).state() in ("absent", "partial"):  # partial: an interrupted S3 write
            why = recording_refusal(entry)
            return ["golden missing"], (f"record it: vd record --suite {entry.name}, or pytest --vd-update"
                                        if why is None else f"change its declaration: {why}")
        accept = f"accept an intended change: pytest --vd-update, or vd refresh {entry.name} --reason TEXT"
        if own_model:
            accept = (f"accept an intended change: pytest --vd-update keeps the rows of the model this test ran "
                      f"(vd refresh {entry.name} --reason TEXT records the declared model, "
                      f"{record_settings(entry).model})")
        try:
            stale = stale_now(entry)
        except VdError as e:
            return [str(e)], accept
        return [f"stale, the declaration changed since it was recorded: {r}" for r in stale], accept

    def _promote(self, entry, who: str, candidate: str, why: str, model):
        """Accept the failed replay's candidate; where its controls were inconclusive (its rows differ at the
        controls' steps already) and it ran the golden's own forward, record the golden again with the test's
        model (or the declared one) instead, as for a stale golden: that recording's own replay vouches for it,
        and a promotion cannot. A candidate of another forward stays refused, naming what to declare."""
        __tracebackhide__ = True
        from vd.workflow.declare import check_pin_writable
        from vd.workflow.refresh import promote

        with _refused(entry.name):
            check_pin_writable(entry)
            done = promote(candidate, entry.path, reason=f"pytest --vd-update ({who}, run {self.run}): {why}",
                           name=entry.name)
        if done.record_instead == {}:
            return self._refresh(entry, who, model, why)
        return self._done(entry, done)

    def _done(self, entry, r):
        """A refresh's or promotion's end: refused, the test's failure; else the golden's new pin written into its
        declaration where it is pinned (`vd.workflow.declare.repin`: it kept the old one, and every replay then
        refused the updated golden), and the refresh listed in the run's summary."""
        __tracebackhide__ = True
        from vd.workflow.declare import repin

        if r.refused:
            raise GoldenFailure(f"vd golden {entry.name!r}: the refresh was refused:\n"
                                + "\n".join(f"  - {x}" for x in r.refused))
        with _refused(entry.name):
            pinned = repin(entry, entry.path)
        if pinned is not None:
            r.changes.append(f"pin in {entry.file}: {pinned}")
        self.refreshed.append((entry.name, r))

    def _refresh(self, entry, who: str, model, why: str):
        __tracebackhide__ = True
        from vd.workflow.declare import check_pin_writable
        from vd.workflow.refresh import refresh
        from vd.workflow.suite import record_settings

        s = record_settings(entry)
        model = model or self.models.get(s.model, s.device, s.dtype, s.head)
        with _refused(entry.name):
            check_pin_writable(entry)
            done = refresh(entry.path, s, reason=f"pytest --vd-update ({who}, run {self.run}): {why}", name=entry.name,
                           model=model)
        self._done(entry, done)


def _root_meta(entry):
    """The golden's root metadata (`vd.store.root_meta`), read once per check; None where it cannot be read (a
    recording, or the replay, says why)."""
    from vd.store import root_meta

    try:
        return root_meta(entry.path)
    except (VdError, OSError):
        return None


def _one_process(entry, meta) -> None:
    """A golden recorded over tensor-parallel ranks (root metadata ``meta``), replayed or updated with its own
    model: pytest runs one process, where its rows differ as another build's (and an update would re-record it
    there): a failure saying what runs its ranks. (A test's own engine is judged as any other build.)"""
    __tracebackhide__ = True
    from vd.preflight import tensor_parallel

    tp, _ = tensor_parallel(meta)
    if tp > 1:
        raise GoldenFailure(f"vd golden {entry.name!r} ({entry.path}) was recorded over {tp} tensor-parallel ranks "
                            f"and pytest runs it in one process, where its rows differ as another build's:\n"
                            f"  (vd replay {entry.name} replays it over its ranks; vd record {entry.name} --refresh "
                            "--reason TEXT re-records it there)")


@contextlib.contextmanager
def _refused(name: str):
    """A refresh or promotion that vd refuses as bad input (a slim golden, another writer holding it, a candidate of
    another version): the golden's failure, its one line, not a traceback through vd."""
    __tracebackhide__ = True
    try:
        yield
    except RACED:
        raise  # (waited for by `_Session.check`)
    except VdError as e:
        raise GoldenFailure(f"vd golden {name!r}: the refresh was refused:\n  - {e}") from None
    except OSError as e:  # a write the system refused (a full disk): its one line, as the command line says it
        raise GoldenFailure(f"vd golden {name!r}: the refresh was not written:\n  - {system_refusal(e)}") from None


def _session(config: pytest.Config) -> _Session:
    if _KEY not in config.stash:
        config.stash[_KEY] = _Session(config)
    return config.stash[_KEY]


class Golden:
    """A declared golden as a test uses it (the ``vd_golden`` fixture)."""

    def __init__(self, session: _Session, name: str, who: str):
        self.session, self.name, self.who = session, name, who

    @property
    def path(self) -> str:
        return self.session.suite.select([self.name])[0].path

    def replay(self, model=None, **settings):
        """Replay through ``model`` (default: the golden's own), with `vd.replayer.ReplaySettings` fields as
        keywords; fails the test with vd's reasons, returns the report on PASS."""
        __tracebackhide__ = True
        from vd.protocol import require_model

        require_model(model, "vd_golden(...).replay()")
        return self.session.check(self.name, self.who, model, **settings)


@pytest.fixture
def vd_golden(request: pytest.FixtureRequest):
    """``vd_golden(NAME)``: the declared golden NAME (see the module's docstring)."""
    session = _session(request.config)
    return lambda name: Golden(session, name, request.node.nodeid)


class GoldenItem(pytest.Item):
    """One declared golden replayed with its own model (``pytest --vd``)."""

    def __init__(self, *, golden: str, **kwargs):
        super().__init__(**kwargs)
        self.golden = golden

    def runtest(self) -> None:
        _session(self.config).check(self.golden, self.nodeid)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, GoldenFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, f"vd golden {self.golden}"


class SuiteFile(pytest.File):
    """The declaring file, collected as the suite's goldens."""

    def collect(self):
        for name in _session(self.config).suite.entries:
            yield GoldenItem.from_parent(self, name=name, golden=name)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    if not config.getoption("vd"):
        return
    try:
        suite = _session(config).suite
    except VdError as e:  # a declaration that cannot work: pytest's one-line usage error
        raise pytest.UsageError(f"vd: {e}") from None
    items.extend(SuiteFile.from_parent(session, path=Path(suite.file)).collect())


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if _KEY not in config.stash:
        return
    s = config.stash[_KEY]
    tr = terminalreporter
    if s.refreshed:
        tr.section("vd: goldens refreshed")
        for name, r in s.refreshed:
            tr.write_line(f"{name}: v{r.version} {r.url}")
            for line in r.changes:
                tr.write_line(f"    {line}")
    if config.getoption("vd") and s._suite is not None:
        from vd.workflow.status import orphans

        found = orphans(s._suite)
        if found:
            tr.section("vd: orphan goldens")
            tr.write_line(f"{len(found)} golden(s) on disk that no declaration in {s._suite.file} names "
                          "(remove them with vd status --prune):")
            for path in found:
                tr.write_line(f"    {path}")
