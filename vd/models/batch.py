"""Batches for the HF adapter (`vd.protocol.BatchedForwards`): several sequences stepped by one model call.

Two kinds of batch, chosen by `vd.models.hf.HFModel.reset_batch`:

* `OneBatch`, a batch of one: the single-sequence machinery (a `DynamicCache` of its own under a dynamic
  forward, a `vd.models.static.StaticRunner` of its own under a static one), so it computes what
  `HFModel.forward` computes bit for bit, on state that is not the single sequence's;
* `BatchRunner`, a batch of two or more: one call of ``[n, L]`` token ids (``L`` the step's longest member,
  shorter members right-padded) over a `BatchKV`, each member at its own positions.

How a `BatchKV` works: every layer holds preallocated keys and values ``[n, heads, slots, dim]``, where
``slots`` is the capacity plus a few scratch slots. A step's input is one device tensor ``[n, L + 2]``: each
member's ids (padded), its start position (its length) and its count of real tokens; positions, the cache
write indices and the additive mask ``[n, 1, L, slots]`` are computed from it on the device (so a step can be
captured as a CUDA graph, one per ``(n, L)``). Member ``i``'s real row ``j`` sits at ``start_i + j``, writes
its keys there and sees its keys ``0 .. start_i + j``: never another member's, nor padding, nor positions past
its length. A padding row repeats its member's last real position (finite values, so no NaN reaches a real
row) and writes the scratch slot ``capacity``, which no query sees. A rewind lowers a member's length (a
later step overwrites the stale positions, the mask hides them until then); a reorder permutes every layer's
batch dimension in place (the graphs keep their addresses).

The step is vd's lean step (`vd.models.lean`, on the members' rows flattened to ``[n * L, H]`` and attended
per member) under a static forward where the architecture allows, else the HF model's own modules given the
4D mask (HF uses a 4D mask as it is: eager adds it to the scores, SDPA passes it as ``attn_mask``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from vd.models.lean import LeanStack
from vd.models.static import GRAPH_MAX, CacheLayer, GraphSet, capacity_for, maybe_compile

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import CacheLayerMixin, DummyLayer, LinearAttentionCacheLayerMixin

SCRATCH = 8  # slots past the capacity: padding rows write the first; 8 keeps the key rows' count aligned


class OneBatch:
    """A batch of one, stepped by the single-sequence machinery on state of its own: ``step(tokens)`` appends
    and returns the rows, ``rewind(n)`` drops positions (a `DynamicCache`'s or a `StaticRunner`'s)."""

    def __init__(self, forward: str, step: Callable[[Sequence[int]], torch.Tensor], rewind: Callable[[int], None]):
        self.forward_name, self.n = forward, 1
        self._step, self._rewind = step, rewind

    def forward(self, tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The one member's rows (new tensors: the single-sequence machinery's, cloned where it reuses them)."""
        _check_members(tokens, 1)
        return [self._step(tokens[0])]

    def rewind(self, member: int, n: int) -> None:
        _check_member(member, 1)
        self._rewind(n)

    def reorder(self, order: Sequence[int]) -> None:
        _check_order(order, 1)


def _check_members(tokens: Sequence[Sequence[int]], n: int) -> None:
    if len(tokens) != n:
        raise ValueError(f"forward_batch got tokens for {len(tokens)} members; the batch has {n}")


def _check_member(member: int, n: int) -> None:
    if not 0 <= member < n:
        raise IndexError(f"member {member} of a batch of {n}")


def _check_order(order: Sequence[int], n: int) -> None:
    if sorted(order) != list(range(n)):
        raise ValueError(f"reorder_batch({list(order)}): expected a permutation of 0 .. {n - 1}")


class _Layer(CacheLayer):
    """One layer's keys and values for every member, written at each member's positions (`BatchKV.write`)."""

    def allocate(self, heads: int, dim: int, dtype: torch.dtype, value_dim: int | None = None) -> None:
        """Keys ``[n, heads, slots, dim]`` and values (`vd.models.static.CacheLayer.allocate_as`)."""
        self.allocate_as(self.kv.n, heads, self.kv.slots, dim, dtype, value_dim)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's cache call: write ``[n, heads, L, dim]`` at the step's write indices, return every slot."""
        if self.keys is None:  # HF's modules: allocated on the first (uncaptured) step, the model's shapes
            self.allocate(key_states.shape[1], key_states.shape[-1], key_states.dtype, value_states.shape[-1])
        return self.write(key_states, value_states)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None, "allocated before the first write"
        at = self.kv.at[:, None, :, None]  # [n, 1, L, 1]
        self.keys.scatter_(2, at.expand(*k.shape), k)
        self.values.scatter_(2, at.expand(*v.shape), v)
        return self.keys, self.values

    def get_seq_length(self):
        return 0  # HF asks this only when no position_ids are passed, and a batch always passes them

    def get_mask_sizes(self, query_length: int):
        return self.kv.slots, 0

    def get_max_cache_shape(self) -> int:
        return self.kv.slots


class BatchKV:
    """A static cache of ``n`` members, ``layers`` layers and ``capacity`` positions each, as an HF `Cache`."""

    def __init__(self, layers: int, n: int, capacity: int, device: torch.device):
        from transformers.cache_utils import Cache

        self.n, self.capacity, self.slots, self.device = n, capacity, capacity + SCRATCH, device
        self.at = torch.zeros(n, 1, dtype=torch.long, device=device)  # the step's write indices (`begin`)
        self.layers = [_Layer(self) for _ in range(layers)]
        self.cache = Cache(layers=cast("list[CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer]",
                                       self.layers))

    @property
    def ready(self) -> bool:
        """Whether the cache tensors exist (HF's modules allocate them on the first step, run as eager kernels)."""
        return any(layer.keys is not None for layer in self.layers)

    def allocate(self, heads: int, dim: int, dtype: torch.dtype) -> None:
        for layer in self.layers:
            layer.allocate(heads, dim, dtype)

    def begin(self, inp: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """From a step's input ``[n, L + 2]`` (ids, start, count): ids ``[n, L]``, positions ``[n, L]`` and the
        additive mask ``[n, 1, L, slots]``; the write indices go to ``at`` for the layers."""
        length = inp.shape[1] - 2
        ids, start, count = inp[:, :length], inp[:, length:length + 1], inp[:, length + 1:]
        j = torch.arange(length, device=self.device)[None]  # [1, L]
        pos = start + torch.minimum(j, (count - 1).clamp(min=0))  # padding: the member's last real position
        self.at = torch.where(j < count, start + j, self.capacity)  # padding: the scratch slot
        visible = torch.arange(self.slots, device=self.device)[None, None] <= pos[:, :, None]  # [n, L, slots]
        zero = torch.zeros((), dtype=dtype, device=self.device)
        hidden = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=self.device)
        return ids, pos, torch.where(visible, zero, hidden)[:, None]

    def reorder(self, order: torch.Tensor) -> None:
        """Slot ``i`` takes member ``order[i]``'s keys and values, in place."""
        for layer in self.layers:
            if layer.keys is not None and layer.values is not None:
                layer.keys.copy_(layer.keys.index_select(0, order))
                layer.values.copy_(layer.values.index_select(0, order))


def _members(t: torch.Tensor, n: int) -> torch.Tensor:
    """``[1, heads, n * L, d]`` (the lean regions' layout of flattened rows) as ``[n, heads, L, d]``."""
    _, h, rows, d = t.shape
    return t[0].view(h, n, rows // n, d).transpose(0, 1)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[n, heads, L, d]`` back to ``[1, heads, n * L, d]``."""
    n, h, length, d = t.shape
    return t.transpose(0, 1).reshape(h, n * length, d)[None]


def lean_step(stack: LeanStack, tables: tuple[torch.Tensor, torch.Tensor], inp: torch.Tensor, kv: BatchKV, *,
              fast: bool, record: Callable | None = None) -> torch.Tensor:
    """vd's lean step over a batch: logits ``[n, L, V]``. The members' rows are flattened for the norms, GEMMs
    and rotary (row-wise: a member's rows meet no other member's there) and attend per member. ``record``, if
    given, sees the traced points (`vd.models.lean.LeanStack.step`'s, the same kernels), each ``[n, L, width]``."""
    ids, pos, mask = kv.begin(inp, stack.embed.dtype)
    n, length = ids.shape

    def attend(layer, w, q, k, v):
        keys, values = layer.write(_members(k, n), _members(v, n))
        return _flat(F.scaled_dot_product_attention(_members(q, n), keys, values, attn_mask=mask, scale=w.scale,
                                                    enable_gqa=True))

    members = None if record is None else (lambda p, what, t: record(p, what, t.reshape(n, length, -1)))
    _, logits = stack.layers_forward(F.embedding(ids.reshape(-1), stack.embed),  # [n * L, H]
                                     tables[0][pos.reshape(-1)], tables[1][pos.reshape(-1)], kv.layers, attend,
                                     fast=fast, record=members)
    return logits.view(n, length, -1)


class BatchRunner:
    """``n`` sequences over one `BatchKV`, stepped together under one forward (`vd.models.hf.HFModel`'s).

    ``mode``: a dynamic forward's name (HF's modules as the model's attention implementation is set, in
    ``context``, e.g. a pinned SDPA backend) or a static one (`vd.models.static.STATIC_FORWARDS`: ``stack``,
    the selected static runner's `LeanStack`, where the architecture allows; compiled and graphed as there)."""

    def __init__(self, model: PreTrainedModel, mode: str, n: int, capacity: int, *, stack: LeanStack | None = None,
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.forward_name, self.n, self.context = model, mode, n, context
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        layers = model.config.get_text_config().num_hidden_layers
        self.kv = BatchKV(layers, n, capacity_for(capacity), self.device)
        self.lengths = [0] * n
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.lean = stack is not None
        if stack is not None:
            tables = stack.tables(self.kv.slots, self.device)  # the batch's own: the stack's are its runner's
            self.kv.allocate(stack.hkv, stack.d, self.dtype)
            self._plain: Callable = lambda inp: lean_step(stack, tables, inp, self.kv, fast=False)
            self._fast: Callable = lambda inp: lean_step(stack, tables, inp, self.kv, fast=True)
            self._traced: Callable | None = lambda inp, rec: lean_step(stack, tables, inp, self.kv, fast=True,
                                                                       record=rec)
        else:
            self._plain = self._hf_step
            self._fast = maybe_compile(self._hf_step, mode.startswith("compiled"))
            # HF's modules uncompiled: their hooks trace (`vd.models.trace`); compiled ones are not traced
            self._traced = None if mode.startswith("compiled") else lambda inp, rec: self._hf_step(inp)
        graphed = mode in ("graphed", "compiled-graphed") and self.device.type == "cuda"
        self._graphs = GraphSet(self._fast, self.device) if graphed else None

    def _hf_step(self, inp: torch.Tensor) -> torch.Tensor:
        """HF's modules over the batch, given the 4D mask: logits ``[n, L, V]``."""
        ids, pos, mask = self.kv.begin(inp, self.dtype)
        with self.context():
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, cache=self.kv.cache,
                             use_cache=True)
        return out.logits

    def _step_fn(self, length: int) -> Callable:
        """As `vd.models.static.StaticRunner`: the compiled step for every length with the lean step, up to
        `GRAPH_MAX` tokens with HF's modules."""
        return self._fast if self.lean or length <= GRAPH_MAX else self._plain

    def _input(self, tokens: Sequence[Sequence[int]], length: int) -> torch.Tensor:
        """The step's input ``[n, length + 2]`` on the host: ids (right-padded with 0), start, count."""
        host = torch.zeros(self.n, length + 2, dtype=torch.long)
        for i, ids in enumerate(tokens):
            if self.lengths[i] + len(ids) > self.kv.capacity:
                raise RuntimeError(f"member {i}'s batch cache holds {self.kv.capacity} positions; "
                                   f"{self.lengths[i] + len(ids)} needed (reset_batch with a larger capacity)")
            host[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            host[i, length], host[i, length + 1] = self.lengths[i], len(ids)
        return host

    def _logits(self, host: torch.Tensor, length: int) -> torch.Tensor:
        """One step's logits ``[n, L, V]``: eager kernels, compiled, or a graph of this ``L`` (captured on
        first use over this very step's input, so its warm-ups write what the step writes)."""
        if not self.kv.ready:
            return self._plain(host.to(self.device))
        if self._graphs is None:
            return self._step_fn(length)(host.to(self.device))
        if length not in self._graphs:
            self._graphs.capture(length, (host.to(self.device),), self._step_fn(length))
        else:
            self._graphs.inputs(length)[0].copy_(host)
        return self._graphs.replay(length)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[Sequence[int]], record: Callable | None = None) -> list[torch.Tensor]:
        """Member ``i`` appends ``tokens[i]``; its ``[len(tokens[i]), V]`` rows (new tensors), in slot order.
        With ``record`` the step runs its kernels without a graph, handing each traced point over ``[n, L,
        width]`` (`vd.models.static.StaticRunner.forward`'s)."""
        _check_members(tokens, self.n)
        length = max(len(t) for t in tokens)
        if length == 0:
            return [torch.empty(0, self.vocab_size, dtype=self.dtype, device=self.device) for _ in tokens]
        if record is not None and self._traced is not None and self.kv.ready:
            logits = self._traced(self._input(tokens, length).to(self.device), record)
        else:
            logits = self._logits(self._input(tokens, length), length)
        for i, ids in enumerate(tokens):
            self.lengths[i] += len(ids)
        return [logits[i, : len(ids)].clone() for i, ids in enumerate(tokens)]

    def rewind(self, member: int, n: int) -> None:
        _check_member(member, self.n)
        if n < 0 or n > self.lengths[member]:
            raise ValueError(f"cannot rewind {n} of member {member}'s {self.lengths[member]} positions")
        self.lengths[member] -= n

    @torch.inference_mode()  # HF's modules allocate the cache in inference mode
    def reorder(self, order: Sequence[int]) -> None:
        _check_order(order, self.n)
        self.kv.reorder(torch.tensor(list(order), dtype=torch.long, device=self.device))
        self.lengths = [self.lengths[i] for i in order]

    def reset(self) -> None:
        """Start ``n`` empty sequences (the cache and graphs stay)."""
        self.lengths = [0] * self.n
