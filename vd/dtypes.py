"""The logits dtypes vd computes in and stores, in one table, and the bit-exact conversions between a
tensor, its stored numpy array and its float values.

bfloat16 has no numpy or zarr dtype, so it is stored as its uint16 bit pattern; float16 and float32 are
stored as themselves, all little-endian. Comparing bits means comparing the values as signed integers of
their width (`int_view`, `int_bits`): equal bits, equal integers. This module leaves out how the
stored arrays are laid out and encoded (`vd.store.format`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vd.errors import UsageError


@dataclass(frozen=True, slots=True)
class LogitsDtype:
    """One logits dtype: its name in a golden and on the command line, its torch dtype, the numpy dtype
    it is stored as, its explicit mantissa bits (a ULP's size) and how its storage reads."""

    name: str
    torch: torch.dtype
    storage: np.dtype
    mantissa_bits: int
    description: str


DTYPES: dict[str, LogitsDtype] = {d.name: d for d in (
    LogitsDtype("bfloat16", torch.bfloat16, np.dtype("<u2"), 7, "bfloat16 as its uint16 bit pattern, little-endian"),
    LogitsDtype("float16", torch.float16, np.dtype("<f2"), 10, "IEEE float16, little-endian"),
    LogitsDtype("float32", torch.float32, np.dtype("<f4"), 23, "IEEE float32, little-endian"),
)}
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
_BY_TORCH = {d.torch: d for d in DTYPES.values()}
_BY_STORAGE = {d.storage.str: d for d in DTYPES.values()}


def parse_dtype(name: str) -> LogitsDtype:
    """``bfloat16``/``float16``/``float32`` (or bf16, fp16, fp32), or a UsageError naming the choices."""
    d = DTYPES.get(ALIASES.get(name, name))
    if d is None:
        raise UsageError(f"unknown dtype {name!r} (choose from {', '.join(DTYPES)})")
    return d


def of_torch(dtype: torch.dtype) -> LogitsDtype:
    """The table's entry for a torch logits dtype."""
    return _BY_TORCH[dtype]


def of_storage(a: np.ndarray) -> LogitsDtype:
    """The table's entry for a stored array's numpy dtype."""
    return _BY_STORAGE[a.dtype.str]


def int_view(t: torch.Tensor) -> torch.Tensor:
    """A logits tensor viewed as signed integers of its width: equal bits, equal integers."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def int_bits(a: np.ndarray) -> np.ndarray:
    """A stored array viewed as signed integers of its width, contiguous (ready for ``torch.from_numpy``)."""
    return np.ascontiguousarray(a).view({2: np.int16, 4: np.int32}[a.dtype.itemsize])


def to_tensor(a: np.ndarray) -> torch.Tensor:
    """A stored array as a CPU tensor of its logical dtype, bits unchanged."""
    return torch.from_numpy(int_bits(a)).view(of_storage(a).torch)


def to_storage(t: torch.Tensor) -> np.ndarray:
    """Logits on any device as their stored array on the host (bf16 becomes uint16 bits)."""
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def to_float(a: np.ndarray, logical: str) -> np.ndarray:
    """A stored array's values as float32 (exact for every dtype in the table)."""
    if logical == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)
