"""A file system that refuses a write (full, over a quota or a file size limit): the one line names what was
refused, exit 2, and nothing already stored changes. The refusal is made with RLIMIT_FSIZE, which needs no
privileges (a write past it fails with EFBIG: Python ignores SIGXFSZ); a full tmpfs, for the writer
processes' arena, where a mount namespace can be made (`unshare`)."""

import json
import os
import resource
import shutil
import subprocess
import sys

import pytest

from vd.store import open_golden


def _vd(*args, limit: int | None = None, **env) -> subprocess.CompletedProcess:
    def limited():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "vd", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **env}, preexec_fn=limited, timeout=300)


def _error(r: subprocess.CompletedProcess) -> str:
    """The error line (progress lines come before it on stderr), and that it is the last line and one line."""
    lines = r.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("vd: error: "), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return lines[-1]


@pytest.mark.parametrize("writers", ["0", "2"])
def test_a_refused_write_names_what_it_was_and_keeps_the_golden(tmp_path, writers):
    g = tmp_path / "g.zarr"
    assert _vd("record", g, "--model", "tiny-llama", "--steps", "4").returncode == 0
    before = open_golden(g).manifest
    r = _vd("record", g, "--refresh", "--model", "tiny-llama", "--steps", "4", limit=4096,
            VD_WRITER_PROCESSES=writers)
    assert r.returncode == 2, r.stderr
    line = _error(r)
    # On threads a row chunk of the staged golden is the first file past the limit; writer processes first
    # make their arena (256 MB), in the temporary folder or /dev/shm.
    named = ".g.zarr.partial-" if writers == "0" else "/vd-arena-"
    assert line.startswith("vd: error: File too large: ") and named in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]  # the staged golden gone with its journal
    assert open_golden(g).manifest == before
    assert _vd("verify", g).returncode == 0


def test_a_replay_whose_temporary_folder_refuses_its_file_names_the_folder(tmp_path, tiny_golden):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    report = tmp_path / "report.json"
    # (a CPU replay keeps its decode rows in an unnamed temporary file: its folder is what the line can name)
    r = _vd("replay", tiny_golden, "--report", report, limit=4096, TMPDIR=str(tmp))
    assert r.returncode == 2, r.stderr
    assert _error(r) == f"vd: error: File too large: {tmp}"
    assert json.loads(report.read_text())["error"] == f"File too large: {tmp}"


def test_an_arena_its_file_system_cannot_hold_is_refused_not_a_fault(tmp_path):
    """A writer processes' arena is a mapped file of 256 MB; where its file system cannot hold it (a small
    /dev/shm, then a small temporary folder), writing the mapping past what fits killed the recording with
    SIGBUS, without a word. Its blocks are taken when it is made, so the same refusal is an `OSError`."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("no mount namespace can be made here (unshare -rm)")
    small = tmp_path / "small"
    small.mkdir()
    code = ("from vd.store.processes import _Arena\n"
            "a = _Arena(1 << 20)\n"
            "a.map[:] = b'x' * (1 << 20)\n")
    # /dev/shm too small for an arena (it must hold four), so it is made in the temporary folder, smaller still
    script = f'mount -t tmpfs -o size=64k tmpfs /dev/shm && mount -t tmpfs -o size=64k tmpfs {small} && exec "$@"'
    r = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", sys.executable, "-c", code],
                       capture_output=True, text=True, env={**os.environ, "TMPDIR": str(small)}, timeout=120)
    if "mount:" in r.stderr:
        pytest.skip(f"no tmpfs can be mounted here: {r.stderr.strip()}")
    assert r.returncode == 1, (r.returncode, r.stderr)  # not -7 (SIGBUS)
    assert f"No space left on device: '{small}/vd-arena-" in r.stderr, r.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full (Linux's device that is always full)")
def test_a_full_device_or_standard_output_is_named(tmp_path, tiny_golden):
    """A report written through a device, or the command's own output on a full disk (``> /dev/full`` stands in
    for it): "No space left on device" named nothing."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "vd", "show", str(tiny_golden)], stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=300)
    assert r.returncode == 2 and r.stderr == "vd: error: No space left on device: standard output\n", r.stderr
    r = _vd("diff", tiny_golden, tiny_golden, "--report", "/dev/full")
    assert r.returncode == 2 and _error(r) == "vd: error: No space left on device: /dev/full", r.stderr


@pytest.mark.parametrize("out", ["copy.zarr", "copy.zip"])
def test_a_pack_refused_a_write_leaves_nothing_beside_its_target(tmp_path, tiny_golden, out):
    """`vd pack` left its staging folder (``.copy.zarr.partial-*``) behind when a write failed."""
    r = _vd("pack", tiny_golden, tmp_path / out, limit=4096)
    assert r.returncode == 2 and _error(r).startswith(f"vd: error: File too large: {tmp_path}/.{out}.partial-")
    assert list(tmp_path.iterdir()) == []


def test_a_suite_goes_on_past_a_golden_the_system_refuses(tmp_path, tiny_golden):
    """A suite replay goes on past a golden that cannot be replayed, an ERROR with its one line: a refused write
    (here each replay's temporary file of decode rows) ended the whole suite instead."""
    import json

    shutil.copytree(tiny_golden, tmp_path / "b.zarr")
    (tmp_path / "vd.toml").write_text(f'[defaults]\nmodel = "tiny-llama"\nsteps = 8\n'
                                      f'[goldens.a]\npath = "{tiny_golden}"\n[goldens.b]\npath = "b.zarr"\n')
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-m", "vd", "replay", "--suite", "--forward", "eager", "--report", "-"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300,
                       env={**os.environ, "TMPDIR": str(tmp)},
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
    assert r.returncode == 2, r.stderr
    report = json.loads(r.stdout)
    assert [(o["name"], o["verdict"], o["error"]) for o in report["goldens"]] == [
        ("a", "ERROR", f"File too large: {tmp}"), ("b", "ERROR", f"File too large: {tmp}")], report
