"""vd's own step for Llama-family stacks (Llama, Qwen2) over the static KV cache: the HF model's own
weights, norms' and rotary's arithmetic, in fewer kernels than HF's modules launch.

Why: besides its GEMMs, each layer of HF's modules launches many small kernels (norms, rotary, cache
writes, the attention's key/value repeats, splits and copies), and on a GPU those add up to a large
share of a verify step's time. This step:

* multiplies by the layer's query, key and value weights in one GEMM and by its gate and up weights in
  another (the fused weights are the storage the HF modules use: their weights become views into it,
  so nothing is copied and HF's own forwards keep the same values);
* rotates queries and keys together (one set of rotary kernels a layer), with the cos/sin rows taken
  from tables the model's own rotary module fills once per cache capacity (the same elementwise
  arithmetic HF does each step, so the same values);
* writes keys and values straight into the cache and attends with SDPA's grouped-query mode instead of
  repeating them per query head;
* keeps HF's arithmetic for RMSNorm (fp32 inside, weight times the rounded result), the residual adds
  and SiLU(gate) * up.

Its logits are HF's within float rounding, and bit for bit only where the kernels happen to agree (a
fused GEMM may pick another cuBLAS kernel, grouped-query SDPA another backend). Like every forward, it
is held bit for bit to its own goldens.
Under ``compiled`` each layer's two elementwise-heavy regions (norm, QKV, rotary; output projection,
residual, norm, MLP, residual) are compiled with Inductor once per step shape and reused by every layer
(the weights are arguments), so compiling a stack of any depth costs what compiling one layer does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vd.models.inductor import inductor_settings

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # position-only tables; dynamic and longrope are not


def unsupported(model: torch.nn.Module) -> str | None:
    """Why vd's lean step cannot run ``model`` (None when it can)."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {', '.join(ARCHITECTURES)}"
    return _unsupported_llama(model)


def _unsupported_llama(model: Any) -> str | None:
    """Why the lean step cannot run a Llama-family ``model``: its submodules are reached by their names."""
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope not in ROPE_TYPES:
        return f"RoPE type {rope!r} (its tables depend on the sequence length)"
    layer = model.model.layers[0]
    if layer.self_attn.o_proj.bias is not None or any(
            getattr(layer.mlp, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
        return "biased output or MLP projections"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm/Qwen2RMSNorm arithmetic: fp32 inside, weight times the result rounded back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


Record = Callable[[str, str, torch.Tensor], None]  # a traced point: (path under the layer, what it is, rows)


def attn_in(x, w_norm, eps: float, wqkv, bqkv, cos, sin, hq: int, hkv: int, d: int, rec: Record | None = None):
    """Norm, the fused QKV projection and rotary: queries ``[1, hq, n, d]``, keys and values
    ``[1, hkv, n, d]``. ``rec`` (never under compile) sees the norm's and each projection's output: the
    same kernels run with or without it."""
    n = x.shape[0]
    h = rms_norm(x, w_norm, eps)
    qkv = F.linear(h, wqkv, bqkv)
    if rec is not None:
        rec("input_layernorm", "input norm", h)
        for name, lo, hi in (("q", 0, hq), ("k", hq, hq + hkv), ("v", hq + hkv, hq + 2 * hkv)):
            rec(f"self_attn.{name}_proj", f"{name} projection", qkv[:, lo * d: hi * d])
    qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
    half = d // 2
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)  # HF's rotate_half
    qk = qk * cos[:, None] + rotated * sin[:, None]
    q = qk[:, :hq].transpose(0, 1)[None]
    k = qk[:, hq:].transpose(0, 1)[None]
    v = qkv[:, (hq + hkv) * d:].view(n, hkv, d).transpose(0, 1)[None]
    return q, k, v


def attn_out_mlp(x, attn, wo, w_norm, eps: float, wgu, wd, inter: int, rec: Record | None = None):
    """Output projection and residual, then norm, SiLU(gate) * up, down projection and residual. ``rec`` (never
    under compile) sees each intermediate output: the same kernels run with or without it."""
    if rec is None:
        n = x.shape[0]
        x = x + F.linear(attn[0].transpose(0, 1).reshape(n, -1), wo)
        gu = F.linear(rms_norm(x, w_norm, eps), wgu)
        return x + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], wd)
    a = attn[0].transpose(0, 1).reshape(x.shape[0], -1)
    o = F.linear(a, wo)
    x = x + o
    h = rms_norm(x, w_norm, eps)
    gu = F.linear(h, wgu)
    down = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], wd)
    for path, what, t in (("self_attn.o_proj", "attention output before o_proj", a),
                          ("self_attn.o_proj", "attention output projection (o_proj)", o),
                          ("post_attention_layernorm", "residual sum after attention", x),
                          ("post_attention_layernorm", "post-attention norm", h),
                          ("mlp.gate_proj", "MLP gate projection", gu[:, :inter]),
                          ("mlp.up_proj", "MLP up projection", gu[:, inter:]),
                          ("mlp.down_proj", "MLP down projection", down)):
        rec(path, what, t)
    return x + down


def attn_out(attn, wo):
    """The output projection alone (tensor parallel: this rank's heads' share, summed across ranks)."""
    return F.linear(attn[0].transpose(0, 1).reshape(attn.shape[2], -1), wo)


def mlp(x, w_norm, eps: float, wgu, wd, inter: int):
    """Norm, SiLU(gate) * up and the down projection alone (tensor parallel: this rank's share)."""
    gu = F.linear(rms_norm(x, w_norm, eps), wgu)
    return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], wd)


@dataclass(slots=True)
class _Weights:
    w_in: torch.Tensor
    eps_in: float
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    w_post: torch.Tensor
    eps_post: float
    wgu: torch.Tensor
    wd: torch.Tensor
    scale: float


def _fuse(linears) -> torch.Tensor:
    """One weight tensor holding ``linears``' weights stacked by output row; each module's weight
    becomes a view into it (same values, so HF's own forward is unchanged, and no memory doubled). A
    second stack over the same modules (another static forward) reuses the first one's tensor."""
    fused = getattr(linears[0], "_vd_fused", None)
    row = 0
    views = []
    for lin in linears:
        views.append((lin, row, lin.weight.shape[0]))
        row += lin.weight.shape[0]
    if fused is not None and all(lin.weight.data_ptr() == fused[r].data_ptr() for lin, r, _ in views):
        return fused
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whatever mode builds the stack
        fused = torch.cat([lin.weight.detach() for lin in linears])
        for lin, r, rows in views:
            lin.weight.data = fused[r: r + rows]
    linears[0]._vd_fused = fused
    return fused


def _fused_bias(linears) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    with torch.no_grad():
        return torch.cat([b.detach() if b is not None else torch.zeros(lin.weight.shape[0], dtype=lin.weight.dtype,
                                                                     device=lin.weight.device)
                          for b, lin in zip(biases, linears)])


class LeanStack:
    """The lean step of one Llama-family model (`unsupported` says which)."""

    description = ("vd's lean Llama-family step (fused QKV and gate-up GEMMs, rotary on queries and keys at once, "
                   "grouped-query SDPA, HF's norm arithmetic)")

    def __init__(self, model: Any, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``model``: a Llama-family model (`unsupported` says None), its submodules reached by their names;
        ``reduce``: for a tensor-parallel shard (`vd.models.tp`), the in-place sum across ranks of each
        layer's output and down projections (None: the model is whole)."""
        cfg = model.config.get_text_config()
        self.reduce = reduce
        inner = model.model
        self.hq, self.hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq
        self.inter = cfg.intermediate_size
        self.rotary = inner.rotary_emb
        self.embed = inner.embed_tokens.weight.detach()
        self.norm, self.norm_eps = inner.norm.weight.detach(), inner.norm.variance_epsilon
        self.lm_head = model.lm_head.weight.detach()
        self.layers: list[_Weights] = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = (a.q_proj, a.k_proj, a.v_proj)
            bqkv = _fused_bias(qkv)
            self.layers.append(_Weights(
                w_in=layer.input_layernorm.weight.detach(), eps_in=layer.input_layernorm.variance_epsilon,
                wqkv=_fuse(qkv), bqkv=bqkv, wo=a.o_proj.weight.detach(),
                w_post=layer.post_attention_layernorm.weight.detach(),
                eps_post=layer.post_attention_layernorm.variance_epsilon,
                wgu=_fuse((m.gate_proj, m.up_proj)), wd=m.down_proj.weight.detach(), scale=a.scaling))
        self.cos: torch.Tensor | None = None  # rotary tables, [capacity, d] (`allocate`)
        self.sin: torch.Tensor | None = None
        self._attn_in, self._attn_out_mlp, self._attn_out, self._mlp = attn_in, attn_out_mlp, attn_out, mlp

    def compile(self) -> None:
        """Compile each layer's two regions (one compilation per step shape, shared by every layer)."""
        inductor_settings()
        self._attn_in = torch.compile(attn_in, dynamic=False, fullgraph=True)
        if self.reduce is None:
            self._attn_out_mlp = torch.compile(attn_out_mlp, dynamic=False, fullgraph=True)
        else:  # the sums across ranks stay outside the compiled regions
            self._attn_out = torch.compile(attn_out, dynamic=False, fullgraph=True)
            self._mlp = torch.compile(mlp, dynamic=False, fullgraph=True)

    def allocate(self, kv) -> None:
        """Size the rotary tables and ``kv``'s layers for ``kv.capacity`` positions."""
        self.cos, self.sin = self.tables(kv.capacity, kv.device)
        kv.allocate(self.hkv, self.d, self.embed.dtype)

    def tables(self, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables ``cos, sin`` ``[positions, d]``, filled by the model's own rotary module."""
        pos = torch.arange(positions, device=device)[None]
        cos, sin = self.rotary(torch.zeros((), dtype=self.embed.dtype, device=device), position_ids=pos)
        return cos[0], sin[0]

    def regions(self, fast: bool) -> tuple[Callable, Callable]:
        """A layer's two regions, ``attn_in`` and the output projection and MLP (summed across ranks for a
        shard): the compiled ones where ``fast`` (when compiled), else the plain functions."""
        a_in, a_out = (self._attn_in, self._attn_out_mlp) if fast else (attn_in, attn_out_mlp)
        if self.reduce is not None:
            a_out = self._reduced(*((self._attn_out, self._mlp) if fast else (attn_out, mlp)))
        return a_in, a_out

    def step(self, inp: torch.Tensor, kv, *, fast: bool, hidden: bool, record: Callable | None = None):
        """Tokens ``inp[:-1]`` at positions from ``inp[-1]``: (logits ``[n, V]``, hidden ``[n, H]`` or
        None). ``fast`` runs the compiled regions (when compiled). ``record(name, what, rows)`` (`trace`), if
        given, sees the traced points as they are computed, under the names `vd.models.trace` gives HF's
        modules: inside each layer's regions where they run as plain kernels, at the regions' edges where
        compiled (their insides are fused)."""
        n = inp.shape[0] - 1
        pos, mask = kv.begin(inp[n], n, self.embed.dtype)
        assert self.cos is not None and self.sin is not None, "allocate sizes the rotary tables before a step"

        def attend(layer, w: _Weights, q, k, v):
            layer.keys.index_copy_(2, pos, k)
            layer.values.index_copy_(2, pos, v)
            return F.scaled_dot_product_attention(q, layer.keys, layer.values, attn_mask=mask, scale=w.scale,
                                                  enable_gqa=True)

        h, logits = self.layers_forward(F.embedding(inp[:n], self.embed), self.cos[pos], self.sin[pos],
                                        kv.cache.layers, attend, fast=fast, record=record)
        return logits, (h if hidden else None)

    def layers_forward(self, x: torch.Tensor, cos, sin, caches, attend: Callable, *, fast: bool,
                       record: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``x`` ``[rows, H]`` (embedded) through every layer, the final norm and the LM head: (the normed
        hidden states, the logits ``[rows, V]``); ``attend(cache, weights, q, k, v)`` writes a layer's keys and
        values into its cache and returns its attention output ``[1, hq, rows, d]`` (one sequence's, or a batch's
        members attending apart: `vd.models.batch.lean_step`). ``record`` as `step`'s, each point ``[rows,
        width]``."""
        a_in, a_out = self.regions(fast)
        plain = a_in is attn_in and record is not None
        if record is not None:
            record("model.embed_tokens", "embeddings", x)
        for i, (w, cache) in enumerate(zip(self.layers, caches)):
            rec = layer_record(record, f"model.layers.{i}.") if record is not None else None
            q, k, v = (attn_in(x, w.w_in, w.eps_in, w.wqkv, w.bqkv, cos, sin, self.hq, self.hkv, self.d, rec)
                       if plain else a_in(x, w.w_in, w.eps_in, w.wqkv, w.bqkv, cos, sin, self.hq, self.hkv, self.d))
            attn = attend(cache, w, q, k, v)
            if rec is not None:
                region_edges(rec, q, k, v, attn, inside=plain)
            x = (attn_out_mlp(x, attn, w.wo, w.w_post, w.eps_post, w.wgu, w.wd, self.inter, rec) if plain
                 else a_out(x, attn, w.wo, w.w_post, w.eps_post, w.wgu, w.wd, self.inter))
            if rec is not None:
                rec("", "layer output (the residual stream)", x)
        h = rms_norm(x, self.norm, self.norm_eps)
        logits = F.linear(h, self.lm_head)
        if record is not None:
            record("model.norm", "final norm", h)
            record("lm_head", "LM head", logits)
        return h, logits

    def _reduced(self, out, mlp_fn):
        """`attn_out_mlp` for a tensor-parallel shard: each projection's share summed across ranks, then the
        residual added (the whole model's arithmetic but for the order of that sum)."""
        reduce = self.reduce

        def a_out(x, attn, wo, w_norm, eps, wgu, wd, inter):
            x = x + reduce(out(attn, wo))
            return x + reduce(mlp_fn(x, w_norm, eps, wgu, wd, inter))

        return a_out


def layer_record(record: Callable, prefix: str) -> Record:
    """``record`` for the points of one layer: paths under ``prefix`` (the layer's own output: the prefix)."""
    return lambda path, what, t: record((prefix + path) if path else prefix[:-1], what, t)


def region_edges(rec: Record, q, k, v, attn, inside: bool) -> None:
    """The points at the edges of a layer's regions, each as ``[n, width]``: the rotated queries and keys and,
    where the regions' insides are not traced (``inside`` False: compiled, fused), the values (the v
    projection) and the attention's output before ``o_proj``."""
    points = [("self_attn.rotary", "queries after rotary", q), ("self_attn.rotary", "keys after rotary", k)]
    if not inside:
        points += [("self_attn.v_proj", "v projection", v),
                   ("self_attn.o_proj", "attention output before o_proj", attn)]
    for path, what, t in points:
        rec(path, what, t[0].transpose(0, 1).reshape(t.shape[2], -1))
