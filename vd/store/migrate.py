"""Rewriting a golden of an earlier format in the current one (`migrate`, ``vd migrate OLD NEW``).

Every row of the old golden is read and checked (its chunks' checksums; its digests where it has them), then
written again as a recording would write it: byte planes, digests and statistics, the run group, the
manifest and the golden's ID. The numbers do not change: the new golden's content digest equals the old
one's (`vd.store.read.Golden.content_digest`), and its history records the migration: a golden of a format
before histories (1-4) starts one with it, a later one keeps its versions and gains one for the migration.
"""

from __future__ import annotations

import os

from vd.errors import UsageError
from vd.store import format as F
from vd.store import history
from vd.store.location import Location
from vd.store.read import open_golden
from vd.store.slim import rewrite


def migrate(source: str | os.PathLike, out: str | os.PathLike, *, refresh: bool = False) -> Location:
    """Write the golden at ``source`` again at ``out``, in the current format."""
    g = open_golden(source)
    if g.info.version == F.FORMAT_VERSION:
        raise UsageError(f"{g.url} is in the current format ({F.FORMAT_VERSION}) already; to copy it into another "
                         f"store: vd pack {g.url} {out}")
    reason = f"migrated from format {g.info.version} ({g.url})"
    updates: dict = {"rows": g.meta.get("rows") or {"stored": True}}
    if g.history:  # the same numbers: a version whose content digest is the last one's
        updates["history"] = [*g.history, history.entry(g.meta, g.content_digest(), reason=reason,
                                                        previous=g.history)]
    return rewrite(g, out, refresh=refresh, rows=True, updates=updates, reason=reason)
