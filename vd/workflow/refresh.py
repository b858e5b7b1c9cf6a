"""A reviewed refresh (`refresh`, `promote`): a golden replaced by a new version only with a reason, only
when the new version is sound, and with a change summary a pull request can show.

`refresh` records the settings it is given (the golden's own, `vd.recorder.RecordSettings.of_golden`, or
its declaration's) into a staging directory beside the golden, then checks the new recording: a thin
reference is refused by the recorder, and the new golden is replayed once with the same model, which must
PASS with every detection control firing (a build that cannot replay its own golden bit for bit, or a
policy too loose to see a changed draft, makes no evidence); its own verify rows failing the policy's
``equivalence=`` against its decode rows are a warning (``Refreshed.warnings``), as they are to `vd record`.
`promote` takes a candidate a replay saved (``vd replay --save-candidate``) instead of recording; the candidate
carries its replay's control results.
Either way the new version is compared with the golden it replaces (`summarise`): which K, steps and rows
moved and by how much, which decisions changed, whether the model, forward or environment changed. The
summary's headline lines and the reason join the golden's history (`vd.store.history`), and the golden is
published whole through its location. Refused, nothing is published and the old golden stays as it was.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from vd import preflight
from vd.env import numerics_differences
from vd.errors import CandidateOutdatedError, GoldenCorruptError, GoldenError, UsageError, naming
from vd.models.specs import golden_dir, names_stored
from vd.progress import SILENT, Progress
from vd.protocol import VerifyModel, require_model
from vd.recorder import RecordSettings, record
from vd.replayer import ReplaySettings, replay, words
from vd.replayer.diff import diff
from vd.store import Golden, Location, check_target, locate, manifest, open_golden
from vd.store import history as H
from vd.store.format import DECODE_K
from vd.store.local import finish_removals
from vd.store.read import recording_difference
from vd.store.write import reseal


@dataclass(slots=True)
class Refreshed:
    """What a refresh did: published or refused (``refused``: why), the change summary in Markdown and its
    headline lines (``changes``, also in the history entry)."""

    url: str
    refused: list[str] = field(default_factory=list)
    summary: str = ""  # the change summary (Markdown): a title, the reason, then ``details``
    details: str = ""  # what changed (Markdown): the headline lines, the rows that moved, the decisions
    changes: list[str] = field(default_factory=list)
    version: int | None = None
    warnings: list[str] = field(default_factory=list)  # the new recording's (`vd.recorder.RecordResult.warnings`)
    # A promotion refused only because the candidate's controls were inconclusive: the settings a recording
    # of its change needs beyond the golden's own ({}: none, the golden's model and forward record it).
    record_instead: dict[str, str] | None = None

    @property
    def published(self) -> bool:
        return not self.refused


def _previous(location: Location) -> tuple[Golden | None, str | None]:
    """The golden a refresh replaces (None where there is none), or why it cannot be read (a damaged golden
    can be refreshed: where its root metadata is intact, hashed to its ID, its history goes on and the summary
    says its rows could not be compared; else the history is lost, and the summary says so)."""
    check_target(location, refresh=True)
    state = location.state()
    if state == "absent":
        return None, None
    if state == "partial":
        return None, "an interrupted S3 write had left no golden there"
    try:
        return open_golden(location), None
    except GoldenError as e:
        try:  # a file missing or cut short, a damaged run group: the root metadata alone (its history, hashed to
            return open_golden(location, sizes=False, volatile=False), None  # its ID), the files checked by the diff
        except GoldenError:
            return None, str(e)


def _check_reason(reason: str) -> None:
    if not reason.strip():
        raise UsageError("a refresh needs a reason (--reason TEXT): it goes into the golden's history")


def refresh(where: str | os.PathLike, settings: RecordSettings, *, reason: str, name: str | None = None,
            model: VerifyModel | None = None, progress: Progress = SILENT) -> Refreshed:
    """Record ``settings`` as the golden at ``where``'s next version (see the module's docstring)."""
    require_model(model, "vd.workflow.refresh()")
    _check_reason(reason)
    settings.check()
    location = locate(where)
    with location.writer():
        done = _refresh(location, settings, reason, name, model, progress)
    finish_removals()  # nothing left beside the golden once a refresh returns
    return done


def _refresh(location: Location, settings: RecordSettings, reason: str, name: str | None,
             model: VerifyModel | None, progress: Progress) -> Refreshed:
    old, unreadable = _previous(location)
    if old is not None:
        _refuse_slim(old)
    staging = location.staging()
    try:
        new_path = staging / "new.zarr"
        if model is None:
            from vd.models import load_model

            progress.phase("loading model", 0)
            model = load_model(settings.model, device=settings.device, dtype=settings.dtype, head=settings.head)
        r = record(new_path, settings, model=model, progress=progress, reason=reason)
        if r.location is None:
            return Refreshed(location.url, refused=[*r.thin, *r.short])
        check = replay(new_path, ReplaySettings(threads=settings.threads), model=model, progress=progress)
        # Its own verify rows failing the policy's equivalence= are its forward's (every replay of it fails on them):
        # a warning, as the recording gave (`RecordResult.warnings`), not a refusal `vd record` would not make.
        blocking = [x for x in check.reasons if x.what != "equivalence"]
        if check.verdict != "PASS" and (blocking or not check.reasons):
            return Refreshed(location.url, refused=[f"the new recording does not pass its own replay: {x.text}"
                                                    for x in blocking or check.reasons])
        done = _publish(location, new_path, old, unreadable, reason, name, settings_changes(old, settings))
        done.warnings = list(r.warnings)
        return done
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _refuse_slim(old: Golden, candidate: str | None = None) -> None:
    """A slim golden is not recorded over, nor a full ``candidate`` promoted over it (`vd.preflight.slim_refusal`,
    which the command line asks before anything heavy is imported): a candidate saved against the slim golden is
    one of its full golden too (the two have one content digest), and `vd slim --refresh` replaces the copy of
    an earlier version."""
    refusal = preflight.slim_refusal(old.url, old.meta, candidate)
    if refusal is not None:
        old.close()
        raise refusal


def settings_changes(old: Golden | None, settings: RecordSettings) -> list[str]:
    """What ``settings`` change from what recorded ``old`` (a model SPEC naming the golden's own model file from
    here, or from its declaration, is no change: `vd.models.specs.names_stored`)."""
    if old is None:
        return []
    have = RecordSettings.of_golden(old.meta)
    if settings.model is not None and names_stored(settings.model, old.meta["model"], golden_dir(old.location)):
        settings = dataclasses.replace(settings, model=have.model)
    return [f"asked: {c}" for c in settings.changes_from(have)]


def promote(candidate: str | os.PathLike, where: str | os.PathLike, *, reason: str,
            name: str | None = None, allow_slim: bool = False) -> Refreshed:
    """Publish a replay's saved candidate as the golden at ``where``'s next version. The candidate must be
    intact (every file against its manifest, every row against its digest), of the golden's model and feed,
    and saved against the golden's current version; every K's control must have fired and no K may be thin.
    A slim candidate over a full golden (which would drop its rows) only with ``allow_slim``."""
    _check_reason(reason)
    location = locate(where)
    with location.writer():
        done = _promote(location, open_golden(candidate), reason, name, allow_slim)
    finish_removals()
    return done


def _check_candidate(cand: Golden, old: Golden | None, url: str, allow_slim: bool) -> dict:
    """The candidate's ``candidate`` metadata, once it is checked whole (as ``vd verify`` checks a golden)
    and found to be a candidate for the golden ``old`` at ``url``; else a `GoldenError` or `UsageError`."""
    made = cand.meta.get("candidate")
    if not isinstance(made, dict) or cand.manifest is None:
        raise UsageError(f"{cand.url} is not a saved candidate (vd replay --save-candidate writes one)")
    cand.check_whole()  # every file against the manifest, then every step log and row
    if old is None:
        return made
    if not cand.slim:
        _refuse_slim(old, cand.url)
    if cand.slim and not old.slim and not allow_slim:
        raise UsageError(f"{cand.url} is slim and {url} is full: promoting it would drop the golden's rows "
                         "(--allow-slim to do so)")
    for what, a, b in (("model fingerprint", old.meta["model"]["fingerprint"], cand.meta["model"]["fingerprint"]),
                       ("feed", old.info.feed, cand.info.feed)):
        if a != b:
            raise UsageError(f"{cand.url} is of another {what} ({b}) than {url} ({a}); record that golden "
                             "anew (vd record) instead of promoting it")
    if made.get("of_content") != old.content_digest():
        if old.history and not any(e.get("content_digest") == made.get("of_content") for e in old.history):
            raise UsageError(f"{cand.url} was saved against {made.get('of')} ({made.get('of_content')}), which is no "
                             f"version of {url}: replay {url} itself with --save-candidate")
        raise CandidateOutdatedError(f"{cand.url} was saved against another version of {url} "
                                     f"({made.get('of_content')}); replay the golden again to save a current candidate")
    return made


def _promote(location: Location, cand: Golden, reason: str, name: str | None, allow_slim: bool) -> Refreshed:
    old, unreadable = _previous(location)
    made = _check_candidate(cand, old, location.url, allow_slim)
    inconclusive = {str(k) for k in made.get("inconclusive") or ()}
    silent = [k for k, fired in (made.get("control") or {}).items() if not fired]
    refused = [f"K={k}: the candidate's detection control was inconclusive (its rows differ from the golden's at the "
               "control's step already, so a changed draft shows nothing there)"
               if k in inconclusive else f"K={k}: the candidate's detection control was blind" for k in silent]
    changed = None
    if inconclusive & set(silent):
        changed = _changed(cand, old)
        refused.append(_rerecord_step(name, location.url, changed, reason))
    thin = list(cand.meta.get("thin") or [])  # the golden's steps, and so its accept counts
    if refused or thin:
        only_inconclusive = not thin and set(silent) <= inconclusive
        return Refreshed(location.url, refused=refused + thin, record_instead=changed if only_inconclusive else None)
    staging = location.staging()
    try:
        new_path = staging / "new.zarr"
        _copy_golden(cand, new_path)
        # (the candidate's path is left out: often a temporary folder, gone once it is promoted)
        ran = [f"rows from a replay with {cand.meta['model']['spec']} ({cand.info.forward}), promoted from a "
               "saved candidate"]
        if old is not None:  # the golden stays of the model it names; the numbers are the candidate's
            reseal(new_path, {"model": {**cand.meta["model"], "spec": old.meta["model"]["spec"],
                                               "head": old.meta["model"].get("head")}})
        return _publish(location, new_path, old, unreadable, reason, name, ran)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _changed(cand: Golden, old: Golden | None) -> dict[str, str]:
    """What a candidate replayed that its golden does not record: its forward, and its model where the replay
    named another (empty where it replayed the golden's own: its numbers moved with the environment)."""
    changed = {}
    if old is not None and cand.meta["model"]["spec"] != old.meta["model"]["spec"]:
        changed["model"] = cand.meta["model"]["spec"]
    if old is None or cand.info.forward != old.info.forward:
        changed["forward"] = cand.info.forward
    return changed


def _rerecord_step(name: str | None, url: str, changed: dict[str, str], reason: str) -> str:
    """How to record what a candidate replayed (``changed``: `_changed`), for a change its control cannot vouch
    for: a declared golden (``name``) has it declared, then refreshed (the declaration says what a refresh
    records); another is recorded with those flags. The reason is given again, unless it is too long to retype
    (a generated one: ``TEXT``)."""
    again = ["--reason", reason if len(reason) <= 100 and "\n" not in reason else "TEXT"]
    if name is not None and not changed:
        return "record the change itself instead: " + shlex.join(["vd", "refresh", name, *again])
    if name is not None:
        declare = ", ".join(f'{key} = "{value}"' for key, value in changed.items())
        return (f"record the change itself instead: declare {declare} in {name}'s declaration, then "
                + shlex.join(["vd", "refresh", name, *again]))
    flags = [x for key, value in changed.items() for x in (f"--{key}", value)]
    return "record the change itself instead: " + shlex.join(["vd", "record", url, "--refresh", *flags, *again])


def _copy_golden(g: Golden, dest: Path) -> None:
    """A local copy of golden ``g`` as a directory: the files its manifest lists, each checked against it as
    it is copied, and the metadata (the root ``zarr.json``, bound by the ID, and the run group's). Nothing
    else of ``g``'s store enters the copy."""
    assert g.manifest is not None  # `_check_candidate` refused a golden without one
    for key in [*g.manifest, *manifest.OUTSIDE]:
        data = g.location.get(key)
        if data is None:
            if key == manifest.OUTSIDE[1]:  # a golden may do without its run group's metadata
                continue
            raise GoldenCorruptError(f"{g.url}/{key} is missing")
        if key in g.manifest:  # the bytes copied are the bytes checked
            manifest.check_hashes(lambda _k, d=data: d, {key: g.manifest[key]}, g.url)
        (dest / key).parent.mkdir(parents=True, exist_ok=True)
        with naming(dest / key):
            (dest / key).write_bytes(data)


def _publish(location: Location, new_path: Path, old: Golden | None, unreadable: str | None, reason: str,
             name: str | None, asked: list[str]) -> Refreshed:
    """Summarise the new version against the old, write its history, publish it. ``asked``: the summary's first
    lines (what the caller changed on purpose)."""
    new = open_golden(new_path)
    changes, details = summarise(old, new, asked, unreadable)
    previous = old.history if old is not None else []
    meta = dict(new.meta)
    meta.pop("candidate", None)  # once promoted, the candidate is the golden
    entry = H.entry(meta, new.content_digest(), reason=reason, previous=previous, changes=changes)
    for g in (old, new):  # let go of both versions' files: the replaced one can then be removed at once
        if g is not None:
            g.close()
    reseal(new_path, {"history": [*previous, entry]}, drop=("candidate",))
    location.publish(new_path, True)
    return Refreshed(location.url, summary=words.refresh_markdown(name or location.url, reason, details),
                     details=details, changes=changes, version=entry["version"])


# -- the change summary -------------------------------------------------------------------------------------
def summarise(old: Golden | None, new: Golden, asked: list[str], unreadable: str | None = None
              ) -> tuple[list[str], str]:
    """The new version against the old: its headline lines, and what changed in Markdown
    (`vd.replayer.words.changes_markdown`) for a pull request's summary."""
    if old is None:
        head = [f"previous version unreadable ({unreadable}); its history is lost" if unreadable else "new golden"]
        return head, words.changes_markdown(head, [], [])
    lines: list[str] = []
    rows: list[tuple[int, str, int, int, float, int, str]] = []
    decisions: list[str] = []
    if old.content_digest() == new.content_digest():
        lines.append("no logit, step or decision moved (content digest unchanged)")
    lines += asked
    for what, a, b in (("model fingerprint", old.meta["model"]["fingerprint"], new.meta["model"]["fingerprint"]),
                       ("forward", old.info.forward, new.info.forward),
                       ("head fingerprint", (old.meta.get("mtp") or {}).get("fingerprint"),
                        (new.meta.get("mtp") or {}).get("fingerprint"))):
        if a != b and not any(line.startswith(f"asked: {what}:") for line in asked):  # (said once)
            lines.append(f"{what}: {a} -> {b}")
    if old.traced and not new.traced:  # (a promoted candidate: a replay traces nothing)
        lines.append("module traces dropped: the new version holds none (vd record GOLDEN --refresh --trace "
                     "records them again)")
    elif old.traced and new.decoded and not old.traced_at(DECODE_K) and new.traced_at(DECODE_K):
        lines.append("module traces of the decode rows added (vd locate locates a difference there too)")
    env = numerics_differences(old.meta.get("environment") or {}, new.meta.get("environment") or {})
    lines += [f"environment: {d}" for d in env]
    differ = recording_difference(old, new)
    if differ is not None:  # (worded without the staging folder's path: the history keeps this line)
        lines.append(f"rows not compared: the new version records another thing: {differ}")
        return lines, words.changes_markdown(lines, rows, decisions)
    try:
        d = diff(old.url, new.url, tolerances=("exact",))
    except UsageError as e:
        lines.append(f"rows not compared: {e}")
    except GoldenError as e:  # a golden damaged past its metadata: no reference, and no reason not to replace it
        lines.append(f"rows not compared: the version replaced is damaged: {e}")
    else:
        rows = words.row_changes(d)
        decisions = [line for k in old.ks for line in words.decision_lines(k, old.checked_log(k), new.checked_log(k))]
        lines += words.rows_headline(rows) + decisions
    return lines, words.changes_markdown(lines, rows, decisions)
