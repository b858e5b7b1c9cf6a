"""The workflow from the command line, as a user types it: a suite recorded, replayed with one verdict and
its reports, refreshed with a reason and a summary, its history and status; a refresh that re-records what
the golden says; bad declarations refused with one line."""

import json
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vd.recorder import RecordSettings
from vd.store import open_golden

PERTURB = "tests/plugins/perturb.py:factory"
SUITE = """
[defaults]
model = "tiny-llama"
steps = 4
[goldens.a]
path = "goldens/a.zarr"
k = [2, 3]
[goldens.b]
path = "goldens/b.zip"
k = [2]
prompt = "Write one sentence about the sea."
policy = ["prefill=ulp:1"]
"""


@pytest.fixture
def project(tmp_path, monkeypatch, cli):
    (tmp_path / "vd.toml").write_text(SUITE)
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("record", "--suite")
    assert code == 0, err
    return tmp_path


@pytest.mark.parametrize("flags, why", [(("--k", "9"), "has no verify width [9]"),
                                         (("--forward", "nosuch"), "has no forward 'nosuch'")])
def test_a_suite_refuses_what_its_goldens_cannot_do_before_loading_a_model(project, cli, flags, why):
    """A width no golden holds or a forward no model offers is each golden's ERROR before its model loads (it
    loaded the model first, then refused: seconds of a GPU model's load for a typo)."""
    code, out, err = cli("replay", "--suite", *flags)
    assert code == 2 and out.count(why) == 2 and "ERROR: 2 ERROR of 2 golden(s); 0 model load(s)" in out, out + err
    assert "loading" not in err, err


def test_a_suite_replays_with_one_verdict_and_its_reports(project, cli, request):
    plugin = str(request.config.rootpath / PERTURB)
    code, out, err = cli("replay", "--suite", "--report", "r.json", "--junit", "j.xml", "--html", "h.html")
    assert code == 0 and "PASS: 2 PASS of 2 golden(s); 1 model load(s)" in out, out + err
    code, out, err = cli("replay", "--suite", "--model", plugin, "--report", "r.json", "--junit", "j.xml",
                         "--bundle", "bundles")
    assert code == 1 and "FAIL: 2 FAIL of 2 golden(s)" in out
    r = json.loads((project / "r.json").read_text())
    assert r["verdict"] == "FAIL" and [g["name"] for g in r["goldens"]] == ["a", "b"]
    assert r["goldens"][0]["report"]["model"]["replayed_spec"] == plugin
    classes = {c.get("classname") for c in ET.parse(project / "j.xml").getroot().iter("testcase")}
    assert {"vd.a.K2", "vd.a.K3", "vd.b.K2"} <= classes
    assert ") in its bundle bundles/a/ (both rows in rows.npz, failure.json): sh bundles/a/command.sh replays just " \
           "that." in out, out  # the bundle written, not a command writing another
    command = (project / "bundles" / "a" / "command.sh").read_text()
    assert f"--model {plugin}" in command  # the suite's --model, so the command replays the engine that failed
    done = subprocess.run(["sh", str(project / "bundles" / "a" / "command.sh")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1, done.stderr
    (project / "mine" / "b").mkdir(parents=True)  # a golden's bundle folder holding a user's file of a bundle's name
    (project / "mine" / "b" / "command.sh").write_text("mine")
    code, out, err = cli("replay", "--suite", "--model", plugin, "--bundle", "mine")
    assert code == 2 and "--bundle mine/b holds command.sh and no earlier bundle" in err, out + err
    assert (project / "mine" / "b" / "command.sh").read_text() == "mine" and not (project / "mine" / "a").exists()
    code, out, err = cli("replay", "b", "--k", "2")  # one golden by its declared name, as vd refresh takes it
    assert code == 0 and out.rstrip().endswith("PASS") and str(project / "goldens" / "b.zip") in out, out + err
    code, out, err = cli("replay", "a", "--model", plugin, "--k", "2")  # alone, its way on is the suite's: declare
    assert code == 1 and f'declare model = "{plugin}" in a\'s declaration, then vd refresh a --reason TEXT' in out, out
    code, out, err = cli("replay", "--suite", "a", "--forward", "sdpa", "--k", "2")  # to accept another forward:
    assert code == 1 and ('  - To make sdpa the golden\'s forward, declare it (forward = "sdpa" in a\'s declaration) '
                          "and refresh: vd refresh a --reason TEXT.") in out.splitlines(), out
    code, out, err = cli("show", "b")  # every command that takes a golden takes a declared golden's name
    assert code == 0 and str(project / "goldens" / "b.zip") in out.splitlines()[0], out + err
    code, out, err = cli("verify", "a")
    assert code == 0 and out.startswith(f"intact: {project / 'goldens' / 'a.zarr'}"), out + err
    code, out, err = cli("diff", "b", "goldens/b.zip")
    assert code == 0 and out.rstrip().endswith("PASS"), out + err
    code, out, err = cli("slim", "a", "a-slim.zarr")
    assert code == 0 and open_golden(project / "a-slim.zarr").slim, out + err
    code, out, err = cli("show", "c")  # a name no one declares is a path, and there is none: the names said
    assert code == 2 and err.startswith("vd: error: c does not exist, and ") and err.endswith(
        "declares no golden of that name (it declares a, b)\n"), err
    code, out, err = cli("replay", "--suite", "b", "--shard", "2/2")
    assert code == 0 and "PASS: shard 2/2 holds none of the 1 golden(s) selected; nothing replayed" in out, out
    (project / "goldens" / "b.zip").unlink()
    code, out, err = cli("replay", "--suite")
    assert code == 2 and "b.zip does not exist" in out and "1 PASS, 1 ERROR of 2" in out
    assert out.splitlines()[-2:] == ["b: next step:", "  - record it: vd record --suite b"], out  # (it said none)


def test_a_suite_bundle_is_never_written_into_a_golden(cli, tmp_path, monkeypatch):
    """A golden declared as ``t.zarr`` at goldens/t.zarr, and a suite replay's --bundle goldens: its bundle,
    goldens/t.zarr/, was written into the golden, which then failed vd verify (found by a user test)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vd.toml").write_text('[goldens."t.zarr"]\npath = "goldens/t.zarr"\nmodel = "tiny-llama"\nk = [2]\n'
                                      'steps = 4\n')
    assert cli("record", "--suite")[0] == 0
    before = sorted(p.name for p in (tmp_path / "goldens" / "t.zarr").iterdir())
    code, out, err = cli("replay", "--suite", "--forward", "sdpa", "--bundle", "goldens")
    assert code == 2 and "--bundle goldens/t.zarr is the golden" in err and err.count("\n") == 1, out + err
    assert sorted(p.name for p in (tmp_path / "goldens" / "t.zarr").iterdir()) == before
    assert cli("verify", "t.zarr")[0] == 0


def test_a_suite_replay_refuses_a_golden_its_declaration_has_moved_past(project, cli):
    """A stale golden (its declaration changed since it was recorded) is an ERROR of the suite replay, as it is a
    failure of `pytest --vd` and of `vd status`: replaying what it holds would pass without checking what the
    declaration asks for (here K=3)."""
    toml = project / "vd.toml"
    toml.write_text(toml.read_text().replace('k = [2]\n', 'k = [2, 3]\n'))
    code, out, err = cli("replay", "--suite", "--report", "r.json", "--junit", "j.xml")
    assert code == 2 and "1 PASS, 1 ERROR of 2" in out, out + err
    line = "stale, the declaration changed since it was recorded: ks: recorded [2], declared [2, 3]"
    assert line in out and "vd record --suite b --refresh --reason TEXT" in out, out
    b = json.loads((project / "r.json").read_text())["goldens"][1]
    assert b["verdict"] == "ERROR" and line in b["error"] and b["report"] is None
    assert ET.parse(project / "j.xml").getroot().get("errors") == "1"
    code, out, err = cli("record", "--suite")  # left as it is, but said to be stale, with how to record it
    assert code == 0 and "b                        PRESENT" in out, out + err
    assert "    stale: ks: recorded [2], declared [2, 3]; vd record --suite b --refresh --reason TEXT records it " \
           "again" in out, out


def test_a_suite_refresh_summary_has_each_goldens_table_of_rows_that_moved(project, cli, request):
    """`vd record --suite --refresh --summary` wrote each refreshed golden's headline lines alone: the table of
    rows that moved, which `vd refresh --summary` writes, was left out (found by a user test)."""
    plugin = str(request.config.rootpath / PERTURB)
    toml = project / "vd.toml"
    toml.write_text(SUITE.replace('[goldens.a]\n', f'[goldens.a]\nmodel = "{plugin}"\n'))
    code, out, err = cli("record", "--suite", "--refresh", "--reason", "the perturbed build", "--summary", "s.md")
    assert code == 0, out + err
    md = (project / "s.md").read_text()
    a, b = md.split("## a: REFRESHED\n\n")[1].split("## b: REFRESHED\n\n")
    assert md.startswith("**Reason:** the perturbed build\n") and "| 2 | verify | 1 |" in a, md
    assert "- no logit, step or decision moved (content digest unchanged)" in b and "| 2 | verify | 0 |" in b, md


def test_refresh_history_and_status(project, cli, request):
    plugin = str(request.config.rootpath / PERTURB)
    code, out, err = cli("replay", "a", "--suite", "--model", plugin, "--save-candidate", "cands")
    assert code == 1 and (project / "cands" / "a.zarr").is_dir()
    code, out, err = cli("refresh", "a", "--from", "cands/a.zarr", "--reason", "kernel change, PR 7",
                         "--summary", "changes.md")
    assert code == 0 and "refreshed" in out and "version 2" in out
    md = (project / "changes.md").read_text()
    assert md.startswith("## vd refresh: a\n") and "**Reason:** kernel change, PR 7" in md
    assert "| 2 | verify | 1 |" in md
    code, out, err = cli("history", "a")
    assert code == 0 and "v2" in out and "kernel change, PR 7" in out and "v1" in out
    code, out, err = cli("status", "--no-models")
    assert code == 0 and "current" in out and "stale" not in out, out
    (project / "vd.toml").write_text(SUITE.replace("steps = 4", "steps = 5"))
    (project / "goldens" / "old.zarr").mkdir()
    code, out, err = cli("status")
    assert code == 1 and "a: steps: recorded 4, declared 5" in out and "stale" in out
    (project / "goldens" / "old.zarr").rmdir()
    code, out, err = cli("refresh", "a", "--reason", "5 steps now")
    assert code == 0 and "asked: steps: 4 -> 5" in out
    # Settings the declaration leaves out ask for nothing, and the history keeps no temporary path.
    assert "-> None" not in out and "rows not compared: the new version records another thing: steps (4 vs 5)" in out
    g = open_golden(project / "goldens" / "a.zarr")
    assert g.info.steps == 5
    history = json.dumps(g.history)
    assert ".partial-" not in history and "/tmp" not in history and "candidate.zarr" not in history, history


def test_record_refresh_re_records_what_the_golden_says(tmp_path, cli, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no suite here: the golden's own settings
    g = tmp_path / "g.zarr"
    code, out, err = cli("record", g, "--model", "tiny-llama", "--k", "2,4", "--steps", "6", "--prompt",
                         "Count to ten.", "--tolerance", "verify=ulp:2")
    assert code == 0, err
    code, out, err = cli("record", g, "--refresh", "--reason", "same build")
    assert code == 0 and "no logit, step or decision moved" in out, out + err
    m = open_golden(g).meta
    assert m["k"] == [2, 4] and m["steps"] == 6 and m["prompt_text"] == "Count to ten." and m["model"]["spec"] == \
        "tiny-llama" and m["policy"]["verify"] == "ulp:2" and len(m["history"]) == 2
    code, out, err = cli("record", g, "--refresh", "--steps", "8")
    assert code == 0 and "asked: steps: 6 -> 8" in out
    assert open_golden(g).meta["k"] == [2, 4] and open_golden(g).history[-1]["reason"] == "vd record --refresh"


@pytest.mark.parametrize("body, needle", [
    ('[goldens.a]\npath = "a.zarr"\nk = 3\n', "[goldens.a] key 'k': expected a list"),
    ('[goldens.a]\npath = "x.zarr"\n[goldens.b]\npath = "x.zarr"\n', "[goldens.b] key 'path'"),
    ('[goldens.a]\npath = "a.zarr"\nstep = 3\n', "[goldens.a] unknown key 'step'"),
    pytest.param('[goldens.a]\npath = "a.zarr"\nbatch = 2\nslot = 5\n', "a batch of 2 has slots 0 to 1",
                 id="a-slot-outside-its-batch"),
    pytest.param('[goldens.a]\npath = "a.zarr"\nslot = 1\n',  # in its keys' words (it said "key 'batch': --slot")
                 "[goldens.a]: slot places the golden's sequence in a batch: pass batch = N too", id="a-slot-alone"),
    pytest.param('[goldens.a]\npath = "a.zarr"\n[goldens.b]\npath = "a.zarr/b.zarr"\n',
                 "are one inside the other", id="one-golden-inside-another"),
    pytest.param('[goldens.b]\npath = "a.zarr/b.zarr"\n[goldens.a]\npath = "a.zarr/"\n',
                 "are one inside the other", id="the-outer-one-declared-second"),
    pytest.param('[goldens.a]\npath = "a.zarr"\nmodel = ' + "{a = " * 2000 + "1" + "}" * 2000 + "\n",
                 "nested too deeply to read", id="inline-tables-2000-deep"),
    pytest.param('[goldens.a]\npath = "a.zarr"\nk = ' + "[" * 2000 + "2" + "]" * 2000 + "\n",
                 "nested too deeply to read", id="arrays-2000-deep"),
    pytest.param("[defaults.model" + ".a" * 2000 + "]\nb = 1\n", "[defaults.model.a.a.a.a",
                 id="table-headers-2000-deep"),
])
def test_bad_declarations_are_one_line_and_exit_2(tmp_path, cli, monkeypatch, body, needle):
    """Settings that cannot work, and declarations nested too deep to read or print (once a RecursionError,
    exit 3): one line naming the file, exit 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vd.toml").write_text(body)
    for args in (("record", "--suite"), ("replay", "--suite"), ("status",), ("refresh", "a", "--reason", "x")):
        code, out, err = cli(*args)
        assert code == 2 and err.count("\n") == 1 and needle in err and str(tmp_path / "vd.toml") in err, err
        assert "Traceback" not in err and "internal error" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vd.toml"]  # nothing recorded, nothing removed


def test_usage_of_targets(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for args in (("record",), ("record", "a.zarr", "b.zarr"), ("replay",)):
        code, out, err = cli(*args)
        assert code == 2 and "give one" in err
    code, out, err = cli("replay", "--suite")
    assert code == 2 and "no suite declared" in err
    (tmp_path / "vd.toml").write_text('[goldens.a]\npath = "a.zarr"\n')
    for command in ("replay", "record", "status"):  # (vd replay --suite a a replayed it twice)
        code, out, err = cli(command, *(["--suite"] if command != "status" else []), "a", "a")
        assert code == 2 and "golden 'a' named more than once" in err, (command, out, err)


def test_refresh_of_an_unknown_name_records_nothing(tmp_path, monkeypatch, cli):
    """A mistyped or undeclared NAME is exit 2 naming the declared goldens, and nothing is written: a refresh
    replaces a golden, recording a new one is vd record's; a declared golden not yet recorded says how."""
    (tmp_path / "vd.toml").write_text(SUITE)
    monkeypatch.chdir(tmp_path)
    for target in ("aa", "smollm2", "goldens/c.zarr"):
        code, out, err = cli("refresh", target, "--reason", "typo")
        assert code == 2 and "neither a declared golden nor a golden on disk" in err and "declares a, b" in err, err
    code, out, err = cli("refresh", "a", "--reason", "not recorded yet")
    assert code == 2 and "declared but not recorded yet" in err and "vd record --suite a" in err
    code, out, err = cli("refresh", "a", "--from", "cands/a.zarr", "--reason", "no golden to promote into")
    assert code == 2 and "declared but not recorded yet" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vd.toml"]
    monkeypatch.chdir(tmp_path / "..")
    code, out, err = cli("refresh", "nowhere.zarr", "--reason", "no suite here")
    assert code == 2 and "neither a declared golden nor a golden on disk" in err and "declares" not in err


def test_status_ties_the_last_replay_to_the_version_it_judged(project, cli):
    """`vd status --report` shows a suite report's verdict for the version that report judged: not for a
    golden that is missing, and marked for one refreshed since."""
    assert cli("replay", "--suite", "--report", "r.json")[0] == 0
    assert json.loads((project / "r.json").read_text())["goldens"][0]["content_digest"].startswith("sha256:")

    def last() -> dict:
        code, out, err = cli("status", "--no-models", "--report", "r.json", "--json", "s.json")
        return {g["name"]: g["last"] for g in json.loads((project / "s.json").read_text())["goldens"]}

    assert last() == {"a": "PASS", "b": "PASS"}
    (project / "vd.toml").write_text(SUITE.replace("steps = 4", "steps = 5"))
    assert cli("refresh", "a", "--reason", "5 steps now")[0] == 0
    (project / "goldens" / "b.zip").unlink()
    assert last() == {"a": "PASS (of another version)", "b": None}
    code, out, err = cli("status", "--no-models", "--report", "gone.json")  # said "is not a suite report: [Errno 2]"
    assert code == 2 and "--report gone.json does not exist (the JSON report of a vd replay --suite" in err, err


def test_status_names_a_golden_whose_files_git_ignores(project, cli):
    """A `*.json` line in .gitignore drops every zarr.json of a committed golden without a word from git:
    `vd status` names the golden and its ignored files, and exits 1."""
    if subprocess.run(["git", "init", "-q", str(project)], capture_output=True).returncode != 0:
        pytest.skip("no git")
    code, out, err = cli("status", "--no-models")
    assert code == 0 and "ignored" not in out, out
    (project / ".gitignore").write_text("*.json\n")
    code, out, err = cli("status", "--no-models", "--json", "s.json")
    states = {g["name"]: g for g in json.loads((project / "s.json").read_text())["goldens"]}
    assert code == 1 and states["a"]["state"] == "ignored" and "a: git ignores" in out, out
    assert "(a.zarr/zarr.json, " in states["a"]["reasons"][0] and states["b"]["state"] == "current"


def test_a_thin_suite_recording_says_how_to_store_it(cli, tmp_path, monkeypatch):
    """`vd record --suite` refusing a thin golden said why but not how to store it anyway (plain `vd record` says
    --allow-thin; a declaration says allow_thin = true)."""
    monkeypatch.chdir(tmp_path)
    toml = tmp_path / "vd.toml"
    toml.write_text('[goldens.m]\npath = "m.zarr"\nmodel = "tiny-llama-mtp"\nfeed = "mtp"\nk = [3]\nsteps = 4\n')
    code, out, err = cli("record", "--suite")
    assert code == 1 and "REFUSED" in out and "nothing written; declare allow_thin = true for m to store it " \
        "anyway" in out, out + err
    toml.write_text(toml.read_text() + "allow_thin = true\n")
    code, out, err = cli("record", "--suite")
    assert code == 0 and "RECORDED" in out, out + err


def test_prune_removes_orphans_only_once_confirmed(project, cli):
    """An orphan is any golden beside a declared one that no declaration names (one the suite never recorded
    among them): `--prune` lists them and, without a terminal to ask at, removes them only with `--yes`."""
    import shutil

    shutil.copytree(project / "goldens" / "a.zarr", project / "goldens" / "kept.zarr")
    code, out, err = cli("status", "--no-models", "--prune")
    assert code == 2 and "orphan: goldens/kept.zarr" in out and "add --yes to remove them" in err, out + err
    assert (project / "goldens" / "kept.zarr").is_dir()
    code, out, err = cli("status", "--no-models", "--prune", "--yes")
    assert code == 0 and "removed 1 orphan golden(s)" in out, out + err
    assert "orphan: goldens/kept.zarr (declared by none)" in out  # not "vd status --prune removes it": it did
    assert not (project / "goldens" / "kept.zarr").exists() and (project / "goldens" / "a.zarr").is_dir()


def test_prune_never_removes_a_golden_another_declaration_names(project, cli):
    """A golden that another declaration names (the project's pyproject.toml beside a vd.toml read with --config;
    a shared folder's own vd.toml for a golden declared there and found beside this suite's) is no orphan: `vd
    status --prune --yes` removed them (a user test lost a project's goldens and their histories)."""
    import shutil

    (project / "pyproject.toml").write_text('[tool.vd.goldens.other]\npath = "goldens/other.zarr"\n')
    shutil.copytree(project / "goldens" / "a.zarr", project / "goldens" / "other.zarr")
    (project / "goldens" / "vd.toml").write_text('[goldens.shared]\npath = "shared.zarr"\n')
    shutil.copytree(project / "goldens" / "a.zarr", project / "goldens" / "shared.zarr")
    shutil.copytree(project / "goldens" / "a.zarr", project / "goldens" / "lost.zarr")
    code, out, err = cli("status", "--no-models", "--config", "vd.toml", "--prune", "--yes")
    assert code == 0 and "removed 1 orphan golden(s)" in out and "orphan: goldens/lost.zarr" in out, out + err
    assert "other.zarr" not in out and "shared.zarr" not in out, out
    assert (project / "goldens" / "other.zarr").is_dir() and (project / "goldens" / "shared.zarr").is_dir()
    (project / "goldens" / "vd.toml").write_text("[goldens.shared\n")  # one vd cannot read might name it: kept
    code, out, err = cli("status", "--no-models", "--config", "vd.toml", "--prune", "--yes")
    assert code == 0 and "orphan" not in out and (project / "goldens" / "shared.zarr").is_dir(), out + err


def test_a_declared_goldens_refresh_by_vd_record_needs_a_reason(project, cli):
    """`vd refresh a` and `vd record --suite --refresh` ask a reason; `vd record a --refresh` recorded one of its own
    ("vd record --refresh") into a declared golden's history and rewrote its pin (a user test)."""
    code, out, err = cli("record", "a", "--refresh")
    assert code == 2 and "--refresh of a, which" in err and "needs --reason TEXT" in err, out + err
    assert len(open_golden(project / "goldens" / "a.zarr").history) == 1
    code, out, err = cli("record", "a", "--refresh", "--reason", "a new kernel")
    assert code == 0 and open_golden(project / "goldens" / "a.zarr").history[-1]["reason"] == "a new kernel", err


def test_a_declared_plugin_file_is_relative_to_its_declaration(tmp_path, cli, monkeypatch, request):
    """`model = "engine.py:factory"` beside the declaration: from a subfolder (tests/) a suite replay looked for
    tests/engine.py, and so did vd status and a refresh; with --config from elsewhere, ./engine.py (a user test).
    A declaration's paths are relative to its folder, the model's file too; the golden's own stored spec is
    found from a subfolder of its project."""
    import shutil

    shutil.copy(request.config.rootpath / PERTURB.split(":")[0], tmp_path / "engine.py")
    (tmp_path / "tests").mkdir()
    (tmp_path / "pyproject.toml").write_text('[tool.vd.goldens.alpha]\npath = "goldens/alpha.zarr"\n'
                                             'model = "engine.py:factory"\nk = [2]\nsteps = 4\n')
    monkeypatch.chdir(tmp_path / "tests")
    code, out, err = cli("record", "--suite")
    assert code == 0 and "RECORDED" in out, out + err
    assert open_golden(tmp_path / "goldens" / "alpha.zarr").meta["model"]["spec"] == "engine.py:factory"  # portable
    code, out, err = cli("replay", "--suite")
    assert code == 0 and "PASS: 1 PASS of 1 golden(s)" in out, out + err
    code, out, err = cli("status")
    assert code == 0 and "current" in out, out + err
    code, out, err = cli("record", "alpha", "--refresh", "--reason", "again")
    assert code == 0 and "asked:" not in out, out + err
    monkeypatch.chdir(tmp_path.parent)
    code, out, err = cli("replay", "alpha", "--config", tmp_path / "pyproject.toml")
    assert code == 0 and out.rstrip().endswith("PASS"), out + err


def test_a_declared_golden_not_recorded_yet_says_how_to_record_it(project, cli):
    """`vd replay a` of a declared golden not recorded said only "goldens/a.zarr does not exist", where a suite
    replay and pytest --vd say how to record it; `vd history nosuch` did not list the declared names (a user
    test)."""
    import shutil

    shutil.rmtree(project / "goldens" / "a.zarr")
    for args in (("replay", "a"), ("show", "a"), ("history", "a"), ("verify", "a")):
        code, out, err = cli(*args)
        assert code == 2 and "a, which" in err and "is not recorded yet (vd record --suite a)" in err, (args, err)
    code, out, err = cli("history", "nosuch")
    assert code == 2 and "declares no golden of that name (it declares a, b)" in err, err


def test_record_of_one_declared_golden_takes_its_declaration_from_config(tmp_path, cli, monkeypatch):
    """`vd record OUT --config FILE` records the golden FILE declares at OUT (or by the name OUT) with its
    declared settings, changed only by the flags given; an OUT FILE does not declare is refused (exit 2).
    Without --config, the declaration found from here is used the same way, where it declares OUT."""
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "team.toml").write_text(SUITE.replace('"goldens/', '"../goldens/'))
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("record", "goldens/a.zarr", "--config", "ci/team.toml")
    assert code == 0, out + err
    got = RecordSettings.of_golden(open_golden(tmp_path / "goldens" / "a.zarr").meta)
    assert (got.model, got.steps, got.ks) == ("tiny-llama", 4, (2, 3)), got  # declared, not the flags' defaults
    code, out, err = cli("record", "b", "--config", "ci/team.toml", "--steps", "5")  # by name; a flag given wins
    assert code == 0, out + err
    got = RecordSettings.of_golden(open_golden(tmp_path / "goldens" / "b.zip").meta)
    assert (got.steps, got.ks, got.prompt) == (5, (2,), "Write one sentence about the sea."), got
    code, out, err = cli("record", "b", "--config", "ci/team.toml")
    assert code == 2 and "already holds a golden" in err and err.count("\n") == 1, err
    code, out, err = cli("record", "goldens/c.zarr", "--config", "ci/team.toml")
    assert code == 2 and "declares no golden" in err and "a, b" in err and err.count("\n") == 1, err
    assert not (tmp_path / "goldens" / "c.zarr").exists()
    code, out, err = cli("record", "goldens/c.zarr", "--model", "tiny-llama", "--steps", "4")  # undeclared: flags
    assert code == 0 and "declares it" not in out, out + err
    (tmp_path / "goldens" / "b.zip").unlink()
    (tmp_path / "ci" / "team.toml").rename(tmp_path / "vd.toml")  # (its paths now one folder too high)
    (tmp_path / "vd.toml").write_text((tmp_path / "vd.toml").read_text().replace('"../goldens/', '"goldens/'))
    code, out, err = cli("record", "b", "--k", "2,3")  # the name, the declaration found from here
    assert code == 0 and f"recording b as {tmp_path / 'vd.toml'} declares it, changed by --k" in out, out + err
    assert "vd: note: b now differs from its declaration (ks: recorded [2, 3], declared [2]); vd status and vd " \
           "replay --suite call it stale until the declaration says the same" in err, err
    got = RecordSettings.of_golden(open_golden(tmp_path / "goldens" / "b.zip").meta)
    assert (got.steps, got.ks, got.prompt) == (4, (2, 3), "Write one sentence about the sea."), got
    code, out, err = cli("refresh", "b", "--reason", "as declared again")  # back to what the declaration says
    assert code == 0 and "vd: note" not in err, out + err
    assert not (tmp_path / "b").exists()
    (tmp_path / "vd.toml").write_text("[goldens.x]\nk = 3\n")  # a broken declaration found here is passed over
    code, out, err = cli("record", "goldens/d.zarr", "--model", "tiny-llama", "--steps", "4")
    assert code == 0, out + err


def test_a_broken_declaration_that_may_declare_the_golden_is_refused(project, cli):
    """A mistake elsewhere in the declaration found from here made every command on one golden pass it over,
    and with it the golden's pin: a pinned golden then PASSed whatever its content. Where the broken
    declaration names the golden (by name or path), or its TOML cannot be read, the command now fails with the
    declaration's error (exit 2); one that plainly declares it not is still passed over."""
    toml = project / "vd.toml"
    text = toml.read_text().replace("k = [2, 3]", f'k = [2, 3]\npin = "sha256:{"0" * 64}"')
    toml.write_text(text)
    assert cli("replay", "goldens/a.zarr")[0] == 2  # the pin, as declared
    toml.write_text(text + '\n[goldens.other]\npath = "goldens/o.zarr"\nstpes = 4\n')
    for target in ("goldens/a.zarr", "a"):
        code, out, err = cli("replay", target)
        assert code == 2 and "unknown key 'stpes'" in err and err.count("\n") == 1, (target, out, err)
    toml.write_text('[goldens.other]\npath = "goldens/o.zarr"\nstpes = 4\n')  # declares no golden a
    assert cli("replay", "goldens/a.zarr")[0] == 0
    toml.write_text("[goldens.a\n")
    code, out, err = cli("replay", "goldens/a.zarr")
    assert code == 2 and "not valid TOML" in err, out + err


def test_a_pinned_golden_is_not_refreshed_when_its_pin_cannot_be_written(project, cli, monkeypatch):
    """A refresh published the golden and then failed to write the new pin (a read-only declaration), leaving a
    golden its own pin refused, with an OSError line that said neither. The declaration is checked first now:
    nothing is published (exit 2); a pin that still cannot be written after publishing says what to write."""
    import vd.workflow.declare as D

    toml = project / "vd.toml"
    pin = open_golden(project / "goldens" / "a.zarr").content_digest()
    toml.write_text(toml.read_text().replace("k = [2, 3]", f'k = [2, 3]\npin = "{pin}"'))
    real = os.access
    monkeypatch.setattr(D.os, "access", lambda f, mode: False if Path(f) == toml else real(f, mode))
    for args in (("refresh", "a", "--reason", "x"), ("record", "--suite", "--refresh", "--reason", "x"),
                 ("record", "a", "--refresh", "--steps", "5", "--reason", "x")):
        code, out, err = cli(*args)
        assert code == 2 and "cannot be written" in err and "nothing was recorded" in err, (args, out, err)
        assert len(open_golden(project / "goldens" / "a.zarr").history) == 1
    monkeypatch.setattr(D.os, "access", real)
    monkeypatch.setattr(D, "set_pin", lambda *a: (_ for _ in ()).throw(OSError(30, "Read-only file system")))
    code, out, err = cli("record", "a", "--refresh", "--steps", "5", "--reason", "x")
    new = open_golden(project / "goldens" / "a.zarr").content_digest()
    assert code == 2 and "was published, but its pin in" in err and f'set pin = "{new}" for a by hand' in err, err
    toml.write_text(toml.read_text() + f'# was "{pin}"\n')  # the pin's text twice: refused first
    code, out, err = cli("refresh", "a", "--reason", "y")
    assert code == 2 and "does not appear exactly once" in err, err


def test_a_suite_refresh_cut_short_pins_what_it_published(project, cli, monkeypatch):
    """Ctrl-C (or a CI timeout) in the middle of a suite's refresh: the goldens published before it have their new
    pins in the declaration at once, so the suite's replay still takes them; one line says it was aborted."""
    import vd.workflow.suite as S

    toml = project / "vd.toml"
    pins = {n: open_golden(project / "goldens" / f).content_digest() for n, f in (("a", "a.zarr"), ("b", "b.zip"))}
    text = toml.read_text().replace("k = [2, 3]", f'k = [2, 3]\npin = "{pins["a"]}"')
    toml.write_text(text.replace("k = [2]", f'k = [2]\npin = "{pins["b"]}"').replace("steps = 4", "steps = 5"))
    real, calls = S.refresh, []

    def cut_short(path, *args, **kwargs):  # the second golden's refresh is interrupted
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(S, "refresh", cut_short)
    code, out, err = cli("record", "--suite", "--refresh", "--reason", "five steps")
    assert code == 130 and err.splitlines()[-1] == "vd: aborted (Ctrl-C)", out + err
    assert len(calls) == 2 and any(line.split()[:2] == ["a", "REFRESHED"] for line in out.splitlines()), out
    now = open_golden(project / "goldens" / "a.zarr").content_digest()
    assert now != pins["a"] and f'pin = "{now}"' in toml.read_text() and pins["b"] in toml.read_text()
    monkeypatch.undo()
    monkeypatch.chdir(project)
    code, out, err = cli("replay", "--suite", "a")
    assert code == 0, out + err


@pytest.mark.parametrize("where", ["_publish", "finish_removals"])
def test_ctrl_c_after_a_refresh_published_says_so(cli, tiny_copy, monkeypatch, where):
    """Ctrl-C after the refresh had published its new version (while the replaced one was being removed) printed
    "vd: aborted (Ctrl-C)" alone, and the user refreshed again, adding a version (found by a user test): the
    line says the golden was published, and where its history shows it. Cut short before, it says nothing so."""
    import vd.workflow.refresh as R

    real = getattr(R, where)

    def cut_short(*args, **kwargs):
        if where == "finish_removals":
            real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(R, where, cut_short)
    code, out, err = cli("refresh", tiny_copy, "--reason", "cut short")
    last = err.splitlines()[-1]
    versions = len(open_golden(tiny_copy).history)
    if where == "_publish":
        assert code == 130 and last == "vd: aborted (Ctrl-C)" and versions == 1, out + err
    else:
        assert code == 130 and versions == 2, out + err
        assert last == f"vd: aborted (Ctrl-C); {tiny_copy} was published before it (version 2: vd history " \
            f"{tiny_copy})", last


def test_a_suite_replay_prints_where_each_golden_parts(tmp_path, monkeypatch, cli):
    """`vd replay --suite --locate` wrote where a forward parts into the JSON and HTML, and printed nothing of it
    (a user test): each golden's locations are printed under its verdict, as `vd replay --locate` prints them."""
    (tmp_path / "vd.toml").write_text('[goldens.t]\npath = "t.zarr"\nmodel = "tiny-llama"\nk = [2]\nsteps = 4\n'
                                      'allow_thin = true\ntrace = true\n')
    monkeypatch.chdir(tmp_path)
    assert cli("record", "--suite")[0] == 0
    code, out, err = cli("replay", "--suite", "--decode-forward", "sdpa", "--locate")
    assert code == 1, out + err
    assert "    where sdpa parts from the golden's module traces:\n      decode the prefill: first difference at " \
        "model.layers.0.self_attn.o_proj" in out, out
