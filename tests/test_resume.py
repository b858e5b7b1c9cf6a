"""`vd record --resume`: a recording killed mid-K continues from its journal and writes the golden an
uninterrupted run writes (equal content digest, every file but the run's volatile facts equal); a journal
that disagrees with what the model computes again refuses the resume."""

import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from vd.store import journal, open_golden

DYING = str(Path(__file__).parent / "plugins" / "dying.py") + ":factory"
ARGS = ["--model", DYING, "--k", "2,3", "--steps", "6"]


def _vd(*args, die_at: int | None = None, writers: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VD_DIE_AT_CALL"}
    if die_at is not None:
        env["VD_DIE_AT_CALL"] = str(die_at)
    env["VD_WRITER_PROCESSES"] = writers  # "": as the device wants (threads on this CPU)
    return subprocess.run([sys.executable, "-m", "vd", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.mark.parametrize("writers", ["", "2"])
def test_a_recording_killed_mid_k_resumes_to_the_uninterrupted_golden(tmp_path, writers):
    # Calls: the greedy decode (1 + 18), K=2 (1 + 6), then K=3: call 30 is its third verify step. Writer
    # processes ("2") finish and journal what they were given after the recording dies.
    g = tmp_path / "g.zarr"
    assert _vd("record", g, *ARGS, die_at=30, writers=writers).returncode == -9
    assert not g.exists() and journal.path_for(g).is_file()
    header, frames = journal.read(journal.path_for(g))
    # K=2's blocks (its prefill and 6 steps) were written and journaled. K=3's rows were still held by its run;
    # with writer processes its prefill and first step had been handed to them as its second step was issued.
    blocks = {(f["k"], f["s"]) for f in frames if "sha256" in f}
    assert header["settings"]["ks"] == [2, 3] and {k for k, _ in blocks} == ({2, 3} if writers else {2})
    assert {s for k, s in blocks if k == 3} == ({None, 0} if writers else set())
    r = _vd("record", g, "--resume", writers=writers)
    assert r.returncode == 0, r.stderr
    assert f"resumed: {len(blocks)} journaled blocks computed again and equal" in r.stdout, r.stdout
    assert len(blocks) == (9 if writers else 7)
    assert not journal.path_for(g).exists()
    whole = tmp_path / "whole.zarr"
    assert _vd("record", whole, *ARGS).returncode == 0
    assert open_golden(g).content_digest() == open_golden(whole).content_digest()
    assert open_golden(g).manifest == open_golden(whole).manifest  # every file the same bytes


def test_a_journal_the_model_does_not_compute_again_refuses_the_resume(tmp_path):
    g = tmp_path / "g.zarr"
    assert _vd("record", g, *ARGS, die_at=30).returncode == -9
    path = journal.path_for(g)
    header, frames = journal.read(path)
    b = next(i for i, f in enumerate(frames) if "sha256" in f)  # (writer processes append blocks out of order)
    frames[b]["sha256"] = "0" * 64  # a block the model will not compute
    path.write_bytes(b"".join(msgpack.packb(f, use_bin_type=True) for f in [header, *frames]))
    r = _vd("record", g, "--resume")
    assert r.returncode == 2 and "differs from its journal at K=2" in r.stderr and not g.exists()
    assert not path.exists()  # the refused resume's own journal goes with it: record afresh, as the line says
    # A journal of an earlier vd (row digests where the SHA-256 now is) is refused, not trusted unchecked.
    frames[b] = {"k": frames[b]["k"], "s": frames[b]["s"], "digests": [[1, 2]]}
    path.write_bytes(b"".join(msgpack.packb(f, use_bin_type=True) for f in [header, *frames]))
    r = _vd("record", g, "--resume")
    assert r.returncode == 2 and "written by an earlier vd" in r.stderr and not g.exists()
    assert _vd("record", tmp_path / "none.zarr", "--resume").returncode == 2


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A recording killed mid-K: its journal's header and frames."""
    g = tmp_path_factory.mktemp("killed") / "g.zarr"
    assert _vd("record", g, *ARGS, die_at=30).returncode == -9
    return journal.read(journal.path_for(g))


def _flip(data: bytes) -> bytes:
    return bytes(b ^ 0xFF if i in (3, 9, 40) else b for i, b in enumerate(data))


# How a journal is damaged: (header, frames) -> its bytes.
_DAMAGE = {
    "flipped bytes": lambda h, f: _flip(_pack(h, f)),
    "no settings": lambda h, f: _pack({k: v for k, v in h.items() if k != "settings"}, f),
    "settings a list": lambda h, f: _pack({**h, "settings": [1]}, f),
    "ks a string": lambda h, f: _pack({**h, "settings": {**h["settings"], "ks": "2,3"}}, f),
    "steps a string": lambda h, f: _pack({**h, "settings": {**h["settings"], "steps": "6"}}, f),
    "threads a float": lambda h, f: _pack({**h, "settings": {**h["settings"], "threads": 2.5}}, f),
    "unknown setting": lambda h, f: _pack({**h, "settings": {**h["settings"], "nope": 1}}, f),
    "refresh a string": lambda h, f: _pack({**h, "refresh": "yes"}, f),
    "fingerprint a number": lambda h, f: _pack({**h, "fingerprint": 7}, f),
    "greedy a map": lambda h, f: _pack({**h, "greedy": {"a": 1}}, f),
    "block k a list": lambda h, f: _pack(h, [{**f[0], "k": [2]}, *f[1:]]),
    "not msgpack": lambda h, f: b"\xc1" * 16,
}


def _pack(header, frames) -> bytes:
    return b"".join(msgpack.packb(f, use_bin_type=True) for f in [header, *frames])


@pytest.mark.parametrize("how", list(_DAMAGE))
def test_a_damaged_journal_is_refused_in_one_line(tmp_path, killed, how):
    g = tmp_path / "g.zarr"
    path = journal.path_for(g)
    path.write_bytes(_DAMAGE[how](*killed))
    r = _vd("record", g, "--resume")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(path) in r.stderr and "without --resume" in r.stderr, r.stderr


def test_a_fifo_as_the_journal_is_refused(tmp_path):
    g = tmp_path / "g.zarr"
    os.mkfifo(journal.path_for(g))
    r = _vd("record", g, "--resume")
    assert r.returncode == 2 and "is a FIFO" in r.stderr and "without --resume" in r.stderr, r.stderr


def test_a_recording_started_afresh_beside_a_journal_says_it_replaces_it(tmp_path):
    """A plain `vd record` (or `vd record --suite`: it said nothing) where a cut-short recording left its journal
    starts afresh (as the README says) but not silently: a note names the journal and --resume (the path quoted:
    pasted as printed, a path with a space was three arguments), and the golden is recorded."""
    g = tmp_path / "p q" / "g.zarr"
    g.parent.mkdir()
    assert _vd("record", g, *ARGS, die_at=30).returncode == -9
    r = _vd("record", g, *ARGS)
    assert r.returncode == 0, r.stderr
    assert (f"vd: note: {journal.path_for(g)} keeps the rows of a recording of {g} that was cut short; this one "
            f"starts afresh and replaces it (vd record '{g}' --resume continues that one instead)") in r.stderr
    assert open_golden(g).ks == [2, 3] and not journal.path_for(g).exists()
    toml = tmp_path / "vd.toml"
    toml.write_text(f'[goldens.s]\npath = "s.zarr"\nmodel = "{DYING}"\nk = [2, 3]\nsteps = 6\n')
    assert _vd("record", tmp_path / "s.zarr", *ARGS, die_at=30).returncode == -9
    r = _vd("record", "--suite", "--config", toml)
    assert r.returncode == 0 and f"vd: note: {journal.path_for(tmp_path / 's.zarr')} keeps the rows" in r.stderr, \
        r.stdout + r.stderr
    r = _vd("record", tmp_path / "other.zarr", *ARGS)
    assert r.returncode == 0 and "note" not in r.stderr


def test_resume_takes_no_other_settings_and_says_why_it_cannot_replace_a_golden(tmp_path, killed, cli):
    """`--resume --model X --steps 5` continued the journal's recording and dropped the flags without a word; and a
    journal beside a golden recorded since said 'pass --refresh', which --resume then also ignored. Both are one
    line, exit 2, the journal kept."""
    g = tmp_path / "g.zarr"
    path = journal.path_for(g)
    path.write_bytes(_pack(*killed))
    code, out, err = cli("record", g, "--resume", "--model", "tiny-qwen2", "--steps", "5")
    assert code == 2 and "--model, --steps cannot change them" in err and path.is_file(), err
    assert cli("record", g, "--model", "tiny-llama", "--k", "2", "--steps", "4", "--allow-thin")[0] == 0
    path.write_bytes(_pack(*killed))  # (the recording afresh replaced the journal)
    code, out, err = cli("record", g, "--resume")
    assert code == 2 and "holds a golden now" in err and "pass --refresh" not in err and path.is_file(), err
    code, out, err = cli("record", g, "--resume", "--refresh")
    assert code == 2 and "--refresh cannot change them" in err, err
