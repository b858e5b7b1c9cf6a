"""Where a golden lives: a directory, a zip file or an object-store prefix, behind one small protocol.

`locate` turns what a user typed into a `Location`:

* a path ending in ``.zip``: a `ZipFile`, read and written through zarr's ``ZipStore`` (written once,
  complete, then read; the zip spec leaves no room for a rewrite in place);
* ``s3://bucket/prefix``: an `ObjectPrefix`, through zarr's ``FsspecStore`` and s3fs, credentials and
  endpoint from the usual AWS environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_ENDPOINT_URL``, ``AWS_REGION``);
* anything else: a `Directory`.

A location reads single keys (`Location.get`), all from the one version it found at its first read, and
publishes a golden staged in a local directory (`Location.publish`): a new golden appears at once and
complete (a rename for a directory or a zip file: `vd.store.local`), or, on an object store where nothing
renames, behind a placeholder root written first and the real root written last (`vd.store.objects`), so a
partial upload never opens as a golden. What a golden's keys mean is left to `vd.store.format`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from zarr.abc.store import Store

from vd.errors import UsageError
from vd.preflight import check_named, golden_meta, peek
from vd.store.local import Directory, ZipFile
from vd.store.objects import ObjectPrefix

__all__ = ["Directory", "Location", "ObjectPrefix", "ZipFile", "locate", "root_meta"]


@runtime_checkable
class Location(Protocol):
    """Where a golden's keys live (``zarr.json``, ``k2/logits.hi/c/0/0/0``, ...)."""

    url: str  # as the user gave it

    def get(self, key: str) -> bytes | None:
        """One key's bytes; None when it does not exist."""

    def store(self) -> Store:
        """A read-only zarr store over the golden."""

    def state(self) -> str:
        """``absent`` (nothing there), ``golden`` (a vd golden, complete or not), ``partial`` (an object-store
        publish under way or interrupted: no golden to lose) or ``other``."""

    def staging(self) -> Path:
        """A new local directory to write a golden into before `publish`."""

    def publish(self, staged: Path, replace: bool) -> None:
        """Put the complete golden staged at ``staged`` here (replacing one with ``replace``), and remove
        ``staged``."""

    def nbytes(self) -> int:
        """Bytes the golden takes where it is stored."""

    def sizes(self) -> dict[str, int] | None:
        """Every key's size in bytes (a folder's `vd.store.manifest.DIRECTORY`, where the listing shows folders), or
        None where listing them is not cheap."""

    def writer(self) -> contextlib.AbstractContextManager:
        """Held for a whole recording or refresh: the only writer of this golden (`vd.store.atomic`); another
        process's refused at once (`vd.errors.GoldenBusyError`)."""

    def wait_writer(self, timeout: float) -> bool:
        """Wait until no other process writes this golden, ``timeout`` seconds at most: whether none does now."""

    def close(self) -> None:
        """Let go of the version read so far (a later read opens the one then at the location)."""


def root_meta(where: str) -> Mapping[str, Any] | None:
    """The vd metadata of the golden at ``where`` read without opening it: a local golden's (`vd.preflight.peek`),
    or an s3:// prefix's root document as it is now (one GET); None where no golden is there."""
    if "://" not in where:
        return peek(where).meta
    location = locate(where)
    doc = location.root() if isinstance(location, ObjectPrefix) else None
    return None if doc is None else golden_meta(doc, where)


def locate(where: str | os.PathLike) -> Location:
    """The location a path or URL names."""
    text = check_named(os.fspath(where))
    if "://" in text:
        scheme = text.split("://", 1)[0]
        if scheme != "s3":
            raise UsageError(f"{text}: unsupported URL scheme {scheme!r} (goldens live in a directory, a .zip "
                             "file or under s3://bucket/prefix)")
        return ObjectPrefix(text)
    if text.endswith(".zip"):
        return ZipFile(Path(text))
    return Directory(Path(text))
