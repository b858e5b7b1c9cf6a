"""Verify rows against decode rows: the axis on which greedy speculative decoding stays lossless or not.

A K-token verify computes a row for each of its K positions; where the tokens up to a position are the greedy
continuation's, the same engine's one-token decode computed that position's row too (a golden stores those:
its decode group, `vd.store.format.DECODE_K`). Speculative output equals plain greedy output only if every
such pair of rows picks the same token, and a kernel chosen by the number of rows (M = 1 against M = K) can
sum in another order and make them differ in the last bits, or flip a near-tie. `decode_map` says which
decode row each verify row of a K is (from the step log alone); `Equivalence` is what the pairs show: how many
were compared and are bit-identical, the largest differences, and each argmax that differs (a place where
speculative output would leave greedy output). `Accumulator` measures a run's verify rows against its decode
rows block by block, as the run lets them go; `of_golden` measures a golden's own, reading rows only where
the digests of a pair differ.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from vd.digest import argmax_rows, digest
from vd.dtypes import DTYPES, int_bits, int_view, to_storage
from vd.errors import naming
from vd.layout import StepLog
from vd.policy import Spec
from vd.rowmath import measure_differing, rows_per_block
from vd.store.format import DECODE_K

if TYPE_CHECKING:
    from vd.store.read import Golden


@dataclass(frozen=True, slots=True)
class Place:
    """A verify row: its step and its row within the step."""

    step: int
    row: int


@dataclass(frozen=True, slots=True)
class Equivalence:
    """Verify rows against the decode rows of the same positions, at one K.

    ``rows`` pairs were compared (verify rows whose input is the greedy continuation), ``identical`` of them
    bit for bit; ``max_abs`` and ``max_ulp`` the largest element differences and ``kl_mean``/``kl_max`` the KL
    divergence of the verify rows from their decode rows (NaN where the rows were not at hand: a slim golden);
    ``flips`` the pairs whose argmax differs; ``first`` the first pair that is not identical. ``judged``: a
    policy asked for equivalence (``equivalence=SPEC``), and ``failing`` lists the pairs that fail it (a flip
    always does).
    """

    rows: int
    identical: int
    max_abs: float = 0.0
    max_ulp: float = 0.0
    kl_mean: float = 0.0
    kl_max: float = 0.0
    flips: tuple[Place, ...] = ()
    first: Place | None = None
    judged: bool = False
    failing: tuple[Place, ...] = ()
    measured: bool = True

    @property
    def passed(self) -> bool:
        """Whether no pair fails (always true where not judged)."""
        return not self.failing


def describe(e: Equivalence) -> str:
    """The figures in words: pairs compared, bit-identical, the largest differences, flips, the verdict where
    judged (what `vd record`, `vd show` and `vd replay` print)."""
    if not e.rows:
        return "no verify row's input is the greedy continuation"
    measures = (f"max |Δ| {e.max_abs:.4g}, {e.max_ulp:.0f} ULP, KL mean {e.kl_mean:.3g} / max {e.kl_max:.3g}"
                if e.measured else "element measures unknown (a slim golden)")
    first = "" if e.first is None else f" (first other at step {e.first.step} row {e.first.row})"
    flips = f"{len(e.flips)} argmax flip(s)" + ("" if not e.flips else
                                               f" (first at step {e.flips[0].step} row {e.flips[0].row})")
    judged = "" if not e.judged else f"; {'pass' if e.passed else 'FAIL'}"
    return f"{e.identical} of {e.rows} rows bit-identical{first}; {measures}; {flips}{judged}"


def decode_map(log: StepLog, prompt: int, greedy: Sequence[int], decode_steps: int) -> np.ndarray:
    """For each of a K's verify rows, step by step, the decode group's verify row of the same position, or -1.

    Verify row ``i`` of a step whose first token sits at position ``pos`` has seen the tokens up to ``pos + i``;
    where the generated tokens up to there are the greedy continuation's (``greedy``: its tokens, the first at
    position ``prompt``), the decode group's row ``pos + i - prompt`` saw the same (its step ``j`` decodes
    ``greedy[j]`` at position ``prompt + j``), if it holds that many (``decode_steps``). A drafter's bootstrap
    decode commits ``log.decoded`` before the first step.
    """
    out = np.full(log.tokens.size, -1, dtype=np.int64)
    generated = [] if log.decoded is None else [int(log.decoded)]
    for s, (tokens, accepted) in enumerate(zip(log.tokens.tolist(), log.accepted.tolist())):
        for i in range(len(tokens)):
            seen = generated + tokens[: i + 1]
            j = len(seen) - 1
            if j < decode_steps and j < len(greedy) and seen == list(greedy[: len(seen)]):
                out[s * len(tokens) + i] = j
        generated += tokens[: accepted + 1]
    return out


@dataclass(slots=True)
class DecodeRows:
    """A run's decode rows as the equivalence needs them: their digests and argmaxes on the device where the
    verify rows are (`digest`, `vd.digest.argmax_rows`), and the rows (``rows(idx)``) for the pairs that differ."""

    digests: torch.Tensor  # [D, LANES]
    argmax: torch.Tensor  # [D]
    rows: Callable[[np.ndarray], torch.Tensor]


class KeptDecode:
    """A forward's decode rows kept as its decode run lets them go, for the verify-against-decode axis: their
    digests and argmaxes on the run's device, and the rows, read back for the pairs that differ. On a GPU the
    rows stay there (no copy either way; 16 MB for 16 steps of the 8B shape); on the CPU they go to a temporary
    file, where in memory they grew a 256-step replay by 100 MB (S x max K rows): the process's memory stays
    flat in steps, and the file goes when the rows do."""

    def __init__(self):
        self.digests: list[torch.Tensor] = []
        self.argmax: list[torch.Tensor] = []
        self.device_rows: list[torch.Tensor] = []
        self.file = None
        self.n, self.width, self.dtype = 0, 0, np.dtype(np.int16)

    def observe(self, kind: str, start: int, rows: torch.Tensor) -> None:
        if kind != "verify":
            return
        self.digests.append(digest(rows))
        self.argmax.append(argmax_rows(rows))
        if rows.device.type != "cpu":
            self.device_rows.append(rows)  # a run's rows are its own (`vd.loop.Run.own`): kept as they are
            return
        bits = np.ascontiguousarray(int_bits(to_storage(rows)))
        if self.file is None:
            self.file = tempfile.TemporaryFile(prefix="vd-decode-rows-")
        self.n, self.width, self.dtype = self.n + bits.shape[0], bits.shape[1], bits.dtype
        with naming(tempfile.gettempdir()):  # (the file has no name: its folder is where the space ran out)
            self.file.write(bits.tobytes())

    @property
    def count(self) -> int:
        """Decode rows kept."""
        return sum(d.shape[0] for d in self.digests)

    def rows(self, idx: np.ndarray) -> torch.Tensor:
        """Rows ``idx``: on the GPU as computed, on the CPU their storage bits ``[len(idx), V]`` read back."""
        if self.device_rows:
            if len(self.device_rows) > 1:
                self.device_rows = [torch.cat(self.device_rows)]
            kept = self.device_rows[0]
            return int_view(kept[torch.from_numpy(np.asarray(idx)).to(kept.device)])
        assert self.file is not None, "no decode rows were kept"
        self.file.flush()
        size = self.width * self.dtype.itemsize
        out = np.empty((len(idx), self.width), self.dtype)
        for j, i in enumerate(np.asarray(idx).tolist()):
            if not 0 <= i < self.n:
                raise IndexError(f"decode row {i} of {self.n}")
            out[j] = np.frombuffer(os.pread(self.file.fileno(), size, i * size), self.dtype)
        return torch.from_numpy(out)

    def result(self) -> DecodeRows:
        return DecodeRows(torch.cat(self.digests), torch.cat(self.argmax), self.rows)


@dataclass(slots=True)
class _Tally:
    places: list[Place] = field(default_factory=list)
    identical: int = 0
    max_abs: float = 0.0
    max_ulp: float = 0.0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    flips: list[Place] = field(default_factory=list)
    failing: list[Place] = field(default_factory=list)
    first: Place | None = None


@dataclass(frozen=True, slots=True)
class FailingPair:
    """The first verify row (in the order the run computed them) failing the policy's ``equivalence=`` against its
    decode row: where it is, both rows as stored, and whether their argmaxes differ."""

    place: Place
    verify: np.ndarray
    decode: np.ndarray
    flipped: bool


class Accumulator:
    """One run's verify rows measured against its decode rows (`DecodeRows`) a block at a time, as the run lets
    them go (`add`, verify rows from row ``start`` of the K); ``spec``: the policy's equivalence SPEC (None:
    reported, not judged)."""

    def __init__(self, k: int, mapping: np.ndarray, decode: DecodeRows, logical: str, spec: Spec | None):
        self.k, self.decode, self.logical, self.spec = k, decode, logical, spec
        self.tally = _Tally()
        # The verify rows that have a decode row, and theirs, on the host and (copied now, before the run, not
        # after it when each copy would wait for the device) where the decode rows are.
        self.at = np.flatnonzero(mapping >= 0)
        self.dec = mapping[self.at]
        device = decode.digests.device
        self.at_on, self.dec_on = (torch.from_numpy(self.at).to(device), torch.from_numpy(self.dec).to(device))
        self.pair: FailingPair | None = None  # the first pair failing ``spec``, kept for a first-divergence bundle

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Verify rows ``start .. start + len(rows)`` (``[n, V]``, on the device of the decode digests)."""
        lo, hi = np.searchsorted(self.at, [start, start + rows.shape[0]])
        if lo == hi:
            return
        at, dec = self.at[lo:hi], self.dec[lo:hi]
        got = rows[self.at_on[lo:hi] - start]
        on = self.dec_on[lo:hi]
        equal = (digest(got) == self.decode.digests[on]).all(dim=1)
        # one read-back for the three (each is a wait for the device)
        eq, argmax, ref = torch.stack([equal.long(), argmax_rows(got), self.decode.argmax[on]]).cpu().numpy()
        same = eq.astype(bool)
        self._count(at, same, argmax != ref)
        differ = np.flatnonzero(~same)
        bad = list(np.flatnonzero(argmax != ref)) if self.spec is not None else []  # a flip fails any SPEC
        for part in _blocks(differ, rows.device, rows.shape[1]):  # the measures' temporaries flat in steps
            vals, ok, _ = measure_differing(self.decode.rows(dec[part]).to(rows.device), got[part], self.logical,
                                            self.spec or Spec("exact", "exact"))
            self._measured(at[part], vals, ok)
            if self.spec is not None:
                bad += list(part[~ok])
        if bad and self.pair is None:
            i = int(min(bad))
            self.pair = FailingPair(Place(int(at[i]) // self.k, int(at[i]) % self.k), to_storage(got[i]),
                                    self.decode.rows(dec[i:i + 1])[0].cpu().numpy().view(DTYPES[self.logical].storage),
                                    bool(argmax[i] != ref[i]))

    def _count(self, at: np.ndarray, same: np.ndarray, flipped: np.ndarray) -> None:
        t = self.tally
        places = [Place(int(r) // self.k, int(r) % self.k) for r in at]
        t.places += places
        t.identical += int(same.sum())
        t.flips += [p for p, f in zip(places, flipped) if f]
        if self.spec is not None:
            t.failing += [p for p, f in zip(places, flipped) if f]
        if t.first is None and not same.all():
            t.first = places[int(np.flatnonzero(~same)[0])]

    def _measured(self, at: np.ndarray, vals: dict[str, np.ndarray], ok: np.ndarray) -> None:
        t = self.tally
        t.max_abs = max(t.max_abs, float(vals["max_abs"].max()))
        t.max_ulp = max(t.max_ulp, float(vals["max_ulp"].max()))
        t.kl_sum += float(vals["kl"].sum())
        t.kl_max = max(t.kl_max, float(vals["kl"].max()))
        if self.spec is not None:
            bad = [Place(int(r) // self.k, int(r) % self.k) for r in at[~ok]]
            t.failing += [p for p in bad if p not in t.failing]

    def result(self) -> Equivalence:
        t = self.tally
        n = len(t.places)
        failing = tuple(sorted(set(t.failing), key=lambda p: (p.step, p.row)))
        return Equivalence(rows=n, identical=t.identical, max_abs=t.max_abs, max_ulp=t.max_ulp,
                           kl_mean=t.kl_sum / n if n else 0.0, kl_max=t.kl_max, flips=tuple(t.flips), first=t.first,
                           judged=self.spec is not None, failing=failing)


def unknown(rows: int, identical: int, flips: tuple[Place, ...], first: Place | None, judged: bool = False,
            failing: tuple[Place, ...] = ()) -> Equivalence:
    """The figures of pairs whose rows were not at hand (a slim golden): counts from the digests and argmaxes,
    the element measures unknown; ``judged`` where the digests and argmaxes alone tell the pairs ``failing``."""
    nan = math.nan
    return Equivalence(rows, identical, nan, nan, nan, nan, flips, first, judged=judged, failing=failing,
                       measured=False)


# Pairs of rows measured at once (`Accumulator.add`, `of_golden`): the measures make a handful of float32 and
# float64 copies of each block (32 rows of a 152k vocabulary: about 20 MB each); measured a hold's worth at once
# (16 MB of bf16 rows on the CPU) they grew a 256-step SmolLM2 replay's peak by a sixth over a 16-step one. On a
# GPU, 32 rows a block (each block a read-back: fewer is faster); on the CPU, whose copies count in the process's
# peak memory, as many as the replay's own comparison takes (`vd.rowmath.rows_per_block`): with 32 SmolLM2 rows a
# 64-step replay peaked at 868-904 MB, with 8-10 at 789-824 (on an AMD EPYC host, where its verify rows differ
# from its decode rows and are measured).
MEASURE_ROWS = 32


def _blocks(idx: np.ndarray, device: torch.device, vocab: int) -> list[np.ndarray]:
    n = MEASURE_ROWS if device.type == "cuda" else min(MEASURE_ROWS, rows_per_block(device, vocab))
    return [idx[i:i + n] for i in range(0, idx.size, n)]


def of_golden(golden: Golden, k: int, spec: Spec | None = None) -> Equivalence | None:
    """A golden's own verify rows at ``k`` against its decode rows (None where it stores no decode rows): the
    pairs compared by their stored digests and argmaxes, and only the pairs whose digests differ read and
    measured (a slim golden's element measures unknown)."""
    if not golden.decoded:
        return None
    side, dec_side = golden.side(k), golden.side(DECODE_K)
    greedy = dec_side.log.tokens[:, 0].tolist()
    mapping = decode_map(side.log, len(golden.prompt), greedy, dec_side.layout.steps)
    acc = Accumulator(k, mapping, DecodeRows(torch.zeros(0), torch.zeros(0), lambda idx: torch.zeros(0)),
                      golden.logical, spec)
    at, dec = acc.at, acc.dec  # the verify rows that have a decode row, and theirs
    v0, d0 = side.layout.offset("verify"), dec_side.layout.offset("verify")
    same = (side.digests[v0 + at] == dec_side.digests[d0 + dec]).all(axis=1)
    flipped = side.stats("verify")["argmax"][at] != dec_side.stats("verify")["argmax"][dec]
    acc._count(at, same, flipped)
    differ = np.flatnonzero(~same)
    if not differ.size:
        return acc.result()
    if not side.has_rows:  # judged where digests and argmaxes tell (exact, argmax: a flip fails any SPEC)
        r = acc.result()
        exact = spec is not None and spec.name == "exact"
        failing = tuple(Place(int(at[i]) // k, int(at[i]) % k) for i in differ) if exact else r.flips
        known = spec is not None and (spec.name in ("exact", "argmax") or bool(r.flips))
        return unknown(r.rows, r.identical, r.flips, r.first, judged=known, failing=failing if known else ())
    for part in _blocks(differ, torch.device("cpu"), golden.info.vocab):  # a block at a time: memory flat in steps
        got = torch.from_numpy(int_bits(side.host_rows("verify", at[part]))).view(DTYPES[golden.logical].torch)
        ref = torch.from_numpy(int_bits(dec_side.host_rows("verify", dec[part])))
        vals, ok, _ = measure_differing(ref, got, golden.logical, spec or Spec("exact", "exact"))
        acc._measured(at[part], vals, ok)
    return acc.result()
