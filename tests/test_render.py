"""What a replay leaves besides its JSON: the first-divergence bundle and its command, JUnit XML (one
golden and a suite), and offline HTML pages, read as text and rendered in a real headless browser."""

import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

import vd
from vd.replayer import ReplaySettings, render, replay

PLUGINS = Path(__file__).parent / "plugins"
PERTURB = f"{PLUGINS / 'perturb.py'}:factory"  # one ULP off in one element at step 3 of every K


@pytest.fixture(scope="module")
def perturbed(tiny_golden):
    """The session golden replayed through the one-ULP plug-in: FAIL at step 3 of each K."""
    return replay(tiny_golden, ReplaySettings(model=PERTURB))


@pytest.fixture(scope="module")
def passing(tiny_golden):
    return replay(tiny_golden)


def _figure(page: str, fid: str) -> str:
    """The ``<figure>`` element with id ``fid`` (figures do not nest)."""
    found = re.findall(rf"<figure id='{re.escape(fid)}'.*?</figure>", page, flags=re.S)
    assert len(found) == 1, f"{len(found)} figures with id {fid}"
    return found[0]


def _ymax(figure: str) -> float:
    return float(re.search(r"data-ymax='([^']+)'", figure).group(1))


def test_bundle_command_reproduces_the_failure(cli, tiny_golden, tmp_path, monkeypatch):
    """command.sh replays the first failing K and forward and fails the same way from any directory: the
    golden and a plug-in file given by a relative path made absolute, and the environment variables the
    replay read set again (here the variable that chose the failing step, unset where command.sh runs)."""
    monkeypatch.chdir(PLUGINS.parent.parent)  # the repository root: the plug-in by a relative path
    monkeypatch.setenv("VD_PERTURB_STEP", "5")
    monkeypatch.setenv("DATABASE_URL", "postgres://user:hunter2@db/x")  # the shell's, read by no one here
    spec = "tests/plugins/perturb.py:factory"
    report = tmp_path / "r.json"
    code, out, err = cli("replay", tiny_golden, "--model", spec, "--report", report, "--junit", tmp_path / "j.xml",
                         "--html", tmp_path / "r.html")
    assert code == 1
    r = json.loads(report.read_text())
    bundle = Path(r["bundle"])
    assert bundle == tmp_path / "r.json.bundle" and r["report_version"] == 1
    page = (tmp_path / "r.html").read_text()  # its next step the bundle written, as the terminal's (a user test)
    assert f"in its bundle <code>{bundle}/</code>" in page and "replay.json.bundle" not in page
    failure = json.loads((bundle / "failure.json").read_text())
    assert failure["k"] == 2 and failure["step"] == 5 and failure["kind"] == "verify"
    rows = np.load(bundle / "rows.npz")
    assert rows["golden"].shape == rows["candidate"].shape == (2, 512)
    assert (rows["golden"] != rows["candidate"]).sum() == 1  # the one ULP the plug-in moved
    assert json.loads((bundle / "environment.json").read_text())["recorded"]["device"] == "cpu"
    command = (bundle / "command.sh").read_text()
    assert "export VD_PERTURB_STEP=5\n" in command and f"{PLUGINS / 'perturb.py'}:factory" in command
    assert "hunter2" not in command and "DATABASE_URL" not in command
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # no vd on PATH (a CI artifact run elsewhere, a machine running vd as python3 -m vd): the Python that wrote it
    env = {k: v for k, v in os.environ.items() if k != "VD_PERTURB_STEP"} | {"PATH": "/usr/bin:/bin"}
    assert subprocess.run(["sh", "-c", "command -v vd"], env=env, capture_output=True).returncode != 0
    done = subprocess.run(["sh", str(bundle / "command.sh")], capture_output=True, text=True, timeout=300,
                          cwd=elsewhere, env=env)
    assert done.returncode == 1, done.stderr
    again = json.loads((bundle / "replay.json").read_text())
    assert [v["k"] for v in again["verify"]] == [2] and not list(elsewhere.iterdir())
    assert again["verify"][0]["comparisons"][0]["first_failure"] == r["verify"][0]["comparisons"][0]["first_failure"]
    # run by a relative path, the paths it prints work from where it ran (it printed them as from its own folder)
    done = subprocess.run(["sh", "r.json.bundle/command.sh"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert done.returncode == 1 and "sh r.json.bundle/replay.json.bundle/command.sh replays just that" in done.stdout
    # JUnit: one case per forward for the decode rows, one per K x forward and one per K for the golden's
    # checks; the perturbed ones fail.
    suite = ET.parse(tmp_path / "j.xml").getroot()
    cases = suite.findall("testcase")
    assert len(cases) == 7 and suite.get("failures") == "3" and suite.get("name") == "vd.tiny"
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    assert failed == ["K=2 eager", "K=3 eager", "K=4 eager"] and cases[0].get("name") == "decode eager"
    assert [c.get("classname") for c in cases] == ["vd.tiny.decode"] + ["vd.tiny.K2"] * 2 + ["vd.tiny.K3"] * 2 + [
        "vd.tiny.K4"] * 2


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


def test_a_decode_or_batch_failure_fails_a_junit_case_and_writes_a_bundle(cli, tmp_path):
    """A FAIL that only the decode rows (--decode-forward) or only a batch (--batch) show fails a JUnit case
    (before, the file said failures="0") and leaves a bundle whose command.sh fails the same way."""
    for name, extra, case in (("decode", ["--decode-forward", "sdpa"], "decode sdpa"),
                              ("batch", ["--batch", "2"], "K=2 batch")):
        path = tmp_path / f"{name}.zarr"  # sdpa's batched rows differ from its rows alone; eager's do not
        forward = "eager" if name == "decode" else "sdpa"
        assert cli("record", path, "--model", "tiny-llama", "--k", "2", "--steps", "8", "--forward", forward)[0] == 0
        report, junit = tmp_path / f"{name}.json", tmp_path / f"{name}.xml"
        code, out, err = cli("replay", path, *extra, "--report", report, "--junit", junit)
        assert code == 1, (name, out, err)
        suite = ET.parse(junit).getroot()
        failed = [c.get("name") for c in suite.findall("testcase") if c.find("failure") is not None]
        assert case in failed and suite.get("failures") == str(len(failed)), (name, failed)
        bundle = Path(json.loads(report.read_text())["bundle"])
        failure = json.loads((bundle / "failure.json").read_text())
        command = (bundle / "command.sh").read_text()
        if name == "decode":
            assert failure["k"] == 1 and failure["decode_forward"] == "sdpa" and "--decode-forward sdpa" in command
            assert "--k 2" in command
        else:
            assert failure["batch"] == {"n": 2, "slot": None, "seed": 0} and "--batch 2 --batch-seed 0" in command
        done = subprocess.run(["sh", str(bundle / "command.sh")], capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, (name, done.stdout, done.stderr)


def test_a_slim_golden_bundle_has_the_candidate_rows_only(cli, tiny_golden, tmp_path):
    code, out, err = cli("slim", tiny_golden, tmp_path / "s.zarr")
    assert code == 0 and "% of" in out and "--rows" in out, out
    code, out, err = cli("replay", tmp_path / "s.zarr", "--model", PERTURB, "--report",
                         tmp_path / "r.json")
    assert code == 1
    rows = np.load(tmp_path / "r.json.bundle" / "rows.npz")
    assert "golden" not in rows and rows["candidate"].shape == (2, 512)


def test_a_bundle_is_one_replays_and_strict_json(cli, tiny_golden, tmp_path):
    """A slim golden's failure has no golden values: failure.json writes them as the report does ("nan"), not as
    Python's NaN, which strict JSON parsers refuse. A later replay with the same report clears the earlier bundle
    (and what its command.sh wrote there): a PASS leaves none beside its report, a FAIL one of its own; a file of
    the user's in the folder stays."""
    def strict(path):
        return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{path} holds {c}"))

    perturb, report = f"{PLUGINS / 'perturb.py'}:factory", tmp_path / "r.json"
    bundle = tmp_path / "r.json.bundle"
    assert cli("slim", tiny_golden, tmp_path / "s.zarr")[0] == 0
    assert cli("replay", tmp_path / "s.zarr", "--model", perturb, "--report", report)[0] == 1
    assert strict(bundle / "failure.json")["first_failure"]["golden"] is None  # unknown: a slim golden
    strict(report)
    (bundle / "replay.json").write_text("{}")  # as its command.sh leaves it, with its own bundle
    (bundle / "replay.json.bundle").mkdir()
    for name in ("command.sh", "failure.json"):
        shutil.copy(bundle / name, bundle / "replay.json.bundle" / name)
    code, out, err = cli("replay", tmp_path / "s.zarr", "--report", report)
    r = json.loads(report.read_text())
    assert code == 0 and "bundle" in r and r["bundle"] is None and not bundle.exists(), err  # the key, null
    assert cli("replay", tmp_path / "s.zarr", "--model", perturb, "--report", report)[0] == 1
    (bundle / "replay.json").write_text("{}")
    (bundle / "notes.txt").write_text("mine")
    assert cli("replay", tmp_path / "s.zarr", "--model", perturb, "--report", report, "--k", "3")[0] == 1
    assert sorted(p.name for p in bundle.iterdir()) == ["command.sh", "environment.json", "failure.json",
                                                       "notes.txt", "rows.npz"]
    assert strict(bundle / "failure.json")["k"] == 3
    assert cli("replay", tmp_path / "s.zarr", "--report", report)[0] == 0
    assert [p.name for p in bundle.iterdir()] == ["notes.txt"]
    (bundle / "notes.txt").unlink()
    assert cli("replay", tmp_path / "s.zarr", "--model", perturb, "--report", report)[0] == 1 and bundle.is_dir()
    code, out, err = cli("replay", tmp_path / "s.zarr", "--report", report, "--k", "9")  # no verdict: an error
    assert code == 2 and strict(report)["verdict"] == "ERROR" and not bundle.exists(), err


def test_a_folder_of_the_users_is_no_bundle_to_clear_or_write_over(cli, tiny_golden, tmp_path):
    """`--bundle DIR` naming a folder of the user's whose files have a bundle file's names (`--bundle .` in a project
    with its own command.sh): a passing replay removed them, and the folder, and a failing one wrote over them
    (found by user tests). A replay clears only a folder a bundle was written to (its failure.json,
    `render.is_bundle`), and a folder holding such files and no bundle is refused before the replay runs."""
    perturb = PERTURB
    mine = tmp_path / "proj"
    mine.mkdir()
    for name in render.BUNDLE_FILES:
        (mine / name).write_text("mine")
    assert not render.is_bundle(mine)
    (mine / "failure.json").write_text('{"k": 2, "note": "a file of mine"}')  # JSON, not a bundle's
    for model in ("tiny-llama", perturb):  # a replay that would PASS, one that would FAIL
        code, out, err = cli("replay", tiny_golden, "--k", "2", "--bundle", mine, "--model", model)
        assert code == 2 and f"--bundle {mine} holds rows.npz, failure.json, environment.json, command.sh, " \
            "replay.json and no earlier bundle: a bundle would overwrite them; give an empty or new folder" in err, err
    assert sorted(p.name for p in mine.iterdir()) == sorted(render.BUNDLE_FILES)
    assert (mine / "command.sh").read_text() == "mine" and (mine / "failure.json").read_text().startswith('{"k": 2')
    (mine / "rows.npz").unlink()
    code, out, err = cli("replay", tiny_golden, "--k", "2", "--model", perturb, "--report", mine / "rows.npz",
                         "--bundle", tmp_path / "b")  # beside a bundle of its own: other files are the user's
    assert code == 1, err
    for name in render.BUNDLE_FILES:
        (mine / name).unlink(missing_ok=True)
    (mine / "notes.txt").write_text("mine")  # a CI job's artifacts folder: the bundle goes in beside its files
    for flag, name in (("--report", "command.sh"), ("--junit", "rows.npz"), ("--html", "failure.json")):
        code, out, err = cli("replay", tiny_golden, "--k", "2", "--model", perturb, "--bundle", mine, flag, mine / name)
        assert code == 2 and f"{flag} {mine / name} is where the bundle (--bundle {mine}) writes its {name}" in err
    assert cli("replay", tiny_golden, "--k", "2", "--model", perturb, "--bundle", mine, "--report",
               mine / "report.json")[0] == 1
    assert render.is_bundle(mine) and (mine / "notes.txt").read_text() == "mine"


def test_a_file_where_the_bundle_beside_the_report_goes_is_refused_before_the_run(cli, tiny_golden, tmp_path):
    """A file at REPORT.bundle: the replay ran, then stopped on a raw "File exists" (exit 2) with no report, JUnit or
    HTML written (found by a user test). Refused first, naming it."""
    (tmp_path / "r.json.bundle").write_text("mine")
    code, out, err = cli("replay", tiny_golden, "--k", "2", "--model", PERTURB, "--report",
                         tmp_path / "r.json")
    assert code == 2 and f"the bundle's place beside --report, {tmp_path / 'r.json.bundle'}, is a file; a bundle is " \
        "a folder" in err and "vd: loading" not in err, err
    assert (tmp_path / "r.json.bundle").read_text() == "mine" and not (tmp_path / "r.json").exists()


def test_html_report_renders_in_headless_chromium(cli, tiny_golden, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("no `chromium` binary on PATH, so the page cannot be rendered in a headless browser "
                    "(install Debian's chromium to run this check)")
    page = tmp_path / "r.html"
    code, out, err = cli("replay", tiny_golden, "--forward", "eager", "--forward", "sdpa", "--html", page)
    assert code == 1 and page.stat().st_size > 2000
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert "vd replay:" in dom and "FAIL" in dom and f"<td>{vd.__version__}</td>" in dom
    # per K: eager, sdpa and the control each on axes of their own, and the golden's accepts and positions
    assert dom.count("<svg") == 12 and dom.count("<path") >= 12 and "K = 4" in dom
    assert dom.count("class=\"forward failing\"") == 3 and "log scale" not in dom  # sdpa's; eager is the golden's
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
                   capture_output=True, timeout=120)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a blank page is a few kB


# -- JUnit ---------------------------------------------------------------------------------------------------


def test_junit_names_the_golden_in_suite_and_class_names(perturbed, tmp_path):
    render.write_junit(tmp_path / "a.xml", perturbed)
    render.write_junit(tmp_path / "b.xml", perturbed, name="smollm2-mtp")
    a, b = (ET.parse(tmp_path / f).getroot() for f in ("a.xml", "b.xml"))
    assert a.tag == b.tag == "testsuite" and a.get("name") == "vd.tiny" and b.get("name") == "vd.smollm2-mtp"
    assert {c.get("classname") for c in b.iter("testcase")} == {"vd.smollm2-mtp.decode", "vd.smollm2-mtp.K2",
                                                                 "vd.smollm2-mtp.K3", "vd.smollm2-mtp.K4"}
    props = {p.get("name"): p.get("value") for p in a.iter("property")}
    assert props["verdict"] == "FAIL" and props["model"] == "tiny-llama" and props["vd"] == vd.__version__


def test_suite_junit_has_a_testsuite_per_golden_and_an_error_case(perturbed, passing, tmp_path):
    path = tmp_path / "suite.xml"
    render.write_suite_junit(path, [("tiny", perturbed, None), ("tiny-again", passing, None),
                                    ("missing", None, "vd: error: missing.zarr is not a vd golden\nmore detail")])
    root = ET.parse(path).getroot()
    suites = root.findall("testsuite")
    assert root.tag == "testsuites" and [s.get("name") for s in suites] == ["vd.tiny", "vd.tiny-again", "vd.missing"]
    assert [(s.get("tests"), s.get("failures"), s.get("errors")) for s in suites] == [
        ("7", "3", "0"), ("7", "0", "0"), ("1", "0", "1")]
    assert (root.get("tests"), root.get("failures"), root.get("errors")) == ("15", "3", "1")
    classes = [c.get("classname") for c in root.iter("testcase")]
    assert len(set(classes) & {"vd.tiny.K2", "vd.tiny-again.K2"}) == 2  # two goldens no longer collide
    error = suites[2].find("testcase/error")
    assert error.get("message") == "vd: error: missing.zarr is not a vd golden" and "more detail" in error.text


# -- HTML ----------------------------------------------------------------------------------------------------


def test_html_marks_a_one_ulp_failure_on_its_own_scale(perturbed, tmp_path):
    """The old page let the control's 27-33 set one y-scale for every line, so a 1-ULP failure sat half a
    pixel above zero, unmarked: now each forward has its own axes and its failing steps are marked."""
    page = tmp_path / "r.html"
    render.write_html(page, perturbed)
    text = page.read_text()
    for k in (2, 3, 4):
        eager, control = _figure(text, f"tiny-k{k}-eager"), _figure(text, f"tiny-k{k}-control")
        assert "class='forward failing'" in eager and "FAILS</b> at step 3 (1 of 8)" in eager
        assert eager.count("<svg") == 1 and f'id="tiny-k{k}-eager-failing"' in eager  # the red markers
        assert 0 < _ymax(eager) < 0.01  # one bf16 ULP of a logit near 0.5 is 0.0039, and it sets the scale
        assert control.count("<svg") == 1 and "detection control" in control and "detection control" not in eager
        assert _ymax(control) > 1 and "draft changed (step 4)" in control and "fired" in control
        assert "linear scale" in eager and "linear scale" in control
    assert "log scale" not in text and "(not given)" in text


def test_html_header_says_what_ran_and_what_to_do_next(perturbed, passing, tmp_path):
    failing, ok = tmp_path / "fail.html", tmp_path / "pass.html"
    render.write_html(failing, perturbed, command=["vd", "replay", "tiny.zarr", "--model", PERTURB])
    render.write_html(ok, passing, command="vd replay tiny.zarr")
    text = failing.read_text()
    assert f"<th>vd version</th><td>{vd.__version__}</td>" in text
    assert f"<code>vd replay tiny.zarr --model {PERTURB}</code>" in text
    assert f"<td>{perturbed.environment.replayed['time']}</td>" in text
    assert "<b>Environment differences</b> (recorded → replayed): none" in text
    assert "Look at the first divergence (K=2, eager, verify step 3 row 1 index 7" in text
    # Every suggested command works as written: a golden replayed by its path is refreshed by that path (a name
    # is suggested only where a suite declares it: test_suite_html_has_a_section_per_golden_and_shows_errors).
    # Another model SPEC than the golden's: its rows taken as a candidate, or that SPEC made the golden's model
    # (a plain refresh would record the golden's own model again).
    assert "--k 2 --forward eager" in text and "--refresh --model " in text
    assert f"<code>vd refresh {shlex.quote(perturbed.golden)} --from PATH --reason TEXT</code>" in text
    assert "vd refresh tiny " not in text
    assert "<h1>vd replay: <span class='PASS'>PASS</span></h1>" in ok.read_text()
    assert "nothing needed" in ok.read_text() and "vd refresh" not in ok.read_text()


def test_html_lists_the_environment_differences(perturbed, tmp_path):
    env = dataclasses.replace(perturbed.environment, numerics_differences=("cpu_capability: AVX2 → DEFAULT",))
    render.write_html(tmp_path / "r.html", dataclasses.replace(perturbed, environment=env))
    assert "<li>cpu_capability: AVX2 → DEFAULT</li>" in (tmp_path / "r.html").read_text()


def test_suite_html_has_a_section_per_golden_and_shows_errors(perturbed, passing, tmp_path):
    page = tmp_path / "suite.html"
    render.write_suite_html(page, [("tiny", perturbed, None), ("tiny-pass", passing, None),
                                   ("missing", None, "vd: error: missing.zarr is not a vd golden")],
                            command="vd replay-all goldens/")
    text = page.read_text()
    assert "vd replay: 3 goldens, <span class='FAIL'>FAIL</span>" in text and "vd replay-all goldens/" in text
    for name, verdict in (("tiny", "FAIL"), ("tiny-pass", "PASS"), ("missing", "ERROR")):
        assert f"<section id='golden-{name}'><h2>{name}: <span class='{verdict}'>{verdict}</span></h2>" in text
    assert "<pre>vd: error: missing.zarr is not a vd golden</pre>" in text
    assert "<code>vd refresh tiny --reason TEXT</code>" in text  # a suite's golden by its declared name
    ids = re.findall(r" id=['\"]([^'\"]+)['\"]", text)
    figures = re.findall(r"<figure id='([^']+)'", text)
    assert len(figures) == 18 and len(set(figures)) == 18 and "tiny-pass-k2-eager" in figures  # 3 per K
    assert len(ids) == len(set(ids)), "ids repeat across the page's SVGs"
    assert "failing" not in _figure(text, "tiny-pass-k2-eager") and "bit for bit" in _figure(text, "tiny-pass-k2-eager")


def test_replayed_spec_is_shown_and_kept(perturbed, tmp_path):
    bare = dataclasses.replace(perturbed, model=dataclasses.replace(perturbed.model, replayed_spec=None))
    assert bare.to_json()["model"]["replayed_spec"] is None  # the key is always there
    report = dataclasses.replace(perturbed, model=dataclasses.replace(perturbed.model, replayed_spec=PERTURB))
    assert report.to_json()["model"]["replayed_spec"] == PERTURB
    render.write_html(tmp_path / "r.html", report)
    render.write_junit(tmp_path / "j.xml", report)
    assert f"<tr><th>replayed spec</th><td>{PERTURB}</td></tr>" in (tmp_path / "r.html").read_text()
    props = {p.get("name"): p.get("value") for p in ET.parse(tmp_path / "j.xml").getroot().iter("property")}
    assert props["replayed_spec"] == PERTURB
    assert f"--model {PERTURB}" in (tmp_path / "r.html").read_text()  # the next step replays what ran


def test_bundle_carries_the_decoded_tokens(perturbed, tmp_path):
    rows = dataclasses.replace(perturbed.failure_rows, text="fox")
    render.write_bundle(tmp_path / "b", dataclasses.replace(perturbed, failure_rows=rows), {})
    assert json.loads((tmp_path / "b" / "failure.json").read_text())["text"] == "fox"
    render.write_bundle(tmp_path / "c", perturbed, {})
    assert "text" not in json.loads((tmp_path / "c" / "failure.json").read_text())


def test_where_elements_differ_is_said_in_words_at_the_extremes(perturbed, passing, tmp_path):
    """The positions plot shows the share of elements that differ; on a PASS it says no element differs (not an
    empty box), where every element differs it says so (not a solid block), for a slim golden it is unknown."""
    from vd.replayer import words

    render.write_html(tmp_path / "pass.html", passing)
    assert "no element differs from the golden" in _figure((tmp_path / "pass.html").read_text(), "tiny-k2-golden")
    render.write_html(tmp_path / "fail.html", perturbed)
    fail = _figure((tmp_path / "fail.html").read_text(), "tiny-k2-golden")
    assert "no element differs" not in fail and "every element" not in fail and "elements that differ, %" in fail
    assert words.positions_note([1.0, 1.0]) == "every element of every row differs"
    assert words.positions_note([0.0, 0.5]) is None and "slim" in words.positions_note([0.0], measured=False)
    v = perturbed.verify[0]
    assert words.coverage_text(v).startswith(f"coverage over {len(v.accepted)} steps: ")


def test_a_bundle_exports_what_was_read_not_what_was_copied(monkeypatch):
    """`reading_environment` notes the variables code looks up, not those a copy of the environment reads (a
    subprocess's, ``dict(os.environ)``): the shell's other variables, a database URL's password among them, stay
    out of command.sh; and a value carrying a URL's credentials stays out whoever reads it."""
    from vd.cli.common import reading_environment

    monkeypatch.setenv("DATABASE_URL", "postgres://user:hunter2@db/x")
    monkeypatch.setenv("N", "8")
    monkeypatch.setenv("MY_PLUGIN_SWITCH", "on")
    monkeypatch.setenv("MY_ENDPOINT", "https://key:secret@store.example/b")
    monkeypatch.setenv("MY_CACHE", "/home/ci/cache")
    monkeypatch.delenv("MY_DEFAULT", raising=False)
    with reading_environment() as found:
        dict(os.environ), {**os.environ}, list(os.environ.items()), os.environ.copy()
        subprocess.run(["true"], env={**os.environ, "X": "1"}, check=True)
        assert os.environ.get("MY_PLUGIN_SWITCH") == "on" and os.environ["MY_ENDPOINT"]
        # Set by the process itself (as vd sets its kernel-cache caps, torch its TORCHINDUCTOR_CACHE_DIR): a
        # command run again sets it again, so it is not pinned; one the shell set is, with the shell's value.
        os.environ["MY_DEFAULT"] = "/tmp/x"
        os.environ["MY_CACHE"] = "/tmp/y"
        assert os.environ["MY_DEFAULT"] and os.environ["MY_CACHE"]
    assert found == {"MY_CACHE": "/home/ci/cache", "MY_PLUGIN_SWITCH": "on"}


def test_code_torch_compile_traces_compiles_as_it_does_unwatched(monkeypatch):
    """A lookup inside code torch.compile traces (transformers' attention asks for TRANSFORMERS_SDPA_FORCE_GQA)
    is traced as os.environ's own: vd's bookkeeping stays out of the traced code, whose graph, guards and
    compilations are those of a process that does not watch (a recording). Watched, torch 2.11 broke the graph
    there, so a compiled MTP head replayed other kernels and other draft rows than its golden's; 2.13 guarded on
    the bookkeeping and compiled again after every copy of the environment. Lookups outside traced code are still
    noted."""
    import torch
    from torch._dynamo.utils import counters

    from vd.cli.common import reading_environment

    monkeypatch.setenv("MY_PLUGIN_SWITCH", "on")

    def step(x):
        return x * 2 if os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1" else x + 1

    def compiled(watch: bool) -> tuple[int, int, dict, dict | None]:
        torch._dynamo.reset()
        counters.clear()
        with reading_environment() if watch else contextlib.nullcontext() as found:
            explained = torch._dynamo.explain(step)(torch.ones(3))
            torch._dynamo.reset()
            counters.clear()
            fast = torch.compile(step, backend="eager")
            for _ in range(3):
                fast(torch.ones(3))
                dict(os.environ)  # a copy between steps, as a subprocess's environment is made
            os.environ.get("MY_PLUGIN_SWITCH")
        return explained.graph_count, explained.graph_break_count, dict(counters["stats"]), found

    graphs, breaks, stats, found = compiled(watch=True)
    plain = compiled(watch=False)
    assert (graphs, breaks) == plain[:2] == (1, 0)
    assert stats["unique_graphs"] == plain[2]["unique_graphs"] == 1, stats
    assert found["MY_PLUGIN_SWITCH"] == "on"


def test_a_decode_rows_first_divergence_names_the_token_it_decoded(perturbed):
    """A failing decode row is one token decoded, not tokens verified: its "Look at" step says so."""
    import dataclasses

    from replayer.words import next_steps, plain_text
    from vd.store.format import DECODE_K

    rows = dataclasses.replace(perturbed.failure_rows, k=DECODE_K, tokens=[17], text="x")
    reasons = [dataclasses.replace(r, what="decode") for r in perturbed.reasons]
    decode = dataclasses.replace(perturbed, failure_rows=rows, reasons=reasons)
    look, verify = (next(plain_text(s) for s in next_steps(r, None) if s[0].startswith("Look at"))
                    for r in (decode, perturbed))
    assert "; the step decoded token [17] ('x')" in look and "verified" not in look, look
    assert "; the step verified tokens [" in verify, verify


def test_the_look_at_command_passes_the_head_and_device_that_ran(perturbed):
    """The command replaying the first divergence passed --model alone: a replay given --head (or --device)
    was reproduced with the golden's own head (device), and its draft rows then matched (a user test)."""
    import dataclasses

    from replayer.words import next_steps, plain_text

    def look(report):
        return next(plain_text(s) for s in next_steps(report, None) if s[0].startswith("Look at"))

    assert "--head" not in look(perturbed) and "--device" not in look(perturbed)
    headed = dataclasses.replace(perturbed, model=dataclasses.replace(perturbed.model, head_file="h2.safetensors"))
    assert f"--head {os.path.abspath('h2.safetensors')} " in look(headed), look(headed)
    env = perturbed.environment
    moved = dataclasses.replace(perturbed, environment=dataclasses.replace(
        env, replayed={**env.replayed, "device": "cuda", "threads": 3}))
    assert "--device cuda --threads 3 " in look(moved), look(moved)


def test_a_thin_drafter_golden_whose_head_never_drafts_is_not_sent_to_more_steps(perturbed):
    """A drafter golden whose every accept count is 0 (a head that never drafts a token the model accepts) was
    told to record again with more steps, which changes nothing (a user test); it is told to change the head."""
    import dataclasses

    from replayer.report import Reason
    from replayer.words import next_steps, plain_text

    def own_checks(report):
        return next(plain_text(s) for s in next_steps(report, None) if s[0].startswith("The golden's own checks"))

    thin = (*perturbed.reasons, Reason("thin", "the reference is too thin"))
    never = dataclasses.replace(perturbed, mtp=True, reasons=thin, verify=tuple(
        dataclasses.replace(v, accepted=(0,) * len(v.accepted)) for v in perturbed.verify))
    assert "its draft head never drafted a token the model accepts" in own_checks(never) \
        and "--steps" not in own_checks(never), own_checks(never)
    some = dataclasses.replace(perturbed, mtp=True, reasons=thin)
    assert f"--refresh --steps {2 * perturbed.steps}" in own_checks(some)


def test_the_golden_decode_forwards_own_failing_rows_are_accepted_by_a_refresh(perturbed):
    """A golden whose decode rows are sdpa's (vd record --decode-forward sdpa), its decode rows failing under sdpa
    alone: the step said to make sdpa the golden's forward (--forward sdpa: its verify rows would then be
    sdpa's, a user test); they are the golden's own, which a refresh records again."""
    import dataclasses

    from replayer.report import Reason
    from replayer.words import next_steps, plain_text

    decode = perturbed.decode
    judged = dataclasses.replace(decode.comparisons[0], reasons=(Reason("decode", "decode rows differ"),),
                                 comparison=dataclasses.replace(decode.comparisons[0].comparison, variant="sdpa"))
    report = dataclasses.replace(perturbed, golden_decode_forward="sdpa", reasons=judged.reasons,
                                 decode=dataclasses.replace(decode, comparisons=(judged,)),
                                 model=dataclasses.replace(perturbed.model, replayed_spec=None))
    steps = [plain_text(s) for s in next_steps(report, None)]
    assert any(s.startswith("If the change is intended, accept it: vd refresh") for s in steps), steps
    assert not any("--forward sdpa" in s or "--decode-forward" in s for s in steps), steps
