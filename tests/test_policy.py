"""Comparison policies at their boundaries, decisions checked inside a tolerance, coverage, sensitivity,
`vd diff`, the first-divergence bundle, and the JUnit and HTML reports."""

import json
import math
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from vd.compare import compare_run, measure
from vd.errors import UsageError
from vd.golden import open_golden, rewrite_summaries
from vd.loop import Run
from vd.policy import parse_policy, parse_spec

PLUGINS = Path(__file__).parent / "plugins"
V = 64


def _golden_row() -> torch.Tensor:
    """A bf16 row with a clear top-3 (4.0, 3.0, 2.0 at 10, 20, 30) over small values."""
    row = torch.linspace(-1, 1, V, dtype=torch.float32).to(torch.bfloat16)
    row[10], row[20], row[30] = 4.0, 3.0, 2.0
    return row


def _judge(spec: str, cand: torch.Tensor, gold: torch.Tensor | None = None) -> bool:
    gold = _golden_row() if gold is None else gold
    r = measure(gold.view(torch.int16)[None], cand[None], "bfloat16", parse_spec(spec))
    return bool(r.passed[0])


def _ulps(x: torch.Tensor, i: int, n: int) -> torch.Tensor:
    """``x`` with element ``i`` moved up by ``n`` bf16 ULPs."""
    y = x.clone()
    y.view(torch.int16)[i] += n
    return y


def test_exact_boundary():
    assert _judge("exact", _golden_row())
    assert not _judge("exact", _ulps(_golden_row(), 5, 1))


@pytest.mark.parametrize("n", [1, 3])
def test_ulp_boundary(n):
    assert _judge(f"ulp:{n}", _ulps(_golden_row(), 5, n))
    assert not _judge(f"ulp:{n}", _ulps(_golden_row(), 5, n + 1))


def test_ulp_counts_across_zero_and_signed_zero_as_zero():
    gold = _golden_row()
    gold[3] = 0.0
    neg = gold.clone()
    neg[3] = -0.0
    assert _judge("ulp:0", neg, gold) and not _judge("exact", neg, gold)


def test_atol_rtol_is_one_combined_bound():
    """An element passes when |got - golden| <= atol + rtol * |golden| (torch.testing's rule): at the 4.0
    logit with atol 0.25 and rtol 0.0625 the bound is 0.5."""
    inside, outside = _golden_row(), _golden_row()
    inside[10] = 4.5  # |Δ| 0.5, on the bound (kept below the 3.0 runner-up: no decision change)
    outside[10] = 4.5625  # |Δ| 0.5625
    assert _judge("atol:0.25,rtol:0.0625", inside)
    assert not _judge("atol:0.25,rtol:0.0625", outside)
    # Either bound alone would not do: outside atol and outside rtol * |golden| separately.
    assert not _judge("atol:0.25,rtol:0", inside) and not _judge("atol:0,rtol:0.0625", inside)


def test_argmax_and_topk_boundaries():
    far = _golden_row()
    far[0] = 2.5  # a big change below the top: argmax and top-1 still the same
    assert _judge("argmax", far) and _judge("topk:1", far)
    assert not _judge("topk:3", far)  # 2.5 displaces 2.0 from the top 3
    reordered = _golden_row()
    reordered[20], reordered[30] = 2.0, 3.0  # ranks 2 and 3 swap: the same top-3 set
    assert _judge("topk:3", reordered) and _judge("argmax", reordered)
    swapped = _golden_row()
    swapped[10], swapped[20] = 3.0, 4.0
    assert not _judge("argmax", swapped) and not _judge("topk:1", swapped)


def test_kl_boundary():
    gold, cand = _golden_row(), _golden_row()
    cand[10] = 4.25
    p, q = torch.log_softmax(gold.float(), 0), torch.log_softmax(cand.float(), 0)
    kl = float((p.exp() * (p - q)).sum())
    assert _judge(f"kl:{kl * 1.001}", cand)
    assert not _judge(f"kl:{kl * 0.999}", cand)


def test_bad_tolerances_are_usage_errors():
    for bad in ("ulp", "ulp:-1", "atol:1", "atol:x,rtol:1", "kl:-1", "topk:0", "fuzzy", "weights=exact"):
        with pytest.raises(UsageError):
            parse_policy([bad])
    assert parse_policy(["ulp:2", "draft=exact"]) == {"prefill": "ulp:2", "verify": "ulp:2", "draft": "exact"}


def _run_of(rows: torch.Tensor, accepted: list[int]) -> Run:
    return Run(k=rows.shape[1], prefill=rows[0, :1].clone(), rows=list(rows), computed=accepted)


def test_a_flipped_decision_fails_inside_tolerance_and_names_the_margin():
    from vd.golden import KRecord, to_storage

    gold = torch.stack([torch.stack([_golden_row(), _golden_row()])] * 2)  # 2 steps x K=2
    gold[1, 0, 20] = 4.0 - 1 / 64  # step 1 row 0: runner-up one bf16 ULP below the top
    rec = KRecord(k=2, bootstrap=0, tokens=np.array([[1, 10], [2, 10]], dtype=np.int32),
                  accepted=np.array([1, 1], dtype=np.int32), prefill=to_storage(gold[0, :1]),
                  logits=to_storage(gold), step_ms=np.zeros(2))
    cand = gold.clone()
    cand[1, 0, 20] = 4.0 + 1 / 32  # now above: the argmax flips, |Δ| 0.047
    c = compare_run("x", rec, _run_of(cand, [1, 0]), "bfloat16", policy=parse_policy(["atol:0.1,rtol:0"]))
    assert c.summary["verify"]["rows_failed"] == 0  # inside the tolerance ...
    assert not c.passed and c.failed_step_list == [1]  # ... and still a failure
    (f,) = c.flips
    assert (f.step, f.row, f.golden_argmax, f.got_argmax) == (1, 0, 10, 20)
    # 1/64 is one step below 4.0 in bf16, half a ULP of 4.0 itself (the top-1 value the margin is counted in)
    assert f.margin == pytest.approx(1 / 64) and f.margin_ulps == pytest.approx(0.5) and f.near_tie
    assert c.accept_changes == [{"step": 1, "golden": 1, "got": 0}]
    ok = compare_run("x", rec, _run_of(gold.clone(), [1, 1]), "bfloat16", policy=parse_policy(["atol:0.1,rtol:0"]))
    assert ok.passed and not ok.flips


def test_replay_with_tolerance_passes_what_exact_fails(cli, tiny_golden, tmp_path):
    """The perturb plug-in moves one element by one ULP at step 3: exact fails, ulp:1 passes, and the
    control still fires under ulp:1 (a changed draft moves rows by far more than one ULP)."""
    spec = f"{PLUGINS / 'perturb.py'}:factory"
    code, out, err = cli("replay", tiny_golden, "--model", spec, "--report", tmp_path / "exact.json")
    assert code == 1
    code, out, err = cli("replay", tiny_golden, "--model", spec, "--tolerance", "verify=ulp:1",
                         "--report", tmp_path / "ulp.json")
    r = json.loads((tmp_path / "ulp.json").read_text())
    assert code == 0, r["reasons"]
    assert r["policy"] == {"prefill": "exact", "verify": "ulp:1", "draft": "exact"}
    assert all(v["detection_control"]["fired"] for v in r["verify"])
    c = r["verify"][0]["comparisons"][0]
    assert c["mismatched_step_list"] == [3] and c["passed"] and c["summary"]["verify"]["max_ulp"] == 1
    assert c["rows"] == [{"kind": "verify", "step": 3, "row": 1, "passed": True, "n_diff": 1, "first_index": 7,
                          "max_abs": c["rows"][0]["max_abs"], "max_ulp": 1.0, "kl": c["rows"][0]["kl"],
                          "argmax_agree": True}]
    assert 0 < c["rows"][0]["max_abs"] < 0.1 and c["per_step"][3]["n_diff"] == 1 and c["per_step"][2]["n_diff"] == 0
    assert "1 ULP" in r["sensitivity"]["prefill"]["catches"] and "2 ULP" not in r["sensitivity"]["verify"]["catches"]
    # A policy too loose to see the control's changed draft is blind, and the replay fails for it.
    code, out, err = cli("replay", tiny_golden, "--tolerance", "kl:1000", "--report", tmp_path / "loose.json")
    r = json.loads((tmp_path / "loose.json").read_text())
    blind = [v for v in r["verify"] if not v["detection_control"]["fired"]]
    assert (code == 1) == bool(blind)
    assert all(any("detection control saw no difference" in x for x in r["reasons"]) for _ in blind)


def test_record_stores_the_policy_and_show_prints_it(cli, tmp_path):
    path = tmp_path / "p.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama", "--steps", "8", "--tolerance", "verify=ulp:4",
                         "--tolerance", "prefill=atol:0.01,rtol:0.01")
    assert code == 0, err
    assert open_golden(path).meta["policy"] == {"prefill": "atol:0.01,rtol:0.01", "verify": "ulp:4", "draft": "exact"}
    code, out, err = cli("show", path)
    assert "policy    prefill atol:0.01,rtol:0.01, verify ulp:4, draft exact" in out
    code, out, err = cli("record", tmp_path / "q.zarr", "--model", "tiny-llama", "--tolerance", "bogus")
    assert code == 2 and "unknown tolerance" in err and not (tmp_path / "q.zarr").exists()


def test_coverage_table_and_require_coverage(cli, tiny_golden, tmp_path):
    code, out, err = cli("replay", tiny_golden, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 0
    cov = {v["k"]: v["coverage"] for v in r["verify"]}
    assert cov[3]["accepted_counts"] == [0, 4, 4] and cov[3]["missing"] == [0]  # K=3 never rejected everything
    code, out, err = cli("replay", tiny_golden, "--require-coverage", "--report", tmp_path / "c.json")
    r = json.loads((tmp_path / "c.json").read_text())
    assert code == 1 and r["reasons"] == ["coverage K=3: no step accepted 0 draft(s) (steps per accept count 0..2: "
                                          "[0, 4, 4])"]
    code, out, err = cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--steps", "8", "--require-coverage")
    assert code == 1 and "coverage K=3" in err and not (tmp_path / "g.zarr").exists()
    assert "--allow-thin" not in err  # it would not help: coverage is never waived
    code, out, err = cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--steps", "8", "--require-coverage",
                         "--allow-thin")
    assert code == 1 and "coverage K=3" in err and not (tmp_path / "g.zarr").exists()


def _edit_one_row(path: Path, k: int, step: int, row: int, index: int, value: float) -> None:
    arr = zarr.open_array(zarr.storage.LocalStore(path / f"k{k}" / "logits"), mode="r+")
    chunk = np.asarray(arr[step])
    chunk[row, index] = (np.float32(value).view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits
    arr[step] = chunk
    rewrite_summaries(path, k)  # as a recording whose model computed that value


def test_diff_two_goldens(cli, tiny_golden, tmp_path):
    other = tmp_path / "other.zarr"
    shutil.copytree(tiny_golden, other)
    code, out, err = cli("diff", tiny_golden, other)
    assert code == 0 and "PASS" in out
    g = open_golden(tiny_golden).runs[3].logits[5, 2, 100]
    gold = float((g.astype(np.uint32) << 16).view(np.float32))
    _edit_one_row(other, 3, 5, 2, 100, gold + 0.0625)
    code, out, err = cli("diff", tiny_golden, other, "--report", tmp_path / "d.json")
    r = json.loads((tmp_path / "d.json").read_text())
    assert code == 1 and len(r["reasons"]) == 1 and "K=3" in r["reasons"][0]
    c = next(v for v in r["verify"] if v["k"] == 3)["comparison"]
    assert c["first_failure"]["step"] == 5 and c["first_failure"]["row"] == 2 and c["first_failure"]["index"] == 100
    assert c["summary"]["verify"]["rows_failed"] == 1
    code, out, err = cli("diff", tiny_golden, other, "--tolerance", "atol:0.0625,rtol:0")
    assert code == 0, out
    code, out, err = cli("diff", tiny_golden, other, "--tolerance", "atol:0.06,rtol:0")
    assert code == 1
    code, out, err = cli("diff", tiny_golden, PLUGINS.parent / "data" / "tiny-llama-mtp-v2.zarr")
    assert code == 2 and "not recordings of the same thing" in err


def test_bundle_command_reproduces_the_failure(cli, tiny_golden, tmp_path):
    spec = f"{PLUGINS / 'perturb.py'}:factory"
    report = tmp_path / "r.json"
    code, out, err = cli("replay", tiny_golden, "--model", spec, "--report", report, "--junit", tmp_path / "j.xml",
                         "--html", tmp_path / "r.html")
    assert code == 1
    r = json.loads(report.read_text())
    bundle = Path(r["bundle"])
    assert bundle == tmp_path / "r.json.bundle"
    failure = json.loads((bundle / "failure.json").read_text())
    assert failure["k"] == 2 and failure["step"] == 3 and failure["kind"] == "verify"
    rows = np.load(bundle / "rows.npz")
    assert rows["golden"].shape == rows["candidate"].shape == (2, 512)
    assert (rows["golden"] != rows["candidate"]).sum() == 1  # the one ULP the plug-in moved
    assert json.loads((bundle / "environment.json").read_text())["recorded"]["device"] == "cpu"
    done = subprocess.run(["sh", str(bundle / "command.sh")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    again = json.loads((bundle / "replay.json").read_text())
    assert [v["k"] for v in again["verify"]] == [2]
    assert again["verify"][0]["comparisons"][0]["first_failure"] == r["verify"][0]["comparisons"][0]["first_failure"]
    # JUnit: one case per K x forward and one per K for the golden's checks; the perturbed ones fail.
    suite = ET.parse(tmp_path / "j.xml").getroot()
    cases = suite.findall("testcase")
    assert len(cases) == 6 and suite.get("failures") == "3"
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    assert failed == ["K=2 eager", "K=3 eager", "K=4 eager"]


def test_html_report_renders_in_headless_chromium(cli, tiny_golden, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is needed (tools/setup.sh installs it)"
    page = tmp_path / "r.html"
    code, out, err = cli("replay", tiny_golden, "--forward", "eager", "--forward", "sdpa", "--html", page)
    assert code == 1 and page.stat().st_size > 2000
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert "vd replay:" in dom and "FAIL" in dom
    assert dom.count("<svg") == 9 and dom.count("<path") >= 9 and "K = 4" in dom  # 3 plots for each K
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                   capture_output=True, timeout=120)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a blank page is a few kB


def test_sensitivity_names_figures_for_each_policy():
    from vd.policy import sensitivity

    stats = {"max_abs": 8.0, "min_margin": 0.5, "median_top1_p": 0.5}
    assert "1 ULP" in sensitivity("exact", "bfloat16", stats)
    assert "0.125" in sensitivity("ulp:2", "bfloat16", stats)  # 2 ULP at 8.0 in bf16 (ULP 1/16)
    assert "0.1 near zero, 0.9 at" in sensitivity("atol:0.1,rtol:0.1", "bfloat16", stats)
    assert "not seen" in sensitivity("argmax", "bfloat16", stats)
    assert f"{math.sqrt(2 * 0.01 / 0.25):.3g}" in sensitivity("kl:0.01", "bfloat16", stats)
