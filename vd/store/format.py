"""The golden format (FORMAT.md is the reference): its version, array names and shapes, how rows are
encoded, and where each row of a K lives in which array.

A golden is a zarr v3 group: ``prompt``, and per verify width a group ``k<K>`` holding the step log
(``tokens``, ``accepted``; ``drafts`` for the drafter feed), every row's digest and
statistics (``digests``, ``stats``) and the row arrays (``prefill``, ``logits``; ``bootstrap_logits``,
``draft_logits`` for the drafter feed).

Since format 4 a row array is stored as two byte planes, both plain zarr arrays of uint8: ``<name>.hi``,
every value's most significant byte (sign and exponent: few distinct values, zstd-1 shrinks it about 4x
on real logits), and ``<name>.lo``, the rest of each value's bytes (mantissa: close to random, stored as
it is), shape ``[..., itemsize - 1]``. The value's little-endian bytes are ``lo`` then ``hi``. A chunk of
either carries a CRC32C. Formats 1 to 3 stored a row array as one array of the storage dtype. This
module leaves out I/O: `vd.store.write` and `vd.store.read` use it.

Since format 5 what differs between two recordings of the same numbers (when and where it ran, each step's
time, the model file's local path) is kept apart from what a review diffs: the root ``zarr.json`` holds
only what the numbers depend on and the golden's history, a ``run`` group's ``zarr.json`` the rest
(`split_volatile`, `join_volatile`), so re-recording unchanged logits leaves every file but ``run/``
byte for byte as it was. Formats 1 to 4 kept them all in the root (and ``step_ms`` arrays in each K).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np
from zarr.codecs import Crc32cCodec, ZstdCodec

from vd import digest as _digest
from vd.chunkfiles import split_planes as split_planes  # (the writer processes' too)
from vd.dtypes import DTYPES
from vd.layout import RowLayout, StepLog
from vd.preflight import FORMAT as FORMAT  # the root metadata's format name (read without zarr there)
from vd.preflight import stored_rows as stored_rows  # (whether a golden stores its rows: asked there too)

FORMAT_VERSION = 7
VOLATILE_SINCE = 5  # the first format keeping volatile facts in the ``run`` group
MANIFEST_SINCE = 6  # the first format listing every file's size and hash in a manifest (`vd.store.manifest`)
DECODE_SINCE = 7  # the first format storing the greedy continuation's one-token decode rows
# The decode rows are laid out as a recording at K = 1 (a step of one token is a one-token decode), in the group
# of that K; no verify width is 1 (they are 2 and up), so the group is the decode rows' alone.
DECODE_K = 1
RUN_GROUP = "run"
# A compiled forward's recording keeps the Inductor artifacts it compiled (`torch.compiler.save_cache_artifacts`)
# here, described by the metadata's ``compiled`` field; a replay loads them before it compiles, so it runs the
# kernels the recording ran (Inductor otherwise picks some kernel configurations by timing them, which
# differs from machine to machine).
INDUCTOR_ARTIFACTS = "inductor/artifacts.bin"
# A recording with ``--trace`` stores, per K, each traced module's output digests and statistics row by row
# (`vd.tracing`; the metadata's ``trace`` lists the points).
TRACE_DIGESTS, TRACE_STATS = "trace_digests", "trace_stats"
PLANES_SINCE = 4  # the first format storing row arrays as byte planes
DIGESTS_SINCE = 3  # the first format storing each row's digest and statistics
# About how much of the prefill's raw rows one chunk holds. The prefill is written once and read only where
# its rows differ; large chunks keep the last chunk's padding (stored whole, its low plane uncompressed) small.
PREFILL_CHUNK_BYTES = 8 << 20

# The metadata a writer makes anew for every golden it writes (a golden made from another leaves them out).
WRITTEN = ("complete", "format", "format_version", "created", "digest", "logs", "prompt_tokens", "rows", "logits",
           "content_digest", "manifest", "golden_id")
STEP_LOG = ("tokens", "accepted", "step_ms")  # a K's step log arrays (``step_ms`` before format 5)
SUMMARY = ("digests", "stats")  # a K's per-row digests and statistics
ROW_ARRAYS = {"prefill": ("prefill",), "verify": ("logits",), "draft": ("bootstrap_logits", "draft_logits")}


def decode_meta(steps: int, forward: str, decode_forward: str | None) -> dict:
    """A golden's ``decode`` metadata: its decode group's ``steps``, and the forward that computed its rows where
    that is another than the golden's ``forward`` (`vd record --decode-forward`; never equal to it)."""
    return {"steps": steps, **({"forward": decode_forward} if decode_forward not in (None, forward) else {})}


def row_array_names(drafted: bool) -> list[str]:
    """The row arrays a K group holds."""
    return [n for kind in ("prefill", "verify", *(["draft"] if drafted else [])) for n in ROW_ARRAYS[kind]]


def planes(name: str) -> tuple[str, str]:
    """The two plane arrays (high byte, other bytes) storing row array ``name`` since format 4."""
    return f"{name}.hi", f"{name}.lo"


def hi_codecs() -> list:
    return [ZstdCodec(level=1), Crc32cCodec()]


def plain_codecs() -> list:
    """The low planes and the small arrays: values as they are, then a CRC32C."""
    return [Crc32cCodec()]


def join_planes(hi: np.ndarray, lo: np.ndarray, storage: np.dtype) -> np.ndarray:
    """The inverse of `split_planes`."""
    n = storage.itemsize
    if n == 2:
        return ((hi.astype("<u2") << 8) | lo[..., 0]).view(storage)
    b = np.empty((*hi.shape, n), dtype=np.uint8)
    b[..., -1], b[..., :-1] = hi, lo
    return b.view(storage).reshape(hi.shape)


def prefill_chunks(prompt: int, vocab: int, itemsize: int) -> int:
    """Prefill rows to a chunk: about `PREFILL_CHUNK_BYTES` of raw values (at least one row), spread
    evenly over as few chunks as that allows (zarr stores the last chunk whole)."""
    most = max(1, PREFILL_CHUNK_BYTES // max(1, vocab * itemsize))
    n = -(-prompt // most)
    return max(1, -(-prompt // max(1, n)))


def row_shapes(layout: RowLayout, vocab: int) -> dict[str, tuple[int, ...]]:
    """Each row array's shape (in values, not planes)."""
    s, k = layout.steps, layout.k
    out = {"prefill": (layout.prompt, vocab), "logits": (s, k, vocab)}
    if layout.drafted:
        out.update(bootstrap_logits=(1, vocab), draft_logits=(s, k - 1, vocab))
    return out


def row_chunks(layout: RowLayout, vocab: int, itemsize: int) -> dict[str, tuple[int, ...]]:
    """Each row array's chunk shape: one step a chunk, the prefill about a megabyte a chunk."""
    k = layout.k
    out = {"prefill": (prefill_chunks(layout.prompt, vocab, itemsize), vocab), "logits": (1, k, vocab)}
    if layout.drafted:
        out.update(bootstrap_logits=(1, vocab), draft_logits=(1, k - 1, vocab))
    return out


def small_shapes(layout: RowLayout) -> dict[str, tuple[int, ...]]:
    """Each small array's shape: the step log, the drafter's drafts, the rows' digests and statistics."""
    s, k = layout.steps, layout.k
    out = {"tokens": (s, k), "accepted": (s,), "step_ms": (s,),
           "digests": (layout.total, _digest.LANES), "stats": (layout.total, len(_digest.STATS))}
    if layout.drafted:
        out["drafts"] = (s, k - 1)
    return out


SMALL_DTYPES: dict[str, np.dtype] = {
    "tokens": np.dtype("<i4"), "accepted": np.dtype("<i4"), "step_ms": np.dtype("<f8"),
    "drafts": np.dtype("<i4"), "digests": np.dtype("<i8"), "stats": np.dtype("<f8")}


def chunk_spans(layout: RowLayout, kind: str, start: int, n: int, vocab: int, itemsize: int
                ) -> list[tuple[str, int, int, int]]:
    """Where ``n`` rows of ``kind`` from the kind's row ``start`` are stored, whole chunks (the prefill's last
    may be short): (row array, chunk index, first row, end row), rows counted from ``start``. Rows that are
    not whole chunks are a ValueError."""
    if kind == "prefill":
        step = prefill_chunks(layout.prompt, vocab, itemsize)
        if start % step:
            raise ValueError(f"prefill rows from {start}: not on a chunk of {step}")
        return [("prefill", (start + a) // step, a, min(a + step, n)) for a in range(0, n, step)]
    if kind == "verify":
        k = layout.k
        if start % k or n % k:
            raise ValueError(f"verify rows {start}..{start + n}: not whole steps of {k}")
        return [("logits", (start + a) // k, a, a + k) for a in range(0, n, k)]
    out, a = [], 0
    if start == 0 and n:  # the draft kind: the bootstrap row, then K - 1 a step
        out, a = [("bootstrap_logits", 0, 0, 1)], 1
    w = layout.k - 1
    if (start + a - 1) % w or (n - a) % w:
        raise ValueError(f"draft rows {start}..{start + n}: not the bootstrap row and whole steps of {w}")
    return out + [("draft_logits", (start + b - 1) // w, b, b + w) for b in range(a, n, w)]


def from_arrays(arrays: Mapping[str, np.ndarray], vocab: int) -> dict[str, np.ndarray]:
    """Row arrays by name (`row_shapes`) as rows ``[R, V]`` by kind."""
    out = {"prefill": arrays["prefill"], "verify": arrays["logits"].reshape(-1, vocab)}
    if "draft_logits" in arrays:
        out["draft"] = np.concatenate([arrays["bootstrap_logits"], arrays["draft_logits"].reshape(-1, vocab)])
    return out


def row_address(layout: RowLayout, kind: str, i: int) -> tuple[str, int, int | None]:
    """Where row ``i`` of ``kind`` is stored: (row array, index along its first axis, index along its
    second axis or None for a two-dimensional array)."""
    if kind == "prefill":
        return "prefill", i, None
    if kind == "verify":
        return "logits", i // layout.k, i % layout.k
    if i == 0:
        return "bootstrap_logits", 0, None
    return "draft_logits", (i - 1) // (layout.k - 1), (i - 1) % (layout.k - 1)


def digest_meta(vocab, logical) -> dict | None:
    """The ``digest`` metadata entry for rows of this width and dtype; None if either is unusable."""
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1 or logical not in DTYPES:
        return None
    return _digest.meta(vocab, DTYPES[logical].storage.itemsize)


def logits_meta(logical: str) -> dict:
    """The ``logits`` metadata entry: the logical dtype and how its values are stored."""
    return {"dtype": logical, "encoding": DTYPES[logical].description,
            "planes": "high byte zstd-1, other bytes as they are (format 4)"}



def step_log_arrays(version: int) -> tuple[str, ...]:
    """The step log arrays a K group of this format version holds."""
    return STEP_LOG if version < VOLATILE_SINCE else STEP_LOG[:2]


VOLATILE_ENV = ("host", "time")


def split_volatile(meta: Mapping) -> tuple[dict, dict]:
    """A golden's metadata as (what the root ``zarr.json`` keeps, what the ``run`` group keeps): the time it
    was made, the host, each step's milliseconds and the model file's local path go to the second."""
    stable = dict(meta)
    env = dict(stable.get("environment") or {})
    model = dict(stable.get("model") or {})
    details = dict(model.get("details") or {})
    logs = {k: dict(e) for k, e in (stable.get("logs") or {}).items()}
    volatile = {"created": stable.pop("created", None),
                "environment": {key: env.pop(key, None) for key in VOLATILE_ENV},
                "model_source": details.pop("source", None),
                "step_ms": {k: e.pop("step_ms", []) for k, e in logs.items()}}
    if "environment" in stable:
        stable["environment"] = env
    if "model" in stable:
        stable["model"] = {**model, "details": details}
    if "logs" in stable:
        stable["logs"] = logs
    return stable, volatile


def join_volatile(stable: Mapping, volatile: Mapping) -> dict:
    """The inverse of `split_volatile`: the metadata as one mapping, as formats 1 to 4 stored it."""
    meta = dict(stable)
    meta["created"] = volatile.get("created")
    if isinstance(meta.get("environment"), Mapping):
        meta["environment"] = {**meta["environment"], **(volatile.get("environment") or {})}
    source = volatile.get("model_source")
    if source is not None and isinstance(meta.get("model"), Mapping):
        meta["model"] = {**meta["model"], "details": {**(meta["model"].get("details") or {}), "source": source}}
    step_ms = volatile.get("step_ms") or {}
    if isinstance(meta.get("logs"), Mapping):
        meta["logs"] = {k: {**e, "step_ms": step_ms.get(k, [])} if isinstance(e, Mapping) else e
                        for k, e in meta["logs"].items()}
    return meta


def content_digest(meta: Mapping, prompt: list[int], logs: Mapping[int, StepLog],
                   digests: Mapping[int, np.ndarray]) -> str:
    """What a golden's numbers are, as one ``sha256:`` digest: the model's and head's fingerprints, the prompt,
    each K's steps (``logs``: tokens, accept counts, bootstrap) and every row's digest (``digests`` by K). Where
    and when it was recorded, how its rows are stored, its format and whether it is slim do not enter it: a
    golden re-recorded with unchanged logits, its slim form and its migration have the same content digest."""
    basis = {"model": (meta.get("model") or {}).get("fingerprint"), "head": (meta.get("mtp") or {}).get("fingerprint"),
             "prompt": [int(t) for t in prompt], "dtype": (meta.get("logits") or {}).get("dtype"),
             "vocab": meta.get("vocab_size"), "feed": meta.get("feed", "reference"), "steps": meta.get("steps"),
             "logs": {str(k): {"tokens": log.tokens.tolist(), "accepted": log.accepted.tolist(),
                               "bootstrap": int(log.bootstrap), "decoded": log.decoded}
                      for k, log in sorted(logs.items())}}
    h = hashlib.sha256(json.dumps(basis, sort_keys=True).encode())
    for k in sorted(digests):
        h.update(f"k{k}".encode())
        h.update(np.ascontiguousarray(digests[k], dtype="<i8").tobytes())
    return f"sha256:{h.hexdigest()}"
