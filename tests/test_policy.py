"""Comparison policies: each SPEC at its boundary, parsing, and the sensitivity a report states."""

import math
import re

import pytest
import torch

from vd.errors import UsageError
from vd.policy import Policy, parse_spec
from vd.rowmath import measure_rows

V = 64


def _golden_row() -> torch.Tensor:
    """A bf16 row with a clear top-3 (4.0, 3.0, 2.0 at 10, 20, 30) over small values."""
    row = torch.linspace(-1, 1, V, dtype=torch.float32).to(torch.bfloat16)
    row[10], row[20], row[30] = 4.0, 3.0, 2.0
    return row


def _judge(spec: str, cand: torch.Tensor, gold: torch.Tensor | None = None) -> bool:
    gold = _golden_row() if gold is None else gold
    passed, _ = measure_rows(gold.view(torch.int16)[None], cand[None], "bfloat16", parse_spec(spec))
    return bool(passed[0])


def _ulps(x: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """``x`` with element ``i`` moved up by ``n`` bf16 ULPs."""
    y = x.clone()
    y.view(torch.int16)[i] += n
    return y


def test_exact_boundary():
    assert _judge("exact", _golden_row())
    assert not _judge("exact", _ulps(_golden_row(), 5, 1))


@pytest.mark.parametrize("n", [1, 3])
def test_ulp_boundary(n):
    assert _judge(f"ulp:{n}", _ulps(_golden_row(), 5, n))
    assert not _judge(f"ulp:{n}", _ulps(_golden_row(), 5, n + 1))


def test_ulp_counts_across_zero_and_signed_zero_as_zero():
    gold = _golden_row()
    gold[3] = 0.0
    neg = gold.clone()
    neg[3] = -0.0
    assert _judge("ulp:0", neg, gold) and not _judge("exact", neg, gold)


def test_atol_rtol_is_one_combined_bound():
    """An element passes when |got - golden| <= atol + rtol * |golden| (torch.testing's rule): at the 4.0
    logit with atol 0.25 and rtol 0.0625 the bound is 0.5."""
    inside, outside = _golden_row(), _golden_row()
    inside[10] = 4.5  # |Δ| 0.5, on the bound (kept below the 3.0 runner-up: no decision change)
    outside[10] = 4.5625  # |Δ| 0.5625
    assert _judge("atol:0.25,rtol:0.0625", inside)
    assert not _judge("atol:0.25,rtol:0.0625", outside)
    # Either bound alone would not do: outside atol and outside rtol * |golden| separately.
    assert not _judge("atol:0.25,rtol:0", inside) and not _judge("atol:0,rtol:0.0625", inside)


def test_argmax_and_topk_boundaries():
    far = _golden_row()
    far[0] = 2.5  # a big change below the top: argmax and top-1 still the same
    assert _judge("argmax", far) and _judge("topk:1", far)
    assert not _judge("topk:3", far)  # 2.5 displaces 2.0 from the top 3
    reordered = _golden_row()
    reordered[20], reordered[30] = 2.0, 3.0  # ranks 2 and 3 swap: the same top-3 set
    assert _judge("topk:3", reordered) and _judge("argmax", reordered)
    swapped = _golden_row()
    swapped[10], swapped[20] = 3.0, 4.0
    assert not _judge("argmax", swapped) and not _judge("topk:1", swapped)


def test_kl_boundary():
    gold, cand = _golden_row(), _golden_row()
    cand[10] = 4.25
    p, q = torch.log_softmax(gold.float(), 0), torch.log_softmax(cand.float(), 0)
    kl = float((p.exp() * (p - q)).sum())
    assert _judge(f"kl:{kl * 1.001}", cand)
    assert not _judge(f"kl:{kl * 0.999}", cand)


def test_a_topk_as_wide_as_the_vocabulary_is_refused_where_the_vocabulary_is_known():
    """topk:N with N at or past the vocabulary catches nothing (the top N are every token): refused once the
    golden's or the model's vocabulary is known, for the kinds and for equivalence=."""
    Policy.parse(["topk:511"]).check_vocab(512)
    for items in (["topk:512"], ["verify=topk:100000"], ["equivalence=topk:600"]):
        with pytest.raises(UsageError, match="the vocabulary has 512 tokens"):
            Policy.parse(items).check_vocab(512)


def test_a_replay_or_recording_with_a_topk_past_the_vocabulary_is_refused(cli, tiny_golden, tmp_path):
    code, _, err = cli("replay", tiny_golden, "--tolerance", "topk:100000")
    assert code == 2 and "topk:100000 (for prefill rows, verify rows, draft rows): the vocabulary has 512" in err, err
    code, _, err = cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--steps", "2", "--tolerance",
                       "draft=topk:512")
    assert code == 2 and "topk:512 (for draft rows)" in err and not (tmp_path / "g.zarr").exists(), err


def test_bad_tolerances_are_usage_errors():
    for bad in ("ulp", "ulp:-1", "atol:1", "atol:x,rtol:1", "kl:-1", "topk:0", "fuzzy", "weights=exact"):
        with pytest.raises(UsageError):
            Policy.parse([bad])
    with pytest.raises(UsageError):
        Policy.parse([], {"verify": "bogus"})  # a stored policy must parse too
    # A known SPEC with a number out of its range says which range, whichever SPEC (ulp:-1 was "unknown").
    for bad, wants in (("ulp:-1", "ulp:N takes a whole N from 0 to 4294967296"), ("ulp:1.5", "ulp:N takes a whole N"),
                       # one past what any two float32 values are apart: it overflowed the comparison (exit 3)
                       ("ulp:4294967297", "ulp:N takes a whole N from 0 to"), ("ulp:" + "9" * 20, "(2**32: more than"),
                       ("topk:0", "topk:N takes a whole N >= 1"), ("kl:-0.1", "kl:X takes a finite X >= 0"),
                       ("atol:-1,rtol:0", "atol:X,rtol:Y take finite X, Y >= 0"),
                       ("atol:0.1", "unknown tolerance 'atol:0.1'"), ("atol:0.1", "atol takes its rtol"),
                       # two SPECs in one item: not a bad number, but an item per kind
                       ("verify=ulp:2,draft", "'ulp:2,draft' is more than one SPEC"),
                       ("kl:0.1,exact", "give each kind's its own item"),
                       # an empty kind before '=' (it applied to every kind without a word)
                       ("=exact", "name a kind before '='"), (" =kl:1", "name a kind before '='")):
        with pytest.raises(UsageError, match=re.escape(wants)):
            Policy.parse([bad])


def test_later_items_win_over_the_stored_policy():
    p = Policy.parse(["ulp:2", "draft=exact"], {"prefill": "kl:0.1", "verify": "argmax"})
    assert p.to_json() == {"prefill": "ulp:2", "verify": "ulp:2", "draft": "exact"}
    assert p.describe() == "prefill ulp:2, verify ulp:2, draft exact" and p["verify"].n == 2
    assert Policy.parse([], {"verify": "argmax"}).needs_rows == []  # exact and argmax need no golden rows
    assert Policy.parse(["verify=kl:0.1"]).needs_rows == ["verify"]


def test_sensitivity_names_figures_for_each_policy():
    from vd.policy import sensitivity

    stats = {"max_abs": 8.0, "min_margin": 0.5, "median_top1_p": 0.5}
    assert "1 ULP" in sensitivity(parse_spec("exact"), "bfloat16", stats)
    assert "0.125" in sensitivity(parse_spec("ulp:2"), "bfloat16", stats)  # 2 ULP at 8.0 in bf16 (ULP 1/16)
    assert "0.1 near zero, 0.9 at" in sensitivity(parse_spec("atol:0.1,rtol:0.1"), "bfloat16", stats)
    assert "not seen" in sensitivity(parse_spec("argmax"), "bfloat16", stats)
    assert f"{math.sqrt(2 * 0.01 / 0.25):.3g}" in sensitivity(parse_spec("kl:0.01"), "bfloat16", stats)


def test_sensitivity_of_a_golden_holding_inf_or_nan_is_said():
    """A golden recorded with --allow-nonfinite whose largest |logit| is Inf: every replay crashed, exit 3, on the
    ULP there (OverflowError, found by a user test)."""
    from vd.policy import sensitivity

    for top in (math.inf, math.nan):
        stats = {"max_abs": top, "min_margin": 0.5, "median_top1_p": 0.5}
        for spec in ("exact", "ulp:2", "atol:0.1,rtol:0.1", "argmax", "topk:2", "kl:0.01"):
            assert sensitivity(parse_spec(spec), "bfloat16", stats)


@pytest.mark.parametrize("margin", ["0.2421875", "0.5", "1", "1e-07", "0.1", "3.0000001"])
def test_a_margin_is_said_as_it_parses(margin):
    """decisions=margin:X is stored, reported and put in a bundle's command.sh as text that parses back to the same
    X: %g made 0.2421875 into 0.242188, and a flip at a margin of 0.2421875 FAILed the replay and PASSed its
    command.sh (found by a user test)."""
    p = Policy.parse([f"decisions=margin:{margin}"])
    assert Policy.parse(list(p.terms())).margin == p.margin == float(margin)
    assert p.decisions == (f"margin:{margin}" if margin != "1e-07" else "margin:1e-07")


@pytest.mark.parametrize("vocab", [1, 5, 63, 64, 65, 1000, 4099])
def test_measures_and_histogram_match_their_definitions(vocab):
    """`measure_differing`'s figures against their definitions written out element by element: the histogram
    counts each differing element in bin ``c * BINS // V`` (as a list of places would), ``max_ulp`` is the
    largest step between the ordered bit patterns, a NaN against a number is infinitely far."""
    from vd.rowmath import POSITION_BINS, measure_differing, ordered

    gen = torch.Generator().manual_seed(vocab)
    gold = (torch.randn(3, vocab, generator=gen) * 4).to(torch.bfloat16)
    got = gold.clone()
    bits = got.view(torch.int16)
    places = torch.randint(0, vocab, (3, max(1, vocab // 7)), generator=gen)
    bits.scatter_(1, places, bits.gather(1, places) + torch.randint(1, 4, places.shape, generator=gen).to(torch.int16))
    got[2, 0] = float("nan")
    vals, ok, hist = measure_differing(gold.view(torch.int16), got, "bfloat16", parse_spec("ulp:3"))
    differ = gold.view(torch.int16) != got.view(torch.int16)
    cols = differ.nonzero()[:, 1]
    assert hist.tolist() == torch.bincount(cols * POSITION_BINS // vocab, minlength=POSITION_BINS).tolist()
    assert vals["n_diff"].tolist() == differ.sum(1).tolist()
    steps = (ordered(gold.view(torch.int16)) - ordered(got.view(torch.int16))).abs().amax(1)
    assert vals["max_ulp"][:2].tolist() == steps[:2].tolist() and vals["max_ulp"][2] == math.inf
    assert ok.tolist() == [bool(steps[0] <= 3), bool(steps[1] <= 3), False]
