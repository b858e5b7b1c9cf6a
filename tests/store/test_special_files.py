"""A golden whose files are not regular files (a FIFO, a link to ``/dev/zero``) or whose run group carries a
setting is refused in one line (exit 2) by ``vd verify`` and ``vd replay``, never hangs, never a traceback
(issue 35, items 5 and 6)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent.parent / "data" / "tiny-llama-v6.zarr"
CHUNK = "k2/logits.lo/c/0/0/0/0"


def _vd(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vd", *map(str, args)], capture_output=True, text=True, timeout=60)


def _refused(r: subprocess.CompletedProcess, names: str) -> None:
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("vd: error: ") and names in r.stderr, r.stderr


def _golden(tmp_path: Path) -> Path:
    g = tmp_path / "g.zarr"
    shutil.copytree(DATA, g)
    assert (g / CHUNK).is_file()
    return g


@pytest.mark.parametrize("key", ["zarr.json", "run/zarr.json", CHUNK])
@pytest.mark.parametrize("command", ["verify", "replay"])
def test_a_fifo_in_a_golden_is_refused_not_waited_on(tmp_path, key, command):
    g = _golden(tmp_path)
    (g / key).unlink()
    os.mkfifo(g / key)
    _refused(_vd(command, g), f"{key} is a FIFO")


@pytest.mark.parametrize("key", ["zarr.json", CHUNK])
@pytest.mark.parametrize("command", ["verify", "replay"])
def test_a_link_to_dev_zero_is_refused(tmp_path, key, command):
    g = _golden(tmp_path)
    (g / key).unlink()
    (g / key).symlink_to("/dev/zero")
    _refused(_vd(command, g), f"{key} is a symbolic link to /dev/zero")


@pytest.mark.parametrize("command", ["verify", "replay", "show"])
def test_a_dangling_link_a_folder_for_a_file_and_a_file_for_a_folder_are_named(tmp_path, command):
    """Each named with the golden's path and what is there: a dangling link said only "No such file or directory:
    0", and a folder where a file goes (or a file where a folder goes) "is missing"."""
    g = _golden(tmp_path)
    (g / CHUNK).unlink()
    (g / CHUNK).symlink_to("nowhere")
    _refused(_vd(command, g), f"{g}/{CHUNK} is a symbolic link to nowhere, which does not exist")
    (g / CHUNK).unlink()
    (g / CHUNK).symlink_to("0")  # itself: a loop (said "Too many levels of symbolic links: 0", no golden named)
    _refused(_vd(command, g), f"{g}/{CHUNK} is a symbolic link to 0, which cannot be read: Too many levels of "
                              "symbolic links")
    (g / CHUNK).unlink()
    (g / CHUNK).mkdir()
    _refused(_vd(command, g), f"{g}/{CHUNK} is a directory, not the file the manifest lists")
    folder = (g / CHUNK).parent
    shutil.rmtree(folder)
    folder.write_bytes(b"")
    _refused(_vd(command, g), f"{g}/{CHUNK} is missing: {folder} is a file, not a folder")


def test_a_fifo_named_as_a_zip_golden_is_refused(tmp_path):
    os.mkfifo(tmp_path / "g.zip")
    _refused(_vd("verify", tmp_path / "g.zip"), "g.zip is a FIFO")


def test_a_link_inside_the_golden_to_its_own_file_reads(tmp_path):
    g = _golden(tmp_path)
    (g / "copy").write_bytes((g / CHUNK).read_bytes())
    (g / CHUNK).unlink()
    (g / CHUNK).symlink_to(g / "copy")
    r = _vd("verify", g)  # the link itself is fine; the file it adds is not in the manifest
    _refused(r, "copy is not in the golden's manifest")


@pytest.mark.parametrize("threads", ["4", 2.5, -1, 4])
@pytest.mark.parametrize("command", ["verify", "replay"])
def test_threads_in_the_run_group_are_refused(tmp_path, threads, command):
    g = _golden(tmp_path)
    path = g / "run" / "zarr.json"
    doc = json.loads(path.read_text())
    doc["attributes"]["vd_run"]["environment"]["threads"] = threads
    path.write_text(json.dumps(doc))
    _refused(_vd(command, g), "'environment.threads'")


@pytest.mark.parametrize("field, value", [("created", 5), ("step_ms", {"2": ["x"]}), ("environment", [1]),
                                          ("model_source", {"a": 1})])
def test_wrong_typed_run_facts_are_refused(tmp_path, field, value):
    g = _golden(tmp_path)
    path = g / "run" / "zarr.json"
    doc = json.loads(path.read_text())
    doc["attributes"]["vd_run"][field] = value
    path.write_text(json.dumps(doc))
    _refused(_vd("verify", g), f"'{field}'")
