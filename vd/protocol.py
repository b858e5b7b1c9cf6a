"""The model protocol: what vd needs from an engine to record and replay its verify path.

Structural (`typing.Protocol`): an engine fits without inheriting from anything. An adapter wraps one
sequence's state (its KV cache) and exposes a single `forward` that appends tokens at the current
position and returns one logits row per token; prefill, decode and a K-token verify are all calls of it.
`vd.testing.ModelConformance` is the test class every adapter must pass. Optional capabilities are
separate runtime-checkable protocols beside this one (`DraftHead`, an MTP draft head; `TokenDecoder`,
token ids back to text for reports). Two optional attributes are read where present: ``context_length``
(positions the model holds: longer runs are refused before their first step) and ``prepare(max_len,
shapes)`` (size a static cache, capture graphs). vd checks every forward's rows against the protocol
(`vd.loop.checked`): ``[len(tokens), vocab_size]`` of the model's ``dtype``, else exit 2 naming what came back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    * Optional: `decode(ids)`, token ids back to text (`TokenDecoder`); not part of this protocol, so an
      engine without it still fits. Optional: ``environment()``, a mapping of fields added to the golden's
      environment (`vd.env.of_model`): an engine puts its version and build flags under ``engine`` (a
      mapping), which a replay compares with the recording's and lists among the numerics differences,
      as it does ``tp`` and ``collectives`` (`vd.env.NUMERIC_FIELDS`).
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
    Callers ask for it with ``getattr(model, "decode", None)`` (or ``isinstance(model, TokenDecoder)``) and
    show bare ids where it is absent. ``decode(encode(text))`` gives ``text`` back for plain ASCII text;
    `vd.testing.ModelConformance` checks that where a model has `decode`.
    """

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, as the model's tokenizer (or its byte encoding) writes them."""
        ...


@runtime_checkable
class DraftHead(Protocol):
    """The optional MTP capability: a multi-token-prediction draft head that proposes drafts.

    Notes
    -----
    The drafter feed drives it as a speculative scheduler does: after the prefill and a bootstrap
    decode, and after every verify, `save_hidden` the accepted rows, `trim_proposer`, then `propose`.
    The head's outputs (each draft's logits row) are recorded and diffed like the verify rows.
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


def protocol_members(proto: type = VerifyModel) -> list[str]:
    """The attribute and method names a protocol requires (``__protocol_attrs__`` is Python 3.12+)."""
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    return sorted(names)
