"""Generated weights: model shapes too large to draw from numpy on the host, filled where they live.

`hash_uniform_` gives every element a value from an integer hash of its index and a seed (exact on every CPU and
GPU), so a full-size model is built directly on its GPU (`generate`, `build_generated`) and a tensor-parallel
shard fills only its own slice of each tensor (`Region`, `vd.models.tp`). Hashing gigabytes on the host would
take longer than a replay, so a generated model's fingerprint hashes a checksum of each tensor computed on
its device (`generated_fingerprint`) instead of its bytes (`vd.models.fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vd.models.checkpoints import quiet_transformers
from vd.models.fingerprint import Fingerprinter, identity_fields
from vd.models.hf import HFModel
from vd.models.text import ByteCodec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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


def tensor_seed(seed: int, name: str) -> int:
    """The `hash_uniform_` seed of parameter ``name`` of the model generated from ``seed``."""
    return zlib.crc32(f"{seed}:{name}".encode()) & _M32


# A checksum's chunk: its int64 temporaries (a handful of 64 MiB) stay small beside a model that fills its GPU
# (a 70B-shape shard on an H200 two ranks share ran out at 2**25). The sums are exact integers, so the chunk
# never changes a checksum.
CHECKSUM_CHUNK = 1 << 23


def device_checksum(t: torch.Tensor, chunk: int = CHECKSUM_CHUNK) -> int:
    """A position-weighted sum of ``t``'s bit patterns, exact in int64 and computed where ``t`` lives."""
    return int(checksum_on_device(t, chunk).sum())


def checksum_on_device(t: torch.Tensor, chunk: int = CHECKSUM_CHUNK, at: Region | None = None) -> torch.Tensor:
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


def fingerprint_of(config: Any, seed: int, tensors: list[tuple[str, torch.dtype, tuple[int, ...], int]]) -> str:
    """A generated model's fingerprint from each tensor's (name, dtype, whole shape, checksum), by name."""
    h = hashlib.sha256()
    h.update(json.dumps({"fields": identity_fields(config), "generator": GENERATOR, "seed": seed},
                        sort_keys=True, default=str).encode())
    for name, dtype, shape, total in tensors:
        h.update(f"{name}|{dtype}|{shape}|{total}|".encode())
    return "sha256:" + h.hexdigest()


def generated_fingerprint(seed: int) -> Fingerprinter:
    """The fingerprint of a generated model: its config fields, generator and seed, and a device-side
    checksum of every tensor (hashing many gigabytes on the host would take longer than a replay)."""

    def fp(model: torch.nn.Module, config: Any) -> str:
        tensors = sorted(model.state_dict().items())
        parts = [checksum_on_device(t) for _, t in tensors]  # every tensor's queued, then one read-back
        flat = torch.cat(parts).tolist() if parts else []  # a generated model lives on one device
        sums, at = [], 0
        for part in parts:
            sums.append(sum(flat[at:at + part.numel()]))  # summed here: Python integers do not overflow
            at += part.numel()
        return fingerprint_of(config, seed, [(name, t.dtype, tuple(t.shape), total)
                                             for (name, t), total in zip(tensors, sums)])

    return fp


def generate(config: Any, seed: int, device: torch.device, dtype: torch.dtype, attention: str = "eager",
             at: Callable[[str, tuple[int, ...]], Region | None] | None = None) -> PreTrainedModel:
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
                hash_uniform_(p, tensor_seed(seed, pname), config.initializer_range,
                              at=None if at is None else at(pname, tuple(p.shape)))
    return model


def build_generated(config: Any, *, seed: int, name: str, device: torch.device, dtype: torch.dtype) -> HFModel:
    """A model of ``config`` with `hash_uniform_` weights built directly on ``device`` in ``dtype`` (norm
    weights one): for full-size shapes (8 B parameters), too large for `vd.models.seeded.build_random` to draw
    on the host."""
    return HFModel(generate(config, seed, device, dtype), name=name, encode=ByteCodec(config.vocab_size),
                   details={"seed": seed, "random_weights": True, "generator": GENERATOR},
                   fingerprinter=generated_fingerprint(seed))
