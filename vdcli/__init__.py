"""The ``vd`` command line (typer), above the recorder, the replayer and the core package: it parses
arguments, calls `recorder.record`, `replayer.replay`, `replayer.diff` and `vd.store`, prints, and
decides the exit code. Nothing below imports it."""

from vdcli.app import app, main

__all__ = ["app", "main"]
