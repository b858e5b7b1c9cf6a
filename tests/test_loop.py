"""The step loop and its feeds: the seed's accept and draft rules, and that a reference run commits
exactly the model's plain greedy continuation (checked against HF's own generate)."""

import pytest
import torch

from vd.layout import Step
from vd.loop import ReferenceFeed, ReplayFeed, accepted, continuation, reference_drafts, run_verify
from vd.models import load_model


def test_accepted_counts_leading_matches():
    # draft j stands when row j-1's argmax is it
    assert accepted([9, 1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted([9, 1, 2, 3], [1, 5, 3, 4]) == 1
    assert accepted([9, 1, 2, 3], [0, 2, 3, 4]) == 0
    assert accepted([9, 1], [1, 7]) == 1


def test_reference_drafts_bump_one_on_odd_steps():
    greedy = list(range(100, 120))
    assert reference_drafts(greedy, 0, 0, 4, 1000) == [101, 102, 103]  # even step: untouched
    assert reference_drafts(greedy, 0, 1, 4, 1000) == [101, 103, 103]  # s=1: draft 1 + 1 % 3 = 2
    assert reference_drafts(greedy, 0, 3, 4, 1000) == [102, 102, 103]  # s=3: draft 1 + 3 % 3 = 1
    assert reference_drafts(greedy, 4, 5, 3, 1000) == [105, 107]  # s=5, K=3: draft 1 + 5 % 2 = 2
    assert reference_drafts([5, 999], 0, 1, 2, 1000) == [0]  # the bump wraps mod vocab
    assert reference_drafts([5], 0, 0, 3, 1000) == [0, 0]  # past the continuation: token 0


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def fp32_model(request):
    return load_model(request.param, dtype="float32")


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("k", [2, 3, 4])
def test_reference_commits_hf_greedy(fp32_model, k):
    prompt = fp32_model.encode("Verify the greedy equivalence of the reference feed.")
    steps = 12
    greedy = continuation(fp32_model, prompt, steps * k + 1)
    run = run_verify(fp32_model, prompt, k, steps, ReferenceFeed(greedy))
    committed = run.committed()
    hf = _hf_greedy(fp32_model, prompt, len(committed))
    assert committed == hf, f"first difference at {next(i for i, (a, b) in enumerate(zip(committed, hf)) if a != b)}"
    assert greedy[: len(committed)] == hf
    full = [s.accepted == k - 1 for s in run.steps]
    assert any(full) and not all(full), [s.accepted for s in run.steps]


def test_replay_feed_forces_tokens_and_accepts(fp32_model):
    prompt = fp32_model.encode("forced schedule")
    greedy = continuation(fp32_model, prompt, 3 * 6 + 1)
    ref = run_verify(fp32_model, prompt, 3, 6, ReferenceFeed(greedy))
    rep = run_verify(fp32_model, prompt, 3, 6, ReplayFeed(ref.steps, ref.bootstrap))
    assert rep.steps == ref.steps
    assert all(torch.equal(a, b) for a, b in zip(ref.rows, rep.rows))
    # A forced schedule is kept even where the model would have decided otherwise.
    forced = [Step(s.tokens, 0) for s in ref.steps]
    rep0 = run_verify(fp32_model, prompt, 3, 6, ReplayFeed(forced, ref.bootstrap))
    assert [s.accepted for s in rep0.steps] == [0] * 6
    assert rep0.computed[0] == ref.steps[0].accepted


def test_held_rows_lay_every_kind_out_in_order_and_a_replay_needs_no_read_back_to_start():
    """`Run.held` gives each kind's rows in layout order from its first row (what a comparison digests); a
    feed that knows its bootstrap token starts without reading the prefill's argmax back (the GPU runs on)."""
    from vd.loop import DrafterFeed
    from vd.models import load_model

    m = load_model("tiny-llama-mtp", device="cpu", dtype="float32")
    prompt = m.encode("rows in order")
    run = run_verify(m, prompt, 3, 5, DrafterFeed(3, 5))
    held = run.held()
    kinds = run.rows_by_kind()
    assert run.layout.counts == {n: t.shape[0] for n, t in kinds.items()} == {"prefill": len(prompt), "verify": 15,
                                                                               "draft": 11}
    assert [(kind, start) for kind, start, _ in held] == [("prefill", 0), ("verify", 0), ("draft", 0)]
    flat = torch.cat([t for _, _, t in held])
    assert torch.equal(torch.cat(list(kinds.values())), flat) and flat.shape[0] == run.layout.total

    def never() -> int:  # the prefill's greedy token, were it read back
        raise AssertionError("read back")

    assert ReplayFeed(run.steps, 7).start(m, run, never) == 7
    forced = ReplayFeed(run.steps, run.bootstrap, run.committed_before[0])
    again = run_verify(m, prompt, 3, 5, DrafterFeed(3, 5, forced))
    assert again.steps == run.steps and torch.equal(torch.cat(list(again.rows_by_kind().values())), flat)


def test_the_collector_is_paused_over_a_run_and_restored_after(fp32_model, monkeypatch):
    """No cyclic collection stops a step loop: the collector is off while forwards run and as it was after
    (also after a run that fails, and left off where the caller had it off)."""
    import gc

    seen = []
    forward = fp32_model.forward
    monkeypatch.setattr(fp32_model, "forward", lambda tokens: seen.append(gc.isenabled()) or forward(tokens))
    prompt = fp32_model.encode("a quiet loop")
    greedy = continuation(fp32_model, prompt, 2 * 4 + 1)
    assert gc.isenabled() and seen and not any(seen)
    seen.clear()
    with pytest.raises(AssertionError):  # the feed hands out too few tokens: the run fails mid-way
        run_verify(fp32_model, prompt, 3, 4, ReplayFeed([Step((1, 2), 0)] * 4, greedy[0]))
    assert gc.isenabled() and seen and not any(seen)
    gc.disable()
    try:
        run_verify(fp32_model, prompt, 2, 4, ReferenceFeed(greedy))
        assert not gc.isenabled()
    finally:
        gc.enable()
