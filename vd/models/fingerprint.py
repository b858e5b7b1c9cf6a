"""A model's weight fingerprint (`vd.protocol.ModelIdentity.fingerprint`): SHA-256 over the state dict as loaded
and over the config fields that change its arithmetic.

Generated-weight models hash checksums computed on their device instead, over the same config fields
(`vd.models.generated`); both kinds of fingerprinter have the `Fingerprinter` signature an adapter is given.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import torch

# Config fields that change the arithmetic and exist under these names across transformers 5.x.
_IDENTITY_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "hidden_act",
    "tie_word_embeddings", "attention_bias", "mlp_bias",
)

Fingerprinter = Callable[[torch.nn.Module, Any], str]  # (model, its config) to ``sha256:<hex>``


def identity_fields(config: Any) -> dict[str, Any]:
    """The config fields that change a model's arithmetic, as every vd fingerprint hashes them."""
    fields = {f: getattr(config, f, None) for f in _IDENTITY_FIELDS}
    rope = getattr(config, "rope_parameters", None) or {}
    fields["rope_theta"] = getattr(config, "rope_theta", None) or rope.get("rope_theta")
    return fields


def fingerprint(model: torch.nn.Module, config: Any) -> str:
    """``sha256:<hex>`` over the state dict as loaded and the arithmetic-relevant config fields."""
    h = hashlib.sha256()
    h.update(json.dumps(identity_fields(config), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


def first_known(fp: str | None) -> Fingerprinter:
    """A fingerprinter answering ``fp`` (already computed from these weights) once, then hashing."""
    known = [fp] if fp is not None else []

    def fingerprinter(model: torch.nn.Module, config: Any) -> str:
        return known.pop() if known else fingerprint(model, config)

    return fingerprinter
