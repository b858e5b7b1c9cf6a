"""Crash safety: one writer at a time, a publish that always leaves a whole golden at its path, readers that
keep the version they opened, refreshes through symlinks, and SIGKILL and SIGTERM at any moment of a
refresh (a campaign: a few kills in the default suite, 50 with -m campaign)."""

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vd.errors import GoldenBusyError, GoldenError
from vd.models import load_model
from vd.recorder import RecordSettings, record
from vd.store import atomic, locate, open_golden

TINY = RecordSettings(model="tiny-llama", steps=4, ks=(2,))
QWEN = RecordSettings(model="tiny-qwen2", steps=4, ks=(2,))


@pytest.fixture(scope="module")
def models():
    return {"tiny-llama": load_model("tiny-llama"), "tiny-qwen2": load_model("tiny-qwen2")}


def _debris(path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def test_a_second_writer_is_refused_at_once(tmp_path, models, cli):
    path = tmp_path / "g.zarr"
    with locate(path).writer():
        with pytest.raises(GoldenError, match="being written by another vd process"):
            record(path, TINY, model=models["tiny-llama"])
        code, out, err = cli("record", path, "--model", "tiny-llama", "--steps", "4", "--k", "2")
        assert code == 2 and "being written by another vd process" in err and err.count("\n") == 1
    assert not path.exists() and _debris(path) == []
    assert record(path, TINY, model=models["tiny-llama"]).location is not None  # the lock went with its holder


def test_a_writer_can_be_waited_for(tmp_path):
    """`wait_writer` (pytest workers updating one golden wait for each other): true at once where none writes,
    false when the time runs out, true once the writer lets go."""
    path = tmp_path / "g.zarr"
    assert locate(path).wait_writer(0)
    held, release = threading.Event(), threading.Event()

    def write():
        with locate(path).writer():
            held.set()
            release.wait(30)

    writer = threading.Thread(target=write)
    writer.start()
    assert held.wait(30)
    with pytest.raises(GoldenBusyError):
        with locate(path).writer():
            pass
    assert not locate(path).wait_writer(0.3)
    threading.Timer(0.3, release.set).start()
    t = time.monotonic()
    assert locate(path).wait_writer(30) and time.monotonic() - t >= 0.25
    writer.join(30)


def test_a_reader_keeps_the_version_it_opened_across_a_refresh(tmp_path, models):
    path = tmp_path / "g.zarr"
    record(path, TINY, model=models["tiny-llama"])
    reader = open_golden(path)
    before = reader.content_digest()
    record(path, QWEN, model=models["tiny-qwen2"], refresh=True)  # lands while the reader is open
    reader.check_files()  # every file of the version it opened, intact and unchanged
    assert reader.content_digest() == before and reader.meta["model"]["spec"] == "tiny-llama"
    assert reader.verify_rows(2)["verify"].shape[0] == 8
    assert open_golden(path).meta["model"]["spec"] == "tiny-qwen2"  # a new open sees the new version
    assert [d.split("-")[0] for d in _debris(path)] == [".g.zarr.replaced"]  # kept while held
    reader.close()
    with atomic.writer_lock(path):  # the next writer removes what no reader holds
        pass
    assert _debris(path) == []


def test_a_refresh_through_a_symlink_replaces_the_golden_it_names(tmp_path, models):
    real = tmp_path / "store" / "g.zarr"
    record(real, TINY, model=models["tiny-llama"])
    link = tmp_path / "g.zarr"
    link.symlink_to(real)
    record(link, QWEN, model=models["tiny-qwen2"], refresh=True)
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert open_golden(real).meta["model"]["spec"] == "tiny-qwen2"


def _refresh_cmd(path) -> list[str]:
    return [sys.executable, "-m", "vd", "record", str(path), "--refresh", "--model", "tiny-llama", "--steps", "6",
            "--k", "2,3", "--reason", "campaign"]


def _kill_campaign(tmp_path, trials: int, sig: int) -> list[int]:
    """Refreshes of one golden killed with ``sig`` at random moments over a whole refresh, the publish
    included; after each, a golden that verifies is at the path, and the next writer leaves no debris."""
    path = tmp_path / "g.zarr"
    assert subprocess.run(_refresh_cmd(path), capture_output=True).returncode == 0
    t = time.perf_counter()
    assert subprocess.run(_refresh_cmd(path), capture_output=True).returncode == 0
    whole = time.perf_counter() - t
    rng, codes = random.Random(17), []
    for _ in range(trials):
        proc = subprocess.Popen(_refresh_cmd(path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, whole * 1.1))
        proc.send_signal(sig)
        codes.append(proc.wait(timeout=120))
        g = open_golden(path)
        g.check_files()  # whole: old or new, never a mix or nothing
        g.close()
        with atomic.writer_lock(path):
            pass
        assert _debris(path) == [], _debris(path)
    return codes


def test_sigkill_at_random_moments_never_loses_the_golden(tmp_path):
    codes = _kill_campaign(tmp_path, 4, signal.SIGKILL)
    assert all(c in (0, -signal.SIGKILL) for c in codes)


@pytest.mark.campaign
def test_sigkill_campaign(tmp_path):
    codes = _kill_campaign(tmp_path, 50, signal.SIGKILL)
    assert codes.count(-signal.SIGKILL) >= 40  # most trials killed mid-refresh


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_cleans_up_like_a_failure(tmp_path, sig):
    """What a CI timeout sends (SIGTERM), or a closed terminal (SIGHUP), in the middle of a K: the process ends with
    128 + the signal, its staging folder and lock removed at once; its journal stays, and `vd record --resume`
    finishes the golden, leaving nothing."""
    path = tmp_path / "g.zarr"
    slow = Path(__file__).parent.parent / "plugins" / "slow.py"  # 10 ms a forward: a K=2 run of 200 steps, 2 s
    proc = subprocess.Popen([sys.executable, "-m", "vd", "record", str(path), "--model", f"{slow}:factory", "--steps",
                             "200", "--k", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while ".g.zarr.journal" not in _debris(path) and time.time() < deadline:  # until it has written rows
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 128 + sig, proc.stderr.read()
    said = proc.stderr.read().splitlines()[-1]
    assert said.startswith(f"vd: terminated by {sig.name}; {path} was not written; its journal ") and \
        said.endswith(f"vd record {path} --resume continues it"), said
    assert _debris(path) == [".g.zarr.journal"] and not path.exists()
    done = subprocess.run([sys.executable, "-m", "vd", "record", str(path), "--resume"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and path.is_dir() and _debris(path) == [], done.stderr


def _wait_for(proc, path, state: str, timeout: float = 120) -> bool:
    """Poll until a fallback publish of ``path`` is in ``state``: ``next`` (its new version at ``.g.zarr.next-*``,
    the old golden still at the path) or ``empty`` (the old golden moved away, the path empty)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        nxt = any(d.startswith(".g.zarr.next-") for d in _debris(path))
        if nxt and (path.exists() if state == "next" else not path.exists()):
            return True
        time.sleep(0.01)
    return False


def _fallback_campaign(tmp_path, per_state: int, random_kills: int, cli) -> dict[str, int]:
    """Refreshes published by renames (`VD_PUBLISH_FALLBACK`), SIGKILLed in each state of the publish (paused
    there, `VD_PUBLISH_PAUSE`) and at random moments; after each, the golden is recovered by the next reader
    (``vd verify``, or opening it) or writer (the next refresh) and verifies, and no debris is left."""
    path = tmp_path / "g.zarr"
    assert subprocess.run(_refresh_cmd(path), capture_output=True).returncode == 0
    rng, counts = random.Random(23), {"next": 0, "empty": 0, "random": 0}
    plan = [s for s in ("next", "empty") for _ in range(per_state)] + ["random"] * random_kills
    for i, state in enumerate(plan):
        env = {**os.environ, atomic.FALLBACK: "1", **({atomic.PAUSE: "0.5"} if state != "random" else {})}
        proc = subprocess.Popen(_refresh_cmd(path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        if state == "random":
            time.sleep(rng.uniform(0.3, 4.0))
        else:
            assert _wait_for(proc, path, state), f"never reached {state}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
        counts[state] += 1
        how = i % 3
        if how == 0:  # the next reader, through the command line
            code, out, err = cli("verify", path)
            assert code == 0, (state, out, err)
        elif how == 1:  # the next reader, through the API
            g = open_golden(path)
            g.check_files()
            g.close()
        else:  # the next writer: a refresh that completes
            assert subprocess.run(_refresh_cmd(path), capture_output=True, env=env | {atomic.PAUSE: ""}).returncode == 0
        g = open_golden(path)
        g.check_files()
        g.close()
        with atomic.writer_lock(path):
            pass
        assert _debris(path) == [], (state, _debris(path))
    return counts


def test_a_fallback_publish_killed_in_each_state_loses_nothing(tmp_path, cli):
    assert _fallback_campaign(tmp_path, 2, 1, cli) == {"next": 2, "empty": 2, "random": 1}


@pytest.mark.campaign
def test_fallback_publish_sigkill_campaign(tmp_path, cli):
    counts = _fallback_campaign(tmp_path, 20, 10, cli)
    assert sum(counts.values()) >= 50


def test_recover_installs_the_version_a_dead_publish_left():
    """The states of the fallback publish, made by hand: a `.next-*` beside an empty path is installed (by the
    first of two recoverers); beside a golden, it is a publish that died before the old version moved, and the
    next writer removes it."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        target = Path(d) / "g.zarr"
        nxt = Path(d) / ".g.zarr.next-1234abcd"
        nxt.mkdir()
        (nxt / "zarr.json").write_text("{}")
        assert atomic.recover(target) and (target / "zarr.json").exists() and not nxt.exists()
        assert not atomic.recover(target)  # nothing to do: a golden is at the path
        nxt.mkdir()
        with atomic.writer_lock(target):
            pass
        assert not nxt.exists() and (target / "zarr.json").exists()
