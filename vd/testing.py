"""The conformance suite every model adapter must pass (after zarr's shipped `StoreTests`).

Subclass `ModelConformance` in a test module and provide a ``model`` fixture returning a fresh
`vd.protocol.VerifyModel`; pytest then runs every check below against it::

    class TestMyEngine(ModelConformance):
        @pytest.fixture(scope="class")
        @classmethod
        def model(cls):
            return my_engine_adapter()

The checks are what the record/replay loop relies on: the protocol's shape, row shapes and dtypes,
bitwise repeatability of a step after a rewind, a rewind that really drops positions, and forwards
that are disclosed and selectable; and each optional member a model declares (`vd.protocol.OPTIONAL_MEMBERS`)
held to its contract: `decode` round-trips, a draft head is whole, ``forward_uses_graphs`` answers a bool for
every forward, ``context_length`` is a positive int, ``environment()`` is a JSON-able mapping, forwards still
work after `prepare`, ``owns_rows`` is a bool, and a batch (`BatchConformance`) of one is `forward` bit for bit
and gives each member its own rows. A check of a member the model does not declare is skipped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest
import torch

from vd.protocol import (
    DraftHead,
    EngineEnvironment,
    GraphedForwards,
    Preparable,
    VerifyModel,
    batched,
    context_length,
    declares,
    decoder,
    draft_head,
    protocol_members,
    tracer,
)


def _prompt(model: VerifyModel) -> list[int]:
    return model.encode("The conformance prompt: a few words to prefill.")[:24]


def _declared(model: object, member: str) -> None:
    """Skip the check of optional member ``member`` where ``model`` does not declare it."""
    if not declares(model, member):
        pytest.skip(f"the model does not declare {member} (optional: vd.protocol)")


def _json_fails(value: object) -> str | None:
    """Why ``value`` cannot be stored as JSON, or None where it can."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def _other_prompt(model: VerifyModel) -> list[int]:
    return model.encode("Another member of the batch, longer and unlike the first prompt in every way.")[:30]


def not_own_rows(got: torch.Tensor, own: torch.Tensor, other: torch.Tensor) -> str | None:
    """Why rows a batch gave a member (``got``) are not its own sequence's (``own``, the rows `forward` gives it),
    or None where they are: within 5 % of the row's scale (rounding), or, for an engine whose kernels change with
    the batch's shape by more (llama.cpp's quantized CUDA kernels moved SmolLM2 Q4_1's rows by 13-15 % of their
    scale), within 25 % and with the last row nearer its own sequence's last row than ``other``'s (the last row
    of another member's sequence at that step): not another member's rows, nor garbage."""
    got, own = got.float(), own.float()
    off, scale = (got - own).abs().max().item(), own.abs().max().item()
    if off <= 0.05 * scale:
        return None
    own_last, other_last = ((got[-1] - r.float()[-1]).abs().max().item() for r in (own, other))
    if off <= 0.25 * scale and own_last < other_last:
        return None
    return (f"rows off their own sequence's by {off:.4g} (row scale {scale:.4g}); the last row {own_last:.4g} from "
            f"its own, {other_last:.4g} from another member's")


class BatchConformance:
    """Checks for a model that runs batches (`vd.protocol.BatchedForwards`), each skipped where it does not;
    mixed into `ModelConformance`. Every check runs under each forward the model says can batch."""

    def _forwards(self, model) -> list[str]:
        _declared(model, "forward_batch")
        b = batched(model)
        assert b is not None, ("the model declares forward_batch but not every method of vd.protocol.BatchedForwards "
                               "(batch_forwards, reset_batch, forward_batch, rewind_batch, reorder_batch)")
        names = list(b.batch_forwards())
        if not names:
            pytest.skip("the model runs a batch under none of its forwards here (batch_forwards() is empty)")
        unknown = [n for n in names if n not in model.forwards()]
        assert not unknown, f"batch_forwards() names {unknown}, which are not among {list(model.forwards())}"
        return names

    @staticmethod
    def _single(model, steps: list[list[int]], rewinds: list[int]) -> list[torch.Tensor]:
        """The rows `forward` gives for ``steps``, with ``rewinds[i]`` positions dropped after step ``i``."""
        model.reset()
        out = []
        for tokens, back in zip(steps, rewinds):
            out.append(model.forward(tokens).clone())
            model.rewind(back)
        return out

    def test_batch_of_one_is_forward(self, model):
        """A batch of one computes, bit for bit, what `forward` does: prefill, a verify, a rewind, a verify."""
        steps, rewinds = [_prompt(model), [5, 6, 7, 8], [9, 10, 11]], [0, 2, 0]
        names = self._forwards(model)  # may skip: before the forward is switched and set back
        try:
            for name in names:
                model.set_forward(name)
                want = self._single(model, steps, rewinds)
                model.reset_batch(1, 64)
                for i, (tokens, back) in enumerate(zip(steps, rewinds)):
                    got = model.forward_batch([tokens])
                    assert isinstance(got, list) and len(got) == 1, f"{name}: forward_batch of one gave {got!r}"
                    assert got[0].dtype == model.dtype and tuple(got[0].shape) == (len(tokens), model.vocab_size)
                    assert torch.equal(got[0], want[i]), \
                        (f"{name}: step {i} of a batch of one differs from forward's by "
                         f"{(got[0].float() - want[i].float()).abs().max().item()}")
                    model.rewind_batch(0, back)
        finally:
            model.set_forward(model.default_forward())

    def test_members_rows_are_their_own(self, model):
        """In a batch of two (prompts of other lengths, then verifies of other widths, a rewind of one member
        only, a reorder) each member's rows are its own sequence's (`not_own_rows`)."""
        a_steps, a_back = [_prompt(model), [5, 6, 7], [9, 10]], [0, 2, 0]
        b_steps, b_back = [_other_prompt(model), [11, 12], [13, 14, 15]], [0, 0, 1]
        names = self._forwards(model)  # may skip: before the forward is switched and set back
        try:
            for name in names:
                model.set_forward(name)
                want = [self._single(model, a_steps, a_back), self._single(model, b_steps, b_back)]
                model.reset_batch(2, 96)
                order = [0, 1]  # which sequence (a: 0, b: 1) each slot holds
                for i in range(3):
                    if i == 2:
                        model.reorder_batch([1, 0])
                        order = [1, 0]
                    steps = [(a_steps, b_steps)[m][i] for m in order]
                    got = model.forward_batch(steps)
                    for slot, m in enumerate(order):
                        why = not_own_rows(got[slot], want[m][i], want[1 - m][i])
                        assert why is None, f"{name}: step {i}, slot {slot}: {why}"
                        model.rewind_batch(slot, (a_back, b_back)[m][i])
        finally:
            model.set_forward(model.default_forward())



class ModelConformance(BatchConformance):
    """Checks for one adapter; subclasses supply the ``model`` fixture."""

    @pytest.fixture
    def model(self) -> VerifyModel:  # pragma: no cover - always overridden
        raise NotImplementedError("subclass ModelConformance and define a `model` fixture")

    def test_satisfies_protocol(self, model):
        assert isinstance(model, VerifyModel)
        assert isinstance(model.vocab_size, int) and model.vocab_size > 1
        assert isinstance(model.device, torch.device)
        assert model.dtype in (torch.bfloat16, torch.float16, torch.float32)

    def test_identity_is_stable(self, model):
        a, b = model.identity(), model.identity()
        assert a.fingerprint and a.fingerprint == b.fingerprint
        assert a.name

    def test_encode_gives_vocab_ids(self, model):
        ids = _prompt(model)
        assert len(ids) >= 2
        assert all(isinstance(i, int) and 0 <= i < model.vocab_size for i in ids)

    def test_decode_round_trips(self, model):
        """Where a model can decode (the optional `vd.protocol.TokenDecoder`), ``decode(encode(text))``
        gives plain ASCII text back."""
        dec = decoder(model)
        if dec is None:
            pytest.skip("the model has no decode (optional: vd.protocol.TokenDecoder)")
        text = "The quick brown fox jumps over the lazy dog"
        ids = model.encode(text)
        got = dec.decode(ids)
        assert isinstance(got, str) and got == text, f"decode(encode({text!r})) = {got!r} (ids {ids})"

    def test_draft_head_is_whole(self, model):
        """A model that offers any member of the MTP draft head (`vd.protocol.DraftHead`) offers them all (vd
        sees no head in part of one), and its ``head_info()`` is a JSON-able mapping (stored in the golden)."""
        members = protocol_members(DraftHead)
        offered = [m for m in members if declares(model, m)]
        if not offered:
            pytest.skip("the model has no draft head (optional: vd.protocol.DraftHead)")
        missing = [m for m in members if m not in offered]
        assert draft_head(model) is not None, (f"the model offers {', '.join(offered)} of an MTP draft head but "
                                               f"not {', '.join(missing) or 'all as methods'}: offer every one "
                                               "of vd.protocol.DraftHead, or none")
        info = model.head_info()
        assert isinstance(info, Mapping), f"head_info() returned a {type(info).__name__}, expected a mapping"
        why = _json_fails(dict(info))
        assert why is None, f"head_info() returned {info!r}, expected a JSON-able mapping ({why})"

    def test_graphs_are_disclosed_per_forward(self, model):
        """Where a model says which forwards replay CUDA graphs (`vd.protocol.GraphedForwards`), it answers a
        bool for every forward it offers."""
        _declared(model, "forward_uses_graphs")
        assert isinstance(model, GraphedForwards), "forward_uses_graphs is declared but is not a method"
        for name in model.forwards():
            got = model.forward_uses_graphs(name)
            assert isinstance(got, bool), f"forward_uses_graphs({name!r}) returned {got!r}, expected True or False"

    def test_context_length_is_positive(self, model):
        """Where a model says how many positions it holds, ``context_length`` is a positive int (None: unknown)."""
        _declared(model, "context_length")
        n = model.context_length
        assert n is None or (isinstance(n, int) and not isinstance(n, bool) and n > 0), \
            f"context_length is {n!r}, expected a positive int (or None where the model does not know)"
        assert context_length(model) == n

    def test_environment_is_a_json_mapping(self, model):
        """Where a model adds fields to the golden's environment (`vd.protocol.EngineEnvironment`),
        ``environment()`` returns a mapping of string keys to JSON-able values."""
        _declared(model, "environment")
        assert isinstance(model, EngineEnvironment), "environment is declared but is not a method"
        fields = model.environment()
        assert isinstance(fields, Mapping), f"environment() returned a {type(fields).__name__}, expected a mapping"
        keys = [k for k in fields if not isinstance(k, str)]
        assert not keys, f"environment() has keys {keys!r}, expected strings"
        why = _json_fails(dict(fields))
        assert why is None, f"environment() returned {dict(fields)!r}, expected JSON-able values ({why})"

    def test_forwards_work_after_prepare(self, model):
        """Where a model can be prepared (`vd.protocol.Preparable`), each forward, prepared for a prefill and a
        3-token verify, then reset, still returns rows of the protocol's shape and dtype."""
        _declared(model, "prepare")
        assert isinstance(model, Preparable), "prepare is declared but is not a method"
        prompt = _prompt(model)
        try:
            for name in model.forwards():
                model.set_forward(name)
                model.prepare(len(prompt) + 8, [len(prompt), 3])
                model.reset()
                for tokens in (prompt, [1, 2, 3]):
                    rows = model.forward(tokens)
                    want = (len(tokens), model.vocab_size)
                    assert tuple(rows.shape) == want and rows.dtype == model.dtype, \
                        (f"forward {name!r} after prepare returned {rows.dtype} rows of shape {list(rows.shape)}, "
                         f"expected {model.dtype} rows of shape {list(want)}")
        finally:
            model.set_forward(model.default_forward())

    def test_tracing_leaves_the_rows_alone(self, model):
        """Where a model traces its modules (`vd.protocol.ModuleTrace`), each forward it traces gives bit-identical
        rows with the trace on, and records named outputs of one row per token."""
        _declared(model, "trace")
        t = tracer(model)
        assert t is not None, "the model declares trace but not trace_forwards (vd.protocol.ModuleTrace)"
        prompt = _prompt(model)
        try:
            for name in t.trace_forwards():
                model.set_forward(name)
                model.reset()
                plain = model.forward(prompt).clone()
                seen: list[tuple[str, str, torch.Tensor]] = []
                model.reset()
                with t.trace(lambda n, w, x, seen=seen: seen.append((n, w, x))):
                    traced = model.forward(prompt)
                assert torch.equal(plain, traced), f"{name}: tracing changed the rows"
                assert seen and all(isinstance(n, str) and n and isinstance(w, str) and x.shape[0] == len(prompt)
                                    for n, w, x in seen), f"{name}: trace recorded {[(n, w) for n, w, _ in seen][:3]}"
        finally:
            model.set_forward(model.default_forward())

    def test_owns_rows_is_a_bool(self, model):
        """Where a model's class vouches for its rows (``owns_rows``), it says True or False."""
        _declared(model, "owns_rows")
        v = type(model).owns_rows
        assert isinstance(v, bool), f"{type(model).__name__}.owns_rows is {v!r}, expected True or False"

    def test_forward_rows(self, model):
        model.reset()
        prompt = _prompt(model)
        rows = model.forward(prompt)
        assert isinstance(rows, torch.Tensor), f"forward returned a {type(rows).__name__}, expected a torch.Tensor"
        want = [len(prompt), model.vocab_size]
        assert list(rows.shape) == want, \
            f"forward of {len(prompt)} tokens returned shape {list(rows.shape)}, expected {want}"
        assert rows.dtype == model.dtype, (f"forward returned {rows.dtype} rows and the model says its dtype is "
                                           f"{model.dtype}: rows must be of model.dtype")
        assert rows.device.type == model.device.type, \
            f"forward returned rows on {rows.device}, expected the model's device {model.device}"
        step = model.forward([1, 2, 3])
        assert tuple(step.shape) == (3, model.vocab_size), \
            f"forward of 3 tokens returned shape {list(step.shape)}, expected {[3, model.vocab_size]}"

    def test_returned_rows_are_owned(self, model):
        """Rows a forward returned stay as they were after a rewind and later forwards: vd holds them until
        the run lets them go, so an adapter must return a tensor it does not reuse (a view of a reused output
        buffer, such as llama-cpp-python's logits array, is not)."""
        model.reset()
        model.forward(_prompt(model))
        kept = model.forward([5, 6, 7])
        before = kept.clone()
        model.rewind(2)
        model.forward([8, 9])
        model.forward([10])
        moved = (kept.float() - before.float()).abs().max().item()
        assert torch.equal(kept, before), (f"rows returned by forward changed (max |Δ| {moved}) after a rewind and "
                                           "two later forwards: return a tensor the adapter does not reuse (clone "
                                           "its output buffer)")

    def test_repeat_after_rewind_is_bitwise(self, model):
        model.reset()
        model.forward(_prompt(model))
        first = model.forward([5, 6, 7, 8]).clone()
        model.rewind(4)
        again = model.forward([5, 6, 7, 8])
        assert torch.equal(first, again), f"max_diff={(first.float() - again.float()).abs().max()}"

    def test_fresh_sequences_are_bitwise_equal(self, model):
        runs = []
        for _ in range(2):
            model.reset()
            pre = model.forward(_prompt(model)).clone()
            runs.append((pre, model.forward([9, 10, 11]).clone()))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])

    def test_rewind_drops_positions(self, model):
        """After appending three tokens and rewinding two, the next token sits where the rewound one
        was: its row matches the row a never-extended sequence gives (to rounding, since the shapes
        of the two forwards differ) and differs from the row without the rewind."""
        prompt = _prompt(model)
        model.reset()
        model.forward(prompt)
        model.forward([20, 21, 22])
        model.rewind(2)
        rewound = model.forward([23]).float()
        model.reset()
        model.forward(prompt)
        model.forward([20])
        straight = model.forward([23]).float()
        model.reset()
        model.forward(prompt)
        model.forward([20, 21, 22])
        unrewound = model.forward([23]).float()
        scale = straight.abs().max().item()
        close = (rewound - straight).abs().max().item()
        far = (unrewound - straight).abs().max().item()
        assert close <= 0.05 * scale, f"rewound row off by {close} (row scale {scale})"
        assert far > close, f"a rewind changed nothing: without it the row is off by {far}, with it {close}"

    def test_forwards_are_disclosed_and_selectable(self, model):
        fw = model.forwards()
        assert fw and all(isinstance(n, str) and isinstance(d, str) and d for n, d in fw.items())
        assert model.default_forward() in fw
        for name in fw:
            model.set_forward(name)
            model.reset()
            assert model.forward(_prompt(model)).shape[-1] == model.vocab_size
        model.set_forward(model.default_forward())
        with pytest.raises(KeyError):
            model.set_forward("no-such-forward")


class DraftHeadConformance:
    """Checks for a model with an MTP draft head (`vd.protocol.DraftHead`); supply ``model``."""

    @pytest.fixture
    def model(self):  # pragma: no cover - always overridden
        raise NotImplementedError("subclass DraftHeadConformance and define a `model` fixture")

    def _bootstrap(self, model) -> int:
        prompt = _prompt(model)
        model.reset()
        pre = model.forward(prompt)
        model.save_hidden(len(prompt) - 1)
        t0 = int(pre[-1].argmax())
        row = model.forward([t0])
        model.save_hidden(0)
        return int(row[0].argmax())

    def test_satisfies_protocol(self, model):
        assert isinstance(model, DraftHead)
        info = model.head_info()
        for key in ("name", "fingerprint", "hidden", "trim"):
            assert info.get(key), key
        assert model.head_info()["fingerprint"] == info["fingerprint"]

    def test_propose_shapes_and_argmax(self, model):
        last = self._bootstrap(model)
        drafts, rows = model.propose(last, 3)
        assert len(drafts) == 3 and all(isinstance(d, int) and 0 <= d < model.vocab_size for d in drafts)
        assert tuple(rows.shape) == (3, model.vocab_size) and rows.dtype == model.dtype
        assert drafts == rows.argmax(-1).tolist()

    def test_propose_is_deterministic(self, model):
        outs = []
        for _ in range(2):
            last = self._bootstrap(model)
            outs.append(model.propose(last, 3))
        assert outs[0][0] == outs[1][0] and torch.equal(outs[0][1], outs[1][1])

    def test_trim_forgets_the_speculation(self, model):
        """A proposal of 3 drafts then a trim leaves the head as a proposal of 1 would: the next
        proposal after the same verify is bitwise the same."""
        results = []
        for n in (3, 1):
            last = self._bootstrap(model)
            drafts, _ = model.propose(last, n)
            model.trim_proposer()
            tokens = [last, drafts[0], 7, 8]
            rows = model.forward(tokens)
            na = 1 if int(rows[0].argmax()) == drafts[0] else 0
            model.rewind(3 - na)
            model.save_hidden(na)
            model.trim_proposer()
            results.append(model.propose(int(rows[na].argmax()), 3))
        assert results[0][0] == results[1][0] and torch.equal(results[0][1], results[1][1])

