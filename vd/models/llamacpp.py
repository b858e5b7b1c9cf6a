"""The llama.cpp adapter (``--model llamacpp:PATH.gguf``; ``pip install 'vd[llamacpp]'``): a GGUF model run by
llama-cpp-python's own evaluation, as an engine integrator runs it, held to the same goldens as any forward.

* **forward** evaluates the tokens with ``Llama.eval`` (every row's logits kept: ``logits_all``) and copies
  their rows out of llama-cpp-python's reused ``scores`` array (vd holds rows it is given). **rewind** lowers
  ``n_tokens``: the next evaluation removes the KV cache from there (``kv_cache_seq_rm``), as llama.cpp's
  own server does after a rejected draft.
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

import torch

from vd import env
from vd.errors import ModelSpecError
from vd.protocol import ModelIdentity

PREFIX = "llamacpp:"
N_CTX = 2048  # positions a context holds unless `prepare` asks for more
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
        if not self.path.is_file():
            raise ModelSpecError(f"{PREFIX}{path}: no such file")
        if self.path.suffix != ".gguf":
            raise ModelSpecError(f"{PREFIX}{path}: not a .gguf file")
        self.device, self.dtype = torch.device("cpu"), dtype  # rows come back on the host, whatever runs them
        self.threads = torch.get_num_threads()
        self.n_ctx = N_CTX
        self._contexts: dict[str, Any] = {}  # llama_cpp.Llama, an optional dependency
        self._forward = "cpu"
        self.llm = self._context("cpu")
        self.vocab_size = int(self.llm.n_vocab())
        self.context_length = int(self.llm._model.n_ctx_train())
        self._identity: ModelIdentity | None = None

    def _context(self, name: str):
        """A llama.cpp context for forward ``name`` (made once, at the capacity asked for)."""
        llm = self._contexts.get(name)
        if llm is None or llm.n_ctx() < self.n_ctx:
            llm = self.lib.Llama(model_path=str(self.path), n_ctx=self.n_ctx, n_threads=self.threads,
                                 n_threads_batch=self.threads, logits_all=True, verbose=False,
                                 flash_attn=name == "cpu-flash", n_gpu_layers=-1 if name == "offload" else 0)
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
        rows = torch.from_numpy(llm.scores[start:start + len(tokens)].copy())  # out of the reused buffer
        return rows.to(self.dtype)

    def rewind(self, n: int) -> None:
        if n < 0 or n > self.llm.n_tokens:
            raise ValueError(f"cannot rewind {n} of {self.llm.n_tokens} positions")
        self.llm.n_tokens -= n


def load(spec: str, device: torch.device, dtype: torch.dtype) -> LlamaCppModel:
    """``llamacpp:PATH.gguf`` on ``device`` (llama.cpp places it: the forwards say where)."""
    return LlamaCppModel(spec[len(PREFIX):], device=device, dtype=dtype)
