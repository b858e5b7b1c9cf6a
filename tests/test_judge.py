"""Judging a run against a golden's side: decisions checked inside any tolerance, and a slim golden judged
from its digests and statistics alone."""

import numpy as np
import pytest
import torch

from vd.digest import summarise
from vd.dtypes import of_torch, to_storage
from vd.layout import RowLayout, Step, StepLog
from vd.loop import Run
from vd.policy import Policy
from vd.replayer.comparison import AcceptChange
from vd.replayer.judge import compare_run
from vd.store.side import GoldenSide

V = 64


def _row() -> torch.Tensor:
    """A bf16 row with a clear top-3 (4.0, 3.0, 2.0 at 10, 20, 30) over small values."""
    row = torch.linspace(-1, 1, V, dtype=torch.float32).to(torch.bfloat16)
    row[10], row[20], row[30] = 4.0, 3.0, 2.0
    return row


def _side(gold: torch.Tensor, accepted: list[int], rows: bool = True) -> GoldenSide:
    """The golden side of steps × K rows ``gold`` (one prefill row: the first step's first row)."""
    steps, k = gold.shape[:2]
    layout = RowLayout(1, steps, k)
    flat = {"prefill": gold[0, :1], "verify": gold.reshape(-1, V)}
    d, s = summarise(flat)
    log = StepLog(k=k, bootstrap=0, tokens=np.tile(np.array([1, 10], dtype=np.int32), (steps, 1)),
                  accepted=np.array(accepted, dtype=np.int32), step_ms=np.zeros(steps))
    stored = {kind: to_storage(t) for kind, t in flat.items()}
    load = (lambda kind, idx: stored[kind][idx]) if rows else None
    return GoldenSide(log, layout, V, d, s, load, "test", logical=of_torch(gold.dtype).name)


def _run(rows: torch.Tensor, accepted: list[int]) -> Run:
    return Run(k=rows.shape[1], prefill=rows[0, :1].clone(), rows=list(rows),
               steps=[Step((1, 10), a) for a in accepted], computed=accepted)


def _gold() -> torch.Tensor:
    gold = torch.stack([torch.stack([_row(), _row()])] * 2)  # 2 steps x K=2
    gold[1, 0, 20] = 4.0 - 1 / 64  # step 1 row 0: runner-up one bf16 ULP below the top
    return gold


def test_a_flipped_decision_fails_inside_tolerance_and_names_the_margin():
    gold = _gold()
    cand = gold.clone()
    cand[1, 0, 20] = 4.0 + 1 / 32  # now above: the argmax flips, |Δ| 0.047
    policy = Policy.parse(["atol:0.1,rtol:0"])
    c = compare_run("x", _side(gold, [1, 1]), _run(cand, [1, 0]), "bfloat16", policy)
    assert c.summary["verify"].rows_failed == 0  # inside the tolerance ...
    assert not c.passed and c.failed_step_list == (1,)  # ... and still a failure
    (f,) = c.flips
    assert (f.step, f.row, f.golden_argmax, f.got_argmax) == (1, 0, 10, 20)
    # 1/64 is one step below 4.0 in bf16, half a ULP of 4.0 itself (the top-1 value the margin is counted in)
    assert f.margin == pytest.approx(1 / 64) and f.margin_ulps == pytest.approx(0.5) and f.near_tie
    assert c.accept_changes == (AcceptChange(step=1, golden=1, got=0, margin=pytest.approx(1 / 64), allowed=False),)
    ok = compare_run("x", _side(gold, [1, 1]), _run(gold.clone(), [1, 1]), "bfloat16", policy)
    assert ok.passed and not ok.flips and ok.equal


@pytest.mark.parametrize("decisions, passed", [("strict", False), ("margin:0.25", True), ("margin:0.01", False)])
def test_decisions_margin_allows_a_flip_and_its_accept_change_only_below_the_margin(decisions, passed):
    """The near-tie flip at step 1 row 0 (golden margin 1/64) and the accept-count change it causes are
    allowed under decisions=margin:X for X above the margin, listed with their margin either way; a flip at a
    clear row (margin 1.0) never is."""
    gold = _gold()
    cand = gold.clone()
    cand[1, 0, 20] = 4.0 + 1 / 32
    policy = Policy.parse(["atol:0.1,rtol:0", f"decisions={decisions}"])
    c = compare_run("x", _side(gold, [1, 1]), _run(cand, [1, 0]), "bfloat16", policy)
    assert c.passed is passed and c.failed_step_list == (() if passed else (1,))
    (f,) = c.flips
    assert f.allowed is passed and f.margin == 1 / 64
    assert c.accept_changes == (AcceptChange(step=1, golden=1, got=0, margin=1 / 64, allowed=passed),)
    assert c.to_json()["flips"][0]["allowed"] is passed
    a = c.summary["verify"].agreement  # llama.cpp's terms: one of four verify rows has another top-1
    assert a.same_top1 == 0.75 and a.kl_max > 0 and a.kl_median == 0 and a.dp_p1 < 0 == a.dp_p50
    clear = gold.clone()
    clear[0, 1, 30] = 5.0  # step 0 row 1: 2.0 -> 5.0 over the top's 4.0 (margin 1.0): a real change
    c = compare_run("x", _side(gold, [1, 1]), _run(clear, [1, 1]), "bfloat16",
                    Policy.parse(["kl:100", "decisions=margin:0.25"]))
    assert not c.passed and [f.allowed for f in c.flips] == [False] and c.failed_step_list == (0,)


def test_decisions_term_parses_stores_and_refuses():
    p = Policy.parse(["kl:0.05", "decisions=margin:0.25"])
    assert p.margin == 0.25 and p.to_json()["decisions"] == "margin:0.25" and "decisions margin:0.25" in p.describe()
    assert Policy.parse((), p.to_json()) == p  # as a golden stores it
    assert "decisions" not in Policy.parse(()).to_json() and Policy.parse(()).margin is None
    assert Policy.parse(["decisions=margin:0.25", "decisions=strict"]).margin is None
    for bad in ("decisions=margin:0", "decisions=margin:x", "decisions=loose", "decision=margin:1"):
        with pytest.raises(Exception, match="decisions"):
            Policy.parse([bad])


def test_a_slim_side_judges_exact_and_argmax_from_its_statistics():
    gold = _gold()
    cand = gold.clone()
    cand[0, 1, 3] = 0.5  # step 0 row 1: a value moves, the argmax stays
    full, slim = _side(gold, [1, 1]), _side(gold, [1, 1], rows=False)
    for policy in ("exact", "argmax"):
        a = compare_run("x", full, _run(cand, [1, 1]), "bfloat16", Policy.parse([policy]))
        b = compare_run("x", slim, _run(cand, [1, 1]), "bfloat16", Policy.parse([policy]))
        assert a.passed == b.passed == (policy == "argmax") and a.mismatched_step_list == b.mismatched_step_list == (0,)
        assert a.measured and not b.measured and np.isnan(b.max_abs_diff) and b.first_mismatch.index is None
        assert a.first_mismatch.index == 3 and a.max_abs_diff > 0
        (row,) = b.rows
        assert row.got_stats.argmax == row.golden_stats.argmax == 10
        assert row.got_stats.absmax == row.golden_stats.absmax == 4.0  # the top value is untouched
    flipped = gold.clone()
    flipped[0, 1, 20] = 8.0
    b = compare_run("x", slim, _run(flipped, [1, 1]), "bfloat16", Policy.parse(["argmax"]))
    assert not b.passed and [f.got_argmax for f in b.flips] == [20] and b.rows[0].got_stats.top1 == 8.0


def test_rows_measured_a_block_at_a_time_judge_as_all_at_once(monkeypatch):
    """Differing rows are measured a few at a time so the float copies stay bounded: the comparison is the
    one an all-at-once measurement gives, row for row."""
    import vd.digest

    g = torch.Generator().manual_seed(5)
    gold = torch.randn(7, 3, V, generator=g).bfloat16()
    cand = gold.clone()
    cand[1:, :, ::3] += 0.25  # every step but the first differs in every row
    policy = Policy.parse(["kl:0.5"])
    side, accepted = (lambda: _side(gold, [2] * 7)), [2] * 7
    whole = compare_run("x", side(), _run(cand, accepted), "bfloat16", policy)
    monkeypatch.setattr(vd.digest, "CPU_BLOCK_BYTES", 16 * V * 2)  # two rows a block
    blocks = compare_run("x", side(), _run(cand, accepted), "bfloat16", policy)
    assert whole.rows == blocks.rows and whole.summary == blocks.summary and whole.positions == blocks.positions
    assert whole.mismatched_steps == 6 and len(whole.rows) > 2


def test_plain_gives_what_dataclasses_asdict_gives():
    """A report's dataclasses become JSON-ready values as `dataclasses.asdict` makes them (plain's fast walk:
    nested dataclasses, tuples, lists, dicts, NumPy scalars, a named tuple), and None stays None."""
    import collections
    import dataclasses

    from vd.replayer.comparison import plain

    Pair = collections.namedtuple("Pair", "a b")

    @dataclasses.dataclass(frozen=True)
    class Inner:
        x: float
        n: np.int64
        tag: str | None

    @dataclasses.dataclass(frozen=True)
    class Outer:
        inner: Inner
        many: tuple[Inner, ...]
        listed: list
        by: dict
        pair: Pair
        flag: bool

    i = Inner(0.5, np.int64(3), None)
    value = Outer(i, (i, Inner(float("nan"), np.int64(-1), "t")), [1, [i]], {"k": i, 2: (i,)}, Pair(i, 4), True)
    got, want = plain(value), dataclasses.asdict(value)
    assert repr(got) == repr(want)
    assert type(got["many"]) is tuple and type(got["pair"]) is Pair and type(got["listed"][1][0]) is dict
    assert plain(None) is None


def test_a_first_failure_under_argmax_or_topk_names_no_element():
    """Under argmax (or topk:N) a failing row's first differing element and its two values mean nothing: the line
    said "prefill row 61 index 0: golden 0.87109375, got 0.86328125" (found by a user test). It says what fails."""
    from vd.replayer.comparison import Failure
    from vd.replayer.words import failure_text

    at = dict(kind="prefill", step=None, row=61, index=0, golden=0.87109375, got=0.86328125, argmax_flipped=True)
    assert failure_text(Failure(**at, policy="argmax")) == "prefill row 61: its argmax differs"
    assert failure_text(Failure(**at, policy="topk:3")) == "prefill row 61: its top 3 tokens differ"
    assert failure_text(Failure(**at, policy="kl:0.01")) == "prefill row 61 index 0: golden 0.87109375, got 0.86328125"
    # a row within its SPEC failing for its changed argmax alone: said so (it said "its top 2 tokens differ" of a
    # row whose top two had only swapped, found by a user test)
    assert failure_text(Failure(**at, policy="topk:2", within=True)) == \
        "prefill row 61: within topk:2, but its argmax changed"
