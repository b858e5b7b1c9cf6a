"""Verify rows against decode rows (format 7): which decode row each verify row is, the golden's own
equivalence as recorded and shown, each forward's as replayed, `equivalence=SPEC` judging it, and a golden
without decode rows saying so."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from vd.equivalence import decode_map
from vd.layout import StepLog
from vd.store import open_golden
from vd.store.format import DECODE_K

PLUGINS = Path(__file__).parent / "plugins"
STEPWISE = f"{PLUGINS / 'stepwise.py'}:factory"
DATA = Path(__file__).parent / "data"


def _log(k: int, tokens: list[list[int]], accepted: list[int], decoded: int | None = None) -> StepLog:
    return StepLog(k=k, bootstrap=tokens[0][0], tokens=np.array(tokens, dtype=np.int32),
                   accepted=np.array(accepted, dtype=np.int32), step_ms=np.zeros(len(tokens)), decoded=decoded)


def test_each_verify_row_whose_input_is_greedy_is_a_decode_row():
    """Greedy 10, 11, 12, ...; K=3: step 0 verifies [10, 11, 12] and accepts both (rows 0..2 are decode rows
    0..2); step 1 verifies [13, 15, 15] with its first draft corrupted (row 0 is decode row 3, rows 1 and 2 saw
    the corrupted token), accepts none; step 2 starts from 14 again."""
    greedy = list(range(10, 30))
    log = _log(3, [[10, 11, 12], [13, 15, 15], [14, 15, 16]], [2, 0, 2])
    assert decode_map(log, prompt=5, greedy=greedy, decode_steps=12).tolist() == [0, 1, 2, 3, -1, -1, 4, 5, 6]
    assert decode_map(log, prompt=5, greedy=greedy, decode_steps=5).tolist() == [0, 1, 2, 3, -1, -1, 4, -1, -1]
    # The drafter feed's bootstrap decode commits `decoded` (greedy[0]) before its first step.
    drafted = _log(2, [[11, 12], [13, 9]], [1, 0], decoded=10)
    assert decode_map(drafted, 5, greedy, 12).tolist() == [1, 2, 3, -1]
    # Once the committed sequence has left greedy, nothing maps.
    left = _log(2, [[10, 99], [7, 8]], [1, 1])
    assert decode_map(left, 5, greedy, 12).tolist() == [0, -1, -1, -1]


@pytest.fixture(scope="module")
def stepwise_golden(tmp_path_factory, cli):
    """A golden of the stepwise plug-in: verify rows equal its decode rows but one element of K=3 step 0 row 1."""
    path = tmp_path_factory.mktemp("equivalence") / "stepwise.zarr"
    code, out, err = cli("record", path, "--model", STEPWISE, "--steps", "6", "--k", "2,3")
    assert code == 0, err
    return path, out


def test_a_recording_stores_its_decode_rows_and_says_how_its_verify_rows_compare(stepwise_golden, cli):
    path, out = stepwise_golden
    g = open_golden(path)
    assert g.info.version == 7 and g.decoded and g.groups == [2, 3, DECODE_K]
    decode = g.checked_log(DECODE_K)
    assert decode.tokens.shape == (18, 1) and not decode.accepted.any()  # S x max(K) one-token decodes
    assert decode.tokens[:, 0].tolist() + [g.meta["greedy"][-1]] == g.meta["greedy"]
    assert "K=2: verify vs decode: " in out and "K=3: verify vs decode: " in out
    k2 = next(line for line in out.splitlines() if line.startswith("K=2: verify vs decode"))
    k3 = next(line for line in out.splitlines() if line.startswith("K=3: verify vs decode"))
    rows3 = int(k3.split(" of ")[1].split()[0])
    assert k2.split(": ", 2)[2].startswith(f"{k2.split(' of ')[1].split()[0]} of ")  # every K=2 pair identical
    assert f"{rows3 - 1} of {rows3} rows bit-identical (first other at step 0 row 1)" in k3
    code, shown, err = cli("show", path)
    assert code == 0 and "verify vs decode: " in shown and "(first other at step 0 row 1)" in shown, err
    assert "decode    18 one-token decode rows" in shown


def test_a_replay_reports_each_forwards_equivalence_and_judges_it_when_asked(stepwise_golden, cli, tmp_path):
    path, _ = stepwise_golden
    code, out, err = cli("replay", path, "--model", STEPWISE, "--report", tmp_path / "r.json")
    assert code == 0 and "PASS" in out, out + err  # reported, not judged
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["decode"]["comparisons"][0]["passed"] and r["decode"]["k"] == DECODE_K
    k3 = next(v for v in r["verify"] if v["k"] == 3)["equivalence"]
    (own,) = k3["forwards"]
    assert own["variant"] == "eager" and own["rows"] - own["identical"] == 1 and not own["judged"]
    assert own["first"] == {"step": 0, "row": 1} and own["max_ulp"] == 1 and own == {**k3["golden"], "variant": "eager"}
    code, out, err = cli("replay", path, "--model", STEPWISE, "--tolerance", "equivalence=exact",
                         "--report", tmp_path / "exact.json")
    assert code == 1 and "FAIL" in out, out
    reasons = json.loads((tmp_path / "exact.json").read_text())["reasons"]
    (why,) = reasons
    assert why.startswith("verify K=3, eager: 1 of ") and "equivalence=exact" in why and "step 0 row 1" in why
    # Its bundle (none was written: its rows matched the golden's): the failing verify row and its decode row.
    bundle = tmp_path / "exact.json.bundle"
    assert "first-divergence bundle: " in out and json.loads((tmp_path / "exact.json").read_text())["bundle"]
    failure = json.loads((bundle / "failure.json").read_text())
    assert (failure["k"], failure["kind"], failure["step"], failure["decode_forward"]) == (3, "equivalence", 0, "eager")
    assert failure["first_failure"]["row"] == 1 and failure["first_failure"]["policy"] == "exact"
    rows = np.load(bundle / "rows.npz")
    assert rows["candidate"].shape == rows["golden"].shape == (1, 512) and (rows["candidate"] != rows["golden"]).any()
    assert "--k 3 --forward eager" in (bundle / "command.sh").read_text()
    code, out, err = cli("replay", path, "--model", STEPWISE, "--tolerance", "equivalence=ulp:1")
    assert code == 0, out


def test_a_recording_warns_when_its_own_rows_fail_its_equivalence_policy(cli, tmp_path):
    """`vd record --tolerance equivalence=exact` of a forward whose own verify rows differ from its decode rows
    stored a golden every replay of that forward FAILs, without a word. It is stored, and a warning says so,
    per K that fails, and by a refresh of it; a policy its rows meet warns of nothing."""
    path = tmp_path / "g.zarr"
    args = ("record", path, "--model", STEPWISE, "--steps", "6", "--k", "2,3")
    code, out, err = cli(*args, "--tolerance", "equivalence=exact")
    assert code == 0 and "K=3: verify vs decode: " in out and "; FAIL" in out, out + err
    assert "vd: warning: K=3: the golden's own verify rows fail its equivalence=exact against its decode rows " \
           "(1 of " in err and "warning: K=2" not in err, err
    assert cli("replay", path, "--model", STEPWISE)[0] == 1  # as the warning says
    # A refresh of it under the same policy warns as the recording did (it was refused: "does not pass its own
    # replay", so a golden `vd record` stored could never be refreshed).
    code, out, err = cli("refresh", path, "--reason", "same build")
    assert code == 0 and "refreshed" in out and "to version 2" in out, out + err
    assert "vd: warning: K=3: the golden's own verify rows fail its equivalence=exact" in err, err
    code, out, err = cli(*args, "--tolerance", "equivalence=ulp:1", "--refresh", "--reason", "one ULP allowed")
    assert code == 0 and "warning" not in err, err


def test_decode_forward_computes_the_decode_rows_each_forward_is_measured_against(cli, tiny_golden, tmp_path):
    """--decode-forward NAME (an engine that decodes with another kernel than it verifies): each forward's verify
    rows are measured against the decode rows NAME computed, and those decode rows are judged against the
    golden's like any rows. On the eager tiny-llama golden, sdpa's decode rows differ from the golden's (the
    FAIL names them as sdpa's, and the way to accept them is a recording with sdpa, not a refresh of eager),
    while eager's verify rows still match; naming the golden's own forward is the default replay."""
    code, out, err = cli("replay", tiny_golden, "--k", "2", "--decode-forward", "sdpa", "--report", tmp_path / "r.json")
    assert code == 1 and "FAIL" in out.splitlines(), out + err
    r = json.loads((tmp_path / "r.json").read_text())
    (decoded,) = r["decode"]["comparisons"]
    assert decoded["variant"] == "sdpa" and not decoded["passed"]
    (v,) = r["verify"]
    assert v["comparisons"][0]["variant"] == "eager" and v["comparisons"][0]["passed"]
    assert v["equivalence"]["decode_forward"] == "sdpa" and v["equivalence"]["forwards"][0]["variant"] == "eager"
    (why,) = r["reasons"]
    assert why.startswith("decode rows (for eager's verify rows), sdpa: "), why
    # the decode rows alone fail: the next step still gives the replay writing their bundle (it gave none)
    assert "Look at the first divergence (decode, sdpa, prefill row 1 index 0) in its bundle " in out, out
    assert "--decode-forward sdpa" in (tmp_path / "r.json.bundle" / "command.sh").read_text()
    # (it said to record the golden with --forward sdpa, whose verify rows then failed: test_a_decode_forward_...)
    assert "To compute the golden's decode rows with sdpa (its verify rows still eager's), record it so: vd record " \
           f"{tiny_golden} --refresh --decode-forward sdpa --reason TEXT." in out and "vd refresh" not in out, out
    code, out, err = cli("replay", tiny_golden, "--k", "2", "--decode-forward", "eager", "--report",
                         tmp_path / "e.json")
    assert code == 0, out + err
    own = json.loads((tmp_path / "e.json").read_text())["verify"][0]["equivalence"]
    assert own["decode_forward"] == "eager" and own["forwards"][0]["identical"] == own["golden"]["identical"]


def test_a_decode_forward_is_recorded_and_replayed_by_default(cli, tmp_path):
    """`vd record --decode-forward sdpa`: the golden's decode rows are sdpa's (those a golden of sdpa holds), its
    verify rows eager's; every replay computes the decode rows with sdpa (a PASS), another decode forward fails
    them, and the next step records that one's (it said to record --forward NAME, whose verify rows then failed,
    and back: a circle, found by a user test); naming the golden's forward records one forward again."""
    from golden_edit import edit_meta

    g, s = tmp_path / "g.zarr", tmp_path / "s.zarr"
    common = ("--model", "tiny-llama", "--k", "2", "--steps", "4", "--allow-thin")
    assert cli("record", g, *common, "--decode-forward", "sdpa")[0] == 0
    assert cli("record", s, *common, "--forward", "sdpa")[0] == 0
    meta = open_golden(g).meta
    assert meta["decode"] == {"steps": 8, "forward": "sdpa"} and meta["forward"] == "eager"
    assert np.array_equal(open_golden(g).summary(DECODE_K)[0], open_golden(s).summary(DECODE_K)[0])
    code, out, err = cli("show", g)
    assert code == 0 and "computed with sdpa: every replay computes them so" in out, out + err
    code, out, err = cli("replay", g, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and r["decode"]["comparisons"][0]["variant"] == "sdpa", out + err
    assert r["golden_decode_forward"] == "sdpa"
    code, out, err = cli("replay", g, "--decode-forward", "eager")
    step = f"record it so: vd record {g} --refresh --decode-forward eager --reason TEXT."
    assert code == 1 and step in out and "--forward eager --decode-forward eager" in out, out + err
    # A candidate's decode rows are labelled with the forward that computed them (its own forward's: no label): a
    # promoted one replays (it failed its own replay, a user test), and one of sdpa is readable (it was refused).
    for flags, name in ((("--decode-forward", "eager"), "c.zarr"), (("--forward", "sdpa"), "c2.zarr")):
        assert cli("replay", g, *flags, "--save-candidate", tmp_path / name)[0] == 1
        assert open_golden(tmp_path / name).meta["decode"] == {"steps": 8}
    promoted = tmp_path / "p.zarr"
    shutil.copytree(g, promoted)
    assert cli("refresh", promoted, "--from", tmp_path / "c.zarr", "--reason", "eager's decode")[0] == 0
    assert cli("replay", promoted)[0] == 0
    code, out, _ = cli("diff", g, promoted)
    assert "made differently: decode forward: sdpa vs eager" in out, out
    code, out, _ = cli("diff", g, s)  # (s: sdpa's golden, its decode rows the same)
    assert "made differently: forward: eager vs sdpa" in out and "decode forward" not in out, out
    assert cli("record", g, "--refresh", "--decode-forward", "eager", "--reason", "one forward")[0] == 0
    code, out, _ = cli("diff", s, g)
    assert "made differently: forward: sdpa vs eager" in out, out
    assert open_golden(g).meta["decode"] == {"steps": 8}
    edit_meta(g, lambda m: m["decode"].update(forward="eager"))  # the golden's own forward: never stored so
    code, out, err = cli("show", g)
    assert code == 2 and "metadata field 'decode'" in err, out + err


def test_the_bundle_shows_a_regression_before_an_equivalence_the_golden_shares(cli, tmp_path, monkeypatch):
    """A golden whose own verify rows fail equivalence=exact at K=2 (as tiny-llama's eager rows did at K=3 step 13
    on some hosts; here, host-independent, against sdpa's decode rows: --decode-forward sdpa); a build moving one
    K=4 verify row sent the first-divergence bundle (and the next step) to that K=2 pair, and nothing captured the
    regression (found by a user test). Rows differing from the golden's come first, whatever their K."""
    golden = tmp_path / "g.zarr"
    assert cli("record", golden, "--model", "tiny-llama", "--decode-forward", "sdpa")[0] == 0
    monkeypatch.setenv("VD_PERTURB_STEP", "4")
    monkeypatch.setenv("VD_PERTURB_K", "4")
    code, out, err = cli("replay", golden, "--model", f"{PLUGINS / 'perturb.py'}:factory", "--tolerance",
                         "equivalence=exact", "--report", tmp_path / "r.json")
    assert code == 1 and "verify K=2, eager: " in out and " verify rows fail equivalence=exact" in out, out + err
    failure = json.loads((tmp_path / "r.json.bundle" / "failure.json").read_text())
    assert (failure["k"], failure["kind"], failure["step"]) == (4, "verify", 4), failure
    assert "Look at the first divergence (K=4, eager, verify step 4 row 1 index 7" in out, out
    # its slim form says of its own pairs what the full golden says (it said "reported": its digests tell exact)
    assert cli("slim", golden, tmp_path / "s.zarr")[0] == 0
    code, out, err = cli("replay", tmp_path / "s.zarr", "--tolerance", "equivalence=exact", "--k", "2", "--report",
                         tmp_path / "s.json")
    own = json.loads((tmp_path / "s.json").read_text())["verify"][0]["equivalence"]["golden"]
    assert own["judged"] and own["failing"] and not own["measured"], own
    assert "fails (the golden's own: not judged)" in out, out + err


def test_decode_forward_named_for_several_forwards_runs_once(cli, tiny_golden, tmp_path):
    """--decode-forward static with --forward eager --forward static ran static's decode rows twice: two equal
    table rows, each axis twice in the report, two JUnit cases of one name (found by a user test)."""
    code, out, err = cli("replay", tiny_golden, "--forward", "eager", "--forward", "static", "--decode-forward",
                         "static", "--k", "2", "--junit", tmp_path / "j.xml", "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert [c["variant"] for c in r["decode"]["comparisons"]] == ["static"], out + err
    assert [e["variant"] for e in r["verify"][0]["equivalence"]["forwards"]] == ["eager", "static"]
    assert (tmp_path / "j.xml").read_text().count('name="decode static"') == 1


def test_a_golden_without_decode_rows_says_the_axis_is_not_recorded(cli, tmp_path):
    golden = DATA / "tiny-llama-v6.zarr"
    code, out, err = cli("replay", golden, "--k", "2", "--report", tmp_path / "r.json")
    assert "verify vs decode: not recorded" in out, out + err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["decode"] is None and r["verify"][0]["equivalence"] is None


def test_a_recordings_own_figures_measured_from_its_held_rows_are_the_stored_goldens(tmp_path, monkeypatch):
    """The recorder measures each K's verify rows against the decode rows it kept while the run still holds
    them (no read-back); a run that let its rows go before its end (a hold of one byte) is measured from the
    published golden instead. Either way the figures are what `of_golden` reads from the golden."""
    import importlib

    from vd.equivalence import of_golden

    R = importlib.import_module("vd.recorder.record")  # the module (the package exports its `record`)

    read_back: list[int] = []

    def counted(golden, k, spec=None):
        read_back.append(k)
        return of_golden(golden, k, spec)

    monkeypatch.setattr(R, "of_golden", counted)
    settings = R.RecordSettings(model=STEPWISE, steps=6, ks=(2, 3))
    held = R.record(tmp_path / "held.zarr", settings)
    assert read_back == [] and sorted(held.equivalence) == [2, 3]
    monkeypatch.setattr(R, "hold_bytes", lambda device: 1)
    let_go = R.record(tmp_path / "let-go.zarr", settings)
    assert read_back == [2, 3]
    for path, result in ((tmp_path / "held.zarr", held), (tmp_path / "let-go.zarr", let_go)):
        g = open_golden(path)
        assert result.equivalence == {k: of_golden(g, k) for k in (2, 3)}
    assert held.equivalence[3].identical == held.equivalence[3].rows - 1  # the one element the plug-in changes


def test_the_goldens_own_failing_pairs_are_not_a_fail_in_a_passing_replays_axes(cli, tmp_path):
    """A golden recorded with sdpa (whose verify rows differ from its decode rows) replayed by static (whose do
    not) under equivalence=exact: the verdict judges static and PASSes, and the golden's own row said FAIL."""
    path = tmp_path / "sdpa.zarr"
    assert cli("record", path, "--model", "tiny-llama", "--forward", "sdpa", "--k", "2", "--steps", "16")[0] == 0
    code, out, err = cli("replay", path, "--forward", "static", "--tolerance", "equivalence=exact", "--tolerance",
                         "kl:1", "--tolerance", "decisions=margin:1", "--report", tmp_path / "r.json")
    assert code == 0, out + err
    axes = json.loads((tmp_path / "r.json").read_text())["verify"][0]["axes"]
    own = next(a for a in axes if a["forward"] == "golden (recorded)")
    static = next(a for a in axes if a["forward"] == "static" and a["axis"] == "verify vs decode")
    assert own["verdict"] == "fails (the golden's own: not judged)" and static["verdict"] == "pass", axes


def test_an_equivalence_check_a_golden_cannot_make_is_said(cli, tmp_path):
    """`--tolerance equivalence=exact` on a golden without decode rows (format 6) PASSed with nothing said of it, and
    `--decode-forward` did nothing (found by a user test): a note says the check judged nothing, and
    --decode-forward on one golden is refused (exit 2)."""
    import shutil

    v6 = tmp_path / "v6.zarr"
    shutil.copytree(Path(__file__).parent / "data" / "tiny-llama-v6.zarr", v6)
    code, out, err = cli("replay", v6, "--k", "2", "--tolerance", "kl:0.05", "--tolerance", "equivalence=exact",
                         "--report", tmp_path / "r.json")
    notes = json.loads((tmp_path / "r.json").read_text())["notes"]
    assert any(n.startswith("equivalence=exact judged nothing: this golden stores no decode rows (format 6")
               for n in notes), (code, notes, err)
    assert "note: equivalence=exact judged nothing" in out
    code, out, err = cli("replay", v6, "--decode-forward", "sdpa")
    assert code == 2 and "--decode-forward measures verify rows against decode rows, and" in err, err

