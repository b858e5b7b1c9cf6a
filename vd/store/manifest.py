"""A golden's manifest and ID (since format 6): what binds every stored byte to the metadata.

At publish the writer lists every file of the golden with its size and SHA-256 (`build`) into the root
metadata's ``manifest``, then hashes the root metadata itself, manifest included, into the golden's ID
(`golden_id`, shown by ``vd show``). Two files stay out of the manifest: the root ``zarr.json``, which
carries it, and ``run/zarr.json``, the run's volatile facts (times, host, step timings), which no verdict
reads and which differ between two recordings of the same numbers.

Reading checks the ID against the metadata at open (an edited field, a changed bootstrap token, a
statistics table swapped for another: refused), the files' presence and sizes (`check_sizes`, cheap: a
missing or truncated file is refused before any model is loaded) and, off the step's path, every file's
hash (`check_hashes`: a flipped byte, a chunk from another golden, a row edited through zarr with its
checksum recomputed). SHA-256 runs at about 1.5 GB/s on this project's CPUs, so a 100 MB golden hashes in
tens of milliseconds, while a replay loads its model.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

from vd.chunkfiles import sha256 as _digest  # (the writer processes hash the files they write with it)
from vd.errors import GoldenCorruptError
from vd.preflight import check_member

# A location's `sizes` gives this for a folder (a golden's folders are not listed; one where a file is listed is
# named as a folder, not as missing).
DIRECTORY = -1
OUTSIDE = ("zarr.json", "run/zarr.json")  # the files the manifest does not list (see the module's docstring)
SCHEME = "sha256"


def file_digest(data: bytes) -> str:
    """A file's hash as the manifest lists it."""
    return _digest(data)


def build(staged: Path, known: Mapping[str, list] | None = None, listed: bool = True) -> dict[str, list]:
    """Every file of the golden staged at ``staged`` but `OUTSIDE`: ``{key: [size, sha256 hex]}``, by key.
    ``known``: files whose size and hash their writer remembered as it wrote them whole (taken where the
    file's size still agrees; every other file is read and hashed). ``listed`` False: ``known`` is every file
    (a `vd.store.write.GoldenWriter`'s, which writes them all), and the folder is not listed (on an H200
    host's disk a recording's 200 folders took 5-9 ms); a file that came there otherwise is not in the
    manifest, and reading the golden refuses it (`check_sizes`)."""
    known = known or {}
    if not listed:
        return {key: list(known[key]) for key in sorted(known) if key not in OUTSIDE}
    out = {}
    for key, path, size in sorted(_files(str(staged), "")):
        if key in OUTSIDE:
            continue
        if key in known and size == known[key][0]:
            out[key] = list(known[key])
            continue
        with open(path, "rb") as f:
            data = f.read()
        out[key] = [len(data), _digest(data)]
    return out


def _files(folder: str, prefix: str):
    """(key, path, size) of every file under ``folder`` (`os.scandir`: one call a folder, sizes included)."""
    with os.scandir(folder) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                yield from _files(e.path, f"{prefix}{e.name}/")
            elif e.is_file(follow_symlinks=False):
                yield f"{prefix}{e.name}", e.path, e.stat(follow_symlinks=False).st_size


def golden_id(meta: Mapping) -> str:
    """The golden's ID: SHA-256 of its root metadata (manifest included; the ID itself and the ``complete``
    flag left out), as canonical JSON."""
    body = {k: v for k, v in meta.items() if k not in ("golden_id", "complete")}
    return f"{SCHEME}:" + _digest(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


def check_meta(meta: Mapping, where: str) -> dict[str, list]:
    """The manifest of a golden whose metadata's ID is right; refuse one whose ID or manifest is malformed or
    whose metadata no longer hashes to its ID."""
    manifest = meta.get("manifest")
    if not isinstance(manifest, Mapping) or not all(
            isinstance(k, str) and isinstance(v, list) and len(v) == 2 and isinstance(v[0], int)
            and not isinstance(v[0], bool) and v[0] >= 0 and isinstance(v[1], str) for k, v in manifest.items()):
        raise GoldenCorruptError(f"{where}: metadata field 'manifest' is missing or malformed")
    for key in manifest:  # a listed name that leads outside the golden is read, or copied, from nowhere
        check_member(key, where)
    stored = meta.get("golden_id")
    if not isinstance(stored, str):
        raise GoldenCorruptError(f"{where}: metadata field 'golden_id' is missing or malformed: the metadata was "
                                 "edited or damaged after the golden was written")
    if stored != golden_id(meta):
        raise GoldenCorruptError(f"{where}: the metadata does not hash to the golden's ID {stored!r}: it was edited "
                                 "or damaged after the golden was written")
    return dict(manifest)


# The files a golden's writer makes (FORMAT.md): one of these missing from the manifest is the manifest's damage.
_OWN = re.compile(r"(prompt|k\d+(/[a-z_.]+)?)/(zarr\.json|c(/\d+)+)|inductor/artifacts\.bin")


def check_sizes(sizes: Mapping[str, int] | None, manifest: Mapping[str, list], where: str, get=None) -> None:
    """Every listed file present with its listed size (``sizes``: the location's files; None where a location
    cannot list them cheaply, and `check_hashes` finds the same later). ``get`` (a location's) reads a small
    file whose size is off, to say what happened to it where git did it (`_git`)."""
    if sizes is None:
        return
    for key, (size, digest) in manifest.items():
        if key not in sizes:
            parts = key.split("/")
            blocked = next((p for p in ("/".join(parts[:i]) for i in range(1, len(parts)))
                            if sizes.get(p, DIRECTORY) != DIRECTORY), None)  # a file where a folder of it goes
            raise GoldenCorruptError(f"{where}/{key} is missing" + (f": {where}/{blocked} is a file, not a folder"
                                                                     if blocked else ""))
        if sizes[key] == DIRECTORY:
            raise GoldenCorruptError(f"{where}/{key} is a directory, not the file the manifest lists")
        if sizes[key] != size:
            seen = get(key) if get is not None and sizes[key] <= _SMALL else None
            raise GoldenCorruptError(f"{where}/{key} has {sizes[key]} bytes; the manifest says {size}"
                                     + _git(seen, key, digest))
    extra = sorted(k for k in set(sizes) - set(manifest) - set(OUTSIDE) if sizes[k] != DIRECTORY)
    own = [k for k in extra if _OWN.fullmatch(k)]
    if own:  # a file of a name vd writes that the manifest leaves out: the manifest is what changed, not the folder
        raise GoldenCorruptError(f"{where}/{own[0]} is a golden's own file that its manifest does not list "
                                 f"({len(own)} such): the manifest was damaged or edited, and nothing in the golden "
                                 "can be trusted (remove nothing: record it again, or restore it)")
    if extra:  # (a Finder's .DS_Store, a .gitkeep): removing them gives back the golden as it was written
        others = f" and the {len(extra) - 1} other(s): {', '.join(extra[1:4])}{' ...' if len(extra) > 4 else ''}"
        raise GoldenCorruptError(f"{where}/{extra[0]} is not in the golden's manifest (a file added after it was "
                                 f"written; a golden holds only the files it lists: remove it"
                                 f"{others if len(extra) > 1 else ''})")


def check_hashes(get, manifest: Mapping[str, list], where: str) -> None:
    """Every listed file read through ``get`` (a location's) and checked against its size and hash."""
    for key, (size, digest) in manifest.items():
        data = get(key)
        if data is None:
            raise GoldenCorruptError(f"{where}/{key} is missing")
        if len(data) != size or _digest(data) != digest:
            raise GoldenCorruptError(f"{where}/{key} does not match the golden's manifest"
                                     + (_git(data, key, digest) or " (damaged, or replaced after the golden was "
                                                                   "written)"))


_SMALL = 64 * 1024  # a file this small whose size is off is read to say why (a document, an LFS pointer)
_LFS = b"version https://git-lfs.github.com/spec/v1"


def _git(data: bytes | None, key: str, digest: str) -> str:
    """Why a file's bytes are not the listed ones where git made them so (empty otherwise): a Git LFS pointer
    checked out in its place (LFS not installed, or a CI checkout without it), or a zarr document whose line
    endings were made CRLF (git's core.autocrlf, the default of Git for Windows, unless .gitattributes says
    ``eol=lf``)."""
    if not data:
        return ""
    if data.startswith(_LFS):
        to = "to it" if f"oid sha256:{digest}".encode() in data else "to other bytes than the manifest lists"
        return (f": it is a Git LFS pointer {to}, not the file; fetch the files (git lfs install, then git lfs "
                "pull; in GitHub Actions, actions/checkout with lfs: true)")
    if key.endswith("zarr.json") and b"\r\n" in data and _digest(data.replace(b"\r\n", b"\n")) == digest:
        return (": its line endings were made CRLF on checkout (git's core.autocrlf); add `goldens/**/zarr.json "
                "text eol=lf` to .gitattributes (README, 'Suites, pytest and reviewed refreshes'), remove the "
                "golden's folder and check it out again (git checkout -- PATH)")
    return ""
