"""The ``vd`` command line (typer), above the recorder, the replayer and the core package: it parses
arguments, calls `vd.recorder.record`, `vd.replayer.replay`, `vd.replayer.diff` and `vd.store`, prints, and
decides the exit code. Nothing below imports it."""

from vd.cli.app import app, main

__all__ = ["app", "main"]
