"""Record a golden: greedy continuation, then for each K the reference feed (or the drafter feed, with
an MTP head) through the shared loop, then one complete write of the zarr store.

The greedy continuation is computed for both feeds: the reference drafts from it, and for either feed
the golden notes whether each K's committed sequence equals it (it must, unless a verify row's argmax
differs from plain decode's).

A reference that never had both a full and a partial accept at some K is not written (it could not
tell a broken commit or rewind from a working one) unless the caller allows it; the caller learns why.
This module leaves out comparison and verdicts: those are the replayer's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vd import env
from vd.compare import coverage_reason, histogram, thin_reason
from vd.errors import UsageError
from vd.golden import ENCODINGS, GoldenWriter, KRecord, check_target, dtype_name, row_summary, to_storage
from vd.loop import DrafterFeed, ReferenceFeed, continuation, prepare, run_verify
from vd.models import DEFAULT_MODEL, load_model, require_forwards
from vd.policy import parse_policy
from vd.protocol import DraftHead, VerifyModel

# An ordinary instruction for the instruct model. (An earlier two-sentence prompt sent SmolLM2 into a
# continuation its draft head rarely predicted: no full accept at K=4 in 16 steps.)
DEFAULT_PROMPT = "Explain how speculative decoding speeds up a large language model."
DEFAULT_KS = (2, 3, 4)
DEFAULT_STEPS = 16
MAX_K = 16
FEEDS = ("reference", "mtp")


@dataclass(slots=True)
class RecordResult:
    """What a recording did: where it went (None when refused), its accept counts and timings, why its
    reference is too thin (``thin``; stored anyway with ``allow_thin``) and, with ``require_coverage``,
    which K misses an accept count (``short``; never stored)."""

    path: Path | None
    accepted: dict[int, list[int]]
    thin: list[str]
    committed_is_greedy: dict[int, bool]
    seconds: dict[str, float] = field(default_factory=dict)
    short: list[str] = field(default_factory=list)


def check_ks(ks: Sequence[int]) -> list[int]:
    """A usable K list: each 2..MAX_K, no repeats."""
    ks = list(ks)
    if not ks:
        raise UsageError("--k needs at least one verify width")
    bad = [k for k in ks if not 2 <= k <= MAX_K]
    if bad:
        raise UsageError(f"verify width K must be 2..{MAX_K}; got {bad}")
    if len(set(ks)) != len(ks):
        raise UsageError(f"repeated verify width in --k {ks}")
    return ks


def record(
    out: str | Path,
    *,
    model: VerifyModel | None = None,
    model_spec: str = DEFAULT_MODEL,
    prompt: str = DEFAULT_PROMPT,
    ks: Sequence[int] = DEFAULT_KS,
    steps: int = DEFAULT_STEPS,
    forward: str | None = None,
    feed: str = "reference",
    head: str | None = None,
    device: str = "cpu",
    dtype: str = "bfloat16",
    threads: int | None = None,
    refresh: bool = False,
    allow_thin: bool = False,
    deterministic: bool = False,
    tolerances: Sequence[str] = (),
    require_coverage: bool = False,
    compress: bool = False,
    on_step: Callable[[int], None] | None = None,
    on_phase: Callable[[str, int], None] | None = None,
) -> RecordResult:
    """Record ``feed`` (``reference`` or ``mtp``) of ``model`` (or the model ``model_spec`` names, with
    the MTP head file ``head`` attached if given) into ``out``.

    ``on_phase(name, total_steps)`` announces each phase and ``on_step`` ticks within it, for a progress
    bar. A passed-in ``model`` is used as it is (its device and dtype win over the arguments).
    ``deterministic`` applies `vd.env.DETERMINISTIC` (stored in the golden; replay applies it again).
    ``compress`` stores the arrays Blosc-compressed (`vd.golden.codecs`; default: uncompressed).

    Each K's prefill and verify rows go to the writer as they are computed (on CUDA through pinned
    buffers, non-blocking copies and a writer thread: `vd.golden.KStream`, so compression and storage
    overlap the run); the golden appears only when complete and not thin.
    """
    out = Path(out)
    ks = check_ks(ks)
    if feed not in FEEDS:
        raise UsageError(f"unknown feed {feed!r} (choose from {', '.join(FEEDS)})")
    if steps < 1:
        raise UsageError(f"--steps must be at least 1; got {steps}")
    check_target(out, refresh)  # fail before the expensive part (the writer checks again)
    policy = parse_policy(tolerances)
    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads must be at least 1; got {threads}")
        torch.set_num_threads(threads)
    phase = on_phase or (lambda name, total: None)
    seconds: dict[str, float] = {}
    if deterministic:
        env.apply_determinism(env.DETERMINISTIC)

    t = time.perf_counter()
    if model is None:
        phase("loading model", 0)
        model = load_model(model_spec, device=device, dtype=dtype, head=head)
    seconds["load"] = time.perf_counter() - t
    if feed == "mtp" and not isinstance(model, DraftHead):
        raise UsageError(f"model {model_spec} has no MTP draft head: use an -mtp preset, a checkpoint "
                         "with MTP layers, or --head FILE")
    forward = forward or model.default_forward()
    require_forwards(model, [forward])
    model.set_forward(forward)
    tokens = model.encode(prompt)
    if not tokens:
        raise UsageError("the prompt encodes to no tokens")
    prepare(model, len(tokens), steps, ks)

    t = time.perf_counter()
    n = steps * max(ks) + 1
    phase("greedy continuation", 0)
    greedy = continuation(model, tokens, n)
    seconds["continuation"] = time.perf_counter() - t

    # On CUDA the writer works on its own thread while the GPU computes; on the CPU it writes in line,
    # since a writer thread would take the cores the model runs on (see vd.golden._Prefetched).
    with GoldenWriter(out, refresh=refresh, background=model.device.type == "cuda", compress=compress) as writer:
        t = time.perf_counter()
        accepted, thin, short, same = {}, [], [], {}
        for k in ks:
            phase(f"recording K={k}", steps)
            chooser = ReferenceFeed(greedy) if feed == "reference" else DrafterFeed(k, steps)
            stream = writer.stream(k, steps, len(tokens), model.vocab_size, model.dtype)
            run = run_verify(model, tokens, k, steps, chooser, on_step=on_step, sink=stream.put)
            committed = run.committed()
            same[k] = committed == greedy[: len(committed)]
            # Built here, between runs: the writer thread touches no GPU (a CUDA call of its own during a
            # graph captured mid-run, such as a draft head's first propose of a shape, invalidated that
            # capture on the H200: cudaErrorStreamCaptureInvalidated).
            stream.finish(_krecord(run, k, steps, same[k], feed == "mtp"))
            accepted[k] = [s.accepted for s in run.steps]
            reason = thin_reason(k, accepted[k])
            if reason:
                thin.append(reason)
            hist = histogram(k, accepted[k])
            if require_coverage and 0 in hist:
                short.append(coverage_reason(k, hist))
        seconds["verify"] = time.perf_counter() - t
        if short or (thin and not allow_thin):
            return RecordResult(None, accepted, thin, same, seconds, short)
        t = time.perf_counter()
        phase("writing golden", 0)
        meta = _meta(model, model_spec, head, forward, feed, ks, steps, prompt, greedy, thin, deterministic)
        writer.publish({**meta, "policy": policy, "require_coverage": require_coverage}, tokens)
    seconds["write"] = time.perf_counter() - t
    return RecordResult(out, accepted, thin, same, seconds)


def _krecord(run, k: int, steps: int, same: bool, mtp: bool) -> KRecord:
    """A finished run's step log, MTP rows and every row's digest and statistics as a `KRecord` (digests
    and statistics computed on the run's device, read back with the MTP rows); its prefill and verify
    rows were streamed, so those fields are empty."""
    digests, stats = row_summary(run.rows_by_kind())
    extra = {}
    if mtp:
        extra = dict(bootstrap_logits=to_storage(run.bootstrap_row),
                     drafts=np.array(run.drafts, dtype=np.int32).reshape(steps, k - 1),
                     draft_logits=to_storage(torch.stack(run.draft_rows)), decoded=run.committed_before[0])
    return KRecord(
        k=k, bootstrap=run.bootstrap,
        tokens=np.array([s.tokens for s in run.steps], dtype=np.int32),
        accepted=np.array([s.accepted for s in run.steps], dtype=np.int32),
        prefill=np.empty((0, 0), np.uint16),
        logits=np.empty((steps, k, 0), np.uint16),
        step_ms=np.array(run.step_ms, dtype=np.float64),
        committed_is_greedy=same, digests=digests, stats=stats, **extra,
    )


def _meta(model, model_spec, head, forward, feed, ks, steps, prompt, greedy, thin, deterministic) -> dict:
    ident = model.identity()
    logical = dtype_name(model.dtype)
    graphs = getattr(model, "forward_uses_graphs", lambda name: False)(forward)
    return {
        "model": {"spec": model_spec, "head": head, "name": ident.name, "fingerprint": ident.fingerprint,
                  "details": dict(ident.details)},
        "forward": forward,
        "forward_description": model.forwards()[forward],
        "graphs": "graphed" if graphs else "eager",
        "feed": feed,
        "mtp": dict(model.head_info()) if feed == "mtp" else None,
        "dtype": logical,
        "device": model.device.type,
        "k": ks,
        "steps": steps,
        "vocab_size": model.vocab_size,
        "prompt_text": prompt,
        "greedy": greedy,
        "thin": thin,
        "logits": {"dtype": logical, "encoding": ENCODINGS[logical][1]},
        "environment": env.capture(model.device),
        "determinism": {"applied": env.DETERMINISTIC if deterministic else None, "settings": env.determinism()},
    }
