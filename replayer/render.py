"""What a replay leaves behind besides its JSON: a first-divergence bundle, JUnit XML and an HTML page.

* `write_bundle`: the golden's and the candidate's rows of the first failing step (``rows.npz``, storage
  encoding: bf16 as uint16 bits), both environments, the failure, and ``command.sh``: the exact command
  that replays only that K and forward, which fails the same way.
* `write_junit`: one test case per K × forward (its reasons as the failure), plus one per K for the
  golden's own checks (detection control, thin reference, coverage).
* `write_html`: one self-contained page (inline SVG, no scripts, nothing fetched) with the verdict, the
  policy and its sensitivity, and per K the largest difference per step for each forward, the accept
  counts, and where in the vocabulary the differing elements sit.
"""

from __future__ import annotations

import html
import json
import math
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from vd.replayer.report import Report

# -- bundle --------------------------------------------------------------------------------------------


def reproduce_command(report: Report, args: Mapping, out: Path) -> list[str]:
    """``vd replay`` of just the first failing K and forward, with the policy spelled out, writing ``out``."""
    rows = report.failure_rows
    golden = report.golden if "://" in report.golden else str(Path(report.golden).resolve())
    cmd = ["vd", "replay", golden, "--k", str(rows.k), "--forward", rows.forward]
    for flag in ("model", "head", "device", "threads", "rows"):
        if args.get(flag) is not None:
            cmd += [f"--{flag}", str(args[flag])]
    for kind, spec in report.policy.to_json().items():
        cmd += ["--tolerance", f"{kind}={spec}"]
    if args.get("allow_model_mismatch"):
        cmd.append("--allow-model-mismatch")
    return [*cmd, "--report", str(out)]


def write_bundle(directory: Path, report: Report, args: Mapping) -> Path:
    """Write the first-divergence bundle of ``report`` (which has `Report.failure_rows`) into ``directory``
    (created); return the command file's path."""
    rows = report.failure_rows
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {"candidate": rows.candidate, "tokens": np.asarray(rows.tokens or [], dtype=np.int64)}
    if rows.golden is not None:  # a slim golden replayed without its rows has none to give
        arrays["golden"] = rows.golden
    np.savez(directory / "rows.npz", **arrays)
    failure = {"k": rows.k, "forward": rows.forward, "kind": rows.kind, "step": rows.step, "tokens": rows.tokens,
               "first_failure": rows.first_failure, "dtype": report.dtype,
               "storage": "bfloat16 rows as uint16 bit patterns" if report.dtype == "bfloat16" else report.dtype,
               "policy": report.policy.to_json(), "golden": report.golden, "verdict": report.verdict,
               "reasons": [r.text for r in report.reasons]}
    (directory / "failure.json").write_text(json.dumps(failure, indent=2, default=str) + "\n")
    (directory / "environment.json").write_text(json.dumps(report.environment, indent=2, default=str) + "\n")
    cmd = reproduce_command(report, args, directory / "replay.json")
    path = directory / "command.sh"
    path.write_text("#!/bin/sh\n# Replays the first failing K and forward; exits 1 as the original replay did.\n"
                    + " ".join(shlex.quote(c) for c in cmd) + "\n")
    path.chmod(0o755)
    return path


# -- JUnit -----------------------------------------------------------------------------------------------


def write_junit(path: Path, report: Report) -> None:
    """JUnit XML: a test case per K × forward, and per K one for the golden's control, thinness, coverage."""
    suite = ET.Element("testsuite", name=f"vd replay {report.golden}")
    cases = failures = 0

    def case(name: str, classname: str, seconds: float, reasons: list) -> None:
        nonlocal cases, failures
        c = ET.SubElement(suite, "testcase", classname=classname, name=name, time=f"{seconds:.3f}")
        cases += 1
        if reasons:
            failures += 1
            ET.SubElement(c, "failure", message=str(reasons[0])).text = "\n".join(map(str, reasons))

    for v in report.verify:
        for j in v.comparisons:
            ms = sum(sum(t.step_ms) for t in v.timings if t.variant == j.comparison.variant)
            case(f"K={v.k} {j.comparison.variant}", f"vd.K{v.k}", ms / 1e3, list(j.reasons))
        case(f"K={v.k} golden checks (control, thin, coverage)", f"vd.K{v.k}", 0.0,
             report.reasons_of(("control", "thin", "coverage"), v.k))
    suite.set("tests", str(cases))
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


# -- HTML ------------------------------------------------------------------------------------------------

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def _svg(width: int, height: int, body: str, title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img"><title>{html.escape(title)}</title>'
            f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff" stroke="#ccc"/>{body}</svg>')


def _line_chart(series: Mapping[str, Sequence[float]], title: str, ylabel: str) -> str:
    """Per-step values per forward on a log10(1 + x) scale (zero stays at the axis)."""
    w, h, left, r, t, b = 560, 220, 56, 150, 24, 32
    n = max((len(s) for s in series.values()), default=0)
    vals = [math.log10(1 + x) if math.isfinite(x) else None for s in series.values() for x in s]
    top = max([x for x in vals if x is not None] + [math.log10(2)])
    parts = [f'<text x="{left}" y="16" font-size="12">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{h - b}" x2="{w - r}" y2="{h - b}" stroke="#000"/>',
             f'<line x1="{left}" y1="{t}" x2="{left}" y2="{h - b}" stroke="#000"/>',
             f'<text x="4" y="{t + 10}" font-size="10">{10 ** top - 1:.3g}</text>',
             f'<text x="4" y="{h - b}" font-size="10">0</text>',
             f'<text x="{left}" y="{h - 8}" font-size="10">step 0 .. {max(n - 1, 0)} ({html.escape(ylabel)})</text>']

    def xy(i, y):
        x = left + (w - left - r) * (i / max(n - 1, 1))
        return x, h - b - (h - b - t) * (y / top)

    for j, (name, s) in enumerate(series.items()):
        color = _COLORS[j % len(_COLORS)]
        pts = [xy(i, math.log10(1 + x) if math.isfinite(x) else top) for i, x in enumerate(s)]
        if pts:
            d = " ".join(f"{'M' if i == 0 else 'L'}{x:.1f},{y:.1f}" for i, (x, y) in enumerate(pts))
            parts.append(f'<path d="{d}" fill="none" stroke="{color}" stroke-width="2"/>')
            parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in pts]
        parts.append(f'<rect x="{w - r + 10}" y="{t + 16 * j}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{w - r + 24}" y="{t + 16 * j + 9}" font-size="11">{html.escape(name)}</text>')
    return _svg(w, h, "".join(parts), title)


def _bar_chart(values: Sequence[float], title: str, xlabel: str, color: str = "#1f77b4") -> str:
    w, h, left, t, b = 560, 160, 40, 24, 30
    top = max(list(values) + [1])
    bw = (w - left - 10) / max(len(values), 1)
    parts = [f'<text x="{left}" y="16" font-size="12">{html.escape(title)}</text>',
             f'<line x1="{left}" y1="{h - b}" x2="{w - 10}" y2="{h - b}" stroke="#000"/>',
             f'<text x="4" y="{t + 10}" font-size="10">{top:g}</text>',
             f'<text x="{left}" y="{h - 8}" font-size="10">{html.escape(xlabel)}</text>']
    for i, val in enumerate(values):
        bh = (h - b - t) * (val / top)
        parts.append(f'<rect x="{left + i * bw + 1:.1f}" y="{h - b - bh:.1f}" width="{max(bw - 2, 1):.1f}" '
                     f'height="{bh:.1f}" fill="{color}"><title>{i}: {val:g}</title></rect>')
    return _svg(w, h, "".join(parts), title)


def write_html(path: Path, typed: Report) -> None:
    """One offline page: verdict, reasons, policy and sensitivity, and per K the plots and a table."""
    report = typed.to_json()
    e = html.escape
    verdict = report["verdict"]
    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'>",
           f"<title>vd replay {e(report['golden'])}: {verdict}</title>",
           "<style>body{font-family:sans-serif;margin:24px;max-width:1200px}h1 span.PASS{color:#2a2}"
           "h1 span.FAIL{color:#c22}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 6px;"
           "font-size:13px}.plots{display:flex;flex-wrap:wrap;gap:12px}</style></head><body>",
           f"<h1>vd replay: <span class='{verdict}'>{verdict}</span></h1>",
           f"<p>golden <code>{e(report['golden'])}</code>; model {e(report['model']['name'])}; feed "
           f"{e(report['feed'])}; {report['steps']} steps; dtype {e(report['dtype'])}; "
           f"graphs {e(report['graphs'])}</p>"]
    if report["reasons"]:
        out.append("<h2>Reasons</h2><ul>" + "".join(f"<li>{e(r)}</li>" for r in report["reasons"]) + "</ul>")
    out.append("<h2>Policy</h2><table><tr><th>rows</th><th>policy</th><th>smallest change it is guaranteed to "
               "catch</th></tr>")
    for kind, s in report["sensitivity"].items():
        out.append(f"<tr><td>{e(kind)}</td><td>{e(s['policy'])}</td><td>{e(s['catches'])}</td></tr>")
    out.append("</table>")
    for v in report["verify"]:
        k = v["k"]
        out.append(f"<h2>K = {k}</h2><div class='plots'>")
        series = {c["variant"]: [p["max_abs"] for p in c["per_step"]] for c in v["comparisons"]}
        if v.get("detection_control"):
            dc = v["detection_control"]
            series[dc["variant"]] = [p["max_abs"] for p in dc["per_step"]]
        out.append(_line_chart(series, f"K={k}: largest |Δ logit| per step", "log scale"))
        out.append(_bar_chart(v["accepted"], f"K={k}: drafts accepted per step (golden)", "step", "#2ca02c"))
        counts = [0] * len(v["comparisons"][0]["positions"]["counts"]) if v["comparisons"] else []
        for c in v["comparisons"]:
            counts = [a + b for a, b in zip(counts, c["positions"]["counts"])]
        vocab = v["comparisons"][0]["positions"]["vocab"] if v["comparisons"] else 0
        out.append(_bar_chart(counts, f"K={k}: where the differing elements sit (vocabulary index, "
                              f"{len(counts)} bins over {vocab})", "vocabulary index →", "#d62728"))
        out.append("</div><table><tr><th>forward</th><th>verdict</th><th>rows differ</th><th>rows fail</th>"
                   "<th>argmax flips</th><th>max |Δ|</th><th>max ULP</th><th>max KL</th><th>first failure</th></tr>")
        for c in v["comparisons"]:
            sm = c["summary"]
            tot = {key: sum(s[key] for s in sm.values()) for key in ("rows_differ", "rows_failed", "argmax_flips")}
            mx = {key: max(s[key] for s in sm.values()) for key in ("max_abs", "max_ulp", "max_kl")}
            ff = c["first_failure"]
            where = "" if ff is None or ff["step"] is None else f" step {ff['step']}"
            first = "-" if ff is None else f"{ff['kind']}{where} row {ff['row']} index {ff['index']}"
            out.append(f"<tr><td>{e(c['variant'])}</td><td>{'pass' if c['passed'] else 'FAIL'}</td>"
                       f"<td>{tot['rows_differ']}</td><td>{tot['rows_failed']}</td><td>{tot['argmax_flips']}</td>"
                       f"<td>{mx['max_abs']:.4g}</td><td>{mx['max_ulp']:.0f}</td><td>{mx['max_kl']:.3g}</td>"
                       f"<td>{e(first)}</td></tr>")
        out.append("</table>")
        out.append(f"<p>coverage (steps accepting 0..{k - 1} drafts): {v['coverage']['accepted_counts']}</p>")
    out.append("</body></html>")
    Path(path).write_text("\n".join(out) + "\n", encoding="utf-8")
