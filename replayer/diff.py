"""`vd diff A B`: compare two goldens of the same recording (made on two machines, builds or versions)
without running a model.

The recordings must match in what was asked (prompt tokens, K list, steps, vocabulary, dtype and feed),
else the question is ill-posed and the answer is a usage error. Within that, B is judged against A exactly
as a replay's candidate is judged against its golden: every row under the policy (A's stored policy
unless ``tolerances`` override it), every row's argmax, and each step's accept count; a recording whose
steps took other tokens (a decision changed while recording) differs too. B's rows are read whole and
checked against its digests. Both goldens' files are checked against their manifests first
(`Golden.check_files`), and A's contents as `vd verify` checks them (`Golden.check_contents`: its step logs, and
each row against its digest, or a slim A's digests and statistics read): a damaged A is refused even where its
rows would not be compared (A may be slim under exact or argmax), and a damaged A whose manifest was made again
to match is refused too (its diff PASSed: found by a user test).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from vd.dtypes import to_tensor
from vd.equivalence import of_golden
from vd.errors import UsageError
from vd.loop import Run
from vd.policy import Policy
from vd.replayer import words
from vd.replayer.judge import compare_run
from vd.replayer.report import DiffK, DiffReport
from vd.store import Golden, open_golden
from vd.store.format import DECODE_K
from vd.store.read import recording_difference


def _as_run(golden: Golden, k: int) -> Run:
    """K of a golden as the run a candidate would have produced (its rows as tensors, bits unchanged)."""
    rows = {kind: to_tensor(a) for kind, a in golden.verify_rows(k).items()}
    log = golden.checked_log(k)
    run = Run(k=k, prefill=rows["prefill"], rows=list(rows["verify"].split(k)), steps=log.steps,
              computed=log.accepted.tolist(), bootstrap=log.bootstrap)
    if "draft" in rows:
        run.bootstrap_row = rows["draft"][:1]
        run.draft_rows = list(rows["draft"][1:].split(k - 1))
    return run


def _same_recording(a: Golden, b: Golden) -> None:
    differ = recording_difference(a, b)
    if differ is not None:
        raise UsageError(f"{a.url} and {b.url} are not recordings of the same thing: {differ}")
    if b.slim:
        raise UsageError(f"{b.url} is slim: vd diff judges B's rows, so B must be a full golden")


def diff(a_path: str | os.PathLike, b_path: str | os.PathLike, *, tolerances: Sequence[str] = ()) -> DiffReport:
    """Judge golden B against golden A; the report's ``verdict`` is PASS or FAIL."""
    a, b = open_golden(a_path), open_golden(b_path)
    try:
        return _diff(a, b, tolerances)
    finally:
        a.close()
        b.close()


def _diff(a: Golden, b: Golden, tolerances: Sequence[str]) -> DiffReport:
    _same_recording(a, b)
    policy = Policy.parse(tolerances, a.meta.get("policy"))
    policy.check_vocab(a.info.vocab)  # a topk:N over every token catches nothing, as a replay refuses it
    if a.slim and policy.needs_rows:
        raise UsageError(f"{a.url} is slim: judging {', '.join(policy.needs_rows)} rows needs its rows")
    a.check_whole()  # A as `vd verify` checks it, its rows against its digests: a damaged golden is no reference,
    b.check_files()  # even where its rows are never compared (only where B's differ); B's rows are, as they are read
    verify, reasons = [], []
    for k in a.groups if b.decoded else a.ks:  # the decode rows too, where both store them
        c = compare_run(b.url, a.side(k), _as_run(b, k), a.logical, policy)
        log_a, log_b = a.checked_log(k), b.checked_log(k)
        changed = [i for i, (x, y) in enumerate(zip(log_a.steps, log_b.steps)) if x != y]
        if changed:
            i = changed[0]
            reasons.append(words.steps_reason(k, changed, log_a.steps[i], log_b.steps[i], len(log_a.steps)))
        if log_b.bootstrap != log_a.bootstrap:
            reasons.append(words.bootstrap_reason(k, log_a.bootstrap, log_b.bootstrap))
        if not c.passed:
            reasons.append(words.diff_rows_reason(k, c))
        if k != DECODE_K and policy.equivalence is not None and b.decoded:  # B's own, as a replay judges its forward's
            own = of_golden(b, k, policy.equivalence)
            if own is not None:
                reasons += words.equivalence_reasons(k, f"B ({b.info.forward})", own, policy)
        verify.append(DiffK(k, c, tuple(changed)))
    return DiffReport(a.url, b.url, policy, a.logical, (a.meta.get("environment"), b.meta.get("environment")),
                      tuple(verify), tuple(reasons), tuple(made_differently(a, b)))


def made_differently(a: Golden, b: Golden) -> list[str]:
    """How the two recordings were made differently, beside what they asked (which must match): the forward, the
    decode rows' forward, a batch, the model's weights, the device, the packages. Said, not judged: the rows say
    whether it mattered."""
    def batch(g: Golden) -> str:
        m = g.meta.get("batch")
        slot = "" if m is None or m["slot"] is None else f"slot {m['slot']}, "
        return "alone" if m is None else f"in a batch of {m['n']} ({slot}seed {m['seed']})"

    env_a, env_b = (g.meta.get("environment") or {} for g in (a, b))
    # (the decode rows' forward said where one golden names it apart from its forward: else "forward" says it)
    decoders = [g.decode_forward or g.info.forward for g in (a, b)]
    named = a.decode_forward is not None or b.decode_forward is not None
    pairs = [("forward", a.info.forward, b.info.forward),
             *([("decode forward", *decoders)] if named else []), ("batch", batch(a), batch(b)),
             ("model fingerprint", a.meta["model"].get("fingerprint"), b.meta["model"].get("fingerprint")),
             ("device", a.info.device, b.info.device),
             *((key, env_a.get(key), env_b.get(key)) for key in ("torch", "transformers", "cuda", "gpu"))]
    return [f"{what}: {x} vs {y}" for what, x, y in pairs if x != y and not (x is None and y is None)]
