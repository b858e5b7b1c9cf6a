"""What a K's accept counts say about a reference: how many steps accepted each count, whether it is
too thin to trust, and which accept counts it never exercised.

A reference must hold both a full accept (every draft taken) and a partial one: a golden of only one kind
could not tell a broken commit or rewind from a working one. These checks read accept counts only; the
recorder applies them before storing and the replayer before judging.
"""

from __future__ import annotations

from collections.abc import Sequence


def histogram(k: int, accepted: Sequence[int]) -> list[int]:
    """How many steps accepted 0, 1, .., K-1 drafts."""
    out = [0] * k
    for a in accepted:
        out[a] += 1
    return out


def thin_reason(k: int, accepted: Sequence[int]) -> str | None:
    """Why a reference is too thin to trust (it must hold a full and a partial accept), or None."""
    full = sum(1 for a in accepted if a == k - 1)
    if full == 0 or full == len(accepted):
        return f"verify K={k}: the reference accepted {list(accepted)}; it needs both full and partial accepts"
    return None


def coverage_reason(k: int, accepted: Sequence[int], made: set[int] | None = None) -> str | None:
    """Which accept counts 0..K-1 no step had, or None when every one occurred. ``made``: the counts the steps'
    feed can make at all (the reference feed's, `vd.loop.reference_accepts`; None: any): those missing outside it
    are named as such, since no number of steps reaches them."""
    hist = histogram(k, accepted)
    missing = [i for i, n in enumerate(hist) if n == 0]
    if not missing:
        return None
    text = (f"coverage K={k}: no step accepted {', '.join(map(str, missing))} draft(s) "
            f"(steps per accept count 0..{k - 1}: {hist})")
    never = [i for i in missing if i not in made] if made is not None else []
    if never:
        text += (f"; the reference feed corrupts draft 1 + s % (K-1) on odd steps, which at K={k} never leaves "
                 f"{', '.join(map(str, never))} accepted (only a model rejecting its own greedy draft does): more "
                 "steps cannot reach it, the drafter feed or other widths can")
    return text
