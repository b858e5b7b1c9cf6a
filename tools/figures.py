"""How the benchmarks report a figure measured several times: its spread (`spread`), and ratios taken
repetition by repetition (`ratios`), since the repetitions are interleaved and a ratio of one repetition's
two sides is what drift on a shared machine cancels out of."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def spread(values: Sequence[float]) -> dict:
    """``{"min", "median", "max", "n"}`` of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}


def ratios(num: Sequence[float], den: Sequence[float]) -> dict:
    """The spread of ``num[i] / den[i]`` over the repetitions."""
    return spread([a / b for a, b in zip(num, den, strict=True)])
