"""A replay's candidate kept as a golden (``vd replay --save-candidate PATH``), as pytest-regressions keeps
the obtained file beside the expected one: the rows the replayed forward computed, through the golden's
own steps (its tokens, accept counts and bootstrap), stored in the golden format with what computed them.

`vd diff GOLDEN CANDIDATE` reviews it; `vd refresh --from CANDIDATE` promotes it (`vd.workflow.refresh`),
so accepting an intended change needs no second recording. The candidate records the golden version it
was replayed against (``candidate.of_content``, the golden's content digest) and whether each K's
detection control fired, which a promotion checks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager

import numpy as np

from vd import env, protocol
from vd.dtypes import to_storage
from vd.errors import UsageError
from vd.layout import StepLog
from vd.loop import Run
from vd.models.inductor import keep_artifacts
from vd.preflight import golden_meta
from vd.protocol import VerifyModel
from vd.store import Golden, GoldenWriter, check_target, locate
from vd.store import format as F

# The golden's metadata a candidate does not inherit: the writer makes it anew, or it names the recording
# (compiled: this process's own artifacts; trace: a replay traces no module, so a candidate holds no traces).
_NOT_INHERITED = (*F.WRITTEN, "history", "candidate", "compiled", "trace")


class CandidateWriter:
    """Keeps one forward's runs of a replay (`keep`, one per K) and publishes them as a golden (`publish`)."""

    def __init__(self, where: str | os.PathLike, golden: Golden):
        location = locate(where)
        if location.url == golden.url:
            raise UsageError(f"--save-candidate {location.url} is the golden being replayed; name another path")
        # a golden there (on S3 too; a local one is the CLI's to refuse) must be an earlier candidate
        if location.state() == "golden" and "candidate" not in golden_meta(location.get("zarr.json") or b"",
                                                                          location.url):
            raise UsageError(f"--save-candidate {location.url} is a golden, not an earlier candidate; refusing to "
                             "replace it (write it elsewhere)")
        check_target(location, refresh=True)  # an earlier candidate is replaced; anything else refused
        self.golden = golden
        self._lock: AbstractContextManager | None = location.writer()
        self._lock.__enter__()  # one writer at a time, until `abort`
        try:
            self.writer = GoldenWriter(location, refresh=True, background=False)
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise

    @property
    def url(self) -> str:
        return self.writer.location.url

    def keep(self, k: int, run: Run) -> None:
        """K's run: its rows as stored, the golden's steps with this run's timings, the head's drafts."""
        g = self.golden.log(k)
        log = StepLog(k=k, bootstrap=g.bootstrap, tokens=g.tokens, accepted=g.accepted, decoded=g.decoded,
                      step_ms=np.asarray(run.step_ms, dtype=np.float64), committed_is_greedy=None)
        rows = {kind: to_storage(t) for kind, t in run.rows_by_kind().items()}
        drafts = (np.asarray(run.drafts, dtype=np.int32).reshape(len(run.steps), k - 1)
                  if self.golden.info.drafted_at(k) else None)
        self.writer.add(run.layout, log, rows, None, drafts)

    def publish(self, model: VerifyModel, spec: str, forward: str, controls: Mapping[int, bool], verdict: str,
                inconclusive: Sequence[int] = (), decode_forward: str | None = None) -> None:
        """The candidate in place: the replayed rows, with ``controls`` (per K, whether the detection control
        fired) and ``inconclusive``, the Ks whose control showed nothing because the candidate's rows differ from
        the golden's at its step already (`vd refresh --from` names them apart from a blind control). Its decode
        rows were computed with ``decode_forward`` (default ``forward``): its ``decode.forward`` says so where
        that is another forward than its own, as a recording's does."""
        g = self.golden
        ident = model.identity()
        meta = {key: v for key, v in g.meta.items() if key not in _NOT_INHERITED}
        if "decode" in meta:
            meta["decode"] = F.decode_meta(meta["decode"]["steps"], forward, decode_forward)
        meta.update(
            model={"spec": spec, "head": g.meta["model"].get("head"), "name": ident.name,
                   "fingerprint": ident.fingerprint, "details": dict(ident.details),
                   **{k: g.meta["model"][k] for k in ("spec_base", "head_base")
                      if k in g.meta["model"] and (k != "spec_base" or spec == g.meta["model"]["spec"])}},
            forward=forward, forward_description=model.forwards()[forward],
            graphs="graphed" if protocol.uses_graphs(model, forward) else "eager",
            mtp=_head_info(model) if g.info.drafted else None, device=model.device.type,
            logits=F.logits_meta(g.logical), environment=env.of_model(model),
            determinism={"applied": (g.meta.get("determinism") or {}).get("applied"), "settings": env.determinism()},
            candidate={"of": g.url, "of_content": g.content_digest(), "verdict": verdict,
                       "control": {str(k): bool(v) for k, v in controls.items()},
                       **({"inconclusive": [str(k) for k in inconclusive]} if inconclusive else {})},
            **keep_artifacts(forward, self.writer.add_file, F.INDUCTOR_ARTIFACTS))
        self.writer.publish(meta, g.prompt, reason=f"candidate saved by a replay of {g.url}")

    def abort(self) -> None:
        """Remove what was not published, and let other writers in."""
        try:
            self.writer.abort()
        finally:
            if self._lock is not None:
                self._lock.__exit__(None, None, None)
                self._lock = None


def _head_info(model: VerifyModel) -> dict:
    """The draft head's description, from a model the drafter golden's replay ran (it has one)."""
    head = protocol.draft_head(model)
    assert head is not None, "a drafter golden replays only with a draft head (vd.replayer.session.check_model)"
    return dict(head.head_info())
