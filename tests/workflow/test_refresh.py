"""A reviewed refresh: a new version only with a reason and only when sound, a change summary against the
version it replaces, the golden's history, and a replay's candidate promoted without re-recording."""

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from golden_edit import files

from vd.errors import UsageError
from vd.recorder import RecordSettings, record
from vd.replayer import ReplaySettings, replay
from vd.store import open_golden
from vd.workflow.refresh import promote, refresh

SETTINGS = RecordSettings(model="tiny-llama", steps=4, ks=(2, 3))
DEAF = Path(__file__).parent.parent / "plugins" / "deaf.py"



@pytest.fixture
def golden(tmp_path, tiny):
    path = tmp_path / "g.zarr"
    assert record(path, SETTINGS, model=tiny, reason="trusted build, first recording").location is not None
    return path


def test_a_refresh_with_unchanged_logits_adds_only_a_history_entry(golden, tiny):
    was = files(golden)
    before = open_golden(golden)
    r = refresh(golden, RecordSettings.of_golden(before.meta), reason="new CI runner", model=tiny)
    assert r.published and r.version == 2
    assert r.changes == ["no logit, step or decision moved (content digest unchanged)"]
    assert "**Reason:** new CI runner" in r.summary and "| 2 | verify | 0 | 8 |" in r.summary
    after = open_golden(golden)
    h = after.history
    assert [e["reason"] for e in h] == ["trusted build, first recording", "new CI runner"]
    assert h[1]["previous"] == h[0]["content_digest"] == h[1]["content_digest"] == after.content_digest()
    assert {"time", "user", "host", "environment", "fingerprint", "forward", "vd"} <= set(h[1])
    now = files(golden)  # what git would show: the run group, and the root's new history entry alone
    assert [n for n in now if now[n] != was[n]] == ["run/zarr.json", "zarr.json"] and now.keys() == was.keys()
    roots = [json.loads(x["zarr.json"])["attributes"]["vd"] for x in (was, now)]
    assert roots[1].pop("history")[:1] == roots[0].pop("history")
    assert roots[1].pop("golden_id") != roots[0].pop("golden_id") and roots[0] == roots[1]  # the same manifest


def test_a_refresh_asked_to_change_a_setting_says_so(golden, tiny):
    r = refresh(golden, RecordSettings(model="tiny-llama", steps=6, ks=(2, 3)), reason="longer", model=tiny)
    assert "asked: steps: 4 -> 6" in r.changes
    assert any(c.startswith("rows not compared:") and "steps (4 vs 6)" in c for c in r.changes)
    assert open_golden(golden).info.steps == 6


def test_a_policy_that_names_a_default_asks_no_change_again(golden, tiny):
    """A policy declared with a default in it (prefill=exact) is the policy recorded, and a refresh asking it
    again said "asked: tolerances: ['verify=argmax'] -> ['verify=argmax', 'prefill=exact']" every time, into the
    history too (a user test), where vd status called the golden current. A real change is still said."""
    asked = RecordSettings(model="tiny-llama", steps=4, ks=(2, 3), tolerances=("verify=argmax", "prefill=exact"))
    refresh(golden, asked, reason="argmax", model=tiny)
    again = refresh(golden, asked, reason="again", model=tiny)
    assert not [c for c in again.changes if "tolerances" in c], again.changes
    other = dataclasses.replace(asked, tolerances=("verify=argmax", "prefill=ulp:1"))
    assert "asked: tolerances: ['verify=argmax'] -> ['prefill=ulp:1', 'verify=argmax']" in refresh(
        golden, other, reason="looser", model=tiny).changes


def test_a_refresh_to_another_forward_says_it_once(golden, tiny):
    r = refresh(golden, RecordSettings(model="tiny-llama", steps=4, ks=(2, 3), forward="sdpa"), reason="sdpa",
                model=tiny)
    assert r.published and open_golden(golden).info.forward == "sdpa"
    assert [c for c in r.changes if "forward" in c] == ["asked: forward: 'eager' -> 'sdpa'"]


def test_a_thin_or_blind_new_recording_is_refused_and_the_old_golden_kept(golden, tiny):
    before = files(golden)
    thin = refresh(golden, RecordSettings(model="tiny-llama", steps=1, ks=(3,)), reason="thin", model=tiny)
    assert not thin.published and "needs both full and partial accepts" in thin.refused[0]
    spec = importlib.util.spec_from_file_location("deaf_for_refresh", DEAF)
    deaf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(deaf)
    blind = refresh(golden, SETTINGS, reason="blind", model=deaf.factory(device="cpu", dtype="bfloat16"))
    assert not blind.published and any("detection control saw no difference" in x for x in blind.refused)
    assert files(golden) == before
    with pytest.raises(UsageError, match="needs a reason"):
        refresh(golden, SETTINGS, reason=" ", model=tiny)


def test_a_saved_candidate_is_reviewed_and_promoted(golden, tmp_path, perturbed, tiny):
    cand = tmp_path / "cand.zarr"
    perturbed_spec = "perturbed-tiny-llama"
    rep = replay(golden, ReplaySettings(model=perturbed_spec, save_candidate=str(cand), allow_model_mismatch=True),
                 model=perturbed)
    assert rep.verdict == "FAIL" and any("candidate saved" in n for n in rep.notes)
    c = open_golden(cand)
    assert c.meta["candidate"]["of_content"] == open_golden(golden).content_digest()
    assert c.meta["candidate"]["control"] == {"2": True, "3": True}
    assert replay(cand, ReplaySettings(), model=perturbed).verdict == "PASS"  # it is the perturbed build's golden
    r = promote(cand, golden, reason="accept the one-ULP change")
    assert r.published and r.changes[0] == (f"rows from a replay with {perturbed_spec} (eager), promoted from a "
                                            "saved candidate")  # no path: the candidate's folder may be temporary
    assert r.changes[1].startswith("rows moved at K=[2, 3]: 2 of")
    assert "| 2 | verify | 1 | 8 | 0.003906 | 0 | 3 |" in r.summary
    g = open_golden(golden)
    assert "candidate" not in g.meta and g.history[-1]["reason"] == "accept the one-ULP change"
    assert g.meta["model"]["spec"] == "tiny-llama"  # still the golden of the model it names
    assert replay(golden, ReplaySettings(), model=perturbed).verdict == "PASS"
    with pytest.raises(UsageError, match="saved against another version"):
        promote(cand, golden, reason="again")  # the golden moved on since the candidate was saved
    other = tmp_path / "other.zarr"  # of the same model and feed, another prompt: the candidate is none of its
    assert record(other, RecordSettings(model="tiny-llama", steps=4, ks=(2, 3), prompt="Another prompt."),
                  model=tiny).location is not None
    with pytest.raises(UsageError, match=r"was saved against .*g.zarr \(sha256:[0-9a-f]+\), which is no version of "
                                         r".*other.zarr: replay .*other.zarr itself with --save-candidate"):
        promote(cand, other, reason="wrong golden")  # it said "saved against another version of other.zarr"
    with pytest.raises(UsageError, match="is the golden being replayed"):
        replay(golden, ReplaySettings(save_candidate=str(golden)), model=perturbed)


def test_a_candidate_whose_control_was_inconclusive_is_refused_with_the_way_forward(golden, tmp_path, tiny):
    """A forward that differs at every step (sdpa against an eager golden) leaves the control inconclusive: the
    candidate says so, and its promotion is refused naming that (not "blind") and the re-recording to run."""
    cand = tmp_path / "cand.zarr"
    rep = replay(golden, ReplaySettings(forwards=("sdpa",), save_candidate=str(cand)), model=tiny)
    assert rep.verdict == "FAIL"
    made = open_golden(cand).meta["candidate"]
    inconclusive = [k for k, o in zip(SETTINGS.ks, rep.verify) if o.control.inconclusive]
    assert inconclusive and made["inconclusive"] == [str(k) for k in inconclusive]
    r = promote(cand, golden, reason="sdpa from now on")
    assert not r.published and all(f"K={k}: the candidate's detection control was inconclusive" in " ".join(r.refused)
                                   for k in inconclusive)
    assert r.refused[len(inconclusive)] == (f"record the change itself instead: vd record {golden} --refresh "
                                            "--forward sdpa --reason 'sdpa from now on'")
    assert "blind" not in " ".join(r.refused) and r.record_instead == {"forward": "sdpa"}


def test_an_inconclusive_candidate_of_the_goldens_own_forward_is_recorded_by_a_plain_refresh(golden, tmp_path,
                                                                                              perturbed, monkeypatch):
    """A build whose every step differs (a new torch, say) replays the golden's own model and forward: the way
    forward is the golden's refresh itself, named without a setting to declare (it said "declare  in")."""
    cand = tmp_path / "cand.zarr"
    monkeypatch.setattr(perturbed, "step", None)  # every step, the controls' included (the session's, so put back)
    replay(golden, ReplaySettings(save_candidate=str(cand)), model=perturbed)
    assert open_golden(cand).meta["candidate"]["inconclusive"] == ["2", "3"]
    r = promote(cand, golden, reason="torch 2.14")
    assert r.refused[-1] == f"record the change itself instead: vd record {golden} --refresh --reason 'torch 2.14'"
    assert r.record_instead == {}
    r = promote(cand, golden, reason="torch 2.14", name="tiny")
    assert r.refused[-1] == "record the change itself instead: vd refresh tiny --reason 'torch 2.14'"


@pytest.mark.parametrize("damage", ["flipped", "truncated", "run group"])
def test_a_golden_damaged_in_its_rows_is_refreshed_its_history_kept(golden, tiny, damage):
    """A chunk file that no longer matches the manifest makes the golden no reference (every replay refuses it),
    but it must not stop the refresh that replaces it: the change summary says the rows were not compared, and
    the history, in the intact root metadata, goes on (a chunk cut short lost it: the golden was not opened)."""
    from golden_edit import chunk, flip_byte

    if damage == "flipped":
        flip_byte(chunk(golden, 2))
    elif damage == "truncated":
        chunk(golden, 2).write_bytes(chunk(golden, 2).read_bytes()[:3])
    else:  # outside the manifest, read for its timings: its damage lost the history (found by a user test)
        (golden / "run" / "zarr.json").write_text("garbage\n")
    r = refresh(golden, SETTINGS, reason="replace the damaged golden", model=tiny)
    assert r.published and r.version == 2, r.refused
    assert damage == "run group" or any(c.startswith("rows not compared: ") and (
        "does not match the golden's manifest" in c or "bytes" in c) for c in r.changes), r.changes
    after = open_golden(golden)
    after.check_files()
    assert [e["reason"] for e in after.history] == ["trusted build, first recording", "replace the damaged golden"]


def test_the_change_summary_names_the_decode_rows_as_such():
    """The decode group (K = 1 in the store) is "decode" in the change summary's table and headline, as in every
    other report (its rows were listed as K 1 "verify" rows)."""
    from vd.replayer import words
    from vd.store.format import DECODE_K

    rows = [(2, "verify", 0, 8, 0.0, 0, ""), (DECODE_K, "prefill", 0, 33, 0.0, 0, ""),
            (DECODE_K, "verify", 2, 24, 0.5, 1, "3, 5")]
    assert words.rows_headline(rows) == ["rows moved in the decode rows: 2 of the golden's 65 rows, max |delta| "
                                         "0.5, 1 argmax flip(s)"]
    md = words.refresh_markdown("t", "r", words.changes_markdown([], rows, []))
    assert "| decode | decode | 2 | 24 | 0.5 | 1 | 3, 5 |" in md and "| decode | prefill | 0 | 33 |" in md
    assert "| 2 | verify | 0 | 8 |" in md and "| steps that moved |" in md
    rows[0] = (2, "verify", 1, 8, 0.25, 0, "1")
    assert words.rows_headline(rows)[0].startswith("rows moved at K=[2] and in the decode rows: 3 of the golden's "
                                                   "65 rows")
