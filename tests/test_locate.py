"""`vd record --trace`, `vd locate` (against a traced golden, and `--between` two forwards) and `vd replay
--locate`: the first module whose output differs, on a golden's steps. A plug-in moves one module's output by one
ULP (`tests/plugins/planted.py`); locate must name that module, where an independent computation with plain
forward hooks agrees that nothing before it differs."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from golden_edit import edit_meta

from vd.models import load_model
from vd.models.hf import HFModel
from vd.store import open_golden

PLANTED = str(Path(__file__).parent / "plugins" / "planted.py") + ":factory"


@pytest.fixture(scope="module")
def planted_golden(tmp_path_factory, cli):
    """SmolLM2 in float32 (a one-ULP move reaches the logits), 2 steps at K=2, recorded with --trace."""
    path = tmp_path_factory.mktemp("locate") / "g.zarr"
    code, _, err = cli("record", path, "--model", PLANTED, "--dtype", "float32", "--steps", "2", "--k", "2",
                       "--allow-thin", "--trace")
    assert code == 0, err
    return path


def _first_by_plain_hooks(module: str, prompt_text: str) -> str:
    """The first module (in the order HF runs them) whose output differs between eager and planted on a prefill,
    found with plain forward hooks on every module of the model, not through vd's tracing."""
    import os

    os.environ["VD_PLANT"] = module
    try:
        m = load_model(PLANTED, device=torch.device("cpu"), dtype=torch.float32)
    finally:
        del os.environ["VD_PLANT"]
    leaves = [(n, mod) for n, mod in m.inner.model.named_modules() if n and not list(mod.children())]
    runs = [_leaf_outputs(m, leaves, name, prompt_text) for name in ("eager", "planted")]
    return next(a[0] for a, b in zip(*runs) if not torch.equal(a[1], b[1]))


def _leaf_outputs(m, leaves, forward: str, prompt_text: str) -> list[tuple[str, torch.Tensor]]:
    """Every leaf module's output on a prefill under ``forward``, in the order they ran."""
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = [mod.register_forward_hook(lambda _m, _a, out, n=n: seen.append((n, out))) for n, mod in leaves]
    m.set_forward(forward)
    m.reset()
    with torch.inference_mode():
        m.forward(m.encode(prompt_text))
    for h in hooks:
        h.remove()
    return [(n, out if isinstance(out, torch.Tensor) else out[0]) for n, out in seen]


@pytest.mark.parametrize("module, what", [
    ("model.layers.7.mlp.down_proj", "MLP down projection"),
    ("model.layers.12.self_attn.o_proj", "attention output projection (o_proj)"),
    ("model.norm", "final norm"),
])
def test_a_planted_difference_is_located_at_its_module(planted_golden, cli, tmp_path, monkeypatch, module, what):
    monkeypatch.setenv("VD_PLANT", module)
    code, out, err = cli("locate", planted_golden, "--model", PLANTED, "--between", "planted",
                         "--report", tmp_path / "l.json")
    assert code == 1, out + err
    r = json.loads((tmp_path / "l.json").read_text())
    (k2,) = r["verify"]
    assert k2["differs"] and k2["step"] is None  # the planted move reaches the logits at the prefill
    assert k2["first_module"]["name"] == module and k2["first_module"]["what"] == what
    assert f"first difference at {module} ({what})" in out
    layer = k2["first_module"]["layer"]
    assert [p["layer"] for p in k2["path"]][:1] == [layer] and k2["first_module"]["max_abs"] > 0


@pytest.mark.parametrize("module, what", [
    ("model.layers.7.mlp.down_proj", "MLP down projection"),
    ("model.layers.12.self_attn.o_proj", "attention output projection (o_proj)"),
    ("model.norm", "final norm"),
])
def test_a_planted_difference_is_located_against_the_golden_traces(planted_golden, cli, tmp_path, monkeypatch,
                                                                   module, what):
    monkeypatch.setenv("VD_PLANT", module)
    code, out, err = cli("replay", planted_golden, "--model", PLANTED, "--forward", "planted", "--locate",
                         "--report", tmp_path / "r.json", "--html", tmp_path / "r.html")
    assert code == 1, out + err
    (loc,) = json.loads((tmp_path / "r.json").read_text())["locate"]
    decode, k2 = loc["verify"]  # (the planted forward computes the decode rows too: they part there first)
    assert (decode["k"], decode["module_call"], decode["first_module"]["name"]) == (1, "the prefill", module)
    assert loc["against"] == "golden traces" and k2["module_call"] == "the prefill" and k2["traced_pass_reproduces"]
    first = k2["first_module"]
    assert (first["name"], first["what"]) == (module, what) and first["rows_differ"] >= 1
    assert first["absmax"]["golden"] != first["absmax"]["now"] or first["norm"]["golden"] != first["norm"]["now"]
    assert f"first difference at {module} ({what})" in out
    page = (tmp_path / "r.html").read_text()
    assert "Where the difference starts" in page and '-loc-k2-first"' in page and module in page
    code, out, err = cli("locate", planted_golden, "--model", PLANTED, "--forward", "planted",  # the same, alone
                         "--html", tmp_path / "l.html")
    assert code == 1 and f"K=2 the prefill: first difference at {module} ({what})" in out, out + err
    assert "(not given)" not in (tmp_path / "l.html").read_text()  # the page names its command, as replay's does
    for outputs in (["--report", tmp_path / "o", "--html", tmp_path / "o"], ["--report", "-", "--html", "-"]):
        code, out, err = cli("locate", planted_golden, "--model", PLANTED, "--forward", "planted", *outputs)
        assert code == 2 and "--report and --html both write" in err and not (tmp_path / "o").exists(), err


def test_the_golden_own_forward_matches_its_traces(planted_golden, cli):
    code, out, err = cli("locate", planted_golden, "--model", PLANTED)
    assert code == 0 and "every row bit-identical" in out, out + err


def test_a_traced_pass_that_does_not_reproduce_the_rows_is_refused(cli, tmp_path):
    code, out, err = cli("record", tmp_path / "g.zarr", "--model", PLANTED, "--dtype", "float32", "--steps", "1",
                         "--k", "2", "--allow-thin", "--forward", "unsteady", "--trace")
    assert code == 2 and "--trace: forward 'unsteady' run again traced did not reproduce its own rows at the " \
        "decode rows (prefill row " in err and not (tmp_path / "g.zarr").exists(), err  # (traced first)


def test_nothing_before_the_located_module_differs_by_plain_hooks(planted_golden):
    from vd.store import open_golden

    prompt = open_golden(planted_golden).meta["prompt_text"]
    assert _first_by_plain_hooks("model.layers.7.mlp.down_proj", prompt) == "model.layers.7.mlp.down_proj"


def test_eager_and_sdpa_part_at_the_attention(tiny_golden, cli):
    code, out, err = cli("locate", tiny_golden, "--forward", "eager", "--between", "sdpa", "--k", "2")
    assert code == 1, out + err
    assert ("K=2 the prefill: first difference at model.layers.0.self_attn.o_proj (attention output before "
            "o_proj)") in out and "the 5 traced outputs before it identical" in out


def test_two_equal_forwards_agree(tiny_golden, cli):
    code, out, err = cli("locate", tiny_golden, "--forward", "eager", "--between", "eager", "--k", "2")
    assert code == 0 and "every row bit-identical" in out, out + err


@pytest.mark.parametrize("args, message", [
    ([], "holds no module traces: record it with vd record --trace (vd record {tiny} --refresh --trace --reason "
         "TEXT), or compare two forwards here with vd locate --between NAME"),
    (["--between", "eager", "--model", "tests/plugins/perturb.py:factory"],
     "forward 'eager' cannot be traced: the model (a Perturbed) implements no vd.protocol.ModuleTrace, which "
     "tracing its modules needs"),
])
def test_what_locate_cannot_do_is_refused(tiny_golden, cli, args, message):
    code, out, err = cli("locate", tiny_golden, *args)
    assert code == 2 and message.format(tiny=tiny_golden) in err and "Traceback" not in err, err


def test_another_model_is_refused_as_a_replay_refuses_it(tiny_golden, cli):
    """`--model` naming a model of another vocabulary crashed (exit 3, an IndexError); one of the same shape but other
    weights ran, every module 'differing' from the golden's. Both are refused (exit 2) as `vd replay` refuses them;
    the second runs with --allow-model-mismatch."""
    code, out, err = cli("locate", tiny_golden, "--between", "sdpa", "--k", "2", "--model", "tiny-qwen2")
    assert code == 2 and "model has vocab 384, golden" in err, err
    code, out, err = cli("locate", tiny_golden, "--between", "sdpa", "--k", "2", "--model", "tiny-llama-shape")
    assert code == 2 and "model fingerprint" in err and "pass --allow-model-mismatch" in err, err
    code, out, err = cli("locate", tiny_golden, "--between", "sdpa", "--k", "2", "--model", "tiny-llama-shape",
                         "--allow-model-mismatch")
    assert code in (0, 1) and "eager against sdpa" in out, out + err


def test_a_damaged_golden_or_unknown_forward_is_refused_before_the_model(tiny_golden, cli, tmp_path, monkeypatch):
    """No verdict from a damaged golden (its files checked against the manifest first), and no model loaded to
    learn that a forward does not exist."""
    import shutil

    from golden_edit import chunk, flip_byte

    import vd.replayer.locate as L

    monkeypatch.setattr(L, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, out, err = cli("locate", tiny_golden, "--forward", "eager", "--between", "nope", "--k", "2")
    assert code == 2 and "has no forward 'nope'" in err, err
    damaged = tmp_path / "d.zarr"
    shutil.copytree(tiny_golden, damaged)
    flip_byte(chunk(damaged, 2, index=1))
    code, out, err = cli("locate", damaged, "--forward", "eager", "--between", "eager", "--k", "2")
    assert code == 2 and "d.zarr/k2/logits.hi/c/1" in err and "does not match the golden's manifest" in err, err


@pytest.fixture(scope="module")
def smollm2_traced(tmp_path_factory, cli):
    """The default model's eager golden (bf16), 4 steps at K=2, recorded with --trace."""
    path = tmp_path_factory.mktemp("smol") / "g.zarr"
    code, _, err = cli("record", path, "--steps", "4", "--k", "2", "--allow-thin", "--trace")
    assert code == 0, err
    return path


def test_sdpa_against_an_eager_smollm2_golden_is_located_where_plain_hooks_see_it(smollm2_traced, cli, tmp_path):
    """The issue's CPU case: SmolLM2's eager golden with --trace, replayed under SDPA with --locate. Plain hooks
    on every leaf module (not vd's tracing) find the first leaf whose output differs: ``o_proj``, whose input
    (the attention's output, computed outside any module) is where locate says the difference starts."""
    path = smollm2_traced
    code, out, err = cli("replay", path, "--forward", "sdpa", "--locate", "--report", tmp_path / "r.json")
    assert code == 1, out + err
    decode, k2 = json.loads((tmp_path / "r.json").read_text())["locate"][0]["verify"]  # (sdpa decodes too)
    first = k2["first_module"]
    assert first["what"] == "attention output before o_proj" and k2["module_call"] == "the prefill"
    assert decode["k"] == 1 and decode["module_call"] == "the prefill" and decode["first_module"] == first
    m = load_model("smollm2", device=torch.device("cpu"), dtype=torch.bfloat16)
    leaves = [(n, mod) for n, mod in m.model.named_modules() if n and not list(mod.children())]
    from vd.store import open_golden

    text = open_golden(path).meta["prompt_text"]
    runs = [_leaf_outputs(m, leaves, name, text) for name in ("eager", "sdpa")]
    plain = next(a[0] for a, b in zip(*runs) if not torch.equal(a[1], b[1]))
    assert plain == first["name"], (plain, first)


def test_verify_against_decode_is_located(smollm2_traced, cli, tmp_path):
    """--between decode: SDPA's K-token verify row against its one-token decode row of the same position parts
    at an attention (its kernel depends on the number of queries). Whether and where eager's rows part depends
    on the host's matrix kernels: on an Intel Xeon a K-row product summed like a one-row one (all bit-identical);
    on AMD EPYC hosts they parted at layer 0's MLP down projection on one and at layer 15's attention (its
    K-query matmul) on another. Whatever the host, locate must then name a module of a layer, after points that
    agreed, with a traced pass that reproduces the rows."""
    code, out, err = cli("locate", smollm2_traced, "--forward", "sdpa", "--between", "decode",
                         "--report", tmp_path / "l.json")
    assert code == 1, out + err
    (k2,) = json.loads((tmp_path / "l.json").read_text())["verify"]
    assert k2["call"].startswith("step ") and "(against decode step " in k2["call"]
    assert k2["first_module"]["what"] == "attention output before o_proj" and k2["traced_pass_reproduces"]
    assert k2["identical_before"] > 0 and k2["first_module"]["max_abs"] > 0
    assert "sdpa against its own decode rows: they differ" in out
    code, out, err = cli("locate", smollm2_traced, "--forward", "eager", "--between", "decode",
                         "--report", tmp_path / "e.json")
    if code == 0:
        assert "verify rows have a decode row; all bit-identical" in out, out + err
        return
    assert code == 1 and "eager against its own decode rows: they differ" in out, out + err
    (k2,) = json.loads((tmp_path / "e.json").read_text())["verify"]
    first = k2["first_module"]
    assert first["name"].startswith("model.layers.") and first["max_abs"] > 0, first
    assert k2["identical_before"] > 0 and k2["traced_pass_reproduces"]


def test_the_lean_static_step_traces_the_points_hf_modules_do(cli, tmp_path):
    """A static golden's traces: HF's points under the same names (plus the rotated queries and keys), so an
    eager replay is compared on every point both hold, and parts at the attention (the lean step's SDPA)."""
    path = tmp_path / "s.zarr"
    code, _, err = cli("record", path, "--model", "tiny-llama", "--forward", "static", "--steps", "4", "--trace",
                       "--allow-thin")
    assert code == 0, err
    from vd.store import open_golden

    g = open_golden(path)
    points = g.trace_points()
    assert ("model.layers.0.self_attn.rotary", "queries after rotary") in points
    assert ("model.layers.1", "layer output (the residual stream)") in points and points[-1] == ("lm_head", "LM head")
    d, st = g.trace(2)
    assert d.shape == (g.layout(2).prompt + 4 * 2, len(points), 6) and st.shape[:2] == d.shape[:2]
    code, out, err = cli("locate", path, "--forward", "eager", "--k", "2", "--report", tmp_path / "l.json")
    assert code == 1 and "first difference at model.layers.0.self_attn.o_proj (attention output before o_proj)" \
        in out, out + err
    k2 = json.loads((tmp_path / "l.json").read_text())["verify"][-1]
    assert k2["k"] == 2 and k2["points_compared"] == len(points) - 2 * 2  # the rotary points eager has not


def test_a_slim_golden_keeps_its_traces_and_a_damaged_trace_is_refused(cli, tmp_path):
    path, slim = tmp_path / "g.zarr", tmp_path / "slim.zarr"
    code, _, err = cli("record", path, "--model", "tiny-llama", "--steps", "4", "--k", "2", "--trace", "--allow-thin")
    assert code == 0, err
    code, _, err = cli("slim", path, slim)
    assert code == 0, err
    code, out, err = cli("locate", slim, "--forward", "sdpa")
    assert code == 1 and "first difference at model.layers.0.self_attn.o_proj" in out, out + err
    chunk = path / "k2" / "trace_digests" / "c" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 1
    chunk.write_bytes(bytes(data))
    for args in (["verify", path], ["locate", path, "--forward", "sdpa"]):
        code, out, err = cli(*args)
        assert code == 2 and "k2/trace_digests" in err, (args, out, err)


def test_a_candidate_promoted_over_a_traced_golden_drops_the_traces_and_says_so(cli, tmp_path):
    """A candidate (a replay traces nothing) kept the golden's ``trace`` metadata without its traces, and a
    promotion of it made a golden that `vd verify` called intact and `vd locate` and `vd slim` refused as damaged
    (found by a user test). The candidate claims no traces; the change summary says they are dropped; and a
    golden claiming traces it does not hold fails `vd verify`."""
    path, cand = tmp_path / "g.zarr", tmp_path / "c.zarr"
    assert cli("record", path, "--model", "tiny-llama", "--steps", "4", "--k", "2", "--trace", "--allow-thin")[0] == 0
    perturb = str(Path(__file__).parent / "plugins" / "perturb.py") + ":factory"
    assert cli("replay", path, "--model", perturb, "--save-candidate", cand)[0] == 1
    meta = json.loads((cand / "zarr.json").read_text())["attributes"]["vd"]
    assert cli("verify", cand)[0] == 0 and "trace" not in meta
    code, out, err = cli("refresh", path, "--from", cand, "--reason", "the perturbed build")
    assert code == 0 and "- module traces dropped: the new version holds none" in out, out + err
    assert cli("verify", path)[0] == 0 and cli("slim", path, tmp_path / "s.zarr")[0] == 0
    code, out, err = cli("locate", path, "--forward", "sdpa")
    assert code == 2 and "holds no module traces" in err, out + err
    traced = tmp_path / "t.zarr"  # traces claimed, not there (the manifest made again without them)
    assert cli("record", traced, "--model", "tiny-llama", "--steps", "4", "--k", "2", "--trace", "--allow-thin")[0] == 0
    shutil.rmtree(traced / "k2" / "trace_digests")
    edit_meta(traced, lambda m: None)
    code, out, err = cli("verify", traced)
    assert code == 2 and "k2/trace_digests is missing" in err and err.count("\n") == 1, out + err


@pytest.mark.parametrize("args, message", [
    (["record", "{tmp}/x.zarr", "--model", "tests/plugins/perturb.py:factory", "--trace", "--steps", "1"],
     "--trace: forward "),
    (["record", "{tmp}/x.zarr", "--model", "tiny-llama", "--trace", "--batch", "2"],
     "--trace runs the sequence alone: it cannot trace a recording with --batch"),
    (["replay", "{tiny}", "--locate"], "holds no module traces: record it with vd record --trace"),
    (["replay", "{tiny}", "--locate", "--batch", "2"], "--locate runs the sequence alone: it does not go with --batch"),
])
def test_what_trace_and_locate_cannot_do_is_refused(tiny_golden, cli, tmp_path, args, message):
    code, out, err = cli(*[a.format(tmp=tmp_path, tiny=tiny_golden) for a in args])
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "x.zarr").exists()


def test_a_batch_is_located_where_the_sequence_alone_parts(smollm2_traced, cli, tmp_path):
    """--between batch:N: SDPA's rows of the sequence in a batch of two part from its rows alone at an attention
    (bench_axes: SDPA is not batch-invariant on the CPU). Whether eager's part depends on the host's matrix
    kernels, as against decode: not on an Intel Xeon; on an AMD EPYC at layer 20's attention (its batched
    matmul). Where they part, locate must name a module of a layer after points that agreed."""
    code, out, err = cli("locate", smollm2_traced, "--forward", "sdpa", "--between", "batch:2",
                         "--report", tmp_path / "l.json")
    assert code == 1, out + err
    decode, k2 = json.loads((tmp_path / "l.json").read_text())["verify"]  # the decode rows too, first (K 1)
    assert decode["k"] == 1 and k2["k"] == 2
    assert k2["first_module"]["what"] == "attention output before o_proj" and k2["traced_pass_reproduces"]
    assert "sdpa against itself in a batch of 2: they differ" in out
    code, out, err = cli("locate", smollm2_traced, "--forward", "eager", "--between", "batch:2",
                         "--report", tmp_path / "e.json")
    if code == 0:
        assert "every row bit-identical" in out, out + err
    else:
        assert code == 1 and "eager against itself in a batch of 2: they differ" in out, out + err
        k2 = next(x for x in json.loads((tmp_path / "e.json").read_text())["verify"] if x["differs"])
        first = k2["first_module"]
        assert first["name"].startswith("model.layers.") and first["max_abs"] > 0, first
        assert k2["identical_before"] > 0 and k2["traced_pass_reproduces"]
    code, out, err = cli("locate", smollm2_traced, "--between", "batch:1")
    assert code == 2 and "batch:N takes a batch size N of 2 to 64" in err, err
    code, out, err = cli("locate", smollm2_traced, "--between", "batch")  # (it said: no forward 'batch')
    assert code == 2 and "--between batch:N names the batch's size" in err, err


def test_a_batch_locates_the_decode_rows_too(cli, tmp_path):
    """tiny-llama's decode rows in a batch of two part from its rows alone at step 33 (as `vd replay --batch 2`
    FAILs there), while its verify rows do not: `vd locate --between batch:2` ran the verify widths alone and said
    "every row bit-identical", exit 0 (found by a user test). Whether a batch moves them depends on the host's
    matrix kernels (on AMD EPYC hosts at decode step 33; on an Intel Xeon not at all): locate must agree with the
    replay either way, the decode rows first."""
    golden = tmp_path / "g.zarr"
    assert cli("record", golden, "--model", "tiny-llama")[0] == 0
    replayed = cli("replay", golden, "--batch", "2")[0]
    code, out, err = cli("locate", golden, "--between", "batch:2")
    assert code == replayed, out + err
    if replayed == 0:
        assert out.startswith("decode: every row bit-identical\nK=2: every row bit-identical"), out + err
    else:
        assert out.startswith("decode ") and ": first difference at model.layers." in out, out + err
        assert "eager against itself in a batch of 2: they differ" in out
    member = tmp_path / "m.zarr"  # a golden recorded in a batch is located alone: said (it was not)
    assert cli("record", member, "--model", "tiny-llama", "--batch", "2", "--k", "2", "--steps", "4")[0] == 0
    code, out, err = cli("locate", member, "--between", "decode")
    assert code in (0, 1) and f"note: {member} was recorded as one member of a batch of 2; vd locate runs its " \
        "sequence alone" in out, out + err


@pytest.mark.parametrize("forward", ["eager", "static"])
def test_a_member_of_a_batch_traces_what_it_traces_alone(forward):
    """The traces of the golden's sequence in a batch of two (HF's modules' hooks, or the lean batch step) are
    its own rows of each point: where the forward is batch-invariant (eager and static on tiny-llama), every
    point both traces hold is bit-identical to the sequence's traces alone."""
    from vd.batch import BatchPlan, BatchView
    from vd.tracing import Traced

    m = load_model("tiny-llama", device=torch.device("cpu"), dtype=torch.bfloat16)
    m.set_forward(forward)
    prompt = m.encode("A member of a batch.")
    view = BatchView(m, BatchPlan(2, 1, 0), prompt, 8)
    calls = []
    with torch.inference_mode():
        for model in (m, view):
            t = Traced(model, model if model is view else m, keep=True)
            t.reset()
            t.forward(prompt)
            t.forward(prompt[:3])
            calls.append(t.traced)
    for c in (0, 1):
        alone, member = calls[0][c], calls[1][c]
        index = dict(zip(member.points, member.rows))
        common = [(p, x) for p, x in zip(alone.points, alone.rows) if p in index]
        assert len(common) == len(alone.points) > 20
        for p, x in common:
            assert torch.equal(x, index[p]), (c, p)


@pytest.mark.parametrize("spec, point", [
    ("tiny-deepseek-mtp", ("model.layers.0.self_attn.kv_a_proj_with_mqa",
                           "kv down-projection with the rotary key (MLA)")),
    ("tiny-glm4moe-mtp", ("model.layers.1.mlp", "MLP output (the experts' combined output)")),
])
def test_mla_and_moe_decoders_trace_with_the_drafter_feed(cli, tmp_path, spec, point):
    """DeepSeek-V3's MLA projections and a mixture of experts' combined output are traced; the drafter feed's
    trace rows are the prefill's, the bootstrap decode's and the steps' (FORMAT.md "Module traces")."""
    path = tmp_path / "g.zarr"
    code, _, err = cli("record", path, "--model", spec, "--feed", "mtp", "--steps", "3", "--k", "2", "--trace",
                       "--allow-thin")
    assert code == 0, err
    from vd.store import open_golden

    g = open_golden(path)
    assert point in g.trace_points()
    assert g.trace(2)[0].shape[0] == g.layout(2).prompt + 1 + 3 * 2
    code, out, err = cli("locate", path, "--forward", "sdpa")
    assert code in (0, 1) and "Traceback" not in err, out + err


def test_a_drafter_golden_parting_at_its_prefill_is_located_without_a_false_warning(cli, tmp_path):
    """A drafter golden whose prefill already differs: the traced pass runs no step, yet its bootstrap decode; its
    rows were set against the prefill's alone, and every such locate warned that the traced pass did not
    reproduce the forward's rows (and reported traced_pass_reproduces false)."""
    path, report = tmp_path / "m.zarr", tmp_path / "l.json"
    code, _, err = cli("record", path, "--model", "tiny-llama-mtp", "--feed", "mtp", "--steps", "4", "--k", "2",
                       "--prompt", "The three laws of thermodynamics state that", "--trace", "--allow-thin")
    assert code == 0, err
    code, out, err = cli("locate", path, "--forward", "sdpa", "--report", report)
    assert code == 1 and "K=2 the prefill" in out and "did not reproduce" not in out + err, out + err
    assert json.loads(report.read_text())["verify"][0]["traced_pass_reproduces"] is True


def test_a_golden_decode_forward_is_located_against(cli, tmp_path):
    """A golden whose decode rows are sdpa's (vd record --decode-forward sdpa): `vd locate --between decode` held
    eager's verify rows against eager's own decode rows and said "every row bit-identical", exit 0, where every
    replay measures them against sdpa's (a user test). It runs the decode rows with sdpa, and says so."""
    g = tmp_path / "g.zarr"
    assert cli("record", g, "--model", "tiny-llama", "--k", "2", "--steps", "4", "--allow-thin", "--trace",
               "--decode-forward", "sdpa")[0] == 0
    code, out, err = cli("locate", g, "--between", "decode")
    assert code == 1 and "first difference at model.layers.0.self_attn" in out, out + err
    assert f"note: {g}'s decode rows are sdpa's (vd record --decode-forward): they are run with it" in out, out
    assert "eager against sdpa's decode rows: they differ (above)" in out, out  # (not "its own")


def test_a_decode_only_difference_is_located_at_its_module(cli, tmp_path):
    """A replay whose verify rows equal the golden's and whose decode rows do not (an engine's one-token decode
    kernel changed: here `--decode-forward sdpa` on an eager golden): `vd replay --locate` printed no location,
    since the decode rows were not traced. They are now (`trace.decode`), and the decode rows are located with
    the decode forward that computed them, once; `vd locate` does the same, the decode rows first, and a golden
    whose decode rows were not traced (recorded before) is located at its K alone, saying so in `vd show`."""
    g, report = tmp_path / "g.zarr", tmp_path / "r.json"
    assert cli("record", g, "--model", "tiny-llama", "--k", "2", "--steps", "4", "--allow-thin", "--trace")[0] == 0
    code, out, err = cli("show", g)
    assert code == 0 and "points per row at every K and the decode rows" in out, out + err
    code, out, err = cli("replay", g, "--decode-forward", "sdpa", "--locate", "--report", report,
                         "--html", tmp_path / "r.html")
    assert code == 1, out + err
    page = (tmp_path / "r.html").read_text()
    assert "<b>decode the prefill</b>" in page and "note: the decode rows sdpa computes for eager&#x27;s" in page
    (loc,) = json.loads(report.read_text())["locate"]  # (eager's K=2 rows are the golden's: nothing located)
    (decode,) = loc["verify"]
    assert loc["forwards"] == ["sdpa"] and decode["k"] == 1 and decode["module_call"] == "the prefill"
    assert decode["first_module"]["what"] == "attention output before o_proj" and decode["traced_pass_reproduces"]
    assert loc["notes"] == ["the decode rows sdpa computes for eager's verify rows (--decode-forward)"]
    assert "where sdpa parts from the golden's module traces:\n  decode the prefill: first difference at " \
        "model.layers.0.self_attn.o_proj" in out, out
    code, out, err = cli("replay", g, "--forward", "eager", "--forward", "sdpa", "--decode-forward", "sdpa",
                         "--locate", "--report", report)
    assert code == 1, out + err
    (sdpa,) = json.loads(report.read_text())["locate"]  # (its decode rows located once, with its K rows)
    assert sdpa["forwards"] == ["sdpa"] and [x["k"] for x in sdpa["verify"]] == [1, 2]
    assert sdpa["notes"] == ["the decode rows sdpa computes for eager, sdpa's verify rows (--decode-forward)"]
    for ks in ([], ["--k", "2"]):  # (the decode rows whatever --k, as a replay runs them)
        code, out, err = cli("locate", g, "--forward", "sdpa", *ks)
        assert code == 1 and out.startswith("decode the prefill: first difference at model.layers.0.self_attn.o_proj")
        assert "K=2 the prefill: first difference" in out, out
    for name in ("trace_digests", "trace_stats"):  # as recorded before the decode rows were traced
        shutil.rmtree(g / "k1" / name)
    edit_meta(g, lambda m: m["trace"].pop("decode"))
    assert cli("verify", g)[0] == 0
    code, out, err = cli("show", g)
    assert code == 0 and "points per row at every K (not the decode rows)" in out, out + err
    code, out, err = cli("replay", g, "--decode-forward", "sdpa", "--locate")
    assert code == 1 and "Traceback" not in err, out + err
    assert f"where sdpa parts from the golden's module traces:\n  note: the decode rows sdpa computes for eager's " \
        f"verify rows (--decode-forward)\n  note: its decode rows differ, but {g} was traced before vd traced the " \
        "decode rows: they are not located (vd record GOLDEN --refresh traces them)" in out, out
    code, out, err = cli("locate", g, "--forward", "sdpa")
    assert code == 1 and out.startswith("K=2 the prefill: first difference"), out + err
    assert f"note: {g} was traced before vd traced the decode rows: located at its K alone" in out, out
    code, out, err = cli("record", g, "--refresh", "--reason", "trace the decode rows")
    assert code == 0 and "module traces of the decode rows added" in out, out + err
    assert open_golden(g).traced_at(1)


def test_decode_traces_the_metadata_does_not_match_are_damage(cli, tmp_path):
    """Traces of the decode rows are checked with every file, as the rows are (an adversarial test): claimed
    without a decode group, lost from a resealed golden (a plain replay, which reads none of them, passed it),
    there without the metadata's claim, or naming no point this forward traces."""
    base = tmp_path / "g.zarr"
    assert cli("record", base, "--model", "tiny-llama", "--k", "2", "--steps", "4", "--allow-thin", "--trace")[0] == 0

    def forged(name: str, change, drop: tuple[str, ...] = ()) -> Path:
        g = tmp_path / name
        shutil.copytree(base, g)
        for rel in drop:
            shutil.rmtree(g / rel)
        edit_meta(g, change)
        return g

    g = forged("nodecode.zarr", lambda m: [m.pop("decode"), m["logs"].pop("1")], ("k1",))
    for args in (["verify", g], ["locate", g, "--forward", "sdpa"], ["replay", g]):
        code, out, err = cli(*args)
        assert code == 2 and "lists decode-row points (trace.decode), but the golden stores no decode rows" in err, \
            (args, out, err)
    g = forged("lost.zarr", lambda m: None, ("k1/trace_digests",))
    for args in (["verify", g], ["replay", g], ["show", g], ["pack", g, tmp_path / "p.zip"]):
        code, out, err = cli(*args)
        last = err.strip().splitlines()[-1]
        assert code == 2 and last.endswith("k1/trace_digests is missing") and "Traceback" not in err, (args, out, err)
    g = forged("undeclared.zarr", lambda m: m["trace"].pop("decode"))
    for args in (["verify", g], ["replay", g]):
        code, out, err = cli(*args)
        assert code == 2 and "k1 holds module traces its metadata does not declare (trace.decode)" in err, \
            (args, out, err)
    g = forged("renamed.zarr", lambda m: m["trace"].update(decode=[[f"x{i}", "y"] for i in range(27)]))
    code, out, err = cli("locate", g, "--forward", "sdpa")
    assert code == 1 and "decode the prefill: the rows differ, but the golden's traces and this run's share no " \
        "traced point" in out, out + err
    g = forged("huge.zarr", lambda m: m["trace"].update(decode=[["a" * 100, "b"]] * 70000))
    code, out, err = cli("verify", g)
    assert code == 2 and "metadata field 'trace' is {" in err and len(err) < 1000, err[:300]


def test_a_golden_decode_forward_traces_its_decode_rows(cli, tmp_path, monkeypatch):
    """`vd record --trace --decode-forward sdpa`: the decode rows are sdpa's, traced under sdpa (refused where the
    decode forward cannot be traced), and `vd locate` holds sdpa's decode rows against them: identical."""
    g = tmp_path / "g.zarr"
    with monkeypatch.context() as m:
        m.setattr(HFModel, "trace_forwards", lambda self: ["eager"])
        code, out, err = cli("record", g, "--model", "tiny-llama", "--k", "2", "--steps", "4", "--trace",
                             "--decode-forward", "sdpa")
        assert code == 2 and "--trace: forward 'sdpa' cannot be traced" in err and not g.exists(), out + err
    assert cli("record", g, "--model", "tiny-llama", "--k", "2", "--steps", "4", "--allow-thin", "--trace",
               "--decode-forward", "sdpa")[0] == 0
    code, out, err = cli("locate", g)
    assert code == 0 and out.startswith("decode: every row bit-identical\nK=2: every row bit-identical"), out + err
    assert "decode rows are sdpa's (vd record --decode-forward): they are run with it" in out, out
    code, out, err = cli("locate", g, "--forward", "sdpa")
    assert code == 1 and out.startswith("decode: every row bit-identical\nK=2 the prefill: first difference"), out
    static = tmp_path / "s.zarr"  # (the lean static step traces the rotated queries and keys too)
    assert cli("record", static, "--model", "tiny-llama", "--k", "2", "--steps", "4", "--allow-thin", "--trace",
               "--decode-forward", "static")[0] == 0
    code, out, err = cli("show", static)
    assert code == 0 and "module traces of 27 points per row at every K, and of 31 points at the decode rows" in out


def test_an_engine_whose_decode_kernel_alone_changed_is_located_and_accepted(cli, tmp_path):
    """The case the decode traces are for (a user test's plug-in): a build whose one-token decode moves one module's
    output by one ULP, its K-token verify untouched. Its replay FAILs on the decode rows alone and --locate names
    that module at the first decode step, with or without --k; the next steps reproduce the K's failure with the
    decode forward that ran and record the plug-in's decode forward with the plug-in as the model (the command
    printed dropped --model); with it as the golden's forward, its decode rows are its own."""
    g, report = tmp_path / "g.zarr", tmp_path / "r.json"
    assert cli("record", g, "--model", "tiny-llama", "--k", "2", "--steps", "4", "--allow-thin", "--trace")[0] == 0
    spec = str(Path(__file__).parent / "plugins" / "decode_planted.py") + ":factory"
    code, out, err = cli("replay", g, "--model", spec, "--decode-forward", "decplant", "--locate", "--report", report)
    assert code == 1, out + err
    (loc,) = json.loads(report.read_text())["locate"]
    (decode,) = loc["verify"]
    assert loc["forwards"] == ["decplant"] and decode["k"] == 1 and decode["module_call"] == "step 0"
    assert decode["first_module"]["name"] == "model.layers.1.mlp.down_proj", decode
    assert "  decode step 0: first difference at model.layers.1.mlp.down_proj (MLP down projection)" in out, out
    assert f"record it so: vd record {g} --refresh --model {spec} --decode-forward decplant --reason TEXT" in out, out
    code, out, err = cli("locate", g, "--model", spec, "--forward", "decplant", "--k", "2")
    assert code == 1 and out.startswith("decode step 0: first difference at model.layers.1.mlp.down_proj"), out + err
    assert "K=2: every row bit-identical" in out, out
    code, out, err = cli("replay", g, "--forward", "static", "--decode-forward", "sdpa")  # both rows moved
    assert code == 1, out + err
    assert f"vd replay {g} --k 2 --forward static --decode-forward sdpa --tolerance" in out, out
    assert "To make static the golden's forward (its decode rows sdpa's), record it with it: vd record " \
        f"{g} --refresh --forward static --decode-forward sdpa --reason TEXT" in out, out  # (not "make sdpa")
