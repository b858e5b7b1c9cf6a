"""The adapter for HF transformers causal LMs: one model, one sequence, many forwards.

The dynamic forwards (eager, SDPA, SDPA pinned to a backend) grow a `DynamicCache` and rewind it with
`crop`; the static forwards (static, graphed, compiled, compiled-graphed: `vd.models.static`) step over a
preallocated cache whose length lives on the device. Written against the pinned transformers 5.24 API
(`cache=`, `crop(-n)`).

Batches (`vd.protocol.BatchedForwards`, `vd.models.batch`) are a second state beside the single sequence: a
batch of one runs the single-sequence machinery on a `DynamicCache` or a `StaticRunner` of its own (so it is
`forward` bit for bit); a larger batch runs one model call of ``[n, L]`` ids over a per-member static cache
(`vd.models.batch.BatchKV`) with per-member positions and a 4D mask: HF's modules under the dynamic forwards,
vd's lean step (else HF's modules) under the static ones, compiled and graphed (one CUDA graph per ``(n, L)``)
as the static forward is. Every forward batches where every layer is full attention; none otherwise.

Leaves out where the model comes from: a local checkpoint (`vd.models.checkpoints`), seeded random weights
(`vd.models.seeded`) or weights generated on the device (`vd.models.generated`); and how text becomes ids
(`vd.models.text`) and weights a fingerprint (`vd.models.fingerprint`), which the adapter is given.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vd.models.batch import BatchRunner, OneBatch
from vd.models.device import CUDA_ONLY
from vd.models.fingerprint import Fingerprinter, fingerprint
from vd.models.lean import unsupported as lean_unsupported
from vd.models.static import DEFAULT_CAPACITY, STATIC_FORWARDS, StaticRunner, capacity_for, static_forwards
from vd.models.text import Codec
from vd.models.trace import points as trace_points
from vd.models.trace import traced
from vd.protocol import ModelIdentity

if TYPE_CHECKING:
    from torch.nn.attention import SDPBackend
    from transformers import DynamicCache, PreTrainedModel

# What each forward runs, for the report's `variants`.
HF_FORWARDS: dict[str, str] = {
    "eager": "HF transformers eager attention (matmul, softmax, matmul in PyTorch ops), DynamicCache",
    "sdpa": "HF transformers SDPA attention (torch.nn.functional.scaled_dot_product_attention; "
    "the backend is PyTorch's choice for the device), DynamicCache",
}
# SDPA pinned to one backend (torch.nn.attention.sdpa_kernel): offered where the model's own attention
# runs under it on its device (`HFModel._runs_pinned` tries a prefill and a verify-shaped step).
PINNED_SDPA = {
    "sdpa-math": ("MATH", "the math backend (plain PyTorch ops)"),
    "sdpa-flash": ("FLASH_ATTENTION", "the flash-attention backend"),
    "sdpa-efficient": ("EFFICIENT_ATTENTION", "the memory-efficient backend"),
    "sdpa-cudnn": ("CUDNN_ATTENTION", "the cuDNN backend"),
}


def _pinned_description(name: str) -> str:
    return f"HF transformers SDPA attention pinned to {PINNED_SDPA[name][1]} (sdpa_kernel), DynamicCache"


def all_forwards() -> dict[str, str]:
    """Every forward the HF adapter can offer; `HFModel.forwards` lists those its device runs."""
    return {**HF_FORWARDS, **{n: _pinned_description(n) + (" (CUDA only, where the GPU has it)" if n in CUDA_ONLY
                                                           else " (where the device has it)") for n in PINNED_SDPA},
            **{n: d + (" (CUDA only)" if n in CUDA_ONLY else "") for n, d in static_forwards().items()}}


class _Offered(Mapping):
    """A model's forwards by name (`HFModel.forwards`): the fixed ones, then each pinned SDPA backend that runs
    here, probed (``runs(name)``) when first asked about, then the static ones."""

    def __init__(self, first: Mapping[str, str], last: Mapping[str, str], runs: Callable[[str], bool]):
        self._first, self._last, self._runs = dict(first), dict(last), runs
        self._pinned: dict[str, bool] = {}

    def _offers(self, name: str) -> bool:
        if name in self._first or name in self._last:
            return True
        if name not in PINNED_SDPA:
            return False
        if name not in self._pinned:
            self._pinned[name] = self._runs(name)
        return self._pinned[name]

    def __getitem__(self, name: str) -> str:
        if not isinstance(name, str) or not self._offers(name):
            raise KeyError(name)
        return self._first.get(name) or self._last.get(name) or _pinned_description(name)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._offers(name)

    def __iter__(self) -> Iterator[str]:
        yield from self._first
        yield from (n for n in PINNED_SDPA if self._offers(n))
        yield from self._last

    def __len__(self) -> int:
        return sum(1 for _ in self)


class HFModel:
    """A `vd.protocol.VerifyModel` over an HF `*ForCausalLM` and its `DynamicCache`."""

    owns_rows = True  # every forward returns new tensors (`vd.loop.Run.check_returned` need not watch them)

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        name: str,
        encode: Codec,
        details: Mapping[str, Any] | None = None,
        fingerprinter: Fingerprinter | None = None,
    ):
        self.model = model.eval()
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._name = name
        self._encode = encode
        self._details = dict(details or {})
        self._fingerprinter = fingerprinter or fingerprint
        self._identity: ModelIdentity | None = None
        self._cache: DynamicCache | None = None  # the dynamic forwards' (`reset` makes it)
        self._runners: dict[str, StaticRunner] = {}  # one per static forward used, kept across switches
        self._runner: StaticRunner | None = None  # the selected static forward's, else None
        self._backend: SDPBackend | None = None  # while a pinned SDPA forward is selected
        self._forwards: _Offered | None = None  # see `forwards`
        self._forward: str | None = None
        self._batch: OneBatch | BatchRunner | None = None  # `reset_batch` starts it
        self._batch_runners: dict[str, StaticRunner] = {}  # a batch of one's, per static forward
        self._batches: dict[str, BatchRunner] = {}  # a larger batch's, per forward, kept for its graphs
        self.set_forward(self.default_forward())

    @torch.inference_mode()
    def _runs_pinned(self, name: str) -> bool:
        """Whether this model's attention runs with SDPA pinned to ``name``'s backend on its device: a
        backend may lack a kernel for the dtype, the head layout (GQA) or an explicit mask, and PyTorch has one for
        CUDA only (`CUDA_ONLY`): no run is tried for it elsewhere."""
        if name in CUDA_ONLY and self.device.type != "cuda":
            return False
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from transformers import DynamicCache

        previous = self.config._attn_implementation
        self.model.set_attn_implementation("sdpa")
        ids = torch.zeros(1, 3, dtype=torch.long, device=self.device)
        try:
            with warnings.catch_warnings(), sdpa_kernel(getattr(SDPBackend, PINNED_SDPA[name][0])):
                warnings.simplefilter("ignore")  # torch explains each refusal at length
                cache = DynamicCache(config=self.config)
                self.model(input_ids=ids, cache=cache, use_cache=True)  # prefill: no mask, causal
                self.model(input_ids=ids[:, :2], cache=cache, use_cache=True)  # verify: q_len < kv_len, mask
        except RuntimeError:  # "No available kernel"
            return False
        finally:
            self.model.set_attn_implementation(previous)
        return True

    def identity(self) -> ModelIdentity:
        """The model's name and weight fingerprint (hashed once, on first use)."""
        if self._identity is None:
            details = {
                "architecture": type(self.model).__name__,
                "parameters": sum(p.numel() for p in self.model.parameters()),
                **self._details,
            }
            self._identity = ModelIdentity(self._name, self._fingerprinter(self.model, self.config), details)
        return self._identity

    def forget_identity(self) -> None:
        """Drop the cached identity, so the next `identity` hashes the weights again (after an in-place edit)."""
        self._identity = None

    @property
    def static_runner(self) -> StaticRunner | None:
        """The selected static forward's runner (None under a dynamic forward): to inspect its cache and step."""
        return self._runner

    def forwards(self) -> Mapping[str, str]:
        """Eager and SDPA attention, SDPA pinned to each backend the device runs, and the static forwards
        (graphed and compiled ones on CUDA only). A pinned backend is probed once, when it is first asked
        about (by name, or by listing them all): a replay of another forward pays nothing for it."""
        if self._forwards is None:
            self._forwards = _Offered(HF_FORWARDS, self._static_forwards(), self._runs_pinned)
        return self._forwards

    def _static_forwards(self) -> dict[str, str]:
        if not self._full_attention():
            return {}  # sliding-window or linear layers: vd's static cache holds full attention only
        offered = static_forwards(self.model)
        return {n: d for n, d in offered.items() if self.device.type == "cuda" or n not in CUDA_ONLY}

    def _full_attention(self) -> bool:
        """Whether every layer is full attention (vd's static and batch caches hold no other kind)."""
        text = self.config.get_text_config()
        return all(t == "full_attention" for t in getattr(text, "layer_types", None) or [])

    @property
    def context_length(self) -> int | None:
        """Positions the model was made for (its config's ``max_position_embeddings``); None where unknown."""
        n = getattr(self.config.get_text_config(), "max_position_embeddings", None)
        return n if isinstance(n, int) and n > 0 else None

    def forward_uses_graphs(self, name: str) -> bool:
        """Whether forward ``name`` replays its steps as CUDA graphs (the report's ``graphs``)."""
        return name in ("graphed", "compiled-graphed")

    def default_forward(self) -> str:
        """Eager: the plainest implementation, the natural trusted reference."""
        return "eager"

    def set_forward(self, name: str) -> None:
        """Switch the attention implementation or the static mode in place (no reload); selecting the
        selected forward again costs nothing (HF's switch walks every module, so it is skipped)."""
        if name == self._forward:
            return
        if name not in HF_FORWARDS and name not in self.forwards():
            raise KeyError(name)
        from torch.nn.attention import SDPBackend

        self.model.set_attn_implementation("eager" if name == "eager" else "sdpa")
        self._backend = getattr(SDPBackend, PINNED_SDPA[name][0]) if name in PINNED_SDPA else None
        self._runner = None
        if name in STATIC_FORWARDS:
            if name not in self._runners:
                self._runners[name] = self._new_runner(name)
            self._runner = self._runners[name]
        self._forward = name

    _wants_hidden = False  # the MTP subclass needs the final hidden states of every forward

    def _new_runner(self, name: str) -> StaticRunner:
        """A runner of static forward ``name`` (the single sequence's, or a batch of one's)."""
        return StaticRunner(self.model, name, hidden=self._wants_hidden)

    def prepare(self, capacity: int, lengths: Sequence[int] = ()) -> None:
        """Ready the selected forward for sequences of ``capacity`` positions and steps of ``lengths``
        tokens (a static forward allocates its cache, captures its graphs, largest first, and starts a
        new sequence). Optional in the protocol: record and replay call it before their runs."""
        if self._runner is not None:
            self._runner.prepare(capacity, lengths)

    def attention_context(self):
        """The context every attention call of this model runs in (a pinned SDPA backend, or none)."""
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self._backend) if self._backend is not None else contextlib.nullcontext()

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt."""
        return self._encode(text)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids (`vd.protocol.TokenDecoder`): the tokenizer's, or UTF-8 bytes without one."""
        return self._encode.decode(list(ids))

    def reset(self) -> None:
        """Start a new sequence: an empty DynamicCache, or the static cache's length set to zero."""
        from transformers import DynamicCache

        if self._runner is not None:
            self._runner.reset()
        else:
            self._cache = DynamicCache(config=self.config)

    def length(self) -> int:
        """Positions in the current sequence."""
        return self._runner.length if self._runner is not None else self._dynamic_cache().get_seq_length()

    def _dynamic_cache(self) -> DynamicCache:
        assert self._cache is not None, "reset starts a sequence before the first forward"
        return self._cache

    def _call(self, tokens: Sequence[int], *, hidden: bool = False, cache: DynamicCache | None = None):
        """One model call appending ``tokens`` to ``cache`` (default: the single sequence's); the HF output
        (with hidden states if asked)."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, n]
        with self.attention_context():
            return self.model(input_ids=ids, cache=cache if cache is not None else self._cache, use_cache=True,
                              output_hidden_states=hidden)

    def _run(self, tokens: Sequence[int], hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``tokens`` under the selected forward: logits ``[n, V]`` and, if asked, the hidden
        states after the final norm ``[n, H]``."""
        if self._runner is not None:
            return self._runner.forward(tokens, self._record)
        out = self._call(tokens, hidden=hidden)
        return out.logits[0], (out.hidden_states[-1][0] if hidden else None)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens``; positions follow the cache length. Returns ``[len(tokens), vocab]``."""
        return self._run(tokens)[0]

    _record: Callable[[str, str, torch.Tensor], None] | None = None  # inside `trace`

    def trace_forwards(self) -> list[str]:
        """The forwards whose module outputs `trace` records: those that run HF's modules (eager and SDPA, pinned
        or not; their hooks, `vd.models.trace`), and the static forwards that run vd's lean step, which hands
        over the same points (a graphed one runs its kernels without the graph while traced; a compiled one
        traces at its compiled regions' edges: `vd.models.lean`), or HF's modules uncompiled."""
        if not trace_points(self.model):
            return []
        return [n for n in self.forwards() if n not in STATIC_FORWARDS or self._static_traces(n)]

    def _static_traces(self, name: str) -> bool:
        return lean_unsupported(self.model) is None or not name.startswith("compiled")

    @contextlib.contextmanager
    def trace(self, record: Callable[[str, str, torch.Tensor], None]):
        """A context in which each forward hands each traced module's output to ``record``
        (`vd.protocol.ModuleTrace`, `vd.models.trace`): HF's modules through hooks, a static forward's step
        through the record it is handed."""
        self._record = record
        try:
            with traced(self.model, record):
                yield
        finally:
            self._record = None

    def rewind(self, n: int) -> None:
        """Drop the last ``n`` positions (`crop` takes a negative count in 5.2x; a static cache just
        lowers its length)."""
        if self._runner is not None:
            self._runner.rewind(n)
        elif n:
            self._dynamic_cache().crop(-n)

    # -- the batch (vd.protocol.BatchedForwards; vd.models.batch) ------------------------------------------

    def batch_forwards(self) -> list[str]:
        """Every forward, where every layer is full attention (a batch's cache holds no other kind); else none."""
        return list(self.forwards()) if self._full_attention() else []

    def reset_batch(self, n: int, capacity: int) -> None:
        """Start ``n`` empty sequences of up to ``capacity`` positions under the selected forward, beside the
        single sequence (neither disturbs the other): a batch of one on the single-sequence machinery's own
        kind of state, a larger one over a per-member cache (`vd.models.batch`)."""
        assert self._forward is not None, "a forward is selected at construction"
        if n < 1:
            raise ValueError(f"a batch has one member or more, not {n}")
        if self._forward not in self.batch_forwards():
            raise ValueError(f"forward {self._forward!r} cannot run a batch (batch_forwards: {self.batch_forwards()})")
        self._batch = self._one_batch(self._forward, capacity) if n == 1 else self._many(self._forward, n, capacity)

    def _one_batch(self, name: str, capacity: int) -> OneBatch:
        """A batch of one: a `DynamicCache`, or a `StaticRunner`, of its own, stepped as `forward` steps the
        single sequence's (hidden states asked for where `forward` asks: the same computation)."""
        from transformers import DynamicCache

        if name not in STATIC_FORWARDS:
            cache = DynamicCache(config=self.config)

            def crop(n: int) -> None:
                if n:
                    cache.crop(-n)

            return OneBatch(name, lambda t: self._call(t, hidden=self._wants_hidden, cache=cache).logits[0], crop)
        runner = self._one_runner(name, capacity)
        return OneBatch(name, lambda t: runner.forward(t)[0], runner.rewind)

    def _one_runner(self, name: str, capacity: int) -> StaticRunner:
        """A batch of one's static runner, as many positions as the single sequence's cache holds where that
        covers ``capacity`` (bit for bit needs the same cache size: attention spans the whole cache)."""
        single = self._runners[name].kv
        want = max(single.capacity if single is not None else capacity_for(DEFAULT_CAPACITY), capacity_for(capacity))
        runner = self._batch_runners.get(name)
        if runner is None or (runner.kv is not None and runner.kv.capacity != want):
            runner = self._batch_runners[name] = self._new_runner(name)
        runner.prepare(want)
        return runner

    def _many(self, name: str, n: int, capacity: int) -> BatchRunner:
        """A batch of ``n`` over one per-member cache: kept per forward (with its graphs) while ``n`` and the
        capacity fit."""
        b = self._batches.get(name)
        if b is not None and b.n == n and b.kv.capacity >= capacity_for(capacity):
            b.reset()
            return b
        runner = self._runners.get(name) if name in STATIC_FORWARDS else None
        b = self._batches[name] = BatchRunner(self.model, name, n, capacity,
                                              stack=runner.lean if runner is not None else None,
                                              context=self.attention_context)
        return b

    def _current_batch(self) -> OneBatch | BatchRunner:
        b = self._batch
        if b is None or b.forward_name != self._forward:
            raise RuntimeError(f"no batch under forward {self._forward!r}: reset_batch starts one")
        return b

    @torch.inference_mode()
    def forward_batch(self, tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Member ``i`` appends ``tokens[i]`` (one model call); its ``[len(tokens[i]), V]`` rows, in slot order."""
        b = self._current_batch()
        return b.forward(tokens, self._record) if isinstance(b, BatchRunner) else b.forward(tokens)

    def rewind_batch(self, member: int, n: int) -> None:
        """Drop member ``member``'s last ``n`` positions."""
        self._current_batch().rewind(member, n)

    def reorder_batch(self, order: Sequence[int]) -> None:
        """Slot ``i`` takes the sequence slot ``order[i]`` held."""
        self._current_batch().reorder(order)
