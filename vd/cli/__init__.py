"""The ``vd`` command line (typer), above the recorder, the replayer and the workflow: it parses arguments,
calls `vd.recorder.record`, `vd.replayer.replay`, `vd.replayer.diff`, `vd.workflow` and `vd.store`, prints,
and decides the exit code (`vd.cli.common`). Nothing below imports it."""

from vd.cli.app import app, main

# isort: split
from vd.cli import (
    cache,  # noqa: F401  (registers vd cache info|clear)
    locate,  # noqa: F401  (registers vd locate)
    team,  # noqa: F401  (registers refresh, history and status, listed after app's commands)
    warm,  # noqa: F401  (registers vd warm)
)

__all__ = ["app", "main"]
