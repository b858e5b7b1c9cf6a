"""The replayer's verdicts: what differs is found where it is, rows are read only where digests differ, the
control must fire, a thin or short reference fails, a damaged golden is refused, and a slim golden is
judged as its full golden is."""

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from golden_edit import edit_meta, edit_rows

from vd.dtypes import to_float
from vd.errors import GoldenCorruptError, UsageError
from vd.models import load_model
from vd.replayer import ReplaySettings, replay
from vd.store import open_golden, slim
from vd.store.read import Golden

PLUGINS = Path(__file__).parent / "plugins"
FIXTURE_PROMPT = "The three laws of thermodynamics state that"  # what tiny-llama-mtp's head was trained on


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny-llama")


@pytest.fixture
def reads(monkeypatch) -> list:
    """Every read of a golden's rows: (K, kind, rows)."""
    seen = []
    real = Golden.read_rows
    monkeypatch.setattr(Golden, "read_rows", lambda self, k, kind, idx: seen.append((k, kind, list(idx)))
                        or real(self, k, kind, idx))
    return seen


def test_replay_reads_rows_only_where_digests_differ(tiny_copy, tiny_model, reads):
    """A passing replay reads no row; a row another recording computed (digests rewritten with it) is read
    and measured; the detection control reads the rows its changed draft moved, and no others."""
    assert replay(tiny_copy, model=tiny_model, settings=ReplaySettings(control=False)).verdict == "PASS"
    assert reads == []
    edit_rows(tiny_copy, 2, "verify", lambda r: r.__setitem__((2, 7), r[2, 7] ^ 1))  # step 1, row 0
    r = replay(tiny_copy, ReplaySettings(control=False), model=tiny_model)
    # Read with the golden, before the runs: for its own verify-vs-decode axis, that row and its decode row (decode
    # step 2), whose digests now differ; then the differing row to measure it, and step 1's rows for the
    # first-divergence bundle.
    assert r.verdict == "FAIL" and reads == [(2, "verify", [2]), (1, "verify", [2]), (2, "verify", [2]),
                                             (2, "verify", [2, 3])]
    c = r.verify[0].comparisons[0].comparison
    assert c.mismatched_step_list == (1,) and c.first_mismatch.index == 7
    reads.clear()
    r = replay(tiny_copy, ReplaySettings(ks=(3,)), model=tiny_model)
    control = r.verify[0].control
    assert control.fired and reads and {(k, kind) for k, kind, _ in reads} == {(3, "verify")}
    assert sorted({i // 3 for _, _, idx in reads for i in idx}) == list(control.comparison.mismatched_step_list)


def test_one_edited_element_is_the_first_mismatch(cli, tiny_copy, tmp_path):
    original = open_golden(tiny_copy).read_rows(3, "verify", np.array([5 * 3 + 2]))[0, 100]
    edit_rows(tiny_copy, 3, "verify", lambda r: r.__setitem__((17, 100), r[17, 100] ^ 1))  # the next bf16 value
    code, out, err = cli("replay", tiny_copy, "--report", tmp_path / "r.json")
    assert code == 1 and "FAIL" in out
    r = json.loads((tmp_path / "r.json").read_text())
    by_k = {v["k"]: v["comparisons"][0] for v in r["verify"]}
    assert by_k[2]["mismatched_steps"] == 0 and by_k[4]["mismatched_steps"] == 0
    c = by_k[3]
    assert c["prefill_equal"] and c["mismatched_steps"] == 1 and c["mismatched_step_list"] == [5]
    golden, got = (float(to_float(np.array([b], dtype=np.uint16), "bfloat16")[0]) for b in (original ^ 1, original))
    assert c["first_mismatch"] == {"step": 5, "row": 2, "index": 100, "golden": golden, "got": got}
    assert c["max_abs_diff"] == abs(golden - got)
    assert any("K=3, eager" in x and "step 5 row 2 index 100" in x for x in r["reasons"])


def test_eager_and_sdpa_reported_as_they_really_compare(tiny_golden, tiny_model):
    r = replay(tiny_golden, ReplaySettings(forwards=("eager", "sdpa")), model=tiny_model)
    prompt = open_golden(tiny_golden).prompt
    rows = {}
    for name in ("eager", "sdpa"):  # the two prefills, computed outside vd's loop
        tiny_model.set_forward(name)
        tiny_model.reset()
        rows[name] = tiny_model.forward(prompt)
    really_equal = torch.equal(rows["eager"], rows["sdpa"])
    assert not really_equal  # tiny-llama, bf16, CPU: SDPA differs from eager
    for v in r.verify:
        eager, sdpa = (j.comparison for j in v.comparisons)
        assert (eager.variant, sdpa.variant) == ("eager", "sdpa")
        assert eager.passed and eager.prefill_equal and eager.mismatched_steps == 0
        assert sdpa.prefill_equal == really_equal and not sdpa.passed
    assert r.verdict == "FAIL" and [x.name for x in r.variants] == ["eager", "sdpa"]
    assert all(x.description for x in r.variants)


def test_pinned_sdpa_backends_compared_as_they_are(tiny_golden, tiny_model):
    """SDPA pinned to each backend the device runs is a forward of its own, reported as it really compares
    with the golden's eager rows."""
    pinned = [f for f in tiny_model.forwards() if f.startswith("sdpa-")]
    assert "sdpa-math" in pinned  # every device has the math backend
    r = replay(tiny_golden, ReplaySettings(forwards=("sdpa", *pinned), ks=(2,), control=False), model=tiny_model)
    prompt = open_golden(tiny_golden).prompt
    rows = {}
    for name in ["eager", "sdpa", *pinned]:
        tiny_model.set_forward(name)
        tiny_model.reset()
        rows[name] = tiny_model.forward(prompt)
    for j in r.verify[0].comparisons:
        c = j.comparison
        assert c.prefill_equal == torch.equal(rows[c.variant], rows["eager"]), c.variant
    assert {v.name for v in r.variants} == {"sdpa", *pinned}


def test_perturbed_plugin_fails_at_that_step(tiny_golden, monkeypatch):
    monkeypatch.setenv("VD_PERTURB_STEP", "3")
    r = replay(tiny_golden, ReplaySettings(model=f"{PLUGINS / 'perturb.py'}:factory"))
    assert r.verdict == "FAIL"
    for v in r.verify:
        c = v.comparisons[0].comparison
        assert c.prefill_equal and c.mismatched_step_list == (3,)
        assert (c.first_mismatch.step, c.first_mismatch.row, c.first_mismatch.index) == (3, 1, 7)
        assert [x.what for x in v.comparisons[0].reasons] == ["rows"]


def test_a_control_on_a_step_the_forward_already_fails_is_inconclusive(tiny_golden, monkeypatch):
    """The perturb plug-in differs at step 4, where the control changes a draft: the control cannot show the
    replay would see a change there (it is inconclusive, not fired), and the verdict fails on the rows alone."""
    monkeypatch.setenv("VD_PERTURB_STEP", str(8 // 2))
    r = replay(tiny_golden, ReplaySettings(model=f"{PLUGINS / 'perturb.py'}:factory"))
    assert r.verdict == "FAIL" and {x.what for x in r.reasons} == {"rows"}
    for v in r.verify:
        assert v.comparisons[0].comparison.failed_step_list == (4,)
        assert v.control.changed_step == 4 and v.control.inconclusive and not v.control.fired
        assert v.control.state == "inconclusive" and v.control.to_json()["inconclusive"] is True


def test_blind_control_fails(cli, golden_dir):
    path = golden_dir / "deaf.zarr"
    code, out, err = cli("record", path, "--model", f"{PLUGINS / 'deaf.py'}:factory", "--steps", "8",
                         "--allow-thin")
    assert code == 0, err
    r = replay(path)
    assert r.verdict == "FAIL"
    assert all(j.comparison.mismatched_steps == 0 for v in r.verify for j in v.comparisons)
    assert all(not v.control.fired and not v.control.inconclusive and v.control.state == "BLIND" for v in r.verify)
    assert {x.what for x in r.reasons} >= {"control"}
    assert all("detection control saw no difference" in x.text for x in r.reasons_of(("control",)))


def test_thin_reference_fails(cli, tmp_path):
    path = tmp_path / "thin.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama", "--steps", "1", "--k", "3", "--allow-thin")
    assert code == 0 and path.exists()
    r = replay(path)
    assert r.verdict == "FAIL" and r.verify[0].comparisons[0].comparison.mismatched_steps == 0
    assert [x.what for x in r.reasons] == ["thin"] and "needs both full and partial accepts" in r.reasons[0].text


def test_tolerance_passes_what_exact_fails_and_the_control_still_fires(tiny_golden):
    """The perturb plug-in moves one element by one ULP at step 3: exact fails, ulp:1 passes, and the control
    still fires under ulp:1 (a changed draft moves rows by far more than one ULP)."""
    spec = f"{PLUGINS / 'perturb.py'}:factory"
    assert replay(tiny_golden, ReplaySettings(model=spec)).verdict == "FAIL"
    r = replay(tiny_golden, ReplaySettings(model=spec, tolerances=("verify=ulp:1",))).to_json()
    assert r["verdict"] == "PASS", r["reasons"]
    assert r["policy"] == {"prefill": "exact", "verify": "ulp:1", "draft": "exact"}
    assert all(v["detection_control"]["fired"] for v in r["verify"])
    c = r["verify"][0]["comparisons"][0]
    assert c["mismatched_step_list"] == [3] and c["passed"] and c["summary"]["verify"]["max_ulp"] == 1
    (row,) = c["rows"]
    assert {k: row[k] for k in ("kind", "step", "row", "passed", "n_diff", "first_index", "max_ulp", "argmax_agree")} \
        == {"kind": "verify", "step": 3, "row": 1, "passed": True, "n_diff": 1, "first_index": 7, "max_ulp": 1.0,
            "argmax_agree": True}
    assert row["golden_stats"]["argmax"] == row["got_stats"]["argmax"] and row["golden_stats"]["absmax"] > 0
    assert 0 < row["max_abs"] < 0.1 and c["per_step"][3]["n_diff"] == 1 and c["per_step"][2]["n_diff"] == 0
    assert "1 ULP" in r["sensitivity"]["prefill"]["catches"] and "2 ULP" not in r["sensitivity"]["verify"]["catches"]


def test_coverage_table_and_require_coverage(tiny_golden, tiny_model):
    r = replay(tiny_golden, model=tiny_model)
    cov = {v.k: v.to_json()["coverage"] for v in r.verify}
    assert r.verdict == "PASS" and cov[3] == {"accepted_counts": [0, 4, 4], "missing": [0]}
    r = replay(tiny_golden, ReplaySettings(require_coverage=True, control=False), model=tiny_model)
    assert [x.text for x in r.reasons] == ["coverage K=3: no step accepted 0 draft(s) (steps per accept count "
                                           "0..2: [0, 4, 4]); the reference feed corrupts draft 1 + s % (K-1) on "
                                           "odd steps, which at K=3 never leaves 0 accepted (only a model rejecting "
                                           "its own greedy draft does): more steps cannot reach it, the drafter "
                                           "feed or other widths can"]
    assert r.reasons[0].what == "coverage" and r.reasons[0].k == 3


def test_drafter_golden_with_static_forward_determinism_and_phases(cli, tmp_path, monkeypatch, request):
    # What --deterministic applies is process-wide: undone after the test, so later tests' environments match.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded as it was (unset: removed again at the end)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    m = torch.backends.cuda.matmul
    flags = {f: getattr(m, f) for f in ("allow_bf16_reduced_precision_reduction",
                                        "allow_fp16_reduced_precision_reduction")}
    request.addfinalizer(lambda: [setattr(m, f, v) for f, v in flags.items()])
    path = tmp_path / "s.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama-mtp", "--feed", "mtp", "--forward", "static",
                         "--prompt", FIXTURE_PROMPT, "--deterministic", "--steps", "8", "--allow-thin")
    assert code == 0, err
    meta = open_golden(path).meta
    assert meta["graphs"] == "eager" and meta["determinism"]["applied"]["deterministic_algorithms"] is True
    assert meta["determinism"]["settings"]["deterministic_algorithms"] is True
    shown = cli("show", path)[1]
    assert " tokens, deterministic (--deterministic)\n" in shown, shown  # (it said nothing of it)
    torch.use_deterministic_algorithms(False)  # replay must apply it again by itself
    try:
        r = replay(path, ReplaySettings(ks=(3,))).to_json()
    finally:
        torch.use_deterministic_algorithms(False)
    assert [v["k"] for v in r["verify"]] == [3]
    c = r["verify"][0]["comparisons"][0]
    assert c["prefill_equal"] and c["mismatched_steps"] == 0 and c["draft_mismatched_steps"] == 0
    assert c["bootstrap_equal"]
    assert r["determinism"]["applied"]["deterministic_algorithms"] is True
    assert r["determinism"]["replayed"]["deterministic_algorithms"] is True
    assert r["graphs"] == "eager" and r["variants"][0]["graphs"] == "eager" and r["mtp"] is True
    assert set(r["phases"]) == {"open", "load", "setup", "prepare", "run", "wait_golden", "compare", "control", "batch",
                                "write", "finish"}
    assert r["phases"]["run"] > 0 and all(v >= 0 for v in r["phases"].values())
    t = r["timing"]  # the phases; the model was loaded here, and the process started before it
    assert set(t) == {"first_step", "open", "load", "setup", "prepare", "run", "control", "compare", "write", "started",
                      "model_code", "fingerprint", "warm"}
    assert t["load"] > 0 and t["run"] > 0 and t["control"] > 0 and t["first_step"] > t["load"] + t["setup"]
    # the parts within: transformers imported within the load, the fingerprint within the setup
    assert 0 <= t["model_code"] <= t["load"] and 0 < t["fingerprint"] <= t["setup"] and t["started"] >= 0
    assert t["warm"] is False  # run in this process, not forked from a warm server
    with pytest.raises(UsageError, match=r"no verify width \[5\]"):
        replay(path, ReplaySettings(ks=(5,)))


def test_a_golden_without_digests_replays_from_its_rows(rows_golden, tiny_model):
    r = replay(rows_golden, model=tiny_model)
    assert r.verdict == "PASS" and all(v.control.fired for v in r.verify)


def test_a_stored_digest_that_disagrees_with_its_row_is_a_damaged_golden(tiny_copy, tiny_model):
    """A replay reads a golden's row only where digests differ, and checks what it reads against the stored
    digest: an edited digest is a damaged golden (exit 2), not a difference of the model's."""
    import zarr

    arr = zarr.open_array(zarr.storage.LocalStore(tiny_copy / "k3" / "digests"), mode="r+")
    arr[5, 2] = int(arr[5, 2]) + 1  # the prefill's row 5
    with pytest.raises(GoldenCorruptError, match=r"k3/digests/c/0/0 does not match the golden's manifest"):
        replay(tiny_copy, ReplaySettings(ks=(3,)), model=tiny_model)
    edit_meta(tiny_copy, lambda m: None)  # as if written so: the rows read are checked against their digests
    with pytest.raises(GoldenCorruptError, match=r"k3/digests: 1 row\(s\) disagree with the stored rows "
                                                 r"\(first: prefill row 5\)"):
        replay(tiny_copy, ReplaySettings(ks=(3,)), model=tiny_model)
    shutil.rmtree(tiny_copy / "k2" / "digests")
    edit_meta(tiny_copy, lambda m: None)
    with pytest.raises(GoldenCorruptError, match="k2/digests is missing"):
        replay(tiny_copy, ReplaySettings(ks=(2,)), model=tiny_model)


@pytest.fixture(scope="module")
def tiny_slim(tiny_golden, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("slim") / "slim.zarr"
    slim(tiny_golden, out)
    return out


def _verdicts(r) -> list:
    return [(v.k, j.comparison.variant, j.comparison.passed, j.comparison.mismatched_step_list,
             [f.step for f in j.comparison.flips], v.control.fired if v.control else None)
            for v in r.verify for j in v.comparisons]


@pytest.mark.parametrize("policy", ["exact", "argmax"])
def test_a_slim_golden_passes_and_fails_as_its_full_golden_does(tiny_golden, tiny_slim, tiny_model, policy,
                                                               monkeypatch):
    settings = ReplaySettings(forwards=("eager", "sdpa"), tolerances=(policy,))
    full, thin = replay(tiny_golden, settings, model=tiny_model), replay(tiny_slim, settings, model=tiny_model)
    assert _verdicts(full) == _verdicts(thin) and full.verdict == thin.verdict == "FAIL"
    assert [x.what for x in full.reasons] == [x.what for x in thin.reasons]
    c = thin.verify[0].comparisons[1].comparison  # sdpa: its rows differ, and say how by their statistics
    assert not c.measured and c.rows and all(np.isnan(row.max_abs) for row in c.rows)
    assert all(row.golden_stats.top1 == row.golden_stats.top1 for row in c.rows)
    assert thin.to_json()["rows"] == {"slim": True, "source": None}
    monkeypatch.setenv("VD_PERTURB_STEP", "3")
    spec = f"{PLUGINS / 'perturb.py'}:factory"
    assert replay(tiny_slim, ReplaySettings(model=spec)).verdict == "FAIL"


def test_a_slim_golden_measures_its_rows_against_the_full_golden_named(tiny_golden, tiny_slim, tiny_model):
    settings = ReplaySettings(forwards=("sdpa",), tolerances=("kl:0.05",), control=False)
    with pytest.raises(UsageError, match="is slim: judging prefill, verify, draft rows under kl:0.05 needs its rows"):
        replay(tiny_slim, settings, model=tiny_model)
    full = replay(tiny_golden, settings, model=tiny_model)
    measured = replay(tiny_slim, ReplaySettings(forwards=("sdpa",), tolerances=("kl:0.05",), control=False,
                                                rows=str(tiny_golden)), model=tiny_model)
    assert measured.to_json()["rows"] == {"slim": True, "source": str(tiny_golden)}
    a, b = full.verify[0].comparisons[0].comparison, measured.verify[0].comparisons[0].comparison
    assert b.measured and a.to_json() == b.to_json() and measured.verdict == full.verdict


@pytest.mark.parametrize("compiled", [
    {"artifacts": "elsewhere.bin", "bytes": 3, "sha256": "0" * 64},
    {"artifacts": "inductor/artifacts.bin", "bytes": -1, "sha256": "0" * 64},
    {"artifacts": "inductor/artifacts.bin", "bytes": 3, "sha256": "not hex"},
    "yes",
])
def test_a_malformed_compiled_field_is_named(cli, tiny_copy, compiled):
    """The metadata of a compiled recording's Inductor artifacts is checked at open like every field."""
    edit_meta(tiny_copy, lambda m: m.update(compiled=compiled))
    code, out, err = cli("replay", tiny_copy)
    assert code == 2 and "metadata field 'compiled'" in err and len(err.strip().splitlines()) == 1, err


def test_a_replay_probes_no_pinned_backend_it_does_not_run(tiny_golden, monkeypatch):
    """Which pinned SDPA backends a model runs is probed by running it (a quarter of a second on the 8B
    shape): a replay of another forward asks about none, and one that names a backend probes that one."""
    from vd.models import load_model
    from vd.models.hf import HFModel

    probed = []
    real = HFModel._runs_pinned
    monkeypatch.setattr(HFModel, "_runs_pinned", lambda self, name: probed.append(name) or real(self, name))
    m = load_model("tiny-llama")
    assert replay(tiny_golden, ReplaySettings(control=False), model=m).verdict == "PASS" and probed == []
    r = replay(tiny_golden, ReplaySettings(forwards=("sdpa-math",), control=False), model=m)
    assert r.variants[0].name == "sdpa-math" and probed == ["sdpa-math"]
    assert "sdpa-math" in list(m.forwards()) and "sdpa-cudnn" not in m.forwards()  # listing probes the rest, once
    assert sorted(probed) == sorted(["sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"])


@pytest.mark.parametrize("settings, error", [
    (ReplaySettings(model="tiny-qwen2"), "vocab"),  # the model loads, then its check refuses it
    (ReplaySettings(model=f"{PLUGINS / 'positional.py'}:number"), "lacks"),  # the model's load refuses it
])
def test_a_replay_refused_before_its_runs_leaves_no_reader_behind(tiny_golden, monkeypatch, settings, error):
    """The golden's reader starts while the model loads (its files hashed, on CUDA its side copied to the device
    on a thread). A replay refused after that (another model, a plug-in that returns no model) stops the thread
    before it returns: in a long-lived process (a suite, the pytest plugin) a thread left reading would touch the
    GPU beside the next golden's graph capture, which CUDA then refuses."""
    from vd.store import prefetch

    real = prefetch.Prefetcher._run

    def slow(self, u, who):  # each unit long enough that the thread is still reading when the refusal comes
        time.sleep(0.05)
        real(self, u, who)

    monkeypatch.setattr(prefetch.Prefetcher, "_run", slow)
    with pytest.raises(Exception, match=error):
        replay(tiny_golden, settings)
    assert not [t for t in threading.enumerate() if t.name == "vd-golden"]
