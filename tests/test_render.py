"""What a replay leaves besides its JSON: the first-divergence bundle and its command, JUnit XML, and an
offline HTML page rendered in a real headless browser."""

import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

PLUGINS = Path(__file__).parent / "plugins"


def test_bundle_command_reproduces_the_failure(cli, tiny_golden, tmp_path):
    spec = f"{PLUGINS / 'perturb.py'}:factory"
    report = tmp_path / "r.json"
    code, out, err = cli("replay", tiny_golden, "--model", spec, "--report", report, "--junit", tmp_path / "j.xml",
                         "--html", tmp_path / "r.html")
    assert code == 1
    r = json.loads(report.read_text())
    bundle = Path(r["bundle"])
    assert bundle == tmp_path / "r.json.bundle" and r["report_version"] == 1
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


def test_junit_files_the_golden_checks_under_their_own_case(cli, tmp_path):
    """A thin reference fails the K's golden-checks case, not its forward's."""
    path = tmp_path / "thin.zarr"
    assert cli("record", path, "--model", "tiny-llama", "--steps", "1", "--k", "3", "--allow-thin")[0] == 0
    code, out, err = cli("replay", path, "--junit", tmp_path / "j.xml")
    assert code == 1
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "j.xml").getroot().findall("testcase")}
    assert cases["K=3 eager"].find("failure") is None
    assert "full and partial accepts" in cases["K=3 golden checks (control, thin, coverage)"].find("failure").get(
        "message")


def test_a_slim_golden_bundle_has_the_candidate_rows_only(cli, tiny_golden, tmp_path):
    code, out, err = cli("slim", tiny_golden, tmp_path / "s.zarr")
    assert code == 0 and "% of" in out and "--rows" in out, out
    code, out, err = cli("replay", tmp_path / "s.zarr", "--model", f"{PLUGINS / 'perturb.py'}:factory",
                         "--report", tmp_path / "r.json")
    assert code == 1
    rows = np.load(tmp_path / "r.json.bundle" / "rows.npz")
    assert "golden" not in rows and rows["candidate"].shape == (2, 512)


def test_html_report_renders_in_headless_chromium(cli, tiny_golden, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (tools/setup.sh installs it where it can)")
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
