"""The recorder: what a golden holds, references refused as too thin or short of coverage, settings refused
before any work, and a golden recorded into each kind of location."""

import json

import numpy as np
import pytest
from golden_edit import files

from vd.errors import UsageError
from vd.models import load_model
from vd.recorder import RecordSettings, record
from vd.store import FORMAT_VERSION, open_golden


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny-llama")


def test_a_golden_holds_the_steps_rows_and_what_made_them(tiny_golden):
    g = open_golden(tiny_golden)
    m = g.meta
    assert m["format_version"] == FORMAT_VERSION and m["rows"] == {"stored": True} and m["feed"] == "reference"
    assert m["model"]["spec"] == "tiny-llama" and m["model"]["fingerprint"].startswith("sha256:")
    assert m["forward"] == "eager" and m["graphs"] == "eager" and m["k"] == [2, 3, 4] and m["steps"] == 8
    assert m["logits"]["dtype"] == "bfloat16" and "high byte zstd-1" in m["logits"]["planes"]
    assert m["prompt_tokens"] == g.prompt and len(m["greedy"]) == 8 * 4 + 1
    assert set(m["environment"]) >= {"torch", "transformers", "zarr", "cpu_capability", "threads", "device"}
    for k in g.ks:
        log = g.checked_log(k)
        assert m["logs"][str(k)]["accepted"] == log.accepted.tolist() and log.tokens.shape == (8, k)
        assert log.committed_is_greedy is True and log.bootstrap == m["greedy"][0]
        # The reference feed: drafts from the greedy continuation, one bumped on each odd step.
        assert (log.accepted[::2] == k - 1).all() and (log.accepted[1::2] < k - 1).all()


def test_a_thin_reference_is_refused_unless_allowed(cli, tmp_path, tiny_model):
    path = tmp_path / "thin.zarr"
    r = record(path, RecordSettings(model="tiny-llama", steps=1, ks=(3,)), model=tiny_model)
    assert r.location is None and r.thin == ["verify K=3: the reference accepted [2]; it needs both full and "
                                             "partial accepts"] and not path.exists()
    code, out, err = cli("record", path, "--model", "tiny-llama", "--steps", "1", "--k", "3")
    assert code == 1 and "too thin" in err and "--allow-thin" in err and not path.exists()
    r = record(path, RecordSettings(model="tiny-llama", steps=1, ks=(3,), allow_thin=True), model=tiny_model)
    assert r.path == str(path) and open_golden(path).meta["thin"] == r.thin


# What a coverage reason adds where the reference feed's rule cannot make the missing count (`reference_accepts`).
NEVER_AT_3 = ("; the reference feed corrupts draft 1 + s % (K-1) on odd steps, which at K=3 never leaves 0 accepted "
              "(only a model rejecting its own greedy draft does): more steps cannot reach it, the drafter feed or "
              "other widths can")


def test_require_coverage_refuses_to_store_even_a_thin_allowed_reference(tmp_path, tiny_model):
    for allow_thin in (False, True):
        r = record(tmp_path / "g.zarr", RecordSettings(model="tiny-llama", steps=8, require_coverage=True,
                                                       allow_thin=allow_thin), model=tiny_model)
        assert r.location is None and r.short == ["coverage K=3: no step accepted 0 draft(s) (steps per accept "
                                                  f"count 0..2: [0, 4, 4]){NEVER_AT_3}"]
        assert not (tmp_path / "g.zarr").exists()


def test_the_policy_is_stored_and_shown(cli, tmp_path):
    path = tmp_path / "p.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama", "--steps", "8", "--tolerance", "verify=ulp:4",
                         "--tolerance", "prefill=atol:0.01,rtol:0.01")
    assert code == 0, err
    assert open_golden(path).meta["policy"] == {"prefill": "atol:0.01,rtol:0.01", "verify": "ulp:4", "draft": "exact"}
    code, out, err = cli("show", path)
    assert "policy    prefill atol:0.01,rtol:0.01, verify ulp:4, draft exact" in out


@pytest.mark.parametrize("settings, needle", [
    (RecordSettings(ks=()), "at least one verify width"), (RecordSettings(ks=(1,)), "K must be 2"),
    (RecordSettings(ks=(2, 2)), "repeated"), (RecordSettings(steps=0), "--steps"),
    (RecordSettings(feed="oracle"), "unknown feed"), (RecordSettings(threads=0), "--threads"),
    (RecordSettings(tolerances=("bogus",)), "unknown tolerance"),
])
def test_settings_that_cannot_work_are_refused_before_any_work(tmp_path, settings, needle):
    with pytest.raises(UsageError, match=needle):
        record(tmp_path / "g.zarr", settings)  # no model is loaded: it would take seconds
    assert not (tmp_path / "g.zarr").exists()


def test_the_same_recording_in_a_directory_a_zip_file_and_on_s3(tmp_path, tiny_model, s3):
    settings = RecordSettings(model="tiny-llama", steps=4, ks=(2, 4))
    where = [tmp_path / "g.zarr", tmp_path / "g.zip", s3]
    for w in where:
        assert record(w, settings, model=tiny_model).location is not None
    a, b, c = (open_golden(w) for w in where)
    for k in (2, 4):
        rows = a.verify_rows(k)
        for other in (b, c):
            assert other.checked_log(k).same_steps(a.checked_log(k))
            assert all(np.array_equal(other.verify_rows(k)[kind], rows[kind]) for kind in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr", "g.zip"]



def test_recording_the_same_numbers_again_changes_only_the_run_group(tmp_path, tiny_model):
    """What a review diffs stays byte for byte as it was when the logits did not move: the time, host, step
    timings and model path live in run/zarr.json alone (the root's history says who recorded it and when),
    and a replay still reads them back."""
    settings = RecordSettings(model="tiny-llama", steps=4, ks=(2, 3))
    a = files(record(tmp_path / "a.zarr", settings, model=tiny_model).location.path)
    b = files(record(tmp_path / "b.zarr", settings, model=tiny_model).location.path)
    assert a.keys() == b.keys() and "run/zarr.json" in a
    assert {name for name in a if a[name] != b[name]} <= {"run/zarr.json", "zarr.json"}
    root_a, root_b = (json.loads(x["zarr.json"])["attributes"]["vd"] for x in (a, b))
    assert len(root_a.pop("history")) == len(root_b.pop("history")) == 1  # each recording's own: when, who, where
    root_a.pop("golden_id"), root_b.pop("golden_id")  # the hash of the metadata, history included
    assert root_a == root_b and not {"step_ms", "created"} & set(json.dumps(root_a).replace('"', " ").split())
    g = open_golden(tmp_path / "b.zarr")
    assert g.meta["created"] and g.meta["environment"]["host"] and len(g.log(2).step_ms) == 4
