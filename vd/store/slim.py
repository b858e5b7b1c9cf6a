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

from vd.errors import UsageError
from vd.store import format as F
from vd.store.location import Location, locate
from vd.store.read import open_golden
from vd.store.write import GoldenWriter


def slim(source: str | os.PathLike, out: str | os.PathLike, *, refresh: bool = False) -> Location:
    """Write the slim form of the golden at ``source`` to ``out``. Every row of the source is read and checked
    against its digest first, so a slim golden never vouches for damaged rows."""
    g = open_golden(source)
    if g.slim:
        raise UsageError(f"{g.url} is slim already")
    location = locate(out)
    with location.writer(), GoldenWriter(location, refresh=refresh, background=False) as w:
        for k in g.ks:
            g.verify_rows(k)
            drafts = g.small(k, "drafts") if g.info.drafted else None
            w.add(g.layout(k), g.checked_log(k), None, g.summary(k), drafts)
        meta = {key: v for key, v in g.meta.items() if key not in F.WRITTEN}
        meta.update(logits=F.logits_meta(g.logical),
                    rows={"stored": False, "slim_of": {"golden": g.url, "created": g.meta.get("created"),
                                                       "format_version": g.info.version}})
        if g.meta.get("compiled"):  # the kernels a compiled forward's replay needs stay with the golden
            g.check_file(F.INDUCTOR_ARTIFACTS)
            w.add_file(F.INDUCTOR_ARTIFACTS, g.location.get(F.INDUCTOR_ARTIFACTS))
        w.publish(meta, g.prompt, reason=f"slim form of {g.url}")
    return w.location
