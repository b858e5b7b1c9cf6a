"""Loading an HF causal LM from local disk: a checkpoint directory, or a ``.gguf`` file whose dequantised form
is cached (`vd.models.weights`), offline, with transformers' progress bars and advisories kept off the terminal.

Nothing is fetched from a hub. Random-weight models are built in process instead (`vd.models.seeded`,
`vd.models.generated`); the adapter they all become is `vd.models.hf.HFModel`.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from vd.dtypes import of_torch
from vd.errors import ModelSpecError
from vd.models.fingerprint import fingerprint, first_known
from vd.models.hf import HFModel
from vd.models.text import ByteCodec, Codec, TokenizerCodec


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
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


def load_checkpoint(path: Path, *, device: torch.device, dtype: torch.dtype) -> HFModel:
    """An HF checkpoint directory, or a `.gguf` file (loaded with ``gguf_file=``, its dequantised form
    cached: `vd.models.weights`), from local disk. A checkpoint without a tokenizer encodes prompts as
    UTF-8 bytes (recorded in its details)."""
    model, tok, fp = _converted(path, dtype) if path.is_file() and path.suffix == ".gguf" else (
        *from_pretrained(path, dtype), None)
    model.to(device)
    aligned(model)
    encode: Codec
    if tok is not None:
        encode, tokenizer = TokenizerCodec(tok), type(tok).__name__
    else:
        encode, tokenizer = ByteCodec(model.config.vocab_size), "none: UTF-8 bytes"
    return HFModel(model, name=f"{type(model).__name__} from {path.name}", encode=encode,
                   details={"source": str(path), "tokenizer": tokenizer}, fingerprinter=first_known(fp))


ALIGNMENT = 64  # bytes: where PyTorch's CPU allocator places a tensor of its own


def aligned(model: torch.nn.Module) -> None:
    """Every CPU parameter and buffer of ``model`` moved, where it is not, into memory of its own, aligned as
    PyTorch allocates a tensor. A checkpoint memory-mapped by safetensors leaves its tensors at the file's
    offsets (8 bytes past a 64-byte boundary in the converted-weights cache), a GGUF's conversion at others, and
    a CPU BLAS may round a one-row matmul (every decode row's) differently by its operands' alignment: on an AMD
    EPYC (MKL), the decode rows of SmolLM2 in float32 loaded from its fresh conversion were not those of the same
    weights loaded from the cache, so a golden recorded by a machine's first load failed every later replay."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "cpu" and t.data_ptr() % ALIGNMENT:
                t.data = t.data.clone()  # (a tied weight is one parameter: moved once, for both)


def _converted(gguf: Path, dtype: torch.dtype) -> tuple[Any, Any, str]:
    """A GGUF checkpoint's model (on the CPU), tokenizer and fingerprint, from the converted-weights cache
    where it holds the file's conversion and the weights there still hash to the fingerprint stored with
    them (else converted again and stored)."""
    from vd.models import weights

    name = of_torch(dtype).name
    entry = None
    with contextlib.suppress(OSError):
        entry = weights.entry_path(gguf, name)
    if entry is not None and weights.ready(entry):
        try:
            model, tok = from_pretrained(entry, dtype)
            fp = fingerprint(model, model.config)
            if fp == weights.stored_fingerprint(entry):
                return model, tok, fp
        except Exception:  # noqa: BLE001  a damaged entry fails to load in any way: converted again below
            pass
        weights.discard(entry)
    model, tok = from_pretrained(gguf, dtype)
    fp = fingerprint(model, model.config)
    if entry is not None:
        weights.store(entry, model, tok, gguf, name, fp)
    return model, tok, fp


def from_pretrained(path: Path, dtype: torch.dtype) -> tuple[Any, Any]:
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
