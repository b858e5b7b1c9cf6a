"""vd as a user drives it from a shell: exit codes, one-line errors, what is printed and written, and a
golden kept in a directory, a zip file or on S3; usage errors answered before torch is imported, the help,
progress in a log, and tools/setup.sh."""

import hashlib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import typer
import zarr
from golden_edit import chunk, damage, edit_meta
from typer.testing import CliRunner

import vd
from vd.cli import app
from vd.progress import Lines
from vd.store.local import finish_removals

PLUGINS = Path(__file__).parent / "plugins"
ROOT = Path(__file__).resolve().parent.parent


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


def _one_line_error(code, out, err, *needles, exit_code=2):
    """One error line, the last on stderr; any before it are progress lines of the work already done."""
    assert code == exit_code, (code, out, err)
    *progress, line = err.strip().splitlines()
    assert line.startswith(("vd: error: ", "vd: internal error: ")), err
    assert all(p.startswith("vd: ") and "error" not in p for p in progress), err
    assert "Traceback" not in err
    for n in needles:
        assert n in line, err


def test_round_trip_passes_with_report(cli, tiny_golden, tmp_path):
    report = tmp_path / "out" / "report.json"
    code, out, err = cli("replay", tiny_golden, "--report", report)
    assert code == 0, out + err
    assert out.rstrip().endswith("PASS")
    r = json.loads(report.read_text())
    assert r["verdict"] == "PASS" and r["reasons"] == [] and r["mtp"] is False and r["graphs"] == "eager"
    assert r["golden"] == str(tiny_golden) and r["rows"] == {"slim": False, "source": str(tiny_golden)}
    assert set(r["environment"]) == {"recorded", "replayed", "numerics_differences"}
    assert r["environment"]["recorded"]["torch"] == r["environment"]["replayed"]["torch"]
    assert [v["k"] for v in r["verify"]] == [2, 3, 4]
    for v in r["verify"]:
        (c,) = v["comparisons"]
        assert c["variant"] == "eager" and c["prefill_equal"] and c["mismatched_steps"] == 0
        assert c["steps"] == 8 and c["first_mismatch"] is None and c["max_abs_diff"] == 0.0
        assert set(v) == {"k", "accepted", "accept_histogram", "coverage", "comparisons", "timings",
                          "detection_control", "golden_left_greedy_step", "equivalence", "batch", "axes"}
        # The control changed step 4's last draft: steps before it still match, step 4 differs.
        dc = v["detection_control"]
        assert dc["fired"] and dc["changed_step"] == 4 and dc["mismatched_step_list"][0] == 4


def test_a_fail_on_the_terminal_says_what_to_do_next(cli, tiny_golden, tmp_path):
    """After FAIL: the command replaying the first divergence and how to accept the change (with the
    golden's path, which is what refresh takes for an undeclared golden); a saved candidate is named."""
    spec = f"{PLUGINS / 'perturb.py'}:factory"
    code, out, err = cli("replay", tiny_golden, "--model", spec, "--k", "2", "--save-candidate", tmp_path / "c.zarr")
    # a candidate of some of the golden's Ks was saved, and no command could open it (found by a user test)
    _one_line_error(code, out, err, "--save-candidate keeps a whole next version of the golden, every K it holds "
                                    "(2, 3, 4), to review and promote: it does not go with --k 2")
    assert not (tmp_path / "c.zarr").exists()
    code, out, err = cli("replay", tiny_golden, "--model", spec, "--save-candidate", tmp_path / "c.zarr")
    assert code == 1, err
    lines = out.splitlines()
    at = lines.index("next step:")
    assert lines[at - 1] == "FAIL" and lines[at + 1].startswith("  - Look at the first divergence (K=2, eager,")
    assert f"vd replay {tiny_golden} --k 2 --forward eager" in lines[at + 1]
    # A refresh alone would record tiny-llama again: the way on takes the plug-in's rows (the candidate saved: it
    # said to save one again), or makes it the model.
    assert lines[at + 2] == (f"  - If the change is intended, take these rows, the golden staying of its model: "
                             f"promote the candidate this replay saved: vd refresh {tiny_golden} --from "
                             f"{tmp_path / 'c.zarr'} --reason TEXT; or make {spec} the golden's model: vd record "
                             f"{tiny_golden} --refresh --model {spec} --reason TEXT (vd refresh records the golden's "
                             "own, tiny-llama).")
    assert f"  note: candidate saved: {tmp_path / 'c.zarr'} (review with vd diff" in out
    assert cli("show", tmp_path / "c.zarr")[0] == 0
    code, out, err = cli("replay", tiny_golden, "--k", "2")
    assert code == 0 and "next step" not in out


def test_a_fail_whose_control_was_inconclusive_offers_no_promotion(cli, tiny_copy, monkeypatch):
    """Rows differing at every step leave the detection control inconclusive, and a candidate of them is refused
    promotion: the next step offered that promotion anyway (found by a user test), and its reproducer spelled a
    draft tolerance for a golden without draft rows. It offers the recording that works."""
    monkeypatch.setenv("VD_PERTURB_STEP", "all")
    spec = f"{PLUGINS / 'perturb.py'}:factory"
    code, out, err = cli("replay", tiny_copy, "--model", spec, "--k", "2")
    steps = out.split("next step:")[1]
    assert code == 1 and "--save-candidate" not in steps and "--tolerance draft" not in steps, out + err
    record = f"vd record {tiny_copy} --refresh --model {spec} --reason TEXT"
    assert record in steps and "the detection control at K=2 was inconclusive" in steps, steps
    assert cli(*shlex.split(record)[1:-1], "the perturbed build")[0] == 0
    assert cli("replay", tiny_copy, "--model", spec, "--k", "2")[0] == 0


def test_coverage_the_reference_feed_cannot_reach_is_not_sent_to_more_steps(cli, tiny_golden):
    """K=3 under the reference feed never accepts 0 drafts: its coverage reason says more steps cannot reach it, and
    the next step said to record again with more steps (found by a user test). It names other widths, or the
    drafter feed, or a replay without --require-coverage."""
    code, out, err = cli("replay", tiny_golden, "--require-coverage", "--k", "3")
    assert code == 1 and "more steps cannot reach it" in out, out + err
    steps = out.split("next step:")[1]
    assert "--steps" not in steps and f"need other widths or the drafter feed (vd record {tiny_golden} --refresh " \
        "--k 2,4), or a replay without --require-coverage." in steps, steps  # the golden's path, not GOLDEN


def test_a_thin_golden_is_sent_to_a_recording_it_can_run(cli, tmp_path):
    """A golden stored thin (--allow-thin) FAILs every replay; its next step said `vd record GOLDEN --refresh
    --steps N`, placeholders where the golden's path and a number belong (found by a user test)."""
    golden = tmp_path / "thin.zarr"
    assert cli("record", golden, "--model", "tiny-llama-mtp", "--feed", "mtp", "--k", "3", "--steps", "4",
               "--allow-thin")[0] == 0
    code, out, err = cli("replay", golden)
    steps = out.split("next step:")[1]
    assert code == 1 and f"more steps (vd record {golden} --refresh --steps 8)" in steps, out + err


def test_a_fail_of_another_model_and_forward_says_both(cli, tiny_golden, tmp_path, monkeypatch):
    """Another model (allowed) under another forward: the next step's command left --allow-model-mismatch out (it
    was refused), and its way to accept recorded the golden's own model again (found by a user test)."""
    code, out, err = cli("replay", tiny_golden, "--model", "tiny-llama-shape", "--k", "2", "--allow-model-mismatch",
                         "--forward", "static")
    assert code == 1, err
    steps = out.split("next step:")[1].splitlines()
    assert " --allow-model-mismatch --report replay.json replays just that" in steps[1], steps
    assert steps[2] == (f"  - To make static the golden's forward and tiny-llama-shape its model, record it with it: "
                        f"vd record {tiny_golden} --refresh --model tiny-llama-shape --forward static --reason TEXT "
                        "(vd refresh records the golden's own, eager of tiny-llama).")
    monkeypatch.chdir(tmp_path)
    look = steps[1].split(": ", 1)[1].split(" replays just that")[0].split()
    code, out, err = cli(*look[1:])  # as printed, it fails the same way
    assert code == 1 and "FAIL" in out, out + err


def test_a_fail_of_another_forward_says_how_to_record_with_it(cli, tiny_golden):
    """A forward other than the golden's failing: a refresh would record the golden's own forward (eager) again,
    so the way to accept it is a recording with that forward, said as the command to run."""
    code, out, err = cli("replay", tiny_golden, "--forward", "sdpa", "--k", "2")
    assert code == 1, err
    # the first place named is the prefill's, which runs first (as the first divergence is): it named step 0 row 0
    assert "verify K=2, sdpa: prefill differs, 8 of 8 steps differ (first at prefill row 1 index 0: " in out, out
    lines = out.splitlines()
    at = lines.index("next step:")
    assert lines[at + 2] == (f"  - To make sdpa the golden's forward, record it with it: vd record {tiny_golden} "
                             "--refresh --forward sdpa --reason TEXT (vd refresh records the golden's own, eager).")
    assert "vd refresh" not in lines[at + 2].split(":")[0] and len(lines) == at + 3, lines[at:]


def test_a_bundle_goes_into_a_folder_that_exists_and_never_onto_a_file(cli, tiny_golden, tmp_path):
    """--bundle names a folder: one a CI job made for its artifacts is written into; a file is refused, kept.
    The next step then points at the bundle written (its command.sh, quoted, replays the failure) rather than at
    a command that would write another."""
    folder = tmp_path / "CI artifacts"
    folder.mkdir()
    spec = f"{PLUGINS / 'perturb.py'}:factory"
    code, out, err = cli("replay", tiny_golden, "--model", spec, "--k", "2", "--bundle", folder)
    assert code == 1 and {p.name for p in folder.iterdir()} >= {"command.sh", "rows.npz", "failure.json"}, out + err
    look = next(line for line in out.splitlines() if "Look at the first divergence" in line)
    assert look.endswith(f") in its bundle '{folder}/' (both rows in rows.npz, failure.json): sh "
                         f"'{folder / 'command.sh'}' replays just that."), look
    done = subprocess.run(shlex.split(look.split("): ", 1)[1].removesuffix(" replays just that.")),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "FAIL" in done.stdout.splitlines(), done.stdout + done.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _one_line_error(*cli("replay", tiny_golden, "--model", spec, "--bundle", blocker), "is a file; give a directory")
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("case, exit_code", [("missing", 2), ("plugin", 2), ("internal", 3)])
def test_a_replay_that_ends_before_a_verdict_still_writes_its_reports(cli, tiny_golden, tmp_path, monkeypatch, case,
                                                                      exit_code):
    """A CI dashboard shows why there is no verdict: --report, --junit and --html hold the error and its exit
    code, for bad input (a missing golden, a plug-in that raises: exit 2) and for vd's own crash (exit 3)."""
    golden = tmp_path / "nowhere.zarr" if case == "missing" else tiny_golden
    extra = ["--model", f"{PLUGINS / 'crashing.py'}:factory"] if case == "plugin" else []
    if case == "internal":
        def boom(*args, **kwargs):
            raise RuntimeError("a bug of vd's")

        monkeypatch.setattr(importlib.import_module("vd.replayer.replay"), "replay_k", boom)
    outputs = ["--report", tmp_path / "r.json", "--junit", tmp_path / "j.xml", "--html", tmp_path / "r.html"]
    code, out, err = cli("replay", golden, "--k", "2", *extra, *outputs)
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == r["exit_code"] == exit_code and r["verdict"] == "ERROR" and r["error"] == r["reasons"][0], (code, r)
    assert r["error"] in err and r["golden"] == str(golden)
    suite = ET.parse(tmp_path / "j.xml").getroot()
    assert suite.get("errors") == "1" and suite.find("testcase/error").get("message") == r["error"]
    assert "<span class='ERROR'>ERROR</span>" in (tmp_path / "r.html").read_text()


def test_decisions_margin_from_the_command_line(cli, tiny_golden, tmp_path):
    report = tmp_path / "r.json"
    code, out, err = cli("replay", tiny_golden, "--tolerance", "decisions=margin:0.5", "--report", report)
    r = json.loads(report.read_text())
    assert code == 0 and r["policy"]["decisions"] == "margin:0.5", out + err
    assert "decisions=margin:0.5" in r["sensitivity"]["verify"]["catches"]
    _one_line_error(*cli("replay", tiny_golden, "--tolerance", "decisions=margin:0"), "decisions=margin:X")
    _one_line_error(*cli("replay", tiny_golden, "--tolerance", "decisions=margin:-1"),  # (it said "unknown term")
                    "decisions=margin:X needs a finite X > 0, not '-1'")


def test_python_m_vd_is_the_command_line():
    done = subprocess.run([sys.executable, "-m", "vd", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "record" in done.stdout and "replay" in done.stdout and "slim" in done.stdout


@pytest.mark.parametrize("where", ["vd.cli.app.app", "vd.warm.forward"])
def test_ctrl_c_before_a_command_runs_is_one_line(where):
    """Ctrl-C in the first quarter second, while the command line is imported or typer builds its commands
    (before `vd.cli.common.Group` handles a command's): one line and 130, not a traceback of typing or numpy."""
    module, name = where.rsplit(".", 1)
    code = (f"import importlib, os, signal; m = importlib.import_module({module!r}); "
            f"m.{name} = lambda *a: os.kill(os.getpid(), signal.SIGINT); "
            "from vd.launch import main; main()")
    done = subprocess.run([sys.executable, "-c", code, "show", "g.zarr"], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stderr) == (130, "vd: aborted (Ctrl-C)\n")


@pytest.mark.parametrize(("args", "code", "closed"), [
    (["show"], 0, ("stdout",)),
    (["replay", "--report", "{report}"], 0, ("stdout", "stderr")),
    (["replay", "--forward", "sdpa"], 1, ("stdout",)),
])
def test_a_reader_that_goes_away_leaves_the_exit_code_as_judged(tiny_golden, tmp_path, args, code, closed):
    """`vd replay GOLDEN | head -1`: the pipe closes before vd prints its table. A PASS exited 1, vd's code for
    a real difference (click's answer to a broken pipe), without a word; it now finishes as judged, its report
    written, the rest of its output dropped."""
    report = tmp_path / "r.json"
    argv = [args[0], str(tiny_golden), *(a.format(report=report) for a in args[1:])]
    proc = subprocess.Popen([sys.executable, "-m", "vd", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for name in closed:
        getattr(proc, name).close()
    err = b"" if "stderr" in closed else proc.stderr.read()
    assert proc.wait(timeout=120) == code, err
    assert b"Traceback" not in err and b"Exception ignored" not in err and b"vd: error" not in err
    if "--report" in args:
        assert json.loads(report.read_text())["verdict"] == "PASS"


def _vd(*args, stdout=subprocess.PIPE, cwd=None):
    return subprocess.run([sys.executable, "-m", "vd", *map(str, args)], stdout=stdout, stderr=subprocess.PIPE,
                          timeout=120, cwd=cwd)


def test_a_report_to_stdout_is_the_json_alone(tiny_golden, tmp_path):
    """``--report -`` (or /dev/stdout) writes the JSON to standard output, and the command's own lines go to
    stderr, so a pipe reads the report alone (``| jq .verdict``); it wrote a file named "-". A JUnit file to
    /dev/stdout redirected to a file lands in that file."""
    done = _vd("replay", tiny_golden, "--k", "2", "--report", "-", cwd=tmp_path)
    assert done.returncode == 0 and json.loads(done.stdout)["verdict"] == "PASS", done.stderr
    assert b"PASS" in done.stderr and not (tmp_path / "-").exists()
    with open(tmp_path / "log.xml", "wb") as log:
        done = _vd("replay", tiny_golden, "--k", "2", "--forward", "sdpa", "--junit=/dev/stdout", stdout=log)
    assert done.returncode == 1 and ET.parse(tmp_path / "log.xml").getroot().get("failures") != "0"
    assert os.path.islink("/dev/stdout")


def test_a_report_to_a_device_or_a_fifo_is_written_through_them(tiny_golden, tmp_path):
    """``--report /dev/null`` as root renamed a regular file over the device: /dev/null stopped discarding for
    every process on the machine (a non-root user was refused: /dev not writable). A device or a named pipe
    is now written through, and no bundle is made beside it."""
    import stat
    import threading

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    done = _vd("replay", tiny_golden, "--k", "2", "--report", fifo)
    reader.join(30)
    assert done.returncode == 0 and json.loads(got[0])["verdict"] == "PASS", done.stderr
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    null = tmp_path / "null"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is
    done = _vd("replay", tiny_golden, "--k", "2", "--forward", "sdpa", "--report", null)
    assert done.returncode == 1 and stat.S_ISCHR(null.stat().st_mode), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "null"]  # no null.bundle


def test_another_distribution_named_vd_is_refused_in_one_line(tmp_path):
    """PyPI's `vd` (a vector-database facade) installs a `vd` package and a `vd` command too: beside it vd
    (distributed as vd-goldens) would run on overwritten files, so it refuses in one line, exit 2."""
    info = tmp_path / "vd-0.2.20.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vd\nVersion: 0.2.20\n"
                                   "Summary: A facade over vector databases\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "vd", "--help"], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    (line,) = done.stderr.splitlines()
    assert "'vd' 0.2.20 (A facade over vector databases)" in line and "pip uninstall vd vd-goldens" in line


def test_refused_overwrite_leaves_golden_intact(cli, tiny_golden):
    before = _tree_hash(tiny_golden)
    _one_line_error(*cli("record", tiny_golden, "--model", "tiny-qwen2", "--steps", "8"), "already holds a golden",
                    "--refresh")
    assert _tree_hash(tiny_golden) == before


@pytest.mark.parametrize("outputs, needles", [
    (("--report", "same.out", "--junit", "same.out"), ("--report and --junit both write", "same.out")),
    (("--junit", "p.xml", "--html", "./p.xml"), ("--junit and --html both write",)),
    (("--report", "-", "--junit", "/dev/stdout"), ("--report and --junit both write standard output",)),
    (("--report", "r.json", "--bundle", "r.json"), ("--report and --bundle both write",)),
])
def test_two_outputs_of_a_replay_on_one_path_are_refused(cli, tiny_golden, tmp_path, monkeypatch, outputs, needles):
    """The second output written replaced the first (a JSON report became JUnit XML, exit 0), or both ran into each
    other on standard output: refused before the replay, nothing written; /dev/null takes any number."""
    monkeypatch.chdir(tmp_path)
    _one_line_error(*cli("replay", tiny_golden, *outputs), *needles)
    _one_line_error(*cli("replay", "--suite", "--config", tmp_path / "none.toml", *outputs), *needles)
    assert not list(tmp_path.iterdir())
    code, out, err = cli("replay", tiny_golden, "--k", "2", "--report", "/dev/null", "--junit", "/dev/null")
    assert code == 0, err


@pytest.mark.parametrize("name", ["g.zarr", "g.zip"])
def test_refresh_replaces(cli, tmp_path, name):
    path = tmp_path / name
    assert cli("record", path, "--model", "tiny-llama", "--steps", "4", "--k", "2")[0] == 0
    assert cli("record", path, "--model", "tiny-qwen2", "--steps", "4", "--k", "2", "--refresh")[0] == 0
    code, out, err = cli("show", path)
    assert code == 0 and "tiny-qwen2" in out
    finish_removals()  # the replaced version is removed beside the caller (a process waits for it at exit)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "directory", "zarr.json"])
def test_damaged_goldens_exit_2(cli, tiny_copy, how):
    if how == "zarr.json":
        (tiny_copy / "zarr.json").write_text((tiny_copy / "zarr.json").read_text()[:50])
    else:
        damage(chunk(tiny_copy, 4, "logits", 6), how)
    for cmd in ("show", "history", "replay"):  # the replay's control moves steps 4-7 of K=4: their rows are read
        _one_line_error(*cli(cmd, tiny_copy), str(tiny_copy))


def test_an_undeclared_golden_edited_in_its_metadata_says_how_to_go_on(cli, tiny_copy):
    """An edited root metadata: `vd record` says pass --refresh, and the refresh, which reads its settings from
    that metadata, refused with no way on (a user test); it says how to go on."""
    edit_meta(tiny_copy, lambda m: m.update(prompt_text="x"), sealed=False)
    for argv in (["record", tiny_copy, "--refresh", "--reason", "x"], ["refresh", tiny_copy, "--reason", "x"]):
        _one_line_error(*cli(*argv), "does not hash to the golden's ID", "an undeclared golden is refreshed with "
                        "the settings its metadata holds, so this one cannot be: restore it (version control, a "
                        f"copy), or remove it and record it afresh (vd record {tiny_copy} with the flags")


def test_non_golden_paths_exit_2(cli, tiny_golden, tmp_path, monkeypatch):
    _one_line_error(*cli("replay", tmp_path / "nope.zarr"), "does not exist")
    (tmp_path / "dir").mkdir()
    _one_line_error(*cli("replay", tmp_path / "dir"), "not a vd golden")
    (tmp_path / "f.txt").write_text("x")
    _one_line_error(*cli("show", tmp_path / "f.txt"), "not a vd golden")
    zarr.create_group(tmp_path / "plain.zarr")
    _one_line_error(*cli("replay", tmp_path / "plain.zarr"), "not a vd golden")
    _one_line_error(*cli("replay", "gs://bucket/g.zarr"), "unsupported URL scheme")
    # an empty argument (an unset variable in a CI script) is not the working directory
    for argv in (["replay", ""], ["show", ""], ["verify", ""], ["diff", "", "b.zarr"], ["locate", ""],
                 ["slim", tiny_golden, ""], ["pack", tiny_golden, ""],
                 ["record", "", "--model", "tiny-llama"], ["history", ""], ["refresh", "", "--reason", "r"]):
        _one_line_error(*cli(*argv), "'': an empty path names no golden")
    # one slash after the scheme wrote a local folder s3:/ and said "wrote s3:/goldens/g.zarr" (a user test)
    monkeypatch.chdir(tmp_path)
    for argv in (["pack", tiny_golden, "s3:/goldens/g.zarr"], ["record", "S3:goldens/g.zarr", "--model", "tiny-llama"],
                 ["replay", "s3:/goldens/g.zarr"]):
        _one_line_error(*cli(*argv), "a URL needs two slashes after its scheme (s3://bucket/prefix)")
    assert not os.path.lexists("s3:") and not os.path.lexists("S3:goldens")


@pytest.mark.parametrize("args, needle", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "tiny-llama", "--forward", "flash"], "no forward 'flash'"),
    (["--model", "tiny-llama", "--k", "2,x"], "comma-separated"),
    (["--model", "tiny-llama", "--k", "1"], "K must be 2"),
    (["--model", "tiny-llama", "--k", "2,2"], "names a verify width twice"),
    (["--model", "tiny-llama", "--k", "2,,3"], "comma-separated"),  # a typo, not K=2,3
    (["--model", "tiny-llama", "--summary", "s.md"], "give it with --refresh"),  # else written by nothing
    (["--model", "tiny-llama", "--head", "no-such-head.safetensors"], "MTP head no-such-head.safetensors does not "
                                                                      "exist"),  # before the model loads
    (["--model", "tiny-llama", "--steps", "0"], "--steps"),
    (["--model", "tiny-llama", "--dtype", "int8"], "--dtype"),
    (["--model", f"{PLUGINS / 'notamodel.py'}:factory"], "lacks"),
    (["--model", f"{PLUGINS / 'positional.py'}:factory"],  # said before the call, not as its TypeError
     "its factory does not take the keywords device= and dtype= (vd calls factory(device=..., dtype=...))"),
    (["--model", f"{PLUGINS / 'positional.py'}:number"], "returned an object of type int, which lacks"),
    (["--model", f"{PLUGINS / 'positional.py'}:nothing"], "returned None, which lacks"),
    (["--model", f"{PLUGINS / 'absent.py'}:factory"], "does not exist"),
    (["--model", "tiny-llama", "--device", "cuda"] if not torch.cuda.is_available() else
     ["--model", "tiny-llama", "--device", "tpu"], "device"),
    (["--model", "tiny-llama", "--bogus-flag"], "No such option"),
    (["--model", "tiny-llama", "--compress"], "No such option"),  # rows are compact by default now
])
def test_bad_record_input_exits_2(cli, tmp_path, args, needle):
    path = tmp_path / "g.zarr"
    _one_line_error(*cli("record", path, *args), needle)
    assert not path.exists()


def test_model_mismatch(cli, tiny_golden, tmp_path):
    _one_line_error(*cli("replay", tiny_golden, "--model", "tiny-qwen2"), "vocab")
    reseeded = f"{PLUGINS / 'reseeded.py'}:factory"
    _one_line_error(*cli("replay", tiny_golden, "--model", reseeded), "fingerprint", "--allow-model-mismatch")
    code, out, err = cli("replay", tiny_golden, "--model", reseeded, "--allow-model-mismatch",
                         "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and r["verdict"] == "FAIL" and r["notes"] and "fingerprint" in r["notes"][0]


def test_replay_unknown_forward_exits_2(cli, tiny_golden):
    _one_line_error(*cli("replay", tiny_golden, "--forward", "flash"), "no forward 'flash'", "eager")
    # a forward named twice ran twice (two table rows, two JUnit cases of one name): refused as --k 2,2 is
    _one_line_error(*cli("replay", tiny_golden, "--forward", "sdpa", "--forward", "eager", "--forward", "sdpa"),
                    "--forward sdpa given twice")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_only_forward_asked_on_the_cpu_says_so(cli, tiny_golden):
    """`--forward graphed` where the model runs on the CPU: the line says it runs on CUDA only, not just that the
    model lacks it; before the model loads (it loaded first, a user test found), for a replay, a recording, a
    declared golden's recording (`vd status` and a suite replay's next step say so of one not recorded yet) and
    `vd locate`."""
    for args in [("replay", tiny_golden, "--forward", "graphed", "--forward", "eager"),
                 ("record", "x.zarr", "--model", "tiny-llama", "--forward", "graphed"),
                 ("record", "x.zarr", "--model", "tiny-llama", "--decode-forward", "graphed"),
                 ("locate", tiny_golden, "--between", "graphed")]:
        code, out, err = cli(*args)
        _one_line_error(code, out, err, "model tiny-llama has no forward 'graphed' on device 'cpu'",
                        "(graphed runs on CUDA only: --device cuda;")
        assert "loading" not in err, args


def test_replay_of_a_forward_this_device_lacks_names_the_choice(cli, tiny_copy):
    """A golden recorded with a forward this machine does not offer (``graphed`` on CUDA, replayed on a
    CPU): one line saying which forward it was and what to pass, not a bare 'no forward'."""
    edit_meta(tiny_copy, lambda m: m.update(forward="graphed"))
    _one_line_error(*cli("replay", tiny_copy), "recorded with forward 'graphed'", "on cpu", "--forward", "eager")
    code, out, err = cli("replay", tiny_copy, "--forward", "eager")
    assert code == 0, err


def test_a_foreign_engine_learns_every_flag_it_needs_in_one_error(cli, tiny_copy):
    """Another model (another fingerprint) lacking the golden's forward: one line names both flags, so one
    failed attempt is enough."""
    edit_meta(tiny_copy, lambda m: m.update(forward="graphed"))
    reseeded = f"{PLUGINS / 'reseeded.py'}:factory"
    _one_line_error(*cli("replay", tiny_copy, "--model", reseeded), "--allow-model-mismatch", "--forward NAME",
                    "'graphed'")
    code, out, err = cli("replay", tiny_copy, "--model", reseeded, "--allow-model-mismatch", "--forward", "eager")
    assert code == 1, err  # judged: another model, allowed by the user


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_golden_on_a_cpu_machine_says_what_to_pass(cli, tiny_copy):
    """A golden recorded on CUDA with a CUDA-only forward, replayed where there is no GPU: the one line
    names both flags it takes (--device cpu, and --forward unless one was given)."""
    edit_meta(tiny_copy, lambda m: m.update(device="cuda", forward="graphed"))
    _one_line_error(*cli("replay", tiny_copy), "no CUDA device", "--device cpu", "--forward", "'graphed'")
    code, out, err = cli("replay", tiny_copy, "--forward", "eager")
    assert code == 2 and "--device cpu" in err and "--forward" not in err
    code, out, err = cli("replay", tiny_copy, "--device", "cpu", "--forward", "eager")
    assert code == 0, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_on_a_cpu_machine_blames_the_flag_not_the_golden(cli, tiny_golden):
    _one_line_error(*cli("replay", tiny_golden, "--device", "cuda"), "--device cuda: this machine has no CUDA "
                    "device", "recorded on cpu")


def test_show_models_forwards(cli, tiny_golden):
    code, out, err = cli("show", tiny_golden)
    assert code == 0, err
    lines = out.splitlines()
    assert "tiny-llama" in out and "sha256:" in out and "forward   eager: " in out
    assert "K=4  accepted [3, 1, 3, 0, 3, 2, 3, 1]  histogram {0:1, 1:2, 2:1, 3:4}" in out
    assert any(line.startswith("          CPU ") and re.search(r", (1 thread|\d+ threads)$", line) for line in lines)
    assert "deterministic" not in out
    assert "rows as byte planes: high byte zstd-1 + crc32c, other bytes + crc32c" in out
    assert "each checked against its row's bytes" in out
    code, out, err = cli("models")
    assert code == 0 and "smollm2" in out and "tiny-llama" in out and "module:factory" in out
    code, out, err = cli("forwards", "--model", "tiny-llama")
    assert code == 0 and out.splitlines()[0].startswith("eager") and "sdpa" in out


def test_module_factory_plugin(cli, tiny_golden, monkeypatch, tmp_path):
    """The ``package.module:factory`` form: an importable module, here put on sys.path."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("VD_PERTURB_STEP", "5")
    code, out, err = cli("replay", tiny_golden, "--model", "perturb:factory", "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and all(v["comparisons"][0]["mismatched_step_list"] == [5] for v in r["verify"])
    code, out, err = cli("replay", tiny_golden, "--model", "no_such_module_xyz:factory")
    _one_line_error(code, out, err, "cannot import plug-in no_such_module_xyz: ModuleNotFoundError")
    assert "traceback in" not in err  # nothing of a plug-in ran


def test_a_plugin_raising_while_it_imports_keeps_its_traceback(cli, tiny_golden, tmp_path):
    """A plug-in file that raises while it imports: one line, exit 2, and its traceback in the file the line names
    (it was lost: found by a user test)."""
    plugin = tmp_path / "engine.py"
    plugin.write_text("import os\n\n\ndef _probe():\n    raise OSError('libcudart.so.13: cannot open shared object')"
                      "\n\n\n_probe()\n")
    code, out, err = cli("replay", tiny_golden, "--model", f"{plugin}:factory")
    _one_line_error(code, out, err, f"cannot import plug-in {plugin}: OSError: libcudart.so.13: cannot open shared "
                                    "object (traceback in ")
    trace = Path(err.split("traceback in ")[1].rstrip(")\n")).read_text()
    assert "_probe()" in trace and "raise OSError" in trace


def test_a_plugin_file_imports_the_modules_beside_it(cli, tiny_golden, tmp_path, monkeypatch):
    """A plug-in file's folder is on the import path while it loads, as a script's is: an engine split over
    several files in one folder loads by its entry file."""
    engine = tmp_path / "my_engine"
    engine.mkdir()
    (engine / "kernels_helper.py").write_text("from vd.models import load_model\n\n\n"
                                              "def build(device, dtype):\n"
                                              "    return load_model('tiny-llama', device=device, dtype=dtype)\n")
    (engine / "entry.py").write_text("import kernels_helper\n\n\ndef factory(device, dtype):\n"
                                     "    return kernels_helper.build(device, dtype)\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the folder the loader adds goes with the test
    code, out, err = cli("replay", tiny_golden, "--k", "2", "--model", f"{engine / 'entry.py'}:factory")
    assert code == 0 and "PASS" in out, err


def test_unwritable_destinations_exit_2(cli, tiny_golden, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _one_line_error(*cli("record", blocker / "g.zarr", "--model", "tiny-llama"), "is not a directory")
    _one_line_error(*cli("replay", tiny_golden, "--report", blocker / "r.json"), "not a writable directory")
    # A folder no file can be made in whatever its permission bits say (root may write anywhere but here):
    # refused before the replay, not after it, naming the path given rather than a temporary file.
    _one_line_error(*cli("replay", tiny_golden, "--report", "/proc/r.json"),
                    "cannot write --report /proc/r.json: /proc is not a writable directory")
    _one_line_error(*cli("record", "/proc/g.zarr", "--model", "tiny-llama"), "cannot write /proc/g.zarr: ")
    _one_line_error(*cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--prompt", ""), "no tokens")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("folder", ["unset", "missing", "a file"])
def test_an_internal_error_is_one_line_naming_its_traceback_file(cli, tiny_golden, monkeypatch, tmp_path, folder):
    """A crash of vd's own engine (here the built-in HF adapter's forward raising mid-run) exits 3 with one
    line; the traceback goes to the file that line names: in $VD_TRACEBACK_DIR, made if missing, else (unset,
    or a folder that cannot be made) in the system's temporary folder."""
    import tempfile

    from vd.models.hf import HFModel

    chosen = tmp_path / "ci" / "tracebacks"
    if folder == "unset":
        monkeypatch.delenv("VD_TRACEBACK_DIR")
    elif folder == "missing":  # (and relative: the line names it whole)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("VD_TRACEBACK_DIR", str(chosen.relative_to(tmp_path)))
    else:
        (tmp_path / "ci").write_text("")
        monkeypatch.setenv("VD_TRACEBACK_DIR", str(chosen))

    calls, forward = [], HFModel.forward

    def crashing(self, tokens):
        calls.append(len(tokens))
        if len(calls) == 4:
            raise RuntimeError("kernel fault at step 2")
        return forward(self, tokens)

    monkeypatch.setattr(HFModel, "forward", crashing)
    code, out, err = cli("replay", tiny_golden)
    _one_line_error(code, out, err, "internal error", "RuntimeError", "kernel fault at step 2", exit_code=3)
    trace = Path(err.split("traceback in ")[1].rstrip(")\n"))
    assert "Traceback" in trace.read_text() and "kernel fault at step 2" in trace.read_text()
    assert trace.parent == (chosen if folder == "missing" else Path(tempfile.gettempdir()))
    trace.unlink()


def test_a_plugin_raising_mid_run_is_named_exit_2(cli, tiny_golden, monkeypatch):
    """A plug-in whose forward raises mid-run is bad input (exit 2), named with what it raised; its
    traceback, the plug-in's frames included, goes to the file the line names."""
    monkeypatch.setenv("VD_CRASH_AT_STEP", "2")
    spec = f"{PLUGINS / 'crashing.py'}:factory"
    code, out, err = cli("replay", tiny_golden, "--model", spec)
    _one_line_error(code, out, err, f"plug-in {spec}: its forward raised RuntimeError: kernel fault at step 2 "
                                    "(at decode step 2; traceback in ")
    trace = Path(err.split("traceback in ")[1].rstrip(")\n"))
    assert "crashing.py" in trace.read_text() and "kernel fault at step 2" in trace.read_text()
    trace.unlink()


def test_slim_command_and_its_replays(cli, tiny_golden, tmp_path):
    slim = tmp_path / "s.zarr"
    code, out, err = cli("slim", tiny_golden, slim)
    assert code == 0 and f"wrote {slim}" in out and f"--rows {tiny_golden}" in out, out + err
    assert cli("replay", slim)[0] == 0
    code, out, err = cli("show", slim)
    assert code == 0 and "slim: no rows (made from" in out
    _one_line_error(*cli("replay", slim, "--tolerance", "kl:0.1"), "is slim", "--rows")
    code, out, err = cli("replay", slim, "--tolerance", "kl:0.1", "--rows", tiny_golden)
    assert code == 0, err
    # A slim golden's rows are not there to measure: its table says "-", not "nan".
    page = tmp_path / "s.html"
    code, out, err = cli("replay", slim, "--model", "tests/plugins/perturb.py:factory", "--k", "2", "--html", page)
    row = next(line for line in out.splitlines() if line.startswith("│ 2 ") and "FAIL" in line)
    assert code == 1 and "nan" not in out and row.split("│")[6].strip() == "-", out
    assert ">nan<" not in page.read_text()
    _one_line_error(*cli("slim", tiny_golden, slim), "already holds a golden")
    assert cli("slim", tiny_golden, slim, "--refresh")[0] == 0


def test_goldens_in_a_zip_file_and_on_s3(cli, tiny_golden, tmp_path, s3):
    """record, replay, show, slim and diff with a golden in a zip file and one under an s3:// prefix."""
    for where in (tmp_path / "g.zip", s3):
        code, out, err = cli("record", where, "--model", "tiny-llama", "--steps", "8")
        assert code == 0 and f"recorded {where}" in out, err
        code, out, err = cli("replay", where, "--report", tmp_path / "r.json")
        assert code == 0 and json.loads((tmp_path / "r.json").read_text())["golden"] == str(where), out + err
        code, out, err = cli("show", where)
        assert code == 0 and str(where) in out.splitlines()[0], err
        assert cli("diff", tiny_golden, where)[0] == 0
    code, out, err = cli("slim", s3, tmp_path / "s.zip")
    assert code == 0, err
    assert cli("replay", tmp_path / "s.zip", "--rows", s3, "--tolerance", "kl:0.1")[0] == 0
    _one_line_error(*cli("record", s3, "--model", "tiny-llama"), "already holds a golden")
    from vd.store.objects import ObjectPrefix

    with ObjectPrefix(s3).writer():  # another writer is at work: a refresh is refused, the golden kept
        _one_line_error(*cli("record", s3, "--refresh", "--reason", "r", "--steps", "4"),
                        "is being written by another vd process")
    assert cli("replay", s3)[0] == 0


def test_no_output_lands_in_or_over_a_golden_on_s3(cli, tiny_golden, tmp_path, s3):
    """Outputs on S3 get the local paths' guard: a recording, a slim form or a candidate inside an S3 golden's
    prefix, and a candidate over an S3 golden that is not a candidate, are refused in one line; the golden stays."""
    code, out, err = cli("record", s3, "--model", "tiny-llama", "--steps", "8")
    assert code == 0, err
    inside = f"{s3}/inner.zarr"
    _one_line_error(*cli("record", inside, "--model", "tiny-llama", "--steps", "4"), f"is inside the golden {s3}")
    _one_line_error(*cli("slim", tiny_golden, inside), f"is inside the golden {s3}")
    _one_line_error(*cli("replay", tiny_golden, "--save-candidate", inside), f"is inside the golden {s3}")
    _one_line_error(*cli("replay", tiny_golden, "--save-candidate", s3), "is a golden, not an earlier candidate")
    assert cli("verify", s3)[0] == 0


# -- usage errors before torch; help; version --------------------------------------------------------------
_AUDIT = """
import contextlib, io, json, sys
from vd.cli import app
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            app(argv, prog_name="vd")
        except SystemExit as e:
            code = e.code
    heavy = [m for m in ("torch", "transformers", "vd.models.hf") if m in sys.modules]
    results.append({"argv": argv, "code": code, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy})
print(json.dumps(results))
"""


def _audit(cwd: Path, *argvs: list[str]) -> list[dict]:
    """Run each command line in turn in one fresh interpreter: its exit code, output and the heavy modules
    imported so far (torch, transformers, the HF adapter)."""
    done = subprocess.run([sys.executable, "-c", _AUDIT, json.dumps(argvs)], capture_output=True, text=True,
                          cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_mistakes_about_a_golden_are_answered_before_torch_is_imported(tiny_golden, tmp_path):
    """What a golden's metadata settles, read as plain JSON: a verify width it lacks, a forward its model has
    not, a golden already at a recording's destination, and what this machine cannot give (threads, CUDA)."""
    import torch

    g = str(tiny_golden)
    cases = [
        (["replay", g, "--k", "7"], "has no verify width [7]; it holds K = [2, 3, 4]"),
        (["replay", g, "--k", "2,2"], "names a verify width twice"),  # as record refuses it
        (["replay", g, "--k", ",2,"], "comma-separated"),
        (["replay", g, "--forward", "eager", "--forward", "flash"], "no forward 'flash'"),
        (["replay", g, "--threads", "64"], "--threads must be 1 to"),
        (["record", g, "--model", "tiny-llama"], "already holds a golden; pass --refresh"),
        (["record", str(tmp_path / "g.zarr"), "--threads", "64"], "--threads must be 1 to"),
        (["show", str(tiny_golden / "k2")], "is a zarr group but not a vd golden"),
    ]
    if not torch.cuda.is_available():
        cases += [(["replay", g, "--device", "cuda"], "--device cuda: this machine has no CUDA device"),
                  (["record", str(tmp_path / "g.zarr"), "--device", "cuda"], "this machine has no CUDA device")]
    for r, (argv, needle) in zip(_audit(tmp_path, *[argv for argv, _ in cases]), cases):
        assert not r["heavy"], (argv, r["heavy"])
        _one_line_error(r["code"], r["out"], r["err"], needle)
    assert not list(tmp_path.iterdir())


def test_a_refresh_of_a_slim_golden_is_refused_before_torch_is_imported(tiny_golden, tmp_path):
    """`vd refresh SLIM` (and a full candidate over it) is refused from the root metadata alone (`vd.preflight`),
    its one line naming the full golden's refresh and the slim form written again."""
    from vd.store import slim

    s = tmp_path / "s.zarr"
    slim(tiny_golden, s)
    cases = [(["refresh", str(s), "--reason", "x"], f"(vd slim {tiny_golden} {s} --refresh)"),
             (["refresh", str(s), "--from", str(tiny_golden), "--reason", "x"],
              f"(vd refresh {tiny_golden} --from {tiny_golden} --reason TEXT)")]
    for r, (argv, needle) in zip(_audit(tmp_path, *[argv for argv, _ in cases]), cases):
        assert not r["heavy"], (argv, r["heavy"])
        _one_line_error(r["code"], r["out"], r["err"], needle)


def test_usage_errors_are_answered_before_torch_is_imported(tmp_path):
    """Each mistake answers with its one line and exit 2 without importing torch or loading a model;
    `vd models`, `--help` and `--version` import nothing heavy either."""
    cases = [
        (["replay", "nosuch.zarr"], "nosuch.zarr does not exist"),
        (["replay", ""], "an empty path names no golden"),
        (["record", "", "--model", "tiny-llama"], "an empty path names no golden"),
        (["replay", "nosuch.zarr", "--k", "2,x"], "comma-separated"),
        (["replay", "nosuch.zarr", "--rows", "full.zarr"], "does not exist"),
        (["show", "nosuch.zarr"], "does not exist"),
        (["slim", "nosuch.zip", "out.zarr"], "nosuch.zip does not exist"),
        (["diff"], "Missing argument 'A'"),
        (["diff", "a.zarr", "b.zarr"], "a.zarr does not exist"),
        (["diff", str(tmp_path), "b.zarr"], "is not a vd golden (no zarr.json)"),
        (["replay", str(tmp_path), "--model", "tiny-llama", "--forward", "flash"], "is not a vd golden (no zarr.json)"),
        (["record", "out.zarr", "--forward", "flash"], "no forward 'flash'"),
        (["record", "out.zarr", "--model", "no-such-model"], "unknown model"),
        (["record", "out.zarr", "--k", "2,x"], "comma-separated"),
        (["record", "out.zarr", "--feed", "greedy"], "--feed"),
        (["record", "out.zarr", "--device", "tpu"], "unknown device 'tpu'"),
        (["replay", "nosuch.zarr", "--device", "cuda:x"], "unknown device"),
        (["record", "out.zarr", "--dtype", "int8"], "Invalid value for '--dtype': 'int8' is not one of"),
        (["record", "out.zarr", "--steps", "0"], "--steps"),
        (["record", "out.zarr", "--threads", "0"], "--threads"),
        (["record", "out.zarr", "--k", "1"], "verify width K must be 2..16; got [1]"),  # (took 2 s: a user test)
        (["record", "out.zarr", "--k", "2,17"], "verify width K must be 2..16; got [17]"),
        (["refresh", "tinny", "--reason", "x"], "'tinny' is neither a declared golden nor a golden on disk"),
        # a one-value option given twice: click kept the last without a word (--k 2 --k 3 ran K=3 alone)
        (["replay", "nosuch.zarr", "--k", "2", "--k", "3"], "--k given 2 times (2, 3): it takes one value (--k 2,3"),
        (["record", "out.zarr", "--steps=4", "--steps", "5"], "--steps given 2 times (4, 5)"),
        (["record", "out.zarr", "--prompt", "--k", "--k", "2", "--steps", "0"], "--steps"),  # a value like --k is one
    ]
    fine = [["models"], ["--help"], ["--version"], ["replay", "--help"], ["record", "--help"]]
    results = _audit(tmp_path, *[argv for argv, _ in cases], *fine)
    for r, (argv, needle) in zip(results, cases):
        assert not r["heavy"], (argv, r["heavy"])
        _one_line_error(r["code"], r["out"], r["err"], needle)
    for r in results[len(cases):]:
        assert r["code"] == 0 and not r["heavy"] and r["out"], r
    assert not list(tmp_path.iterdir())


def test_a_zip_golden_cut_short_is_named_as_such(cli, tiny_golden, tmp_path):
    """A zip golden truncated (a copy or an upload cut short) was "not a vd golden (a golden is a zarr directory,
    a .zip file or an s3:// prefix)", which it seemed to be; it is named a zip file that cannot be read."""
    whole, cut = tmp_path / "g.zip", tmp_path / "cut" / "g.zip"
    assert cli("pack", tiny_golden, whole)[0] == 0
    cut.parent.mkdir()
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    for argv in (["show", str(cut)], ["replay", str(cut)], ["verify", str(cut)]):
        (r,) = _audit(cut.parent, argv)
        _one_line_error(r["code"], r["out"], r["err"], f"{cut} is not a readable zip file (no zip directory at its "
                        "end: truncated, damaged or not a zip)")


@pytest.mark.parametrize(("offset", "byte", "raised"), [(0, 0x00, "BadZipFile: Bad magic number for central "
                                                                "directory"),
                                                        (6, 0xff, "NotImplementedError: zip file version")])
def test_a_zip_golden_damaged_in_its_directory_exits_2(cli, tiny_golden, tmp_path, offset, byte, raised):
    """A zip golden whose central directory is damaged within (its first entry's signature, or the version it
    needs to extract) was an internal error, exit 3 (found by a user test): it is a zip that cannot be read."""
    import struct

    good, bad = tmp_path / "g.zip", tmp_path / "bad.zip"
    assert cli("pack", tiny_golden, good)[0] == 0
    data = bytearray(good.read_bytes())
    end = data.rfind(b"PK\x05\x06")
    data[struct.unpack("<I", data[end + 16:end + 20])[0] + offset] = byte  # the first central directory entry
    bad.write_bytes(bytes(data))
    for argv in (["verify", str(bad)], ["show", str(bad)], ["replay", str(bad)]):
        _one_line_error(*cli(*argv), f"{bad} is not a readable zip file: {raised}")


def test_one_kind_given_two_tolerances_is_refused(cli, tiny_golden):
    """`--tolerance verify=kl:0.1 --tolerance verify=argmax` stored the last alone without a word (a user test);
    a SPEC for every kind, then one kind's, still layers."""
    _one_line_error(*cli("replay", tiny_golden, "--tolerance", "verify=kl:0.1", "--tolerance", "verify=argmax"),
                    "--tolerance verify= given 2 times (kl:0.1, argmax): a kind takes one SPEC")
    code, out, err = cli("replay", tiny_golden, "--k", "2", "--tolerance", "ulp:2", "--tolerance", "verify=exact")
    assert code == 0 and "verify exact" in out and "prefill ulp:2" in out, out + err


def test_a_bad_tolerance_is_refused_before_a_model_is_loaded(tmp_path):
    (r,) = _audit(tmp_path, ["record", "out.zarr", "--model", "tiny-llama", "--tolerance", "verify=ulp"])
    _one_line_error(r["code"], r["out"], r["err"], "unknown tolerance 'ulp'")
    assert "vd.models.hf" not in r["heavy"] and "transformers" not in r["heavy"]  # no model layer
    v6 = str(Path(__file__).parent / "data" / "tiny-llama-v6.zarr")
    (r,) = _audit(tmp_path, ["diff", v6, v6, "--tolerance", "bogus=exact"])
    _one_line_error(r["code"], r["out"], r["err"], "unknown row kind 'bogus'")


def test_names_the_command_line_checks_early_match_the_layers_below():
    """The choices and forward names the command line checks before importing torch are those below."""
    from vd.cli.app import Dtype, Feed
    from vd.dtypes import DTYPES
    from vd.models import BUILTIN_FORWARDS
    from vd.models.hf import all_forwards
    from vd.recorder.record import FEEDS

    assert tuple(Feed) == FEEDS and tuple(Dtype) == tuple(DTYPES)
    assert BUILTIN_FORWARDS == tuple(all_forwards())


def _help(*args: str) -> str:
    r = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"}, prog_name="vd")
    assert r.exit_code == 0, r.output
    return re.sub(r"\x1b\[[0-9;]*m", "", r.stdout)  # FORCE_COLOR in the environment colours it


@pytest.mark.parametrize("command, usage", [
    ("record", "[OUT|NAME]..."), ("replay", "[GOLDEN|NAME]..."),
    ("show", "{GOLDEN}"), ("slim", "{GOLDEN} {OUT}"), ("diff", "{A} {B}"),
    ("models", ""), ("forwards", ""),
])
def test_help_shows_choices_plain_flags_metavars_and_ends_with_examples(command, usage):
    text = _help(command)
    assert f"Usage: vd {command} [OPTIONS] {usage}".rstrip() in text
    assert "<bool>" not in text and "list[" not in text and "<str>" not in text
    lines = [line.strip(" │") for line in text.splitlines() if line.strip(" │")]
    examples = lines[lines.index("Examples:") + 1:]
    assert 1 <= len(examples) <= 3 and all(e.startswith(f"vd {command}") for e in examples), lines[-5:]
    if command == "record":
        for shown in ("--feed", "reference|mtp", "--dtype", "bfloat16|float16|float32", "--device", "cpu|cuda|cuda:N",
                      "--tolerance", "[KIND=]SPEC", "--k", "K,K,...", "--refresh "):
            assert shown in text, shown
    if command == "replay":
        assert re.search(r"--forward +NAME", text) and re.search(r"--tolerance +\[KIND=\]SPEC", text)


@pytest.mark.parametrize("command", sorted(typer.main.get_command(app).commands))
def test_help_paragraphs_flow_at_the_terminals_width(command):
    """A docstring's paragraph is rewrapped at the terminal's width, not kept at its source line breaks (a
    100-column help would otherwise show each 110-column source line as a long line and a stub)."""
    r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "100", "TERMINAL_WIDTH": "100"}, prog_name="vd")
    assert r.exit_code == 0, r.output
    text = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout)
    body = text.split(" Usage: ", 1)[1].split("╭", 1)[0].splitlines()[2:]  # the description, before the options
    lines = [line.strip() for line in body]
    for line, after in zip(lines, lines[1:]):
        assert not (line and after and len(line) < 60), (line, after)  # only a paragraph's last line is short


def test_version_and_top_level_help(cli):
    code, out, err = cli("--version")
    assert code == 0 and out == f"vd {vd.__version__}\n" == "vd 0.1.0\n"
    text = _help()
    assert "--version" in text and "<bool>" not in text and "vd replay goldens/" in text


# -- progress in a log ------------------------------------------------------------------------------------
def test_progress_off_a_terminal_is_plain_lines(cli, tiny_golden, tmp_path):
    """CliRunner's stderr is no terminal: a line as each phase starts and one as it ends with its count and
    seconds, no carriage returns or terminal codes."""
    code, out, err = cli("replay", tiny_golden, "--k", "2,4")
    assert code == 0, err
    assert "\r" not in err and "\x1b" not in err
    lines = err.splitlines()
    assert lines[:2] == ["vd: loading model", lines[1]] and re.fullmatch(r"vd: loading model: done in \d+\.\d s",
                                                                          lines[1])
    for k in (2, 4):
        for phase in (f"K={k} eager", f"K={k} control"):
            at = lines.index(f"vd: {phase} (8 steps)")
            assert re.fullmatch(rf"vd: {phase}: 8/8 steps in \d+\.\d s", lines[at + 1]), lines
    code, out, err = cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--steps", "4", "--k", "2")
    assert code == 0, err
    assert [line.split(":")[1].split(" (")[0].strip() for line in err.splitlines()[::2]] == [
        "loading model", "greedy continuation", "recording K=2", "writing golden"]
    # 4 steps at K=2: 8 one-token decodes after the prefill (the decode group), 9 tokens of continuation
    assert "vd: greedy continuation (8 steps)" in err and re.search(r"greedy continuation: 8/8 steps in", err)


def test_the_control_shows_on_the_row_of_the_forward_it_ran_under(cli, tiny_golden):
    """With several forwards the control runs under the last: only its row says how the control went (the
    passing eager row read "inconclusive", which was sdpa's)."""
    code, out, err = cli("replay", tiny_golden, "--forward", "eager", "--forward", "sdpa", "--k", "2")
    verdict_table = out.split("axes:")[0]  # the axes table below it has rows per K and forward too
    rows = {cells[2]: cells for line in verdict_table.splitlines()
            if len(cells := [c.strip() for c in line.split("│")]) > 3 and cells[1] == "2"}
    assert rows["eager"][-2] == "-" and rows["sdpa"][-2] in ("fired", "inconclusive"), out


def test_a_terminal_bar_stops_each_phase_timer_when_the_next_begins():
    """On a terminal each phase is a task; a phase of unknown length (loading the model) is finished, its
    timer stopped, when the next phase begins, rather than running on for the whole replay."""
    from rich.console import Console

    from vd.cli.common import TerminalBar

    with TerminalBar(Console(file=io.StringIO(), force_terminal=True)) as bar:
        bar.phase("loading model", 0)
        bar.phase("K=2 eager", 3)
        for s in range(3):
            bar.step(s)
        loading, run = bar.progress.tasks
        assert loading.finished and loading.stop_time is not None and loading.total == loading.completed == 1
        elapsed = loading.elapsed
        assert run.completed == 3 and not run.stop_time
        assert bar.progress.tasks[0].elapsed == elapsed  # stopped: no longer counting


def test_a_terminal_bar_ended_leaves_what_is_printed_next_alone():
    """`end` takes the bars off the terminal (a suite prints each golden's line there); the next phase's bars start
    below that line, never moving the cursor up over it to redraw the bars before."""
    from rich.console import Console

    from vd.cli.common import TerminalBar

    screen = io.StringIO()
    with TerminalBar(Console(file=screen, force_terminal=True)) as bar:
        bar.phase("recording K=2", 2)
        bar.step(0)
        bar.end()
        screen.write("a    RECORDED\n")
        bar.phase("recording K=3", 2)
        bar.step(0)
    after = screen.getvalue().split("a    RECORDED\n", 1)[1]
    assert "recording K=3" in after and "\x1b[1A" not in after.split("recording K=3")[0], repr(after)
    assert "recording K=2" not in after


def test_progress_lines_count_steps_and_seconds():
    times = iter([0.0, *[2.5 * (i + 1) / 16 for i in range(16)], 2.5, 2.5, 3.0])
    stream = io.StringIO()
    p = Lines(stream, clock=times.__next__)
    p.phase("K=2 eager", 16)
    for s in range(16):
        p.step(s)
    p.phase("writing golden", 0)
    p.end()
    p.end()  # nothing open: nothing written
    assert stream.getvalue() == ("vd: K=2 eager (16 steps)\nvd: K=2 eager: 16/16 steps in 2.5 s\n"
                                 "vd: writing golden\nvd: writing golden: done in 0.5 s\n")


def test_a_phase_that_failed_is_not_said_done(cli, tmp_path, monkeypatch):
    """A phase ended by an error says so: counted, where it stopped. A suite ends a golden's last phase so when
    the golden is an ERROR (a declared model that does not load was `loading smolm2: done in 0.0 s`)."""
    times = iter([0.0, 0.5, 1.0, 1.25, 2.0])
    stream = io.StringIO()
    p = Lines(stream, clock=times.__next__)
    p.phase("loading m", 0)
    p.end(failed=True)
    p.phase("K=2 eager", 16)
    p.step(0)
    p.end(failed=True)
    assert stream.getvalue().splitlines() == ["vd: loading m", "vd: loading m: failed after 0.5 s",
                                              "vd: K=2 eager (16 steps)", "vd: K=2 eager: failed at 1/16 steps after "
                                              "1.0 s"]
    (tmp_path / "ckpt").mkdir()  # a checkpoint folder that holds none: refused only once it is loaded
    (tmp_path / "vd.toml").write_text('[goldens.c]\npath = "c.zarr"\nmodel = "ckpt"\n')
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("record", "--suite")
    lines = err.splitlines()
    ckpt = tmp_path / "ckpt"  # (a declared model's folder, from the declaring file's)
    assert code == 2 and lines[0] == f"vd: loading {ckpt}" and lines[1].startswith(f"vd: loading {ckpt}: failed after ")
    assert "done" not in err, err


@pytest.mark.parametrize("declared, said", [
    ('model = "tiny-lama"', "unknown model 'tiny-lama'"),
    ('model = "tiny-llama"\nthreads = 99', "--threads must be 1 to"),
    ('model = "tiny-llama"\nforward = "flash"', "no forward 'flash'"),
    ('model = "tiny-llama"\ndecode_forward = "nope"', "no forward 'nope'"),
])  # (a bad policy or batch is the declaration's own error, before any of this)
def test_a_suite_with_a_declaration_that_cannot_work_records_nothing(cli, tmp_path, monkeypatch, declared, said):
    """A declared golden a single `vd record` would refuse from its flags alone: the suite recorded the goldens
    declared before it first, then stopped (found by a user test). Refused whole (exit 2), naming it."""
    (tmp_path / "vd.toml").write_text('[goldens.a]\npath = "a.zarr"\nmodel = "tiny-llama"\nk = [2]\nsteps = 4\n\n'
                                      f'[goldens.b]\npath = "b.zarr"\n{declared}\n')
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("record", "--suite")
    assert code == 2 and "golden 'b' cannot be recorded as declared: " in err and said in err, out + err
    assert not (tmp_path / "a.zarr").exists()
    code, out, err = cli("status", "--no-models")  # says so of the missing golden before anyone records it
    assert code == 1 and "  b: vd record --suite would refuse it: golden 'b' cannot be recorded as declared: " in out
    assert said in out and "  a: " not in out, out + err
    code, out, err = cli("replay", "--suite")  # its next step is not a recording that would be refused
    assert code == 2 and "  - record it: vd record --suite a" in out.splitlines(), out + err
    assert "  - change its declaration: golden 'b' cannot be recorded as declared: " in out and said in out, out


def test_a_stale_golden_replayed_by_name_says_so(cli, tmp_path, monkeypatch):
    """A declared golden whose declaration moved on (steps 8 -> 6): replayed by name it PASSed without a word, while
    the suite called it an ERROR (found by a user test). Replayed as stored, with a note naming what moved."""
    (tmp_path / "vd.toml").write_text('[goldens.t]\npath = "t.zarr"\nmodel = "tiny-llama"\nk = [2]\nsteps = 8\n')
    monkeypatch.chdir(tmp_path)
    assert cli("record", "--suite")[0] == 0
    code, out, err = cli("replay", "t")
    assert code == 0 and "stale" not in err, err
    (tmp_path / "vd.toml").write_text('[goldens.t]\npath = "t.zarr"\nmodel = "tiny-llama"\nk = [2]\nsteps = 6\n')
    for target in ("t", "t.zarr"):
        code, out, err = cli("replay", target)
        assert code == 0 and "PASS" in out, err
        assert "vd: note: t is stale against its declaration (steps: recorded 8, declared 6): replayed as stored; " \
            "vd replay --suite calls it an ERROR until vd record --suite t --refresh --reason TEXT" in err, err


def test_near_misses_name_what_was_meant(cli, tiny_golden, tmp_path, monkeypatch):
    """Three mistakes whose lines said too little (a user test): a mistyped declared name ("tinny does not exist"),
    a tolerance without its number ("unknown tolerance 'ulp'"), a mistyped axis to locate (only forwards named)."""
    (tmp_path / "vd.toml").write_text(f'[goldens.tiny]\npath = "{tiny_golden}"\nmodel = "tiny-llama"\n')
    monkeypatch.chdir(tmp_path)
    _one_line_error(*cli("replay", "tinny"), f"tinny does not exist, and {tmp_path / 'vd.toml'} declares no golden "
                                             "of that name (it declares tiny)")
    _one_line_error(*cli("replay", "tiny", "--tolerance", "verify=ulp"), "(ulp takes its number: ulp:N)")
    _one_line_error(*cli("locate", "tiny", "--between", "decdoe"), "--between decdoe: model tiny-llama has no "
                    "forward 'decdoe'", "; or the axes decode and batch:N")


def test_a_long_phase_says_its_count_every_half_minute():
    """The greedy continuation is about half a CPU recording: a log gets its count every 30 s, not one line
    at each end minutes apart."""
    times = iter([0.0, *[10.0 * (i + 1) for i in range(10)], 100.0])
    stream = io.StringIO()
    p = Lines(stream, clock=times.__next__)
    p.phase("greedy continuation", 10)
    for s in range(10):
        p.step(s)
    p.end()
    assert stream.getvalue().splitlines() == [
        "vd: greedy continuation (10 steps)", "vd: greedy continuation: 3/10 steps, 30 s",
        "vd: greedy continuation: 6/10 steps, 60 s", "vd: greedy continuation: 9/10 steps, 90 s",
        "vd: greedy continuation: 10/10 steps in 100.0 s"]


# -- forwards on this machine -----------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_forwards_lists_only_what_this_machine_runs(cli):
    code, out, err = cli("forwards", "--model", "tiny-llama")
    assert code == 0, err
    *listed, last = out.splitlines()
    names = [line.split()[0] for line in listed]
    assert names[:2] == ["eager", "sdpa"] and "static" in names
    assert not {"graphed", "compiled", "compiled-graphed", "sdpa-efficient", "sdpa-cudnn"} & set(names)
    assert {"sdpa-math", "sdpa-flash"} <= set(names)  # the SDPA backends PyTorch has on a CPU
    assert last == ("left out: sdpa-efficient, sdpa-cudnn, graphed, compiled, compiled-graphed (they run on CUDA only; "
                    "this machine has no CUDA device)")
    code, _, err = cli("record", "x.zarr", "--model", "tiny-llama", "--steps", "2", "--forward", "sdpa-cudnn")
    assert code == 2 and "sdpa-cudnn runs on CUDA only: --device cuda" in err, err
    _one_line_error(*cli("forwards", "--device", "cuda"), "no CUDA device")


# -- tools/setup.sh ---------------------------------------------------------------------------------------
def _setup_env(path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VD_SYSTEM_PIP", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PATH": f"{path}{os.pathsep}{env.get('PATH', '')}"}


def test_setup_needs_no_root_and_no_system_packages():
    text = (ROOT / "tools" / "setup.sh").read_text()
    assert not re.search(r"\b(apt|apt-get|sudo|chromium)\b", text)
    assert "python3 -m pip" not in text and '"$PY" -m pip install' in text  # the active interpreter's pip


def test_setup_outside_a_virtual_environment_says_to_make_one(tmp_path):
    """Outside a virtual environment (Debian's python would refuse pip) it stops with one line, before pip."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    done = subprocess.run(["bash", str(ROOT / "tools" / "setup.sh")], capture_output=True, text=True,
                          env=_setup_env(str(bin_dir)), timeout=60)
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and "not in a virtual environment" in done.stderr
    assert "python3 -m venv .venv && . .venv/bin/activate" in done.stderr and "VD_SYSTEM_PIP=1" in done.stderr


def test_setup_in_a_virtual_environment_uses_its_pip(tmp_path):
    """In a virtual environment it goes on to the environment's own pip (absent here, so it stops there)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    done = subprocess.run(["bash", str(ROOT / "tools" / "setup.sh")], capture_output=True, text=True,
                          env=_setup_env(str(venv / "bin")), timeout=60)
    assert done.returncode != 0 and "No module named pip" in done.stderr, done
    assert str(venv / "bin" / "python3") in done.stderr and "virtual environment" not in done.stderr


# -- hostile engines and settings: one line, exit 2 ------------------------------------------------------------
MISBEHAVING = str(PLUGINS / "misbehaving.py")


@pytest.mark.parametrize("factory, needle", [
    ("raising", "misbehaving.py:raising: its factory raised RuntimeError: no GPU context could be created"),
    ("wide", "forward of 66 token(s) returned torch.bfloat16 rows of shape [66, 513]; the protocol wants "
             "torch.bfloat16 rows of shape [66, 512]"),
    ("flat", "returned torch.bfloat16 rows of shape [512]"),
    ("float32", "returned torch.float32 rows of shape [66, 512]"),
    ("elsewhere", "misbehaving.py:elsewhere: forward returned rows on meta, not on the model's device cpu"),
    ("nan", "the model computed non-finite logits (NaN or Inf) in its one-token decodes (the greedy continuation): "
            "prefill row 0"),
    # NaN in one late one-token decode alone: the golden was stored with it, and replays judged against it
    ("nan_late_decode", "non-finite logits (NaN or Inf) in its one-token decodes (the greedy continuation): verify "
                        "step 6"),
    ("vocabless", "misbehaving.py:vocabless: its vocab_size raised RuntimeError: the engine has no vocabulary loaded"),
    ("textual_vocab", "misbehaving.py:textual_vocab: its vocab_size is '512', expected a positive int"),
])
def test_a_misbehaving_engine_is_named_in_one_line(cli, tmp_path, factory, needle):
    out = tmp_path / "g.zarr"
    code, _, err = cli("record", out, "--model", f"{MISBEHAVING}:{factory}", "--k", "2", "--steps", "4")
    _one_line_error(code, "", err, needle)
    assert not out.exists()


EXITING = str(PLUGINS / "exiting.py")


@pytest.mark.parametrize("factory, needle", [
    ("exit0_in_forward", "its forward raised SystemExit: 0"),
    ("exit1_in_forward", "its forward raised SystemExit: 1"),
    ("doom_in_forward", "its forward raised Doom: the engine's own way out"),
    ("exit0_in_factory", "its factory raised SystemExit: 0"),
    ("identity_raising", "its identity raised LookupError: no fingerprint for this build"),
    ("exit0_in_set_forward", "its set_forward raised SystemExit: 0"),
])
@pytest.mark.parametrize("command", ["record", "replay"])
def test_a_plugin_ending_the_process_is_named_exit_2(cli, tmp_path, tiny_golden, factory, needle, command):
    """A plug-in that calls sys.exit(0) (which would read as PASS with no verdict), raises SystemExit(1) or a
    BaseException that is not an Exception (which would read as FAIL), or whose identity raises, is bad input:
    exit 2, one line naming the plug-in, the method and what it raised, the call of the run (a user test missed
    it), its traceback in the file named; a recording leaves no golden."""
    out, spec = tmp_path / "g.zarr", f"{EXITING}:{factory}"
    args = ("record", out, "--steps", "4") if command == "record" else ("replay", tiny_golden)
    code, _, err = cli(*args, "--model", spec, "--k", "2")
    at = "at decode step 1; " if "its forward" in needle else ""  # (its third call: the run names it)
    _one_line_error(code, "", err, f"plug-in {spec}: {needle} ({at}traceback in ")
    trace = Path(err.split("traceback in ")[1].rstrip(")\n"))
    assert "exiting.py" in trace.read_text()
    trace.unlink()
    assert not out.exists()


def test_a_plugins_set_forward_still_raises_key_error_for_a_name_it_lacks():
    """The guard passes on what the protocol lets a method raise: set_forward's KeyError for an unknown name."""
    from vd.models import load_model

    model = load_model(f"{EXITING}:exit0_in_forward")  # (its forward is what misbehaves)
    with pytest.raises(KeyError):
        model.set_forward("no-such-forward")


@pytest.mark.parametrize("change, said", [
    ("identity=lambda: ModelIdentity(ident.name, '', {})", "its identity() is ModelIdentity("),
    ("identity=lambda: ModelIdentity(ident.name, 12345, {})", "whose name and fingerprint are non-empty"),
    ("identity=lambda: 'tiny'", "its identity() is 'tiny', expected a vd.protocol.ModelIdentity"),
    ("forwards=lambda: ['eager']", "its forwards() is ['eager'], expected a mapping of each forward's name"),
    ("default_forward=lambda: 'turbo'", "its default_forward() is 'turbo', which its forwards() do not offer (eager,"),
])
def test_a_plugins_identity_and_forwards_are_checked_when_it_loads(cli, tmp_path, tiny_golden, change, said):
    """A plug-in whose identity has an empty (or int) fingerprint was recorded (exit 0) into a golden no command could
    open again; forwards() as a list crashed a replay after its runs (exit 3); a default forward it does not offer
    was blamed on the wrapped preset (found by a user test). Each is the plug-in's one line at load (exit 2)."""
    plugin = tmp_path / "engine.py"
    plugin.write_text("from vd.models import load_model\nfrom vd.protocol import ModelIdentity\n\n\n"
                      "def factory(device, dtype):\n"
                      "    inner = load_model('tiny-llama', device=device, dtype=dtype)\n"
                      "    ident = inner.identity()\n"
                      f"    for name, value in dict({change}).items():\n"
                      "        setattr(inner, name, value)\n"
                      "    return inner\n")
    for args in (("record", tmp_path / "g.zarr", "--k", "2", "--steps", "4"), ("replay", tiny_golden)):
        code, _, err = cli(*args, "--model", f"{plugin}:factory")
        _one_line_error(code, "", err, f"plug-in {plugin}:factory: ", said)
    assert not (tmp_path / "g.zarr").exists()


@pytest.mark.parametrize("factory, needle", [
    ("one_short", "propose was asked for 1 draft(s) and returned []; the protocol wants 1 token id(s) below the "
                  "vocabulary size 512"),
    ("rows_short", "propose of 1 draft(s) returned torch.bfloat16 rows of shape [0, 512] on cpu; the protocol "
                   "wants torch.bfloat16 rows of shape [1, 512] on cpu"),
    ("beyond_vocab", "the protocol wants 1 token id(s) below the vocabulary size 512"),
])
def test_a_draft_head_breaking_propose_is_named_in_one_line(cli, tmp_path, factory, needle):
    """A draft head proposing one draft too few (an AssertionError deep in the loop, exit 3, found by a user test),
    too few rows, or tokens past the vocabulary: one line naming the plug-in, exit 2, no golden."""
    out = tmp_path / "g.zarr"
    code, _, err = cli("record", out, "--model", f"{MISBEHAVING}:{factory}", "--feed", "mtp", "--k", "2",
                       "--steps", "4")
    _one_line_error(code, "", err, f"misbehaving.py:{factory}: propose ", needle)
    assert not out.exists()


def test_a_draft_head_proposing_tokens_its_rows_do_not_say_fails(cli, tmp_path):
    """A draft head whose proposed tokens are not its draft rows' argmaxes (its rows right): the rows were diffed,
    the tokens never, and the replay PASSed (found by a user test). It FAILs, naming the first proposal."""
    golden = tmp_path / "m.zarr"
    assert cli("record", golden, "--model", "tiny-llama-mtp", "--feed", "mtp", "--k", "2", "--steps", "4")[0] == 0
    plugin = tmp_path / "head.py"
    plugin.write_text("from vd.models import load_model\n\n\n"
                      "def factory(device, dtype):\n"
                      "    inner = load_model('tiny-llama-mtp', device=device, dtype=dtype)\n"
                      "    propose = inner.propose\n\n"
                      "    def off_by_one(last, n):\n"
                      "        drafts, rows = propose(last, n)\n"
                      "        return [(d + 1) % inner.vocab_size for d in drafts], rows\n\n"
                      "    inner.propose = off_by_one\n"
                      "    return inner\n")
    code, out, err = cli("replay", golden, "--model", f"{plugin}:factory",
                         "--report", tmp_path / "r.json")
    reasons = json.loads((tmp_path / "r.json").read_text())["reasons"]
    assert code == 1 and any("the draft head proposed tokens that are not its draft rows' argmaxes at 4 of 4 "
                             "proposals (first before step 0: proposed [" in r for r in reasons), (out, err, reasons)
    assert cli("replay", golden)[0] == 0  # its own head: every proposal its rows' argmax


def test_a_change_summary_names_the_steps_whose_draft_rows_moved(cli, tmp_path, monkeypatch):
    """A draft head changed at step 2: the replay, vd diff and the report named step 2, and the change summary's
    "steps that moved" cell for the draft rows was empty (found by a user test)."""
    golden, cand, summary = tmp_path / "m.zarr", tmp_path / "c.zarr", tmp_path / "s.md"
    assert cli("record", golden, "--model", "tiny-llama-mtp", "--feed", "mtp", "--k", "2", "--steps", "6",
               "--prompt", "The three laws of thermodynamics state that")[0] == 0
    monkeypatch.setenv("VD_PERTURB_STEP", "2")
    code, out, err = cli("replay", golden, "--model", f"{PLUGINS / 'perturb_head.py'}:factory", "--save-candidate",
                         cand)
    # the table's first-mismatch column showed "-" where the draft rows alone differed
    assert code == 1 and "│ draft step 2 row 0" in out, out + err
    code, out, err = cli("refresh", golden, "--from", cand, "--reason", "the head's change", "--summary", summary)
    assert code == 0, out + err
    row = next(line for line in summary.read_text().splitlines() if line.startswith("| 2 | draft |"))
    assert row.endswith("| 2 |"), summary.read_text()


def test_an_engine_reusing_its_output_buffer_is_refused_naming_it(cli, tmp_path, tiny_golden):
    """Rows returned as views of one reused buffer would be stored (and compared) as whatever the buffer held
    last: record and replay refuse them at once, an internal error of the engine (exit 3) naming it."""
    out, spec = tmp_path / "g.zarr", f"{MISBEHAVING}:aliasing"
    code, _, err = cli("record", out, "--model", spec, "--k", "2", "--steps", "4")
    _one_line_error(code, "", err, f"AdapterError: the model adapter {spec} returned rows in memory holding rows it "
                    "returned earlier", exit_code=3)
    assert not out.exists()
    code, _, err = cli("replay", tiny_golden, "--model", spec)
    _one_line_error(code, "", err, "reused output buffer", exit_code=3)
    from vd.models import load_model
    from vd.testing import ModelConformance

    with pytest.raises(AssertionError, match="rows returned by forward changed"):
        ModelConformance().test_returned_rows_are_owned(load_model(spec))


def test_an_engines_own_environment_joins_the_golden_and_its_build_is_compared(cli, tmp_path, monkeypatch):
    out, report = tmp_path / "g.zarr", tmp_path / "r.json"
    monkeypatch.setenv("VD_ENGINE_BUILD", "1")
    assert cli("record", out, "--model", f"{MISBEHAVING}:built", "--k", "2", "--steps", "4", "--allow-thin")[0] == 0
    from vd.store import open_golden

    assert open_golden(out).meta["environment"]["engine"] == {"name": "tiny-engine", "build": "1"}
    monkeypatch.setenv("VD_ENGINE_BUILD", "2")
    cli("replay", out, "--report", report)
    diffs = json.loads(report.read_text())["environment"]["numerics_differences"]
    assert any(d.startswith("engine: ") and "'build': '2'" in d for d in diffs), diffs


def test_an_engine_changing_rows_it_returned_is_refused_naming_it(cli, tmp_path, tiny_golden):
    """Rows in new tensors each time, but one written into after it was returned: its digest when returned is
    no longer its digest when the run lets it go, so record and replay refuse (exit 3), naming the step."""
    out, spec = tmp_path / "g.zarr", f"{MISBEHAVING}:scribbling"
    code, _, err = cli("record", out, "--model", spec, "--k", "2", "--steps", "4")
    _one_line_error(code, "", err, f"AdapterError: the model adapter {spec} changed step 1's rows after returning "
                    "them", exit_code=3)
    assert not out.exists()
    _one_line_error(*cli("replay", tiny_golden, "--model", spec), "after returning them", exit_code=3)
    from vd.models import load_model
    from vd.testing import ModelConformance

    with pytest.raises(AssertionError, match="rows returned by forward changed"):
        ModelConformance().test_returned_rows_are_owned(load_model(spec))


def test_where_verify_rows_leave_the_engines_own_decode_is_named(cli, tmp_path):
    """An engine whose K=3 verify rows disagree with its one-token decode at step 2: the recording names that
    step, the golden keeps it, and a replay's report (JSON, CLI) names it for that K."""
    out, report = tmp_path / "g.zarr", tmp_path / "r.json"
    spec = f"{MISBEHAVING}:drifting"
    code, stdout, err = cli("record", out, "--model", spec, "--k", "3", "--steps", "6", "--allow-thin")
    assert code == 0 and "left the greedy continuation at step 2" in stdout, stdout + err
    from vd.store import open_golden

    assert open_golden(out).meta["left_greedy"] == {"3": 2}
    code, stdout, err = cli("replay", out, "--model", spec, "--report", report)
    assert code == 0 and "left its engine's own one-token decode at step 2" in stdout, stdout + err
    assert json.loads(report.read_text())["verify"][0]["golden_left_greedy_step"] == 2


def test_a_replay_whose_engine_computes_another_dtype_is_refused(cli, tiny_golden):
    code, _, err = cli("replay", tiny_golden, "--model", f"{MISBEHAVING}:computes_float32")
    _one_line_error(code, "", err, "model computes float32 rows", "holds bfloat16 rows")


def test_nonfinite_logits_are_stored_only_when_asked(cli, tmp_path):
    out = tmp_path / "g.zarr"
    code, _, err = cli("record", out, "--model", f"{MISBEHAVING}:nan", "--k", "2", "--steps", "4",
                       "--allow-nonfinite", "--allow-thin")
    assert code == 0, err


@pytest.mark.parametrize("args, needle", [
    (("--steps", "100000"), "100000 steps at K=2 need 200070 positions; the model's context holds 512"),
    (("--prompt", "x" * 600), "600 prompt tokens and 16 steps at K=2 need 636 positions"),
    (("--threads", "100000"), "--threads must be 1 to"),
])
def test_runs_the_model_cannot_hold_are_refused_before_they_start(cli, tmp_path, args, needle):
    code, _, err = cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--k", "2", *args)
    _one_line_error(code, "", err, needle)


def test_a_file_where_a_folder_is_named_is_said_so(cli, tmp_path, monkeypatch):
    """VD_CACHE_DIR naming a file made `vd cache info` say "0 entries" (and nothing was cached); VD_WARM_DIR naming
    one made `vd warm` say "File exists"; --config naming a folder said "no such declaration file"."""
    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("VD_CACHE_DIR", str(afile))
    for command in ("info", "clear"):  # (clear said "removed 0 entries from" the file, exit 0)
        code, out, err = cli("cache", command)
        assert code == 2 and "afile is a file, not a folder: vd caches nothing there" in err, out + err
    assert afile.read_text() == ""
    monkeypatch.setenv("VD_WARM_DIR", str(afile))
    code, out, err = cli("warm")
    assert code == 2 and "afile is a file, not a folder: vd's warm socket lives in a folder" in err, out + err
    code, out, err = cli("replay", "--suite", "--config", tmp_path)
    assert code == 2 and "is a folder; --config names the declaration file" in err, out + err
    assert afile.read_text() == ""


def test_a_refresh_names_the_golden_model_refusing_a_forward(tiny_golden, tmp_path):
    """`vd record TINY --refresh --forward nosuch` said "model smollm2 has no forward" (the --model default) of a
    tiny-llama golden (a user test): the golden's own model is named, before torch is imported; --model given
    names that one."""
    cases = [(["record", str(tiny_golden), "--refresh", "--forward", "nosuch", "--reason", "x"],
              "model tiny-llama has no forward 'nosuch'"),
             (["record", str(tiny_golden), "--refresh", "--decode-forward", "nosuch", "--reason", "x"],
              "model tiny-llama has no forward 'nosuch'"),
             (["record", str(tiny_golden), "--refresh", "--model", "smollm2", "--forward", "nosuch", "--reason", "x"],
              "model smollm2 has no forward 'nosuch'")]
    for r, (argv, needle) in zip(_audit(tmp_path, *[argv for argv, _ in cases]), cases):
        assert not r["heavy"], (argv, r["heavy"])
        _one_line_error(r["code"], r["out"], r["err"], needle)


def test_a_plugin_spec_is_printed_as_it_is_not_as_an_emoji():
    """rich turned `crashing.py:factory: its forward raised` into `crashing.py🏭 its forward raised` in suite output
    (its emoji codes; a user test): vd's consoles print text as it is."""
    from vd.cli.common import err, out

    for console in (out, err):
        with console.capture() as captured:
            console.print("plug-in crashing.py:factory: its forward raised; :smile: [bold]x[/bold]")
        assert captured.get() == "plug-in crashing.py:factory: its forward raised; :smile: [bold]x[/bold]\n"
