"""The same record/replay code on CUDA (marker ``gpu``; skipped without a CUDA device).

Run on a GPU machine with ``python3 -m pytest -m gpu``.
"""

import json
import os

import pytest
import torch

from vd.models import load_model
from vd.store import Prefetcher, open_golden
from vd.testing import DraftHeadConformance, ModelConformance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("spec, feed", [("tiny-llama", "reference"), ("tiny-qwen2", "reference"),
                                        ("tiny-llama-mtp", "mtp")])
def test_cuda_round_trip(cli, tmp_path, spec, feed):
    path = tmp_path / "g.zarr"
    code, out, err = cli("record", path, "--model", spec, "--feed", feed, "--device", "cuda", "--steps", "8",
                         "--allow-thin")
    assert code == 0, err
    offered = list(load_model(spec, device="cuda").forwards())  # eager, sdpa and each pinned SDPA backend
    assert offered[:2] == ["eager", "sdpa"] and "sdpa-math" in offered
    args = [x for f in offered for x in ("--forward", f)]
    code, out, err = cli("replay", path, *args, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["environment"]["recorded"]["device"] == "cuda" and r["environment"]["recorded"]["gpu_name"]
    for v in r["verify"]:
        eager = v["comparisons"][0]
        assert eager["prefill_equal"] and eager["mismatched_steps"] == 0 and not eager["draft_mismatched_steps"]
        # The control runs under the last forward: it fires, or is inconclusive where that forward already
        # fails at the changed step (a pinned SDPA backend rounding otherwise than eager attention).
        dc = v["detection_control"]
        assert dc["fired"] or (dc["inconclusive"] and dc["changed_step"] in v["comparisons"][-1]["failed_step_list"])
    print(json.dumps({v["k"]: [(c["variant"], c["mismatched_steps"], c["max_abs_diff"]) for c in v["comparisons"]]
                      for v in r["verify"]}))


def test_cpu_golden_on_cuda_names_the_device(cli, tiny_golden, tmp_path):
    code, out, err = cli("replay", tiny_golden, "--device", "cuda", "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert any(d.startswith("device: cpu → cuda") for d in r["environment"]["numerics_differences"])
    if code == 1:
        assert any("replaying environment differs" in x for x in r["reasons"])


class TestCudaConformance(ModelConformance, DraftHeadConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return load_model("tiny-llama-mtp", device="cuda")


def _replay_all(cli, path, forwards, report):
    args = [x for f in forwards for x in ("--forward", f)]
    code, out, err = cli("replay", path, *args, "--report", report)
    r = json.loads(report.read_text())
    by = {}
    for v in r["verify"]:
        for c in v["comparisons"]:
            by.setdefault(c["variant"], []).append(c)
    return r, by


def _brief(by):
    """What differed, per forward and K, short enough to read whole in a failure."""
    keys = ("prefill_equal", "mismatched_step_list", "max_abs_diff", "bootstrap_equal", "draft_mismatched_step_list")
    return json.dumps({f: [{k: c.get(k) for k in keys} for c in cs] for f, cs in by.items()})  # a str: not cut


def _equal(cs):
    return all(c["prefill_equal"] and c["mismatched_steps"] == 0 and not c["draft_mismatched_steps"]
               and c["bootstrap_equal"] is not False for c in cs)


@pytest.mark.parametrize("spec, feed", [("tiny-llama-mtp", "mtp"), ("tiny-qwen2", "reference")])
def test_graphed_replays_static_bit_for_bit(cli, tmp_path, spec, feed):
    """A CUDA graph of the static forward's kernels replays them bitwise (verify, decode and, with a head,
    propose), for every K, verify and draft rows. Every forward is compared."""
    path = tmp_path / "graphed.zarr"
    code, out, err = cli("record", path, "--model", spec, "--feed", feed, "--device", "cuda", "--steps", "8",
                         "--forward", "graphed", "--allow-thin",
                         "--prompt", "The three laws of thermodynamics state that")
    assert code == 0, err
    assert open_golden(path).meta["graphs"] == "graphed"
    r, by = _replay_all(cli, path, ["graphed", "static", "eager", "sdpa"], tmp_path / "r.json")
    assert _equal(by["graphed"]) and _equal(by["static"]), _brief(by)
    assert not _equal(by["eager"])  # eager attention is other arithmetic, and the report says so
    assert all(v["detection_control"]["fired"] for v in r["verify"])
    assert {v["name"]: v["graphs"] for v in r["variants"]} == {
        "graphed": "graphed", "static": "eager", "eager": "eager", "sdpa": "eager"}
    assert r["graphs"] == "mixed"


def test_compiled_forwards_replay_their_own_golden(cli, tmp_path):
    """In one process a compiled golden replays bit for bit, and the compiled step captured as CUDA graphs
    equals it (the same compiled kernels). Across processes it did not always (README, On the GPU): that is
    not asserted here."""
    path = tmp_path / "compiled.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama-mtp", "--feed", "mtp", "--device", "cuda",
                         "--steps", "8", "--forward", "compiled", "--allow-thin",
                         "--prompt", "The three laws of thermodynamics state that")
    assert code == 0, err
    r, by = _replay_all(cli, path, ["compiled", "compiled-graphed"], tmp_path / "r.json")
    assert _equal(by["compiled"]) and _equal(by["compiled-graphed"]), _brief(by)


def test_a_compiled_golden_carries_the_kernels_it_was_recorded_with(cli, tmp_path):
    """A compiled recording (`vd record`, a process of its own) stores the Inductor artifacts it compiled; a
    replay in a new process with an empty Inductor cache (as on another machine) loads them before compiling,
    says so, and is bit for bit equal; the slim form keeps them; damaging them is caught before anything
    runs. (Recorded inside a process that had compiled other models first, the K=4 step of this golden did
    not replay bit for bit: README, "Compiled goldens travel".)"""
    import os
    import subprocess
    import sys

    def vd(*args, cache: str):  # a process of its own with an empty Inductor cache, as a machine of its own
        fresh = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / cache)}
        return subprocess.run([sys.executable, "-m", "vd", *map(str, args)], env=fresh, capture_output=True,
                              text=True, timeout=600)

    path = tmp_path / "compiled.zarr"
    done = vd("record", path, "--model", "tiny-llama", "--device", "cuda", "--steps", "8", "--forward",
              "compiled-graphed", "--allow-thin", cache="recording")
    assert done.returncode == 0, done.stderr[-2000:]
    g = open_golden(path)
    about = g.meta["compiled"]
    assert about["artifacts"] == "inductor/artifacts.bin" and about["bytes"] > 0 and about["kinds"]
    assert "inductor/artifacts.bin" in g.manifest and cli("verify", path)[0] == 0
    assert cli("slim", path, tmp_path / "slim.zarr")[0] == 0
    report = tmp_path / "r.json"
    done = vd("replay", path, "--report", report, cache="replay")
    r = json.loads(report.read_text())
    assert done.returncode == 0 and r["verdict"] == "PASS", (r["reasons"], r["notes"])
    assert any("reuse the recording's Inductor artifacts" in n for n in r["notes"]), r["notes"]
    data = bytearray((path / "inductor" / "artifacts.bin").read_bytes())
    data[len(data) // 2] ^= 1
    (path / "inductor" / "artifacts.bin").write_bytes(bytes(data))
    code, out, err = cli("replay", path)
    assert code == 2 and "inductor/artifacts.bin" in err, err


def test_a_compiled_golden_replays_forked_from_the_warm_server(tmp_path):
    """`vd warm` imports Inductor (its one CUDA question asked in a child of its own): a `compiled-graphed`
    golden recorded in a process of its own replays bit for bit in a command forked from the server, which
    stays free of CUDA and serves on."""
    from warm_server import start_server, stop_server, vd_run

    path = tmp_path / "compiled.zarr"
    done = vd_run(["record", path, "--model", "tiny-llama", "--device", "cuda", "--steps", "8", "--forward",
                   "compiled-graphed", "--allow-thin"], {**os.environ, "VD_WARM": "off"})
    assert done.returncode == 0, done.stderr[-2000:]
    env, info = start_server(tmp_path / "warm")
    try:
        assert info["inductor"] == "imported"
        for n in range(2):
            done = vd_run(["replay", path, "--report", tmp_path / f"r{n}.json"], env)
            r = json.loads((tmp_path / f"r{n}.json").read_text())
            assert done.returncode == 0 and r["verdict"] == "PASS", (done.stderr[-2000:], r["reasons"])
            assert r["timing"]["warm"] is True and "warm server not used" not in done.stderr
        status = json.loads(vd_run(["warm", "--status", "--json"], env).stdout)
        assert status["pid"] == info["pid"] and status["served"] == 2
    finally:
        stop_server(env, info["pid"])


def test_generated_weights_are_the_same_bits_on_cpu_and_cuda():
    from transformers import LlamaConfig

    from vd.models.generated import build_generated, hash_uniform_

    a, b = torch.empty(3_000_001, dtype=torch.bfloat16), torch.empty(3_000_001, dtype=torch.bfloat16, device="cuda")
    hash_uniform_(a, 99, 0.02)
    hash_uniform_(b, 99, 0.02)
    assert torch.equal(a, b.cpu())
    cfg = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)
    fps = [build_generated(LlamaConfig(**cfg), seed=1, name="x", device=torch.device(d),
                           dtype=torch.bfloat16).identity().fingerprint for d in ("cpu", "cuda")]
    assert fps[0] == fps[1]


class TestCudaGraphedConformance(ModelConformance, DraftHeadConformance):
    @pytest.fixture
    def model(self):
        m = load_model("tiny-llama-mtp", device="cuda")
        m.set_forward("graphed")
        return m


def test_prefetched_golden_on_cuda_gives_what_reading_in_line_does(tiny_golden, rows_golden):
    """On CUDA a golden's small arrays are read in units (on the thread, before a run by ``ready``, or when a K
    is judged) and its digests copied to the device on the side stream: the same side as reading in line on
    the CPU. A golden without digests has them computed from its rows."""
    import numpy as np

    cuda = torch.device("cuda")
    for path in (tiny_golden, rows_golden):
        inline = open_golden(path)
        for how in ("demand", "ready", "thread"):
            p = Prefetcher(open_golden(path), cuda)
            if how == "thread":
                p.start_thread()
            if how == "ready":
                p.ready()
                assert not p.units
            for k in (2, 3, 4):
                side, want = p.side(k), inline.side(k)
                assert np.array_equal(side.digests, want.digests) and side.log.same_steps(want.log)
                rows = inline.all_rows(k)
                got = torch.cat([torch.from_numpy(a.view(np.int16)) for a in rows.values()]).view(torch.bfloat16)
                assert not side.differ(got.to(cuda)).any()  # the golden's own rows do not differ on the GPU
            where = {w for w, _, _ in p.timeline}
            if path == tiny_golden:
                assert where <= {"thread", "drain"} if how == "thread" else where == {"drain"}, where
            else:
                assert not where  # nothing is read ahead for a golden without digests


def test_comparison_queued_during_the_last_step_is_the_comparison_after_the_run(tmp_path):
    """`vd.replayer.judge.Queued` (which rows differ, asked of the GPU on a side stream while it runs the last
    step) gives the comparison made after the run, for the golden's forward (equal) and for eager (rows
    that differ, measured from the queued rows)."""
    from vd.loop import ReplayFeed, run_verify
    from vd.policy import Policy
    from vd.recorder import RecordSettings, record
    from vd.replayer.judge import Queued, compare_run

    m = load_model("tiny-qwen2", device="cuda")
    m.set_forward("graphed")
    path = tmp_path / "g.zarr"
    record(path, RecordSettings(model="tiny-qwen2", prompt="The three laws of thermodynamics state that", ks=(3,),
                                steps=6, forward="graphed", allow_thin=True), model=m)
    g = open_golden(path)
    p = Prefetcher(g, m.device)
    log, verdicts, policy = g.log(3), [], Policy.parse()
    for fwd in ("graphed", "eager"):
        m.set_forward(fwd)
        queued = []
        p.ready()
        run = run_verify(m, g.prompt, 3, 6, ReplayFeed(log.steps, log.bootstrap),
                         on_last=lambda r, rows, into=queued: into.append(Queued(p.side(3), r, rows)))
        assert len(queued) == 1
        a = compare_run(fwd, p.side(3), run, g.logical, policy, queued[0]).to_json()
        assert a == compare_run(fwd, p.side(3), run, g.logical, policy).to_json()
        verdicts.append((a["passed"], a["mismatched_steps"] > 0 or not a["prefill_equal"]))
    assert verdicts[0] == (True, False) and verdicts[1][1], verdicts


def test_row_digests_are_the_same_on_cpu_and_cuda(cli, tmp_path):
    """`vd.digest` sums exact integers in float64: cuBLAS gives the CPU's digest bit for bit (a 152k
    vocabulary in bf16, float32 rows, the blocked path); a golden recorded on CUDA stores the digests
    its rows have when read back on the CPU."""
    import numpy as np

    from vd.digest import BLOCK_BYTES, digest, summarise
    from vd.dtypes import to_tensor

    g = torch.Generator().manual_seed(0)
    for rows in (torch.randn(BLOCK_BYTES // (8 * 151936) + 5, 151936, generator=g).mul(30).to(torch.bfloat16),
                 torch.randn(7, 50000, generator=g).mul(1e4)):
        assert torch.equal(digest(rows), digest(rows.cuda()).cpu())
    path = tmp_path / "g.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama-mtp", "--feed", "mtp", "--device", "cuda",
                         "--steps", "8", "--forward", "graphed", "--allow-thin")
    assert code == 0, err
    golden = open_golden(path)
    for k in golden.ks:
        digests, stats = summarise({kind: to_tensor(a) for kind, a in golden.verify_rows(k).items()})
        stored_digests, stored_stats = golden.summary(k)
        assert np.array_equal(stored_digests, digests), k
        # argmax, top-1, margin and largest |logit| are exact on either device; the top-1 probability sums
        assert np.array_equal(stored_stats[:, :4], stats[:, :4]) and np.allclose(stored_stats, stats, rtol=1e-5), k


@pytest.mark.parametrize("spec, feed", [("tiny-llama", "reference"), ("tiny-llama-mtp", "mtp")])
def test_a_graphed_golden_is_refreshed_and_a_candidate_promoted_on_cuda(cli, tmp_path, monkeypatch, spec, feed):
    """The reviewed refresh on CUDA: the new recording replays itself bit for bit as graphs (else it would be
    refused), re-recording unchanged logits moves nothing, and a replay's candidate promotes to the same
    content. (The prompt is one the tiny MTP head drafts well on: a refresh refuses a thin recording.)"""
    monkeypatch.chdir(tmp_path)  # no suite declared here
    g = tmp_path / "g.zarr"
    code, out, err = cli("record", g, "--model", spec, "--feed", feed, "--device", "cuda", "--forward", "graphed",
                         "--steps", "8", "--prompt", "The three laws of thermodynamics state that")
    assert code == 0, err
    code, out, err = cli("record", g, "--refresh", "--reason", "the same build again")
    assert code == 0 and "no logit, step or decision moved" in out, out + err
    code, out, err = cli("replay", g, "--save-candidate", tmp_path / "c.zarr")
    assert code == 0, out + err
    code, out, err = cli("refresh", g, "--from", tmp_path / "c.zarr", "--reason", "promote the graphed replay")
    assert code == 0 and "no logit, step or decision moved" in out, out + err
    h = open_golden(g).history
    assert [e["reason"] for e in h] == ["first recording", "the same build again", "promote the graphed replay"]
    assert h[0]["content_digest"] == h[2]["content_digest"] and h[2]["environment"]["device"] == "cuda"


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2"])
def test_graphed_batch_is_the_static_batch_bit_for_bit(spec):
    """A batch of three under ``graphed`` (one CUDA graph per (n, L), captured on first use) replays the static
    batch's kernels: every member's rows bit for bit, through padding, per-member rewinds and a reorder."""
    m = load_model(spec, device="cuda")
    prompts = [m.encode(p)[:30] for p in ("A first prompt of some length.", "Second, longer than the first by far.",
                                          "Third.")]
    steps = [prompts, [[5, 6, 7], [11, 12], [4]], [[9, 10], [13, 14, 15], [7, 8, 9, 10]], [[1], [2], [3]]]
    rows = {}
    for name in ("static", "graphed"):
        m.set_forward(name)
        m.reset_batch(3, 96)
        out = []
        for i, tokens in enumerate(steps):
            if i == 2:
                m.reorder_batch([2, 0, 1])
            out.append([r.clone() for r in m.forward_batch(tokens)])
            m.rewind_batch(i % 3, 1)
        rows[name] = out
    for a, b in zip(rows["static"], rows["graphed"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("recorded, replayed", [("graphed", "compiled-graphed"), ("compiled-graphed", "graphed")])
def test_a_traced_graphed_or_compiled_golden_locates_the_other(cli, tmp_path, recorded, replayed):
    """--trace on forwards that capture graphs or compile: the traced pass (their kernels without the graph; a
    compiled step at its regions' edges) reproduced every row, or the recording would be refused; a replay under
    the other forward locates where it parts, on a point both traces hold, or passes."""
    path = tmp_path / "g.zarr"
    code, out, err = cli("record", path, "--model", "tiny-qwen2", "--device", "cuda", "--steps", "8", "--forward",
                         recorded, "--trace", "--allow-thin")
    assert code == 0, err
    from vd.store import open_golden

    assert open_golden(path).traced_at(1)  # (the decode rows' traced pass reproduced them too)
    code, out, err = cli("replay", path, "--forward", replayed, "--locate", "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code in (0, 1), err
    for loc in r["locate"]:
        for k in loc["verify"]:
            assert k["traced_pass_reproduces"] and (k["first_module"] is not None or k["note"]), k
    print(json.dumps([(k["k"], k["module_call"], k["first_module"]["name"] if k["first_module"] else k["note"])
                      for loc in r["locate"] for k in loc["verify"]]))
    if recorded == "graphed":  # the static step's kernels in a graph: its golden is the static step's, every row
        cli("replay", path, "--forward", "static", "--locate", "--report", tmp_path / "s.json")
        r = json.loads((tmp_path / "s.json").read_text())
        assert all(c["prefill_equal"] and c["mismatched_steps"] == 0 for v in r["verify"] for c in v["comparisons"])
        assert r["locate"] == []


def test_a_collection_inside_a_capture_cannot_reset_an_earlier_graph():
    """An earlier model's graphs freed by Python's cyclic collector while another graph is captured would be
    reset mid-capture, which CUDA refuses ("operation not permitted when stream is capturing": the capture
    fails). `GraphSet.capture` pauses the collector, so the collection the captured call would start (threshold
    1, a cycle holding the old graphs dropped inside it) waits until the capture is over."""
    import gc

    from vd.models.static import WARMUP_RUNS, GraphSet

    cuda = torch.device("cuda")
    x = torch.arange(4.0, device=cuda)
    old = GraphSet(lambda t: t * 2, cuda)
    old.capture("old", (x,))
    held, calls = {"old": old}, []
    del old

    def step(t):
        calls.append(t)
        if len(calls) == WARMUP_RUNS + 1 and "old" in held:  # the captured call
            cycle: list = [held.pop("old")]
            cycle.append(cycle)  # the old graphs now go with the collector alone
            del cycle
            gc.set_threshold(1)
            _ = [[] for _ in range(1000)]  # enough new containers to start a collection, were it running
        return t * 3

    threshold = gc.get_threshold()
    try:
        new = GraphSet(step, cuda)
        new.capture("new", (x,))
    finally:
        gc.set_threshold(*threshold)
    gc.collect()  # the old graphs go now, outside any capture
    assert torch.equal(new.replay("new"), x * 3) and not held
