"""MTP draft heads for HF models: a DeepSeek-style multi-token-prediction layer driven as a proposer.

Both kinds of head vd supports are HF's own `MtpLayer` (enorm and hnorm, ``eh_proj`` over the
concatenated [embedding, hidden], one decoder block of the host's kind, a post norm, and the host's
shared embedding and output head):

* **native**: the MTP layer of a model whose config carries ``num_mtp_layers`` (DeepSeek-V3, GLM-4.5
  style), built by HF's `MtpModel` from the main model (from the checkpoint when there is one);
* **attached**: a layer of the host's decoder kind loaded from a safetensors file (`save_head` writes
  one; ``tools/train_head.py`` trains one by self-distillation), attachable to any HF decoder.

`HFMtpModel` adds the `vd.protocol.DraftHead` capability to the HF adapter. How it drives the head
(recorded in every MTP golden as ``head_info()``):

* the hidden state fed to the head is the host's ``last_hidden_state``, **after** its final norm (as HF's
  own MTP generation does); later drafts feed back the head's post-norm output;
* a head entry sits at the position of the hidden state it was computed from (vLLM's convention);
* after each verify the accepted rows are saved, the previous proposal's speculative entries (``n - 1``
  of them) are trimmed from the head's cache, and the saved rows are re-run through the head with the
  target's hidden states before it proposes (SGLang's draft-extend), so the head's cache never holds a
  rejected or head-computed entry for a committed position.

Multi-layer MTP (``num_mtp_layers > 1``) is left out: vd drives layer 0 for every draft.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vd.errors import ModelSpecError
from vd.models.checkpoints import quiet_transformers
from vd.models.fingerprint import fingerprint
from vd.models.hf import HFModel
from vd.models.seeded import seeded_init
from vd.models.static import STATIC_FORWARDS, StaticHead

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

HEAD_FORMAT = "vd-mtp-head/1"


def _layer_classes(host: PreTrainedModel) -> tuple[type, type]:
    decoder = host.get_decoder()
    return type(decoder.layers[-1]), type(decoder.norm)


def new_attached_layer(host: PreTrainedModel, *, intermediate_size: int | None = None
                       ) -> tuple[torch.nn.Module, PreTrainedConfig]:
    """A fresh (untrained) DeepSeek-style MTP layer of ``host``'s decoder kind, and its config."""
    from transformers.modeling_layers import MtpLayer

    cfg = copy.deepcopy(host.config)
    if intermediate_size:
        cfg.intermediate_size = intermediate_size
    layer_cls, norm_cls = _layer_classes(host)
    layer = MtpLayer(cfg, layer_cls, norm_cls, 0, use_post_norm=True)
    return layer.to(device=next(host.parameters()).device, dtype=next(host.parameters()).dtype), cfg


def save_head(layer: torch.nn.Module, cfg: Any, path: Path, extra: Mapping[str, Any] | None = None) -> None:
    """Write an attachable head: its tensors (bf16) and what it needs to be rebuilt, as safetensors."""
    from safetensors.torch import save_file

    meta = {"format": HEAD_FORMAT, "architecture": cfg.architectures[0] if cfg.architectures else "",
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, **(extra or {})}
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in layer.state_dict().items()}
    save_file(tensors, str(path), metadata={"vd": json.dumps(meta)})


def load_attached_layer(host: PreTrainedModel, path: Path) -> tuple[torch.nn.Module, PreTrainedConfig, dict]:
    """The head a `save_head` file holds, attached to ``host`` (shapes must fit the host)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("vd", "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError for a file that is not one
        raise ModelSpecError(f"cannot read MTP head {path}: {str(e).splitlines()[0]}") from e
    if meta.get("format") != HEAD_FORMAT:
        raise ModelSpecError(f"{path} is not a vd MTP head (format {meta.get('format')!r})")
    if meta.get("hidden_size") != host.config.hidden_size:
        raise ModelSpecError(f"MTP head {path} has hidden size {meta.get('hidden_size')}, "
                             f"the model {host.config.hidden_size}")
    layer, cfg = new_attached_layer(host, intermediate_size=meta.get("intermediate_size"))
    try:
        layer.load_state_dict({k: v.to(next(layer.parameters()).dtype) for k, v in tensors.items()})
    except RuntimeError as e:
        raise ModelSpecError(f"MTP head {path} does not fit this model: {str(e).splitlines()[0]}") from e
    return layer, cfg, meta


def native_layer(host: PreTrainedModel, *, seed: int | None) -> tuple[torch.nn.Module, PreTrainedConfig]:
    """Layer 0 of HF's native `MtpModel` for ``host``: from its checkpoint, or seeded random weights."""
    from transformers.modeling_layers import MtpModel

    n = host.config.get_text_config().num_mtp_layers
    if seed is None:
        with quiet_transformers():
            mtp = MtpModel.from_pretrained(host)
    else:
        mtp = MtpModel(host, n)
        seeded_init(mtp.layers, seed, host.config.initializer_range)
    # transformers wraps PreTrainedModel.to in functools.wraps, which mypy reads as an unbound function.
    mtp = mtp.to(device=next(host.parameters()).device,  # type: ignore[call-arg]
                 dtype=next(host.parameters()).dtype).eval()
    return mtp.layers[0], mtp.config


class HFMtpModel(HFModel):
    """The HF adapter with an MTP draft head: a `VerifyModel` that is also a `DraftHead`.

    Under a static forward the head runs as a `vd.models.static.StaticHead` in the same mode (graphed,
    compiled, ...) over its own static cache; its "trim" is then implicit: entries sit at their
    positions, so the next draft-extend overwrites the speculative ones and the mask hides the rest.
    """

    _wants_hidden = True

    def __init__(self, model, *, layer, head_config, head_name: str, head_source: str, **kw):
        self._layer = layer.eval()
        self._head_config = head_config
        self._head_name, self._head_source = head_name, head_source
        self._head_identity: str | None = None
        self._heads: dict[str, StaticHead] = {}
        super().__init__(model, **kw)
        self._embed = self.model.get_input_embeddings()
        self._lm_head = self.model.get_output_embeddings()
        self._rotary = getattr(self.model.get_decoder(), "rotary_emb", None)

    @property
    def head_layer(self) -> torch.nn.Module:
        """The MTP layer the head runs: to check which weights a head was loaded with."""
        return self._layer

    # -- VerifyModel, extended to keep what the head needs -----------------------------------------

    def set_forward(self, name: str) -> None:
        super().set_forward(name)
        # The head's block follows the host's forward (its pinned backend too: see `_step`).
        self._head_config._attn_implementation = self.model.config._attn_implementation
        if name in STATIC_FORWARDS and name not in self._heads:
            self._heads[name] = StaticHead(self._layer, self._embed, self._lm_head, self._rotary, name,
                                           self.device, self.attention_context)

    def prepare(self, capacity: int, lengths: Sequence[int] = ()) -> None:
        super().prepare(capacity, lengths)
        if self._runner is not None:
            self._static_head().prepare(capacity)

    def _static_head(self) -> StaticHead:
        """The selected static forward's head."""
        assert self._forward is not None and self._runner is not None, "a static forward is selected"
        return self._heads[self._forward]

    def reset(self) -> None:
        from transformers import DynamicCache

        super().reset()
        self._head_cache = DynamicCache()
        self._pending: list[tuple[torch.Tensor, int, int | None]] = []  # (hidden [H], position, next token)
        self._speculative = 0
        self._last_hidden: torch.Tensor | None = None  # the last forward's [n, H], after the final norm
        self._last_tokens: list[int] = []
        self._last_start = 0

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int]) -> torch.Tensor:
        start = self.length()
        logits, hidden = self._run(tokens, hidden=True)
        if self._pending and self._pending[-1][2] is None:  # the saved row's next token arrived
            h, p, _ = self._pending[-1]
            self._pending[-1] = (h, p, int(tokens[0]))
        self._last_hidden = hidden  # [n, H], after the final norm
        self._last_tokens, self._last_start = list(tokens), start
        return logits  # [n, V]

    # -- DraftHead ---------------------------------------------------------------------------------

    def head_info(self) -> dict:
        if self._head_identity is None:
            self._head_identity = fingerprint(self._layer, self._head_config)
        return {
            "name": self._head_name,
            "source": self._head_source,
            "fingerprint": self._head_identity,
            "block": type(self._layer.mtp_block).__name__,
            "hidden": "post_norm: the host's last_hidden_state, after its final norm; later drafts feed "
                      "back the head's post-norm output",
            "trim": "every step: the previous proposal's n-1 speculative head-cache entries are cropped, "
                    "then the accepted rows are re-run through the head with the target's hidden states",
            "positions": "a head entry sits at the position of the hidden state it was computed from",
        }

    def save_hidden(self, row: int) -> None:
        """Rows ``0 .. row`` of the last forward are committed: queue their hidden states for the head."""
        h, start, toks = self._last_hidden, self._last_start, self._last_tokens
        assert h is not None, "save_hidden follows a forward"
        for j in range(row + 1):
            self._pending.append((h[j], start + j, toks[j + 1] if j < row else None))

    def trim_proposer(self) -> None:
        """Drop the last proposal's speculative entries from the head's cache."""
        if self._speculative:
            self._head_cache.crop(-self._speculative)
        self._speculative = 0

    def _step(self, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One head pass over ``q`` entries: ids ``[1, q]``, hidden ``[1, q, H]``, positions ``[1, q]``."""
        emb = self._embed(ids)  # [1, q, H]
        q, past = ids.shape[1], self._head_cache.get_seq_length()
        mask = None
        if q > 1:  # causal over the new entries, everything cached stays visible
            mask = torch.full((q, past + q), torch.finfo(emb.dtype).min, dtype=emb.dtype, device=emb.device)
            mask = mask.triu(past + 1)[None, None]  # [1, 1, q, past + q]
        pe = self._rotary(emb, position_ids=pos) if self._rotary is not None else None
        with self.attention_context():
            return self._layer(emb, hidden, position_embeddings=pe, attention_mask=mask, position_ids=pos,
                               cache=self._head_cache)

    @torch.inference_mode()
    def propose(self, last: int, n: int) -> tuple[list[int], torch.Tensor]:
        """``n`` drafts after ``last``, autoregressively, and their ``[n, V]`` logits rows."""
        assert self._pending, "propose needs a saved hidden state"
        h, p, _ = self._pending[-1]
        self._pending[-1] = (h, p, int(last))
        if self._runner is not None:  # a static forward: the head's static counterpart
            pending, self._pending = self._pending, []
            hid = torch.stack([e[0] for e in pending])  # [q, H]
            return self._static_head().propose(_next_tokens(pending), hid, pending[0][1], n)
        assert self._head_cache.get_seq_length() == self._pending[0][1], "head cache out of step"
        hid = torch.stack([e[0] for e in self._pending])[None]  # [1, q, H]
        ids = torch.tensor([_next_tokens(self._pending)], device=self.device)
        pos = torch.tensor([[e[1] for e in self._pending]], device=self.device)
        self._pending = []
        out = self._step(ids, hid, pos)[:, -1:]  # [1, 1, H]
        pos = pos[:, -1:]
        drafts, rows = [], []
        for j in range(n):
            logits = self._lm_head(out)[0, -1]  # [V]
            drafts.append(int(logits.argmax()))
            rows.append(logits)
            if j + 1 < n:
                pos = pos + 1
                out = self._step(torch.tensor([[drafts[-1]]], device=self.device), out, pos)
        self._speculative = n - 1
        return drafts, torch.stack(rows)


def _next_tokens(pending: list[tuple[torch.Tensor, int, int | None]]) -> list[int]:
    """The token after each pending entry: all known once `HFMtpModel.propose` has set the last one's."""
    out = []
    for _, _, token in pending:
        assert token is not None, "a pending entry without its next token"
        out.append(token)
    return out


def attach_head(base: HFModel, path: Path | None = None, *, layer=None, head_config=None,
                head_name: str | None = None, head_source: str = "attached") -> HFMtpModel:
    """``base`` with an MTP head: the one a `save_head` file at ``path`` holds, or ``layer`` as given."""
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ModelSpecError(f"MTP head {path} does not exist")
        layer, head_config, _ = load_attached_layer(base.model, path)
        head_name = head_name or path.name
    return HFMtpModel(base.model, layer=layer, head_config=head_config, head_name=head_name or "MTP head",
                      head_source=head_source, name=base._name, encode=base._encode, details=base._details,
                       fingerprinter=base._fingerprinter)
