"""Module outputs of an HF decoder, traced by forward hooks (`vd.protocol.ModuleTrace`, ``vd locate``).

The traced points follow the decoder's own structure, in the order a forward computes them: the embeddings;
per layer the input norm, the q/k/v projections, the attention output before ``o_proj`` (an input hook on
``o_proj``), ``o_proj``, the residual sum after attention (the post-attention norm's input), the
post-attention norm, the MLP's gate/up/down projections (or, for a mixture of experts or any MLP without a
``down_proj``, the MLP's combined output) and the layer's output; then the final norm and the LM head. A module
a given architecture lacks is left out. Hooks see what HF's modules compute (eager and SDPA, pinned or not);
vd's lean static step hands over the same points itself, under the same names (`vd.models.lean`), and where
it is compiled the points at its compiled regions' edges (the rotated queries and keys, the values, the
attention output, each layer's output).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Point:
    """One traced point: the module, its path, what it is, and whether its input (not its output) is traced."""

    module: torch.nn.Module
    name: str
    what: str
    on_input: bool = False


# Per decoder layer, in execution order: (path under the layer, what it is, traced on the module's input).
_LAYER = (
    ("input_layernorm", "input norm", False),
    ("self_attn.q_proj", "q projection", False),
    ("self_attn.k_proj", "k projection", False),
    ("self_attn.v_proj", "v projection", False),
    # MLA (DeepSeek-V3): its kv up-projection runs over the whole cache, not the step's rows, and is left out
    ("self_attn.q_a_proj", "q down-projection (MLA)", False),
    ("self_attn.q_b_proj", "q up-projection (MLA)", False),
    ("self_attn.kv_a_proj_with_mqa", "kv down-projection with the rotary key (MLA)", False),
    ("self_attn.o_proj", "attention output before o_proj", True),
    ("self_attn.o_proj", "attention output projection (o_proj)", False),
    ("post_attention_layernorm", "residual sum after attention", True),
    ("post_attention_layernorm", "post-attention norm", False),
    ("mlp.gate_proj", "MLP gate projection", False),
    ("mlp.up_proj", "MLP up projection", False),
    ("mlp.down_proj", "MLP down projection", False),
)


def _get(root: torch.nn.Module, path: str) -> torch.nn.Module | None:
    for part in path.split("."):
        root = getattr(root, part, None)  # type: ignore[assignment]
        if root is None:
            return None
    return root


def points(model: torch.nn.Module) -> list[Point]:
    """The traced points of an HF ``*ForCausalLM`` whose decoder is ``model.model`` (none where it has no layers)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None:
        return []
    out = [Point(m, "model.embed_tokens", "embeddings")] if (m := _get(base, "embed_tokens")) is not None else []
    for i, layer in enumerate(layers):
        for path, what, on_input in _LAYER:
            m = _get(layer, path)
            if m is not None:
                out.append(Point(m, f"model.layers.{i}.{path}", what, on_input))
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and _get(layer, "mlp.down_proj") is None:
            out.append(Point(mlp, f"model.layers.{i}.mlp", "MLP output (the experts' combined output)"))
        out.append(Point(layer, f"model.layers.{i}", "layer output (the residual stream)"))
    for m, name, what in ((_get(base, "norm"), "model.norm", "final norm"),
                          (getattr(model, "lm_head", None), "lm_head", "LM head")):
        if m is not None:
            out.append(Point(m, name, what))
    return out


def _rows(x) -> torch.Tensor | None:
    """A hooked value's tensor, its leading axes of one dropped: ``[n, ...]`` (a batch's ``[n, L, ...]``), None
    where it holds no tensor."""
    if isinstance(x, tuple):
        x = x[0] if x else None
    if not isinstance(x, torch.Tensor):
        return None
    while x.dim() >= 3 and x.shape[0] == 1:  # a batch of one (MLA's key/value up-projection: two such axes)
        x = x[0]
    return x  # `vd.tracing.Call` copies what it keeps


@contextlib.contextmanager
def traced(model: torch.nn.Module, record: Callable[[str, str, torch.Tensor], None]) -> Iterator[None]:
    """Inside, each point of ``model`` (`points`) hands its output (or input) to ``record`` as it is computed."""
    handles = []
    for p in points(model):
        def hook(module, args, output=None, p=p):
            rows = _rows(args if p.on_input else output)
            if rows is not None:
                record(p.name, p.what, rows)
        handles.append(p.module.register_forward_pre_hook(hook) if p.on_input
                       else p.module.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
