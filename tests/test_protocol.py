"""The optional members of the model protocol: each accessor's default where a model lacks the member, its
value where it has it, and the conformance checks that hold a declared member to its contract (run here on
small hand-written fakes)."""

import re

import pytest
import torch

from vd import protocol
from vd.testing import ModelConformance


class Bare:
    """Only the required protocol (the members vd reads are all that matter here)."""

    vocab_size, device, dtype = 8, torch.device("cpu"), torch.float32


class Full(Bare):
    """Every optional member but the draft head."""

    owns_rows = True
    context_length = 64

    def __init__(self):
        self.prepared: list[tuple[int, list[int]]] = []

    def decode(self, ids):
        return "".join(map(chr, ids))

    def forward_uses_graphs(self, name):
        return name == "graphed"

    def prepare(self, capacity, lengths=()):
        self.prepared.append((capacity, list(lengths)))

    def environment(self):
        return {"engine": {"name": "fake", "build": 1}}


class Delegating:
    """A wrapper handing every other lookup to the model it wraps (as tests/plugins/misbehaving.py does)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_absent_members_read_as_their_defaults():
    m = Bare()
    assert protocol.decoder(m) is None and protocol.draft_head(m) is None
    assert protocol.uses_graphs(m, "eager") is False
    assert protocol.context_length(m) is None
    assert protocol.environment(m) == {}
    assert protocol.owns_rows(m) is False
    protocol.prepare(m, 10, [3])  # nothing to call: no error
    assert not any(protocol.declares(m, member) for member in protocol.OPTIONAL_MEMBERS)


def test_present_members_are_read_through_their_accessors():
    m = Full()
    assert protocol.decoder(m) is m and protocol.draft_head(m) is None
    assert protocol.uses_graphs(m, "graphed") is True and protocol.uses_graphs(m, "eager") is False
    assert protocol.context_length(m) == 64
    assert protocol.environment(m) == {"engine": {"name": "fake", "build": 1}}
    assert protocol.owns_rows(m) is True
    protocol.prepare(m, 10, [3, 1])
    assert m.prepared == [(10, [3, 1])]


def test_owns_rows_is_the_class_word_not_a_wrapped_models():
    """A wrapper that delegates lookups makes rows of its own: the wrapped adapter's ``owns_rows`` does not
    cover them, so vd watches them; every other member is the wrapped one's."""
    w = Delegating(Full())
    assert protocol.owns_rows(w) is False and not protocol.declares(w, "owns_rows")
    assert protocol.context_length(w) == 64 and protocol.uses_graphs(w, "graphed")


def test_a_non_callable_environment_adds_nothing():
    m = Bare()
    m.environment = {"engine": "not a method"}
    assert protocol.environment(m) == {}


def test_declares_knows_only_the_optional_members():
    with pytest.raises(AssertionError, match="not an optional member"):
        protocol.declares(Full(), "forward")


@pytest.mark.parametrize("member, value, message", [
    ("context_length", 0, "context_length is 0, expected a positive int"),
    ("context_length", True, "context_length is True, expected a positive int"),
    ("owns_rows", 1, "owns_rows is 1, expected True or False"),
])
def test_conformance_refuses_a_declared_attribute_out_of_contract(member, value, message):
    bad = type("Bad", (Full,), {member: value})()
    check = {"context_length": ModelConformance.test_context_length_is_positive,
             "owns_rows": ModelConformance.test_owns_rows_is_a_bool}[member]
    with pytest.raises(AssertionError, match=message):
        check(ModelConformance(), bad)


def test_conformance_refuses_an_environment_that_is_not_json():
    bad = type("Bad", (Full,), {"environment": lambda self: {"engine": object()}})()
    with pytest.raises(AssertionError, match="expected JSON-able values"):
        ModelConformance().test_environment_is_a_json_mapping(bad)


def test_conformance_refuses_a_graphs_answer_that_is_not_a_bool():
    bad = type("Bad", (Full,), {"forward_uses_graphs": lambda self, name: "yes",
                                "forwards": lambda self: {"eager": "plain"}})()
    with pytest.raises(AssertionError, match=r"forward_uses_graphs\('eager'\) returned 'yes', expected True"):
        ModelConformance().test_graphs_are_disclosed_per_forward(bad)


def test_conformance_refuses_part_of_a_draft_head():
    bad = type("Bad", (Full,), {"propose": lambda self, last, n: ([], None)})()
    with pytest.raises(AssertionError, match="offers propose of an MTP draft head but not head_info"):
        ModelConformance().test_draft_head_is_whole(bad)


def _factory(device="cpu", dtype="bfloat16"):
    return Bare()


@pytest.mark.parametrize("given, what", [
    (42, "an object of type int, which lacks default_forward, device, dtype, encode"),
    (_factory, r"the function _factory, which lacks .* \(a factory\? pass what it returns: model=factory\("),
    (Bare, r"the class Bare, which lacks default_forward, encode"),
])
def test_the_python_api_refuses_a_model_that_is_no_model_before_touching_a_golden(tiny_copy, tmp_path, given, what):
    """Each entry point that takes ``model=`` (replay, record, refresh, a suite's replay, locate) refuses an object
    that is not a `VerifyModel` as a TypeError naming the function, what it got and what that lacks, before it
    reads or writes a golden; the golden it was pointed at is as it was."""
    from vd.recorder import RecordSettings, record
    from vd.replayer import replay
    from vd.replayer.locate import locate
    from vd.workflow.declare import Entry
    from vd.workflow.refresh import refresh
    from vd.workflow.suite import replay_suite

    before = {p: p.read_bytes() for p in tiny_copy.rglob("*") if p.is_file()}
    calls = {
        "vd.replayer.replay()": lambda: replay(tiny_copy, model=given),
        "vd.recorder.record()": lambda: record(tmp_path / "new.zarr", RecordSettings(model="tiny-llama"), model=given),
        "vd.workflow.refresh()": lambda: refresh(tiny_copy, RecordSettings(model="tiny-llama"), reason="r",
                                                 model=given),
        "vd.workflow.suite.replay_suite()": lambda: replay_suite([Entry("tiny", str(tiny_copy))], model=given),
        "vd.replayer.locate.locate()": lambda: locate(tiny_copy, "eager", model=given),
    }
    for where, call in calls.items():
        with pytest.raises(TypeError, match=rf"^{re.escape(where)} takes a vd.protocol.VerifyModel as model=; got "
                                            rf"{what}"):
            call()
    assert not (tmp_path / "new.zarr").exists()
    assert {p: p.read_bytes() for p in tiny_copy.rglob("*") if p.is_file()} == before


def test_a_callable_engine_object_is_not_taken_for_a_factory():
    """An object that is merely callable (a torch module handed in unwrapped) is named by its type, with no
    advice to call it; a function or class is told to be called."""
    with pytest.raises(TypeError, match=r"got an object of type Linear, which lacks .* of the vd model protocol$"):
        protocol.require_model(torch.nn.Linear(2, 2), "f()")


@pytest.mark.parametrize("check", ["test_batch_of_one_is_forward", "test_members_rows_are_their_own"])
def test_conformance_skips_the_batch_checks_of_a_model_that_does_not_batch(check):
    """A model without batches is skipped, and the forward is not set back: a model whose default forward could not
    be set (its own failure, in `test_forwards_are_disclosed_and_selectable`) turned the skip into that KeyError
    (a user test)."""
    calls: list[str] = []

    def set_forward(self, name):
        calls.append(name)
        raise KeyError(name)

    model = type("NoBatch", (Full,), {"set_forward": set_forward, "default_forward": lambda self: "fast",
                                      "encode": lambda self, text: [1, 2, 3]})()
    with pytest.raises(pytest.skip.Exception, match="does not declare forward_batch"):
        getattr(ModelConformance(), check)(model)
    assert calls == []
