"""What a golden stores about each logits row besides its bytes: a digest (a few integers), so a replay
can tell which of its rows equal the golden's without reading the golden's rows, and the row's
statistics (`STATS`), which a report and its decision checks use.

A row's bytes are read as little-endian signed 16-bit words ``x_0 .. x_{n-1}`` (``n`` is the row's
width for bfloat16 and float16, twice it for float32). Its digest is ``LANES`` integers

    d_l = sum_j x_j * w[j, l]        (exact: no rounding, no wrap-around)

with fixed pseudo-random weights ``w[j, l]`` in ``[0, 2**bits)`` (SplitMix64 of ``j * LANES + l + 1``,
top ``bits`` bits; `weights`). Every product and every partial sum is an integer below 2**53 in
magnitude (``bits`` is chosen from ``n`` so that ``n * 2**15 * 2**bits <= 2**53``), so the sums are exact
in float64 whatever order a matrix multiply adds them in: the CPU's BLAS and cuBLAS give the same
digest bit for bit, and a row computed on a GPU digests as its stored copy does on the CPU.

Two rows with the same digest: for two different rows, each lane's sums agree for at most one value of
any one weight where the rows differ, so over weights drawn at random the chance is at most
``2**-(bits * LANES)`` (2**-120 for vocabularies up to 2**18 words). The weights here are fixed, not
drawn per golden: that bound holds for changes that do not depend on them (a kernel, a build, a
machine), not for rows crafted to collide. A replay compares digests first and reads, measures and
judges the golden's rows only where the digests differ (`vd.replayer.judge`); "byte for byte" means: equal
digests, and for rows whose digests differ, their bytes.

On the GPU a digest is one conversion and one float64 matrix multiply per block of rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from vd.streams import Behind

SCHEME = "vd-linear-int16-f64/1"  # what `weights` and `digest` compute; stored in a golden's metadata
LANES = 6
MAX_BITS = 20
BLOCK_BYTES = 1 << 25  # rows converted to float64 at a time on a GPU: at most 32 MB of them (26 rows of 152k words)
CPU_BLOCK_BYTES = 1 << 23  # and on the CPU, where the copies count in the process's peak memory: 8 MB
_CACHE: dict[tuple[int, str], torch.Tensor] = {}


def words(width: int, itemsize: int) -> int:
    """16-bit words in a row of ``width`` values of ``itemsize`` bytes."""
    return width * itemsize // 2


def bits_for(n: int) -> int:
    """The weight width for rows of ``n`` words: the largest (at most `MAX_BITS`) that keeps every sum
    exact in float64."""
    b = min(MAX_BITS, 38 - max(1, math.ceil(math.log2(max(n, 2)))))
    if b < 8:
        raise ValueError(f"rows of {n} 16-bit words are too wide to digest exactly")
    return b


def meta(width: int, itemsize: int) -> dict:
    """The golden metadata entry (``digest``) that names this scheme for rows of ``width`` values."""
    n = words(width, itemsize)
    return {"scheme": SCHEME, "lanes": LANES, "bits": bits_for(n), "words": n}


def _splitmix64(i: np.ndarray) -> np.ndarray:
    z = i * np.uint64(0x9E3779B97F4A7C15)  # uint64 arrays wrap modulo 2**64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def weights(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The ``[n, LANES]`` float64 weights for rows of ``n`` words, on ``device`` (made once per process
    and device, then cached)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # one cache entry for "cuda" and "cuda:0"
        device = torch.device("cuda", torch.cuda.current_device())
    key = (n, str(device))
    if key not in _CACHE:
        with np.errstate(over="ignore"):
            z = _splitmix64(np.arange(1, n * LANES + 1, dtype=np.uint64))
        w = (z >> np.uint64(64 - bits_for(n))).astype(np.float64).reshape(n, LANES)
        _CACHE[key] = torch.from_numpy(w).to(device)
    return _CACHE[key]


def block_bytes(device: torch.device) -> int:
    """How many bytes of float copies of rows one block of work on ``device`` may make."""
    return BLOCK_BYTES if device.type == "cuda" else CPU_BLOCK_BYTES


def digest(rows: torch.Tensor) -> torch.Tensor:
    """The digests ``[R, LANES]`` (float64, exact integers) of logits rows ``[R, V]`` of any dtype,
    computed on their device (nothing read back)."""
    x = rows.reshape(rows.shape[0], -1).contiguous().view(torch.int16)
    w = weights(x.shape[1], x.device)
    block = max(1, block_bytes(x.device) // (8 * x.shape[1]))
    if x.shape[0] <= block:
        return x.to(torch.float64) @ w
    return torch.cat([x[i:i + block].to(torch.float64) @ w for i in range(0, x.shape[0], block)])


STATS = ("argmax", "top1", "margin", "absmax", "top1_p")  # a golden's statistics of each row, in order


def stats_tensor(rows: torch.Tensor) -> torch.Tensor:
    """Per row of logits ``[R, V]`` (any float dtype): argmax, top-1 value, top-1/top-2 margin, largest
    |logit| and top-1 probability, as one float64 tensor ``[len(STATS), R]`` on the rows' device. A
    golden stores them for its rows (a replay's report and decision checks use them without reading the
    rows: `vd.replayer.judge`). Computed a bounded block of rows at a time (`block_bytes`): each block makes a
    few float32 copies of itself, which on the CPU count in the process's peak memory."""
    block = max(1, block_bytes(rows.device) // (8 * max(1, rows.shape[1])))
    if rows.shape[0] > block:
        return torch.cat([stats_tensor(rows[i:i + block]) for i in range(0, rows.shape[0], block)], dim=1)
    g = rows.float()
    top = g.topk(min(2, g.shape[1]), dim=1).values
    return torch.stack([g.argmax(1).double(), top[:, 0].double(), (top[:, 0] - top[:, -1]).double(),
                        g.abs().amax(1).double(), (1.0 / torch.exp(g - top[:, :1]).sum(1)).double()])


def argmax_rows(rows: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (int64, on the rows' device): `stats_tensor`'s first statistic without the others (a
    dtype's values convert to float32 exactly, so the first largest value is the same index either way)."""
    return rows.argmax(dim=1)


def stats_dict(stacked: np.ndarray) -> dict[str, np.ndarray]:
    """Statistics ``[len(STATS), R]`` by name (argmax as int64, the rest float32)."""
    out = {n: stacked[i].astype(np.float32) for i, n in enumerate(STATS)}
    out["argmax"] = stacked[0].astype(np.int64)
    return out


def summarise(rows: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> tuple[np.ndarray, np.ndarray]:
    """What a golden stores about rows per kind (logits ``[R, V]`` on any device, every kind's in order; a
    kind may be given as a list of consecutive row blocks, a run's steps, which are never joined whole):
    their digests (int64 ``[R, LANES]``) and statistics (float64 ``[R, len(STATS)]``), computed on the rows'
    device a block at a time (so the float copies stay bounded whatever the number of rows) and read back
    once."""
    both = _on_device(rows)
    return _split(np.zeros((0, LANES + len(STATS))) if both is None else both.cpu().numpy())


def _on_device(rows: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]) -> torch.Tensor | None:
    """`summarise`'s digests and statistics side by side, ``[R, LANES + len(STATS)]`` float64 on the rows'
    device (None for no rows)."""
    parts = [t for v in rows.values() for t in ([v] if isinstance(v, torch.Tensor) else v) if t.shape[0]]
    if not parts:
        return None
    per_block = max(1, block_bytes(parts[0].device) // (8 * words(parts[0].shape[1], parts[0].element_size())))
    return torch.cat([torch.cat([digest(b), stats_tensor(b).T], dim=1) for b in _blocks(parts, per_block)])


def _split(both: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return both[:, :LANES].astype(np.int64), np.ascontiguousarray(both[:, LANES:])


class Summary:
    """`summarise` of a run whose rows come a block at a time (`add`, each kind's in order), so they need not
    all be held: each block is summarised as it comes, and `result` joins them in layout order. On CUDA the
    last block can be queued on a stream (`queue`) behind work still running, and read back at `result`."""

    def __init__(self, kinds: Sequence[str]):
        self._parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {kind: [] for kind in kinds}
        self._queued: tuple[dict[str, int], Behind] | None = None

    def add(self, rows: Mapping[str, torch.Tensor]) -> None:
        """The next rows of each kind given (one read-back for them all)."""
        rows = {kind: t for kind, t in rows.items() if t.shape[0]}
        if rows:
            self._keep({kind: t.shape[0] for kind, t in rows.items()}, summarise(rows))

    def queue(self, device: torch.device, rows: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        """`add` the last rows (``rows()``, on GPU ``device``, gathered there too) on the device's side stream,
        behind the work queued so far (`vd.streams.Behind`), read back at `result`."""
        counts = {}

        def both() -> torch.Tensor:
            given = {kind: t for kind, t in rows().items() if t.shape[0]}
            counts.update({kind: t.shape[0] for kind, t in given.items()})
            out = _on_device(given)
            return out if out is not None else torch.zeros((0, LANES + len(STATS)), dtype=torch.float64, device=device)

        self._queued = (counts, Behind(device, both))

    @property
    def queued(self) -> bool:
        """Whether rows were `queue`d and not read back yet."""
        return self._queued is not None

    def _keep(self, counts: Mapping[str, int], summary: tuple[np.ndarray, np.ndarray]) -> None:
        at = 0
        for kind, n in counts.items():
            self._parts[kind].append((summary[0][at:at + n], summary[1][at:at + n]))
            at += n

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """Digests and statistics of every row added, in the order of the kinds given, then of adding."""
        if self._queued is not None:
            counts, behind = self._queued
            self._keep(counts, _split(behind.result()))
            self._queued = None
        parts = [p for ps in self._parts.values() for p in ps] or [_split(np.zeros((0, LANES + len(STATS))))]
        return np.concatenate([d for d, _ in parts]), np.concatenate([s for _, s in parts])


def _blocks(parts: Sequence[torch.Tensor], n: int) -> Iterator[torch.Tensor]:
    """The rows of ``parts`` in order, in blocks of at most ``n`` rows (small parts joined, large ones cut)."""
    pending: list[torch.Tensor] = []
    count = 0
    for t in parts:
        for i in range(0, t.shape[0], n):
            piece = t[i:i + n]
            if count + piece.shape[0] > n and pending:
                yield torch.cat(pending) if len(pending) > 1 else pending[0]
                pending, count = [], 0
            pending.append(piece)
            count += piece.shape[0]
    if pending:
        yield torch.cat(pending) if len(pending) > 1 else pending[0]
