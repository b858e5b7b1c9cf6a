"""The adapter for HF transformers causal LMs: one model, one sequence, many forwards.

The dynamic forwards (eager, SDPA, SDPA pinned to a backend) grow a `DynamicCache` and rewind it with
`crop`; the static forwards (static, graphed, compiled, compiled-graphed: `vd.models.static`) step over a
preallocated cache whose length lives on the device. It loads local checkpoints only (a directory, a
`.gguf` file, or a random-weight config built in process): nothing is fetched from a hub. Written against
the pinned transformers 5.24 API (`cache=`, `crop(-n)`).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import warnings
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vd.dtypes import of_torch
from vd.errors import ModelSpecError, UsageError
from vd.models.static import CUDA_ONLY, STATIC_FORWARDS, StaticRunner, static_forwards
from vd.protocol import ModelIdentity

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
    return {**HF_FORWARDS, **{n: _pinned_description(n) + " (where the device has it)" for n in PINNED_SDPA},
            **{n: d + (" (CUDA only)" if n in CUDA_ONLY else "") for n, d in static_forwards().items()}}


# Config fields that change the arithmetic and exist under these names across transformers 5.x.
_IDENTITY_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act",
    "tie_word_embeddings", "attention_bias", "mlp_bias",
)


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' progress bars and advisory warnings while loading; load offline."""
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        # The GGUF loader's own tqdm bar ignores transformers' switch; keep it off our terminal.
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()


def identity_fields(config) -> dict:
    """The config fields that change a model's arithmetic, as every vd fingerprint hashes them."""
    fields = {f: getattr(config, f, None) for f in _IDENTITY_FIELDS}
    rope = getattr(config, "rope_parameters", None) or {}
    fields["rope_theta"] = getattr(config, "rope_theta", None) or rope.get("rope_theta")
    return fields


def fingerprint(model: torch.nn.Module, config) -> str:
    """``sha256:<hex>`` over the state dict as loaded and the arithmetic-relevant config fields."""
    h = hashlib.sha256()
    h.update(json.dumps(identity_fields(config), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


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

    def __iter__(self):
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
        model: torch.nn.Module,
        *,
        name: str,
        encode: ByteCodec | TokenizerCodec,
        details: Mapping | None = None,
        fingerprinter: Callable[[torch.nn.Module, object], str] | None = None,
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
        self._cache = None
        self._runners: dict[str, StaticRunner] = {}  # one per static forward used, kept across switches
        self._runner: StaticRunner | None = None  # the selected static forward's, else None
        self._backend = None  # an SDPBackend while a pinned SDPA forward is selected
        self._forwards: _Offered | None = None  # see `forwards`
        self._forward: str | None = None
        self.set_forward(self.default_forward())

    @torch.inference_mode()
    def _runs_pinned(self, name: str) -> bool:
        """Whether this model's attention runs with SDPA pinned to ``name``'s backend on its device: a
        backend may lack a kernel for the dtype, the head layout (GQA) or an explicit mask."""
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
        text = self.config.get_text_config()
        if any(t != "full_attention" for t in getattr(text, "layer_types", None) or []):
            return {}  # sliding-window or linear layers: vd's static cache holds full attention only
        offered = static_forwards(self.model)
        return {n: d for n, d in offered.items() if self.device.type == "cuda" or n not in CUDA_ONLY}

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
                self._runners[name] = StaticRunner(self.model, name, hidden=self._wants_hidden)
            self._runner = self._runners[name]
        self._forward = name

    _wants_hidden = False  # the MTP subclass needs the final hidden states of every forward

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
        return self._runner.length if self._runner is not None else self._cache.get_seq_length()

    def _call(self, tokens: Sequence[int], *, hidden: bool = False):
        """One model call appending ``tokens`` to the cache; the HF output (with hidden states if asked)."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # [1, n]
        with self.attention_context():
            return self.model(input_ids=ids, cache=self._cache, use_cache=True, output_hidden_states=hidden)

    def _run(self, tokens: Sequence[int], hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ``tokens`` under the selected forward: logits ``[n, V]`` and, if asked, the hidden
        states after the final norm ``[n, H]``."""
        if self._runner is not None:
            return self._runner.forward(tokens)
        out = self._call(tokens, hidden=hidden)
        return out.logits[0], (out.hidden_states[-1][0] if hidden else None)

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        """Append ``tokens``; positions follow the cache length. Returns ``[len(tokens), vocab]``."""
        return self._run(tokens)[0]

    def rewind(self, n: int) -> None:
        """Drop the last ``n`` positions (`crop` takes a negative count in 5.2x; a static cache just
        lowers its length)."""
        if self._runner is not None:
            self._runner.rewind(n)
        elif n:
            self._cache.crop(-n)


class ByteCodec:
    """Text as UTF-8 bytes folded into the vocabulary, for a model without a tokenizer (random weights, a
    bare checkpoint). Decoding reads ids below 256 back as bytes and shows any other id as ``<id>``."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text: str) -> list[int]:
        return [b % self.vocab for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out += [run.decode("utf-8", errors="replace"), f"<{i}>"]
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


class TokenizerCodec:
    """Text through a checkpoint's HF tokenizer, without special tokens either way."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def load_checkpoint(path: Path, *, device: torch.device, dtype: torch.dtype) -> HFModel:
    """An HF checkpoint directory, or a `.gguf` file (loaded with ``gguf_file=``, its dequantised form
    cached: `vd.models.weights`), from local disk. A checkpoint without a tokenizer encodes prompts as
    UTF-8 bytes (recorded in its details)."""
    model, tok, fp = _converted(path, dtype) if path.is_file() and path.suffix == ".gguf" else (
        *_from_pretrained(path, dtype), None)
    model.to(device)
    if tok is not None:
        encode, tokenizer = TokenizerCodec(tok), type(tok).__name__
    else:
        encode, tokenizer = ByteCodec(model.config.vocab_size), "none: UTF-8 bytes"
    return HFModel(model, name=f"{type(model).__name__} from {path.name}", encode=encode,
                   details={"source": str(path), "tokenizer": tokenizer}, fingerprinter=_first_known(fp))


def _converted(gguf: Path, dtype: torch.dtype):
    """A GGUF checkpoint's model (on the CPU), tokenizer and fingerprint, from the converted-weights cache
    where it holds the file's conversion and the weights there still hash to the fingerprint stored with
    them (else converted again and stored)."""
    from vd.models import weights

    name = of_torch(dtype).name
    entry = None
    with contextlib.suppress(OSError):
        entry = weights.entry_path(gguf, name)
    if weights.ready(entry):
        try:
            model, tok = _from_pretrained(entry, dtype)
            fp = fingerprint(model, model.config)
            if fp == weights.stored_fingerprint(entry):
                return model, tok, fp
        except Exception:  # noqa: BLE001  a damaged entry fails to load in any way: converted again below
            pass
        weights.discard(entry)
    model, tok = _from_pretrained(gguf, dtype)
    fp = fingerprint(model, model.config)
    if entry is not None:
        weights.store(entry, model, tok, gguf, name, fp)
    return model, tok, fp


def _first_known(fp: str | None) -> Callable[[torch.nn.Module, object], str]:
    """A fingerprinter answering ``fp`` (already computed from these weights) once, then hashing."""
    known = [fp] if fp is not None else []

    def fingerprinter(model: torch.nn.Module, config) -> str:
        return known.pop() if known else fingerprint(model, config)

    return fingerprinter


def _from_pretrained(path: Path, dtype: torch.dtype):
    """The HF causal LM at ``path`` (a folder, or a ``.gguf`` file), on the CPU, and its tokenizer (None
    where it has none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, extra = (path.parent, {"gguf_file": path.name}) if path.is_file() else (path, {})
    try:
        with quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                folder, **extra, dtype=dtype, local_files_only=True, attn_implementation="eager"
            )
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelSpecError(f"cannot load an HF causal LM from {path}: {first}") from e
    try:
        with quiet_transformers():
            tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
    except (OSError, ValueError, KeyError, TypeError):
        tok = None
    return model, tok


def _seeded_init(model: torch.nn.Module, seed: int, std: float) -> None:
    """Fill every parameter from numpy's PCG64 stream: the same bits on every CPU. (torch's own
    ``normal_`` takes vectorised paths that differ between AVX2 and AVX-512, so its weights would not
    match across machines, and neither would the fingerprint.)"""
    rng = np.random.default_rng(seed)
    for name, p in sorted(model.named_parameters()):
        if p.dim() == 1 and "norm" in name:
            values = np.ones(p.shape, dtype=np.float32)
        else:
            values = rng.standard_normal(p.shape, dtype=np.float32) * np.float32(std)
        with torch.no_grad():
            p.copy_(torch.from_numpy(values))


def build_random(config, *, seed: int, name: str, device: torch.device, dtype: torch.dtype) -> HFModel:
    """A random-weight model of ``config``, seeded and platform-independent, built on the CPU and
    then moved, so its weights are identical on every machine and device."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _seeded_init(model, seed, config.initializer_range)
    model.to(device=device, dtype=dtype)
    return HFModel(model, name=name, encode=ByteCodec(config.vocab_size),
                   details={"seed": seed, "random_weights": True})


# -- generated weights: model shapes too large to draw from numpy on the host ------------------------

GENERATOR = "vd-hash-uniform/1"
_M32 = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Region:
    """Where a tensor's elements sit in a larger tensor of ``columns`` columns (a 2-D ``[R, columns]``; a
    1-D one is ``[R, 1]``): from row ``row`` and column ``column``. A tensor-parallel shard generates and
    checksums its elements by their index in the whole tensor (`vd.models.tp`)."""

    row: int = 0
    column: int = 0
    columns: int | None = None  # None: the tensor is whole


def _flat_index(s: int, e: int, t: torch.Tensor, at: Region | None) -> torch.Tensor:
    """Indices, in the whole tensor, of ``t``'s flat elements ``s .. e - 1`` (int64, on ``t``'s device)."""
    i = torch.arange(s, e, dtype=torch.int64, device=t.device)
    if at is None or at.columns is None:
        return i
    width = t.shape[-1] if t.dim() > 1 else 1
    return (at.row + i // width) * at.columns + at.column + i % width


def hash_uniform_(t: torch.Tensor, seed: int, std: float, chunk: int = 1 << 25, at: Region | None = None) -> None:
    """Fill ``t`` in place with uniform values of standard deviation ``std``, computed where ``t`` lives.

    Element ``i`` is a 32-bit integer hash (lowbias32) of ``i`` and ``seed`` in int64 arithmetic, whose 24
    high bits give ``u`` in [0, 1); the value is ``(2u - 1) * std * sqrt(3)`` in float32, rounded once to
    ``t``'s dtype. Integer operations and single IEEE roundings are exact on every CPU and GPU, so the
    weights are the same bits everywhere, and a full-size model is filled on its GPU, not drawn on the host.
    With ``at``, ``t`` is that region of a larger tensor and gets the values it has there (``i`` its index in
    the larger tensor): a shard is generated alone.
    """
    flat = t.view(-1)
    bound = float(np.float32(std * np.sqrt(3.0)))
    for s in range(0, flat.numel(), chunk):
        x = (_flat_index(s, min(flat.numel(), s + chunk), t, at) * 0x9E3779B1 + seed) & _M32
        x ^= x >> 16
        x = (x * 0x7FEB352D) & _M32
        x ^= x >> 15
        x = (x * 0x846CA68B) & _M32
        x ^= x >> 16
        u = (x >> 8).to(torch.float32) * (2.0 ** -24)
        flat[s : s + chunk] = ((u * 2.0 - 1.0) * bound).to(t.dtype)


def _tensor_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode()) & _M32


# A checksum's chunk: its int64 temporaries (a handful of 64 MiB) stay small beside a model that fills its GPU
# (a 70B-shape shard on an H200 two ranks share ran out at 2**25). The sums are exact integers, so the chunk
# never changes a checksum.
CHECKSUM_CHUNK = 1 << 23


def device_checksum(t: torch.Tensor, chunk: int = CHECKSUM_CHUNK) -> int:
    """A position-weighted sum of ``t``'s bit patterns, exact in int64 and computed where ``t`` lives."""
    return int(_checksum_on_device(t, chunk).sum())


def _checksum_on_device(t: torch.Tensor, chunk: int = CHECKSUM_CHUNK, at: Region | None = None) -> torch.Tensor:
    """`device_checksum`'s partial sums, one per chunk, int64 on ``t``'s device (nothing read back). Each is
    below 2**15 * 2**16 * 2**23 = 2**54 in magnitude, so int64 holds it exactly. With ``at``, each element is
    weighted by its index in the larger tensor, so the shards' sums add up to the whole tensor's."""
    bits = t.detach().contiguous().view(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
    parts = []
    for s in range(0, bits.numel(), chunk):
        b = bits[s : s + chunk].to(torch.int64)
        w = _flat_index(s, s + b.numel(), t, at) % 65521 + 1
        parts.append((b * w).sum())
    return torch.stack(parts) if parts else torch.zeros(0, dtype=torch.int64, device=t.device)


def fingerprint_of(config, seed: int, tensors: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> str:
    """A generated model's fingerprint from each tensor's (name, dtype, whole shape, checksum), by name."""
    h = hashlib.sha256()
    h.update(json.dumps({"fields": identity_fields(config), "generator": GENERATOR, "seed": seed},
                        sort_keys=True, default=str).encode())
    for name, dtype, shape, total in tensors:
        h.update(f"{name}|{dtype}|{shape}|{total}|".encode())
    return "sha256:" + h.hexdigest()


def generated_fingerprint(seed: int) -> Callable[[torch.nn.Module, object], str]:
    """The fingerprint of a generated model: its config fields, generator and seed, and a device-side
    checksum of every tensor (hashing many gigabytes on the host would take longer than a replay)."""

    def fp(model: torch.nn.Module, config) -> str:
        tensors = sorted(model.state_dict().items())
        parts = [_checksum_on_device(t) for _, t in tensors]  # every tensor's queued, then one read-back
        flat = torch.cat(parts).tolist() if parts else []  # a generated model lives on one device
        sums, at = [], 0
        for part in parts:
            sums.append(sum(flat[at:at + part.numel()]))  # summed here: Python integers do not overflow
            at += part.numel()
        return fingerprint_of(config, seed, [(name, t.dtype, tuple(t.shape), total)
                                             for (name, t), total in zip(tensors, sums)])

    return fp


def generate(config, seed: int, device: torch.device, dtype: torch.dtype, attention: str = "eager",
             at: Callable[[str, tuple[int, ...]], Region | None] | None = None) -> torch.nn.Module:
    """The model of ``config`` built directly on ``device`` in ``dtype`` with `hash_uniform_` weights (norm
    weights one); ``at(name, shape)``: where each tensor sits in the whole model's, for a shard that
    generates only its slices (`vd.models.tp`)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    with quiet_transformers(), torch.device(device), no_init_weights():
        config._attn_implementation = attention
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1 and "norm" in pname:
                p.fill_(1.0)
            else:
                hash_uniform_(p, _tensor_seed(seed, pname), config.initializer_range,
                              at=None if at is None else at(pname, tuple(p.shape)))
    return model


def build_generated(config, *, seed: int, name: str, device: torch.device, dtype: torch.dtype) -> HFModel:
    """A model of ``config`` with `hash_uniform_` weights built directly on ``device`` in ``dtype`` (norm
    weights one): for full-size shapes (8 B parameters), too large for `build_random` to draw on the host."""
    return HFModel(generate(config, seed, device, dtype), name=name, encode=ByteCodec(config.vocab_size),
                   details={"seed": seed, "random_weights": True, "generator": GENERATOR},
                   fingerprinter=generated_fingerprint(seed))


def check_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here, or a UsageError."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise UsageError(f"unknown device {device!r} (use cpu or cuda)") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"device {device!r} asked for, but this machine has no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"unsupported device {device!r} (use cpu or cuda)")
    return dev
