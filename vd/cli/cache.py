"""``vd cache info|clear``: the converted-weights cache (`vd.models.weights`)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from vd.cli.common import EXIT_PASS, Command, Group, app, examples, out
from vd.errors import UsageError
from vd.outputs import size_text

cache = typer.Typer(cls=Group, no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                    help="The cache of converted model weights (a GGUF checkpoint is dequantised once per machine).")
app.add_typer(cache, name="cache")


def _root():
    """The cache's folder (None: the cache is off); a file where it goes refused."""
    from vd.models import weights

    where = weights.root()
    if where is not None and where.exists() and not where.is_dir():  # (it said "0 entries": nothing is cached there)
        raise UsageError(f"{where} is a file, not a folder: vd caches nothing there (VD_CACHE_DIR names a folder)")
    return where


@cache.command(cls=Command, epilog=examples("vd cache info", "vd cache info --json"))
def info(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> int:
    """Where the cache is and what it holds, most recently used first."""
    from datetime import UTC, datetime

    from vd.models import weights

    where = _root()
    entries = weights.entries()
    if as_json:
        out.print(json.dumps({"root": None if where is None else str(where), "bytes": sum(e.nbytes for e in entries),
                              "entries": [{"name": e.name, "source": e.source, "dtype": e.dtype,
                                           "transformers": e.transformers, "created": e.created, "bytes": e.nbytes,
                                           "last_used": datetime.fromtimestamp(e.last_used, UTC).isoformat(
                                               timespec="seconds")} for e in entries]}, indent=1))
        return EXIT_PASS
    if where is None:
        out.print("the cache is off (VD_CACHE=off): every GGUF load converts its weights again")
        return EXIT_PASS
    out.print(f"{where}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
              + (f", {size_text(sum(e.nbytes for e in entries))}" if entries else ""))
    if entries:
        t = Table(show_edge=False)
        for col in ("entry", "source", "dtype", "transformers", "size", "last used"):
            t.add_column(col)
        for e in entries:
            t.add_row(e.name[:12], e.source, e.dtype, e.transformers, size_text(e.nbytes),
                      datetime.fromtimestamp(e.last_used, UTC).strftime("%Y-%m-%d %H:%M"))
        out.print(t)
    return EXIT_PASS


@cache.command(cls=Command, epilog=examples("vd cache clear"))
def clear() -> int:
    """Remove every cached conversion (the next load of each model converts it again)."""
    from vd.models import weights

    _root()  # (a file there: it said "removed 0 entries from" it)
    n, nbytes = weights.clear()
    out.print(f"removed {n} entr{'y' if n == 1 else 'ies'}" + (f" ({size_text(nbytes)})" if n else "")
              + ("" if weights.root() is None else f" from {weights.root()}"))
    return EXIT_PASS
