"""vd's pytest plugin, run as a user's project runs it (pytest's own pytester, as syrupy and
pytest-regressions test theirs): goldens collected with --vd, the vd_golden fixture failing with vd's
reasons, --vd-update refreshing what failed, stale and orphan goldens reported."""

import re
import shutil
from pathlib import Path

import pytest
import torch
from golden_edit import chunk, flip_byte

from vd.store import open_golden

PERTURB = Path(__file__).parent.parent / "plugins" / "perturb.py"
SUITE = """
[defaults]
model = "tiny-llama"
steps = 4
k = [2, 3]
[goldens.tiny]
path = "goldens/tiny.zarr"
"""
TEST_ENGINE = f"""
import importlib.util

def _perturbed():
    spec = importlib.util.spec_from_file_location("perturb_engine", {str(PERTURB)!r})
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m.factory(device="cpu", dtype="bfloat16")

def test_engine(vd_golden):
    report = vd_golden("tiny").replay(model=_perturbed())
    assert report is None or report.verdict == "PASS"
"""


@pytest.fixture(scope="module")
def warm(tmp_path_factory, tiny):
    """Everything a recording, a refresh and a replay import, imported here first: an in-process pytester run
    removes the modules it imported when it ends, and torch and transformers cannot be imported twice."""
    from vd.recorder import RecordSettings
    from vd.workflow.refresh import refresh

    refresh(tmp_path_factory.mktemp("warm") / "w.zarr", RecordSettings(model="tiny-llama", steps=2, ks=(2,)),
            reason="warm-up", model=tiny)


@pytest.fixture
def project(pytester, warm):
    pytester.makefile(".toml", vd=SUITE)
    return pytester


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_missing_golden_that_cannot_be_recorded_here_says_why(pytester, warm):
    """Its way on is not a recording `vd record` would refuse (a CUDA-only forward on the CPU): the declaration
    to change, and why."""
    pytester.makefile(".toml", vd=SUITE + 'forward = "graphed"\n')
    r = pytester.runpytest("--vd")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*golden missing*", "*(change its declaration: golden 'tiny' cannot be recorded as "
                            "declared: model tiny-llama has no forward 'graphed' on device 'cpu'*"])
    assert "record it" not in r.stdout.str()


def test_goldens_are_collected_recorded_when_missing_and_replayed(project):
    r = project.runpytest("--vd")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*golden missing*", "*(record it: vd record --suite tiny, or pytest --vd-update)*"])
    assert "vd refresh" not in r.stdout.str()  # which refuses a golden not recorded yet
    assert "def check(" not in r.stdout.str()  # vd's reasons, not the plugin's source
    r = project.runpytest("--vd", "--vd-update")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["*vd: goldens refreshed*", "tiny: v1 *tiny.zarr", "*new golden*"])
    r = project.runpytest("--vd", "-v")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["vd.toml::tiny PASSED*"])
    flip_byte(chunk(project.path / "goldens" / "tiny.zarr", 2))  # damaged: nothing judged, no candidate to accept
    r = project.runpytest("--vd")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*does not match the golden's manifest*", "*(fix what the line above names; or record "
                            "the golden again from its declaration: vd refresh tiny --reason TEXT)*"])


def test_a_replay_its_own_arguments_stop_points_at_them_not_at_a_refresh(project):
    """``replay(ks=5)`` or an unknown tolerance stops the replay before a verdict, as a damaged golden does; but
    recording the golden again would not help: the way on names the test's arguments, and no refresh."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    project.makepyfile(test_engine="""
def test_k(vd_golden):
    vd_golden("tiny").replay(ks=5)

def test_tolerance(vd_golden):
    vd_golden("tiny").replay(tolerances="bogus")
""")
    r = project.runpytest("test_engine.py")
    r.assert_outcomes(failed=2)
    r.stdout.fnmatch_lines(["*has no verify width [[]5[]]*", "*(fix what the line above names: the test's replay() "
                            "arguments or the model it hands in)*", "*unknown tolerance 'bogus'*",
                            "*(fix what the line above names: the test's replay() arguments or the model it hands "
                            "in)*"])
    assert "vd refresh" not in r.stdout.str()
    (project.path / "test_engine.py").unlink()
    r = project.runpytest("--vd", "--vd-forward", "flash")  # the command line's, for a golden no test names
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*no forward 'flash'*", "*(fix what the line above names)*"])
    assert "vd refresh" not in r.stdout.str()


def test_a_failing_engine_fails_with_vds_reasons_and_update_accepts_it(project):
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    project.makepyfile(test_engine=TEST_ENGINE)
    r = project.runpytest("test_engine.py")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*GoldenFailure: vd golden 'tiny' (*tiny.zarr) FAILED:*",
                            "*verify K=2, eager: prefill equal, 1 of 4 steps differ (first at step 3 row 1*",
                            "*accept an intended change: pytest --vd-update*"])
    project.runpytest("test_engine.py", "--vd-tolerance", "argmax").assert_outcomes(passed=1)
    r = project.runpytest("test_engine.py", "--vd-update")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["tiny: v2 *", "*rows moved at K=[[]2, 3[]]: 2 of *"])
    # Nothing beside the golden once the update returns: no replaced version, staging folder or lock.
    assert sorted(p.name for p in (project.path / "goldens").iterdir()) == ["tiny.zarr"]
    g = open_golden(project.path / "goldens" / "tiny.zarr")
    reason = g.history[-1]["reason"]
    assert re.match(r"pytest --vd-update \(test_engine.py::test_engine, run [0-9a-f]{12}\): verify K=2", reason)
    assert reason.endswith(" …") and len(reason) < 280  # shortened at a word (textwrap), not cut mid-word
    g.close()
    project.runpytest("test_engine.py").assert_outcomes(passed=1)  # the golden now holds the engine's numbers


def test_a_pin_is_checked_and_an_update_writes_the_new_one(project):
    """The plugin's replays ignored a declaration's pin (a golden every `vd replay` refused passed `pytest --vd`),
    and `--vd-update` left the old pin, so every replay then refused the updated golden (found by a user test)."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    toml = project.path / "vd.toml"
    digest = open_golden(project.path / "goldens" / "tiny.zarr").content_digest()
    wrong = "sha256:" + "0" * 64
    toml.write_text(SUITE.replace('path = "goldens/tiny.zarr"\n', f'path = "goldens/tiny.zarr"\npin = "{wrong}"\n'))
    r = project.runpytest("--vd")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines([f"*is not the one its declaration pins ({wrong})*"])
    again = "\n\ndef test_again(vd_golden):\n    assert vd_golden('tiny').replay(model=_perturbed()).verdict == 'PASS'"
    project.makepyfile(test_engine=TEST_ENGINE + again)
    toml.write_text(toml.read_text().replace(wrong, digest))
    r = project.runpytest("test_engine.py", "--vd-update")  # the second test replays what the first accepted
    r.assert_outcomes(passed=2)
    now = open_golden(project.path / "goldens" / "tiny.zarr").content_digest()
    assert now != digest and f'pin = "{now}"' in toml.read_text()
    r.stdout.fnmatch_lines([f"    pin in {toml}: {now}"])
    project.runpytest("test_engine.py").assert_outcomes(passed=2)


def test_an_update_of_a_change_at_every_step_records_the_golden_with_the_tests_model(project, monkeypatch):
    """An engine whose every verify step differs from the golden's, the controls' steps too, so a promotion cannot
    vouch for its candidate: the failure says that vd refresh records the declared model, not the test's (it
    advised vd refresh, which recorded tiny-llama again and left the test failing), and --vd-update records
    the golden again with the test's model, as for a stale golden (it said "declare  in tiny's declaration")."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    project.makepyfile(test_engine=TEST_ENGINE)
    monkeypatch.setenv("VD_PERTURB_STEP", "all")
    r = project.runpytest("test_engine.py")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*verify K=2, eager: prefill equal, 4 of 4 steps differ*",
                            "*(accept an intended change: pytest --vd-update keeps the rows of the model this test ran "
                            "(vd refresh tiny --reason TEXT records the declared model, tiny-llama))"])
    r = project.runpytest("test_engine.py", "--vd-update")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["tiny: v2 *", "*rows moved at K=[[]2, 3[]]: 8 of *"])
    project.runpytest("test_engine.py").assert_outcomes(passed=1)
    monkeypatch.delenv("VD_PERTURB_STEP")
    project.runpytest("test_engine.py").assert_outcomes(failed=1)  # the golden holds the engine's numbers now


def test_a_second_update_of_a_golden_in_one_run_fails_instead(project):
    """Two tests whose engines disagree on one golden, under --vd-update: the first updated it, the second failed
    against that update and updated it back, and the run reported two updates and no failure (the update asked
    for silently undone). The second now fails, naming the test whose update it disagrees with."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    project.makepyfile(test_both=TEST_ENGINE + """
def test_plain(vd_golden):
    vd_golden("tiny").replay()
""")
    r = project.runpytest("test_both.py", "--vd-update")
    r.assert_outcomes(passed=1, failed=1)
    r.stdout.fnmatch_lines(["*vd golden 'tiny' (*tiny.zarr) FAILED against the update test_both.py::test_engine made "
                            "in this run:*", "*two tests' engines give this golden different rows*"])
    g = open_golden(project.path / "goldens" / "tiny.zarr")
    assert len(g.history) == 2 and "test_both.py::test_engine" in g.history[-1]["reason"]
    g.close()


def test_update_all_records_each_golden_once_per_run_in_every_worker(project, monkeypatch):
    """--vd-update=all re-recorded a golden for every test that used it (a version each), and again in every
    pytest-xdist worker; now once per run (its ID, xdist's PYTEST_XDIST_TESTRUNUID), later tests replaying it."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    project.makepyfile(test_twice="""
def test_one(vd_golden):
    vd_golden("tiny").replay()

def test_two(vd_golden):
    vd_golden("tiny").replay()
""")
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "0123456789abcdef")
    r = project.runpytest("test_twice.py", "--vd-update=all")
    r.assert_outcomes(passed=2)
    r.stdout.fnmatch_lines(["tiny: v2 *"])
    g = open_golden(project.path / "goldens" / "tiny.zarr")
    assert [v["reason"] for v in g.history[1:]] == [
        "pytest --vd-update (test_twice.py::test_one, run 0123456789ab): --vd-update=all"]
    g.close()
    r = project.runpytest("test_twice.py", "--vd-update=all")  # another worker of the same run: replayed
    r.assert_outcomes(passed=2)
    assert "vd: goldens refreshed" not in r.stdout.str()
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "another run")
    project.runpytest("test_twice.py", "--vd-update=all").stdout.fnmatch_lines(["tiny: v3 *"])
    assert len(open_golden(project.path / "goldens" / "tiny.zarr").history) == 3


def test_stale_declarations_fail_and_orphans_are_listed(project):
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    shutil.copytree(project.path / "goldens" / "tiny.zarr", project.path / "goldens" / "forgotten.zarr")
    project.makefile(".toml", vd=SUITE.replace("steps = 4", "steps = 6"))
    r = project.runpytest("--vd", "--vd-forward", "eager")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*stale, the declaration changed since it was recorded: steps: recorded 4, declared 6*",
                            "*vd: orphan goldens*", "*forgotten.zarr"])
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    assert open_golden(project.path / "goldens" / "tiny.zarr").info.steps == 6
    assert sorted(p.name for p in (project.path / "goldens").iterdir()) == ["forgotten.zarr", "tiny.zarr"]


def test_a_bad_declaration_fails_the_items_with_one_line(project):
    project.makefile(".toml", vd=SUITE + "colour = 'blue'\n")
    project.makepyfile(test_engine="def test_it(vd_golden):\n    vd_golden('tiny').replay()\n")
    r = project.runpytest("test_engine.py")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*vd.toml: [[]goldens.tiny[]] unknown key 'colour'*"])
    r = project.runpytest("--vd")
    assert r.ret == pytest.ExitCode.USAGE_ERROR
    r.stderr.fnmatch_lines(["ERROR: vd: *vd.toml: [[]goldens.tiny[]] unknown key 'colour'*"])


def test_a_tests_replay_keywords_win_over_the_command_lines(project):
    """``replay(forwards=..., tolerances=..., ks=..., save_candidate=...)``: the ReplaySettings fields the fixture
    documents, over --vd-forward and --vd-tolerance (they collided: "got multiple values for keyword argument",
    as save_candidate did with the plugin's own); one name given for a tuple is that name; a keyword that is no
    field is a TypeError naming the fields."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    project.makepyfile(test_engine="""
import pytest

def test_tuple(vd_golden):
    assert vd_golden("tiny").replay(forwards=("eager",), tolerances=("exact",)).verdict == "PASS"

def test_one_name(vd_golden):
    report = vd_golden("tiny").replay(forwards="eager", ks=2)
    assert [r.k for r in report.verify] == [2] and [v.name for v in report.variants] == ["eager"]

def test_own_candidate(vd_golden, tmp_path):
    vd_golden("tiny").replay(forwards="eager", save_candidate=str(tmp_path / "c.zarr"))
    assert (tmp_path / "c.zarr" / "zarr.json").is_file()

def test_no_such_field(vd_golden):
    with pytest.raises(TypeError, match="forward is none of them .*forwards"):
        vd_golden("tiny").replay(forward="eager")
""")
    project.runpytest("test_engine.py", "--vd-forward", "sdpa", "--vd-tolerance", "argmax").assert_outcomes(passed=4)


def test_a_model_that_is_no_model_is_a_type_error_naming_what_it_lacks(project):
    """``replay(model=factory)`` (the factory, not what it returns) or ``model=42``: a TypeError in the test's
    line that says what vd takes and what the object lacks, not an AttributeError from inside vd; with
    --vd-update too, and the golden is not refreshed."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    before = {p: p.read_bytes() for p in (project.path / "goldens").rglob("*") if p.is_file()}
    project.makepyfile(test_engine="""
import pytest
from vd.models import load_model

def factory(device="cpu", dtype="bfloat16"):
    return load_model("tiny-llama", device=device, dtype=dtype)

def test_the_factory_itself(vd_golden):
    with pytest.raises(TypeError, match=r"vd_golden\\(...\\).replay\\(\\) takes a vd.protocol.VerifyModel as model=; "
                                        r"got the function factory, which lacks .*forward.* \\(a factory\\? pass "
                                        r"what it returns: model=factory\\(device=..., dtype=...\\)\\)"):
        vd_golden("tiny").replay(model=factory)

def test_a_number(vd_golden):
    with pytest.raises(TypeError, match="got an object of type int, which lacks default_forward, device"):
        vd_golden("tiny").replay(model=42)
""")
    project.runpytest("test_engine.py").assert_outcomes(passed=2)
    project.runpytest("test_engine.py", "--vd-update=all").assert_outcomes(passed=2)
    assert {p: p.read_bytes() for p in (project.path / "goldens").rglob("*") if p.is_file()} == before


def test_an_update_its_control_cannot_vouch_for_names_the_recording_to_run(project):
    """A test replaying another forward (sdpa against an eager golden) differs at every step, so with
    --vd-update its candidate's control is inconclusive and the promotion refused: the failure shows the test's
    line and the command that records the change (by the golden's declared name), not the plugin's source. Its
    failure without --vd-update names that recording too, not --vd-update."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    project.makepyfile(test_engine="""
def test_sdpa(vd_golden):
    vd_golden("tiny").replay(forwards="sdpa")
""")
    r = project.runpytest("test_engine.py")  # without --vd-update: the way on it names is the same recording
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*(accept an intended change: declare forward = \"sdpa\" in tiny's declaration, then vd "
                            "refresh tiny --reason TEXT; pytest --vd-update takes a change of the golden's own "
                            "forward, eager, not another's)"])
    r = project.runpytest("test_engine.py", "--vd-update")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*the candidate's detection control was inconclusive*",
                            "*record the change itself instead: declare forward = \"sdpa\" in tiny's declaration, then "
                            "vd refresh tiny --reason TEXT"])
    assert "def _done(" not in r.stdout.str() and 'vd_golden("tiny").replay(forwards="sdpa")' in r.stdout.str()


def test_an_update_vd_refuses_fails_the_golden_with_its_one_line(project):
    """--vd-update of a declared slim golden (a team's, its full golden kept elsewhere): vd refuses to put a full
    golden in its place, and the test fails with that line, the way on in it, not with a traceback through vd."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    goldens = project.path / "goldens"
    shutil.move(goldens / "tiny.zarr", project.path / "full.zarr")
    from vd.store import slim

    slim(project.path / "full.zarr", goldens / "tiny.zarr")
    before = sorted(p.name for p in (goldens / "tiny.zarr").rglob("*"))
    project.makepyfile(test_engine=TEST_ENGINE)
    r = project.runpytest("test_engine.py", "--vd-update")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*GoldenFailure: vd golden 'tiny': the refresh was refused:*",
                            "*is slim (a vd slim form of *full.zarr)*vd slim *full.zarr *tiny.zarr --refresh)*"])
    assert "raise UsageError" not in r.stdout.str() and open_golden(goldens / "tiny.zarr").slim
    assert sorted(p.name for p in (goldens / "tiny.zarr").rglob("*")) == before


HOLDER = """
import os, sys
from vd.store import locate
with locate("goldens/tiny.zarr").writer():  # another process writing the golden (a pytest-xdist worker)
    print("held", flush=True)
    sys.stdin.readline()
    os.rename("ready.zarr", "goldens/tiny.zarr")
"""
TEST_WAITS = f"""
import subprocess, sys
import vd.store.atomic as atomic

def test_waits(vd_golden, monkeypatch):
    holder = subprocess.Popen([sys.executable, "-c", {HOLDER!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline() == "held\\n"
    waited, wait_writer = [], atomic.wait_writer

    def waiting(target, timeout):
        waited.append(target)
        holder.stdin.write("go\\n")  # it puts its golden in place and lets go of the lock
        holder.stdin.flush()
        return wait_writer(target, timeout)

    monkeypatch.setattr(atomic, "wait_writer", waiting)
    report = vd_golden("tiny").replay()
    assert holder.wait() == 0 and waited
    assert report is not None and report.verdict == "PASS"  # judged against what the other process wrote
"""


def test_an_update_waits_for_another_process_writing_its_golden(project):
    """pytest-xdist workers updating one golden: the second found it locked by the first and failed with "is
    being written by another vd process". It waits for that writer, then judges what it wrote."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    shutil.move(project.path / "goldens" / "tiny.zarr", project.path / "ready.zarr")  # the other process's
    project.makepyfile(test_waits=TEST_WAITS)
    r = project.runpytest("test_waits.py", "--vd-update")
    r.assert_outcomes(passed=1)
    assert "goldens refreshed" not in r.stdout.str()  # the other process wrote it; this one judged it
    assert sorted(p.name for p in (project.path / "goldens").iterdir()) == ["tiny.zarr"]


TEST_RACED = TEST_ENGINE.split("def test_engine")[0] + """
import subprocess, sys

class Racing:
    def __init__(self, inner):
        self.inner, self.raced = inner, False
        self.vocab_size, self.device, self.dtype = inner.vocab_size, inner.device, inner.dtype

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, tokens):
        if not self.raced:  # as its replay starts, another process (a pytest-xdist worker) updates the golden
            self.raced = True
            subprocess.run([sys.executable, "-m", "vd", "refresh", "tiny", "--from", "other.zarr", "--reason",
                            "another worker's update"], check=True, capture_output=True)
        return self.inner.forward(tokens)

def test_raced(vd_golden):
    assert vd_golden("tiny").replay(model=Racing(_perturbed())) is None
"""


def test_an_update_whose_golden_another_process_updated_meanwhile_judges_it_again(project, cli, monkeypatch):
    """The replay's candidate was saved against the version another process has since replaced: the promotion
    refused it ("saved against another version"); the update judges the new version and promotes from that."""
    project.runpytest("--vd", "--vd-update").assert_outcomes(passed=1)
    monkeypatch.setenv("VD_PERTURB_K", "2")  # the other process's engine moves step 3 at K=2, the test's at every K
    code, _, err = cli("replay", "tiny", "--model", f"{PERTURB}:factory", "--save-candidate", "other.zarr")
    assert code == 1, err
    monkeypatch.delenv("VD_PERTURB_K")
    project.makepyfile(test_raced=TEST_RACED)
    r = project.runpytest("test_raced.py", "--vd-update")
    r.assert_outcomes(passed=1)
    r.stdout.fnmatch_lines(["tiny: v3 *"])
    g = open_golden(project.path / "goldens" / "tiny.zarr")
    assert [v["reason"][:36] for v in g.history[1:]] == ["another worker's update",
                                                         "pytest --vd-update (test_raced.py::t"]
    g.close()


def test_an_update_the_disk_refuses_fails_with_its_one_line(project):
    """--vd-update of a golden whose files the file system refuses (a file size limit standing in for a full
    disk): the test fails with the system's line naming the file, not with a traceback through vd."""
    project.makeconftest("""
import resource
resource.setrlimit(resource.RLIMIT_FSIZE, (24 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
""")
    project.makepyfile(test_engine=TEST_ENGINE)
    r = project.runpytest_subprocess("test_engine.py", "--vd-update", "-p", "no:cacheprovider")
    r.assert_outcomes(failed=1)
    r.stdout.fnmatch_lines(["*GoldenFailure: vd golden 'tiny': the refresh was not written:*",
                            "*- File too large: *goldens/.tiny.zarr.partial-*"])
    assert "def write_bytes" not in r.stdout.str()  # (pathlib's, at the end of vd's traceback)
    assert sorted(p.name for p in (project.path / "goldens").iterdir()) == []
