"""`vd diff A B`: compare two goldens of the same recording (made on two machines, builds or versions)
without running a model.

The recordings must match in what was asked (prompt tokens, K list, steps, vocabulary, dtype and feed),
else the question is ill-posed and the answer is a usage error. Within that, B is judged against A
exactly as a replay's candidate is judged against its golden: every row under the policy (A's stored
policy unless ``--tolerance`` overrides it), every row's argmax, and each step's accept count; a
recording whose steps took other tokens (a decision changed while recording) differs too.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vd.compare import compare_run
from vd.errors import UsageError
from vd.golden import Golden, KRecord, open_golden, to_tensor
from vd.loop import Run, Step
from vd.policy import parse_policy


def _as_run(rec: KRecord) -> Run:
    """A golden's record as the run a candidate would have produced (its rows as tensors, bits unchanged)."""
    run = Run(k=rec.k, prefill=to_tensor(rec.prefill), rows=list(to_tensor(rec.logits)),
              steps=rec.steps, computed=rec.accepted.tolist(), bootstrap=rec.bootstrap)
    if rec.draft_logits is not None:
        run.bootstrap_row = to_tensor(rec.bootstrap_logits)
        run.draft_rows = list(to_tensor(rec.draft_logits))
    return run


def _same_recording(a: Golden, b: Golden) -> None:
    checks = [("prompt tokens", a.prompt, b.prompt)] + [
        (key, a.meta.get(key), b.meta.get(key)) for key in ("k", "steps", "vocab_size", "dtype", "feed")]
    for what, x, y in checks:
        if x != y:
            shown = (f"{len(x)} vs {len(y)} tokens" if what == "prompt tokens" and len(x) != len(y)
                     else "they differ" if what == "prompt tokens" else f"{x} vs {y}")
            raise UsageError(f"{a.path} and {b.path} are not recordings of the same thing: {what} ({shown})")


def diff(a_path: str | Path, b_path: str | Path, *, tolerances: Sequence[str] = ()) -> dict:
    """Judge golden B against golden A; the report's ``verdict`` is PASS or FAIL."""
    a, b = open_golden(a_path), open_golden(b_path)
    _same_recording(a, b)
    logical = a.logical_dtype
    policy = parse_policy(tolerances, a.meta.get("policy"))
    verify, reasons = [], []
    for k, ra in a.runs.items():
        rb = b.runs[k]
        c = compare_run(str(b.path), ra, _as_run(rb), logical, policy=policy)
        steps_a, steps_b = ra.steps, rb.steps
        changed = [i for i, (x, y) in enumerate(zip(steps_a, steps_b)) if x != y]
        if changed:
            i = changed[0]
            reasons.append(f"K={k}: {len(changed)} of {len(steps_a)} steps verified other tokens or accepted "
                           f"another count (first at step {i}: {_step(steps_a[i])} vs {_step(steps_b[i])})")
        if rb.bootstrap != ra.bootstrap:
            reasons.append(f"K={k}: bootstrap token {ra.bootstrap} vs {rb.bootstrap}")
        if not c.passed:
            f = c.first_failure or {}
            reasons.append(f"K={k}: rows differ under {', '.join(f'{x} {y}' for x, y in policy.items())}: "
                           + ", ".join(f"{n} {s['rows_failed']}/{s['rows']} rows fail, {s['argmax_flips']} argmax "
                                       f"flip(s), max |Δ| {s['max_abs']:.4g}" for n, s in c.summary.items())
                           + (f" (first: {f.get('kind')} step {f.get('step')} row {f.get('row')} index "
                              f"{f.get('index')})" if f else ""))
        verify.append({"k": k, "comparison": c.to_json(), "steps_changed": changed})
    return {
        "a": str(a.path), "b": str(b.path), "policy": policy, "dtype": logical,
        "environment": {"a": a.meta.get("environment"), "b": b.meta.get("environment")},
        "verify": verify, "verdict": "FAIL" if reasons else "PASS", "reasons": reasons,
    }


def _step(s: Step) -> str:
    return f"{list(s.tokens)} accepting {s.accepted}"
