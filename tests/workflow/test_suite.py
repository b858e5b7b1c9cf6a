"""A suite recorded and replayed together, each model loaded once; status finds missing, stale and
orphaned goldens."""

import dataclasses
import re
import shutil
import weakref

import pytest
from golden_edit import chunk, flip_byte

from vd.errors import UsageError
from vd.replayer import ReplaySettings
from vd.store import open_golden
from vd.workflow.declare import load_suite, shard
from vd.workflow.status import orphans, prune, status, status_key
from vd.workflow.suite import (
    Models,
    exit_code,
    plan_of,
    record_key,
    record_settings,
    record_suite,
    replay_plan,
    replay_suite,
)

SUITE = """
[defaults]
model = "tiny-llama"
steps = 4
[goldens.a]
path = "goldens/a.zarr"
k = [2, 3]
[goldens.b]
path = "goldens/b.zarr"
k = [2]
prompt = "Another prompt entirely."
[goldens.c]
path = "goldens/c.zip"
k = [3]
"""


def _suite(tmp_path, text=SUITE):
    (tmp_path / "vd.toml").write_text(text)
    return load_suite(tmp_path / "vd.toml")


def _holding(tiny) -> Models:
    """Models holding the session's tiny-llama already (nothing loaded again)."""
    models = Models()
    models.held[("tiny-llama", "cpu", "bfloat16", None)] = tiny
    return models


def _declared_b(tmp_path, tiny, lines: str):
    """Golden b declared with ``lines`` added and recorded so: its path (status calls it current)."""
    suite = _suite(tmp_path, SUITE.replace('k = [2]\n', f'k = [2]\n{lines}\n'))
    record_suite(suite.select(["b"]), models=_holding(tiny))
    assert status(suite, suite.select(["b"]), check_models=False)[0].state == "current"
    return suite.entries["b"].path


def test_a_suite_is_recorded_and_replayed_with_its_model_loaded_once(tmp_path, perturbed):
    suite = _suite(tmp_path)
    models = Models()
    out = record_suite(suite.select(), models=models)
    assert [o.verdict for o in out] == ["RECORDED"] * 3 and models.loads == 1
    assert open_golden(suite.entries["b"].path).meta["prompt_text"] == "Another prompt entirely."
    assert [o.verdict for o in record_suite(suite.select(), models=models)] == ["PRESENT"] * 3
    out = replay_suite(suite.select(), models=models)
    assert [o.verdict for o in out] == ["PASS"] * 3 and models.loads == 1 and exit_code(out) == 0
    bad = replay_suite(suite.select(["a", "b"]), model=perturbed)
    assert [o.verdict for o in bad] == ["FAIL", "FAIL"] and exit_code(bad) == 1
    loose = replay_suite(suite.select(["a"]), ReplaySettings(tolerances=("argmax",)), model=perturbed)
    assert loose[0].verdict == "PASS"
    shutil.rmtree(suite.entries["a"].path)
    gone = replay_suite(suite.select(), models=models)
    assert [o.verdict for o in gone] == ["ERROR", "PASS", "PASS"] and "does not exist" in gone[0].error
    assert exit_code(gone) == 2


TWO_MODELS = """
[defaults]
steps = 4
k = [2]
[goldens.a]
path = "goldens/a.zarr"
model = "tiny-llama"
[goldens.b]
path = "goldens/b.zarr"
model = "tiny-qwen2"
[goldens.c]
path = "goldens/c.zarr"
model = "tiny-llama"
prompt = "Another prompt entirely."
"""


class Watching(Models):
    """`Models` that notes which models it holds at each golden, and keeps a weak reference to each it loads."""

    def __init__(self, plan=()):
        super().__init__(plan)
        self.held_at, self.loaded = [], []

    def get(self, *args, **kwargs):
        m = super().get(*args, **kwargs)
        if not any(r() is m for r in self.loaded):
            self.loaded.append(weakref.ref(m))
        self.held_at.append(sorted(key[0] for key in self.held))
        return m


def test_a_suite_lets_each_model_go_after_its_last_golden(tmp_path):
    suite = _suite(tmp_path, TWO_MODELS)
    entries = suite.select()
    recording = Watching([record_key(e) for e in entries])
    assert [o.verdict for o in record_suite(entries, models=recording)] == ["RECORDED"] * 3
    replaying = Watching(replay_plan(entries, ReplaySettings()))  # each golden's model read from it
    assert [o.verdict for o in replay_suite(entries, models=replaying)] == ["PASS"] * 3
    checking = Watching(plan_of(entries, status_key))  # vd status loads each model to check its fingerprint
    assert [s.state for s in status(suite, entries, models=checking)] == ["current"] * 3
    for models in (recording, replaying, checking):
        # tiny-llama is held until its last golden (c), tiny-qwen2 goes after its only one (b), and each is
        # freed, not only dropped (a GPU gets its memory back for the next model)
        assert models.held_at == [["tiny-llama"], ["tiny-llama", "tiny-qwen2"], ["tiny-llama"]]
        assert models.loads == 2 and not models.held and [r() for r in models.loaded] == [None, None]
    kept = Models()  # no plan (the pytest plugin's): every model stays for the session
    assert [o.verdict for o in replay_suite(entries, models=kept)] == ["PASS"] * 3 and len(kept.held) == 2


def test_shards_split_the_suite_by_name(tmp_path):
    entries = _suite(tmp_path).select()
    parts = [[e.name for e in shard(entries, f"{i}/2")] for i in (1, 2)]
    assert parts == [["a", "c"], ["b"]]
    for spec, says in (("1/0", "N, the number of shards, must be at least 1"), ("3/2", "I must be 1..2"),
                       ("0/2", "I must be 1..2"), ("a/2", "takes I/N like 2/4")):
        with pytest.raises(UsageError, match=re.escape(says)):
            shard(entries, spec)


def test_status_finds_missing_stale_and_orphaned_goldens(tmp_path, tiny):
    suite = _suite(tmp_path)
    models = _holding(tiny)
    record_suite(suite.select(["a", "b"]), models=models)
    shutil.copytree(suite.entries["a"].path, tmp_path / "goldens" / "old.zarr")  # no declaration names it
    states = {s.name: s for s in status(suite, suite.select(), models=models)}
    assert states["a"].state == "current" and states["a"].recorded["version"] == 1
    assert states["c"].state == "missing"
    changed = _suite(tmp_path, SUITE.replace('prompt = "Another prompt entirely."', 'prompt = "A third prompt."'))
    b = {s.name: s for s in status(changed, changed.select(), check_models=False)}["b"]
    assert b.state == "stale" and b.reasons == ["prompt: recorded 'Another prompt entirely.', declared "
                                                "'A third prompt.'"]
    found = orphans(suite)
    assert found == [str(tmp_path / "goldens" / "old.zarr")]
    prune(found)
    assert orphans(suite) == [] and (tmp_path / "goldens" / "a.zarr").is_dir()
    shutil.copytree(suite.entries["a"].path, tmp_path / "goldens" / "damaged.zarr")
    flip_byte(chunk(tmp_path / "goldens" / "damaged.zarr", 2))  # no replay would take it: status says so
    damaged = _suite(tmp_path, SUITE.replace('"goldens/a.zarr"', '"goldens/damaged.zarr"'))
    d = status(damaged, damaged.select(["a"]), check_models=False)[0]
    assert d.state == "unreadable" and "does not match the golden's manifest" in d.reasons[0], d


def test_a_model_whose_fingerprint_moved_makes_its_goldens_stale(tmp_path, tiny):
    suite = _suite(tmp_path)
    models = _holding(tiny)
    record_suite(suite.select(["a"]), models=models)
    other = Models()
    other.held[("tiny-llama", "cpu", "bfloat16", None)] = _Reweighted(tiny)
    a = status(suite, suite.select(["a"]), models=other)[0]
    assert a.state == "stale" and a.reasons[0].startswith("model tiny-llama now has fingerprint sha256:0000")


class _Reweighted:
    """tiny-llama as if its weights had changed: another fingerprint."""

    def __init__(self, inner):
        self.inner = inner

    def identity(self):
        ident = self.inner.identity()
        return type(ident)(ident.name, "sha256:" + "0" * 64, ident.details)

    def default_forward(self):
        return self.inner.default_forward()


def test_a_declared_policy_stays_current_and_a_refresh_keeps_it(tmp_path, tiny):
    """A declared equivalence term (and a SPEC without a kind) is what the golden records: status calls it
    current, and a refresh from the golden's own settings keeps every term (it dropped equivalence=)."""
    from vd.recorder import RecordSettings
    from vd.workflow.refresh import refresh

    text = SUITE.replace('k = [2]\n', 'k = [2]\npolicy = ["kl:0.5", "equivalence=kl:1", "decisions=margin:0.5"]\n')
    suite = _suite(tmp_path, text)
    models = _holding(tiny)
    record_suite(suite.select(["b"]), models=models)
    want = {"prefill": "kl:0.5", "verify": "kl:0.5", "draft": "kl:0.5", "decisions": "margin:0.5",
            "equivalence": "kl:1"}
    path = suite.entries["b"].path
    assert open_golden(path).meta["policy"] == want
    assert status(suite, suite.select(["b"]), check_models=False)[0].state == "current"
    settings = RecordSettings.of_golden(open_golden(path).meta)
    assert refresh(path, settings, reason="new runner", model=tiny).published
    assert open_golden(path).meta["policy"] == want
    assert status(suite, suite.select(["b"]), check_models=False)[0].state == "current"
    changed = _suite(tmp_path, text.replace('"equivalence=kl:1", ', ""))
    stale = status(changed, changed.select(["b"]), check_models=False)[0]
    assert stale.state == "stale" and stale.reasons[0].startswith("tolerances: recorded"), stale


def test_a_batch_is_declared_and_a_golden_recorded_otherwise_is_stale(tmp_path, tiny):
    """A declaration could not say `batch`: a golden recorded in a batch was 'current' against a declaration of one
    recorded alone, and a refresh from the declaration dropped the batch without a word. `batch`, `slot` and
    `batch_seed` are declared now, compared by status, and a refresh that drops a batch says so."""
    from vd.recorder import RecordSettings
    from vd.workflow.refresh import refresh

    path = _declared_b(tmp_path, tiny, "batch = 2\nslot = 1")
    assert open_golden(path).meta["batch"]["n"] == 2 and open_golden(path).meta["batch"]["slot"] == 1
    alone = _suite(tmp_path, SUITE)
    stale = status(alone, alone.select(["b"]), check_models=False)[0]
    assert stale.state == "stale" and stale.reasons[0].startswith("batch: recorded 2, declared None"), stale
    r = refresh(path, record_settings(alone.entries["b"]), reason="alone again", model=tiny)
    assert r.published and "batch" not in open_golden(path).meta
    assert any(c.startswith("asked: batch: 2 -> None") for c in r.changes), r.changes
    assert RecordSettings.of_golden(open_golden(path).meta).batch is None


def test_a_decode_forward_is_declared_and_a_golden_recorded_otherwise_is_stale(tmp_path, tiny):
    """`decode_forward` declares the forward of the golden's decode rows (vd record --decode-forward): recorded
    so, compared by status (a golden recorded without it is stale, and naming the golden's forward is none)."""
    path = _declared_b(tmp_path, tiny, 'decode_forward = "sdpa"')
    assert open_golden(path).meta["decode"]["forward"] == "sdpa"
    alone = _suite(tmp_path, SUITE)
    stale = status(alone, alone.select(["b"]), check_models=False)[0]
    assert stale.state == "stale" and stale.reasons == ["decode_forward: recorded 'sdpa', declared None"], stale
    assert stale.recorded["decode_forward"] == "sdpa" and stale.to_json()["recorded"]["decode_forward"] == "sdpa"
    own = _suite(tmp_path, SUITE.replace('k = [2]\n', 'k = [2]\nforward = "eager"\ndecode_forward = "eager"\n'))
    record_suite(own.select(["b"]), models=_holding(tiny), refresh_existing=True, reason="one forward")
    assert "forward" not in open_golden(path).meta["decode"]
    current = status(own, own.select(["b"]), check_models=False)[0]
    assert current.state == "current" and current.recorded["decode_forward"] is None


def test_a_declared_trace_the_golden_lacks_is_stale(tmp_path, tiny):
    """`trace = true` declared over a golden recorded without traces left it "current" and a suite record left it
    untraced (a user test): status calls it stale, both ways, so that a refresh records the traces."""
    path = _declared_b(tmp_path, tiny, "")
    traced = _suite(tmp_path, SUITE.replace('k = [2]\n', 'k = [2]\ntrace = true\n'))
    stale = status(traced, traced.select(["b"]), check_models=False)[0]
    assert stale.state == "stale" and stale.reasons == ["trace: recorded False, declared True"], stale
    record_suite(traced.select(["b"]), models=_holding(tiny), refresh_existing=True, reason="traced")
    assert open_golden(path).traced and status(traced, traced.select(["b"]), check_models=False)[0].state == "current"
    alone = _suite(tmp_path, SUITE)
    assert status(alone, alone.select(["b"]), check_models=False)[0].reasons == ["trace: recorded True, declared False"]


def test_a_golden_recorded_with_a_forward_its_declaration_leaves_out_is_stale(tmp_path, tiny):
    """A declaration naming no forward means the model's default; `vd record b --refresh --forward sdpa` left the
    golden 'current' until a suite refresh silently recorded the default again. With the model loaded, status
    calls it stale."""
    from vd.recorder import record

    suite = _suite(tmp_path)
    models = _holding(tiny)
    record_suite(suite.select(["b"]), models=models)
    assert status(suite, suite.select(["b"]), models=models)[0].state == "current"
    sdpa = dataclasses.replace(record_settings(suite.entries["b"]), forward="sdpa")
    assert record(suite.entries["b"].path, sdpa, refresh=True, model=tiny).location is not None
    b = status(suite, suite.select(["b"]), models=models)[0]
    assert b.state == "stale" and b.reasons == ["forward: recorded 'sdpa', declared none (the model's default, "
                                                "'eager')"], b
    assert status(suite, suite.select(["b"]), check_models=False)[0].state == "current"  # known only with the model
