"""Row arithmetic both halves share: rows of one dtype measured against rows of the same dtype, element by
element (how many elements differ and the first, the largest absolute and ULP difference, the KL divergence,
the probability moved from the reference's top token, where in the vocabulary the differences sit), and judged
under a `vd.policy.Spec`. The replayer measures a candidate's rows against a golden's with it; a recording and a
replay measure verify rows against decode rows of the same positions with it (`vd.equivalence`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vd.digest import block_bytes
from vd.dtypes import DTYPES, int_view
from vd.policy import Spec

POSITION_BINS = 64
# 0 for equal rows; ``dp``: the candidate's probability of the golden's top token minus the golden's (llama.cpp's Δp)
MEASURES = ("n_diff", "first_index", "first_golden", "first_got", "max_abs", "max_ulp", "kl", "dp")


def ordered(bits: torch.Tensor) -> torch.Tensor:
    """Integer bit patterns mapped so that adjacent floats are adjacent integers (-0.0 and 0.0 both 0)."""
    b = bits.to(torch.int64)
    low = -(1 << (8 * bits.element_size() - 1))
    return torch.where(b < 0, low - b, b)


def ulp_of(x: float, logical: str) -> float:
    """One unit in the last place of ``x`` in the logical dtype."""
    x = abs(x) if math.isfinite(x) and x != 0 else 2.0 ** -126
    return 2.0 ** (math.floor(math.log2(x)) - DTYPES[logical].mantissa_bits)


def rows_per_block(device: torch.device, vocab: int) -> int:
    """How many rows `measure_differing` takes at once on ``device``: its float copies (about 16 bytes a value)
    within `vd.digest.block_bytes`."""
    return max(1, block_bytes(device) // (16 * vocab))


def measure_differing(gb: torch.Tensor, got: torch.Tensor, logical: str, spec: Spec
                       ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """Rows that differ, measured (`MEASURES`) and judged under ``spec`` on the device, golden bits ``gb``
    against candidate rows ``got`` (both ``[D, V]``), with the histogram of their differing elements over
    the vocabulary. One read-back, and no other wait for the device: each figure has a size known before
    the rows are (the histogram sums the differing elements per column, then per bin of columns, where a
    list of the differing elements' places would make the host wait for its length)."""
    d, v = got.shape
    cb = int_view(got)
    gd, cd, dm = gb.view(DTYPES[logical].torch).float(), got.float(), gb != cb
    first = dm.to(torch.int8).argmax(dim=1)
    nan = (gd.isnan() | cd.isnan()) & dm
    absd = torch.where(dm, (gd - cd).abs(), 0.0).masked_fill_(nan, torch.inf)
    ulp = (ordered(gb) - ordered(cb)).abs().amax(1).double().masked_fill_(nan.any(1), torch.inf)
    pg = torch.softmax(gd, 1)
    kl = (pg * (torch.log_softmax(gd, 1) - torch.log_softmax(cd, 1))).sum(1)
    kl = torch.nan_to_num(kl.double(), nan=torch.inf).clamp_min(0.0)
    rows_at = torch.arange(d, device=got.device)
    top = gd.argmax(1)
    dp = torch.softmax(cd, 1)[rows_at, top] - pg[rows_at, top]
    vals = {"n_diff": dm.sum(1), "first_index": first, "first_golden": gd[rows_at, first],
            "first_got": cd[rows_at, first], "max_abs": absd.amax(1), "max_ulp": ulp, "kl": kl, "dp": dp}
    ok = judge(spec, gd, cd, absd, ulp, kl)
    packed = torch.cat([torch.stack([vals[n].to(torch.float64) for n in MEASURES]).flatten(), ok.double(),
                        _bins(dm).double()]).cpu().numpy()
    per, ok_at, bins = np.split(packed, [len(MEASURES) * d, (len(MEASURES) + 1) * d])
    return dict(zip(MEASURES, per.reshape(len(MEASURES), d))), ok_at != 0, bins.astype(np.int64)


def _bins(dm: torch.Tensor) -> torch.Tensor:
    """Differing elements (``dm``, ``[D, V]``) per vocabulary bin: column ``c`` in bin ``c * POSITION_BINS // V``
    (bin ``b`` holds columns ``ceil(b V / BINS)`` up to ``ceil((b + 1) V / BINS)``), summed over rows."""
    v = dm.shape[1]
    per_column = torch.cat([dm.new_zeros(1, dtype=torch.int64), dm.sum(0).cumsum(0)])
    edges = (torch.arange(POSITION_BINS + 1, device=dm.device) * v + POSITION_BINS - 1) // POSITION_BINS
    return per_column[edges[1:]] - per_column[edges[:-1]]


def judge(spec: Spec, gd: torch.Tensor, cd: torch.Tensor, absd: torch.Tensor, ulp: torch.Tensor,
           kl: torch.Tensor) -> torch.Tensor:
    """Which differing rows pass ``spec`` (golden and candidate values ``gd``, ``cd``, the absolute differences
    ``absd`` element by element, and each row's largest ULP difference ``ulp`` and KL divergence ``kl``)."""
    if spec.name == "ulp":
        return ulp <= spec.n
    if spec.name == "close":
        return ~(absd > spec.atol + spec.rtol * gd.abs()).any(1)
    if spec.name == "argmax":
        return gd.argmax(1) == cd.argmax(1)
    if spec.name == "topk":
        n = min(spec.n, gd.shape[1])
        return (gd.topk(n, 1).indices.sort(1).values == cd.topk(n, 1).indices.sort(1).values).all(1)
    if spec.name == "kl":
        return kl <= spec.kl
    return torch.zeros(gd.shape[0], dtype=torch.bool, device=gd.device)  # exact: a differing row fails


def measure_rows(gold_bits: torch.Tensor, got: torch.Tensor, logical: str, spec: Spec) -> tuple[np.ndarray, dict]:
    """Candidate rows ``[R, V]`` against golden bit patterns ``[R, V]`` held in memory: which pass ``spec``
    and their measures (for judging rows outside a golden, and for tests of the policies)."""
    differ = (int_view(got) != gold_bits).any(1).cpu().numpy()
    passed = ~differ
    vals = {m: np.zeros(differ.size) for m in MEASURES}
    if differ.any():
        idx = np.flatnonzero(differ)
        at = torch.from_numpy(idx).to(got.device)
        measured, ok, _ = measure_differing(gold_bits[at], got[at], logical, spec)
        passed[idx] = ok
        for m in MEASURES:
            vals[m][idx] = measured[m]
    return passed, vals
