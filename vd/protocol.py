"""The model protocol: what vd needs from an engine to record and replay its verify path.

Structural (`typing.Protocol`): an engine fits without inheriting from anything. An adapter wraps one
sequence's state (its KV cache) and exposes a single `forward` that appends tokens at the current
position and returns one logits row per token; prefill, decode and a K-token verify are all calls of it.
`vd.testing.ModelConformance` is the test class every adapter must pass. vd checks every forward's rows
against the protocol (`vd.loop.checked`): ``[len(tokens), vocab_size]`` of the model's ``dtype``, else exit 2
naming what came back.

Optional members. An adapter may offer more; each optional member is described here, with what vd assumes
where it is absent, and vd reads it only through the accessor beside it (never ``getattr`` at a call site):

================================  ======================  ===================================================
member                            accessor                where absent
================================  ======================  ===================================================
``decode(ids)``                   `decoder`               reports show bare token ids
``head_info``, ``save_hidden``,   `draft_head`            no MTP draft head: ``--feed mtp`` is refused
``trim_proposer``, ``propose``
``forward_uses_graphs(name)``     `uses_graphs`           every forward runs its kernels one by one (eager)
``context_length``                `context_length`        no run is refused for its length before it starts
``prepare(capacity, lengths)``    `prepare`               nothing is sized ahead: the first steps allocate
``environment()``                 `environment`           the golden's environment gets no engine fields
``owns_rows`` (on the class)      `owns_rows`             vd watches the rows (`vd.loop.Run.check_returned`)
``trace_forwards``, ``trace``     `tracer`                no module outputs: ``vd locate`` is refused, naming it
``batch_forwards``,               `batched`               no batch: ``--batch N`` is refused, naming the model
``reset_batch``, ``forward_batch``,
``rewind_batch``, ``reorder_batch``
================================  ======================  ===================================================

The methods among them are runtime-checkable protocols (`TokenDecoder`, `DraftHead`, `GraphedForwards`,
`Preparable`, `EngineEnvironment`, `BatchedForwards`, `ModuleTrace`) that hold each one's contract;
`vd.testing.ModelConformance` checks every one an adapter declares.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """Who a model is, as stored in a golden.

    Attributes
    ----------
    name : str
        Human-readable name (architecture and checkpoint), for display.
    fingerprint : str
        ``sha256:<hex>`` over the weights as loaded (names, dtypes, shapes, bytes) and the config fields
        that change the arithmetic. Two models with the same fingerprint compute the same function. An
        engine that is not HF covers what decides its function: the model file's content hash (not its
        path), the quantisation and any config it applies; not its version, threads or build flags, which
        are the build (its ``environment()``, below), so the same model run by another build keeps its
        fingerprint and a replay reports the build's differences.
    details : dict
        Anything else worth storing (architecture, parameter count, config summary).
    """

    name: str
    fingerprint: str
    details: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class VerifyModel(Protocol):
    """One model and one sequence's state, driven token by token.

    Attributes
    ----------
    vocab_size : int
        Width of a logits row.
    device : torch.device
        Where `forward` computes and returns its rows.
    dtype : torch.dtype
        The dtype of the returned logits rows (bfloat16, float16 or float32): the dtype the factory was
        asked for (``factory(device=, dtype=)``). An engine that computes in float32 whatever it is asked
        returns float32 rows and says so here; a replay refuses a model whose dtype is not the golden's
        (exit 2), so record and replay such an engine with ``--dtype float32``.

    Notes
    -----
    The contract, checked by `vd.testing.ModelConformance`:

    * `reset()` starts an empty sequence. `forward(tokens)` appends ``len(tokens)`` tokens at positions
      ``length .. length + len(tokens) - 1`` and returns a ``[len(tokens), vocab_size]`` tensor whose row
      ``i`` is the next-token logits after token ``i``; the sequence grows by ``len(tokens)``.
    * `rewind(n)` drops the last ``n`` positions, so a later `forward` overwrites them; rewinding and
      repeating the same `forward` gives bitwise the same rows.
    * `forward` is deterministic for a fixed forward, device and thread count.
    * `set_forward(name)` switches the implementation (attention kernel, compiled, graphed, ...) without
      changing the weights; `forwards()` names each and says what it is.
    * The rows `forward` returns are the caller's: vd holds them until its run lets them go (and compares or
      stores them then), so they must not change after a rewind or a later forward. Return a tensor the
      engine does not reuse (clone an output buffer) and does not change afterwards. Rows in memory the run
      still holds are refused as an internal error naming the adapter (exit 3, `vd.errors.AdapterError`), and
      so are rows whose digest when the run lets them go is not their digest when they were returned (an
      adapter class that sets ``owns_rows = True``, as vd's own do, is not watched so).
    * Threads: the factory is given only ``device`` and ``dtype``. vd sets torch's thread count
      (``--threads``, else the recording's) before it calls the factory; an engine with its own threads
      reads ``torch.get_num_threads()`` there.
    * Optional members (decoding, a draft head, graphs, a context length, `prepare`, an engine environment,
      ``owns_rows``) are not part of this protocol, so an engine without them still fits: the module's
      docstring lists them, and the accessors below read them.
    """

    vocab_size: int
    device: torch.device
    dtype: torch.dtype

    def identity(self) -> ModelIdentity:
        """The model's name and weight fingerprint."""
        ...

    def forwards(self) -> Mapping[str, str]:
        """Every forward this model offers, name to a one-line disclosure of what it runs."""
        ...

    def default_forward(self) -> str:
        """The forward `vd record` uses when none is named."""
        ...

    def set_forward(self, name: str) -> None:
        """Select a forward by name; raise ``KeyError`` for an unknown name."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt."""
        ...

    def reset(self) -> None:
        """Start a new, empty sequence."""
        ...

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens`` and return their ``[len(tokens), vocab_size]`` logits rows."""
        ...

    def rewind(self, n: int) -> None:
        """Drop the last ``n`` positions of the sequence (``n >= 0``)."""
        ...


@runtime_checkable
class TokenDecoder(Protocol):
    """The optional decoding capability: token ids back to text, so reports can show what a step verified.

    Notes
    -----
    Read through `decoder`; where it is absent, reports show bare ids. ``decode(encode(text))`` gives
    ``text`` back for plain ASCII text; `vd.testing.ModelConformance` checks that where a model has `decode`.
    """

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, as the model's tokenizer (or its byte encoding) writes them."""
        ...


@runtime_checkable
class DraftHead(Protocol):
    """The optional MTP capability: a multi-token-prediction draft head that proposes drafts.

    Notes
    -----
    Read through `draft_head`. The drafter feed drives it as a speculative scheduler does: after the prefill
    and a bootstrap decode, and after every verify, `save_hidden` the accepted rows, `trim_proposer`, then
    `propose`. The head's outputs (each draft's logits row) are recorded and diffed like the verify rows.
    `vd.testing.DraftHeadConformance` checks a head's behaviour.
    """

    def head_info(self) -> Mapping[str, Any]:
        """The head's name, fingerprint, and how it is driven: which hidden state feeds it (after the
        final norm or before), how its cache is trimmed, where its entries sit."""
        ...

    def save_hidden(self, row: int) -> None:
        """Rows ``0 .. row`` of the last `forward` are committed; keep their hidden states for the head
        (row ``row`` is the accepted row whose argmax is the next ``last``)."""
        ...

    def trim_proposer(self) -> None:
        """Drop the head's state past the committed prefix (what the last proposal speculated)."""
        ...

    def propose(self, last: int, n: int) -> tuple[list[int], torch.Tensor]:
        """Propose ``n`` drafts autoregressively after ``last``; return them and their ``[n, V]`` logits."""
        ...


@runtime_checkable
class GraphedForwards(Protocol):
    """The optional disclosure of which forwards replay CUDA graphs.

    Notes
    -----
    Read through `uses_graphs`. A golden and a replay's report say, per forward, whether its steps ran as
    captured CUDA graphs (``graphs``: ``graphed`` or ``eager``); a model without this member runs every
    forward's kernels one by one.
    """

    def forward_uses_graphs(self, name: str) -> bool:
        """Whether forward ``name`` (one of `VerifyModel.forwards`) replays its steps as CUDA graphs."""
        ...


@runtime_checkable
class Preparable(Protocol):
    """The optional preparation before a run: size a static cache and capture step graphs ahead of time.

    Notes
    -----
    Called through `prepare` by record and replay before their runs (and before any timing), for the
    selected forward. It may start a new sequence (a static cache is rewritten from position 0); afterwards
    every forward still meets the protocol. A model without it allocates on its first steps.
    """

    def prepare(self, capacity: int, lengths: Sequence[int] = ()) -> None:
        """Ready the selected forward for sequences of up to ``capacity`` positions and steps of each of
        ``lengths`` tokens (largest first: the prefill, each K, a one-token decode)."""
        ...


@runtime_checkable
class EngineEnvironment(Protocol):
    """The optional engine environment: fields an engine adds to the golden's environment.

    Notes
    -----
    Read through `environment` (`vd.env.of_model` merges it into what vd captures). An engine puts its version
    and build flags under ``engine`` (a mapping), which a replay compares with the recording's and lists
    among the numerics differences, as it does ``tp`` and ``collectives`` (`vd.env.NUMERIC_FIELDS`). The
    mapping is stored as JSON: strings, numbers, booleans, None, lists and mappings of them.
    """

    def environment(self) -> Mapping[str, Any]:
        """The fields to add to the golden's environment, JSON-able."""
        ...


@runtime_checkable
class BatchedForwards(Protocol):
    """The optional batch: several sequences stepped by one forward call, as a serving engine batches requests.

    Notes
    -----
    Read through `batched`; ``vd replay --batch N`` (`vd.batch`) runs a golden's sequence as one member of a batch
    of N. The batch is a second state beside the single sequence of `VerifyModel.forward`: `reset_batch` starts
    it, for the selected forward, and neither state disturbs the other's rows. Members are numbered by their slot
    in the batch, ``0 .. n-1``. The contract, checked by `vd.testing.BatchConformance`:

    * ``forward_batch(tokens)``: member ``i`` appends ``tokens[i]`` (one token or more; members may append
      different numbers, as a prefill beside a verify does) in one call of the engine, and gets back its own
      ``[len(tokens[i]), vocab_size]`` rows of the model's dtype, owned as `VerifyModel.forward`'s are.
    * A batch of one computes what `VerifyModel.forward` computes, bit for bit; in a larger batch each member's
      rows are its own sequence's (to rounding: a kernel may sum in another order for another batch shape,
      which is what ``--batch`` measures).
    * ``rewind_batch(member, n)`` drops member ``member``'s last ``n`` positions and no other member's;
      ``reorder_batch(order)`` moves the members so that slot ``i`` holds what slot ``order[i]`` held (a
      scheduler compacting or reordering its batch), and the sequences go on as they were.
    """

    def batch_forwards(self) -> Collection[str]:
        """The forwards (of `VerifyModel.forwards`) that can run a batch."""
        ...

    def reset_batch(self, n: int, capacity: int) -> None:
        """Start ``n`` empty sequences under the selected forward, each to hold up to ``capacity`` positions."""
        ...

    def forward_batch(self, tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Member ``i`` appends ``tokens[i]``; each member's ``[len(tokens[i]), vocab_size]`` rows, in slot order."""
        ...

    def rewind_batch(self, member: int, n: int) -> None:
        """Drop the last ``n`` positions of member ``member`` (``n >= 0``)."""
        ...

    def reorder_batch(self, order: Sequence[int]) -> None:
        """Slot ``i`` takes the sequence slot ``order[i]`` held (``order`` a permutation of the slots)."""
        ...


@runtime_checkable
class ModuleTrace(Protocol):
    """The optional trace: each traced module's output, as the forward computes it (``vd locate``).

    Notes
    -----
    Read through `tracer`. Inside ``with model.trace(record):`` every `VerifyModel.forward` calls
    ``record(name, what, output)`` for each traced point in the order the forward computes them: ``name`` a
    module's path (``model.layers.3.mlp.down_proj``), ``what`` what it is (``MLP down-projection``), ``output``
    its ``[len(tokens), ...]`` tensor for the call's tokens (a view the forward may reuse later: the caller copies
    what it keeps; a value without one row per token is skipped). In a batch (`BatchedForwards.forward_batch`,
    ``vd locate --between batch:N``) each point is handed once for the whole batch, ``[n, L, ...]``: member ``i``
    along the first dimension, right-padded to the longest member's ``L`` (a trace handing none so is refused).
    Tracing must not change the forward's rows. Only
    the forwards `trace_forwards` names are traced: those whose kernels the trace follows (vd's HF adapter: HF's
    modules through hooks, its lean static step through the record it is handed, graphed ones without the graph,
    compiled ones at their regions' edges; `vd.models.trace`, `vd.models.lean`). The points a trace hands over
    are the adapter's declaration of them: a golden recorded with ``--trace`` lists them.
    """

    def trace_forwards(self) -> Collection[str]:
        """The forwards (of `VerifyModel.forwards`) whose module outputs `trace` records."""
        ...

    def trace(self, record: Callable[[str, str, torch.Tensor], None]) -> contextlib.AbstractContextManager[None]:
        """A context in which every forward hands each traced module's output to ``record``."""
        ...


# -- the accessors: how vd reads each optional member, and its default -------------------------------------

# Every optional member, as the module's docstring lists them.
OPTIONAL_MEMBERS = ("decode", "head_info", "save_hidden", "trim_proposer", "propose", "forward_uses_graphs",
                    "context_length", "prepare", "environment", "owns_rows", "batch_forwards", "reset_batch",
                    "forward_batch", "rewind_batch", "reorder_batch", "trace_forwards", "trace")


def declares(model: object, member: str) -> bool:
    """Whether ``model`` declares the optional member ``member`` (``owns_rows`` on its class), whatever its value:
    the members `vd.testing.ModelConformance` holds to their contracts."""
    assert member in OPTIONAL_MEMBERS, f"{member!r} is not an optional member of the model protocol"
    return hasattr(type(model) if member == "owns_rows" else model, member)


def decoder(model: object) -> TokenDecoder | None:
    """The model as a `TokenDecoder`, or None where it cannot decode (reports show bare ids)."""
    return model if isinstance(model, TokenDecoder) else None


def draft_head(model: object) -> DraftHead | None:
    """The model as a `DraftHead`, or None where it has no MTP draft head (or only part of one)."""
    return model if isinstance(model, DraftHead) else None


def uses_graphs(model: object, forward: str) -> bool:
    """Whether ``model``'s forward ``forward`` replays CUDA graphs (`GraphedForwards`); False where the model
    does not say."""
    return isinstance(model, GraphedForwards) and bool(model.forward_uses_graphs(forward))


def tracer(model: object) -> ModuleTrace | None:
    """The model as a `ModuleTrace`, or None where it cannot trace its modules' outputs."""
    return model if isinstance(model, ModuleTrace) else None


def batched(model: object) -> BatchedForwards | None:
    """The model as a `BatchedForwards`, or None where it cannot run a batch (or only part of one)."""
    return model if isinstance(model, BatchedForwards) else None


def context_length(model: object) -> int | None:
    """Positions ``model`` holds (its ``context_length`` attribute, or property): a run that needs more is
    refused before its first step. None where the model does not say, or says None (unknown)."""
    n = getattr(model, "context_length", None)
    return n if isinstance(n, int) else None


def prepare(model: object, capacity: int, lengths: Sequence[int]) -> None:
    """Let ``model`` size itself for ``capacity`` positions and steps of ``lengths`` tokens (`Preparable`);
    nothing where it cannot."""
    if isinstance(model, Preparable):
        model.prepare(capacity, lengths)


def environment(model: object) -> dict[str, Any]:
    """The fields ``model`` adds to the golden's environment (`EngineEnvironment`); none where it adds none."""
    return dict(model.environment()) if isinstance(model, EngineEnvironment) and callable(model.environment) else {}


def owns_rows(model: object) -> bool:
    """Whether ``model``'s class vouches that every forward returns a new tensor it never changes afterwards
    (a class attribute ``owns_rows = True``, as vd's own adapters set), so vd need not watch the rows it holds
    (`vd.loop.Run.check_returned`); False, watched, where the class does not say. Read from the class, not the
    instance: a wrapper that hands attribute lookups to an adapter (``__getattr__``) makes rows of its own, and
    the adapter's word does not cover them."""
    return bool(getattr(type(model), "owns_rows", False))


# -- how vd names an adapter in its errors -----------------------------------------------------------------

PLUGIN_SPEC = "_vd_plugin"  # the attribute `mark_plugin` sets on a plug-in's model (errors name it)


def mark_plugin(model: object, spec: str) -> None:
    """Note on a plug-in's model the spec that loaded it, for the errors that name it (`adapter_name`); a model
    that takes no new attributes (``__slots__``) is named by its class."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(model, PLUGIN_SPEC, spec)


def adapter_name(model: object) -> str:
    """How errors name a model adapter: the plug-in spec that loaded it (`mark_plugin`), else its class."""
    return getattr(model, PLUGIN_SPEC, None) or f"{type(model).__module__}.{type(model).__qualname__}"


def protocol_members(proto: type = VerifyModel) -> list[str]:
    """The attribute and method names a protocol requires (``__protocol_attrs__`` is Python 3.12+)."""
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    return sorted(names)


def not_a_model(model: object) -> str | None:
    """None where ``model`` fits `VerifyModel`; else what it is and what of the protocol it lacks, for an
    error's line."""
    if isinstance(model, VerifyModel):
        return None
    missing = ", ".join(n for n in protocol_members() if not hasattr(model, n))
    if model is None:
        what = "None"
    elif _factory_like(model):
        what = f"the {'class' if isinstance(model, type) else 'function'} {getattr(model, '__qualname__', '?')}"
    else:
        what = f"an object of type {type(model).__name__}"
    return f"{what}, which lacks {missing} of the vd model protocol"


def _factory_like(model: object) -> bool:
    """A class, function or method: something that makes a model, handed in where the model belongs (an engine
    object that is merely callable, a torch module say, is not one)."""
    return isinstance(model, type) or inspect.isfunction(model) or inspect.ismethod(model)


def require_model(model: object, where: str) -> None:
    """Refuse, as a TypeError (a mistake in the caller's code, as a bad keyword is), a ``model`` handed to the
    Python API ``where`` that is not a `VerifyModel`: before anything reads a golden or writes one. None is no
    model handed in (the golden's or the settings' own is loaded) and passes."""
    if model is not None and (why := not_a_model(model)) is not None:
        called = " (a factory? pass what it returns: model=factory(device=..., dtype=...))" if _factory_like(model) \
            else ""
        raise TypeError(f"{where} takes a vd.protocol.VerifyModel as model=; got {why}{called}")
