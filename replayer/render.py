"""What a replay leaves behind besides its JSON: a first-divergence bundle, JUnit XML and an HTML page.

* `write_bundle`: the golden's and the candidate's rows of the first failing step (``rows.npz``, storage
  encoding: bf16 as uint16 bits), both environments, the failure (with the step's tokens decoded where
  the model could), and ``command.sh``: the exact command that replays only that K and forward, which
  fails the same way.
* `write_junit`, `write_suite_junit`: per golden one ``<testsuite>`` named ``vd.NAME``, a test case per
  K × forward (its reasons as the failure) plus one per K for the golden's own checks (detection
  control, thin reference, coverage), each of class ``vd.NAME.K2``, so several goldens stay apart in a
  CI dashboard; a suite file holds one ``<testsuite>`` per golden.
* `write_html`, `write_suite_html`: one self-contained page (inline SVG drawn by matplotlib, no scripts,
  nothing fetched): the command, time and vd version, then per golden the verdict and its reasons, the
  environment's differences, the next step, the policy and its sensitivity, and per K each forward's
  largest difference per step on axes of its own with failing steps marked, the detection control on
  its own axes, the golden's accept counts and where in the vocabulary the differing elements sit.

matplotlib is imported only when a page is drawn, so the command line starts without it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import html
import io
import math
import re
import shlex
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from vd import __version__
from vd.outputs import BUNDLE_FILES, is_bundle, json_text, write_bytes, write_text
from vd.replayer import words
from vd.replayer.comparison import Comparison, plain
from vd.replayer.report import Control, Judged, KResult, Reason, Report, golden_name
from vd.store.format import DECODE_K

# One golden of a suite: its name, and its report or the error that kept it from being replayed.
Entry = tuple[str, Report | None, str | None]

# -- bundle --------------------------------------------------------------------------------------------


def clear_bundle(directory: Path) -> None:
    """Remove what an earlier replay's bundle left in ``directory`` (`is_bundle`; nothing where there is none): its
    files, and the report and bundle its command.sh wrote there when run; then the folder, once empty (other files
    in it stay). A replay clears its bundle's place before it writes one, so that a bundle is one replay's and a
    passing replay leaves none beside its report; a user's files of a bundle file's name, in a folder no bundle
    was written to, stay."""
    if not is_bundle(directory):
        return
    for name in (*(n for n in BUNDLE_FILES if n != "failure.json"), "failure.json"):  # its mark last
        path = directory / name
        if path.is_symlink() or path.is_file():
            path.unlink()
    inner = directory / "replay.json.bundle"
    if inner.is_dir() and not inner.is_symlink():
        clear_bundle(inner)
    with contextlib.suppress(OSError):  # not there, or holding files of the user's
        directory.rmdir()


def write_bundle(directory: Path, report: Report, args: Mapping, environ: Mapping[str, str] | None = None) -> Path:
    """Write the first-divergence bundle of ``report`` (which has `Report.failure_rows`) into ``directory``
    (created); return the command file's path. ``environ``: environment variables the replay read, which
    ``command.sh`` sets again (an engine switched by a variable fails the same way)."""
    rows = report.failure_rows
    assert rows is not None, "a replay that failed at a step"
    directory.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {"candidate": rows.candidate,
                                     "tokens": np.asarray(rows.tokens or [], dtype=np.int64)}
    if rows.golden is not None:  # a slim golden replayed without its rows has none to give
        arrays["golden"] = rows.golden
    npz = io.BytesIO()
    np.savez(npz, **arrays)  # type: ignore[arg-type]  # numpy's stub types the first kwarg
    failure = {"k": rows.k, "forward": rows.forward, "kind": rows.kind, "step": rows.step, "tokens": rows.tokens,
               "first_failure": plain(rows.first_failure) or {"kind": rows.kind, "step": rows.step},
               "dtype": report.dtype,
               "storage": "bfloat16 rows as uint16 bit patterns" if report.dtype == "bfloat16" else report.dtype,
               "policy": report.policy.to_json(), "golden": report.golden, "verdict": report.verdict,
               "reasons": [r.text for r in report.reasons]}
    if rows.text is not None:
        failure["text"] = rows.text
    if rows.decode_forward is not None:  # k 1: the golden's decode rows
        failure["decode_forward"] = rows.decode_forward
    if rows.batch is not None:
        failure["batch"] = dict(rows.batch)
    write_text(directory / "failure.json", json_text(failure))  # first: what marks the folder as a bundle
    write_bytes(directory / "rows.npz", npz.getvalue())
    write_text(directory / "environment.json", json_text(plain(report.environment)))
    cmd = words.reproduce_command(report, dict(args), "replay.json")
    assert cmd[0] == "vd" and cmd[-2:] == ["--report", "replay.json"], "a vd command writing replay.json"
    exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in sorted((environ or {}).items()))
    python = shlex.quote(sys.executable)
    path = directory / "command.sh"
    write_text(path, "#!/bin/sh\n# Replays the first failing K and forward; exits 1 as the original replay did. It "
                     "runs from any directory\n# (writing replay.json beside it), with the environment variables the "
                     "replay read (secrets left out),\n# by the vd on PATH, else the Python that wrote this bundle "
                     "(where it is there), else python3. The paths it prints\n# work from where it was run.\n"
                     + exports + 'here=$(dirname "$0")\n'
                     f"if command -v vd >/dev/null 2>&1; then set -- vd\nelif [ -x {python} ]; then set -- {python} "
                     "-m vd\nelse set -- python3 -m vd\nfi\n"
                     + '"$@" ' + " ".join(shlex.quote(c) for c in cmd[1:-1]) + ' "$here/replay.json"\n', mode=0o755)
    return path


# -- JUnit -----------------------------------------------------------------------------------------------


def write_junit(path: Path, report: Report, name: str | None = None) -> None:
    """JUnit XML of one replay: a ``<testsuite>`` named ``vd.NAME`` (``name`` defaults to the golden's
    `golden_name`), its cases of class ``vd.NAME.K2`` and so on (see `junit_suite`)."""
    suite = junit_suite(report, name or golden_name(report.golden))
    _write_xml(path, suite)


def write_error_junit(path: Path, name: str, error: str) -> None:
    """JUnit XML of a replay that ended before a verdict: one test case with an ``<error>``."""
    _write_xml(path, _junit_error(name, error))


def write_suite_junit(path: Path, entries: Sequence[Entry]) -> None:
    """JUnit XML of several goldens, ``(name, report, error)`` each: one ``<testsuite>`` per golden in one
    ``<testsuites>``; a golden whose replay errored is one test case with an ``<error>``."""
    root = ET.Element("testsuites", name="vd replay")
    for name, report, error in entries:
        root.append(junit_suite(report, name) if report is not None else _junit_error(name, error))
    for key in ("tests", "failures", "errors"):
        root.set(key, str(sum(int(s.get(key, 0)) for s in root)))
    _write_xml(path, root)


def _write_xml(path: Path, root: ET.Element) -> None:
    write_bytes(path, ET.tostring(root, encoding="utf-8", xml_declaration=True))


def junit_suite(report: Report, name: str) -> ET.Element:
    """One golden's ``<testsuite>``: its properties (golden, verdict, model, the SPEC that ran, the
    environment's numerics differences, vd), a test case per K × forward and per K one for the golden's
    own checks (control, thin, coverage)."""
    suite = ET.Element("testsuite", name=f"vd.{name}", time=f"{report.seconds:.3f}")
    props = ET.SubElement(suite, "properties")
    env_diff = "; ".join(report.environment.numerics_differences) or None
    for key, value in (("golden", report.golden), ("verdict", report.verdict), ("model", report.model.spec),
                       ("replayed_with", report.model.replayed_with), ("replayed_spec", report.replayed_spec),
                       ("environment_differences", env_diff), ("vd", __version__)):
        if value is not None:
            ET.SubElement(props, "property", name=key, value=str(value))
    placed: list[Reason] = []
    for v in ([report.decode] if report.decode is not None else []) + list(report.verify):
        classname = _classname(name, v.k)
        for j in v.comparisons:
            ms = sum(sum(t.step_ms) for t in v.timings if t.variant == j.comparison.variant)
            _junit_case(suite, words.junit_case(v.k, j.comparison.variant), classname, ms / 1e3, list(j.reasons))
            placed += j.reasons
        if v.k != DECODE_K:
            checks = report.reasons_of(("control", "thin", "coverage"), v.k)
            _junit_case(suite, words.junit_checks_case(v.k), classname, 0.0, checks)
            placed += checks
    # every other reason (a batch's rows, the environment, ...) fails a case of its own: none is left out
    left: dict[tuple[str, int | None], list[Reason]] = {}
    for r in report.reasons:
        if not any(r is p for p in placed):
            left.setdefault((r.what, r.k), []).append(r)
    for (what, k), reasons in left.items():
        _junit_case(suite, words.junit_other_case(what, k), _classname(name, k), 0.0, reasons)
    _tally(suite)
    return suite


def _classname(name: str, k: int | None) -> str:
    """A JUnit case's class: ``vd.NAME.K2``, ``vd.NAME.decode``, or ``vd.NAME`` for no K."""
    return f"vd.{name}" + ("" if k is None else f".{words.group(k).replace('=', '')}")


def _junit_case(suite: ET.Element, name: str, classname: str, seconds: float, reasons: list) -> None:
    case = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{seconds:.3f}")
    if reasons:
        message, text = words.junit_message(reasons)
        ET.SubElement(case, "failure", message=message).text = text


def _junit_error(name: str, error: str | None) -> ET.Element:
    suite = ET.Element("testsuite", name=f"vd.{name}", time="0.000")
    case = ET.SubElement(suite, "testcase", classname=f"vd.{name}", name="replay", time="0.000")
    message, text = words.error_message(error)
    ET.SubElement(case, "error", message=message).text = text
    _tally(suite)
    return suite


def _tally(suite: ET.Element) -> None:
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(sum(c.find("failure") is not None for c in cases)))
    suite.set("errors", str(sum(c.find("error") is not None for c in cases)))


# -- HTML: plots -----------------------------------------------------------------------------------------

_RED, _GREEN, _GREY = "#d62728", "#2ca02c", "#555555"
_COLORS = ["#1f77b4", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"]
_SVG_IDS = re.compile(r'(?<= id=")|(?<=href="#)|(?<=url\(#)')  # where an SVG id or a reference to one starts
_STYLE = {"font.size": 8, "axes.titlesize": 9, "axes.spines.top": False, "axes.spines.right": False,
          "svg.fonttype": "none"}  # text stays text: searchable, and a fraction of the bytes


class _Plots:
    """Draws one page's figures as inline SVG, under vd's style while open (a context manager). Figures sit
    on the Agg canvas and never touch pyplot, so no GUI backend or global state is involved. Every id inside
    a figure's SVG is prefixed with the figure's own id, so a page's SVGs share none, and ids are hashed
    with a fixed salt, so the same report draws the same bytes."""

    def __enter__(self) -> _Plots:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self._rc, self._figure, self._canvas = matplotlib.rc_context, Figure, FigureCanvasAgg
        self._style = self._rc({**_STYLE, "svg.hashsalt": "vd"})  # type: ignore[dict-item]  # rc keys as str
        self._style.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._style.__exit__(*exc)

    def new(self, ncols: int = 1, width: float = 6.0):
        """A figure and its axes (one row of ``ncols``), with fixed margins: a layout engine would measure
        every label of every figure and take most of a page's drawing time."""
        fig = self._figure(figsize=(width, 2.5))
        self._canvas(fig)
        fig.subplots_adjust(left=0.65 / width, right=0.98, bottom=0.17, top=0.89, wspace=0.25)
        return fig, fig.subplots(1, ncols)

    def svg(self, fig, fid: str) -> str:
        """The figure as an ``<svg>`` element to inline (no XML prologue), its ids and the references to
        them prefixed with ``fid-``."""
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        text = buf.getvalue()
        return _SVG_IDS.sub(f"{fid}-", text[text.index("<svg"):])


def _step_plot(plots: _Plots, fid: str, title: str, c: Comparison, color: str, marked: str,
               changed: int | None = None) -> tuple[str, float]:
    """One forward's largest |Δ logit| per verify step on a linear axis of its own, the steps in
    ``c.failed_step_list`` marked in red (labelled ``marked``); the SVG and the axis' top."""
    fig, ax = plots.new()
    per = {p.step: p for p in c.per_step}
    steps = sorted(per)
    ys = [per[s].max_abs for s in steps]
    ax.plot(steps, ys, marker="o", ms=3, lw=1.5, color=color, label="verify rows")
    drafts = [d for s in steps if (d := per[s].draft_max_abs) is not None]
    if drafts:  # a drafter golden: the head's draft rows too
        ax.plot(steps, drafts, marker="s", ms=3, lw=1, ls="--", color=color, alpha=0.6, label="draft rows")
    failed = set(c.failed_step_list)
    bad = [s for s in steps if s in failed]
    for s in bad:
        ax.axvspan(s - 0.4, s + 0.4, color=_RED, alpha=0.12, lw=0)
    if bad:  # on the value where it is known, else on the axis: a failure is shown whatever its size
        ax.plot(bad, [y if math.isfinite(y) else 0.0 for y in (per[s].max_abs for s in bad)], ls="none",
                marker="o", ms=9, mfc="none", mec=_RED, mew=2, gid="failing", label=marked)
    if changed is not None:
        ax.axvline(changed, ls=":", lw=1.5, color="black", label=f"draft changed (step {changed})")
    top = max((y for y in ys + drafts if math.isfinite(y)), default=0.0)
    top = top * 1.15 if top > 0 else 1.0
    ax.set_ylim(0.0, top)
    ax.set_xlim(-0.5, max(len(steps) - 0.5, 0.5))
    ax.set_xticks(steps[::max(1, len(steps) // 16)])
    ax.set(title=title, xlabel="verify step", ylabel="largest |Δ logit| (linear scale)")
    if len(ax.get_lines()) > 1:
        ax.legend(loc="best", fontsize=7, frameon=False)
    return plots.svg(fig, fid), top


def _golden_plot(plots: _Plots, fid: str, v: KResult) -> str:
    """The golden's accept counts per step beside where the forwards' differing elements sit."""
    fig, (left, right) = plots.new(ncols=2, width=9.0)
    left.bar(range(len(v.accepted)), v.accepted, color=_GREEN)
    left.set(title=f"K={v.k}: drafts accepted per step (golden)", xlabel="verify step", ylabel="drafts accepted",
             ylim=(0, max(v.k - 1, 1) + 0.3), yticks=range(v.k))
    share, vocab = _differing_share(v)
    right.stairs(100 * share, np.linspace(0, vocab, len(share) + 1), fill=True, color=_RED)
    right.set(title=f"K={v.k}: where the differing elements sit (every forward)", xlabel="vocabulary index",
              ylabel="elements that differ, % (linear scale)", xlim=(0, max(vocab, 1)), ylim=(0, 105))
    note = words.positions_note(share.tolist(), all(j.comparison.measured for j in v.comparisons))
    if note is not None:  # no element differs, or every one does: said, not left to an empty or solid box
        right.text(0.5, 0.5, note, transform=right.transAxes, ha="center", va="center", fontsize=9,
                   bbox={"facecolor": "white", "edgecolor": _GREY})
    return plots.svg(fig, fid)


def _differing_share(v: KResult) -> tuple[np.ndarray, int]:
    """Per vocabulary bin, the share of the elements compared (every row of every forward at this K) that
    differ from the golden's, and the vocabulary's size."""
    positions = [j.comparison.positions for j in v.comparisons]
    if not positions:
        return np.zeros(0), 0
    bins, vocab = positions[0].bins, positions[0].vocab
    rows = sum(s.rows for j in v.comparisons for s in j.comparison.summary.values())
    width = np.bincount(np.arange(vocab) * bins // vocab, minlength=bins)  # indices per bin, as measured
    counts = np.sum([p.counts for p in positions], axis=0)
    return counts / np.maximum(rows * width, 1), vocab


# -- HTML: the page --------------------------------------------------------------------------------------

_CSS = ("body{font-family:sans-serif;margin:24px;max-width:1250px}.PASS{color:#2a2}.FAIL,.ERROR{color:#c22}"
        "table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;"
        "text-align:left;vertical-align:top}.plots{display:flex;flex-wrap:wrap;gap:12px}"
        "figure{margin:0;border:1px solid #ddd;padding:4px}figure.failing{border-color:#c22}"
        "figcaption{font-size:13px;max-width:600px}"
        ".next{background:#f6f6f6;padding:6px 12px;border-left:4px solid #888}"
        "pre{white-space:pre-wrap}svg{display:block}")


def write_html(path: Path, report: Report, command: str | Sequence[str] | None = None, bundle: str | None = None,
               declared: str | None = None) -> None:
    """One offline page for one replay: the header (``command``, the replay's time, vd's version) and the
    golden's section (see the module's docstring); ``bundle``: the first-divergence bundle the replay wrote, which
    its next step names; ``declared``: the golden's name in its declaration, which the next step uses."""
    name = golden_name(report.golden)
    replayed = report.environment.replayed.get("time")
    with _Plots() as plots:
        body = [f"<h1>vd replay: <span class='{report.verdict}'>{report.verdict}</span></h1>",
                _header(command, "replayed at", replayed or _now()), _section(plots, name, report, declared, bundle)]
    _write_page(path, f"vd replay {name}: {report.verdict}", body)


def write_error_html(path: Path, name: str, error: str, command: str | Sequence[str] | None = None) -> None:
    """One offline page for a replay that ended before a verdict: the header and the error."""
    body = ["<h1>vd replay: <span class='ERROR'>ERROR</span></h1>", _header(command, "written at", _now()),
            _error_section(name, error)]
    _write_page(path, f"vd replay {name}: ERROR", body)


def write_suite_html(path: Path, entries: Sequence[Entry], command: str | Sequence[str] | None = None,
                     bundles: Mapping[str, str] | None = None) -> None:
    """One offline page for several goldens, ``(name, report, error)`` each: the header, a table of their
    verdicts, then a section per golden (`write_html`'s), or its error where its replay did not complete;
    ``bundles``: the first-divergence bundles written, by golden."""
    verdict = "PASS" if all(r is not None and r.verdict == "PASS" for _, r, _ in entries) else "FAIL"
    rows = []
    for name, report, error in entries:
        what = report.verdict if report is not None else "ERROR"
        rows.append(f"<tr><td><a href='#golden-{_slug(name)}'>{html.escape(name)}</a></td>"
                    f"<td class='{what}'>{what}</td><td>{html.escape(words.first_reason(report, error))}</td></tr>")
    with _Plots() as plots:
        body = [f"<h1>vd replay: {len(entries)} goldens, <span class='{verdict}'>{verdict}</span></h1>",
                _header(command, "written at", _now()),
                "<table><tr><th>golden</th><th>verdict</th><th>first reason</th></tr>" + "".join(rows) + "</table>"]
        body += [_section(plots, name, report, name, (bundles or {}).get(name)) if report is not None
                 else _error_section(name, error) for name, report, error in entries]
    _write_page(path, f"vd replay: {len(entries)} goldens, {verdict}", body)


def _write_page(path: Path, title: str, body: list[str]) -> None:
    write_text(path, _page(title, body))


def _page(title: str, body: list[str]) -> str:
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]+", "-", text).strip("-") or "x"


def _header(command: str | Sequence[str] | None, label: str, when: str) -> str:
    """What ran, when (``label``: what the time is of), under which vd."""
    cmd = "(not given)" if command is None else command if isinstance(command, str) else shlex.join(command)
    return ("<table class='header'>" f"<tr><th>command</th><td><code>{html.escape(cmd)}</code></td></tr>"
            f"<tr><th>{label}</th><td>{html.escape(when)}</td></tr>"
            f"<tr><th>vd version</th><td>{html.escape(__version__)}</td></tr></table>")


def _error_section(name: str, error: str | None) -> str:
    return (f"<section id='golden-{_slug(name)}'><h2>{html.escape(name)}: <span class='ERROR'>ERROR</span></h2>"
            f"<p>The replay did not complete:</p><pre>{html.escape(error or 'no error text')}</pre></section>")


def _section(plots: _Plots, name: str, report: Report, declared: str | None, bundle: str | None = None) -> str:
    """One golden's verdict, facts, reasons, environment differences, next step, policy and plots per K;
    ``declared``: the golden's name in its suite's declaration (None for a golden replayed by its path);
    ``bundle``: its first-divergence bundle, where one was written."""
    e, v = html.escape, report.verdict
    out = [f"<section id='golden-{_slug(name)}'><h2>{e(name)}: <span class='{v}'>{v}</span></h2>", _facts(report)]
    if report.reasons:
        out.append("<h3>Reasons</h3><ul>" + "".join(f"<li>{e(str(r))}</li>" for r in report.reasons) + "</ul>")
    diffs = report.environment.numerics_differences
    out.append("<div class='env'><b>Environment differences</b> (recorded → replayed): "
               + ("none" if not diffs else "<ul>" + "".join(f"<li>{e(d)}</li>" for d in diffs) + "</ul>") + "</div>")
    out.append(_next_step(report, declared, bundle))
    out.append("<h3>Policy</h3><table><tr><th>rows</th><th>policy</th><th>smallest change it is guaranteed to "
               "catch</th></tr>" + "".join(f"<tr><td>{e(kind)}</td><td>{e(s.policy)}</td><td>{e(s.catches)}"
                                           "</td></tr>" for kind, s in report.sensitivity.items()) + "</table>")
    if report.decode is not None:
        out.append("<h3>Decode rows</h3>" + _axes_table(report.decode))
    out += [_k_block(plots, f"{_slug(name)}-k{k.k}", k) for k in report.verify]
    out += [locate_section(plots, f"{_slug(name)}-{_slug(r.forwards[0])}", r) for r in report.located]
    out.append("</section>")
    return "\n".join(out)


def _facts(report: Report) -> str:
    """The golden, the model and the run's settings (`vd.replayer.words.facts`), as a table."""
    return "<table>" + "".join(f"<tr><th>{k}</th><td>{html.escape(x)}</td></tr>" for k, x in words.facts(report)) \
        + "</table>"


def _next_step(report: Report, declared: str | None, bundle: str | None) -> str:
    """What to do about the verdict (`vd.replayer.words.next_steps`): a paragraph on a PASS, a list on a FAIL,
    each command as code."""
    steps = [_html_step(step) for step in words.next_steps(report, declared, bundle)]
    if report.verdict == "PASS":
        return f"<p class='next'><b>Next step:</b> {steps[0]}</p>"
    return "<div class='next'><b>Next step</b><ul>" + "".join(f"<li>{i}</li>" for i in steps) + "</ul></div>"


def _html_step(step: words.NextStep) -> str:
    return "".join(f"<code>{html.escape(p.text)}</code>" if isinstance(p, words.Code) else html.escape(p)
                   for p in step)


def _emphasize(text: str, word: str) -> str:
    """``text`` escaped, its first ``word`` in bold red (a failing state: FAILS, BLIND)."""
    return html.escape(text).replace(word, f"<b class='FAIL'>{word}</b>", 1)


def _k_block(plots: _Plots, kid: str, v: KResult) -> str:
    """One K: each forward's plot, the control's, the golden's accepts and positions, and the table."""
    out = [f"<h3>K = {v.k}</h3><div class='plots'>"]
    for i, j in enumerate(v.comparisons):
        out.append(_forward_figure(plots, f"{kid}-{_slug(j.comparison.variant)}", v.k, j, _COLORS[i % len(_COLORS)]))
    if v.control is not None:
        out.append(_control_figure(plots, f"{kid}-control", v.k, v.control))
    out.append(f"<figure id='{kid}-golden'>{_golden_plot(plots, f'{kid}-golden', v)}</figure></div>")
    out.append(_k_table(v))
    out.append(_axes_table(v))
    out.append(f"<p>{html.escape(words.coverage_text(v))}</p>")
    left = words.left_greedy_text(v)
    if left is not None:
        out.append(f"<p>{html.escape(left)}</p>")
    return "\n".join(out)


def _figure(fid: str, svg: str, top: float, caption: str, failing: bool, kind: str) -> str:
    cls = f"{kind} failing" if failing else kind
    return (f"<figure id='{fid}' class='{cls}' data-ymax='{top:.6g}'>{svg}"
            f"<figcaption>{caption}</figcaption></figure>")


def _forward_figure(plots: _Plots, fid: str, k: int, j: Judged, color: str) -> str:
    c = j.comparison
    svg, top = _step_plot(plots, fid, f"K={k} {c.variant}: largest |Δ logit| per step", c, color, "fails the policy")
    failing = bool(c.failed_step_list)
    return _figure(fid, svg, top, _emphasize(words.forward_caption(c), "FAILS"), failing, "forward")


def _control_figure(plots: _Plots, fid: str, k: int, control: Control) -> str:
    c, at = control.comparison, control.changed_step
    svg, top = _step_plot(plots, fid, f"K={k} detection control ({c.variant})", c, _GREY, "fails the policy",
                          changed=at)
    return _figure(fid, svg, top, _emphasize(words.control_caption(control), "BLIND"),
                   not control.fired and not control.inconclusive, "control")


def _axes_table(v: KResult) -> str:
    """K's table of axes (`vd.replayer.report.KResult.axes`): one row per forward and axis."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in words.AXES_COLUMNS[1:])
    rows = ["<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row[1:]) + "</tr>"
            for row in words.axes_table_rows(v)]
    return f"<table class='axes'><tr>{head}</tr>" + "".join(rows) + "</table>"


def _k_table(v: KResult) -> str:
    """Each forward's figures at one K (`vd.replayer.words.k_table_row`)."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in words.K_TABLE_COLUMNS)
    rows = ["<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in words.k_table_row(j.comparison)) + "</tr>"
            for j in v.comparisons]
    return f"<table><tr>{head}</tr>" + "".join(rows) + "</table>"


# -- locate ------------------------------------------------------------------------------------------


def locate_page(report, command: str | Sequence[str] | None = None) -> str:
    """``vd locate``'s page (a `vd.replayer.locate.LocateReport`): per K where the difference starts, the path
    through the layers and the plot of every compared point's difference."""
    name = golden_name(report.golden)
    with _Plots() as plots:
        body = [f"<h1>vd locate: {html.escape(name)}</h1>", _header(command, "written at", _now()),
                locate_section(plots, _slug(name), report)]
    return _page(f"vd locate {name}", body)


def locate_section(plots: _Plots, fid: str, report) -> str:
    """The located differences of one golden (``vd locate``, ``vd replay --locate``) as HTML."""
    e = html.escape
    out = [f"<h3>Where the difference starts: {e(report.forwards[0])} against {e(report.against)}</h3>"]
    for x in report.ks:
        out.append(_located_block(plots, f"{fid}-loc-k{x.k}", x, len(report.forwards) == 2))
    out += [f"<p>note: {e(note)}</p>" for note in report.notes]
    return "\n".join(out)


def _located_block(plots: _Plots, fid: str, x, between: bool) -> str:
    e = html.escape
    if not x.found or x.first is None:
        text = "every row bit-identical" if not x.found else (x.note or "no traced module's output differs")
        return f"<p><b>{words.group(x.k)}</b>: {e(text)}</p>"
    f = x.first
    head = (f"<p><b>{words.group(x.k)} {e(x.module_call)}</b>: first difference at <code>{e(f.name)}</code> "
            f"({e(f.what)}); {e(words.before_words(x.identical_before))}"
            + ("" if x.reproduces is not False else " (warning: the traced pass did not reproduce the rows)") + "</p>")
    rows = "".join(f"<tr><td>{'' if m.layer is None else m.layer}</td><td><code>{e(m.name)}</code></td>"
                   f"<td>{e(m.what)}</td><td>{_size(m):.4g}</td></tr>" for m in x.path)
    label = "max |Δ|" if between else "|Δ max |x||"
    table = f"<table><tr><th>layer</th><th>first differing point</th><th>what</th><th>{label}</th></tr>{rows}</table>"
    return head + _locate_plot(plots, fid, x, label) + table


def _size(m) -> float:
    """A located module's size of difference: max |Δ| between forwards, else the change of its max |x|."""
    if m.max_abs is not None:
        return m.max_abs
    return abs(m.absmax[1] - m.absmax[0]) if m.absmax is not None else 0.0


def _locate_plot(plots: _Plots, fid: str, x, label: str) -> str:
    """Every compared point's difference in execution order (a point per traced output; layers shaded in turn),
    the first differing one marked."""
    fig, ax = plots.new(width=9.0)
    sizes = [v for *_, v in x.profile]
    layers = [lay for _, _, lay, _ in x.profile]
    ax.plot(range(len(sizes)), sizes, lw=1, marker=".", ms=3, color=_COLORS[0], label=label)
    start = None
    for i, lay in enumerate(layers + [None]):
        if start is not None and (lay != layers[start]):
            if layers[start] is not None and layers[start] % 2:
                ax.axvspan(start - 0.5, i - 0.5, color=_GREY, alpha=0.15, lw=0)
            start = None
        if start is None and lay is not None:
            start = i
    at = next((i for i, (n, w, _, _) in enumerate(x.profile) if (n, w) == (x.first.name, x.first.what)), None)
    if at is not None:
        ax.plot([at], [sizes[at]], ls="none", marker="o", ms=9, mfc="none", mec=_RED, mew=2, gid="first",
                label=f"first: {x.first.name}")
    ax.set(title=f"{words.group(x.k)} {x.module_call}: difference by traced point (layers shaded in turn)",
           xlabel="traced point, in the order the forward computes them", ylabel=f"{label} (linear scale)")
    ax.legend(loc="best", fontsize=7, frameon=False)
    return _figure(fid, plots.svg(fig, fid), max(sizes, default=0.0), f"{words.group(x.k)}: {label} per traced point",
                   True, "locate")
