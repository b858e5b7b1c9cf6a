"""Every verdict in words: the reasons a replay or a diff gives, the command line's table and lines, the
suite's lines and Markdown summary, a refresh's change summary, JUnit's messages and the HTML page's text.

Everything here reads the typed values of `vd.replayer.comparison` and `vd.replayer.report` and returns
plain text (or rows of cells); it prints nothing, escapes nothing and draws nothing: the command line
prints, `vd.replayer.render` lays the text out as HTML and JUnit. A new fact about a verdict is a field of
those values, a function here, and its test.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vd.batch import slots_text
from vd.equivalence import Equivalence
from vd.equivalence import describe as describe_equivalence
from vd.layout import StepLog
from vd.policy import Policy
from vd.replayer.comparison import Comparison, Failure, Flip, KindSummary, Mismatch
from vd.replayer.report import BatchAxis, Control, DiffReport, FailureRows, KResult, Reason, Report
from vd.store.format import DECODE_K


@dataclass(frozen=True, slots=True)
class TextTable:
    """A table to print: its title, column headings and rows of cells."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, slots=True)
class Code:
    """A command or a path inside a sentence (HTML shows it as code)."""

    text: str


# One thing to do about a verdict: sentences and the commands (or files) they name, in order.
NextStep = tuple[str | Code, ...]


def plain_text(step: NextStep) -> str:
    """A next step as one line of text."""
    return "".join(part.text if isinstance(part, Code) else part for part in step)


# -- places --------------------------------------------------------------------------------------------------


def group(k: int) -> str:
    """How a K group is named in words: ``K=2``, or ``decode`` for the decode rows' group."""
    return "decode" if k == DECODE_K else f"K={k}"


def before_words(n: int) -> str:
    """How many traced outputs before a located module's are identical, in words (`vd.replayer.locate`)."""
    return "the first traced output" if n == 0 else \
        f"the {n} traced output{'s' if n > 1 else ''} before it identical"


def mismatch_place(m: Mismatch | None) -> str:
    """Where two sets of rows first differ, with both values where the golden's rows were at hand."""
    if m is None:
        return "-"
    step = "prefill" if m.step is None else f"step {m.step}"
    if m.index is None:
        return f"{step} row {m.row}"
    return f"{step} row {m.row} index {m.index}: golden {m.golden!r}, got {m.got!r}"


def failure_place(f: Failure, k: int | None = None) -> str:
    """Where a first failure sits: ``verify step 3 row 1 index 57`` (at ``k`` the decode group: ``decode step``)."""
    if f.step is None:
        place = "prefill" if f.kind == "prefill" else "draft bootstrap"
    else:
        place = f"{f.kind if k is None else _row_kind(k, f.kind)} step {f.step}"
    return f"{place} row {f.row}" + ("" if f.index is None else f" index {f.index}")


def failure_text(f: Failure | None) -> str:
    """A first failure with both values."""
    if f is None:
        return "-"
    if f.step is None:
        where = f"prefill row {f.row}" if f.kind == "prefill" else "draft bootstrap row"
    else:
        where = f"{f.kind} step {f.step} row {f.row}"
    if f.within:  # the row is within its SPEC: what fails is its changed argmax (a decision the policy forbids)
        return f"{where}: within {f.policy}, but its argmax changed"
    if f.policy == "argmax":  # (an element's two values say nothing of an argmax, or of the top N)
        return f"{where}: its argmax differs"
    if f.policy.startswith("topk:"):
        return f"{where}: its top {f.policy.removeprefix('topk:')} tokens differ"
    if f.index is None:
        return f"{where}: differs (its elements unknown: the golden's rows are not at hand)"
    return f"{where} index {f.index}: golden {f.golden!r}, got {f.got!r}"


# -- reasons ---------------------------------------------------------------------------------------------------


def comparison_reasons(k: int, name: str, c: Comparison, label: str | None = None, what: str = "rows",
                       shown: str | None = None) -> list[Reason]:
    """One reason per kind of row that fails (its policy, or a changed decision); ``label`` heads it (default
    ``verify K=2``), then the forward (``shown``, default ``name``); ``what`` it is about."""
    out, sm = [], c.summary
    flips = {kind: [f for f in c.unallowed_flips if f.kind == kind] for kind in ("prefill", "verify", "draft")}
    slim = "" if c.measured else " (the golden is slim: name its full golden with --rows to measure the rows)"
    if (sm["verify"].rows_failed or sm["prefill"].rows_failed or flips["verify"] or flips["prefill"]
            or c.changed_accepts):
        head = _rows_head(label or f"verify K={k}", shown or name, c)
        out.append(Reason(what, head + _flip_text(flips["prefill"]) + _flip_text(flips["verify"]) + _accept_text(c)
                          + slim, k, name))
    if "draft" in sm and (sm["draft"].rows_failed or flips["draft"]):
        out.append(Reason("draft", _draft_head(k, name, c) + _flip_text(flips["draft"]) + slim, k, name))
    return out


def _rows_head(label: str, name: str, c: Comparison) -> str:
    if c.policy.prefill.text == c.policy.verify.text == "exact":
        prefill = "equal" if c.prefill_equal else "differs"
        return (f"{label}, {name}: prefill {prefill}, {c.mismatched_steps} of {c.steps} steps differ (first "
                f"at {mismatch_place(c.prefill_first_mismatch or c.first_mismatch)})")  # (the prefill runs first)
    v, p = c.summary["verify"], c.summary["prefill"]
    return (f"{label}, {name}: {v.rows_failed} of {v.rows} verify rows fail {c.policy.verify.text}, "
            f"{p.rows_failed} of {p.rows} prefill rows fail {c.policy.prefill.text} (largest |Δ| "
            f"{max(v.max_abs, p.max_abs):.4g}, {max(v.max_ulp, p.max_ulp):.0f} ULP, KL "
            f"{max(v.max_kl, p.max_kl):.3g}; first failure {failure_text(c.first_failure)})")


def _draft_head(k: int, name: str, c: Comparison) -> str:
    if c.policy.draft.text == "exact":
        bootstrap = "equal" if c.bootstrap_equal else "differs"
        return (f"draft head K={k}, {name}: bootstrap row {bootstrap}, {c.draft_mismatched_steps} of {c.steps} "
                f"steps' draft rows differ (first at {mismatch_place(c.draft_first_mismatch)})")
    d = c.summary["draft"]
    return (f"draft head K={k}, {name}: {d.rows_failed} of {d.rows} draft rows fail {c.policy.draft.text} "
            f"(largest |Δ| {d.max_abs:.4g}, {d.max_ulp:.0f} ULP, KL {d.max_kl:.3g})")


def _flip_text(flips: Sequence[Flip]) -> str:
    if not flips:
        return ""
    f = flips[0]
    where = "bootstrap row" if f.kind == "draft" and f.step is None else (
        "prefill" if f.step is None else f"step {f.step}") + f" row {f.row}"
    return (f"; {len(flips)} argmax flip(s), first at {where}: {f.golden_argmax} → {f.got_argmax}, golden "
            f"top-1/top-2 margin {f.margin:.4g} ({f.margin_ulps:.1f} ULP{', a near-tie' if f.near_tie else ''})")


def _accept_text(c: Comparison) -> str:
    changed = c.changed_accepts
    if not changed:
        return ""
    a = changed[0]
    return (f"; {len(changed)} step(s) would accept a different number of drafts (first: step {a.step}, "
            f"{a.golden} → {a.got})")


def decode_reasons(name: str, decode_forward: str, c: Comparison) -> list[Reason]:
    """The decode rows (the greedy continuation's one-token decodes) a forward computed, against the golden's."""
    label = "decode rows" + ("" if decode_forward == name else f" (for {name}'s verify rows)")
    return comparison_reasons(1, name, c, label=label, what="decode", shown=decode_forward)


def batch_reasons(k: int, label: str, b: BatchAxis) -> list[Reason]:
    """A forward's rows run in a batch (`vd.replayer.report.BatchAxis`) that fail the policy against the golden's;
    ``label`` names the rows (``verify K=3``, ``decode rows``)."""
    first = b.first_difference
    where = "" if first is None else f" (slot {first[1]} at the first difference)"
    return comparison_reasons(k, b.forward, b.comparison, label=f"{label} in a batch of {b.n}{where}", what="batch")


def batch_line(k: int | None, b: BatchAxis) -> str:
    """One line of a forward's batch axis: where its sequence sat, and where its rows first differ."""
    row, first = b.axis_row(), b.first_difference
    where = "no row differs" if first is None else (
        f"first difference at {'the prefill' if first[0] is None else f'step {first[0]}'}, slot {first[1]}")
    head = "decode" if k is None else f"K={k}"
    return (f"  {head} {b.forward} in a batch of {b.n} ({slots_text(b.slot)}, seed {b.seed}): {row.identical} of "
            f"{row.rows} rows identical to the golden's, {where}")


def equivalence_reasons(k: int, name: str, e: Equivalence, policy: Policy) -> list[Reason]:
    """A forward's verify rows that fail the policy's ``equivalence=SPEC`` against the decode rows of the same
    positions (none where equivalence is reported only)."""
    if not e.judged or e.passed:
        return []
    f = e.failing[0]
    spec = policy.equivalence.text if policy.equivalence is not None else "?"
    flips = f"; {len(e.flips)} argmax flip(s): speculative output would differ from greedy output there" if e.flips \
        else ""
    return [Reason("equivalence", f"verify K={k}, {name}: {len(e.failing)} of {e.rows} verify rows fail "
                   f"equivalence={spec} against the one-token decode rows of the same positions (first at step "
                   f"{f.step} row {f.row}; largest |Δ| {e.max_abs:.4g}, {e.max_ulp:.0f} ULP){flips}", k, name)]


def draft_token_reason(k: int, name: str, bad: list[int], proposals: int, proposed: list[int], implied: list[int]
                       ) -> Reason:
    """A draft head whose proposed tokens are not its own draft rows' argmaxes (``bad``: those proposals, by the
    step they precede; `vd.loop.mismatched_drafts`): the rows can match the golden's while the drafts a scheduler
    would verify do not."""
    return Reason("draft", f"verify K={k}, {name}: the draft head proposed tokens that are not its draft rows' "
                  f"argmaxes at {len(bad)} of {proposals} proposals (first before step {bad[0]}: proposed {proposed}, "
                  f"its rows say {implied})", k, name)


def equivalence_line(k: int, name: str, e: Equivalence) -> str:
    """One line of a verify-against-decode axis (`vd.equivalence.describe`)."""
    return f"  K={k} {name} verify vs decode: {describe_equivalence(e)}"


def control_reason(k: int, at: int, policy: Policy) -> Reason:
    """A blind detection control."""
    return Reason("control", f"verify K={k}: the detection control saw no difference at step {at} after changing "
                  f"its last draft (policy: {policy.describe()})", k)


def environment_reason(differences: Sequence[str], hint: str | None) -> Reason:
    """The replaying environment differs where bits differ."""
    return Reason("environment", "the replaying environment differs from the recording's in "
                  + "; ".join(differences) + " — bitwise differences may come from that"
                  + (f" (the recording's CPU kernels run here under {hint})" if hint else ""))


def steps_reason(k: int, changed: Sequence[int], a: Any, b: Any, total: int) -> Reason:
    """A diff's K whose recordings verified other tokens or accepted other counts (``a``, ``b``: the first
    changed step's `vd.layout.Step` of each)."""
    if k == DECODE_K:  # (one-token decodes: each step's token is the one the step before chose; none accepts)
        return Reason("steps", f"{group(k)}: {len(changed)} of {total} steps decoded from another token: the greedy "
                      f"continuations part (first at step {changed[0]}: {list(a.tokens)} vs {list(b.tokens)})", k)
    return Reason("steps", f"{group(k)}: {len(changed)} of {total} steps verified other tokens or accepted another "
                  f"count (first at step {changed[0]}: {_step(a)} vs {_step(b)})", k)


def _step(s: Any) -> str:
    return f"{list(s.tokens)} accepting {s.accepted}"


def bootstrap_reason(k: int, a: int | None, b: int | None) -> Reason:
    return Reason("steps", f"{group(k)}: bootstrap token {a} vs {b}", k)


def diff_rows_reason(k: int, c: Comparison) -> Reason:
    """A diff's K whose rows fail the policy."""
    f = c.first_failure
    return Reason("rows", f"{group(k)}: rows differ under {c.policy.describe()}: "
                  + ", ".join(f"{_row_kind(k, n)} {s.rows_failed}/{s.rows} rows fail, {s.argmax_flips} argmax "
                              f"flip(s), max |Δ| {_measure(s.max_abs)}" for n, s in c.summary.items())
                  + (f" (first: {_row_kind(k, f.kind)}{'' if f.step is None else f' step {f.step}'} row {f.row}"
                     f"{'' if f.index is None else f' index {f.index}'})" if f else ""), k)


# -- the command line ------------------------------------------------------------------------------------------


def replay_table(report: Report) -> TextTable:
    """A replay's table: a row per K and forward."""
    cols = ["K", "forward", "prefill", "steps differ", "first mismatch", "max |Δ|", "flips", "judged", "step ms",
            "control"]
    if report.mtp:
        cols[4:4] = ["drafts differ"]
    rows = []
    for v in ([report.decode] if report.decode is not None else []) + list(report.verify):
        last = len(v.comparisons) - 1  # the control runs under the last forward: its row shows it
        for i, (j, tm) in enumerate(zip(v.comparisons, v.timings[1:])):
            control = "-" if v.control is None or i != last else v.control.state
            c = j.comparison
            label = "decode" if v is report.decode else str(v.k)
            cells = [label, c.variant, "equal" if c.prefill_equal else "DIFFERS", f"{c.mismatched_steps}/{c.steps}",
                     _first_cell(c), _size(c.max_abs_diff), _flips(c), "pass" if c.passed else "FAIL",
                     f"{tm.median_ms:.2f}", control]
            if report.mtp:
                cells[4:4] = ["-" if c.draft_mismatched_steps is None else
                              f"{c.draft_mismatched_steps}/{c.steps}{'' if c.bootstrap_equal else ' +bootstrap'}"]
            rows.append(tuple(cells))
    return TextTable(f"vd replay {report.golden}  (policy: {report.policy.describe()})", tuple(cols), tuple(rows))


def _first_cell(c: Comparison) -> str:
    """The table's first-mismatch cell: the first row computed that differs (the prefill's, then a verify row's,
    else the draft head's: a FAIL of draft rows alone showed ``-``), its place short."""
    m = c.prefill_first_mismatch or c.first_mismatch
    head = ""
    if m is None and c.bootstrap_equal is False:
        return "draft bootstrap"
    if m is None and c.draft_first_mismatch is not None:
        m, head = c.draft_first_mismatch, "draft "
    if m is None:
        return "-"
    place = "prefill" if m.step is None else f"step {m.step}"
    return f"{head}{place} row {m.row}" + ("" if m.index is None else f" [{m.index}]")


def _size(x: float | None, form: str = ".4g") -> str:
    """A size of difference in a table: ``-`` where it is unknown (None, or NaN: a slim golden's rows are not
    there to measure)."""
    return "-" if x is None or math.isnan(x) else format(x, form)


def _flips(c: Comparison) -> str:
    """The flips column: how many, and how many of them the policy's decisions=margin:X allowed."""
    allowed = sum(f.allowed for f in c.flips)
    return f"{len(c.flips)}" + (f" ({allowed} allowed)" if allowed else "")


AXES_COLUMNS = ("K", "forward", "axis", "rows compared", "identical", "max |Δ|", "flips", "verdict")


def axes_table(report: Report) -> TextTable:
    """The table of axes: per K and forward, one row per axis (`vd.replayer.report.KResult.axes`); first the
    decode rows' (K column ``decode``: against the golden's decode rows and, with ``--batch``, in a batch)."""
    decode = [] if report.decode is None else [("decode", *row[1:]) for row in axes_table_rows(report.decode)]
    rows = tuple(decode) + tuple(row for v in report.verify for row in axes_table_rows(v))
    return TextTable("axes: where greedy speculative decoding stays lossless", AXES_COLUMNS, rows)


def axes_table_rows(v: KResult) -> list[tuple[str, ...]]:
    """K's rows of the table of axes (`AXES_COLUMNS`)."""
    def cell(x) -> str:
        return _size(x) if isinstance(x, float) or x is None else str(x)

    return [(str(v.k), a.forward, a.axis, cell(a.rows), cell(a.identical), cell(a.max_abs), cell(a.flips),
             a.verdict) for a in v.axes()]


def replay_lines(report: Report) -> list[str]:
    """The lines below a replay's table: agreement where rows differ, where a recording left greedy, the
    notes (a candidate saved, the artifacts a compiled forward loaded), the reasons (the verdict itself is
    printed apart, then `next_lines`)."""
    out = []
    for v in report.verify:
        out += [line for j in v.comparisons if (line := agreement_line(v.k, j.comparison))]
        if v.equivalence is not None:
            out += [equivalence_line(v.k, name, e) for name, e in v.equivalence.forwards if e.rows > e.identical]
        if v.left_greedy is not None:
            out.append(f"  K={v.k}: the recording's committed sequence left its engine's own one-token decode at "
                       f"step {v.left_greedy} (its verify rows chose another token there)")
    batches = [] if report.decode is None else [batch_line(None, b) for b in report.decode.batch]
    out += batches + [batch_line(v.k, b) for v in report.verify for b in v.batch]
    if report.verify and report.verify[0].equivalence is None:
        out.append("  verify vs decode: not recorded (the golden stores no decode rows; format 7 records them)")
    return out + [f"  note: {note}" for note in report.notes] + [f"  - {reason}" for reason in report.reasons]


def next_lines(report: Report, declared: str | None = None, bundle: str | None = None) -> list[str]:
    """What to do about a FAIL, in lines for a terminal (`next_steps`; ``bundle``: the first-divergence bundle
    the command wrote); none on a PASS."""
    if report.verdict == "PASS":
        return []
    return ["next step:"] + [f"  - {plain_text(step)}" for step in next_steps(report, declared, bundle)]


def agreement_line(k: int, c: Comparison) -> str | None:
    """One line of a forward's verify rows in llama.cpp's terms, where rows differ."""
    a = c.summary["verify"].agreement
    if not a or not c.summary["verify"].rows_differ:
        return None
    return (f"  K={k} {c.variant} verify: KL mean {a.kl_mean:.3g}, median {a.kl_median:.3g}, p99 "
            f"{a.kl_p99:.3g}, max {a.kl_max:.3g}; same top-1 {100 * a.same_top1:.1f} %; Δp of the golden's "
            f"top token p1 {a.dp_p1:+.3g}, median {a.dp_p50:+.3g}, p99 {a.dp_p99:+.3g}")


def bundle_line(path: str) -> str:
    return f"first-divergence bundle: {path} (command.sh reproduces it)"


def diff_lines(d: DiffReport) -> list[str]:
    """A diff's lines: how A and B were made differently, per K each kind's rows that differ and fail, then the
    reasons."""
    out = [f"made differently: {m}" for m in d.made]
    for v in d.verify:
        out.append(f"{group(v.k)}: " + "; ".join(
            f"{_row_kind(v.k, n)} {s.rows_differ}/{s.rows} rows differ, {s.rows_failed} fail, max |Δ| "
            f"{_measure(s.max_abs)}" for n, s in v.comparison.summary.items()))
    return out + [f"  - {reason}" for reason in d.reasons]


def _row_kind(k: int, kind: str) -> str:
    """A kind of row as a diff names it: the decode group's rows are its one-token decodes, not verify rows."""
    return "decode" if k == DECODE_K and kind == "verify" else kind


def _measure(x: float) -> str:
    """A measure in words: unknown where it is NaN (a slim side's rows were not read)."""
    return "unknown" if x != x else f"{x:.4g}"


# -- a refresh's change summary ----------------------------------------------------------------------------


def row_changes(d: DiffReport) -> list[tuple[int, str, int, int, float, int, str]]:
    """Per K and kind of row: K, kind, rows that moved, of how many, the largest |Δ|, argmax flips, and the
    first steps that moved (verify steps, or the decode group's decode steps; the draft head's proposals by the
    step they precede)."""
    out = []
    for v in d.verify:
        c = v.comparison
        for kind, s in c.summary.items():
            steps = c.mismatched_step_list if kind == "verify" else \
                (c.draft_mismatched_step_list or ()) if kind == "draft" else ()
            shown = "" if not steps else ", ".join(map(str, steps[:12])) + (" ..." if len(steps) > 12 else "")
            out.append((v.k, kind, s.rows_differ, s.rows, s.max_abs, s.argmax_flips, shown))
    return out


def decision_lines(k: int, old: StepLog, new: StepLog) -> list[str]:
    """How K's decisions moved between two versions' step logs: accept counts, the tokens verified, the
    bootstrap token (none where nothing moved)."""
    out = []
    moved = [i for i, (x, y) in enumerate(zip(old.accepted.tolist(), new.accepted.tolist())) if x != y]
    if moved:
        out.append(f"{group(k)}: accept counts changed at steps {moved}: {old.accepted.tolist()} -> "
                   f"{new.accepted.tolist()}")
    tok = [i for i in range(len(old.tokens)) if old.tokens[i].tolist() != new.tokens[i].tolist()]
    if tok:
        out.append(f"{group(k)}: {len(tok)} step(s) verified other tokens, from step {tok[0]}")
    if old.bootstrap != new.bootstrap:
        out.append(f"{group(k)}: bootstrap token {old.bootstrap} -> {new.bootstrap}")
    return out


def rows_headline(rows: Sequence[tuple[int, str, int, int, float, int, str]]) -> list[str]:
    """One line for the rows that moved, if any: how many, of all the golden's rows (every K's and the decode
    group's: "2 of 342" reads as of the decode rows otherwise, a user test)."""
    moved = [r for r in rows if r[2]]
    if not moved:
        return []
    ks = sorted({r[0] for r in moved} - {DECODE_K})
    where = ([f"at K={ks}"] if ks else []) + (["in the decode rows"] if any(r[0] == DECODE_K for r in moved) else [])
    return [f"rows moved {' and '.join(where)}: {sum(r[2] for r in moved)} of the golden's {sum(r[3] for r in rows)} "
            f"rows, max |delta| {max(r[4] for r in moved):.4g}, {sum(r[5] for r in moved)} argmax flip(s)"]


def _k_cell(k: int) -> str:
    return "decode" if k == DECODE_K else str(k)


def _kind_cell(k: int, kind: str) -> str:
    """A kind of row as the change summary names it: the decode group's one row a step is a decode row."""
    return "decode" if k == DECODE_K and kind == "verify" else kind


def refresh_markdown(title: str, reason: str, changes: str) -> str:
    """A refresh's change summary for a pull request: its title and reason, then ``changes`` (`changes_markdown`)."""
    return f"## vd refresh: {title}\n\n**Reason:** {reason}\n\n{changes}"


def changes_markdown(lines: Sequence[str], rows: Sequence[tuple[int, str, int, int, float, int, str]],
                     decisions: Sequence[str]) -> str:
    """What a refresh changed, in Markdown: its headline lines, a table of the rows that moved per K and kind,
    and the decisions that changed."""
    md = [f"- {x}" for x in lines] or ["- nothing changed"]
    if rows:
        md += ["", "| K | rows | moved | of | max abs delta | argmax flips | steps that moved |",
               "|---|---|---|---|---|---|---|"]
        md += [f"| {_k_cell(k)} | {_kind_cell(k, kind)} | {n} | {of} | {mx:.4g} | {fl} | {steps} |"
               for k, kind, n, of, mx, fl, steps in rows]
    if decisions:
        md += ["", "**Decisions**", ""] + [f"- {x}" for x in decisions]
    return "\n".join(md) + "\n"


# -- JUnit --------------------------------------------------------------------------------------------------------


def junit_case(k: int, variant: str) -> str:
    return f"{group(k)} {variant}"


def junit_other_case(what: str, k: int | None) -> str:
    """A JUnit case for reasons no K × forward case holds: ``K=2 batch``, ``decode batch``, ``environment``."""
    return what if k is None else f"{group(k)} {what}"


def junit_checks_case(k: int) -> str:
    return f"K={k} golden checks (control, thin, coverage)"


def junit_message(reasons: Sequence[Reason]) -> tuple[str, str]:
    """A failing case's message (its first reason) and text (every reason, a line each)."""
    return str(reasons[0]), "\n".join(map(str, reasons))


def error_message(error: str | None) -> tuple[str, str]:
    """A golden that could not be replayed: the message (the error's first line) and its whole text."""
    text = error or "the replay did not complete"
    return (text.strip().splitlines()[0] if text.strip() else text), text


# -- the HTML page ------------------------------------------------------------------------------------------------


def facts(report: Report) -> list[tuple[str, str]]:
    """The golden, the model (and the SPEC that ran, where it is not the golden's) and the run's settings."""
    m, recorded = report.model, report.environment.recorded.get("time")
    pairs: list[tuple[str, Any]] = [
        ("golden", report.golden), ("recorded at", recorded), ("model", f"{m.name} ({m.spec})"),
        ("replayed with", m.replayed_with), ("replayed spec", report.replayed_spec),
        ("feed", f"{report.feed}{' (MTP draft head)' if report.mtp else ''}"), ("steps", report.steps),
        ("dtype", report.dtype), ("golden's forward", report.golden_forward),
        ("forwards replayed", ", ".join(v.name for v in report.variants)), ("graphs", report.graphs),
        ("rows", "slim golden" if report.rows.slim else "full golden"), ("batch", batch_text(report.batch)),
        ("notes", "; ".join(report.notes) or None)]
    return [(label, str(x)) for label, x in pairs if x is not None]


def batch_text(plan: Mapping[str, Any] | None) -> str | None:
    """A replay's batch plan (`Report.batch`) in words; None without ``--batch``."""
    if plan is None:
        return None
    others = plan["companion_prompt_tokens"]
    return (f"a batch of {plan['n']}, the golden's sequence at {slots_text(plan['slot'])}, companions from seed "
            f"{plan['seed']}"
            + (f" (prompts of {', '.join(map(str, others))} tokens)" if others else ""))


def reproduce_command(report: Report, args: dict, out: str) -> list[str]:
    """``vd replay`` of just the first failing K and forward, with the policy spelled out, writing ``out``;
    the golden, a plug-in's file and the other local paths absolute, so it runs from any directory."""
    rows = report.failure_rows
    assert rows is not None, "a replay that failed at a step"
    # the decode rows (K = 1) run before any K's: the smallest K replayed runs them too
    k = rows.k if rows.k != DECODE_K else min(v.k for v in report.verify)
    cmd = ["vd", "replay", _absolute(report.golden), "--k", str(k), "--forward", rows.forward]
    decoder = rows.decode_forward if rows.k == DECODE_K else _decoder_of(report, rows.forward)
    if decoder not in (None, report.golden_decode_forward or rows.forward):  # (not the default)
        cmd += ["--decode-forward", str(decoder)]
    if rows.batch is not None:
        cmd += ["--batch", str(rows.batch["n"]), *(["--slot", str(rows.batch["slot"])] if rows.batch["slot"]
                                                   is not None else []), "--batch-seed", str(rows.batch["seed"])]
    for flag, value in _as_replayed(report, args).items():
        if value is not None:
            cmd += [f"--{flag}", portable_spec(value) if flag == "model" else
                    _absolute(value) if flag in ("head", "rows") else value]
    ran, recorded = (e.get("tp") or 1 for e in (report.environment.replayed, report.environment.recorded))
    if ran != recorded:  # (a replay takes the golden's degree unless told: `vd.cli.ranks.recorded`)
        cmd += ["--tp", str(ran)]
    for kind, spec in report.policy.to_json().items():
        if kind != "draft" or report.mtp:  # (a reference golden has no draft rows for it to judge)
            cmd += ["--tolerance", f"{kind}={spec}"]
    if args.get("allow_model_mismatch"):
        cmd.append("--allow-model-mismatch")
    return [*cmd, "--report", out]


def _decoder_of(report: Report, forward: str) -> str:
    """The forward whose decode rows the replay measured ``forward``'s verify rows against: its own, or the one
    decode forward that ran (``--decode-forward``, or the golden's)."""
    ran = [] if report.decode is None else [j.comparison.variant for j in report.decode.comparisons]
    return forward if forward in ran or len(ran) != 1 else ran[0]


def _as_replayed(report: Report, args: dict) -> dict[str, str | None]:
    """The model, head, device, threads and full golden's rows a command replaying the failure passes: each as
    ``args`` gives it (the flags the replay was given), else as the report says it ran where that is not the
    golden's default from any folder: a model SPEC naming a file (stored relative to the golden's project, it
    was resolved from the folder the replay ran in), the head file that ran, another device or thread count."""
    m, ran, recorded = report.model, report.environment.replayed, report.environment.recorded
    model = args.get("model") or (m.ran if m.ran is not None and portable_spec(m.ran) != m.spec else None)
    head = args.get("head") or m.head_file  # (always: --model alone loads no head, a stored one may be relative)
    device = args.get("device") or (ran.get("device") if ran.get("device") != recorded.get("device") else None)
    threads = args.get("threads") or (ran.get("threads") if ran.get("threads") != recorded.get("threads") else None)
    return {"model": model, "head": head, "device": device, "threads": None if threads is None else str(threads),
            "rows": args.get("rows")}


def _absolute(path: str) -> str:
    """A local path made absolute; a URL as it is."""
    return path if "://" in path else os.path.abspath(path)


def portable_spec(spec: str) -> str:
    """A model SPEC with its local file made absolute (``path/engine.py:factory``, ``llamacpp:PATH``, a
    checkpoint folder or a .gguf file); a preset or ``package.module:factory`` as it is."""
    if spec.startswith("llamacpp:"):
        return "llamacpp:" + _absolute(spec.removeprefix("llamacpp:"))
    head, sep, factory = spec.rpartition(":")
    if sep and (head.endswith(".py") or os.sep in head) and os.path.exists(head):
        return f"{_absolute(head)}:{factory}"
    return _absolute(spec) if os.path.exists(spec) else spec


def next_steps(report: Report, declared: str | None, bundle: str | None = None) -> list[NextStep]:
    """What to do about the verdict: nothing on a PASS; on a FAIL how to look at the first divergence (in
    ``bundle``, the first-divergence bundle the command wrote, else the command that writes one) and how to
    accept the change, and what the golden's own failures or a changed environment call for. Every
    command works as written: ``declared`` is the golden's name in its suite's declaration, which `vd refresh`
    takes; a golden replayed by its path (``declared`` None) is refreshed by that path."""
    if report.verdict == "PASS":
        return [("nothing needed: every forward matches the golden under its policy, and the golden's own checks "
                 "passed.",)]
    out: list[NextStep] = []
    rows = report.failure_rows
    if rows is not None and report.reasons_of(_failing_as(rows)):
        where = failure_place(rows.first_failure, rows.k) if rows.first_failure else f"{rows.kind} step {rows.step}"
        fed = "decoded token" if rows.k == DECODE_K and rows.axis != "equivalence" else "verified tokens"
        tokens = "" if rows.tokens is None else f"; the step {fed} {rows.tokens}" + (
            "" if rows.text is None else f" ({rows.text!r})")
        both = ("the candidate's rows in ", Code("rows.npz"), " (the golden is slim: add ", Code("--rows FULL"),
                ", the full golden it was made from, for its rows too)") \
            if report.rows.slim and report.rows.source is None else ("both rows in ", Code("rows.npz"))
        forward = rows.forward if rows.k != DECODE_K else rows.decode_forward or rows.forward
        batch = "" if rows.batch is None else f" in a batch of {rows.batch['n']}"
        look = f"Look at the first divergence ({group(rows.k)}, {forward}{batch}, {where}{tokens})"
        if bundle is not None:
            out.append((f"{look} in its bundle ", Code(shlex.quote(bundle.rstrip('/') + '/')), " (", *both, ", ",
                        Code("failure.json"), "): ", Code(shlex.join(["sh", os.path.join(bundle, "command.sh")])),
                        " replays just that."))
        else:
            rows_from = report.rows.source if report.rows.slim else None  # (a full golden's source is itself)
            cmd = shlex.join(reproduce_command(report, {"model": report.replayed_spec, "rows": rows_from,
                                                        "allow_model_mismatch": report.model.mismatch_allowed},
                                               "replay.json"))
            out.append((f"{look}: ", Code(cmd), " replays just that and writes its first-divergence bundle to ",
                        Code("replay.json.bundle/"), " (", *both, ", ", Code("failure.json"), ", ",
                        Code("command.sh"), ")."))
    out += _axis_steps(report)
    if failing_forwards(report):
        out.append(_accept_step(report, declared))
    if report.reasons_of(("control", "thin", "coverage")):
        out.append(_own_checks_step(report))
    if report.reasons_of(("environment",)):
        out.append(("The environment differs from the recording's (above): replay on a machine like the recording's "
                    "to tell a change in the code from a change of machine.",))
    return out


def _own_checks_step(report: Report) -> NextStep:
    """What the golden's own failed checks call for, each as its reasons say: a blind control, a policy too loose;
    a thin golden, or accept counts more steps can reach, more steps; counts the reference feed never makes (its
    reason says so), other widths or the drafter feed."""
    parts: list[str | Code] = ["The golden's own checks failed (see the reasons)"]
    if report.reasons_of(("control",)):
        parts.append(": a blind control means the policy is too loose to see a changed draft")
    coverage = [r.text for r in report.reasons_of(("coverage",))]
    unreachable = any("more steps cannot reach it" in t for t in coverage)
    never = report.mtp and all(n == 0 for v in report.verify for n in v.accepted)
    if report.reasons_of(("thin",)) and never:  # more steps of a head that never drafts a token accept nothing
        parts += ["; " if len(parts) > 1 else ": ", "its draft head never drafted a token the model accepts (every "
                  "accept count 0), which more steps will not change: record it with a head trained for this model "
                  "(", Code("--head FILE"), ") or with the reference feed (", Code("--feed reference"), ")"]
    elif report.reasons_of(("thin",)) or (coverage and not unreachable):
        parts += ["; " if len(parts) > 1 else ": ", "a thin or uncovered golden needs recording again with more "
                  "steps (", Code(f"vd record {shlex.quote(report.golden)} --refresh --steps {2 * report.steps}"),
                  ")"]
    if unreachable:
        parts += ["; " if len(parts) > 1 else ": ", "accept counts the reference feed never makes need other widths "
                  "or the drafter feed (", Code(f"vd record {shlex.quote(report.golden)} --refresh --k 2,4"),
                  "), or a replay without ",
                  Code("--require-coverage"), ""]
    return (*parts, ".")


def failing_forwards(report: Report) -> set[str | None]:
    """The forwards whose rows failed (None: rows of no one forward); failing decode rows count as the forward
    that computed them (``--decode-forward``'s where one was named, whichever forward they were computed for),
    those of the golden's own decode forward (`vd record --decode-forward`) as the golden's forward."""
    # (the golden's own decode forward's rows: the golden's own, a refresh's)
    return _failing_rows(report) | {report.golden_forward if d == report.decoder else d
                                    for d in _failing_decoders(report)}


def _failing_rows(report: Report) -> set[str | None]:
    """The forwards whose own rows (verify, prefill, draft) failed against the golden's."""
    return {r.variant for r in report.reasons_of(("rows", "draft"))}


def _failing_decoders(report: Report) -> set[str]:
    """The forwards whose decode rows failed against the golden's."""
    return set() if report.decode is None else {j.comparison.variant for j in report.decode.comparisons if j.reasons}


def other_forward(report: Report) -> str | None:
    """Where only forwards other than the golden's failed, the first of them (by name): what a refresh, which
    records the golden's own forward again, would not take. None where the golden's own failed, or none did."""
    failing = failing_forwards(report)
    if not failing or report.golden_forward in failing or None in failing:
        return None
    own = _failing_rows(report) & failing  # (a forward's own rows before its decode rows)
    return sorted(f for f in (own or failing) if f is not None)[0]


def decoder_with(report: Report, forward: str) -> str | None:
    """Where ``forward`` (`other_forward`) is to become the golden's forward and another forward's decode rows
    failed too (``--decode-forward``, not the golden's decode forward), that forward: the golden's decode
    forward to record with it."""
    others = _failing_decoders(report) - {report.decoder, forward}
    return sorted(others)[0] if others else None


def other_decoder(report: Report) -> str | None:
    """Where only decode rows failed, computed with another forward than the golden's decode rows were (its
    ``--decode-forward``, else its forward), that forward: what accepting them records (a refresh would record
    the golden's own again). None otherwise."""
    if report.reasons_of(("rows", "draft", "batch")):
        return None
    failing = _failing_decoders(report)
    return sorted(failing)[0] if failing and report.decoder not in failing else None


def _accept_decoder(report: Report, declared: str | None, target: str, decoder: str) -> NextStep:
    """How to take ``decoder``'s decode rows as the golden's: a recording that computes them with it (the verify
    rows still the golden's forward's)."""
    spec = None if report.replayed_spec is None else portable_spec(report.replayed_spec)  # (its forward's model)
    if declared is not None:
        return (f"To compute the golden's decode rows with {decoder}, declare it (",
                Code(f'decode_forward = "{decoder}"'), *(() if spec is None else (" and ", Code(f'model = "{spec}"'))),
                f" in {declared}'s declaration) and refresh: ",
                Code(f"vd refresh {shlex.quote(declared)} --reason TEXT"), ".")
    model = [] if spec is None else ["--model", spec]
    return (f"To compute the golden's decode rows with {decoder} (its verify rows still {report.golden_forward}'s"
            f"{'' if spec is None else f', its model {spec}'}), record it so: ",
            Code(shlex.join(["vd", "record", target, "--refresh", *model, "--decode-forward", decoder])
                 + " --reason TEXT"), ".")


def _accept_slim(report: Report, forward: str | None) -> NextStep:
    """`_accept_step` for a slim golden: the full golden it was made from accepts the change (promoted or
    recorded), then is slimmed again."""
    own = forward is None
    full = shlex.quote(report.rows.source or "FULL")
    if own and report.replayed_spec is not None and _inconclusive(report):  # no candidate would be promoted
        plugin = portable_spec(str(report.replayed_spec))
        return ("If the change is intended, record the full golden this slim one was made from with it: ",
                Code(shlex.join(["vd", "record", report.rows.source or "FULL", "--refresh", "--model", plugin])
                     + " --reason TEXT"),
                ", then write its slim form again: ",
                Code(f"vd slim {full} {shlex.quote(report.golden)} --refresh"), f" ({_no_promotion(report)}).")
    if own and report.replayed_spec is not None:  # another model's rows: a refresh would record the golden's own
        how, saved = _promotion(report)
        return ("If the change is intended, take these rows into the full golden this slim one was made from: ",
                *how, Code(f"vd refresh {full} --from {shlex.quote(saved)} --reason TEXT"),
                ", then write its slim form again: ",
                Code(f"vd slim {full} {shlex.quote(report.golden)} --refresh"), ".")
    decoder = other_decoder(report)
    also = None if own else decoder_with(report, str(forward))
    record = f"vd record {full} --refresh --decode-forward {shlex.quote(decoder)} --reason TEXT" if decoder \
        else f"vd refresh {full} --reason TEXT" if own else \
        f"vd record {full} --refresh --forward {shlex.quote(str(forward))}" \
        + ("" if also is None else f" --decode-forward {shlex.quote(also)}") + " --reason TEXT"
    return ("If the change is intended, accept it in the full golden this slim one was made from: ", Code(record),
            ", then write its slim form again: ",
            Code(f"vd slim {full} {shlex.quote(report.golden)} --refresh"), ".")


def _accept_step(report: Report, declared: str | None) -> NextStep:
    """How to accept what failed: a refresh (it records the golden's own forward again); or, where only other
    forwards failed, a recording with the first of them, which a refresh would not make. A slim golden is not
    recorded over (`vd.workflow.refresh`): the full golden it was made from is, and then slimmed again."""
    forward = other_forward(report)
    own = forward is None
    if report.rows.slim:
        return _accept_slim(report, forward)
    target = declared if declared is not None else report.golden
    decoder = other_decoder(report)
    if decoder is not None:
        return _accept_decoder(report, declared, target, decoder)
    if own and report.replayed_spec is not None:
        return _accept_other_model(report, declared, target)
    if own and report.candidate is not None and not _inconclusive(report):
        return ("If the change is intended, accept it: ",
                Code(f"vd refresh {shlex.quote(target)} --from {shlex.quote(report.candidate)} --reason TEXT"),
                " promotes the candidate this replay saved, or ", Code(f"vd refresh {shlex.quote(target)} --reason "
                                                                        "TEXT"), " records the golden again.")
    if own:
        return ("If the change is intended, accept it: ", Code(f"vd refresh {shlex.quote(target)} --reason TEXT"),
                ", or record the golden again on the trusted build: ",
                Code(f"vd record {shlex.quote(report.golden)} --refresh --reason TEXT"), ".")
    spec = None if report.replayed_spec is None else portable_spec(report.replayed_spec)  # another model ran too
    also = decoder_with(report, str(forward))  # (and its decode rows another forward's)
    if declared is not None:  # the declaration says what a refresh records
        return (f"To make {forward} the golden's forward, declare it (", Code(f'forward = "{forward}"'),
                *(() if also is None else (" and ", Code(f'decode_forward = "{also}"'))),
                *(() if spec is None else (" and ", Code(f'model = "{spec}"'))),
                f" in {declared}'s declaration) and refresh: ",
                Code(f"vd refresh {shlex.quote(declared)} --reason TEXT"), ".")
    model = [] if spec is None else ["--model", spec]
    decode = [] if also is None else ["--decode-forward", also]
    its = "" if also is None else f" (its decode rows {also}'s)"
    return (f"To make {forward} the golden's forward{its}{'' if spec is None else f' and {spec} its model'}, record "
            "it with it: ",
            Code(shlex.join(["vd", "record", target, "--refresh", *model, "--forward", str(forward), *decode])
                 + " --reason TEXT"),
            f" (vd refresh records the golden's own, {report.golden_forward}"
            + ("" if spec is None else f" of {report.model.spec}") + ").")


def _accept_other_model(report: Report, declared: str | None, target: str) -> NextStep:
    """How to accept what another model SPEC than the golden's computed (a plug-in engine over the golden's
    model): its rows promoted as a candidate, the golden staying of its model; or that SPEC made the golden's
    model. A refresh alone records the golden's own model again, which would not take the change."""
    spec = portable_spec(str(report.replayed_spec))
    if _inconclusive(report):  # a promotion of these rows would be refused: only a recording vouches for them
        why = f"; {_no_promotion(report)}"
        if declared is not None:
            return (f"If the change is intended, make {spec} the golden's model: declare ", Code(f'model = "{spec}"'),
                    f" in {declared}'s declaration, then ", Code(f"vd refresh {shlex.quote(declared)} --reason TEXT"),
                    f" (a refresh records the declared model, {report.model.spec}, until then{why}).")
        return (f"If the change is intended, make {spec} the golden's model: ",
                Code(shlex.join(["vd", "record", target, "--refresh", "--model", spec]) + " --reason TEXT"),
                f" (vd refresh records the golden's own, {report.model.spec}{why}).")
    how, saved = _promotion(report)
    promote = ("If the change is intended, take these rows, the golden staying of its model: ", *how,
               Code(f"vd refresh {shlex.quote(target)} --from {shlex.quote(saved)} --reason TEXT"))
    if declared is not None:
        return (*promote, f"; or make {spec} the golden's model: declare ", Code(f'model = "{spec}"'),
                f" in {declared}'s declaration, then ", Code(f"vd refresh {shlex.quote(declared)} --reason TEXT"),
                f" (a refresh records the declared model, {report.model.spec}, until then).")
    return (*promote, f"; or make {spec} the golden's model: ",
            Code(shlex.join(["vd", "record", target, "--refresh", "--model", spec]) + " --reason TEXT"),
            f" (vd refresh records the golden's own, {report.model.spec}).")


def _failing_as(rows: FailureRows) -> tuple[str, ...]:
    """The reasons (by ``what``) a bundle's rows are the first failure of (`FailureRows.axis`; a golden's rows
    include its draft rows)."""
    return ("rows", "draft") if rows.axis == "rows" else (rows.axis,)


def _promotion(report: Report) -> tuple[NextStep, str]:
    """How to take this replay's rows as a candidate (the start of a step), and the path `vd refresh --from`
    takes: the candidate this replay saved (``--save-candidate``: it asked to save one again), else ``PATH``."""
    if report.candidate is not None:
        return ("promote the candidate this replay saved: ",), report.candidate
    return ("replay with ", Code("--save-candidate PATH"), ", then "), "PATH"


def _inconclusive(report: Report) -> list[int]:
    """The Ks whose detection control was inconclusive (the rows differ at its step already): a candidate saved
    from this replay would not be promoted (`vd.workflow.refresh.promote` refuses it)."""
    return [v.k for v in report.verify if v.control is not None and v.control.inconclusive]


def _no_promotion(report: Report) -> str:
    ks = ", ".join(map(str, _inconclusive(report)))
    return (f"these rows cannot be promoted as a candidate: the detection control at K={ks} was inconclusive, "
            "the rows differing at its step already, so a recording's own replay must vouch for them")


def _axis_steps(report: Report) -> list[NextStep]:
    """What a failing axis calls for: verify rows that are not decode's, rows that depend on the batch."""
    out: list[NextStep] = []
    if report.reasons_of(("equivalence",)):
        out.append(("The verify kernel does not compute what one-token decode computes for the same positions (see "
                    "the reasons): speculative output differs from plain greedy output wherever an argmax flips. The "
                    "report's verify[].equivalence names every differing row; ", Code("--decode-forward NAME"),
                    " measures against another forward's decode."))
    groups = ([report.decode] if report.decode else []) + list(report.verify)
    alone = {(v.k, j.comparison.variant) for v in groups for j in v.comparisons if j.comparison.passed}
    failing = [(v.k, b) for v in groups for b in v.batch
               if not b.comparison.passed and (v.k, b.forward) in alone]  # not where its rows differ alone too
    if failing and failing[0][1].n == 1:  # (the command it gave was the one just run)
        out.append(("A batch of one already differs from the golden's rows (see the reasons): the batched call "
                    "itself computes other rows, whoever shares the batch; a golden recorded in a batch ",
                    Code("vd show"), " names is replayed in it."))
    elif failing and failing[0][1].slot is not None:  # the replay held the slot already
        b = failing[0][1]
        out.append((f"The rows depend on what shares their batch (see the reasons), at the slot this replay held "
                    f"({b.slot}); ", Code("--batch 1"), " tells a batched kernel apart from the batch's composition; "
                    "a golden recorded in a batch ", Code("vd show"), " names is replayed in it."))
    elif failing:
        k, b = failing[0]
        first = b.first_difference
        slot = b.slot if first is None or b.n == 1 else first[1]
        model = [] if report.replayed_spec is None else ["--model", report.replayed_spec]
        where = ([] if slot is None else ["--slot", str(slot)]) + ([] if k == DECODE_K else ["--k", str(k)])
        ran = ["--forward", b.forward]
        if k == DECODE_K:  # (decode rows in a batch are the decode forward's: named where it is not the default)
            ran = [] if b.forward == report.decoder else ["--decode-forward", b.forward]
        cmd = ["vd", "replay", report.golden, *model, *ran, "--batch", str(b.n), "--batch-seed", str(b.seed), *where]
        out.append(("The rows depend on what shares their batch (see the reasons). Hold the golden's sequence at the "
                    "slot of the first difference: ", Code(shlex.join(cmd)), "; ", Code("--batch 1"), " tells a "
                    "batched kernel apart from the batch's composition; a golden recorded in a batch ", Code("vd show"),
                    " names is replayed in it."))
    return out


def forward_caption(c: Comparison) -> str:
    """What a forward's plot shows: where it fails, or that it is equal or passes."""
    failed = c.failed_step_list
    if failed:
        first = failure_place(c.first_failure) if c.first_failure else "a changed accept count"
        caption = (f"FAILS at step{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} ({len(failed)} of "
                   f"{c.steps}), marked in red; first failure: {first}")
    elif c.equal:
        caption = "equal to the golden bit for bit at every step"
    else:
        caption = f"passes its policy ({', '.join(sorted(set(c.policy.to_json().values())))}) where rows differ"
    if not c.measured:
        caption += ("; the golden is slim, so |Δ| is unknown where rows differ (name the full golden with --rows "
                    "to measure them)")
    return f"{c.variant}: {caption}"


def control_caption(control: Control) -> str:
    verdict = ("fired: it fails at that step, as it must" if control.fired
               else "inconclusive: the forward's own run fails at that step already, so the control shows nothing"
               if control.inconclusive
               else "BLIND: no failure at that step, so this policy cannot see such a change")
    return (f"detection control, drawn apart from the forwards on its own axes: the last draft of step "
            f"{control.changed_step} changed; {verdict}")


K_TABLE_COLUMNS = ("forward", "verdict", "rows differ", "rows fail", "argmax flips (allowed)", "max |Δ|", "max ULP",
                   "verify KL mean / median / p99 / max", "same top-1",
                   "Δp of the golden's top token p1 / median / p99", "first failure")


def k_table_row(c: Comparison) -> tuple[str, ...]:
    """A forward's figures at one K (`K_TABLE_COLUMNS`)."""
    kinds: list[KindSummary] = list(c.summary.values())
    first = "-" if c.first_failure is None else failure_place(c.first_failure)
    a = c.summary["verify"].agreement
    kl = " / ".join(f"{x:.3g}" for x in (a.kl_mean, a.kl_median, a.kl_p99, a.kl_max)) if a else "-"
    dp = " / ".join(f"{x:+.3g}" for x in (a.dp_p1, a.dp_p50, a.dp_p99)) if a else "-"
    same = f"{100 * a.same_top1:.1f} %" if a else "-"
    return (c.variant, "pass" if c.passed else "FAIL", str(sum(s.rows_differ for s in kinds)),
            str(sum(s.rows_failed for s in kinds)),
            f"{sum(s.argmax_flips for s in kinds)} ({sum(f.allowed for f in c.flips)})",
            _size(_largest(s.max_abs for s in kinds)), _size(_largest(s.max_ulp for s in kinds), ".0f"), kl, same, dp,
            first)


def _largest(xs) -> float:
    """The largest of sizes of difference, NaN (unknown) where any is (``max`` would depend on their order)."""
    xs = [float(x) for x in xs]
    return math.nan if any(math.isnan(x) for x in xs) else max(xs, default=0.0)


def coverage_text(v: KResult) -> str:
    """How many of the golden's steps accepted each number of drafts (``1 step accepted 0 drafts, 2 accepted 1,
    none accepted 2``), an uncovered count said so."""
    def steps(n: int) -> str:
        return "no step" if n == 0 else f"{n} step{'s' if n != 1 else ''}"

    parts = [f"{steps(n)} accepted {i} draft{'s' if i != 1 else ''}" for i, n in enumerate(v.histogram)]
    return f"coverage over {len(v.accepted)} steps: " + ", ".join(parts)


def positions_note(share: Sequence[float], measured: bool = True) -> str | None:
    """What the plot of where differing elements sit says in words at its extremes (``share``: per vocabulary
    bin, the share of elements that differ): none differ, or every one does; None between. A slim golden's
    rows were not at hand (``measured`` False): where elements differ is unknown."""
    if not measured:
        return "unknown: the golden is slim (name its full golden with --rows)"
    if not any(share):
        return "no element differs from the golden"
    if all(x >= 1.0 for x in share):
        return "every element of every row differs"
    return None


def left_greedy_text(v: KResult) -> str | None:
    if v.left_greedy is None:
        return None
    return (f"the recording's committed sequence left its engine's own one-token decode at step {v.left_greedy}: "
            "its verify rows chose another token there")


def first_reason(report: Report | None, error: str | None) -> str:
    """A suite page's one line for a golden: its first reason, or its error's first line."""
    if report is None:
        lines = (error or "").strip().splitlines()
    else:
        lines = [str(r) for r in report.reasons[:1]]
    return lines[0] if lines else ""



# -- suites ------------------------------------------------------------------------------------------------------


def outcome_lines(name: str, verdict: str, path: str, seconds: float, details: Sequence[str],
                  bullet: str = "") -> list[str]:
    """A suite golden's line (``bullet``: how its details are marked) and its details, one a line."""
    width = 9 if not bullet else 6
    return [f"{name:<24} {verdict:<{width}} {path}  ({seconds:.1f} s)"] + [f"    {bullet}{x}" for x in details]


def suite_total(verdict: str, verdicts: Sequence[str], loads: int, shard: str | None = None,
                selected: int = 0) -> str:
    """A suite replay's last line: its verdict, how many goldens passed, failed or errored, model loads. A shard
    that holds none of the ``selected`` goldens (more shards than goldens: a CI matrix may grow ahead of its
    suite) passes, saying so."""
    if not verdicts:
        return f"{verdict}: shard {shard} holds none of the {selected} golden(s) selected; nothing replayed"
    counts = {v: sum(x == v for x in verdicts) for v in ("PASS", "FAIL", "ERROR")}
    return (f"{verdict}: " + ", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" of {len(verdicts)} "
            f"golden(s); {loads} model load(s)")


def record_summary(reason: str | None, outcomes: Sequence[tuple[str, str, Sequence[str], str]]) -> str:
    """A suite recording's Markdown summary: per golden its verdict and what it says (``(name, verdict, lines,
    changes)`` each: a refreshed golden's ``changes``, `changes_markdown`, in place of its lines, so it has the
    table of rows that moved that `vd refresh --summary` writes), after the reason."""
    text = "\n".join(f"## {name}: {verdict}\n\n" + (changes or "".join(f"- {x}\n" for x in lines or [""]))
                     for name, verdict, lines, changes in outcomes)
    return f"**Reason:** {reason}\n\n{text}" if reason else text
