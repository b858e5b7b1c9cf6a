"""A slim golden (`slim`): a golden's step logs, row digests and statistics without its rows.

A replay judges rows by their digests, so a slim golden PASSes or FAILs exactly as its full golden does
under the exact policy (and under ``argmax``, whose decision the stored statistics answer), with every
decision checked; where rows differ it says which and what their statistics are, and it measures them
when the full golden is named as its rows' source (`vd.store.read.Golden.with_rows`). Typically 1 % of
the full golden's size: small enough to commit beside a test while the full golden lives in a zip file
or an object store.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from vd.errors import UsageError, VdError
from vd.store import format as F
from vd.store.location import Location, locate
from vd.store.read import Golden, open_golden, recording_difference
from vd.store.write import GoldenWriter


def slim(source: str | os.PathLike, out: str | os.PathLike, *, refresh: bool = False) -> Location:
    """Write the slim form of the golden at ``source`` to ``out``. Every row of the source is read and checked
    against its digest first, so a slim golden never vouches for damaged rows."""
    g = open_golden(source)
    if g.slim:
        raise UsageError(f"{g.url} is slim already")
    if refresh:
        check_copy_target(locate(out), g, slim=True)
    return rewrite(g, out, refresh=refresh, rows=False, reason=f"slim form of {g.url}",
                   updates={"rows": {"stored": False, "slim_of": {**_made_from(g.url, os.fspath(out)),
                                                                  "created": g.meta.get("created"),
                                                                  "format_version": g.info.version}}})


def _made_from(source: str, out: str) -> dict:
    """How a slim golden at ``out`` names the full golden at ``source``: both local, by the path from the slim
    golden's folder (``"base": "slim"``), which names it from any folder and in any checkout of the two
    (`vd.preflight.made_from` reads it back); else as given."""
    if "://" in source or "://" in out:
        return {"golden": source}
    return {"golden": os.path.relpath(os.path.abspath(source), os.path.dirname(os.path.abspath(out))),
            "base": "slim"}


def rewrite(g: Golden, out: str | os.PathLike, *, refresh: bool, rows: bool, updates: Mapping, reason: str
            ) -> Location:
    """Write the opened golden ``g`` again at ``out`` as a recording writes one (`slim`, `vd.store.migrate`):
    its files checked against its manifest (where it has one: its group documents too, which reading its rows
    passes) and every row it stores read whole and checked first, each K's step log, digests and statistics, its
    rows (with ``rows``), its metadata with ``updates``, and the Inductor artifacts a compiled forward's replay
    needs; ``reason`` starts the new golden's history."""
    if g.manifest is not None:  # (without one, the rows' own checks below are `check_files`' whole work)
        g.check_files()
    location = locate(out)
    with location.writer(), GoldenWriter(location, refresh=refresh, background=False) as w:
        for k in g.groups:
            stored = None if g.slim else g.verify_rows(k)  # read whole, each chunk and row checked
            drafts = g.small(k, "drafts") if g.info.drafted_at(k) else None
            w.add(g.layout(k), g.checked_log(k), stored if rows else None, g.summary(k), drafts)
            if g.traced_at(k):  # module traces (vd record --trace) stay with the golden
                w.add_trace(k, *g.trace(k))
        meta = {key: v for key, v in g.meta.items() if key not in F.WRITTEN}
        meta.update(logits=F.logits_meta(g.logical), **updates)
        if g.meta.get("compiled"):  # the kernels a compiled forward's replay needs stay with the golden
            g.check_file(F.INDUCTOR_ARTIFACTS)
            artifacts = g.location.get(F.INDUCTOR_ARTIFACTS)
            assert artifacts is not None  # check_file read it from the version this golden holds
            w.add_file(F.INDUCTOR_ARTIFACTS, artifacts)
        w.publish(meta, g.prompt, reason=reason)
    return w.location


def earlier_version(old: Golden, source: Golden) -> bool:
    """Whether ``old`` is a copy (`vd slim`, `vd pack`) of ``source`` or of one of its earlier versions: its history
    the beginning of ``source``'s, entry for entry (a refresh adds to a golden's history and keeps the rest)."""
    mine, theirs = old.meta.get("history") or [], source.meta.get("history") or []
    return bool(mine) and len(mine) <= len(theirs) and mine == theirs[:len(mine)]


def _parted(old: Golden, source: Golden) -> str | None:
    """How ``old``'s history shows it is no copy of ``source`` or of an earlier version of it, though both record
    the same thing: another first recording (a golden recorded on its own), or a version of its own after a
    shared one (a copy refreshed by itself); None where it is such a copy, or either keeps no history."""
    mine, theirs = old.meta.get("history") or [], source.meta.get("history") or []
    if not mine or not theirs or earlier_version(old, source):
        return None
    shared = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    if shared == 0:
        first = mine[0]
        return (f"another golden: its first recording is {first.get('user')}@{first.get('host')}'s of "
                f"{first.get('time')}, with its own history of {len(mine)} version{'s' if len(mine) > 1 else ''}")
    return (f"its history parts from the source's after version {shared}: its version {shared + 1} "
            f"({mine[shared].get('reason')!r}) is its own")


def check_copy_target(location: Location, source: Golden, *, slim: bool) -> None:
    """Refuse (`vd.errors.UsageError`) a ``--refresh`` of a copy of ``source`` (its ``slim`` form, or not) over a
    golden that is no such copy: one of another recording (prompt, K, steps, vocabulary, dtype, feed or model),
    unless it is a copy of one of ``source``'s earlier versions (`earlier_version`: the copy a refresh of
    ``source`` left behind, which ``--refresh`` is for); one of the same kind whose history is not the beginning
    of ``source``'s (`_parted`: a golden recorded on its own, or a copy refreshed by itself); or a full golden
    where the copy is slim. ``--refresh``
    brings a copy up to date; it is not a licence to replace whatever golden stands at the path (its rows and
    history would be gone). A target that cannot be read as a golden is left to the writer's own check."""
    if location.state() != "golden":
        return
    try:
        old = open_golden(location, sizes=False)
    except VdError:
        return  # a damaged copy: replacing it is what --refresh is for
    try:
        if earlier_version(source, old) and not earlier_version(old, source):  # old is the newer: a rollback
            n, m = len(old.meta.get("history") or []), len(source.meta.get("history") or [])
            raise UsageError(f"{location.url} is a later version of {source.url} (version {n}, against {m}): "
                             "--refresh would roll it back and drop its newer history; copy the newer version, "
                             "or remove it first")
        differ = None if earlier_version(old, source) else recording_difference(old, source) or (
            None if old.meta["model"].get("fingerprint") == source.meta["model"].get("fingerprint") else "model")
        why = f"a recording of another kind: {differ}" if differ is not None else _parted(old, source)
        if why is None and old.slim != slim:
            why = "a full golden, whose rows the slim copy would drop" if slim else "a slim golden"
    finally:
        old.close()
    if why is not None:
        raise UsageError(f"{location.url} is not a copy of {source.url} ({why}); --refresh replaces only a copy: "
                         "remove it first, or write the copy elsewhere")
