"""A plug-in for tests: tiny-llama's architecture and vocabulary with other random weights (seed 7),
so its fingerprint differs from tiny-llama's while every shape matches."""

from transformers import LlamaConfig

from vd.models.presets import PRESETS
from vd.models.seeded import build_random


def factory(device, dtype):
    cfg = PRESETS["tiny-llama"].build(device, dtype).config
    return build_random(LlamaConfig(**cfg.to_dict()), seed=7, name="tiny-llama reseeded", device=device,
                        dtype=dtype)
