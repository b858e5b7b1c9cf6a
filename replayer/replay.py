"""Replay a golden against a model and judge it: PASS or FAIL, with reasons and a JSON-ready report.

For each K and each forward asked for, the shared loop runs the replay feed (the stored tokens, accept
counts and bootstrap token, so every run verifies the same inputs and commits the same prefixes) and
every row is judged against the golden under the policy (`vd.policy`: byte for byte unless the golden
or ``tolerances`` say otherwise), with every decision checked (`vd.compare`). A golden of the drafter
feed replays with the model's MTP head still running, so its drafts and draft logits are judged too.
Then, under the last forward, the detection control changes the last draft of step ``steps // 2`` and
must fail there under the same policy; a reference without both a full and a partial accept at every K
fails as too thin (and, if asked, one missing an accept count). The report keeps the seed's fields
(graphs, mtp, steps, variants, verify[k, accepted, comparisons, timings, detection_control], verdict,
reasons) and adds policy, sensitivity, coverage and the environments. This module leaves out
rendering: the CLI prints what it returns, and `replayer.reports` writes bundles, JUnit and HTML.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from vd import env
from vd.compare import Queued, compare_run, coverage_reason, histogram, thin_reason
from vd.errors import ModelMismatchError, UsageError
from vd.gold import Gold, step_rows
from vd.golden import Golden, open_golden, to_storage
from vd.loop import DrafterFeed, ReplayFeed, Step, prepare, run_verify
from vd.models import check_device, load_model, require_forwards
from vd.models.static import CUDA_ONLY
from vd.policy import describe, parse_policy, sensitivity
from vd.protocol import DraftHead, VerifyModel


def control_steps(steps: Sequence[Step], vocab: int) -> list[Step]:
    """The detection control's input: the last draft of step ``len(steps) // 2`` bumped by one."""
    changed = list(steps)
    at = len(steps) // 2
    tokens = list(changed[at].tokens)
    tokens[-1] = (tokens[-1] + 1) % vocab
    changed[at] = Step(tuple(tokens), changed[at].accepted)
    return changed


def _timing(variant: str, step_ms: Sequence[float]) -> dict:
    return {
        "variant": variant,
        "steps": len(step_ms),
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "step_ms_max": max(step_ms) if step_ms else None,
        "total_ms": sum(step_ms),
    }


def _open_model(golden: Golden, spec: str | None, head: str | None, device: str | None,
                forwards: Sequence[str]) -> VerifyModel:
    meta = golden.meta
    dev = device or meta["device"]
    if dev.startswith("cuda") and not torch.cuda.is_available():
        also = (f", with --forward naming a CPU forward (it was recorded with {meta['forward']!r}, which runs on "
                f"CUDA only; `vd forwards` lists them)" if not forwards and meta["forward"] in CUDA_ONLY else "")
        raise UsageError(
            f"{golden.path} was recorded on {dev} and this machine has no CUDA device; "
            f"pass --device cpu to replay it on the CPU{also}"
        )
    if head is None and spec is None:
        head = meta["model"].get("head")  # another SPEC brings its own head, if any
    dev = check_device(dev)
    golden.prefetch(dev, background=True)  # on CUDA the golden's rows are read while the weights load
    return load_model(spec or meta["model"]["spec"], device=dev, dtype=meta["dtype"], head=head)


def _check_model(golden: Golden, model: VerifyModel, allow_mismatch: bool) -> list[str]:
    """Refuse a model that cannot be compared; a different fingerprint only with ``allow_mismatch``."""
    meta = golden.meta
    if model.vocab_size != meta["vocab_size"]:
        raise ModelMismatchError(
            f"model has vocab {model.vocab_size}, golden {golden.path} has {meta['vocab_size']}"
        )
    pairs = [("model", model.identity().fingerprint, meta["model"]["fingerprint"])]
    if meta.get("feed") == "mtp":
        if not isinstance(model, DraftHead):
            raise ModelMismatchError(f"{golden.path} was recorded with an MTP draft head and this model has none")
        pairs.append(("MTP head", model.head_info()["fingerprint"], meta["mtp"]["fingerprint"]))
    notes = []
    for what, got, want in pairs:
        if got == want:
            continue
        if not allow_mismatch:
            raise ModelMismatchError(
                f"{what} fingerprint {got[:19]}… differs from golden's {want[:19]}… "
                "(pass --allow-model-mismatch to compare anyway)"
            )
        notes.append(f"{what} fingerprint differs from the golden's ({got} vs {want}); allowed by the user")
    return notes


def replay(
    golden_path: str | Path,
    *,
    model: VerifyModel | None = None,
    model_spec: str | None = None,
    head: str | None = None,
    forwards: Sequence[str] = (),
    ks: Sequence[int] = (),
    device: str | None = None,
    threads: int | None = None,
    allow_model_mismatch: bool = False,
    control: bool = True,
    tolerances: Sequence[str] = (),
    require_coverage: bool = False,
    on_phase: Callable[[str, int], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> dict:
    """Replay ``golden_path`` and return the report (``report["verdict"]`` is PASS or FAIL).

    ``ks`` limits the replay to some of the golden's verify widths (default: all of them).
    ``tolerances`` (``[KIND=]SPEC`` items, `vd.policy`) override the golden's comparison policy;
    ``require_coverage`` fails a golden whose steps miss any accept count 0..K-1 at some K.
    The first failing step's rows are kept in ``report["_first_failure_rows"]`` for a bundle.
    Bad input (a missing or corrupt golden, an unknown model or forward, a fingerprint mismatch) raises
    a `vd.errors.VdError` before any comparison.
    """
    phase = on_phase or (lambda name, total: None)
    # Where a replay's own time goes (seconds), beside the model's: the report's "phases".
    clock = dict.fromkeys(("open", "setup", "prepare", "run", "wait_golden", "compare", "control", "finish"), 0.0)
    t = time.perf_counter()
    # Metadata and prompt now; each K's arrays when needed (on CUDA, ahead of time on a thread).
    golden = open_golden(golden_path, lazy=True)
    clock["open"] = time.perf_counter() - t
    t, loading = time.perf_counter(), 0.0
    meta = golden.meta
    recorded_env = meta.get("environment", {})
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be at least 1; got {threads}")
    ks = list(ks) or list(golden.runs)
    absent = [k for k in ks if k not in golden.runs]
    if absent:
        raise UsageError(f"{golden.path} has no verify width {absent}; it holds K = {list(golden.runs)}")
    policy = parse_policy(tolerances, meta.get("policy"))
    determinism = (meta.get("determinism") or {}).get("applied")
    env.apply_determinism(determinism)  # what the recording applied, before the model is loaded
    # CPU kernels can split work by thread count: replay with the recording's unless told otherwise.
    torch.set_num_threads(threads or recorded_env.get("threads") or torch.get_num_threads())
    if model is None:
        phase("loading model", 0)
        t_load = time.perf_counter()
        model = _open_model(golden, model_spec, head, device, forwards)
        loading = time.perf_counter() - t_load
    golden.prefetch(model.device)  # on CUDA: read and copied there in the GPU's idle time (`vd.reader`)
    notes = _check_model(golden, model, allow_model_mismatch)
    offered = model.forwards()
    if not forwards and meta["forward"] not in offered:  # e.g. a CUDA golden replayed on a CPU
        raise UsageError(f"the golden was recorded with forward {meta['forward']!r}, which this model on "
                         f"{model.device.type} does not offer; choose one with --forward ({', '.join(offered)})")
    forwards = list(forwards) or [meta["forward"]]
    require_forwards(model, forwards)

    logical, vocab, steps = golden.logical_dtype, model.vocab_size, meta["steps"]
    mtp = meta.get("feed") == "mtp"

    def feed(k: int, log: list[Step], bootstrap: int):
        forced = ReplayFeed(log, bootstrap, golden.log(k).decoded)
        return DrafterFeed(k, steps, forced) if mtp else forced

    cuda = model.device.type == "cuda"

    def queue(k: int, into: list) -> Callable | None:
        """On CUDA: while the GPU runs a run's last step, its comparison's GPU work queued behind it."""
        return (lambda run, rows: into.append(Queued(golden.gold(k), run, rows))) if cuda else None

    verify, reasons, differs, kept = [], [], False, None
    t_start = time.perf_counter()
    clock["setup"] = t_start - t - loading  # checks, the model's and the golden's, outside loading the model
    for k in ks:
        rec = golden.log(k)  # the step log (the metadata's copy); the golden's arrays are read beside the run
        log, comparisons, timings = rec.steps, [], [_timing(f"{meta['forward']} (golden)", rec.step_ms.tolist())]
        c_reasons: list[list[str]] = []  # each comparison's own reasons, in order
        for name in forwards:
            phase(f"K={k} {name}", steps)
            t = time.perf_counter()
            model.set_forward(name)
            golden.pause()  # no reader work beside a graph capture
            prepare(model, len(golden.prompt), steps, golden.runs.keys())
            t1 = time.perf_counter()
            queued: list[Queued] = []
            run = run_verify(model, golden.prompt, k, steps, feed(k, log, rec.bootstrap), on_step=on_step,
                             idle=golden.idle, on_last=queue(k, queued))
            t2 = time.perf_counter()
            # The golden's side (made in the run's idle time on CUDA): its digests, or its rows.
            gold = golden.gold(k)
            t3 = time.perf_counter()
            c = compare_run(name, gold, run, logical, policy, *queued)
            t4 = time.perf_counter()
            for key, dt in (("prepare", t1 - t), ("run", t2 - t1), ("wait_golden", t3 - t2), ("compare", t4 - t3)):
                clock[key] += dt
            comparisons.append(c)
            differs |= not c.passed  # a failure; bits that differ within the policy are not one
            timings.append(_timing(name, run.step_ms))
            c_reasons.append(_reasons(k, name, c))
            reasons.extend(c_reasons[-1])
            if not c.passed and kept is None:
                kept = _failure_rows(k, name, c, gold, run)
        hist = histogram(k, rec.accepted.tolist())
        entry = {
            "k": k,
            "accepted": rec.accepted.tolist(),
            "accept_histogram": hist,
            # How many steps accepted 0, 1, .., K-1 drafts: the golden's coverage of the accept path.
            "coverage": {"accepted_counts": hist, "missing": [i for i, n in enumerate(hist) if n == 0]},
            "comparisons": [{**c.to_json(), "reasons": why} for c, why in zip(comparisons, c_reasons)],
            "timings": timings,
            "detection_control": None,
        }
        if control:
            t = time.perf_counter()
            phase(f"K={k} control", steps)  # runs under the last forward, still selected
            queued = []
            run = run_verify(model, golden.prompt, k, steps, feed(k, control_steps(log, vocab), rec.bootstrap),
                             on_step=on_step, idle=golden.idle, on_last=queue(k, queued))
            dc = compare_run(f"{forwards[-1]}, one draft changed", golden.gold(k), run, logical, policy, *queued)
            at = steps // 2
            # It must fail at the very step whose draft changed, under the active policy (or by a changed
            # decision), whatever else differs: a policy too loose to see a changed input is blind.
            fired = at in dc.failed_step_list
            entry["detection_control"] = {**dc.to_json(), "changed_step": at, "fired": fired}
            if not fired:
                reasons.append(f"verify K={k}: the detection control saw no difference at step {at} "
                               f"after changing its last draft (policy: {describe(policy)})")
            clock["control"] += time.perf_counter() - t
        thin = thin_reason(k, rec.accepted.tolist())
        if thin:
            reasons.append(thin)
        if require_coverage and entry["coverage"]["missing"]:
            reasons.append(coverage_reason(k, hist))
        verify.append(entry)

    t = time.perf_counter()
    replayed_env = env.capture(model.device)
    uses_graphs = getattr(model, "forward_uses_graphs", lambda name: False)
    graphed = [uses_graphs(n) for n in forwards]
    env_diff = env.numerics_differences(recorded_env, replayed_env)
    if differs and env_diff:
        reasons.append("the replaying environment differs from the recording's in "
                       + "; ".join(env_diff) + " — bitwise differences may come from that")
    return {
        "golden": str(golden.path),
        "model": {"spec": meta["model"]["spec"], "name": meta["model"]["name"],
                  "fingerprint": meta["model"]["fingerprint"], "replayed_with": model.identity().name},
        # As the seed's field: "graphed" when the verify steps ran as CUDA graphs, "eager" when they ran
        # kernel by kernel; "mixed" when the replayed forwards differ (each variant says which).
        "graphs": "graphed" if all(graphed) else "eager" if not any(graphed) else "mixed",
        "mtp": mtp,
        "head": meta.get("mtp"),
        # Measured (tests/test_mtp.py): a process's first propose equals every later one here, so unlike
        # the seed's engine no discarded warm-up run precedes the recording or the replay.
        "warmup": False,
        "feed": meta.get("feed", "reference"),
        "steps": steps,
        "dtype": logical,
        "variants": [{"name": n, "description": offered[n], "golden": n == meta["forward"],
                      "graphs": "graphed" if g else "eager"} for n, g in zip(forwards, graphed)],
        "determinism": {"recorded": meta.get("determinism"), "applied": determinism,
                        "replayed": env.determinism()},
        "golden_forward": meta["forward"],
        "policy": policy,
        "sensitivity": _sensitivity(policy, logical, verify),
        "require_coverage": require_coverage,
        "verify": verify,
        "verdict": "FAIL" if reasons else "PASS",
        "reasons": reasons,
        "notes": notes,
        "environment": {"recorded": recorded_env, "replayed": replayed_env, "numerics_differences": env_diff},
        "seconds": time.perf_counter() - t_start,
        "phases": {**clock, "finish": time.perf_counter() - t},
        "reader": _reader_summary(golden),
        "_first_failure_rows": kept,
    }


def _reader_summary(golden: Golden) -> dict | None:
    """Where the golden's reading went (`vd.reader`): units (of them chunk reads) and seconds on the
    thread while the model loaded, before the runs (buffers left to allocate), in the GPU's idle time
    during runs, and left for when the rows were needed."""
    reader = getattr(golden.runs, "reader", None)
    if reader is None:
        return None
    out = {w: {"units": 0, "reads": 0, "seconds": 0.0} for w in ("thread", "prefetch", "idle", "drain")}
    for who, kind, sec in reader.timeline:
        out[who]["units"] += 1
        out[who]["reads"] += kind.startswith("read")
        out[who]["seconds"] += sec
    return out


def _reasons(k: int, name: str, c) -> list[str]:
    """One line per kind of row that fails (its policy, or a changed decision)."""
    out, pol, sm = [], c.policy, c.summary
    flips = {kind: [f for f in c.flips if f.kind == kind] for kind in ("prefill", "verify", "draft")}

    def flip_text(kind: str) -> str:
        fl = flips[kind]
        if not fl:
            return ""
        f = fl[0]
        where = "bootstrap row" if kind == "draft" and f.step is None else (
            "prefill" if f.step is None else f"step {f.step}") + f" row {f.row}"
        return (f"; {len(fl)} argmax flip(s), first at {where}: {f.golden_argmax} → {f.got_argmax}, golden "
                f"top-1/top-2 margin {f.margin:.4g} ({f.margin_ulps:.1f} ULP{', a near-tie' if f.near_tie else ''})")

    ver_bad = sm["verify"]["rows_failed"] or sm["prefill"]["rows_failed"] or flips["verify"] or flips["prefill"]
    if ver_bad or c.accept_changes:
        if pol["prefill"] == pol["verify"] == "exact":
            head = (f"verify K={k}, {name}: prefill equal {c.prefill_equal}, {c.mismatched_steps} of {c.steps} "
                    f"steps differ (first at {_where(c.first_mismatch or c.prefill_first_mismatch)})")
        else:
            v, p = sm["verify"], sm["prefill"]
            head = (f"verify K={k}, {name}: {v['rows_failed']} of {v['rows']} verify rows fail {pol['verify']}, "
                    f"{p['rows_failed']} of {p['rows']} prefill rows fail {pol['prefill']} (largest |Δ| "
                    f"{max(v['max_abs'], p['max_abs']):.4g}, {max(v['max_ulp'], p['max_ulp']):.0f} ULP, KL "
                    f"{max(v['max_kl'], p['max_kl']):.3g}; first failure {_failure(c.first_failure)})")
        acc = ""
        if c.accept_changes:
            a = c.accept_changes[0]
            acc = (f"; {len(c.accept_changes)} step(s) would accept a different number of drafts (first: step "
                   f"{a['step']}, {a['golden']} → {a['got']})")
        out.append(head + flip_text("prefill") + flip_text("verify") + acc)
    if "draft" in sm and (sm["draft"]["rows_failed"] or flips["draft"]):
        if pol["draft"] == "exact":
            head = (f"draft head K={k}, {name}: bootstrap row equal {c.bootstrap_equal}, "
                    f"{c.draft_mismatched_steps} of {c.steps} steps' draft rows differ "
                    f"(first at {_where(c.draft_first_mismatch)})")
        else:
            d = sm["draft"]
            head = (f"draft head K={k}, {name}: {d['rows_failed']} of {d['rows']} draft rows fail {pol['draft']} "
                    f"(largest |Δ| {d['max_abs']:.4g}, {d['max_ulp']:.0f} ULP, KL {d['max_kl']:.3g})")
        out.append(head + flip_text("draft"))
    return out


def _failure(f: dict | None) -> str:
    if f is None:
        return "-"
    if f["step"] is None:
        where = f"prefill row {f['row']}" if f["kind"] == "prefill" else "draft bootstrap row"
    else:
        where = f"{f['kind']} step {f['step']} row {f['row']}"
    return f"{where} index {f['index']}: golden {f['golden']!r}, got {f['got']!r}"


def _failure_rows(k: int, name: str, c, gold: Gold, run) -> dict | None:
    """The golden's and the candidate's rows of the first failing step (for a first-divergence bundle)."""
    f = c.first_failure
    if f is None:  # a changed accept count alone: keep its step's verify rows
        if not c.accept_changes:
            return None
        f = {"kind": "verify", "step": c.accept_changes[0]["step"]}
    kind, step = f["kind"], f["step"]
    idx = step_rows(kind, step, k, gold.counts)
    return {"k": k, "forward": name, "kind": kind, "step": step, "golden": gold.host_rows(kind, idx),
            "candidate": to_storage(run.rows_by_kind()[kind][torch.from_numpy(idx).to(run.prefill.device)]),
            "tokens": gold.tokens[step].tolist() if step is not None else None, "first_failure": f}


def _sensitivity(policy: dict, logical: str, verify: list[dict]) -> dict:
    """Per kind: the smallest change the active policy is guaranteed to catch, from the golden's rows."""
    out = {}
    for kind in ("prefill", "verify", "draft"):
        stats = [c["summary"][kind] for v in verify for c in v["comparisons"] if kind in c["summary"]]
        if not stats:
            continue
        agg = {"max_abs": max(s["golden_max_abs"] for s in stats),
               "min_margin": min(s["golden_min_margin"] for s in stats),
               "median_top1_p": statistics.median(s["golden_median_top1_p"] for s in stats)}
        out[kind] = {"policy": policy[kind], "catches": sensitivity(policy[kind], logical, agg), **agg}
    return out


def _where(m) -> str:
    if m is None:
        return "-"
    step = "prefill" if m.step is None else f"step {m.step}"
    return f"{step} row {m.row} index {m.index}: golden {m.golden!r}, got {m.got!r}"
