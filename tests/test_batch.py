"""The batch axis's engine side (`vd.batch`): the conformance of the test plug-ins, companions, slots, and a
golden's rows run in a batch equal to its rows alone for a batch-invariant engine and not for a variant one."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from vd.batch import BatchPlan, BatchView, batched, companion_prompts
from vd.errors import UsageError
from vd.loop import ReferenceFeed, continuation, run_verify
from vd.models import load_model
from vd.preflight import check_batch
from vd.recorder import RecordSettings
from vd.testing import ModelConformance

CPU = torch.device("cpu")
SPEC = "tests/plugins/batched.py:{}"


def _load(name: str):
    return load_model(SPEC.format(name), device=CPU, dtype=torch.bfloat16)


class TestInvariantPlugin(ModelConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return _load("invariant")


class TestVariantPlugin(ModelConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return _load("variant")


@pytest.fixture(scope="module")
def invariant():
    return _load("invariant")


@pytest.fixture(scope="module")
def variant():
    return _load("variant")


def _rows(model, k=3, steps=5):
    prompt = model.encode("The batch axis: a golden's sequence among others.")
    greedy = continuation(model, prompt, steps * k + k)
    plain = run_verify(model, prompt, k, steps, ReferenceFeed(greedy))
    return prompt, greedy, plain


def _in_batch(model, plan, prompt, greedy, k=3, steps=5):
    view = BatchView(model, plan, prompt, steps * k + k)
    run = run_verify(view, prompt, k, steps, ReferenceFeed(greedy))
    return view, run


def test_companions_are_deterministic_and_of_other_lengths():
    prompt = list(range(100, 130))
    a, b = companion_prompts(prompt, 4, seed=7), companion_prompts(prompt, 4, seed=7)
    assert a == b and len(a) == 3
    assert all(len(p) != len(prompt) and set(p) <= set(prompt) for p in a)
    assert companion_prompts(prompt, 4, seed=8) != a
    assert companion_prompts(prompt, 1, seed=0) == []


def test_plan_rotates_slots_unless_one_is_asked():
    assert [BatchPlan(3).slot_at(c) for c in range(5)] == [0, 1, 2, 0, 1]
    assert [BatchPlan(3, slot=2).slot_at(c) for c in range(3)] == [2, 2, 2]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_an_invariant_engine_gives_the_golden_rows_in_any_batch(invariant, n):
    prompt, greedy, plain = _rows(invariant)
    view, run = _in_batch(invariant, BatchPlan(n, seed=1), prompt, greedy)
    assert torch.equal(run.prefill, plain.prefill)
    assert all(torch.equal(a, b) for a, b in zip(run.rows, plain.rows))
    assert [s.accepted for s in run.steps] == [s.accepted for s in plain.steps]
    assert view.slots == [c % n for c in range(6)]
    # The companions ran feeds of their own: other lengths, and their sequences moved on.
    assert all(c.s == 5 and c.p > 0 for c in view.companions)


def test_a_variant_engine_differs_where_its_sequence_shares_a_batch(variant):
    prompt, greedy, plain = _rows(variant)
    _, alone = _in_batch(variant, BatchPlan(1), prompt, greedy)
    assert torch.equal(alone.prefill, plain.prefill)
    _, shared = _in_batch(variant, BatchPlan(2), prompt, greedy)
    assert not torch.equal(shared.prefill, plain.prefill)
    assert (shared.prefill.float() - plain.prefill.float()).abs().max() < 0.05 * plain.prefill.float().abs().max()


@pytest.mark.parametrize("args, message", [
    ((None, 1), "--slot places the golden's sequence in a batch: pass --batch N too"),
    ((None, None, 3), "--batch-seed places"),
    ((0, None), "--batch 0: a batch holds 1 to 64 sequences"),
    ((2, 2), "--slot 2: a batch of 2 has slots 0 to 1"),
    ((2, None, -1), "--batch-seed -1: a seed is a non-negative integer"),
    ((2, None, None, True), "this golden's drafts come from an MTP head"),
])
def test_plans_that_cannot_run_are_refused(args, message):
    with pytest.raises(UsageError, match=message):
        check_batch(*args)


def test_a_model_without_a_batch_is_refused_by_name():
    bare = load_model("tests/plugins/perturb.py:factory", device=CPU, dtype=torch.bfloat16)
    with pytest.raises(UsageError, match=r"perturb.py:factory\) cannot run a batch"):
        batched(bare, "eager")
    with pytest.raises(UsageError, match="forward 'sdpa' of this model cannot run a batch"):
        batched(_load("invariant"), "sdpa")


# -- vd replay --batch -------------------------------------------------------------------------------------------

PLUGIN = str(Path(__file__).parent / "plugins" / "batched.py") + ":{}"
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def batch_golden(tmp_path_factory, cli):
    """A golden of the batch-invariant plug-in (tiny-llama's rows: the same model), 6 steps at K=2 and 3."""
    path = tmp_path_factory.mktemp("batch") / "g.zarr"
    code, _, err = cli("record", path, "--model", PLUGIN.format("invariant"), "--steps", "6", "--k", "2,3")
    assert code == 0, err
    return path


def _replay(cli, path, tmp_path, name, *args):
    code, out, err = cli("replay", path, "--model", PLUGIN.format(name), "--report", tmp_path / "r.json", *args)
    return code, out + err, json.loads((tmp_path / "r.json").read_text()) if code in (0, 1) else None


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_batch_invariant_engine_passes_every_batch(batch_golden, cli, tmp_path, n):
    code, out, r = _replay(cli, batch_golden, tmp_path, "invariant", "--batch", str(n))
    assert code == 0 and "PASS" in out, out
    others = r["batch"].pop("companion_prompt_tokens")
    assert r["batch"] == {"n": n, "slot": None, "seed": 0} and len(others) == n - 1
    for v in [r["decode"], *r["verify"]]:
        (b,) = v["batch"]
        assert b["comparison"]["passed"] and b["first_difference"] is None and b["n"] == n
        assert b["slots"] == [c % n for c in range(len(b["slots"]))]
        assert [a for a in v["axes"] if a["axis"] == f"batch (N={n}, every slot in turn)"][0]["verdict"] == "pass"
    assert f"in a batch of {n} (every slot in turn, seed 0)" in out


def test_a_batch_variant_engine_fails_where_its_slot_shares_a_batch(batch_golden, cli, tmp_path):
    code, out, r = _replay(cli, batch_golden, tmp_path, "variant", "--batch", "2", "--slot", "1")
    assert code == 1 and "FAIL" in out, out
    for v in r["verify"]:
        (b,) = v["batch"]
        assert not b["comparison"]["passed"] and b["first_difference"] == {"step": None, "slot": 1}
        assert all(c["passed"] for c in v["comparisons"])  # alone, its rows are the golden's
    assert "verify K=2 in a batch of 2 (slot 1 at the first difference), eager: prefill differs" in out
    assert "at the slot this replay held (1)" in out and "--slot 1" not in out.split("next step")[-1], out
    code, out, _ = _replay(cli, batch_golden, tmp_path, "variant", "--batch", "2")
    assert code == 1 and "--batch 2 --batch-seed 0 --slot " in out, out  # the next step holds a slot
    code, out, _ = _replay(cli, batch_golden, tmp_path, "variant", "--batch", "1")
    assert code == 0 and "PASS" in out, out


def test_a_golden_without_decode_rows_replays_in_a_batch(cli, tmp_path):
    """(Recorded on another CPU: judged by argmax, as a golden from another machine is.)"""
    code, out, r = _replay(cli, DATA / "tiny-llama-v6.zarr", tmp_path, "invariant", "--batch", "3", "--k", "2",
                           "--tolerance", "argmax")
    assert code == 0 and r["decode"] is None and r["verify"][0]["batch"][0]["comparison"]["passed"], out


@pytest.mark.parametrize("args, message", [
    (["--slot", "1"], "--slot places the golden's sequence in a batch: pass --batch N too"),
    (["--batch", "2", "--slot", "2"], "--slot 2: a batch of 2 has slots 0 to 1"),
    (["--batch", "65"], "--batch 65: a batch holds 1 to 64 sequences"),
    (["--batch", "2", "--model", "tests/plugins/perturb.py:factory"], "cannot run a batch"),
])
def test_a_batch_that_cannot_run_is_refused(batch_golden, cli, args, message):
    code, out, err = cli("replay", batch_golden, *args)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_a_drafter_golden_is_not_replayed_in_a_batch(cli):
    code, _, err = cli("replay", DATA / "tiny-llama-mtp-v5.zarr", "--batch", "2")
    assert code == 2 and "drafts come from an MTP head" in err, err


# -- vd record --batch -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def recorded_in_a_batch(tmp_path_factory, cli):
    """A golden of the batch-variant plug-in recorded as member 1 of a batch of 2: its rows are batch rows."""
    path = tmp_path_factory.mktemp("recorded-batch") / "g.zarr"
    code, _, err = cli("record", path, "--model", PLUGIN.format("variant"), "--steps", "4", "--k", "2",
                       "--batch", "2", "--slot", "1")
    assert code == 0, err
    return path


def test_a_golden_recorded_in_a_batch_is_replayed_in_it(recorded_in_a_batch, cli, tmp_path):
    from vd.recorder import RecordSettings
    from vd.store import open_golden

    g = open_golden(recorded_in_a_batch)
    batch = dict(g.meta["batch"])
    assert batch.pop("companion_prompt_tokens") and batch == {"n": 2, "slot": 1, "seed": 0}
    settings = RecordSettings.of_golden(g.meta)  # a refresh records it in the same batch
    assert (settings.batch, settings.slot, settings.batch_seed) == (2, 1, 0)
    code, shown, _ = cli("show", recorded_in_a_batch)
    assert "batch     recorded as one member of a batch of 2 (slot 1, companions from seed 0)" in shown
    code, out, r = _replay(cli, recorded_in_a_batch, tmp_path, "variant")
    assert code == 0 and "recorded as one member of a batch of 2" in out, out
    assert r["golden_batch"] == g.meta["batch"] and r["batch"] is None  # what ran, for a program reading it
    code, out, r = _replay(cli, recorded_in_a_batch, tmp_path, "variant", "--batch", "1")
    assert code == 1 and not r["verify"][0]["batch"][0]["comparison"]["passed"], out  # alone it differs
    # (the next step repeated this very command: --batch 1 --batch-seed 0)
    assert "A batch of one already differs from the golden's rows" in out and "--batch 1 --batch-seed" not in out


def test_a_refresh_names_the_kept_settings_a_flag_is_at_odds_with(recorded_in_a_batch, cli, tmp_path):
    """A refresh keeps the golden's settings the flags do not change; a flag at odds with one was refused naming
    flags the user never typed (--slot 1, --trace), with no way to drop --trace (found by a user test)."""
    copy = tmp_path / "g.zarr"
    shutil.copytree(recorded_in_a_batch, copy)
    code, _, err = cli("record", copy, "--refresh", "--batch", "1", "--reason", "alone")
    assert code == 2 and err.count("\n") == 1 and "(a refresh keeps the golden's own settings the flags given do " \
        "not change: slot 1; --slot I changes it)" in err, err
    traced = tmp_path / "t.zarr"
    assert cli("record", traced, "--model", "tiny-llama", "--trace", "--k", "2", "--steps", "4", "--allow-thin")[0] == 0
    code, _, err = cli("record", traced, "--refresh", "--batch", "2", "--reason", "in a batch")
    assert code == 2 and "trace True; --no-trace changes it)" in err, err
    code, out, err = cli("record", traced, "--refresh", "--batch", "2", "--no-trace", "--reason", "in a batch")
    assert code == 0 and "module traces dropped" in out, out + err


def test_no_batch_refreshes_a_golden_recorded_in_a_batch_alone(recorded_in_a_batch, cli, tmp_path):
    """A refresh keeps the golden's batch, and --batch 1 records a batch of one (with a batch key), not the
    sequence alone: --no-batch does, its summary saying so; with --batch, --slot or --batch-seed it is refused."""
    from vd.store import open_golden

    copy = tmp_path / "g.zarr"
    shutil.copytree(recorded_in_a_batch, copy)
    code, _, err = cli("record", copy, "--refresh", "--no-batch", "--slot", "0", "--reason", "alone")
    assert code == 2 and err == "vd: error: --no-batch records the sequence alone: it does not go with --slot\n", err
    code, out, err = cli("record", copy, "--refresh", "--no-batch", "--reason", "alone")
    assert code == 0 and "batch: 2 -> None" in out, out + err
    assert "batch" not in open_golden(copy).meta
    code, out, _ = cli("show", copy)
    assert code == 0 and "one member of a batch" not in out


def test_a_damaged_batch_field_is_refused(recorded_in_a_batch, cli, tmp_path):
    from golden_edit import edit_meta

    copy = tmp_path / "g.zarr"
    shutil.copytree(recorded_in_a_batch, copy)
    edit_meta(copy, lambda m: m["batch"].update(slot=5))
    code, _, err = cli("verify", copy)
    assert code == 2 and "metadata field 'batch'" in err and "Traceback" not in err, err


def test_a_drafter_recording_is_not_made_in_a_batch(cli, tmp_path):
    code, _, err = cli("record", tmp_path / "g.zarr", "--feed", "mtp", "--model", "tiny-llama-mtp", "--batch", "2")
    assert code == 2 and "the drafter feed's drafts come from an MTP head" in err, err
    assert "record it without --batch" in err and "replay" not in err and "this golden" not in err, err
    with pytest.raises(UsageError, match="record it without --batch"):
        RecordSettings(model="tiny-llama-mtp", feed="mtp", batch=2).check()


def test_own_rows_are_told_from_another_members_and_from_garbage():
    """The conformance's rule for a member's rows (`vd.testing.not_own_rows`): rounding passes, an engine whose
    kernels move rows by more passes while they stay nearer their own sequence's; another member's rows fail."""
    from vd.testing import not_own_rows

    g = torch.Generator().manual_seed(0)
    own, other = (torch.randn(3, 64, generator=g) * 10 for _ in range(2))
    noise = torch.randn(3, 64, generator=g)
    assert not_own_rows(own + 0.01 * noise, own, other) is None
    assert not_own_rows(own + 0.8 * noise, own, other) is None  # beyond 5 %, within 25 % and nearer its own
    assert "from another member's" in not_own_rows(other, own, other)
    assert not_own_rows(own + 10 * noise, own, other) is not None  # garbage


def test_a_batch_a_plugin_gets_wrong_is_named_as_the_plugins(batch_golden, cli):
    """A plug-in's forward_batch returning float32 rows was blamed on vd.batch.BatchView; a trace handing each
    member's points as the member ran ([L, ...], not [n, L, ...]) had its points dropped, and `vd locate` then
    said the rows differ "but no traced module's output does" with nothing compared (a user test). Both are
    the plug-in's, named, exit 2."""
    code, out, err = cli("replay", batch_golden, "--model", PLUGIN.format("float32_batch"), "--batch", "2",
                         "--k", "2")
    last = err.splitlines()[-1]
    assert code == 2 and "Traceback" not in err and \
        last.startswith(f"vd: error: {PLUGIN.format('float32_batch')} (its forward_batch): forward of "), out + err
    code, out, err = cli("locate", batch_golden, "--model", PLUGIN.format("per_member_trace"), "--between",
                         "batch:2", "--k", "2")
    last = err.splitlines()[-1]
    assert code == 2 and "Traceback" not in err and last.startswith(f"vd: error: {PLUGIN.format('per_member_trace')}: "
                                                                    "in a batch of 2 its trace handed") \
        and "none of them [2, L, ...]" in last, out + err
