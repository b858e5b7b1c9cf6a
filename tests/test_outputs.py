"""No output of any command lands in or on a golden, not only the one being read (a report, a candidate, a new
golden, a slim copy, a status file), and an output file is written without following a link at its path."""

import os
import shutil

import pytest


@pytest.fixture
def other(tiny_golden, tmp_path):
    """Golden B: a copy of the session golden, which the commands below must leave as it is."""
    dst = tmp_path / "b.zarr"
    shutil.copytree(tiny_golden, dst)
    return dst


def _refused(cli, golden, *args):
    """The command exits 2 in one line naming ``golden``, which still verifies."""
    code, out, err = cli(*args)
    assert code == 2 and err.count("\n") == 1 and err.startswith("vd: error: "), (code, out, err)
    assert str(golden) in err, err
    code, out, verified = cli("verify", golden)
    assert code == 0, verified
    return err


def test_a_report_over_another_goldens_root_file_is_refused(cli, tiny_golden, other):
    err = _refused(cli, other, "replay", tiny_golden, "--report", other / "zarr.json")
    assert "inside the golden" in err


def test_a_report_over_a_zip_golden_is_refused(cli, tiny_golden, tmp_path):
    packed = tmp_path / "b.zip"
    code, out, err = cli("pack", tiny_golden, packed)
    assert code == 0, err
    before = packed.read_bytes()
    err = _refused(cli, packed, "replay", tiny_golden, "--report", packed)
    assert "is the golden" in err and packed.read_bytes() == before


def test_a_candidate_over_another_golden_is_refused(cli, tiny_golden, other):
    _refused(cli, other, "replay", tiny_golden, "--save-candidate", other)


def test_a_new_golden_inside_another_is_refused(cli, other):
    _refused(cli, other, "record", other / "inner.zarr", "--model", "tiny-llama", "--steps", "2")
    assert not (other / "inner.zarr").exists()


def test_a_slim_copy_inside_another_golden_is_refused(cli, tiny_golden, other):
    _refused(cli, other, "slim", tiny_golden, other / "slim.zarr")
    assert not (other / "slim.zarr").exists()


def test_status_json_over_a_declared_goldens_root_file_is_refused(cli, tiny_golden, tmp_path, monkeypatch):
    shutil.copytree(tiny_golden, tmp_path / "goldens" / "g.zarr")
    (tmp_path / "vd.toml").write_text('[goldens.g]\npath = "goldens/g.zarr"\nmodel = "tiny-llama"\n')
    monkeypatch.chdir(tmp_path)
    _refused(cli, "goldens/g.zarr", "status", "--no-models", "--json", "goldens/g.zarr/zarr.json")


def test_a_link_at_the_report_path_is_replaced_not_followed(cli, tiny_golden, other, tmp_path):
    """A link planted at the report's path, into golden B: the report replaces the link; B is untouched."""
    link = tmp_path / "report.json"
    os.symlink(other / "zarr.json", link)
    before = (other / "zarr.json").read_bytes()
    code, out, err = cli("replay", tiny_golden, "--report", link, "--k", "2")
    assert code == 0, err
    assert not link.is_symlink() and '"verdict": "PASS"' in link.read_text()
    assert (other / "zarr.json").read_bytes() == before
    code, out, err = cli("verify", other)
    assert code == 0, err


def test_a_file_that_cannot_be_made_is_named_as_given():
    """The error names the path asked for, not the temporary file written first."""
    from vd.outputs import write_text

    with pytest.raises(OSError, match=r"cannot write /proc/vd-report\.json: ") as e:
        write_text("/proc/vd-report.json", "{}")
    assert ".tmp" not in str(e.value)
