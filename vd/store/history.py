"""A golden's history (``history`` in its metadata, since format 5): one entry per version, appended by each
recording and refresh, so a golden says why it holds the numbers it holds.

An entry records the reason given, when and by whom (user, host), with which vd, environment, model
fingerprint and forward, the version's content digest (`vd.store.format.content_digest`) and the previous
version's, and the change summary's headline lines. The history is part of what a review diffs: a refresh
shows as a new entry with its reason, even when no logit moved.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import socket
from collections.abc import Mapping, Sequence

import vd

# The environment facts an entry keeps (the full environment stays in the metadata).
_ENV = ("torch", "transformers", "device", "gpu_name", "cuda", "cpu_model", "cpu_capability", "onednn_isa")


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name (a container without a passwd entry)
        return "unknown"


def entry(meta: Mapping, content: str, *, reason: str, previous: Sequence[Mapping] = (),
          changes: Sequence[str] = ()) -> dict:
    """The history entry for a version with metadata ``meta`` and content digest ``content``, following
    ``previous`` (the golden's history so far)."""
    env = meta.get("environment") or {}
    last = previous[-1] if previous else None
    return {
        "version": len(previous) + 1,
        "reason": reason,
        "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "user": _user(),
        "host": socket.gethostname(),
        "vd": vd.__version__,
        "environment": {key: env.get(key) for key in _ENV if env.get(key) is not None},
        "fingerprint": (meta.get("model") or {}).get("fingerprint"),
        "head": (meta.get("mtp") or {}).get("fingerprint"),
        "forward": meta.get("forward"),
        "content_digest": content,
        "previous": None if last is None else last.get("content_digest"),
        "changes": list(changes),
    }


def lines(history: Sequence[Mapping]) -> list[str]:
    """The history as text, newest first (`vd history`)."""
    out = []
    for e in reversed(history):
        env = e.get("environment") or {}
        where = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers", "gpu_name", "cpu_model") if k in env)
        out.append(f"v{e.get('version')}  {e.get('time')}  {e.get('user')}@{e.get('host')}  {e.get('reason')}")
        out.append(f"    {e.get('content_digest')} (previous: {e.get('previous') or 'none'})")
        out.append(f"    forward {e.get('forward')}, vd {e.get('vd')}, {where}; model {e.get('fingerprint')}")
        out.extend(f"    - {c}" for c in e.get("changes") or ())
    return out
