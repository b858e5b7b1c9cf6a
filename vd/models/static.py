"""Static-KV-cache steps for HF models, run as eager kernels, compiled, or CUDA-graphed per shape.

The four forwards of this module (`STATIC_FORWARDS`) share one step function and differ only in how it
is executed. The step is vd's lean Llama-family step (`vd.models.lean`) where the architecture allows,
else the HF model's own modules over the cache below:

* ``static``: the step's PyTorch kernels, launched one by one (CPU and CUDA);
* ``graphed``: the same kernels captured as one CUDA graph per input length (prefill, verify K, decode) and,
  for an MTP head, one graph per proposal shape; a graph of the same kernels replays them bit for bit,
  so ``graphed`` is expected to equal ``static`` bit for bit;
* ``compiled``: the step under ``torch.compile`` (Inductor, default mode, no CUDA graphs of its own);
* ``compiled-graphed``: the compiled step captured as CUDA graphs as above.

How the cache works: every layer holds preallocated keys and values of ``capacity`` positions. The
sequence length lives on the device as the last element of each step's input buffer, which carries the
step's token ids too, so one small host-to-device copy from pinned memory moves both; positions, the cache
write indices and the additive attention mask (each query sees the keys at or before its own position) are
computed from it on the device inside the step. Rewinding lowers the length: nothing is cleared, a later
step overwrites the stale positions and the mask hides them until then. Nothing inside a step reads a
value back to the host, which is what lets it be captured.

Graphs are captured lazily for each new shape (at the current length: the warm-up runs write only the
positions the real step is about to overwrite), or ahead of time by `StaticRunner.prepare`, largest shape
first (the prompt's prefill, then verify K, then decode), all in one shared memory pool; outputs live in
that pool and are cloned before the next replay. The prefill is graphed too: as eager kernels it is the
longest run of launches from Python in a replay, and while it runs the model's thread holds the
interpreter that a golden reader on another thread needs. The lean step is compiled for every length; HF's
modules only up to `GRAPH_MAX` tokens (HF: compiling the prefill "is known to fail"), and the MTP head's
first proposal over a prefill runs as eager kernels in every mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from vd.loop import gc_paused
from vd.models.inductor import inductor_settings
from vd.models.lean import LeanStack
from vd.models.lean import unsupported as lean_unsupported

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.cache_utils import CacheLayerMixin, DummyLayer, LinearAttentionCacheLayerMixin

STEP_HF = "HF transformers' modules with SDPA attention"
STEP_ANY = ("vd's lean step (Llama and Qwen2 stacks, vd.models.lean) or HF transformers' modules with SDPA "
            "(other architectures)")
STATIC_FORWARDS: dict[str, str] = {
    "static": "{step} over vd's static KV cache (device-side length, additive mask over the whole cache), "
    "kernels launched one by one",
    "graphed": "the static forward captured as one CUDA graph per step shape (prefill, verify K, decode, MTP "
    "propose), shared memory pool, outputs cloned",
    "compiled": "the static forward under torch.compile (Inductor, mode default, deterministic mode; the lean "
    "step compiles each layer's two elementwise regions once per shape; no CUDA graphs of its own); bit for "
    "bit within a process, not always across processes (prefer graphed for goldens)",
    "compiled-graphed": "the compiled static forward captured as one CUDA graph per step shape",
}


def static_forwards(model: torch.nn.Module | None = None) -> dict[str, str]:
    """`STATIC_FORWARDS` described for ``model`` (which step its static forwards run), or for any model."""
    step = STEP_ANY if model is None else LeanStack.description if lean_unsupported(model) is None else STEP_HF
    return {n: d.format(step=step) for n, d in STATIC_FORWARDS.items()}


GRAPH_MAX = 16  # longest step HF's modules compile and an MTP head graphs; longer ones run as eager kernels
DEFAULT_CAPACITY = 512
ROUND = 256  # capacities are rounded up to this, so nearby recordings share a cache size
WARMUP_RUNS = 3  # before each capture: cuBLAS handles, workspaces and compiled code settle


def capacity_for(n: int) -> int:
    """The cache capacity vd allocates for a sequence of ``n`` positions."""
    return max(ROUND, -(-n // ROUND) * ROUND)


class CacheLayer:
    """What a preallocated cache's layer is to HF's `Cache` (the flags it reads) and how its keys and values are
    allocated; `_Layer` (one sequence) and `vd.models.batch`'s (a batch) write them each their own way."""

    is_compileable = True
    is_sliding = False
    is_linear = False
    is_dummy = False

    def __init__(self, kv: Any):
        self.kv = kv
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False

    def allocate_as(self, n: int, heads: int, slots: int, dim: int, dtype: torch.dtype, value_dim: int | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[n, heads, slots, dim]`` and values (``value_dim`` wide when it differs, as in DeepSeek's MLA) on
        the cache's device, zeroed and marked as static addresses for compiled code; return them."""
        device = self.kv.device
        self.keys = keys = torch.zeros(n, heads, slots, dim, dtype=dtype, device=device)
        self.values = values = torch.zeros(n, heads, slots, value_dim or dim, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(keys)
        torch._dynamo.mark_static_address(values)
        self.is_initialized = True
        return keys, values


class _Layer(CacheLayer):
    """One layer's preallocated keys and values, written at the runner's current positions."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None or self.values is None:  # allocated on the first (uncaptured) step: the model's shapes
            _, h, _, d = key_states.shape  # vd steps one sequence: batch 1
            self.keys, self.values = self.allocate(h, d, key_states.dtype, value_dim=value_states.shape[-1])
        pos = self.kv.positions[: key_states.shape[-2]]
        self.keys.index_copy_(2, pos, key_states)
        self.values.index_copy_(2, pos, value_states)
        return self.keys, self.values

    def allocate(self, heads: int, dim: int, dtype: torch.dtype, value_dim: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate this layer's keys ``[1, heads, capacity, dim]`` and values (`CacheLayer.allocate_as`)."""
        return self.allocate_as(1, heads, self.kv.capacity, dim, dtype, value_dim)

    def get_seq_length(self):
        # HF asks this only when no position_ids are passed, and vd always passes them.
        return self.kv.length_on_device()

    def get_mask_sizes(self, query_length: int):
        return self.kv.capacity, 0

    def get_max_cache_shape(self) -> int:
        return self.kv.capacity


class StaticKV:
    """A static cache for ``layers`` layers of ``capacity`` positions, as an HF `Cache`."""

    def __init__(self, layers: int, capacity: int, device: torch.device):
        from transformers.cache_utils import Cache

        self.capacity = capacity
        self.device = device
        self.positions = torch.zeros(GRAPH_MAX, dtype=torch.long, device=device)  # replaced per step
        self.layers = [_Layer(self) for _ in range(layers)]
        # HF's Cache calls only what `_Layer` defines of its layers' members.
        self.cache = Cache(layers=cast("list[CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer]",
                                       self.layers))

    @property
    def ready(self) -> bool:
        """Whether the cache tensors exist (they are allocated by the first step, run as eager kernels,
        so neither a compiled trace nor a graph capture allocates them)."""
        return any(layer.keys is not None for layer in self.layers)

    def allocate(self, heads: int, dim: int, dtype: torch.dtype) -> None:
        """Allocate every layer's keys and values ``[1, heads, capacity, dim]`` up front."""
        for layer in self.layers:
            layer.allocate(heads, dim, dtype)

    def length_on_device(self) -> torch.Tensor:
        """The current step's first position, which is the length before it (a device tensor)."""
        return self.positions[:1]

    def begin(self, start: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``start .. start+n-1`` (device) and the additive mask ``[1, 1, n, capacity]``."""
        pos = start + torch.arange(n, device=self.device)
        self.positions = pos
        visible = torch.arange(self.capacity, device=self.device)[None, :] <= pos[:, None]  # [n, capacity]
        zero = torch.zeros((), dtype=dtype, device=self.device)
        hidden = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=self.device)
        return pos, torch.where(visible, zero, hidden)[None, None]


class GraphSet:
    """CUDA graphs of one step function, one per shape key, sharing one memory pool.

    ``inputs`` are static tensors the caller fills before `replay`; ``outputs`` live in the pool and
    are overwritten by the next replay of any graph of the set.
    """

    def __init__(self, fn: Callable, device: torch.device):
        self.fn, self.device = fn, device
        self.pool: Any = None  # torch.cuda.graph_pool_handle()'s, made at the first capture
        self.graphs: dict[Any, tuple[torch.cuda.CUDAGraph, tuple[Any, ...], Any]] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.graphs

    def capture(self, key: Any, inputs: tuple[Any, ...], fn: Callable | None = None) -> None:
        """Capture ``fn`` (default: the set's) over ``inputs`` as the graph of ``key``, with Python's cyclic
        collector paused: a collection inside a capture that frees an earlier model's graphs (a runner is freed
        by the collector alone: its step closes over it) resets them mid-capture, which CUDA refuses
        ("operation not permitted when stream is capturing") and the capture fails. `vd.loop.run_verify`
        pauses it for the captures made mid-run; this covers those its `prepare` makes before."""
        with gc_paused():
            self._capture(key, inputs, fn or self.fn)

    def _capture(self, key: Any, inputs: tuple[Any, ...], fn: Callable) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                fn(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a golden's writer or reader) cannot invalidate a
        # capture that happens mid-run (a draft head's first propose of a shape).
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            outputs = fn(*inputs)
        self.graphs[key] = (graph, inputs, outputs)

    def replay(self, key: Any) -> Any:
        graph, _, outputs = self.graphs[key]
        graph.replay()
        return outputs

    def inputs(self, key: Any) -> tuple[Any, ...]:
        return self.graphs[key][1]


def maybe_compile(fn: Callable, compiled: bool) -> Callable:
    """``fn`` under ``torch.compile`` (Inductor, vd's settings, static shapes) where ``compiled``, else ``fn``."""
    if not compiled:
        return fn
    inductor_settings()
    return torch.compile(fn, dynamic=False)


class _Staging:
    """Token ids and the start position for one step, copied to the device in one transfer."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.host = torch.zeros(4 * GRAPH_MAX + 1, dtype=torch.long, pin_memory=self.pinned)
        self.event = torch.cuda.Event() if self.pinned else None  # None exactly where not pinned

    def fill(self, ids: Sequence[int], start: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[*ids, start]`` on the device (into ``out`` when given)."""
        n = len(ids)
        if self.event is None:
            src = torch.tensor([*ids, start], dtype=torch.long)
        else:
            self.event.synchronize()  # the previous step's copy has left the pinned buffer
            if n + 1 > self.host.numel():  # a long prefill: a larger pinned buffer from now on
                self.host = torch.zeros(max(2 * self.host.numel(), n + 1), dtype=torch.long, pin_memory=True)
            src = self.host[: n + 1]
            src.numpy()[:n] = ids
            src.numpy()[n] = start
        if out is None:
            out = torch.empty(n + 1, dtype=torch.long, device=self.device)
        out.copy_(src, non_blocking=self.pinned)
        if self.event is not None:
            self.event.record()
        return out


class StaticRunner:
    """An HF causal LM stepping over a `StaticKV`, in one of the `STATIC_FORWARDS` modes."""

    def __init__(self, model: PreTrainedModel, mode: str, *, hidden: bool, lean: bool = True,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``lean``: run vd's lean step where the architecture allows (False: HF's modules always);
        ``reduce``: the model is a tensor-parallel shard (`vd.models.tp`), whose lean step sums across ranks."""
        self.model, self.mode, self.hidden = model, mode, hidden
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.graphed = mode in ("graphed", "compiled-graphed")
        self.layers = model.config.get_text_config().num_hidden_layers
        self.kv: StaticKV | None = None
        self.length = 0
        compiled = mode.startswith("compiled")
        # vd's lean step where the architecture allows it (vd.models.lean), else HF's modules.
        self.lean = LeanStack(model, reduce) if lean and lean_unsupported(model) is None else None
        if reduce is not None and self.lean is None:
            raise ValueError(f"a tensor-parallel shard needs vd's lean step: {lean_unsupported(model)}")
        if self.lean is not None:
            stack = self.lean
            if compiled:
                stack.compile()
            self._plain: Callable = lambda inp: stack.step(inp, self.kv, fast=False, hidden=hidden)
            self._fast: Callable = lambda inp: stack.step(inp, self.kv, fast=True, hidden=hidden)
        else:
            self._plain = self._step
            self._fast = maybe_compile(self._step, compiled)
        self._graphs: GraphSet | None = None
        self._staging = _Staging(self.device)

    def _allocate(self, capacity: int) -> None:
        self.kv = StaticKV(self.layers, capacity, self.device)
        if self.lean is not None:
            self.lean.allocate(self.kv)
        self._graphs = GraphSet(self._fast, self.device) if self.graphed else None

    def prepare(self, capacity: int, lengths: Sequence[int] = ()) -> None:
        """Hold at least ``capacity`` positions, and capture graphs for ``lengths`` (largest first).
        Starts a new sequence: the warm-up runs before a capture write the cache from position 0 (at a
        leftover length, a prefill's warm-up could run past the end). A larger capacity reallocates the
        cache, which drops the graphs too."""
        capacity = capacity_for(capacity)
        if self.kv is None or self.kv.capacity < capacity:
            self._allocate(capacity)
        self.length = 0
        for n in sorted(set(lengths), reverse=True):
            self._ensure_graph(n)

    def reset(self) -> None:
        if self.kv is None:
            self._allocate(capacity_for(DEFAULT_CAPACITY))
        self.length = 0

    def _cache(self) -> StaticKV:
        """The static cache (`reset` or `prepare` allocates it before the first step)."""
        assert self.kv is not None, "reset or prepare allocates the cache before the first step"
        return self.kv

    def rewind(self, n: int) -> None:
        if n < 0 or n > self.length:
            raise ValueError(f"cannot rewind {n} of {self.length} positions")
        self.length -= n

    def _step(self, inp: torch.Tensor):
        """Tokens ``inp[:-1]`` at positions from ``inp[-1]``: (logits ``[n, V]``, hidden ``[n, H]`` or None)."""
        n = inp.shape[0] - 1
        kv = self._cache()
        pos, mask = kv.begin(inp[n], n, self.dtype)
        out = self.model(input_ids=inp[:n][None], position_ids=pos[None], attention_mask=mask,
                         cache=kv.cache, use_cache=True, output_hidden_states=self.hidden)
        return out.logits[0], (out.hidden_states[-1][0] if self.hidden else None)

    def _step_fn(self, n: int) -> Callable:
        """The step function for ``n`` tokens: the compiled one (in compiled modes) for every length with
        the lean step, up to `GRAPH_MAX` with HF's modules (compiling HF's prefill "is known to fail")."""
        return self._fast if self.lean is not None or n <= GRAPH_MAX else self._plain

    def _ensure_graph(self, n: int) -> None:
        if self._graphs is not None and n not in self._graphs:
            inp = self._staging.fill([0] * n, self.length)
            if not self._cache().ready:
                self._plain(inp)
            self._graphs.capture(n, (inp,), self._step_fn(n))

    def traceable(self) -> bool:
        """Whether `forward` can hand its traced points to a ``record``: the lean step's (plain or compiled), or
        HF's modules run as plain kernels (their hooks see them: `vd.models.trace`), not HF's modules compiled."""
        return self.lean is not None or not self.mode.startswith("compiled")

    def forward(self, tokens: Sequence[int], record: Callable | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``tokens``; their logits rows and (if asked at construction) final hidden states. With
        ``record`` (`traceable`), the step runs its kernels without a graph, the lean step handing each traced
        point to ``record`` (the compiled step's at its regions' edges): the kernels a graph of it replays."""
        if self.kv is None:
            self.reset()
        kv, n = self._cache(), len(tokens)
        if self.length + n > kv.capacity:
            raise RuntimeError(f"the static KV cache holds {kv.capacity} positions; {self.length + n} "
                               "needed (prepare a larger capacity)")
        if record is not None:
            inp = self._staging.fill(tokens, self.length)
            logits, hidden = (self.lean.step(inp, kv, fast=True, hidden=self.hidden, record=record)
                              if self.lean is not None else self._plain(inp))
        elif not kv.ready:  # HF's modules allocate the cache on their first step, run as eager kernels
            logits, hidden = self._plain(self._staging.fill(tokens, self.length))
        elif self._graphs is not None:
            self._ensure_graph(n)
            self._staging.fill(tokens, self.length, out=self._graphs.inputs(n)[0])
            logits, hidden = self._graphs.replay(n)
            logits, hidden = logits.clone(), (hidden.clone() if hidden is not None else None)
        else:
            logits, hidden = self._step_fn(n)(self._staging.fill(tokens, self.length))
        self.length += n
        return logits, hidden


class StaticHead:
    """An MTP layer proposing over its own `StaticKV`, in the host's static mode.

    ``propose(ids, hidden, start, n)`` runs the head over ``q`` committed entries (ids ``[q]``, hidden
    ``[q, H]`` at positions ``start..``), then ``n`` drafts autoregressively, in one step function, so a
    graphed head replays one graph per ``(q, n)`` and reads the drafts back once.
    """

    def __init__(self, layer: torch.nn.Module, embed, lm_head, rotary, mode: str, device: torch.device,
                 context: Callable[[], contextlib.AbstractContextManager]):
        self.layer, self.embed, self.lm_head, self.rotary = layer, embed, lm_head, rotary
        self.device, self.mode, self.context = device, mode, context
        self.dtype = next(layer.parameters()).dtype
        self.graphed = mode in ("graphed", "compiled-graphed")
        attn = getattr(layer.mtp_block, "self_attn", None)
        self.layers = (getattr(attn, "layer_idx", 0) or 0) + 1
        self.kv: StaticKV | None = None
        self._fast = maybe_compile(self._propose, mode.startswith("compiled"))
        self._graphs: GraphSet | None = None
        self._staging = _Staging(device)

    def prepare(self, capacity: int) -> None:
        capacity = capacity_for(capacity)
        if self.kv is None or self.kv.capacity < capacity:
            self.kv = StaticKV(self.layers, capacity, self.device)
            self._graphs = GraphSet(self._fast, self.device) if self.graphed else None

    def _cache(self) -> StaticKV:
        """The head's static cache (`prepare` allocates it before the first proposal)."""
        assert self.kv is not None, "prepare allocates the head's cache before the first proposal"
        return self.kv

    def _block(self, ids: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        q, kv = ids.shape[1], self._cache()
        pos, mask = kv.begin(start, q, self.dtype)
        emb = self.embed(ids)
        pe = self.rotary(emb, position_ids=pos[None]) if self.rotary is not None else None
        return self.layer(emb, hidden, position_embeddings=pe, attention_mask=mask, position_ids=pos[None],
                          cache=kv.cache)

    def _propose(self, inp: torch.Tensor, hidden: torch.Tensor, n: int):
        q = inp.shape[0] - 1
        start = inp[q]
        with self.context():
            out = self._block(inp[:q][None], hidden[None], start)[:, -1:]  # [1, 1, H]
            drafts, rows = [], []
            for j in range(n):
                logits = self.lm_head(out)[0, -1]  # [V]
                d = logits.argmax()
                drafts.append(d)
                rows.append(logits)
                if j + 1 < n:
                    out = self._block(d.view(1, 1), out, start + q + j)
        return torch.stack(drafts), torch.stack(rows)

    def propose(self, ids: Sequence[int], hidden: torch.Tensor, start: int, n: int):
        """``n`` drafts (ints) and their ``[n, V]`` rows, after ``q = len(ids)`` committed entries."""
        if self.kv is None:
            self.prepare(DEFAULT_CAPACITY)
        kv, q = self._cache(), len(ids)
        if start + q + n - 1 > kv.capacity:
            raise RuntimeError(f"the head's static KV cache holds {kv.capacity} positions")
        if q > GRAPH_MAX or not kv.ready:
            drafts, rows = self._propose(self._staging.fill(ids, start), hidden, n)
        elif self._graphs is not None:
            key = (q, n)
            if key not in self._graphs:
                self._graphs.capture(key, (self._staging.fill(ids, start), hidden.clone(), n))
            inp, hid, _ = self._graphs.inputs(key)
            self._staging.fill(ids, start, out=inp)
            hid.copy_(hidden)
            drafts, rows = self._graphs.replay(key)
            rows = rows.clone()
        else:
            drafts, rows = self._fast(self._staging.fill(ids, start), hidden, n)
        return drafts.tolist(), rows
