"""Train a DeepSeek-style MTP draft head for an HF model by self-distillation, and measure it.

No dataset: the host model greedily continues a fixed list of prompts (208: 48 written out, 160 from
topic templates); the head learns to predict the
host's own next-next tokens from the host's final hidden state (after its norm) and the next token's
embedding, unrolled for three drafts (the later ones fed the head's own output, as at inference).
The host's embedding and output head are shared and frozen; only the head's layer trains. Everything is
seeded, so the same command on the same machine gives the same head. Afterwards the head drafts through
vd's own drafter feed on the default prompt, and its acceptance per K is written with the head.

    python tools/train_head.py --model smollm2 --out vd/heads/smollm2-mtp.safetensors
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path

import checkout  # noqa: F401,E402  (the checkout's vd first on sys.path)
import torch

from vd import env
from vd.coverage import histogram
from vd.loop import DrafterFeed, run_verify
from vd.models import load_model
from vd.models.mtp import attach_head, new_attached_layer, save_head
from vd.models.seeded import seeded_init
from vd.recorder import DEFAULT_PROMPT

PROMPTS = [
    "The history of the printing press begins", "Here is a simple recipe for bread:",
    "Photosynthesis is the process by which", "Write a short story about a lighthouse keeper.",
    "The three laws of thermodynamics state that", "In Python, a list comprehension is",
    "The main causes of the French Revolution were", "Explain how a hash table works.",
    "A good night's sleep matters because", "The solar system consists of",
    "def fibonacci(n):", "Dear hiring manager, I am writing to apply for",
    "The difference between weather and climate is", "How do vaccines train the immune system?",
    "Once upon a time in a small village,", "The rules of chess are simple:",
    "To change a flat tire, first", "Machine learning models learn from data by",
    "The water cycle describes", "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?", "A balanced diet includes", "The internet works by sending packets",
    "Tips for learning a new language:", "The Roman Empire fell because", "What is a prime number?",
    "Gravity is the force that", "An essay on the importance of reading:", "SELECT name FROM users WHERE",
    "The benefits of regular exercise are", "How does a bicycle stay upright?", "List five fruits:",
    "The capital of Japan is Tokyo, which", "Volcanoes form when", "Good software design means",
    "The first step in solving any problem is", "Bees are important to agriculture because",
    "A brief introduction to linear algebra:", "The stock market is", "My favourite season is autumn because",
    "Renewable energy sources include", "To write a good email,", "The human heart has four chambers:",
    "Quantum computers differ from classical ones", "A haiku about the sea:", "Steps to plant a tree:",
    "Electric cars work by", "The moon affects the tides because",
]
EVAL_PROMPTS = [DEFAULT_PROMPT, "Tell me about the history of mathematics.", "How do airplanes fly?"]


TOPICS = [
    "the ocean", "volcanoes", "the printing press", "honey bees", "black holes", "the Roman Empire", "coffee",
    "machine learning", "the human brain", "bridges", "the French Revolution", "electric cars", "chess",
    "climate change", "vaccines", "the internet", "photosynthesis", "jazz music", "the moon", "democracy",
    "recycling", "earthquakes", "the piano", "rainforests", "ancient Egypt", "solar panels", "sleep",
    "the stock market", "dinosaurs", "mountains", "public libraries", "the immune system",
]
TEMPLATES = ["Write a short paragraph about {}.", "Explain {} to a ten-year-old.", "Three facts about {}:",
             "What is the most surprising thing about {}?", "The history of {} begins"]


SEEDS = ["The", "In", "How", "Write", "Why", "A", "My", "Today", "When", "Here is", "Please", "What", "One",
         "If", "Scientists", "def", "Dear", "Once", "Our", "This"]


def training_prompts() -> list[str]:
    return PROMPTS + [t.format(topic) for topic in TOPICS for t in TEMPLATES]


@torch.no_grad()
def sampled_prompts(model, n: int, seed: int, length: int = 16, batch: int = 64) -> list[list[int]]:
    """``n`` prompts the model writes itself: a seed word, then ``length`` tokens sampled (top-k 50)
    with a seeded generator. More varied than any list we could write by hand, and no dataset."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    out = []
    for b in range(0, n, batch):
        starts = [model.encode(SEEDS[(b + i) % len(SEEDS)]) for i in range(min(batch, n - b))]
        width = max(map(len, starts))
        ids = torch.tensor([[0] * (width - len(x)) + x for x in starts], device=model.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in starts], device=model.device)
        for _ in range(length):
            logits = model.model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
            top = logits.topk(50, dim=-1)
            pick = torch.multinomial(top.values.softmax(-1), 1, generator=gen)
            ids = torch.cat([ids, top.indices.gather(1, pick)], dim=1)
            mask = torch.cat([mask, torch.ones_like(pick)], dim=1)
        out += [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return out


@torch.no_grad()  # not inference_mode: these tensors feed autograd later
def make_data(model, prompts, new_tokens, batch=16, soft=32):
    """Each prompt's greedy continuation (generated in left-padded batches), then the host's final
    hidden states, argmax targets and top-``soft`` distributions (none for 0) over the unpadded sequence."""
    data = []
    for b in range(0, len(prompts), batch):
        ids = [model.encode(p) if isinstance(p, str) else p for p in prompts[b : b + batch]]
        width = max(map(len, ids))
        inp = torch.tensor([[0] * (width - len(x)) + x for x in ids], device=model.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=model.device)
        out = model.model.generate(inp, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                   min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        for row, x in zip(out, ids):
            seq = row[width - len(x) :]
            fw = model.model(input_ids=seq[None], output_hidden_states=True)
            top = fw.logits[0].float().log_softmax(-1).topk(max(soft, 1), dim=-1)  # soft targets
            probs = top.values.softmax(-1) if soft else torch.zeros_like(top.values)
            data.append((seq, fw.hidden_states[-1][0].float(), fw.logits[0].argmax(-1), probs, top.indices))
    return data


def unrolled_loss(layer, host, seq, hidden, target, probs, index, depth):
    """Cross-entropy of ``depth`` unrolled drafts over every position of one sequence, against both the
    host's argmax and its top-k distribution (self-distillation).

    Draft d at position i predicts the host's argmax at i + d + 1 (token i + d + 2) from token
    i + d + 1 and, for d = 0, the host's hidden at i, otherwise the head's own previous output."""
    embed, lm_head = host.get_input_embeddings(), host.get_output_embeddings()
    rotary = host.get_decoder().rotary_emb
    loss, h = 0.0, hidden
    for d in range(depth):
        n = seq.shape[0] - d - 2  # positions with a token i+d+1 and a target at i+d+1
        if n < 2:
            break
        ids = seq[d + 1 : d + 1 + n][None]
        pos = torch.arange(d, d + n, device=seq.device)[None]
        emb = embed(ids)
        mask = torch.full((n, n), torch.finfo(emb.dtype).min, device=seq.device).triu(1)[None, None]
        out = layer(emb, h[:n][None], position_embeddings=rotary(emb, position_ids=pos), attention_mask=mask,
                    position_ids=pos, cache=None)[0]
        logits = lm_head(out)
        logp = logits.float().log_softmax(-1)
        sl = slice(d + 1, d + 1 + n)
        hard = torch.nn.functional.nll_loss(logp, target[sl])
        soft = -(probs[sl] * logp.gather(1, index[sl])).sum(-1).mean()
        loss = loss + (0.5**d) * (hard + soft)
        h = out
    return loss


def acceptance(model, ks, steps):
    """Acceptance of the head through vd's drafter feed, per K, over the evaluation prompts."""
    out = {}
    for k in ks:
        accepted = []
        for text in EVAL_PROMPTS:
            run = run_verify(model, model.encode(text), k, steps, DrafterFeed(k, steps))
            accepted += [s.accepted for s in run.steps]
        out[k] = {"mean_accepted": sum(accepted) / len(accepted),
                  "acceptance_rate": sum(accepted) / (len(accepted) * (k - 1)),
                  "histogram": histogram(k, accepted), "steps": len(accepted)}
    return out


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--intermediate", type=int, default=768, help="the head block's MLP width")
    ap.add_argument("--new-tokens", type=int, default=80)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--sampled-prompts", type=int, default=0, help="add this many self-written prompts")
    ap.add_argument("--batch", type=int, default=16, help="generation batch")
    ap.add_argument("--soft-top-k", type=int, default=32, help="distil the host's top-k distribution too "
                    "(0: argmax targets only)")
    ap.add_argument("--train-on-eval-prompts", action="store_true", help="train on the evaluation prompts too "
                    "(for test fixtures: a head on random weights learns little that carries to new prompts)")
    ap.add_argument("--data-dtype", default="float32", help="the dtype the host generates its training data "
                    "in (random-weight hosts continue differently in bf16 and fp32)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--eval-only", action="store_true", help="measure an existing head on --device and add "
                    "the figures to its JSON")
    return ap.parse_args()


def _train(layer, host, data: list, a: argparse.Namespace) -> list[float]:
    """Train ``layer`` on ``data`` for ``a.epochs`` (AdamW, one-cycle schedule, seeded order): each epoch's
    mean loss."""
    opt = torch.optim.AdamW(layer.parameters(), lr=a.lr, weight_decay=0.0)
    total = a.epochs * len(data)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=total, pct_start=0.1)
    gen = torch.Generator().manual_seed(a.seed)
    losses = []
    for epoch in range(a.epochs):
        ep = 0.0
        for i in torch.randperm(len(data), generator=gen).tolist():
            loss = unrolled_loss(layer, host.model, *data[i], a.depth)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
            opt.step()
            sched.step()
            ep += float(loss.detach())
        losses.append(ep / len(data))
        print(f"epoch {epoch}: loss {losses[-1]:.3f}", file=sys.stderr)
    return losses


def main() -> None:
    a = _args()
    if a.eval_only:
        return evaluate_only(a)

    t0 = time.perf_counter()
    torch.manual_seed(a.seed)
    host = load_model(a.model, dtype="float32", device=a.device)
    for p in host.model.parameters():
        p.requires_grad_(False)
    data_host = host if a.data_dtype == "float32" else load_model(a.model, dtype=a.data_dtype, device=a.device)
    prompts = training_prompts() + sampled_prompts(data_host, a.sampled_prompts, a.seed)
    if a.train_on_eval_prompts:
        prompts += EVAL_PROMPTS
    data = [tuple(t.float() if t.is_floating_point() else t for t in d)
            for d in make_data(data_host, prompts, a.new_tokens, a.batch, a.soft_top_k)]
    t_data = time.perf_counter() - t0

    layer, cfg = new_attached_layer(host.model, intermediate_size=a.intermediate)
    seeded_init(layer, a.seed, 0.02)
    layer.train()
    losses = _train(layer, host, data, a)
    t_train = time.perf_counter() - t0 - t_data

    # Measure as vd will run it: bf16 host, the head rounded to bf16 as it is saved.
    a.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"host": a.model, "seed": a.seed, "trained_by": "tools/train_head.py (self-distillation)"}
    save_head(layer, cfg, a.out, meta)
    model = attach_head(load_model(a.model, device=a.device), a.out)
    acc = acceptance(model, (2, 3, 4), 16)
    e = env.capture(torch.device(a.device))
    report = {
        "command": "python " + " ".join(sys.argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {f: e[f] for f in ("cpu_model", "cpu_capability", "cpu_count", "threads", "torch",
                                      "transformers", "device", "gpu_name")},
        "head": str(a.out), "bytes": a.out.stat().st_size,
        "parameters": sum(p.numel() for p in layer.parameters()),
        "data": {"prompts": len(prompts), "new_tokens": a.new_tokens,
                 "positions": sum(int(d[0].shape[0]) for d in data), "soft_top_k": a.soft_top_k,
                 "includes_eval_prompts": a.train_on_eval_prompts},
        "training": {"epochs": a.epochs, "lr": a.lr, "depth": a.depth, "intermediate": a.intermediate,
                     "loss_per_epoch": losses},
        "seconds": {"data": t_data, "train": t_train, "total": time.perf_counter() - t0},
        "acceptance": {"evaluated_on": "vd's drafter feed, bf16 host, eager, 16 steps per prompt",
                       "prompts": EVAL_PROMPTS, "per_k": acc, "device": a.device},
    }
    a.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"acceptance": acc, "seconds": report["seconds"], "bytes": report["bytes"]}, indent=2))


def evaluate_only(a) -> None:
    """Measure a trained head's acceptance on ``a.device`` and record it beside the training figures."""
    model = attach_head(load_model(a.model, device=a.device), a.out)
    t = time.perf_counter()
    acc = acceptance(model, (2, 3, 4), 16)
    report_path = a.out.with_suffix(".json")
    report = json.loads(report_path.read_text())
    report.setdefault("acceptance_elsewhere", {})[a.device] = {
        "command": "python " + " ".join(sys.argv), "per_k": acc, "seconds": time.perf_counter() - t,
        "machine": env.capture(torch.device(a.device))["cpu_model"]}
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(acc, indent=2))


if __name__ == "__main__":
    main()
