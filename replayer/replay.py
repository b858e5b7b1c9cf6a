"""Replay a golden against a model and judge it (`replay`): a `vd.replayer.report.Report`, PASS or FAIL with
reasons.

For each K and each forward asked for, the shared loop runs the replay feed (the stored tokens, accept
counts and bootstrap token, so every run verifies the same inputs and commits the same prefixes) and every
row is judged against the golden under the policy (byte for byte unless the golden or the caller says
otherwise), every decision checked (`vd.compare`). A drafter golden replays with the model's MTP head
still running, so its drafts and draft logits are judged too. Then, under the last forward, the detection
control changes the last draft of step ``steps // 2`` and must fail there under the same policy; a
reference without both a full and a partial accept at every K fails as too thin (and, if asked, one
missing an accept count). This module leaves out rendering: `vd.replayer.render` writes bundles, JUnit and
HTML, the command line prints.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vd import env
from vd.compare import Comparison, Queued, compare_run
from vd.coverage import coverage_reason, thin_reason
from vd.dtypes import of_torch, to_storage
from vd.errors import GoldenCorruptError, GoldenError, ModelMismatchError, UsageError
from vd.layout import Step
from vd.loop import DrafterFeed, Hold, ReplayFeed, hold_bytes, prepare, run_verify
from vd.measure import Measurer
from vd.models import check_device, check_forward_names, load_model, require_forwards
from vd.models.inductor import compiles, held, load_artifacts
from vd.models.specs import golden_dir, stored
from vd.models.static import CUDA_ONLY
from vd.policy import Policy, sensitivity
from vd.progress import SILENT, Progress
from vd.protocol import DraftHead, VerifyModel
from vd.replayer.candidate import CandidateWriter
from vd.replayer.report import Control, FailureRows, Judged, KResult, Reason, Report, Timing
from vd.store import Golden, Prefetcher, open_golden
from vd.store.side import GoldenSide

PHASES = ("open", "load", "setup", "prepare", "run", "wait_golden", "compare", "control", "write", "finish")


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    """What a replay asks for; every field left at its default means: as the golden recorded it.

    ``ks`` limits the replay to some of the golden's verify widths; ``tolerances`` (``[KIND=]SPEC`` items)
    override the golden's policy; ``require_coverage`` fails a golden missing an accept count;
    ``rows`` names the full golden a slim one was made from, to measure its rows; ``save_candidate`` a
    path to keep the replayed forward's rows at, as a golden (`vd.replayer.candidate`; one forward only).
    """

    model: str | None = None
    head: str | None = None
    forwards: tuple[str, ...] = ()
    ks: tuple[int, ...] = ()
    device: str | None = None
    threads: int | None = None
    allow_model_mismatch: bool = False
    control: bool = True
    tolerances: tuple[str, ...] = ()
    require_coverage: bool = False
    rows: str | None = None
    save_candidate: str | None = None


def control_steps(steps: Sequence[Step], vocab: int) -> list[Step]:
    """The detection control's input: the last draft of step ``len(steps) // 2`` bumped by one."""
    changed = list(steps)
    at = len(steps) // 2
    tokens = list(changed[at].tokens)
    tokens[-1] = (tokens[-1] + 1) % vocab
    changed[at] = Step(tuple(tokens), changed[at].accepted)
    return changed


def replay(golden: str | os.PathLike, settings: ReplaySettings = ReplaySettings(), *,
           model: VerifyModel | None = None, progress: Progress = SILENT) -> Report:
    """Replay the golden at ``golden`` (a directory, a ``.zip`` file or an ``s3://`` URL) and judge it.

    Bad input (a missing or damaged golden, an unknown model or forward, a fingerprint mismatch, a policy a
    slim golden cannot judge) raises a `vd.errors.VdError` before any comparison.
    """
    r = _Replay(settings, progress)
    r.open(golden)
    try:
        r.load(model)
        verify = [r.replay_k(k) for k in r.ks]
        r.files.check_files()  # no damaged golden reaches a verdict
        r.save_candidate(verify)
    except GoldenError:
        if hasattr(r, "files"):
            r.files.check_files()  # a damaged file, named, before whatever it broke
        raise
    finally:
        if r.candidate is not None:
            r.candidate.abort()
    return r.report(verify)


class _FileCheck:
    """Every file of the golden checked (`vd.store.read.Golden.check_files`) on a thread of its own, off the
    step's path: while the model loads, or beside the run when the model is given. (On CUDA, where the
    golden is read ahead, the `vd.store.prefetch.Prefetcher` hashes the files instead, a unit a file, in the
    time the GPU leaves idle.)"""

    def __init__(self, golden: Golden):
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, args=(golden,), name="vd-file-check", daemon=True)
        self.thread.start()

    def _run(self, golden: Golden) -> None:
        t = time.perf_counter()
        try:
            golden.check_files()
        except BaseException as e:  # handed to the replay's thread by `result`
            self.error = e
        self.seconds = time.perf_counter() - t

    def check_files(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


class _Replay:
    """One replay's state, from opening the golden to the report, each phase timed (``clock``)."""

    def __init__(self, settings: ReplaySettings, progress: Progress):
        self.settings, self.progress = settings, progress
        self.clock = dict.fromkeys(PHASES, 0.0)
        self.reasons: list[Reason] = []
        self.failure: FailureRows | None = None
        self.candidate: CandidateWriter | None = None
        self.first_step: float | None = None  # seconds from the process's start to its first verify run

    def open(self, where) -> None:
        """Open the golden (its metadata only) and check what the settings ask of it."""
        t = time.perf_counter()
        s = self.settings
        self.golden = g = open_golden(where, rows=s.rows)
        self.clock["open"] = time.perf_counter() - t
        env.check_threads(s.threads)
        self.ks = list(s.ks) or g.ks
        absent = [k for k in self.ks if k not in g.ks]
        if absent:
            raise UsageError(f"{g.url} has no verify width {absent}; it holds K = {g.ks}")
        self.policy = Policy.parse(s.tolerances, g.meta.get("policy"))
        needs = self.policy.needs_rows
        if g.rows_source is None and needs:
            raise UsageError(f"{g.url} is slim: judging {', '.join(needs)} rows under "
                             f"{', '.join(sorted({self.policy[k].text for k in needs}))} needs its rows; "
                             "name the full golden with --rows, or judge exact or argmax")

    def load(self, model: VerifyModel | None) -> None:
        """The model (loaded unless given), checked against the golden; the forwards to replay."""
        t, loading = time.perf_counter(), 0.0
        g, s = self.golden, self.settings
        self.recorded_env = g.meta.get("environment") or {}
        self.determinism = (g.meta.get("determinism") or {}).get("applied")
        env.apply_determinism(self.determinism)  # what the recording applied, before the model is loaded
        # CPU kernels can split work by thread count: replay with the recording's unless told otherwise.
        # (the recorded count, bounded by this machine's cores: more threads than cores only slows it down)
        torch.set_num_threads(s.threads or min(self.recorded_env.get("threads") or torch.get_num_threads(),
                                               os.cpu_count() or 1))
        self.prefetcher = None
        artifacts = self._artifacts()  # before anything compiles
        if model is None:
            self.progress.phase("loading model", 0)
            t_load = time.perf_counter()
            model = self._load_model()
            loading = time.perf_counter() - t_load
        self.clock["load"] = loading
        self.model = model
        if self.prefetcher is None:
            self._reader(Prefetcher(g, model.device, files=True))
        self.offered = model.forwards()
        lacks = None if s.forwards or g.info.forward in self.offered else (  # e.g. a CUDA golden on a CPU
            f"--forward NAME: the golden was recorded with forward {g.info.forward!r}, which this model on "
            f"{model.device.type} does not offer (it offers {', '.join(self.offered)})")
        self.notes = _check_model(g, model, s.allow_model_mismatch, lacks) + artifacts
        if lacks is not None:
            raise UsageError(f"pass {lacks}")
        self.forwards = list(s.forwards) or [g.info.forward]
        require_forwards(model, self.forwards)
        if s.save_candidate is not None:
            if len(self.forwards) > 1:
                raise UsageError("--save-candidate keeps one forward's rows; replay one --forward")
            self.candidate = CandidateWriter(s.save_candidate, g)
        self.clock["setup"] = time.perf_counter() - t - loading

    def _artifacts(self) -> list[str]:
        """Load the Inductor artifacts a compiled golden's recording stored, when a compiled forward is to run,
        so that it compiles to the recording's kernels (`vd.models.inductor`); what happened, as a note."""
        g, s = self.golden, self.settings
        about = g.meta.get("compiled")
        if about is None or not any(compiles(f) for f in (s.forwards or [g.info.forward])):
            return []
        if held(about["sha256"]):  # this process saved or loaded them already (its file is checked with the rest)
            return [f"compiled forwards reuse the recording's Inductor artifacts ({about['bytes'] / 1e6:.1f} MB, "
                    f"{about.get('torch')}; held by this process already)"]
        data = g.location.get(about["artifacts"])
        if data is None or hashlib.sha256(data).hexdigest() != about["sha256"]:
            raise GoldenCorruptError(f"{g.url}/{about['artifacts']} is missing or does not match its hash")
        why = load_artifacts(data, about["sha256"])
        if why is not None:
            return [f"the recording's Inductor artifacts ({about.get('torch')}) could not be loaded ({why}): compiled "
                    "forwards compiled afresh and may run other kernels than the recording's"]
        return [f"compiled forwards reuse the recording's Inductor artifacts ({len(data) / 1e6:.1f} MB, "
                f"{about.get('torch')})"]

    def _reader(self, prefetcher: Prefetcher) -> None:
        """The golden's reader, and its files' check begun: by the reader's units where it reads ahead (CUDA),
        else on a thread of its own, while the model loads."""
        self.prefetcher = prefetcher
        self.files = prefetcher if prefetcher.hashing else _FileCheck(self.golden)

    def _load_model(self) -> VerifyModel:
        g, s = self.golden, self.settings
        spec, stored_head = stored(g.meta["model"], golden_dir(g.location))  # a file spec from here
        check_forward_names(s.model or spec, list(s.forwards))  # before the model loads
        dev = s.device or g.info.device
        if dev.startswith("cuda") and not torch.cuda.is_available():
            also = (f", with --forward naming a CPU forward (it was recorded with {g.info.forward!r}, which runs "
                    "on CUDA only; `vd forwards` lists them)" if not s.forwards and g.info.forward in CUDA_ONLY else "")
            raise UsageError(f"{g.url} was recorded on {dev} and this machine has no CUDA device; pass --device cpu "
                             f"to replay it on the CPU{also}")
        head = s.head if s.head is not None or s.model is not None else stored_head
        device = check_device(dev)
        self._reader(Prefetcher(g, device, files=True))
        self.prefetcher.start_thread()  # on CUDA the golden is read while the weights load
        return load_model(s.model or spec, device=device, dtype=g.logical, head=head)

    # -- one K -------------------------------------------------------------------------------------------
    def replay_k(self, k: int) -> KResult:
        """Every forward at ``k``, then the control, then the golden's own checks at ``k``."""
        log = self.golden.log(k)  # the metadata's copy; the arrays are read and checked beside the run
        judged, timings = [], [Timing(f"{self.golden.info.forward} (golden)", tuple(log.step_ms.tolist()))]
        for name in self.forwards:
            self.progress.phase(f"K={k} {name}", self.golden.info.steps)
            c, step_ms = self._run(k, name, log.steps)
            why = tuple(_reasons(k, name, c))
            self.reasons.extend(why)
            judged.append(Judged(c, why))
            timings.append(Timing(name, tuple(step_ms)))
        control = self._control(k, log.steps, judged[-1].comparison) if self.settings.control else None
        accepted = log.accepted.tolist()
        for what, text in (("thin", thin_reason(k, accepted)),
                           ("coverage", coverage_reason(k, accepted) if self.settings.require_coverage else None)):
            if text is not None:
                self.reasons.append(Reason(what, text, k))
        left = (self.golden.meta.get("left_greedy") or {}).get(str(k))
        return KResult(k, tuple(accepted), tuple(judged), tuple(timings), control, left)

    def _feed(self, k: int, steps: list[Step]):
        log = self.golden.log(k)
        forced = ReplayFeed(steps, log.bootstrap, log.decoded)
        return DrafterFeed(k, self.golden.info.steps, forced) if self.golden.info.drafted else forced

    def _execute(self, k: int, steps: list[Step], variant: str, clock: dict[str, float], control: bool = False
                 ) -> tuple[Comparison, list[float]]:
        """One run of ``steps`` under the selected forward and its comparison, timed into ``clock``. Rows are
        measured as the run lets them go (`vd.loop.Hold`), so its memory stays flat in steps (a run whose
        candidate is kept holds them all); on CUDA the comparison of the rows still held is queued behind the
        last step while it runs."""
        queued: list[Queued] = []
        on_last = ((lambda run, rows: queued.append(Queued(self.prefetcher.side(k), run, rows)))
                   if self.model.device.type == "cuda" else None)
        measurer = Measurer(lambda: self.prefetcher.side(k), self.golden.logical, self.policy)
        hold = None if self.candidate is not None and not control else Hold(hold_bytes(self.model.device),
                                                                            measurer.add)
        if self.first_step is None:
            self.first_step = env.process_age()
        t1 = time.perf_counter()
        run = run_verify(self.model, self.golden.prompt, k, self.golden.info.steps, self._feed(k, steps),
                         on_step=self.progress.step, idle=self.prefetcher.idle, on_last=on_last, hold=hold)
        t2 = time.perf_counter()
        side = self.prefetcher.side(k)  # made in the run's idle time on CUDA
        t3 = time.perf_counter()
        c = compare_run(variant, side, run, self.golden.logical, self.policy, *queued, measurer=measurer)
        for name, dt in (("run", t2 - t1), ("wait_golden", t3 - t2), ("compare", time.perf_counter() - t3)):
            clock[name] += dt
        if control:  # meant to fail: neither the first divergence nor a candidate
            return c, run.step_ms
        if not c.passed and self.failure is None:
            self.failure = _failure_rows(k, variant, c, side, measurer.kept, getattr(self.model, "decode", None))
        if self.candidate is not None:
            self.candidate.keep(k, run)
        return c, run.step_ms

    def _run(self, k: int, name: str, steps: list[Step]) -> tuple[Comparison, list[float]]:
        t = time.perf_counter()
        self.model.set_forward(name)
        self.prefetcher.pause()  # no reader work beside a graph capture
        prepare(self.model, len(self.golden.prompt), self.golden.info.steps, self.golden.ks,
                decode=self.golden.info.drafted)  # a reference feed's replay runs no one-token forward
        self.clock["prepare"] += time.perf_counter() - t
        return self._execute(k, steps, name, self.clock)

    def save_candidate(self, verify: list[KResult]) -> None:
        """Publish the kept candidate, with each K's control result (`vd.replayer.candidate`)."""
        if self.candidate is None:
            return
        t = time.perf_counter()
        controls = {v.k: v.control is not None and v.control.fired for v in verify}
        self.candidate.publish(self.model, self.settings.model or self.golden.meta["model"]["spec"], self.forwards[0],
                               controls, "FAIL" if self.reasons else "PASS")
        self.notes.append(f"candidate saved: {self.candidate.url} (review with vd diff, promote with vd refresh "
                          "--from)")
        self.clock["write"] += time.perf_counter() - t

    def _control(self, k: int, steps: list[Step], own: Comparison) -> Control:
        """The detection control under the last forward (still selected; ``own``: its comparison): it must
        fail at the very step whose draft changed, under the active policy or by a changed decision, where
        that forward's own run did not. Where its own run fails there already, it is inconclusive: a replay
        that differs everywhere does not show it would see a change (and fails anyway)."""
        t = time.perf_counter()
        self.progress.phase(f"K={k} control", self.golden.info.steps)
        dc, _ = self._execute(k, control_steps(steps, self.model.vocab_size), f"{self.forwards[-1]}, one draft changed",
                              dict.fromkeys(PHASES, 0.0), control=True)  # counted as the control's time alone
        at = self.golden.info.steps // 2
        inconclusive = at in own.failed_step_list
        fired = at in dc.failed_step_list and not inconclusive
        if not fired and not inconclusive:
            self.reasons.append(Reason("control", f"verify K={k}: the detection control saw no difference at step "
                                       f"{at} after changing its last draft (policy: {self.policy.describe()})", k))
        self.clock["control"] += time.perf_counter() - t
        return Control(dc, at, fired, inconclusive)

    # -- the report --------------------------------------------------------------------------------------
    def report(self, verify: list[KResult]) -> Report:
        t = time.perf_counter()
        g, model = self.golden, self.model
        replayed_env = env.of_model(model)
        uses_graphs = getattr(model, "forward_uses_graphs", lambda name: False)
        graphed = [uses_graphs(n) for n in self.forwards]
        env_diff = env.numerics_differences(self.recorded_env, replayed_env)
        if env_diff and any(not j.comparison.passed for v in verify for j in v.comparisons):
            hint = env.same_kernels_hint(self.recorded_env, replayed_env)
            self.reasons.append(Reason("environment", "the replaying environment differs from the recording's in "
                                       + "; ".join(env_diff) + " — bitwise differences may come from that"
                                       + (f" (the recording's CPU kernels run here under {hint})" if hint else "")))
        m = g.meta["model"]
        source = g.rows_source
        return Report(
            golden=g.url,
            model={"spec": m["spec"], "name": m.get("name"), "fingerprint": m["fingerprint"],
                   "replayed_with": model.identity().name,
                   "replayed_spec": self.settings.model if self.settings.model not in (None, m["spec"]) else None},
            graphs="graphed" if all(graphed) else "eager" if not any(graphed) else "mixed",
            mtp=g.info.drafted, head=g.meta.get("mtp"), feed=g.info.feed, steps=g.info.steps, dtype=g.logical,
            variants=tuple({"name": n, "description": self.offered[n], "golden": n == g.info.forward,
                            "graphs": "graphed" if gr else "eager"} for n, gr in zip(self.forwards, graphed)),
            determinism={"recorded": g.meta.get("determinism"), "applied": self.determinism,
                         "replayed": env.determinism()},
            golden_forward=g.info.forward, policy=self.policy, sensitivity=_sensitivity(self.policy, g.logical, verify),
            require_coverage=self.settings.require_coverage, verify=tuple(verify), reasons=tuple(self.reasons),
            notes=tuple(self.notes),
            environment={"recorded": self.recorded_env, "replayed": replayed_env, "numerics_differences": env_diff},
            rows={"slim": g.slim, "source": None if source is None else source.url},
            seconds=sum(self.clock[n] for n in PHASES if n not in ("open", "load", "setup", "write")),
            phases={**self.clock, "finish": time.perf_counter() - t},
            timing=_timing_of(self.clock, time.perf_counter() - t, self.first_step),
            reader={**self.prefetcher.summary(), "file_check_s": getattr(self.files, "seconds", None)},
            failure_rows=self.failure)


def _timing_of(clock: dict[str, float], finish: float, first_step: float | None) -> dict:
    return {"first_step": first_step, "open": clock["open"], "load": clock["load"], "setup": clock["setup"],
            "prepare": clock["prepare"], "run": clock["run"], "control": clock["control"],
            "compare": clock["compare"] + clock["wait_golden"], "write": clock["write"] + finish}


def _check_model(golden: Golden, model: VerifyModel, allow_mismatch: bool, lacks: str | None = None
                 ) -> list[str]:
    """Refuse a model that cannot be compared; a different fingerprint only with ``allow_mismatch``. ``lacks``:
    the other flag the replay needs (a forward), named in the same error so one attempt learns both."""
    meta = golden.meta
    if model.vocab_size != golden.info.vocab:
        raise ModelMismatchError(f"model has vocab {model.vocab_size}, golden {golden.url} has {golden.info.vocab}")
    computes = of_torch(model.dtype).name
    if computes != golden.logical:
        raise ModelMismatchError(f"model computes {computes} rows, golden {golden.url} holds {golden.logical} rows: "
                                 "a replay compares rows of the golden's dtype (load the model in it, or replay a "
                                 f"golden recorded in {computes})")
    pairs = [("model", model.identity().fingerprint, meta["model"]["fingerprint"])]
    if golden.info.drafted:
        if not isinstance(model, DraftHead):
            raise ModelMismatchError(f"{golden.url} was recorded with an MTP draft head and this model has none")
        pairs.append(("MTP head", model.head_info()["fingerprint"], meta["mtp"]["fingerprint"]))
    notes = []
    for what, got, want in pairs:
        if got == want:
            continue
        if not allow_mismatch:
            also = "" if lacks is None else f", and {lacks}"
            raise ModelMismatchError(f"{what} fingerprint {got[:19]}… differs from golden's {want[:19]}… "
                                     f"(pass --allow-model-mismatch to compare anyway{also})")
        notes.append(f"{what} fingerprint differs from the golden's ({got} vs {want}); allowed by the user")
    return notes


def _reasons(k: int, name: str, c: Comparison) -> list[Reason]:
    """One reason per kind of row that fails (its policy, or a changed decision)."""
    out, pol, sm = [], c.policy, c.summary
    flips = {kind: [f for f in c.flips if f.kind == kind and not f.allowed] for kind in ("prefill", "verify", "draft")}
    slim = "" if c.measured else " (the golden is slim: name its full golden with --rows to measure the rows)"
    if sm["verify"]["rows_failed"] or sm["prefill"]["rows_failed"] or flips["verify"] or flips["prefill"] \
            or _changed(c):
        if pol["prefill"] == pol["verify"] == "exact":
            head = (f"verify K={k}, {name}: prefill equal {c.prefill_equal}, {c.mismatched_steps} of {c.steps} "
                    f"steps differ (first at {_where(c.first_mismatch or c.prefill_first_mismatch)})")
        else:
            v, p = sm["verify"], sm["prefill"]
            head = (f"verify K={k}, {name}: {v['rows_failed']} of {v['rows']} verify rows fail {pol['verify']}, "
                    f"{p['rows_failed']} of {p['rows']} prefill rows fail {pol['prefill']} (largest |Δ| "
                    f"{max(v['max_abs'], p['max_abs']):.4g}, {max(v['max_ulp'], p['max_ulp']):.0f} ULP, KL "
                    f"{max(v['max_kl'], p['max_kl']):.3g}; first failure {_failure(c.first_failure)})")
        out.append(Reason("rows", head + _flip_text(flips["prefill"]) + _flip_text(flips["verify"])
                          + _accept_text(c) + slim, k, name))
    if "draft" in sm and (sm["draft"]["rows_failed"] or flips["draft"]):
        if pol["draft"] == "exact":
            head = (f"draft head K={k}, {name}: bootstrap row equal {c.bootstrap_equal}, {c.draft_mismatched_steps} "
                    f"of {c.steps} steps' draft rows differ (first at {_where(c.draft_first_mismatch)})")
        else:
            d = sm["draft"]
            head = (f"draft head K={k}, {name}: {d['rows_failed']} of {d['rows']} draft rows fail {pol['draft']} "
                    f"(largest |Δ| {d['max_abs']:.4g}, {d['max_ulp']:.0f} ULP, KL {d['max_kl']:.3g})")
        out.append(Reason("draft", head + _flip_text(flips["draft"]) + slim, k, name))
    return out


def _flip_text(flips: list) -> str:
    if not flips:
        return ""
    f = flips[0]
    where = "bootstrap row" if f.kind == "draft" and f.step is None else (
        "prefill" if f.step is None else f"step {f.step}") + f" row {f.row}"
    return (f"; {len(flips)} argmax flip(s), first at {where}: {f.golden_argmax} → {f.got_argmax}, golden "
            f"top-1/top-2 margin {f.margin:.4g} ({f.margin_ulps:.1f} ULP{', a near-tie' if f.near_tie else ''})")


def _changed(c: Comparison) -> list[dict]:
    """The accept-count changes the policy does not allow."""
    return [a for a in c.accept_changes if not a["allowed"]]


def _accept_text(c: Comparison) -> str:
    changed = _changed(c)
    if not changed:
        return ""
    a = changed[0]
    return (f"; {len(changed)} step(s) would accept a different number of drafts (first: step {a['step']}, "
            f"{a['golden']} → {a['got']})")


def _failure(f: dict | None) -> str:
    if f is None:
        return "-"
    if f["step"] is None:
        where = f"prefill row {f['row']}" if f["kind"] == "prefill" else "draft bootstrap row"
    else:
        where = f"{f['kind']} step {f['step']} row {f['row']}"
    return f"{where} index {f['index']}: golden {f['golden']!r}, got {f['got']!r}"


def _where(m) -> str:
    if m is None:
        return "-"
    step = "prefill" if m.step is None else f"step {m.step}"
    if m.index is None:
        return f"{step} row {m.row}"
    return f"{step} row {m.row} index {m.index}: golden {m.golden!r}, got {m.got!r}"


def _failure_rows(k: int, name: str, c: Comparison, side: GoldenSide, kept: dict, decode=None) -> FailureRows | None:
    """The golden's and the candidate's rows of the first failing step (for a first-divergence bundle);
    ``kept``: the candidate's rows of each kind's first failing step (`vd.measure.Measurer.kept`)."""
    f = c.first_failure
    if f is None:  # a changed accept count alone: keep its step's verify rows
        if not _changed(c):
            return None
        f = {"kind": "verify", "step": _changed(c)[0]["step"]}
    kind, step = f["kind"], f["step"]
    if kind not in kept or kept[kind][0] != step:
        return None
    idx = side.layout.step_rows(kind, step)
    return FailureRows(k=k, forward=name, kind=kind, step=step,
                       golden=side.host_rows(kind, idx) if side.has_rows else None,
                       candidate=to_storage(kept[kind][1]),
                       tokens=side.tokens[step].tolist() if step is not None else None, first_failure=f,
                       text=None if decode is None or step is None else decode(side.tokens[step].tolist()))


def _sensitivity(policy: Policy, logical: str, verify: list[KResult]) -> dict:
    """Per kind: the smallest change the active policy is guaranteed to catch, from the golden's rows."""
    out = {}
    for kind in ("prefill", "verify", "draft"):
        stats = [j.comparison.summary[kind] for v in verify for j in v.comparisons if kind in j.comparison.summary]
        if not stats:
            continue
        agg = {"max_abs": max(s["golden_max_abs"] for s in stats),
               "min_margin": min(s["golden_min_margin"] for s in stats),
               "median_top1_p": statistics.median(s["golden_median_top1_p"] for s in stats)}
        catches = sensitivity(policy[kind], logical, agg, policy.margin)
        out[kind] = {"policy": policy[kind].text, "catches": catches, **agg}
    return out
