"""Rewriting a golden of an earlier format in the current one (`migrate`, ``vd migrate OLD NEW``).

Every row of the old golden is read and checked (its chunks' checksums; its digests where it has them), then
written again as a recording would write it: byte planes, digests and statistics, the run group, the
manifest and the golden's ID. The numbers do not change: the new golden's content digest equals the old
one's (`vd.store.read.Golden.content_digest`), and its history records the migration: a golden of a format
before histories (1-4) starts one with it, a later one keeps its versions and gains one for the migration.
"""

from __future__ import annotations

import os

from vd.errors import UsageError, VdError
from vd.store import format as F
from vd.store import history
from vd.store.location import Location, locate
from vd.store.read import open_golden
from vd.store.slim import rewrite


def migrate(source: str | os.PathLike, out: str | os.PathLike, *, refresh: bool = False) -> Location:
    """Write the golden at ``source`` again at ``out``, in the current format."""
    g = open_golden(source)
    if g.info.version == F.FORMAT_VERSION:
        raise UsageError(f"{g.url} is in the current format ({F.FORMAT_VERSION}) already; to copy it into another "
                         f"store: vd pack {g.url} {out}")
    if refresh:
        _check_target(locate(out), g)
    reason = f"migrated from format {g.info.version} ({g.url})"
    updates: dict = {"rows": g.meta.get("rows") or {"stored": True}}
    if g.history:  # the same numbers: a version whose content digest is the last one's
        updates["history"] = [*g.history, history.entry(g.meta, g.content_digest(), reason=reason,
                                                        previous=g.history)]
    return rewrite(g, out, refresh=refresh, rows=True, updates=updates, reason=reason)


def _check_target(location: Location, source) -> None:
    """Refuse (`vd.errors.UsageError`) a ``--refresh`` over a golden whose numbers are not ``source``'s (its
    content digest another): ``--refresh`` replaces an earlier migration of it (or a copy), not whatever golden
    stands at NEW, whose rows and history would be gone. A target that cannot be read is the writer's to check."""
    if location.state() != "golden":
        return
    try:
        old = open_golden(location, sizes=False)
    except VdError:
        return  # a damaged earlier migration: replacing it is what --refresh is for
    try:
        have, want = old.content_digest(), source.content_digest()
    except VdError:
        return
    finally:
        old.close()
    if have != want:
        raise UsageError(f"{location.url} holds other numbers than {source.url} (content digest {have}, not "
                         f"{want}); --refresh replaces only an earlier migration of it: remove it first, or "
                         "write the migration elsewhere")
