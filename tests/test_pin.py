"""Goldens pinned by their content (issue 35, item 4): a resealed golden (its manifest and ID made again after an
edit, which anyone can do) passes every check the golden carries itself; what it cannot pass is a content digest
recorded somewhere reviewed (a suite declaration's ``pin``), a row read against its statistics, or ``vd replay
--verify``, which reads every row."""

import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zarr
from golden_edit import edit_meta, edit_rows, restate_content

from vd.store import atomic, open_golden


@pytest.fixture
def declared(tiny_golden, tmp_path):
    """A copy of the session golden declared in a vd.toml beside it, pinned to its content digest."""
    shutil.copytree(tiny_golden, tmp_path / "tiny.zarr")
    pin = open_golden(tmp_path / "tiny.zarr").content_digest()
    (tmp_path / "vd.toml").write_text(f'[goldens.tiny]\npath = "tiny.zarr"\nmodel = "tiny-llama"\nsteps = 8\n'
                                      f'pin = "{pin}"\n')
    return tmp_path, pin


def _bump(rows: np.ndarray) -> None:
    rows[3, 7] ^= 1  # one bit of one verify row


def test_an_edited_and_resealed_golden_is_refused_by_its_pin(declared, cli, monkeypatch):
    where, pin = declared
    monkeypatch.chdir(where)
    code, out, err = cli("replay", "--suite")
    assert code == 0, out + err
    edit_rows(where / "tiny.zarr", 2, "verify", _bump)  # digests, statistics, manifest and ID made again
    assert cli("verify", "tiny.zarr")[0] == 2  # its content digest is no longer what its row digests make
    restate_content(where / "tiny.zarr")  # and that made again too:
    assert cli("verify", "tiny.zarr")[0] == 0  # the golden vouches for itself
    code, out, err = cli("replay", "--suite")
    assert code == 2 and f"is not the one its declaration pins ({pin})" in out + err, out + err
    code, out, err = cli("replay", "tiny.zarr")  # by its path: the declaration found from here still pins it
    assert code == 2 and "is not the one its declaration pins" in err and err.count("\n") == 1, err
    code, out, err = cli("status", "--no-models")  # it said "current", exit 0 (found by a user test)
    assert code == 1 and "tiny: its content digest sha256:" in out and f"is not the one its declaration pins " \
        f"({pin})" in out, out + err


def test_a_replay_by_path_takes_the_pin_from_the_declaration_config_names(declared, cli, monkeypatch):
    """A declaration kept elsewhere (not found from here) pins the golden a replay by path names with --config; a
    --config that cannot be read is refused (exit 2, one line), not taken for no declaration."""
    where, pin = declared
    (where / "ci").mkdir()
    (where / "ci" / "team.toml").write_text((where / "vd.toml").read_text().replace('"tiny.zarr"', '"../tiny.zarr"'))
    (where / "vd.toml").unlink()
    monkeypatch.chdir(where)
    edit_rows(where / "tiny.zarr", 2, "verify", _bump)
    code, out, err = cli("replay", "tiny.zarr", "--k", "2")  # nothing declares it from here: the bumped row differs
    assert code == 1, out + err
    code, out, err = cli("replay", "tiny.zarr", "--k", "2", "--config", "ci/team.toml")
    assert code == 2 and f"is not the one its declaration pins ({pin})" in err and err.count("\n") == 1, err
    code, out, err = cli("replay", "tiny.zarr", "--config", "ci/missing.toml")
    assert code == 2 and "ci/missing.toml" in err and err.count("\n") == 1, err
    # a refresh by path, the declaration named relative to here, writes the new pin into it (paths in a
    # declaration are relative to its own folder, whatever the one --config is named from)
    team = where / "ci" / "team.toml"
    team.write_text(team.read_text().replace(pin, "sha256:" + "0" * 64))
    code, out, err = cli("refresh", "tiny.zarr", "--config", "ci/team.toml", "--reason", "the trusted build again")
    assert code == 0 and f'pin = "{pin}"' in team.read_text(), out + err
    assert cli("replay", "tiny.zarr", "--k", "2", "--config", "ci/team.toml")[0] == 0


def test_a_golden_named_from_outside_its_project_keeps_its_pin(declared, cli, monkeypatch, tmp_path_factory):
    """Named by its path from another folder, a golden is read with its own project's declaration (found from the
    golden's folder): a replay checks its pin, and a refresh writes the new pin there (it wrote none, and every
    replay in the project then refused the refreshed golden as "changed outside a reviewed refresh")."""
    where, pin = declared
    toml, wrong = where / "vd.toml", "sha256:" + "0" * 64
    toml.write_text(toml.read_text().replace(pin, wrong))
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    code, out, err = cli("replay", str(where / "tiny.zarr"), "--k", "2")
    assert code == 2 and f"is not the one its declaration pins ({wrong})" in err and err.count("\n") == 1, err
    code, out, err = cli("refresh", str(where / "tiny.zarr"), "--reason", "the trusted build again")
    assert code == 0 and f'pin = "{pin}"' in toml.read_text() and f"pin of tiny in {toml}" in out, out + err
    monkeypatch.chdir(where)
    assert cli("replay", "--suite")[0] == 0


def test_a_first_recording_named_from_outside_its_project_takes_its_declaration(tmp_path, cli, monkeypatch,
                                                                                 tmp_path_factory):
    """`vd record sub/zeta.zarr` from a folder above a declaration in sub/ recorded the default model and settings
    (SmolLM2, 64 steps, about three minutes) where the same command run in sub/ records zeta as declared (a user
    test): a golden not recorded yet is looked up in the declaration found from its folder, as one on disk is."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "vd.toml").write_text('[goldens.zeta]\npath = "zeta.zarr"\nmodel = "tiny-llama"\n'
                                              'k = [2]\nsteps = 4\n')
    monkeypatch.chdir(tmp_path)
    code, out, err = cli("record", "sub/zeta.zarr")
    assert code == 0 and f"recording zeta as {tmp_path / 'sub' / 'vd.toml'} declares it" in out, out + err
    g = open_golden(tmp_path / "sub" / "zeta.zarr")
    assert g.ks == [2] and g.info.steps == 4 and g.meta["model"]["spec"] == "tiny-llama"


def test_a_refresh_cut_short_in_its_publish_leaves_no_golden_its_pin_refuses(declared, cli, monkeypatch):
    """A suite refresh published by renames (`VD_PUBLISH_FALLBACK`) and interrupted (Ctrl-C) with the path empty:
    `vd status` said missing (no reader had put the new version in place), and once one did, every replay refused
    it, its pin the old one (found by a user test). The interrupted command writes the new pin all the same, and
    status puts the version in place as a reader does."""
    where, pin = declared
    monkeypatch.chdir(where)
    toml = where / "vd.toml"
    toml.write_text(toml.read_text().replace("steps = 8", "steps = 7"))
    env = {**os.environ, atomic.FALLBACK: "1", atomic.PAUSE: "3"}
    proc = subprocess.Popen([sys.executable, "-m", "vd", "record", "--suite", "--refresh", "--reason", "seven"],
                            cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while (where / "tiny.zarr").exists() or not list(where.glob(".tiny.zarr.next-*")):  # the path empty
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "aborted (Ctrl-C)" in err, err
    code, out, err = cli("status", "--no-models")
    assert code == 0 and "missing" not in out and "current" in out, out + err
    assert pin not in toml.read_text() and cli("replay", "--suite")[0] == 0


def test_shard_without_suite_is_refused(tiny_golden, cli):
    code, out, err = cli("replay", tiny_golden, "--shard", "1/2")
    assert code == 2 and "--shard 1/2" in err and "--suite" in err and err.count("\n") == 1, err


def test_a_refresh_updates_the_pin_in_the_declaration(declared, cli, monkeypatch):
    where, pin = declared
    monkeypatch.chdir(where)
    toml = where / "vd.toml"
    wrong = "sha256:" + "0" * 64
    toml.write_text(toml.read_text().replace(pin, wrong))
    code, out, err = cli("replay", "--suite")
    assert code == 2 and "pins" in out + err
    code, out, err = cli("refresh", "tiny", "--reason", "accept the golden as it is")
    assert code == 0, out + err
    assert f'pin = "{pin}"' in toml.read_text() and f"pin of tiny in {toml}" in out
    assert cli("replay", "--suite")[0] == 0


def test_a_bad_pin_is_refused_at_declaration(declared, cli, monkeypatch):
    where, _ = declared
    monkeypatch.chdir(where)
    (where / "vd.toml").write_text('[goldens.tiny]\npath = "tiny.zarr"\npin = "md5:abc"\n')
    code, out, err = cli("replay", "--suite")
    assert code == 2 and "key 'pin'" in err and 'a content digest, "sha256:"' in err, err


def test_statistics_edited_to_hide_a_flip_are_refused_where_rows_are_read(tiny_copy, cli):
    """The stored argmax of a verify row changed (as an edit hiding a flip would) and the golden resealed: a
    replay that reads that row (another forward: every row differs) refuses it, naming the statistics."""
    g = open_golden(tiny_copy)
    at = len(g.prompt)  # the first verify row
    g.close()
    root = zarr.open_group(zarr.storage.LocalStore(tiny_copy), mode="r+")
    stats = root["k2/stats"][...]
    stats[at, 0] = (stats[at, 0] + 1) % 100
    root["k2/stats"][...] = stats
    edit_meta(tiny_copy, lambda m: None)  # resealed
    code, out, err = cli("replay", tiny_copy, "--forward", "sdpa", "--k", "2")
    assert code == 2 and "k2/stats: 1 row(s) disagree with the stored rows (first: verify row 0)" in err, out + err


def test_replay_verify_reads_every_row(tiny_copy, cli):
    """A row edited behind its digest and the golden resealed: the replay's forward reproduces the digest, so a
    replay reads no row and passes; --verify reads them all and refuses the golden."""
    edit_rows(tiny_copy, 3, "verify", _bump, digests=False)
    assert cli("replay", tiny_copy, "--k", "3")[0] == 0
    code, out, err = cli("replay", tiny_copy, "--k", "3", "--verify")
    assert code == 2 and "k3/digests: 1 row(s) disagree with the stored rows (first: verify row 3)" in err, err
