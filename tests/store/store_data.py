"""Small synthetic goldens written straight through the store, without a model."""

from __future__ import annotations

import numpy as np

from vd.layout import RowLayout, StepLog
from vd.store import GoldenWriter
from vd.store import format as F

PROMPT = [1, 2, 3, 4]
V = 8


def k_data(k: int = 2, steps: int = 3, seed: int = 0, drafted: bool = False):
    """K's layout, step log and rows by kind (random bf16 bit patterns, NaNs and infinities included)."""
    layout = RowLayout(len(PROMPT), steps, k, drafted)
    rng = np.random.default_rng(seed)
    accepted = np.array([k - 1, 0, 1, 0][:steps], dtype=np.int32)
    tokens = rng.integers(0, V, (steps, k)).astype(np.int32)
    rows = {kind: rng.integers(0, 2 ** 16, (n, V)).astype(np.uint16) for kind, n in layout.counts.items()}
    _accepting(tokens, accepted, rows["verify"])
    log = StepLog(k=k, bootstrap=5, tokens=tokens, accepted=accepted, step_ms=rng.random(steps),
                  committed_is_greedy=True, decoded=3 if drafted else None)
    return layout, log, rows


def _accepting(tokens: np.ndarray, accepted: np.ndarray, verify: np.ndarray) -> None:
    """Drafts set so that each step accepts its count by its rows' argmaxes (as stored beside their digests), as a
    recording's do (`vd verify` checks it where a step's rows are finite)."""
    import torch

    from vd.digest import STATS, summarise

    k = tokens.shape[1]
    stats = summarise({"verify": torch.from_numpy(verify.view(np.int16)).view(torch.bfloat16)})[1]
    top = np.nan_to_num(stats[:, STATS.index("argmax")]).astype(np.int64) % V
    for s, n in enumerate(accepted.tolist()):
        a = top[s * k:(s + 1) * k]
        for j in range(1, k):
            tokens[s, j] = a[j - 1] if j <= n else (a[j - 1] + 1) % V if j == n + 1 else tokens[s, j]


def meta(ks=(2,), steps: int = 3, feed: str = "reference") -> dict:
    out = {"model": {"spec": "x", "name": "x", "fingerprint": "sha256:0"}, "forward": "eager", "dtype": "bfloat16",
           "device": "cpu", "k": list(ks), "steps": steps, "vocab_size": V, "feed": feed,
           "logits": F.logits_meta("bfloat16")}
    if feed == "mtp":
        out["mtp"] = {"fingerprint": "sha256:1"}
    return out


def write(where, ks=(2,), seed: int = 0, refresh: bool = False, drafted: bool = False) -> dict:
    """A complete golden at ``where``; returns each K's rows by kind."""
    written = {}
    with GoldenWriter(where, refresh=refresh, background=False) as w:
        for k in ks:
            layout, log, rows = k_data(k, seed=seed, drafted=drafted)
            drafts = log.tokens[:, 1:] if drafted else None
            w.add(layout, log, rows, drafts=drafts)
            written[k] = rows
        w.publish(meta(ks, feed="mtp" if drafted else "reference"), PROMPT)
    return written


def write_as_run(writer: GoldenWriter, k: int = 3, steps: int = 3, hand: bool = False) -> dict:
    """A drafter K written through ``writer`` as a recording's run lets its rows go (`KRows.write`): the prefill
    whole, the bootstrap row on its own, then one step at a time, then `KRows.finish`; its rows by kind, as
    bf16 tensors. ``hand``: those parts handed over as a run logs them (`KRows.hand`), then each kind's rows
    written whole, as a run on a GPU leaves them held at its end."""
    import torch

    from vd.digest import summarise

    layout, log, rows = k_data(k, steps=steps, drafted=True)
    tensors = {kind: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for kind, a in rows.items()}
    step = {"prefill": layout.prompt, "verify": k, "draft": k - 1}
    k_rows = writer.rows(layout, V, torch.bfloat16)
    for kind, t in tensors.items():
        first = 1 if kind == "draft" else 0  # the bootstrap row on its own, then whole steps
        put = k_rows.hand if hand else k_rows.write
        if first:
            put(kind, 0, t[:1])
        for a in range(first, t.shape[0], step[kind]):
            put(kind, a, t[a:a + step[kind]])
        if hand:
            k_rows.write(kind, 0, t)
    k_rows.finish(log, summarise(tensors), np.zeros((steps, k - 1), np.int32))
    return tensors
