"""The golden's side of one K's comparison (`vd.compare.compare_run`): its step log, how many rows of
each kind it holds, which of a candidate's rows differ from its own, and its rows where they do.

* `InMemory`: the golden's rows are at hand (a golden read whole, a `vd diff`, or a golden written
  before row digests, whose rows a GPU replay reads beside the run: `vd.reader`); a candidate row
  differs where its bits do.
* `ByDigest`: the golden stores each row's digest and statistics (`vd.digest`, format 3): a candidate
  row differs where its digest does, and the golden's rows are read from disk only for the rows that
  differ, after the run. A replay of a passing golden reads no rows at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch

from vd.digest import digest, stats_dict, stats_tensor
from vd.golden import KLog, KRecord, Source, check_digests, int_bits, to_tensor

_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per CUDA device for the process, shared by the golden's reader and the queued
    comparison (`vd.reader`, `vd.compare.Queued`): its cached GPU memory is reused."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def int_view(t: torch.Tensor) -> torch.Tensor:
    """A logits tensor viewed as signed integers of its width: equal bits, equal integers."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def step_rows(kind: str, step: int | None, k: int, counts: Mapping[str, int]) -> np.ndarray:
    """The rows of ``kind`` that step ``step`` computed (None: the prefill's, or the bootstrap row)."""
    if kind == "prefill":
        return np.arange(counts["prefill"])
    if kind == "verify":
        return np.arange(step * k, step * k + k)
    return np.array([0]) if step is None else np.arange(1 + step * (k - 1), 1 + (step + 1) * (k - 1))


class Gold:
    """One K of a golden as a comparison needs it. ``counts``: rows per kind (prefill, verify and, for
    the drafter feed, draft), laid out as `vd.golden.KRecord.rows_by_kind`."""

    k: int
    tokens: np.ndarray  # int32 [S, K]
    accepted: np.ndarray  # int32 [S]
    counts: dict[str, int]
    vocab: int

    @property
    def steps(self) -> int:
        return int(self.accepted.shape[0])

    def differ(self, got: torch.Tensor) -> torch.Tensor:
        """Which candidate rows differ from the golden's: ``got`` is ``[R, V]``, every kind's rows in
        `counts`' order; a bool ``[R]`` on its device (nothing read back)."""
        raise NotImplementedError

    def stats(self, kind: str, device: torch.device) -> dict[str, np.ndarray]:
        """The golden's statistics of every row of ``kind`` (`vd.digest.STATS`, by name)."""
        raise NotImplementedError

    def figures(self, kind: str, device: torch.device) -> dict[str, float]:
        """What a report says of the golden's rows of ``kind`` (its largest |logit|, its smallest top-1/
        top-2 margin, its median top-1 probability: `vd.policy.sensitivity` reads them), made once."""
        cache = getattr(self, "_figures", None)
        if cache is None:
            cache = self._figures = {}
        if kind not in cache:
            st = self.stats(kind, device)
            cache[kind] = {"golden_max_abs": float(np.nanmax(st["absmax"], initial=0.0)),
                           "golden_min_margin": float(np.nanmin(st["margin"], initial=np.inf)),
                           "golden_median_top1_p": _median(st["top1_p"])}
        return cache[kind]

    def prepare(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        """Make ahead of a comparison on ``device`` what it needs of the golden (a reader runs this in the
        GPU's idle time during a run: `vd.reader`): its figures, and what `differ` compares on the device
        (uploaded on ``stream``, a side stream, if given)."""
        for kind in self.counts:
            self.figures(kind, device)

    def rows(self, kind: str, idx: np.ndarray, device: torch.device) -> torch.Tensor:
        """The golden's rows ``idx`` of ``kind`` as integer bits ``[len(idx), V]`` on ``device``."""
        return torch.from_numpy(int_bits(self.host_rows(kind, idx))).to(device)

    def host_rows(self, kind: str, idx: np.ndarray) -> np.ndarray:
        """The golden's rows ``idx`` of ``kind`` as stored (``[len(idx), V]``)."""
        raise NotImplementedError


class InMemory(Gold):
    """A golden K whose rows are all at hand (``device``: some of them already on the replay's device as
    integer bits, `vd.golden.Golden.device_rows`)."""

    def __init__(self, record: KRecord, device: Mapping[str, torch.Tensor] | None = None):
        self.record, self.k, self.tokens, self.accepted = record, record.k, record.tokens, record.accepted
        self.arrays = record.rows_by_kind()
        self.counts = {n: a.shape[0] for n, a in self.arrays.items()}
        self.vocab = record.logits.shape[-1]
        self._device = dict(device or {})
        self._stats: dict[str, dict[str, np.ndarray]] = {}
        if record.stats is not None:
            self._stats = _by_kind(record.stats, self.counts)

    def _on(self, kind: str, device: torch.device) -> torch.Tensor:
        g = self._device.get(kind)
        if g is None or g.device != device:
            g = self._device[kind] = torch.from_numpy(int_bits(self.arrays[kind])).to(device)
        return g.reshape(-1, self.vocab)

    def differ(self, got):
        parts, at = [], 0
        for kind, n in self.counts.items():
            parts.append((self._on(kind, got.device) != int_view(got[at:at + n])).any(dim=1))
            at += n
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def stats(self, kind, device):
        if kind not in self._stats:  # a golden without stored statistics: computed from its rows
            rows = self._on(kind, device).view(to_tensor(self.arrays[kind][:0]).dtype)
            self._stats[kind] = stats_dict(stats_tensor(rows).cpu().numpy())
        return self._stats[kind]

    def rows(self, kind, idx, device):
        return self._on(kind, device)[torch.from_numpy(np.asarray(idx, dtype=np.int64)).to(device)]

    def host_rows(self, kind, idx):
        return self.arrays[kind][idx]


class ByDigest(Gold):
    """A golden K known by its rows' digests and statistics (``digests``: int64 ``[R, LANES]``; ``stats``:
    float64 ``[R, len(STATS)]``; every kind's rows in order), with ``load(kind, idx)`` to read rows from
    its store when they are needed. A row read is checked against its stored digest: one that disagrees
    (its golden corrupt, or edited without `vd.golden.rewrite_summaries`) raises `GoldenCorruptError`
    naming ``where`` (the K's group) rather than be taken for a candidate's difference."""

    def __init__(self, log: KLog, counts: Mapping[str, int], vocab: int, digests: np.ndarray,
                 stats: np.ndarray, load: Callable[[str, np.ndarray], np.ndarray], where: str = "golden"):
        self.k, self.tokens, self.accepted = log.k, log.tokens, log.accepted
        self.counts, self.vocab, self.digests, self._load = dict(counts), vocab, digests, load
        self.where = where
        self._first = dict(zip(self.counts, np.cumsum([0, *self.counts.values()]).tolist()))  # a kind's first row
        self._stats = _by_kind(stats, self.counts)
        self._device: tuple[torch.Tensor, torch.cuda.Event | None] | None = None  # `_upload`

    @classmethod
    def of(cls, src: Source, k: int, log: KLog, digests: np.ndarray, stats: np.ndarray) -> ByDigest:
        """K of the golden ``src`` (its step log as checked, its digests and statistics), its rows read
        from the store where asked for (`vd.reader.read_rows`)."""

        def load(kind: str, idx: np.ndarray) -> np.ndarray:
            from vd.reader import read_rows  # the reader builds on this module

            return read_rows(src, k, kind, idx)

        return cls(log, src.counts(k), src.meta["vocab_size"], digests, stats, load, src.where(k))

    def prepare(self, device, stream=None):
        super().prepare(device, stream)
        self._upload(device, stream)

    def _upload(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """The stored digests on ``device`` as float64 (what `vd.digest.digest` computes), uploaded once:
        on ``stream`` from page-locked memory, the copy awaited by the stream that compares."""
        if self._device is None or self._device[0].device != device:
            host = torch.from_numpy(self.digests.astype(np.float64))
            if stream is None:
                self._device = (host.to(device), None)
            else:
                with torch.cuda.stream(stream):
                    on = host.pin_memory().to(device, non_blocking=True)
                    self._device = (on, stream.record_event())
        on, ready = self._device
        if ready is not None:
            torch.cuda.current_stream(device).wait_event(ready)
            on.record_stream(torch.cuda.current_stream(device))
            self._device = (on, None)
        return on

    def differ(self, got):
        return (digest(got) != self._upload(got.device)).any(dim=1)

    def stats(self, kind, device):
        return self._stats[kind]

    def host_rows(self, kind, idx):
        idx = np.asarray(idx, dtype=np.int64)
        rows = self._load(kind, idx)
        check_digests(digest(torch.from_numpy(int_bits(rows))).numpy(), self.digests[self._first[kind] + idx],
                      self.where, lambda i: f"{kind} row {int(idx[i])}")
        return rows


def _median(a: np.ndarray) -> float:
    """`np.nanmedian` of a one-dimensional array, as numpy computes it (the middle value, or the mean of
    the two in the array's dtype) without its overhead (5 against 72 us for 64 rows on the 2-core
    machines); 0.5 for no rows, NaN when every value is NaN."""
    kept = np.sort(a[~np.isnan(a)])
    n = kept.size
    if not n:
        return 0.5 if not a.size else float("nan")
    return float(kept[n // 2]) if n % 2 else float((kept[n // 2 - 1] + kept[n // 2]) / 2)


def _by_kind(stats: np.ndarray, counts: Mapping[str, int]) -> dict[str, dict[str, np.ndarray]]:
    """Stored statistics ``[R, len(STATS)]`` split by kind (rows in `counts`' order), by name."""
    out, at = {}, 0
    for kind, r in counts.items():
        out[kind] = stats_dict(stats[at:at + r].T)
        at += r
    return out
