"""The golden store: a recording's step logs and logits rows in a zarr v3 group, in a directory, a zip file
or an object store.

Its modules import one way: `format` (names, shapes, encodings) and `location` (where a golden lives:
`local` for a directory or zip file, `objects` for an S3 prefix) at the bottom; `chunks` (one array's
chunks, checked) and `side` (one K as a comparison sees it) above them; then `read` (open and check a
golden) and `write` (stage, then publish one; on a GPU its rows written by `processes`); `prefetch` (read
beside a GPU replay), `slim` and `migrate` on top; `manifest`, `schema`, `history` and `atomic` are below
`read` and `write`.
"""

from vd.store.format import FORMAT_VERSION
from vd.store.location import Location, locate, root_meta
from vd.store.migrate import migrate
from vd.store.prefetch import Prefetcher
from vd.store.read import Golden, content_digest_at, open_golden
from vd.store.side import GoldenSide, SlimGoldenError
from vd.store.slim import slim
from vd.store.write import GoldenWriter, check_target

__all__ = ["FORMAT_VERSION", "Golden", "GoldenSide", "GoldenWriter", "Location", "Prefetcher", "SlimGoldenError",
           "check_target", "content_digest_at", "locate", "migrate", "open_golden", "root_meta",
           "slim"]
