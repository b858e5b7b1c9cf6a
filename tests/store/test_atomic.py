"""Crash safety: one writer at a time, a publish that always leaves a whole golden at its path, readers that
keep the version they opened, refreshes through symlinks, and SIGKILL and SIGTERM at any moment of a
refresh (a campaign: a few kills in the default suite, 50 with -m campaign)."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vd.errors import GoldenError
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


def test_sigterm_cleans_up_like_a_failure(tmp_path):
    """What a CI timeout sends, in the middle of a K: the process ends with 143, its staging folder and lock
    removed at once; its journal stays, and `vd record --resume` finishes the golden, leaving nothing."""
    path = tmp_path / "g.zarr"
    slow = Path(__file__).parent.parent / "plugins" / "slow.py"  # 10 ms a forward: a K=2 run of 200 steps, 2 s
    proc = subprocess.Popen([sys.executable, "-m", "vd", "record", str(path), "--model", f"{slow}:factory", "--steps",
                             "200", "--k", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while ".g.zarr.journal" not in _debris(path) and time.time() < deadline:  # until it has written rows
        time.sleep(0.02)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, proc.stderr.read()
    assert _debris(path) == [".g.zarr.journal"] and not path.exists()
    done = subprocess.run([sys.executable, "-m", "vd", "record", str(path), "--resume"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and path.is_dir() and _debris(path) == [], done.stderr
