"""Writer processes (`vd.store.processes`): the golden they write is the one the writer's threads write,
byte for byte, through an arena small enough to wrap and grow; their journal frames are the threads'; a
process that dies or a file the system refuses fails the recording and leaves the old golden."""

import collections
import os

import numpy as np
import pytest
from store_data import PROMPT, k_data, meta, write, write_as_run

import vd.store.processes as P
import vd.store.write as W
from vd.errors import UsageError
from vd.store import GoldenWriter, journal, manifest, open_golden


@pytest.fixture
def pool(monkeypatch):
    monkeypatch.setattr(P, "ARENA_BYTES", 128)  # two steps' rows (64 bytes a copy): the ring wraps every other step
    p = P.WriterPool(2)
    yield p
    p.close()


def _record(where, pool, log_path=None, hand=False):
    """K=3's rows (drafter kinds too) written a step at a time as a run lets them go (``hand``: handed over as
    it logs them, then written whole at its end), with a journal."""
    with GoldenWriter(where, pool=pool) as w:
        if log_path is not None:
            w.journal = journal.Journal(log_path, {"settings": {}, "refresh": False, "reason": "r", "fingerprint": "f",
                                                   "prompt": PROMPT, "greedy": [1]})
        write_as_run(w, hand=hand)
        w.publish(meta((3,), feed="mtp"), PROMPT)
        if w.journal is not None:
            w.journal.close(remove=False)


def test_processes_write_what_threads_write(tmp_path, pool):
    _record(tmp_path / "p.zarr", pool, tmp_path / "p.journal")
    _record(tmp_path / "t.zarr", None, tmp_path / "t.journal")
    a, b = open_golden(tmp_path / "p.zarr"), open_golden(tmp_path / "t.zarr")
    assert a.meta["manifest"] == b.meta["manifest"] and len(a.meta["manifest"]) > 20  # every file, same bytes
    for path in ("p.zarr", "t.zarr"):  # the files the writer knows are the folder's, every one listed and hashed
        assert manifest.build(tmp_path / path) == a.meta["manifest"]
    assert all(np.array_equal(a.verify_rows(3)[kind], b.verify_rows(3)[kind]) for kind in ("prefill", "verify"))
    assert pool.arena is not None and pool.arena.size == 128
    layout, log, rows = k_data(3, steps=3, drafted=True)
    with GoldenWriter(tmp_path / "w.zarr", pool=pool) as w:  # a whole K: 9 verify rows, 144 bytes at once
        w.add(layout, log, rows, drafts=np.zeros((3, 2), np.int32))
        w.publish(meta((3,), feed="mtp"), PROMPT)
    assert pool.arena.size == 256  # the copy did not fit: the arena grew
    assert open_golden(tmp_path / "w.zarr").meta["manifest"] == b.meta["manifest"]

    def blocks(path):
        return sorted((f["k"], -1 if f["s"] is None else f["s"], f["sha256"]) for f in journal.read(path)[1]
                      if "sha256" in f)
    assert blocks(tmp_path / "p.journal") == blocks(tmp_path / "t.journal")
    assert len(blocks(tmp_path / "p.journal")) == 4  # the prefill and three steps
    _record(tmp_path / "h.zarr", pool, tmp_path / "h.journal", hand=True)  # each row handed once, none twice
    assert open_golden(tmp_path / "h.zarr").meta["manifest"] == b.meta["manifest"]
    assert blocks(tmp_path / "h.journal") == blocks(tmp_path / "t.journal")


def test_a_writer_process_that_dies_fails_the_recording(tmp_path, pool):
    path = tmp_path / "g.zarr"
    old = write(path, seed=1)
    pool.workers[1].proc.kill()
    pool.workers[1].proc.wait()
    with pytest.raises(P.WriterError, match=r"a writer process \(pid \d+\) died"):
        layout, log, rows = k_data(2, seed=2)
        with GoldenWriter(path, refresh=True, pool=pool) as w:
            w.add(layout, log, rows)
            w.publish(meta(), PROMPT)
    assert np.array_equal(open_golden(path).verify_rows(2)["verify"], old[2]["verify"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]  # nothing staged left behind


def test_a_file_the_system_refuses_is_an_os_error(tmp_path, pool, monkeypatch):
    staged = []
    real = W.GoldenWriter.rows

    def rows(self, layout, vocab, dtype):  # a file where a row array's folder goes: mkdir fails in the process
        staged.append(self.staged)
        (self.staged / f"k{layout.k}").mkdir(parents=True, exist_ok=True)
        (self.staged / f"k{layout.k}" / "logits.hi").write_bytes(b"in the way")
        return real(self, layout, vocab, dtype)

    monkeypatch.setattr(W.GoldenWriter, "rows", rows)
    with pytest.raises(OSError, match="logits.hi"):
        _record(tmp_path / "g.zarr", pool)
    assert staged and not staged[0].exists() and not (tmp_path / "g.zarr").exists()


def test_how_many_processes_a_recording_uses(monkeypatch):
    monkeypatch.delenv(P.ENV, raising=False)
    assert P.wanted("cpu") == 0 and P.wanted("cuda") == P.DEFAULT >= 1
    monkeypatch.setenv(P.ENV, "3")
    assert P.wanted("cpu") == P.wanted("cuda:0") == 3
    monkeypatch.setenv(P.ENV, "0")
    assert P.wanted("cuda") == 0 and P.pool_for("cuda") is None
    monkeypatch.setenv(P.ENV, "many")
    with pytest.raises(UsageError, match="VD_WRITER_PROCESSES='many'"):
        P.wanted("cuda")


def test_the_writer_process_imports_neither_torch_nor_zarr():
    import subprocess
    import sys

    code = "import sys, vd.chunkfiles; print(sorted(m for m in ('torch', 'zarr', 'vd.store') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(P.Path(P.vd.__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]"


def test_ctrl_c_stops_a_recording_and_its_processes_quietly(tmp_path):
    """SIGINT to the whole process group (Ctrl-C at a terminal) mid-K: exit 130, nothing published, the journal
    kept for ``--resume``, and no traceback from a writer process (they ignore it and end with their input)."""
    import subprocess
    import sys
    from pathlib import Path

    dying = str(Path(__file__).parents[1] / "plugins" / "dying.py") + ":factory"
    env = {**os.environ, "VD_DIE_AT_CALL": "30", "VD_DIE_SIGNAL": "INT", P.ENV: "2"}
    g = tmp_path / "g.zarr"
    r = subprocess.run([sys.executable, "-m", "vd", "record", str(g), "--model", dying, "--k", "2,3", "--steps", "6"],
                       capture_output=True, text=True, env=env, start_new_session=True, timeout=300)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    # one line says so, and how to go on (typer would end the process with 130 and say nothing)
    assert r.stderr.splitlines()[-1] == (f"vd: aborted (Ctrl-C); {g} was not written; its journal "
                                         f"{journal.path_for(g)} keeps the rows computed: vd record {g} --resume "
                                         "continues it"), r.stderr
    assert not g.exists() and journal.path_for(g).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [journal.path_for(g).name]  # no staged copy left


def test_a_drafter_recording_handed_over_step_by_step_is_the_threads_golden(tmp_path, monkeypatch):
    """A real run (the MTP draft head's rows too) hands each step's rows to writer processes as it logs it
    (`KRows.hand`); the golden is the one the writer's threads write, file for file."""
    from vd.recorder import RecordSettings, record

    handed = []
    real = W.KRows.hand
    monkeypatch.setattr(W.KRows, "hand", lambda self, kind, start, rows: (handed.append(kind),
                                                                          real(self, kind, start, rows)))
    settings = RecordSettings(model="tiny-llama-mtp", feed="mtp", steps=6, allow_thin=True)
    monkeypatch.setenv(P.ENV, "0")
    record(tmp_path / "t.zarr", settings)
    assert not handed  # threads: rows are written as the run lets them go
    monkeypatch.setenv(P.ENV, "2")
    record(tmp_path / "p.zarr", settings)
    assert {"prefill", "verify", "draft"} <= set(handed)
    t, p = open_golden(tmp_path / "t.zarr"), open_golden(tmp_path / "p.zarr")
    assert p.manifest == t.manifest and p.content_digest() == t.content_digest()


def test_a_runs_files_are_written_in_the_next_runs_hand_overs(tmp_path, monkeypatch):
    """With writer processes a run's small files (the decode group's, each K's but the last) and each K's
    metadata are the writer's `later` work: the next run's hand-overs do it a unit at a time, in its host
    slack, and what is left when the last K finishes is done then. The golden is the threads' file for file."""
    from vd.recorder import RecordSettings, record

    done: list[str] = []  # the unit each hand-over did ("" where none was left)
    real = W.GoldenWriter.idle

    def idle(self, rows):
        done.append(self._later[0].__qualname__ if self._later else "")
        real(self, rows)

    monkeypatch.setattr(W.GoldenWriter, "idle", idle)
    settings = RecordSettings(model="tiny-llama-mtp", ks=(2, 3), steps=10, allow_thin=True)
    monkeypatch.setenv(P.ENV, "0")
    record(tmp_path / "t.zarr", settings)
    assert not done  # threads: nothing is handed over, nothing left for later
    monkeypatch.setenv(P.ENV, "2")
    record(tmp_path / "p.zarr", settings)
    finished = [i for i, name in enumerate(done) if name.endswith("_finish_units.<locals>.noted")]
    documents = [i for i, name in enumerate(done) if name.endswith("_RowArray.create")]
    # in order: the decode run's documents (its first hand-overs), the decode group's files (the first K's run),
    # K=2's documents, K=2's files (K=3's run, the last; what its hand-overs left is done when it finishes)
    assert done[0].endswith("write_prompt.<locals>.<lambda>")  # written ahead, before the decode run
    # the metadata no run decides and the artifacts, made in the first K run (after the decode group's files)
    assert finished[0] < done.index("_Ahead.make") < documents[2]
    assert len(documents) >= 4 and len(finished) == 2
    assert documents[1] < finished[0] < documents[2] <= documents[3] < finished[1]
    t, p = open_golden(tmp_path / "t.zarr"), open_golden(tmp_path / "p.zarr")
    assert p.manifest == t.manifest and p.content_digest() == t.content_digest()


def test_metadata_written_ahead_is_written_again_for_another_shape(tmp_path, pool, monkeypatch):
    """`KRows.document` writes a K's array metadata while its run steps, at the shapes the layout gives; a small
    array that ends with another shape gets its own metadata (sent once: the last bytes put), and the golden
    reads back as written."""
    import json

    import torch

    from vd.digest import summarise
    from vd.dtypes import to_tensor

    layout, log, rows = k_data(2, steps=3)
    assert W.small_shapes(layout)["tokens"] == (3, 2)
    real = W.small_shapes
    monkeypatch.setattr(W, "small_shapes", lambda lay: {**real(lay), "tokens": (99, 2)})  # a layout gone wrong
    with GoldenWriter(tmp_path / "g.zarr", pool=pool) as w:
        k_rows = w.rows(layout, rows["prefill"].shape[1], torch.bfloat16)
        k_rows.document()  # queued as the writer's later work, a document a unit, done by the run's hand-overs
        assert "k2/tokens/zarr.json" not in w._files
        w.catch_up()
        assert json.loads(w._files["k2/tokens/zarr.json"])["shape"] == [99, 2]
        for kind, a in rows.items():
            k_rows.write(kind, 0, a)
        k_rows.finish(log, summarise({kind: to_tensor(a) for kind, a in rows.items()}))
        w.publish(meta((2,)), PROMPT)
    g = open_golden(tmp_path / "g.zarr")
    assert json.loads((tmp_path / "g.zarr/k2/tokens/zarr.json").read_text())["shape"] == [3, 2]
    assert np.array_equal(g.checked_log(2).tokens, log.tokens)
    assert manifest.build(tmp_path / "g.zarr") == g.meta["manifest"]


def test_a_larger_file_is_written_by_a_process_and_can_be_replaced(tmp_path, pool, monkeypatch):
    """A file of more than `FILE_JOB_BYTES` (a compiled recording's Inductor artifacts) goes through the arena to a
    process; one added again with other bytes replaces it, and the manifest lists the bytes the golden holds, as
    the threads' golden does."""
    monkeypatch.setattr(W, "FILE_JOB_BYTES", 16)
    first, last = bytes(range(200)), bytes(range(100, 0, -1)) * 3

    def golden(where, pool, again):
        with GoldenWriter(where, pool=pool) as w:
            w.add_file("inductor/artifacts.bin", first, manifest.file_digest(first))
            if again:
                w.add_file("inductor/artifacts.bin", last)
            write_as_run(w)
            w.publish(meta((3,), feed="mtp"), PROMPT)
        return open_golden(where)

    once = golden(tmp_path / "once.zarr", pool, again=False)
    assert (tmp_path / "once.zarr/inductor/artifacts.bin").read_bytes() == first
    assert once.meta["manifest"]["inductor/artifacts.bin"] == [200, manifest.file_digest(first)]
    twice = golden(tmp_path / "twice.zarr", pool, again=True)
    assert (tmp_path / "twice.zarr/inductor/artifacts.bin").read_bytes() == last
    assert twice.meta["manifest"] == golden(tmp_path / "threads.zarr", None, again=True).meta["manifest"]
    assert manifest.build(tmp_path / "twice.zarr") == twice.meta["manifest"]


def test_the_ring_waits_for_every_copy_it_overwrites(monkeypatch):
    """The arena's ring, started again at 0 twice while a copy of the first round lies past where the second round
    ended: the copy the second round made at 0 is waited for before the third overwrites it (it was not, and a
    job read another file's bytes: a golden's metadata documents swapped, their manifest hashing the wrong
    bytes)."""
    monkeypatch.setattr(P, "ARENA_BYTES", 1024)
    pool = P.WriterPool(1)
    waited: list[set] = []
    monkeypatch.setattr(pool, "_wait", lambda ids: waited.append(set(ids)) if ids else None)
    try:
        def copy(nbytes, job):
            offset = pool._alloc(nbytes)
            pool.regions[-1][2].append(job)
            return offset

        assert (copy(640, "a"), copy(256, "b")) == (0, 640) and not waited
        assert copy(640, "c") == 0 and waited == [{"a"}]
        assert copy(576, "d") == 0 and waited[1:] == [{"b"}, {"c"}]  # the first round's last copy, then c's
        assert copy(448, "e") == 576 and waited[3:] == []
    finally:
        pool.close()


def test_a_hand_over_on_a_gpu_does_later_work_for_as_long_as_the_step_computes(monkeypatch):
    """On a GPU a hand-over does the writer's `later` work a unit at a time while the step issued after the rows
    it handed still computes, and stops once that step is done (its next read-back would wait); elsewhere it
    does one unit."""
    import torch

    class Stream:  # busy for the first two queries
        def __init__(self):
            self.queries = 0

        def query(self):
            self.queries += 1
            return self.queries > 2

    class Rows:
        is_cuda, device = True, "cuda:0"

    stream = Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    writer = W.GoldenWriter.__new__(W.GoldenWriter)  # (only its queue of later work)
    done: list[int] = []
    writer._later = collections.deque(lambda i=i: done.append(i) for i in range(5))
    writer.idle(Rows())
    assert done == [0, 1] and len(writer._later) == 3  # two units while the step computed, none after
    writer.idle(Rows())
    assert done == [0, 1]  # the step is done: nothing
    writer.idle(torch.zeros(1))  # rows on the CPU: one unit
    assert done == [0, 1, 2]
