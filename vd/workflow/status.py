"""Where a suite's goldens stand (`status`): each declared golden present or missing, complete, up to date
with its declaration and its model, recorded with which fingerprint and environment, last replayed with
which result (from a suite report); and the orphans, goldens on disk that no declaration names (`orphans`),
removed only when asked (`prune`).

A golden is **stale** when what its declaration would record now differs from what recorded it (prompt, K,
steps, model SPEC, ...: `vd.workflow.suite.stale_reasons`), when its content digest is not the one its
declaration pins, or when the model it names no longer has the fingerprint it was recorded with (checked by
loading each model once, unless ``check_models`` is off).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vd.errors import GoldenError, UsageError, VdError, system_refusal
from vd.models.specs import golden_dir, stored
from vd.preflight import recovered
from vd.progress import SILENT, Progress
from vd.store import Golden, locate, open_golden
from vd.store.location import Directory, ZipFile
from vd.workflow.declare import DeclarationError, Entry, Suite, declares, load_suite
from vd.workflow.suite import Key, Models, plan_of, stale_reasons


@dataclass(slots=True)
class GoldenStatus:
    """One declared golden's state: ``missing``, ``unreadable`` (``reasons``: why; a damaged file included),
    ``stale`` (``reasons``: what changed), ``ignored`` (git ignores some of its files, which a commit would
    drop) or ``current``; ``recorded``: what made it; ``last``: its last suite replay's verdict."""

    name: str
    path: str
    state: str
    reasons: list[str] = field(default_factory=list)
    recorded: dict = field(default_factory=dict)
    last: str | None = None

    def to_json(self) -> dict:
        return {"name": self.name, "path": self.path, "state": self.state, "reasons": self.reasons,
                "recorded": self.recorded, "last": self.last}


def status(suite: Suite, entries: Sequence[Entry], *, check_models: bool = True, report: str | None = None,
           models: Models | None = None, progress: Progress = SILENT) -> list[GoldenStatus]:
    """Each entry's `GoldenStatus`. ``report``: a suite report (``vd replay --suite --report``) to take each
    golden's last verdict from."""
    last = _last_verdicts(report)
    models = models or Models(plan_of(entries, status_key) if check_models else ())  # each let go after its last
    out = []
    for e in entries:
        out.append(_one(e, check_models, models, last.get(e.name), progress))
        models.done()
    return out


def _one(e: Entry, check_models: bool, models: Models, last: tuple[str, str | None] | None,
         progress: Progress) -> GoldenStatus:
    s = GoldenStatus(e.name, e.path, "current")
    recovered(e.path)  # a publish cut short with the path empty: its complete version put in place, as a reader does
    if locate(e.path).state() in ("absent", "partial"):  # partial: an interrupted S3 write
        s.state = "missing"  # and no last result: it was of a golden that is not there
        return s
    try:
        g = open_golden(e.path)
        if "://" not in e.path:  # a local golden's files hashed, as every replay hashes them (S3's are not fetched)
            g.check_files()
    except GoldenError as err:
        s.state, s.reasons = "unreadable", [str(err)]
        return s
    s.last = _last_of(last, g.content_digest())
    m, env = g.meta["model"], g.meta.get("environment") or {}
    history = g.history
    s.recorded = {"version": len(history) or None, "fingerprint": m["fingerprint"], "forward": g.info.forward,
                  "decode_forward": g.decode_forward, "device": g.info.device, "created": g.meta.get("created"),
                  "environment": {k: env.get(k) for k in ("vd", "torch", "transformers", "gpu_name", "cpu_model")},
                  "reason": history[-1].get("reason") if history else None, "slim": g.slim}
    s.reasons = stale_reasons(e, g)
    if e.pin is not None and (content := g.content_digest()) != e.pin:  # every replay refuses it (exit 2)
        s.reasons.append(f"its content digest {content} is not the one its declaration pins ({e.pin}): a replay "
                         "refuses it until a reviewed refresh pins it again")
    if check_models:
        try:
            model = models.get(*status_key(g), progress)
        except VdError as err:
            s.reasons.append(f"model {m['spec']}: {err}")
        else:
            s.reasons += _fingerprint(g, model) + _undeclared_forward(e, g, model)
    if s.reasons:
        s.state = "stale"
    ignored = git_ignored(e.path, ["zarr.json", *(g.manifest or {})])
    if ignored:
        s.state = "ignored" if s.state == "current" else s.state
        s.reasons.append(f"git ignores {len(ignored)} of its files ({', '.join(ignored[:3])}"
                         f"{', ...' if len(ignored) > 3 else ''}): a commit would leave them out; un-ignore them "
                         f"in .gitignore (a `*.json` line drops every zarr.json)")
    return s


def git_ignored(golden: str, keys: Sequence[str]) -> list[str]:
    """The files of the local golden at ``golden`` (a directory or a .zip, its keys ``keys``) that git ignores
    where it sits in a git work tree; none elsewhere, or where git cannot say."""
    path = Path(golden)
    if "://" in golden or not path.exists():
        return []
    files = [str(path / k) for k in keys] if path.is_dir() else [str(path)]
    try:
        done = subprocess.run(["git", "-C", str(path.parent), "check-ignore", "--stdin"], input="\n".join(files),
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode not in (0, 1):  # 1: nothing ignored; 128: not a work tree
        return []
    return [os.path.relpath(line, path.parent) for line in done.stdout.splitlines() if line]


def status_key(g: Golden) -> Key:
    """The model `vd status` loads to check a golden's fingerprint: its own, on the CPU where CUDA is not
    here (fingerprints cover weights and config, not the device they sit on)."""
    import torch

    device = g.info.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"
    spec, head = stored(g.meta["model"], golden_dir(g.location))  # a file it names, from here
    return (spec, device, g.logical, head)


def _fingerprint(g: Golden, model) -> list[str]:
    """Whether the ``model`` (and head) the golden names, loaded, still has the fingerprint it was recorded with."""
    from vd import protocol

    m = g.meta["model"]
    out = []
    now = model.identity().fingerprint
    if now != m["fingerprint"]:
        out.append(f"model {m['spec']} now has fingerprint {now}; the golden was recorded with {m['fingerprint']}")
    drafter = protocol.draft_head(model) if g.info.drafted else None
    if drafter is not None:
        head = drafter.head_info().get("fingerprint")
        if head != g.meta["mtp"]["fingerprint"]:
            out.append(f"MTP head now has fingerprint {head}; the golden was recorded with "
                       f"{g.meta['mtp']['fingerprint']}")
    return out


def _undeclared_forward(e: Entry, g: Golden, model) -> list[str]:
    """A declaration that names no forward means the model's default: a golden recorded with another (``vd record
    NAME --forward sdpa``) is stale, as a suite refresh would record the default again. Known only with the
    ``model`` loaded, on the golden's own device (another device's default may differ)."""
    if e.forward is not None or status_key(g)[1] != g.info.device:
        return []
    default = model.default_forward()
    return [] if g.info.forward == default else [
        f"forward: recorded {g.info.forward!r}, declared none (the model's default, {default!r})"]


def _last_of(last: tuple[str, str | None] | None, content: str) -> str | None:
    """The last suite replay's verdict for the golden whose content digest is ``content``: as it is for this
    version, marked for another one, and marked where the report predates content digests."""
    if last is None:
        return None
    verdict, replayed = last
    if replayed is None:
        return f"{verdict} (version not recorded)"
    return verdict if replayed == content else f"{verdict} (of another version)"


def _last_verdicts(report: str | None) -> dict[str, tuple[str, str | None]]:
    """Each golden's verdict in a suite report, and the content digest of the version it judged."""
    if report is None:
        return {}
    try:
        data = json.loads(Path(report).read_text())
        return {g["name"]: (g["verdict"], g.get("content_digest")) for g in data["goldens"]}
    except FileNotFoundError:
        raise UsageError(f"--report {report} does not exist (the JSON report of a vd replay --suite --report)") \
            from None
    except OSError as e:
        raise UsageError(f"--report {report} cannot be read: {system_refusal(e)}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise GoldenError(f"--report {report} is not a suite report (vd replay --suite --report): {e}") from e


def orphans(suite: Suite) -> list[str]:
    """Goldens (directories and .zip files holding one) in the folders of the suite's local goldens that no
    declaration names."""
    declared = {e.path for e in suite.entries.values()}
    folders = {Path(p).parent for p in declared if "://" not in p}
    found = []
    for folder in sorted(folders):
        if not folder.is_dir():
            continue
        for child in sorted(folder.iterdir()):
            if str(child) in declared or child.name.startswith("."):
                continue
            where = ZipFile(child) if child.suffix == ".zip" else Directory(child)
            if where.state() == "golden" and not _declared_by_another(child, suite):
                found.append(str(child))
    return found


def _declared_by_another(child: Path, suite: Suite) -> bool:
    """Whether a declaration other than the suite's, in ``child``'s folder or one above it (a vd.toml, a
    pyproject.toml with [tool.vd]), names ``child``, or cannot be read and so might: a golden another suite
    declares (a project's other declaration, named apart with --config; a shared folder's own) is no orphan of
    this one, and `prune` would remove it."""
    own, target = suite.file.resolve(), child.resolve()
    for folder in (target.parent, *target.parent.parents):
        for file in (folder / "vd.toml", folder / "pyproject.toml"):
            if file.resolve() == own or not (file.is_file() if file.name == "vd.toml" else declares(file)):
                continue
            try:
                other = load_suite(file)
            except DeclarationError:
                return True
            if any(Path(e.path).resolve() == target for e in other.entries.values() if "://" not in e.path):
                return True
    return False


def prune(paths: Sequence[str]) -> None:
    """Remove orphan goldens (`orphans`)."""
    for p in map(Path, paths):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
