"""A golden copied whole into another store (`pack`, ``vd pack GOLDEN OUT``): a directory into a ``.zip`` for
an artifact store, a ``.zip`` or an ``s3://`` prefix back into a directory, and so on.

Nothing is rewritten: every file the manifest lists is read, checked against its size and hash, and written
as it is, with the root ``zarr.json`` (the metadata, which the golden's ID covers) and the run group, so the
copy has the same golden ID, content digest and history, and `vd verify` says so. Only goldens with a manifest
(format 6 and later) are packed; an earlier one is rewritten in the current format by `vd.store.migrate`, into
any store.
"""

from __future__ import annotations

import os
import shutil

from vd.errors import GoldenCorruptError, UsageError, naming
from vd.store import format as F
from vd.store.location import Location, locate
from vd.store.read import open_golden
from vd.store.slim import check_copy_target
from vd.store.write import check_target

_OUTSIDE_MANIFEST = ("zarr.json", f"{F.RUN_GROUP}/zarr.json")  # the metadata (bound by the ID) and the run group


def pack(source: str | os.PathLike, out: str | os.PathLike, *, refresh: bool = False) -> Location:
    """Copy the golden at ``source`` to ``out`` (another store, or the same kind elsewhere), file for file."""
    g = open_golden(source)
    if g.manifest is None:
        raise UsageError(f"{g.url} is a format-{g.info.version} golden, which lists no files to copy; rewrite it "
                         f"in the current format instead (vd migrate {g.url} {out})")
    location = locate(out)
    if location.url == g.url:
        raise UsageError(f"{location.url} is the golden being packed; name another path")
    check_target(location, refresh)
    if refresh:
        check_copy_target(location, g, slim=g.slim)
    g.check_files()  # every file against the manifest before anything is copied
    with location.writer():
        staged = location.staging()
        try:
            _copy(g, staged)
            g.close()
            location.publish(staged, refresh)
        finally:  # (publish removes it; a copy that failed, a full disk say, leaves nothing beside the target)
            shutil.rmtree(staged, ignore_errors=True)
    copy = open_golden(location)
    copy.check_files()
    if copy.meta.get("golden_id") != g.meta.get("golden_id"):
        raise GoldenCorruptError(f"{location.url}: the copy's golden ID is not the source's")
    return location


def _copy(g, staged) -> None:
    """Every file of ``g`` its manifest lists, with the metadata outside it, written under ``staged``."""
    for key in [*g.manifest, *_OUTSIDE_MANIFEST]:
        data = g.location.get(key)
        if data is None:
            if key == _OUTSIDE_MANIFEST[1]:  # a golden may do without its run group's metadata
                continue
            raise GoldenCorruptError(f"{g.url}/{key} is missing")
        (staged / key).parent.mkdir(parents=True, exist_ok=True)
        with naming(staged / key):
            (staged / key).write_bytes(data)
