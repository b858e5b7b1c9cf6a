"""One K of a golden as a comparison sees it (`GoldenSide`): its step log and row layout, each row's
digest and statistics, and its rows when they are needed.

A candidate row differs from the golden's where its digest does (`vd.digest`); the golden's rows are
read only for rows that differ, and each row read is checked against its own stored digest, so a golden
whose bytes were damaged or edited is refused rather than taken for a difference of the model's. A slim
golden (`vd slim`) has no rows to read: it says which rows differ and what their statistics are.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vd.digest import STATS, digest, stats_tensor
from vd.dtypes import DTYPES, int_bits
from vd.errors import GoldenCorruptError, GoldenError
from vd.layout import RowLayout, StepLog


class SlimGoldenError(GoldenError):
    """A golden's rows were asked for and it stores none (a slim golden replayed without ``--rows``)."""


def check_digests(computed: np.ndarray, stored: np.ndarray, where: str, name: Callable[[int], str]) -> None:
    """Refuse rows whose digests (``computed``, ``[R, LANES]``) disagree with the ``stored`` ones: the golden
    is damaged, or its rows were edited without their digests. ``name(i)`` names row ``i``."""
    bad = np.flatnonzero((computed != stored).any(axis=1))
    if bad.size:
        raise GoldenCorruptError(f"{where}/digests: {bad.size} row(s) disagree with the stored rows "
                                 f"(first: {name(int(bad[0]))})")


def stats_differ(stats: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """Rows whose statistics computed here disagree with the stored ones: argmax, top-1, margin and largest
    |logit| exactly (each a function of the row's values alone), the top-1 probability to 1e-4 relatively
    (a sum over the vocabulary, whose order differs between a GPU, where a recording computes it, and here)."""
    same = (stats == stored) | (np.isnan(stats) & np.isnan(stored))
    p = STATS.index("top1_p")
    with np.errstate(invalid="ignore"):
        same[:, p] |= np.isclose(stats[:, p], stored[:, p], rtol=1e-4, atol=0.0)
    return ~same.all(axis=1)


def median(a: np.ndarray) -> float:
    """`np.nanmedian` of a one-dimensional array (the middle value, or the mean of the two in the array's
    dtype) without its overhead; 0.5 for no rows, NaN when every value is NaN."""
    kept = np.sort(a[~np.isnan(a)])
    n = kept.size
    if not n:
        return 0.5 if not a.size else float("nan")
    return float(kept[n // 2]) if n % 2 else float((kept[n // 2 - 1] + kept[n // 2]) / 2)


class GoldenSide:
    """K's golden as a comparison needs it.

    ``digests`` (int64 ``[R, LANES]``) and ``stats`` (float64 ``[R, len(STATS)]``) hold every row's, in
    ``layout`` order; ``load(kind, idx)`` reads rows ``idx`` of ``kind`` as stored (None: a slim golden);
    ``where`` names the K's group in messages.
    """

    def __init__(self, log: StepLog, layout: RowLayout, vocab: int, digests: np.ndarray, stats: np.ndarray,
                 load: Callable[[str, np.ndarray], np.ndarray] | None, where: str, *, logical: str):
        self.log, self.layout, self.vocab, self.where, self.logical = log, layout, vocab, where, logical
        self.k, self.tokens, self.accepted = log.k, log.tokens, log.accepted
        self.counts = layout.counts
        self.digests, self._load, self._stored_stats = digests, load, stats
        self._stats = {kind: {n: part[:, i] for i, n in enumerate(STATS)} for kind, part in layout.split(stats).items()}
        for by in self._stats.values():
            top = by["argmax"]
            if not (np.isfinite(top) & (top >= 0) & (top < vocab) & (top == np.round(top))).all():
                raise GoldenCorruptError(f"{where}/stats: an argmax outside the vocabulary (0..{vocab - 1})")
            by["argmax"] = top.astype(np.int64)
        self._figures: dict[str, dict[str, float]] = {}
        self._device: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    @property
    def steps(self) -> int:
        return self.layout.steps

    @property
    def has_rows(self) -> bool:
        return self._load is not None

    def differ(self, got: torch.Tensor) -> torch.Tensor:
        """Which candidate rows ``got`` (``[R, V]``, every kind's in layout order) differ from the golden's:
        a bool ``[R]`` on their device, nothing read back."""
        return (digest(got) != self._digests_on(got.device)).any(dim=1)

    def differ_at(self, got: torch.Tensor, first: int) -> torch.Tensor:
        """`differ` for rows ``got`` that sit at flat positions ``first ..`` of the layout."""
        return (digest(got) != self._digests_on(got.device)[first:first + got.shape[0]]).any(dim=1)

    def stats(self, kind: str) -> dict[str, np.ndarray]:
        """The golden's statistics (`vd.digest.STATS`, by name) of every row of ``kind``."""
        return self._stats[kind]

    def figures(self, kind: str) -> dict[str, float]:
        """What a report says of the golden's rows of ``kind`` (`vd.policy.sensitivity` reads them)."""
        if kind not in self._figures:
            st = self._stats[kind]
            self._figures[kind] = {"golden_max_abs": float(np.nanmax(st["absmax"], initial=0.0)),
                                   "golden_min_margin": float(np.nanmin(st["margin"], initial=np.inf)),
                                   "golden_median_top1_p": median(st["top1_p"].astype(np.float32))}
        return self._figures[kind]

    def prepare(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        """Make ahead of a comparison on ``device`` what it needs: the report's figures, and the stored digests
        on the device (copied on ``stream``, a side stream, if given)."""
        for kind in self.counts:
            self.figures(kind)
        self._digests_on(device, stream)

    def _digests_on(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """The stored digests on ``device`` as float64 (what `vd.digest.digest` computes), copied once: on
        ``stream`` from page-locked memory, the copy awaited by the stream that compares."""
        if self._device is None or self._device[0].device != device:
            host = torch.from_numpy(self.digests.astype(np.float64))
            if stream is None:
                self._device = (host.to(device), None)
            else:
                with torch.cuda.stream(stream):
                    on = host.pin_memory().to(device, non_blocking=True)
                    self._device = (on, stream.record_event())
        on, ready = self._device
        if ready is not None and stream is None:
            torch.cuda.current_stream(device).wait_event(ready)
            on.record_stream(torch.cuda.current_stream(device))
            self._device = (on, None)
        return on

    def host_rows(self, kind: str, idx: np.ndarray) -> np.ndarray:
        """The golden's rows ``idx`` of ``kind`` as stored (``[len(idx), V]``), each checked against its
        stored digest."""
        if self._load is None:
            raise SlimGoldenError(f"{self.where}: the golden is slim (it stores no rows); name the full golden "
                                  "with --rows to measure its rows")
        idx = np.asarray(idx, dtype=np.int64)
        rows = self._load(kind, idx)
        first = self.layout.offset(kind)
        bits = torch.from_numpy(int_bits(rows))
        check_digests(digest(bits).numpy(), self.digests[first + idx], self.where,
                      lambda i: f"{kind} row {int(idx[i])}")
        # and the statistics a verdict reads without the rows (argmax, margin, ...): a golden resealed with them
        # edited to hide a flip is refused where its rows are read
        differ = stats_differ(stats_tensor(bits.view(DTYPES[self.logical].torch)).T.cpu().numpy(),
                              self._stored_stats[first + idx])
        if differ.any():
            raise GoldenCorruptError(f"{self.where}/stats: {int(differ.sum())} row(s) disagree with the stored rows "
                                     f"(first: {kind} row {int(idx[np.flatnonzero(differ)[0]])})")
        return rows

    def rows(self, kind: str, idx: np.ndarray, device: torch.device) -> torch.Tensor:
        """The golden's rows ``idx`` of ``kind`` as integer bits ``[len(idx), V]`` on ``device``."""
        return torch.from_numpy(int_bits(self.host_rows(kind, idx))).to(device)
