"""Tensor parallelism (`vd.models.tp`, ``--tp``): shards generated alone are slices of the whole model; a TP=2
recording over two CPU processes (gloo, launched with torchrun) replays bit for bit at TP=2 (its default) and as
another build at TP=1; a rank that fails ends every rank with one line; bad degrees and models are refused."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vd.models.generated import build_generated, checksum_on_device, hash_uniform_, tensor_seed
from vd.models.presets import PRESETS
from vd.models.tp import ranks_sharing, region, shard_config
from vd.store import open_golden

ARGS = ["--model", "tiny-llama-shape", "--k", "2,3", "--steps", "6"]


def _vd(*args, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vd", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("size", [1, 2])
def test_each_rank_generates_its_slice_of_the_whole_model(size):
    """Every shard tensor `build` would fill is that slice of the whole generated model's tensor, and the
    ranks' checksums of their slices (weighted by index in the whole tensor) add up to the whole one's."""
    cfg, seed, _ = PRESETS["tiny-llama-shape"].shape()
    whole = dict(build_generated(cfg, seed=seed, name="x", device=torch.device("cpu"),
                                 dtype=torch.bfloat16).model.named_parameters())
    shard = shard_config(cfg, size)
    assert (shard.num_attention_heads, shard.num_key_value_heads, shard.intermediate_size) == (4 // size, 2 // size,
                                                                                                128 // size)
    split = 0
    for name, full in whole.items():
        module = name.split(".")[-2]
        dim = 0 if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") else \
            1 if module in ("o_proj", "down_proj") else None
        shape = list(full.shape)
        if dim is None:  # every rank holds it whole
            assert region(name, tuple(shape), cfg, 1, size) == (None, tuple(shape))
            continue
        shape[dim] //= size
        pieces, sums = [], 0
        for rank in range(size):
            at, whole_shape = region(name, tuple(shape), cfg, rank, size)
            assert whole_shape == tuple(full.shape)
            t = torch.empty(shape, dtype=torch.bfloat16)
            hash_uniform_(t, tensor_seed(seed, name), cfg.initializer_range, at=at)
            pieces.append(t)
            sums += int(checksum_on_device(t, at=at).sum())
        split += 1
        assert torch.equal(torch.cat(pieces, dim=dim), full), name
        assert sums == int(checksum_on_device(full).sum()), name
    assert split == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    with pytest.raises(Exception, match="needs 3 to divide"):
        shard_config(cfg, 3)


def test_tp2_golden_replays_bit_for_bit_at_tp2_and_as_another_build_at_tp1(tmp_path):
    g = tmp_path / "tp2.zarr"
    r = _vd("record", g, *ARGS, "--tp", "2")
    assert r.returncode == 0, r.stderr
    meta = open_golden(g).meta
    assert meta["environment"]["tp"] == 2 and meta["environment"]["collectives"] == "gloo"
    assert meta["forward"] == "static" and "tensor parallel over 2 ranks" in meta["forward_description"]
    assert "tensor parallel over 2 ranks (gloo)" in _vd("show", g).stdout
    # The fingerprint is the whole model's, whatever the degree.
    cfg, seed, name = PRESETS["tiny-llama-shape"].shape()
    whole = build_generated(cfg, seed=seed, name=name, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert meta["model"]["fingerprint"] == whole.identity().fingerprint
    assert meta["model"]["details"]["parameters"] == whole.identity().details["parameters"]

    r = _vd("replay", g, "--tp", "2", "--report", tmp_path / "r2.json")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    report = json.loads((tmp_path / "r2.json").read_text())
    assert report["verdict"] == "PASS" and [v["k"] for v in report["verify"]] == [2, 3]
    assert all(v["detection_control"]["fired"] and v["comparisons"][0]["mismatched_steps"] == 0
               for v in report["verify"])
    assert report["environment"]["numerics_differences"] == []
    assert not [line for line in r.stderr.splitlines() if "Traceback" in line or "SIGABRT" in line], r.stderr

    r = _vd("replay", g, "--tp", "1", "--report", tmp_path / "r1.json")  # one process: the sums' order differs
    report = json.loads((tmp_path / "r1.json").read_text())
    assert r.returncode == 1 and report["verdict"] == "FAIL", r.stdout
    assert "tp: 2 → 1" in report["environment"]["numerics_differences"], report["environment"]
    bundle = tmp_path / "r1.json.bundle"  # (the next step names it) and its command replays at --tp 1:
    assert f"in its bundle {bundle}/" in r.stdout and f"sh {bundle / 'command.sh'} replays just that" in r.stdout
    command = (bundle / "command.sh").read_text()
    assert f'"$@" replay {g} --k 2 --forward static --tp 1 --tolerance' in command  # (--tp 2 is the default)

    # Without --tp, the golden's degree, as its forward and device: it took one process, and FAILed as another
    # build; `vd record --refresh` re-recorded it in one process, moving every row.
    r = _vd("replay", g)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    assert r.stderr.startswith("vd: --tp 2, as the golden was recorded (--tp 1: in one process, another build)\n")
    r = _vd("record", g, "--refresh")
    assert r.returncode == 0 and "no logit, step or decision moved" in r.stdout, r.stdout + r.stderr
    assert open_golden(g).meta["environment"]["tp"] == 2


def test_an_s3_tp2_golden_replays_over_its_ranks_without_tp(s3):
    """An s3:// golden's degree is read from its root document (one GET) before the command opens it: without
    ``--tp`` it replayed in one process and FAILed on every row."""
    r = _vd("record", s3, *ARGS, "--tp", "2")
    assert r.returncode == 0, r.stderr
    r = _vd("replay", s3)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    assert r.stderr.startswith("vd: --tp 2, as the golden was recorded (--tp 1: in one process, another build)\n")


SUITE_TOML = """\
[defaults]
model = "tiny-llama-shape"
steps = 6
[goldens.a]
path = "a.zarr"
k = [2, 3]
[goldens.b]
path = "b.zarr"
k = [2]
"""


def test_a_suite_replays_and_refreshes_at_the_degree_its_goldens_share(tmp_path):
    """``vd replay --suite`` ran a TP=2 suite in one process (every row FAILed as another build) and
    ``vd record --suite --refresh`` re-recorded it there; a suite of mixed degrees is refused (it runs over one)."""
    (tmp_path / "vd.toml").write_text(SUITE_TOML)

    def vd(*args):
        return subprocess.run([sys.executable, "-m", "vd", *args], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path)

    r = vd("record", "--suite", "--tp", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert [open_golden(tmp_path / g).meta["environment"]["tp"] for g in ("a.zarr", "b.zarr")] == [2, 2]
    r = vd("replay", "--suite")
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    assert r.stderr.startswith("vd: --tp 2, as the suite's goldens were recorded (--tp 1: in one process, "), r.stderr
    _pytest_fails_tp_goldens(tmp_path)
    _refreshes_keep_the_degree(tmp_path, vd)
    _missing_goldens_take_the_degree_and_mixed_ones_are_refused(tmp_path, vd)


def _pytest_fails_tp_goldens(tmp_path):
    """pytest runs one process: its own replay of a TP golden, or an update re-recording it, fails saying so."""
    for update in ((), ("--vd-update",)):
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--vd", "-p", "no:cacheprovider", *update],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert r.returncode == 1 and "2 failed" in r.stdout, r.stdout
        assert ("vd golden 'a' (" in r.stdout and "was recorded over 2 tensor-parallel ranks and "
                "pytest runs it in one process, where its rows differ as another build's" in r.stdout), r.stdout
        assert "(vd replay b replays it over its ranks; vd record b --refresh --reason TEXT" in r.stdout, r.stdout
    assert len(open_golden(tmp_path / "a.zarr").history) == 1


def _refreshes_keep_the_degree(tmp_path, vd):
    r = vd("record", "--suite", "b", "--refresh", "--reason", "again")
    assert r.returncode == 0 and "REFRESHED" in r.stdout, r.stdout + r.stderr
    assert open_golden(tmp_path / "b.zarr").meta["environment"]["tp"] == 2
    r = vd("refresh", "a", "--reason", "again")  # (it re-recorded the golden in one process)
    assert r.returncode == 0 and "refreshed" in r.stdout, r.stdout + r.stderr
    assert r.stderr.startswith("vd: --tp 2, as the golden was recorded"), r.stderr
    assert open_golden(tmp_path / "a.zarr").meta["environment"]["tp"] == 2
    r = vd("refresh", "a", "--from", "cand.zarr", "--tp", "2", "--reason", "r")
    assert r.returncode == 2 and r.stderr == ("vd: error: --tp splits the model a refresh records; a promotion "
                                              "(--from) records nothing\n"), r.stderr


def _missing_goldens_take_the_degree_and_mixed_ones_are_refused(tmp_path, vd):
    with (tmp_path / "vd.toml").open("a") as f:
        f.write('[goldens.d]\npath = "d.zarr"\n')
    r = vd("record", "--suite")  # d, not recorded yet, is recorded at the degree of the others
    assert r.returncode == 0 and "RECORDED" in r.stdout, r.stdout + r.stderr
    assert open_golden(tmp_path / "d.zarr").meta["environment"]["tp"] == 2
    r = vd("record", "--suite")  # none missing: nothing to launch ranks for
    assert r.returncode == 0 and "PRESENT" in r.stdout and "--tp" not in r.stderr, r.stdout + r.stderr

    r = vd("record", str(tmp_path / "c.zarr"), *ARGS)  # one process
    assert r.returncode == 0, r.stderr
    with (tmp_path / "vd.toml").open("a") as f:
        f.write('[goldens.c]\npath = "c.zarr"\nk = [2, 3]\n')
    r = vd("replay", "--suite")
    assert r.returncode == 2 and r.stderr == (
        "vd: error: the suite's goldens were recorded over different numbers of tensor-parallel ranks "
        "(c: 1; a, b, d: 2) and a suite runs over one: give --tp N, or name the goldens of one degree\n"), r.stderr
    r = vd("replay", "--suite", "c")
    assert r.returncode == 0 and "PASS" in r.stdout and "--tp" not in r.stderr, r.stdout + r.stderr


def test_a_rank_that_fails_ends_every_rank_with_one_line(tmp_path):
    """Rank 1's forward raising on its 20th call (a crashing engine on one GPU) ends the run: rank 1 says so in
    one line, its traceback in the folder $VD_TRACEBACK_DIR names, rank 0 fails its next collective (an internal
    error, exit 3), nothing is written, and nothing is left in the temporary folder (torchrun's log folders
    went with vd's own)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("RANK") == "1":
            from vd.models import tp
            calls, forward = [0], tp.TPModel.forward
            def failing(self, tokens):
                calls[0] += 1
                if calls[0] == 20:
                    raise RuntimeError("injected failure on rank 1")
                return forward(self, tokens)
            tp.TPModel.forward = failing
    """))
    temporary, tracebacks = tmp_path / "tmp", tmp_path / "tracebacks"
    temporary.mkdir()
    env = {"PYTHONPATH": os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(temporary), "VD_TRACEBACK_DIR": str(tracebacks)}
    r = _vd("record", tmp_path / "g.zarr", *ARGS, "--tp", "2", env=env)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "vd: error: rank 1: RuntimeError: injected failure on rank 1 (traceback in" in r.stderr, r.stderr
    trace = Path(r.stderr.split("traceback in ")[1].split(")")[0])
    assert trace.parent == tracebacks and "injected failure on rank 1" in trace.read_text()
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_")] == []  # (a cache)
    assert "tensor-parallel ranks ended without an outcome" in r.stderr or "internal error" in r.stderr
    assert not (tmp_path / "g.zarr").exists()


@pytest.mark.parametrize("args, message", [
    (["--model", "tiny-llama-shape", "--tp", "3"], "needs 3 to divide the model's query heads 4"),
    (["--model", "tiny-llama", "--tp", "2"], "tiny-llama is not one"),
])
def test_a_degree_or_model_that_cannot_split_is_refused(tmp_path, args, message):
    r = _vd("record", tmp_path / "g.zarr", "--steps", "2", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("vd: error:")] == \
        [next(line for line in r.stderr.splitlines() if message in line)]
    assert not Path(tmp_path / "g.zarr").exists()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_graphed_on_two_gpus_replays_bit_for_bit(tmp_path):
    """On two GPUs: NCCL's all-reduce captured inside each step's CUDA graph; the TP=2 `graphed` golden
    replays bit for bit at TP=2 (`graphed` and `static`), and in one process as another build."""
    g = tmp_path / "tp2.zarr"
    args = ["--model", "qwen2.5-0.5b-shape", "--prompt", "Verify.", "--k", "2,4", "--steps", "8", "--allow-thin",
            "--device", "cuda"]
    r = _vd("record", g, *args, "--forward", "graphed", "--tp", "2")
    assert r.returncode == 0, r.stderr
    env = open_golden(g).meta["environment"]
    assert env["tp"] == 2 and env["collectives"].startswith("nccl ")
    r = _vd("replay", g, "--tp", "2", "--forward", "graphed", "--forward", "static", "--report", tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    assert r.returncode == 0 and report["verdict"] == "PASS", r.stdout + r.stderr
    assert all(v["detection_control"]["fired"] for v in report["verify"])
    r = _vd("replay", g, "--forward", "graphed", "--report", tmp_path / "r1.json")
    report = json.loads((tmp_path / "r1.json").read_text())
    assert "tp: 2 → 1" in report["environment"]["numerics_differences"]


@pytest.mark.parametrize("local_size, devices, shares", [(2, 2, [1, 1]), (2, 1, [2, 2]), (3, 2, [2, 1, 2]),
                                                         (4, 8, [1, 1, 1, 1])])
def test_ranks_sharing_a_gpu_are_counted_per_gpu(local_size, devices, shares):
    """Each rank's share of its GPU's memory is one over the ranks on that GPU (rank r on GPU r % devices)."""
    assert [ranks_sharing(r, local_size, devices) for r in range(local_size)] == shares


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tp2_on_one_gpu_with_gloo_replays_bit_for_bit(tmp_path):
    """Two ranks sharing one GPU (NCCL refuses that; VD_TP_COLLECTIVES=gloo sums through gloo, without graphs):
    each rank builds its shard on the GPU, the fingerprint is the whole model's (the TP=1 replay is not refused
    as another model), the TP=2 golden replays bit for bit at TP=2 (by default too, summing through gloo as it was
    recorded), and in one process as another build."""
    env = {"VD_TP_COLLECTIVES": "gloo"}
    g = tmp_path / "tp2.zarr"
    args = ["--model", "qwen2.5-0.5b-shape", "--prompt", "Verify.", "--k", "2,4", "--steps", "8", "--allow-thin",
            "--device", "cuda", "--forward", "static"]
    r = _vd("record", g, *args, "--tp", "2", env=env)
    assert r.returncode == 0, r.stderr
    assert open_golden(g).meta["environment"]["collectives"] == "gloo"
    r = _vd("replay", g, "--tp", "2", "--report", tmp_path / "r.json", env=env)
    report = json.loads((tmp_path / "r.json").read_text())
    assert r.returncode == 0 and report["verdict"] == "PASS", r.stdout + r.stderr
    # Without --tp or VD_TP_COLLECTIVES: two ranks summing through gloo, as recorded (NCCL refuses one GPU).
    r = _vd("replay", g)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout + r.stderr
    r = _vd("replay", g, "--tp", "1", "--report", tmp_path / "r1.json")
    report = json.loads((tmp_path / "r1.json").read_text())
    assert r.returncode in (0, 1) and "tp: 2 → 1" in report["environment"]["numerics_differences"], r.stderr


def test_tp2_batch_meets_the_batch_conformance(tmp_path):
    """A TP=2 shard (two CPU processes, gloo) runs batches: rank 0 holds the model to `BatchConformance`'s checks
    (a batch of one is `forward` bit for bit, members of two get their own rows) while rank 1 follows each call."""
    script = tmp_path / "tp_batch.py"
    script.write_text(textwrap.dedent("""
        from vd.models import load_model, tp
        from vd.testing import BatchConformance

        if tp.is_follower():
            tp.follow()
        else:
            m = load_model("tiny-llama-shape")
            try:
                assert list(m.batch_forwards()) == ["static"], m.batch_forwards()
                BatchConformance().test_batch_of_one_is_forward(m)
                BatchConformance().test_members_rows_are_their_own(m)
                print("BATCH OK")
            finally:
                tp.stop()
        tp.finish()
        tp.leave(0)
    """))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        f"--log-dir={tmp_path / 'torchrun'}", str(script)],  # (else torchrun's stay in /tmp)
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "BATCH OK" in r.stdout, r.stdout + r.stderr


def test_a_rank_leaves_as_python_exits_but_without_its_finalization(tmp_path):
    """`tp.leave`: a thread still running is joined, the exit handlers run and the streams are flushed, and the
    exit status is the one asked for; what the interpreter's finalization would collect is never collected (a
    finalizer would print)."""
    script = tmp_path / "leave.py"
    script.write_text(textwrap.dedent("""
        import atexit, sys, threading, time
        from vd.models import tp

        class Cycle:
            def __del__(self):
                print("finalized")
        c = Cycle()
        c.me = c  # a cycle: only a collection, as at finalization, frees it
        del c
        import gc; gc.disable()
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
        atexit.register(lambda: print("handler ran"))
        sys.stdout.write("unflushed ")
        sys.stderr.write("to stderr")
        tp.leave(3)
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert r.stdout.split() == ["unflushed", "thread", "done", "handler", "ran"] and r.stderr == "to stderr", r
