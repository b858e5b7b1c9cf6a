"""Seeded random-weight HF models built on the host: numpy's PCG64 stream fills every parameter, so the weights
(and so the fingerprint) are the same bits on every CPU and every device they are moved to.

The small test presets and their draft heads are built here; full-size shapes, too large to draw on the host,
are generated on their device (`vd.models.generated`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vd.models.checkpoints import quiet_transformers
from vd.models.hf import HFModel
from vd.models.text import ByteCodec


def seeded_init(model: torch.nn.Module, seed: int, std: float) -> None:
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


def build_random(config: Any, *, seed: int, name: str, device: torch.device, dtype: torch.dtype) -> HFModel:
    """A random-weight model of ``config``, seeded and platform-independent, built on the CPU and
    then moved, so its weights are identical on every machine and device."""
    from transformers import AutoModelForCausalLM

    with quiet_transformers():
        config._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    seeded_init(model, seed, config.initializer_range)
    model.to(device=device, dtype=dtype)
    return HFModel(model, name=name, encode=ByteCodec(config.vocab_size),
                   details={"seed": seed, "random_weights": True})
