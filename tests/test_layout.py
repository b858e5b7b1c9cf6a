"""The shared values: a K's row layout, its step log, and what its accept counts say."""

import numpy as np
import pytest

from vd.coverage import coverage_reason, histogram, thin_reason
from vd.layout import RowLayout, Step, StepLog
from vd.loop import reference_accepts, reference_drafts


def test_rows_are_laid_out_prefill_verify_then_draft():
    layout = RowLayout(prompt=5, steps=4, k=3, drafted=True)
    assert layout.counts == {"prefill": 5, "verify": 12, "draft": 9} and layout.total == 26
    assert [layout.offset(kind) for kind in layout.counts] == [0, 5, 17]
    assert layout.locate("prefill", 4) == (None, 4) and layout.locate("verify", 7) == (2, 1)
    assert layout.locate("draft", 0) == (None, 0) and layout.locate("draft", 5) == (2, 0)  # row 0: bootstrap
    assert layout.step_rows("verify", 2).tolist() == [6, 7, 8] and layout.step_rows("draft", 2).tolist() == [5, 6]
    assert layout.step_rows("draft", None).tolist() == [0] and layout.step_rows("prefill", None).tolist() == [0, 1, 2,
                                                                                                             3, 4]
    values = np.arange(layout.total)
    parts = layout.split(values)
    assert [p.tolist()[0] for p in parts.values()] == [0, 5, 17]
    assert layout.by_step("draft", parts["draft"]).tolist() == [[18, 19], [20, 21], [22, 23], [24, 25]]
    assert RowLayout(5, 4, 3).counts == {"prefill": 5, "verify": 12}


def test_a_step_log_round_trips_its_metadata_copy():
    log = StepLog(k=3, bootstrap=7, tokens=np.array([[7, 1, 2], [2, 3, 4]], dtype=np.int32),
                  accepted=np.array([2, 0], dtype=np.int32), step_ms=np.array([1.5, 2.5]), committed_is_greedy=True)
    back = StepLog.from_json(3, log.to_json())
    assert back.same_steps(log) and back.committed_is_greedy and back.step_ms.tolist() == [1.5, 2.5]
    assert back.steps == [Step((7, 1, 2), 2), Step((2, 3, 4), 0)]
    other = StepLog.from_json(3, {**log.to_json(), "accepted": [2, 1]})
    assert not other.same_steps(log)
    with pytest.raises(ValueError):
        StepLog.from_json(3, {**log.to_json(), "tokens": [1, 2, 3, 4]})  # not a whole number of steps of 3


def test_accept_counts_thin_and_coverage():
    assert histogram(3, [2, 0, 2, 1]) == [1, 1, 2]
    assert thin_reason(3, [2, 0, 2, 1]) is None
    assert "needs both full and partial accepts" in thin_reason(3, [2, 2])
    assert "needs both full and partial accepts" in thin_reason(3, [0, 1])
    assert coverage_reason(3, [2, 0, 2, 1]) is None
    assert coverage_reason(3, [2, 1]) == "coverage K=3: no step accepted 0 draft(s) (steps per accept count 0..2: " \
                                        "[0, 1, 1])"


@pytest.mark.parametrize("k", range(2, 9))
def test_the_reference_feeds_accept_counts_are_named_where_steps_cannot_reach_them(k):
    """The reference feed's rule (draft 1 + s % (K-1) corrupted on odd steps) run over a model that accepts its own
    greedy drafts makes exactly `reference_accepts(k)`: every count at an even K, at an odd K only the odd ones
    below K-1 and K-1. A coverage reason says so for the counts it can never make (K=3 misses 0 however many
    steps), and only for the reference feed's steps."""
    greedy, p, made = list(range(100, 1000)), 0, set()
    for s in range(64):
        drafts = reference_drafts(greedy, p, s, k, 5000)
        n = next((j for j, t in enumerate(drafts) if t != greedy[p + 1 + j]), k - 1)
        made.add(n)
        p += n + 1
    assert made == reference_accepts(k) and (made == set(range(k))) == (k % 2 == 0)
    missing = sorted(set(range(k)) - made)
    if missing:
        why = coverage_reason(k, sorted(made), reference_accepts(k))
        assert why is not None and why.endswith(f"at K={k} never leaves {', '.join(map(str, missing))} accepted (only "
                                                "a model rejecting its own greedy draft does): more steps cannot "
                                                "reach it, the drafter feed or other widths can")
        assert "reference feed" not in coverage_reason(k, sorted(made))
