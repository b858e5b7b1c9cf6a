"""A recording's journal (``.NAME.journal`` beside the golden): what a recording has computed so far, so that
``vd record --resume`` can continue one a crash cut short and still write the golden an uninterrupted run
would have written, bit for bit.

msgpack frames appended as the recording goes: a header (the settings, the model's fingerprint, the prompt's
tokens, the greedy continuation), then one frame per row block written (``{"k", "s", "sha256"}``: the SHA-256
of a step's verify rows as stored, ``s`` None for the prefill), each K's ``{"k", "tokens", "accepted"}`` once
it is finished. A resume records again from the header's settings and checks every block it computes against
the journaled one: the same model on the same build computes the same rows, and a difference (another build,
a nondeterministic kernel) refuses the resume, naming the K and step, rather than publish a golden
made of two runs. A frame cut short by the crash is ignored. The journal is removed once the golden is
published or the recording ends in an error (a cut leaves it: Ctrl-C, a signal, a kill), and replaced by a
recording that does not resume.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import msgpack
import numpy as np

from vd.errors import GoldenError, UsageError, naming
from vd.preflight import MAX_META, read_regular


def path_for(target: Path) -> Path:
    return target.parent / f".{target.name}.journal"


def of_location(location) -> Path | None:
    """The journal a recording into ``location`` (a `vd.store.Location`) keeps: beside a directory or a zip
    file; None on an object store, which keeps none."""
    target = getattr(location, "target", None) or getattr(location, "path", None)  # a directory's, a zip's
    return None if target is None else path_for(target)


def damaged(path: Path, what: str) -> GoldenError:
    """The error for a journal that cannot be resumed from, saying how to start over."""
    return GoldenError(f"{path} is damaged ({what}): record afresh without --resume, which replaces it (or remove "
                       "it)")


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# The header's fields besides the settings (`vd.recorder.record`), each with its type test.
_HEADER = {"refresh": lambda v: isinstance(v, bool), "reason": lambda v: isinstance(v, str),
           "fingerprint": lambda v: isinstance(v, str), "settings": lambda v: isinstance(v, dict),
           "prompt": lambda v: isinstance(v, list) and all(_int(t) for t in v),
           "greedy": lambda v: isinstance(v, list) and all(_int(t) for t in v)}


def read(path: Path) -> tuple[dict, list[dict]]:
    """The header and frames of the journal at ``path`` (a last frame cut short by a crash left out), their
    fields' types checked: a damaged journal is refused naming it, never a traceback."""
    try:
        data = read_regular(path, str(path), limit=MAX_META)
    except GoldenError as e:
        raise damaged(path, str(e).removeprefix(f"{path} ")) from None
    if data is None:
        raise UsageError(f"nothing to resume: no journal {path} (a recording that was cut short leaves one)")
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    frames = []
    try:
        for frame in unpacker:
            frames.append(frame)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise damaged(path, f"not readable msgpack: {e}") from e
    if not frames or not isinstance(frames[0], dict) or frames[0].get("journal") != 1:
        raise damaged(path, "no vd journal header")
    header = frames[0]
    for key, test in _HEADER.items():
        if not test(header.get(key)):
            raise damaged(path, f"header field {key!r} is {header.get(key)!r}")
    blocks = [f for f in frames[1:] if isinstance(f, dict)]
    for f in blocks:
        if "sha256" in f and not (_int(f.get("k")) and (f.get("s") is None or _int(f["s"]))
                                  and isinstance(f["sha256"], str)):
            raise damaged(path, f"a block frame is {f!r}")
    return header, blocks


def differs(k: int, s: int | None) -> GoldenError:
    """The error for a block computed again that is not the journaled one."""
    where = "the prefill" if s is None else f"step {s}"
    return GoldenError(f"the resumed recording differs from its journal at K={k}, {where}: another model, build or a "
                       "nondeterministic kernel; record afresh (without --resume)")


class Journal:
    """Appends frames to the journal at ``path`` (thread-safe: the writer threads append); with ``expected``
    (a resumed recording's journal frames), checks each block against its journaled digests."""

    def __init__(self, path: Path, header: Mapping, expected: list[dict] | None = None):
        self.path, self.lock = path, threading.Lock()
        if any("digests" in f for f in expected or ()):  # row digests: what vd wrote before the SHA-256
            raise GoldenError(f"{path} was written by an earlier vd, which journaled other figures; record afresh "
                              "(without --resume)")
        self.expected = {(f["k"], f.get("s")): f["sha256"] for f in expected or () if "sha256" in f}
        self.checked = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        # A new recording's journal replaces a stale one; appended to (O_APPEND), as the recording's writer
        # processes append their blocks' frames too (`vd.chunkfiles`), each frame one write.
        self.file = open(path, "ab", buffering=0)
        self.file.truncate(0)
        self._append({"journal": 1, **header})

    def _append(self, frame: Mapping) -> None:
        with self.lock, naming(self.path):
            self.file.write(msgpack.packb(dict(frame), use_bin_type=True))

    @staticmethod
    def digest(stored: np.ndarray, into=None):
        """The SHA-256 of rows as stored (``into``: a hash to update, for a block written in parts)."""
        h = hashlib.sha256() if into is None else into
        h.update(np.ascontiguousarray(stored).data)  # lets go of the interpreter lock
        return h

    def block(self, k: int, s: int | None, digest: str) -> None:
        """Rows of K's step ``s`` (None: the prefill) were written; ``digest``: their SHA-256 as stored
        (`digest`)."""
        want = self.expected.get((k, s))
        if want is not None:
            if want != digest:
                raise differs(k, s)
            self.checked += 1
        self._append({"k": k, "s": s, "sha256": digest})

    def finished(self, k: int, tokens: np.ndarray, accepted: np.ndarray) -> None:
        self._append({"k": k, "tokens": tokens.tolist(), "accepted": accepted.tolist()})

    def close(self, remove: bool) -> None:
        self.file.close()
        if remove:
            os.unlink(self.path)
