"""The llama.cpp adapter (``--model llamacpp:PATH.gguf``; ``pip install 'vd[llamacpp]'``): a GGUF model run by
llama-cpp-python's own evaluation, as an engine integrator runs it, held to the same goldens as any forward.

* **forward** evaluates the tokens with ``Llama.eval`` (every row's logits kept: ``logits_all``) and copies
  their rows out of llama-cpp-python's reused ``scores`` array (vd holds rows it is given). **rewind** lowers
  ``n_tokens``: the next evaluation removes the KV cache from there (``kv_cache_seq_rm``), as llama.cpp's
  own server does after a rejected draft.
* **batch** (`vd.protocol.BatchedForwards`, under every forward): as llama.cpp's server runs its slots.
  ``reset_batch(n, capacity)`` makes a second context on the forward's loaded model (its context parameters:
  threads, flash attention, offload) holding ``n`` sequences (``n_seq_max``) in one unified KV cache
  (``kv_unified``) of ``n`` × ``capacity`` positions; the single sequence's context is untouched.
  ``forward_batch`` fills one ``llama_batch`` (each token its sequence id, position and a logits row) and runs
  one ``llama_decode``, so members of different lengths share the ubatch's matrix products; **rewind_batch**
  removes a member's positions (``llama_memory_seq_rm``); **reorder_batch** relabels the slots' sequence ids
  (the KV stays where it is). A batch of one runs as ``forward`` does (the same graph: one sequence, its KV
  cells and their padding alike) and is ``forward`` bit for bit. In a batch of several a member's rows are its
  own sequence's to rounding, not bit for bit, as llama.cpp's own rows are not between a prefill and the same
  tokens one at a time (up to 0.9 on logits of magnitude 27, SmolLM2's Q4_1 on ``cpu``). Measured on CPU
  (SmolLM2 Q4_1, float32, a batch of two: prompts of 10 and 18 tokens, then verifies of 1-4, one rewind):
  ``cpu`` 16 of 43 rows identical, max |Δ| 1.55 (5.1 % of the row's scale, past
  `vd.testing.BatchConformance`'s 5 %; its own batch stays within 3 %, 36 of 38 rows identical);
  ``cpu-flash`` 43 of 43 identical (its CPU kernel skips masked KV cells, the other members'), though after
  rewinds and a reorder a few differ (35 of 38 in BatchConformance's batch, within 2 %).
* **dtype**: llama.cpp computes its logits in float32. The rows come back in the dtype asked for, each
  float32 logit rounded once to it (round to nearest even), so a bf16 HF golden and llama.cpp are compared
  as a bf16 recording of either would be; ``--dtype float32`` keeps llama.cpp's own values.
* **forwards**: ``cpu`` (llama.cpp's CPU kernels), ``cpu-flash`` (with its flash attention) and, where
  llama-cpp-python was built with CUDA (``CMAKE_ARGS=-DGGML_CUDA=on``), ``offload`` (every layer on the
  GPU). Threads: torch's count, which vd sets from ``--threads`` (or the recording's) before loading.
* **identity**: the GGUF's name and SHA-256 (the fingerprint: the same file is the same model whatever
  build runs it); **environment()** adds llama-cpp-python's version and llama.cpp's build flags under
  ``engine``, compared by a replay and listed among its numerics differences.
* The prompt is tokenised by the GGUF's own tokenizer (its BOS as the file says).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vd import env
from vd.errors import ModelSpecError
from vd.models import check_gguf
from vd.models.specs import LLAMACPP
from vd.protocol import ModelIdentity

PREFIX = LLAMACPP
N_CTX = 2048  # positions a context holds unless `prepare` asks for more
KV_PAD = 256  # llama.cpp pads a sequence's KV cells to this many
FORWARDS = {
    "cpu": "llama.cpp's CPU evaluation (llama-cpp-python Llama.eval, every row's logits, KV cache removed from "
           "the rewound position), float32 logits rounded once to the dtype asked for",
    "cpu-flash": "llama.cpp's CPU evaluation with its flash attention (flash_attn), float32 logits rounded once "
                 "to the dtype asked for",
    "offload": "llama.cpp with every layer offloaded to the GPU (n_gpu_layers=-1; a CUDA build of "
               "llama-cpp-python), float32 logits rounded once to the dtype asked for",
}


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise ModelSpecError("--model llamacpp:PATH needs llama-cpp-python: pip install 'vd[llamacpp]' (built from "
                             "source; tools/setup_llamacpp.sh caches the wheel)") from e
    bad = libstdcxx_exporters(Path(llama_cpp.__file__).parent / "lib")
    if bad:
        raise ModelSpecError(
            f"this llama-cpp-python build's {', '.join(bad)} carries its own exported copy of libstdc++, which "
            "crashes a process that also holds PyTorch; rebuild it with CMAKE_ARGS='... "
            f"-DCMAKE_SHARED_LINKER_FLAGS={HIDE_STATIC}' (tools/setup_llamacpp.sh adds it to CUDA builds)")
    return llama_cpp


# A symbol only libstdc++ itself defines: a shared library that exports it has libstdc++ linked in statically
# and exported, as nvcc's link of llama.cpp's libggml-cuda.so (CUDA 13) did. Such a copy of
# std::locale and std::regex interposes on the process's libstdc++ in whichever library loads second:
# llama.cpp crashed in its tokenizer's std::regex under PyTorch, and importing PyTorch after it crashed.
LIBSTDCXX_MARK = b"_ZNSt6locale5_Impl"
HIDE_STATIC = "-Wl,--exclude-libs,ALL"  # the linker flag that keeps a static library's symbols private
_DYNSYM = 11


def libstdcxx_exporters(lib_dir: Path) -> list[str]:
    """The shared libraries in ``lib_dir`` that define and export libstdc++'s own symbols (ELF64 little
    endian, read from their dynamic symbol tables; other files are skipped)."""
    out = []
    for path in sorted({p.resolve() for p in lib_dir.glob("*.so*") if p.is_file()}):
        try:
            with open(path, "rb") as f:
                if _exports(f, LIBSTDCXX_MARK):
                    out.append(path.name)
        except (OSError, struct.error, ValueError):
            continue
    return out


def _exports(f, prefix: bytes) -> bool:
    """Whether the ELF file ``f`` defines an exported dynamic symbol whose name starts with ``prefix``."""
    head = f.read(64)
    if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:  # ELF, 64-bit, little endian
        return False
    shoff, = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
    f.seek(shoff)
    table = f.read(shentsize * shnum)
    sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _DYNSYM or not entsize:
            continue
        f.seek(offset)
        symbols = f.read(size)
        _, _, _, _, str_offset, str_size, *_ = sections[link]
        f.seek(str_offset)
        names = f.read(str_size)
        for i in range(0, size - entsize + 1, entsize):
            name, info, _, shndx = struct.unpack_from("<IBBH", symbols, i)
            if shndx and info >> 4 in (1, 2) and names.startswith(prefix, name):  # defined, global or weak
                return True
    return False


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


class LlamaCppModel:
    """A `vd.protocol.VerifyModel` over llama-cpp-python (see the module's docstring)."""

    owns_rows = True  # each forward's rows are copied out of llama-cpp-python's reused scores array

    def __init__(self, path: str | Path, *, device: torch.device, dtype: torch.dtype):
        self.lib = _llama_cpp()
        self.path = Path(path)
        check_gguf(path)
        self.device, self.dtype = torch.device("cpu"), dtype  # rows come back on the host, whatever runs them
        self.threads = torch.get_num_threads()
        self.n_ctx = N_CTX
        self._contexts: dict[str, Any] = {}  # llama_cpp.Llama, an optional dependency
        self._forward = "cpu"
        self.llm = self._context("cpu")
        self.vocab_size = int(self.llm.n_vocab())
        self.context_length = int(self.llm._model.n_ctx_train())
        self._identity: ModelIdentity | None = None
        self._batch: _Batch | None = None  # the batch's own state (`reset_batch`), beside the single sequence

    def _context(self, name: str):
        """A llama.cpp context for forward ``name`` (made once, at the capacity asked for)."""
        llm = self._contexts.get(name)
        if llm is None or llm.n_ctx() < self.n_ctx:
            try:
                llm = self.lib.Llama(model_path=str(self.path), n_ctx=self.n_ctx, n_threads=self.threads,
                                     n_threads_batch=self.threads, logits_all=True, verbose=False,
                                     flash_attn=name == "cpu-flash", n_gpu_layers=-1 if name == "offload" else 0)
            except ValueError as e:  # llama-cpp-python's word for a file llama.cpp refused: bad input, not a crash
                if "Failed to load model" not in str(e):
                    raise
                raise ModelSpecError(f"{LLAMACPP}{self.path}: llama.cpp cannot load it (not a GGUF model, or one "
                                     f"truncated, damaged or of an architecture it lacks): {e}") from e
            self._contexts[name] = llm
        return llm

    def identity(self) -> ModelIdentity:
        if self._identity is None:
            meta = dict(self.llm.metadata)
            name = meta.get("general.name") or self.path.stem
            self._identity = ModelIdentity(
                f"{name} (GGUF, llama.cpp)", f"sha256:{file_sha256(self.path)}",
                {"engine": "llama.cpp", "gguf": self.path.name, "file_type": meta.get("general.file_type"),
                 "architecture": meta.get("general.architecture"), "llama_cpp_python": self.lib.__version__})
        return self._identity

    def environment(self) -> dict:
        """llama-cpp-python's version and llama.cpp's build flags, for the golden's environment; where the
        forward in use is ``offload``, the GPU it ran on (device, GPU name, driver) in place of the host that
        receives the rows (cuDNN stays unset: llama.cpp does not use it)."""
        fields = {"engine": {"name": "llama.cpp", "llama_cpp_python": self.lib.__version__,
                             "system_info": self.lib.llama_print_system_info().decode().strip(),
                             "gpu_offload": bool(self.lib.llama_supports_gpu_offload()),
                             "threads": self.threads}}
        if self._forward == "offload" and torch.cuda.is_available():
            gpu = env.capture(torch.device("cuda"))
            fields.update({f: gpu[f] for f in ("device", "gpu_name", "driver")})
        return fields

    def forwards(self) -> Mapping[str, str]:
        gpu = bool(self.lib.llama_supports_gpu_offload())
        return {n: d for n, d in FORWARDS.items() if n != "offload" or gpu}

    def default_forward(self) -> str:
        return "cpu"

    def set_forward(self, name: str) -> None:
        if name not in self.forwards():
            raise KeyError(name)
        self._forward = name
        self.llm = self._context(name)

    def prepare(self, capacity: int, lengths: Sequence[int] = ()) -> None:
        """Hold at least ``capacity`` positions (a larger context is made where needed)."""
        if capacity > self.n_ctx:
            self.n_ctx = capacity
            self.llm = self._context(self._forward)

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)]

    def decode(self, ids: list[int]) -> str:
        return self.llm.detokenize(list(ids)).decode("utf-8", errors="replace")

    def reset(self) -> None:
        self.llm.reset()

    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        llm, start = self.llm, self.llm.n_tokens
        if start + len(tokens) > llm.n_ctx():
            raise RuntimeError(f"the llama.cpp context holds {llm.n_ctx()} positions; {start + len(tokens)} needed")
        llm.eval([int(t) for t in tokens])
        return self._rows(llm.scores[start:start + len(tokens)])

    def _rows(self, logits) -> torch.Tensor:
        """llama.cpp's float32 ``logits`` (a numpy array over a buffer llama.cpp or llama-cpp-python reuses),
        copied out and rounded once to the model's dtype."""
        return torch.from_numpy(logits.copy()).to(self.dtype)

    def rewind(self, n: int) -> None:
        if n < 0 or n > self.llm.n_tokens:
            raise ValueError(f"cannot rewind {n} of {self.llm.n_tokens} positions")
        self.llm.n_tokens -= n

    # -- the batch (`vd.protocol.BatchedForwards`) ---------------------------------------------------------

    def batch_forwards(self) -> list[str]:
        return list(self.forwards())

    def reset_batch(self, n: int, capacity: int) -> None:
        """Start ``n`` empty sequences in a new batch context of the selected forward (the last one is freed)."""
        if n < 1 or capacity < 1:
            raise ValueError(f"a batch needs at least one member and one position, not {n} × {capacity}")
        most = int(self.lib.llama_max_parallel_sequences())
        if n > most:
            raise ValueError(f"llama.cpp holds at most {most} sequences in a context; a batch of {n} asked")
        if self._batch is not None:
            self._batch.close()
        self._batch = _Batch(self.lib, self.llm, n, capacity)

    def forward_batch(self, tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        b = self._need_batch()
        if len(tokens) != len(b.seq):
            raise ValueError(f"the batch has {len(b.seq)} members; {len(tokens)} token lists given")
        logits = b.decode([[int(t) for t in ids] for ids in tokens])
        out, start = [], 0
        for ids in tokens:
            out.append(self._rows(logits[start:start + len(ids)]))
            start += len(ids)
        return out

    def rewind_batch(self, member: int, n: int) -> None:
        self._need_batch().rewind(member, n)

    def reorder_batch(self, order: Sequence[int]) -> None:
        b = self._need_batch()
        if sorted(order) != list(range(len(b.seq))):
            raise ValueError(f"{list(order)} is not a permutation of the batch's {len(b.seq)} slots")
        b.seq = [b.seq[i] for i in order]

    def _need_batch(self) -> _Batch:
        if self._batch is None:
            raise RuntimeError("no batch: reset_batch starts one")
        return self._batch


class _Batch:
    """A batch's llama.cpp state: its own context beside the forward's (the same loaded model, its context
    parameters but ``n_seq_max`` sequences in one unified KV cache of ``n`` × ``capacity`` positions, padded as
    llama.cpp pads), one llama.cpp sequence id per member, and the ``llama_batch`` each step fills."""

    def __init__(self, lib, llm, n: int, capacity: int):
        from llama_cpp import _internals

        self.lib, self.capacity, self.n_vocab = lib, capacity, int(llm.n_vocab())
        params = lib.llama_context_params.from_buffer_copy(llm.context_params)  # threads, flash attention
        params.n_ctx = n * -(-capacity // KV_PAD) * KV_PAD
        params.n_batch, params.n_seq_max, params.kv_unified = params.n_ctx, n, True
        self.ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=params.n_ctx, embd=0, n_seq_max=1, verbose=False)
        self.seq = list(range(n))  # slot -> llama.cpp sequence id: a reorder relabels, the KV stays put
        self.length = [0] * n  # positions held, by sequence id

    def decode(self, tokens: list[list[int]]):
        """Append ``tokens[slot]`` to each slot's sequence in one ``llama_decode``; every token's float32 logits,
        ``[sum of lengths, n_vocab]`` in slot order (a view of llama.cpp's buffer, valid until the next call)."""
        total = sum(len(ids) for ids in tokens)
        for slot, ids in enumerate(tokens):
            have = self.length[self.seq[slot]]
            if have + len(ids) > self.capacity:
                raise RuntimeError(f"member {slot} of the batch holds {self.capacity} positions; "
                                   f"{have + len(ids)} needed")
        if total:
            self._fill(tokens)
            self.ctx.decode(self.batch)
        for slot, ids in enumerate(tokens):
            self.length[self.seq[slot]] += len(ids)
        if not total:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        return np.ctypeslib.as_array(self.ctx.get_logits(), shape=(total * self.n_vocab,)).reshape(total, -1)

    def _fill(self, tokens: list[list[int]]) -> None:
        """Write ``tokens`` into the ``llama_batch``: each token its sequence id, position and a logits row."""
        b, i = self.batch.batch, 0
        for slot, ids in enumerate(tokens):
            seq, start = self.seq[slot], self.length[self.seq[slot]]
            for k, token in enumerate(ids):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, start + k, 1, True
                b.seq_id[i][0] = seq
                i += 1
        b.n_tokens = i

    def rewind(self, member: int, n: int) -> None:
        """Drop the last ``n`` positions of the sequence in slot ``member`` from the KV cache."""
        seq = self.seq[member]
        have = self.length[seq]
        if n < 0 or n > have:
            raise ValueError(f"cannot rewind {n} of member {member}'s {have} positions")
        if n and not self.lib.llama_memory_seq_rm(self.ctx.memory, seq, have - n, -1):
            raise RuntimeError(f"llama.cpp could not remove member {member}'s last {n} positions")
        self.length[seq] = have - n

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def load(spec: str, device: torch.device, dtype: torch.dtype) -> LlamaCppModel:
    """``llamacpp:PATH.gguf`` on ``device`` (llama.cpp places it: the forwards say where)."""
    return LlamaCppModel(spec[len(PREFIX):], device=device, dtype=dtype)
