"""The HF adapter's batches (`vd.models.batch`): members of other lengths get their own sequences' rows, a
batch of one is `forward` bit for bit, and neither the batch nor the single sequence disturbs the other."""

import pytest
import torch

from vd.models import load_model
from vd.models.batch import BatchRunner
from vd.models.static import StaticRunner

PROMPTS = ("The first member's prompt, of middling length.", "Second: a longer prompt than the first one, by far.",
           "Third.")
# Each member's steps after its prompt (other widths per step; an empty step appends nothing) and rewinds.
STEPS = (([5, 6, 7], [9, 10], [1], [2, 3, 4, 5]), ([11, 12], [13, 14, 15], [], [2]), ([4], [7, 8, 9, 10], [5], [6]))
BACKS = ((2, 0, 0, 0), (0, 1, 0, 0), (1, 0, 0, 0))
ORDER = (2, 0, 1)  # the reorder before step 2


@pytest.fixture(scope="module")
def qwen():
    return load_model("tiny-qwen2", dtype="float32")


def _members(model):
    return [([model.encode(p)[:30], *s], (0, *b)) for p, s, b in zip(PROMPTS, STEPS, BACKS)]


def _single(model, steps, backs):
    model.reset()
    out = []
    for tokens, back in zip(steps, backs):
        out.append(model.forward(tokens).clone() if tokens else None)
        model.rewind(back)
    return out


def _batched(run, members, order=ORDER):
    """Rows of each member (by member, not slot) from a batch ``run`` (forward, rewind, reorder callables)."""
    forward, rewind, reorder = run
    slots, got = list(range(len(members))), [[] for _ in members]
    for i in range(len(members[0][0])):
        if i == 2:
            reorder(list(order))
            slots = [slots[j] for j in order]
        rows = forward([members[m][0][i] for m in slots])
        for slot, m in enumerate(slots):
            assert tuple(rows[slot].shape) == (len(members[m][0][i]), rows[slot].shape[-1])
            got[m].append(rows[slot] if members[m][0][i] else None)
            rewind(slot, members[m][1][i])
    return got


def _assert_close(got, want, rel):
    for member_got, member_want in zip(got, want):
        for g, w in zip(member_got, member_want):
            if w is not None:
                off = (g.float() - w.float()).abs().max().item()
                assert off <= rel * w.abs().max().item(), f"off by {off}"


def test_members_of_a_batch_of_three_get_their_own_rows(qwen):
    """Three members (prompts of other lengths, steps of other widths, an empty step, per-member rewinds, a
    reorder): each member's rows are its single sequence's to float32 rounding, under every forward."""
    members = _members(qwen)
    try:
        for name in qwen.batch_forwards():
            qwen.set_forward(name)
            want = [_single(qwen, *m) for m in members]
            qwen.reset_batch(3, 96)
            got = _batched((qwen.forward_batch, qwen.rewind_batch, qwen.reorder_batch), members)
            _assert_close(got, want, 1e-4)
    finally:
        qwen.set_forward("eager")


def test_hf_modules_static_batch(qwen):
    """The static batch over HF's own modules (architectures vd's lean step does not run) against HF's modules
    over the single static cache."""
    members = _members(qwen)
    qwen.set_forward("static")
    try:
        hf = StaticRunner(qwen.model, "static", hidden=False, lean=False)
        with torch.inference_mode():
            want = [_hf_single(hf, steps, backs) for steps, backs in members]
        b = BatchRunner(qwen.model, "static", 3, 96)
        assert not b.lean
        _assert_close(_batched((b.forward, b.rewind, b.reorder), members), want, 1e-4)
    finally:
        qwen.set_forward("eager")


def _hf_single(runner, steps, backs):
    runner.reset()
    out = []
    for tokens, back in zip(steps, backs):
        out.append(runner.forward(tokens)[0].clone() if tokens else None)
        runner.rewind(back)
    return out


@pytest.mark.parametrize("forward", ["eager", "sdpa", "static"])
def test_batch_and_sequence_leave_each_other_alone(forward):
    """A batch stepped between the single sequence's steps changes none of its rows (bit for bit), and a batch
    of one (its own state) is the single sequence's rows bit for bit, though the single sequence was prepared
    for another capacity."""
    m = load_model("tiny-llama")
    m.set_forward(forward)
    prompt = m.encode(PROMPTS[0])
    m.prepare(300)
    m.reset()
    alone = [m.forward(prompt).clone(), m.forward([5, 6, 7]).clone()]
    m.rewind(2)
    alone.append(m.forward([8, 9]).clone())
    m.reset()
    mixed = [m.forward(prompt).clone()]
    for n in (1, 3):
        m.reset_batch(n, 64)
        m.forward_batch([prompt[:n + 4]] * n)
    mixed.append(m.forward([5, 6, 7]).clone())
    m.forward_batch([[1, 2]] * 3)
    m.rewind(2)
    mixed.append(m.forward([8, 9]).clone())
    assert all(torch.equal(a, b) for a, b in zip(alone, mixed))
    m.reset_batch(1, 64)
    one = [m.forward_batch([prompt])[0], m.forward_batch([[5, 6, 7]])[0]]
    m.rewind_batch(0, 2)
    one.append(m.forward_batch([[8, 9]])[0])
    assert all(torch.equal(a, b) for a, b in zip(alone, one))


def test_batch_refuses_what_it_cannot_run():
    m = load_model("tiny-llama")
    with pytest.raises(RuntimeError, match="reset_batch starts one"):
        m.forward_batch([[1]])
    m.reset_batch(2, 16)
    with pytest.raises(ValueError, match="2"):
        m.forward_batch([[1]])
    with pytest.raises(ValueError, match="permutation"):
        m.reorder_batch([0, 0])
    with pytest.raises(ValueError, match="rewind"):
        m.rewind_batch(1, 1)
    with pytest.raises(RuntimeError, match="holds 256 positions"):
        m.forward_batch([[1] * 257, [2]])
    m.set_forward("sdpa")
    with pytest.raises(RuntimeError, match="no batch under forward 'sdpa'"):
        m.forward_batch([[1], [2]])
