"""A zip golden's member names, checked once when it is opened: a member repeated (a later copy, which a
reader would take, shadowing the one the manifest hashed) or named outside the golden (``../x``, ``/abs``)
is refused, by the command line's first look (`vd.preflight`) and by the store itself; and a manifest that
lists such a name is refused as well; and bytes outside the archive vd wrote."""

import json
import warnings
import zipfile
from pathlib import Path

import pytest
from refusal import refused

from vd.errors import GoldenCorruptError
from vd.store import open_golden


@pytest.fixture
def packed(cli, tiny_golden, tmp_path) -> Path:
    path = tmp_path / "g.zip"
    assert cli("pack", tiny_golden, path)[0] == 0
    return path


def _append(path: Path, name: str, data: bytes) -> None:
    with warnings.catch_warnings(), zipfile.ZipFile(path, "a") as z:
        warnings.simplefilter("ignore")  # zipfile warns of a duplicate name, and writes it
        z.writestr(name, data)


def _stats_key(path: Path) -> str:
    with zipfile.ZipFile(path) as z:
        return next(n for n in z.namelist() if n.startswith("k2/stats/c"))


@pytest.mark.parametrize("member", ["zarr.json", "stats"])
def test_a_duplicate_member_is_refused_by_verify_and_replay(cli, packed, member):
    assert cli("verify", packed)[0] == 0
    with zipfile.ZipFile(packed) as z:
        name = "zarr.json" if member == "zarr.json" else _stats_key(packed)
        forged = z.read(name)
    if member == "zarr.json":  # the same metadata, but for one field nothing hashes
        doc = json.loads(forged)
        doc["attributes"]["forged"] = True
        forged = json.dumps(doc).encode()
    _append(packed, name, forged)
    refused(cli("verify", packed), "two members", repr(name))
    refused(cli("replay", packed, "--model", "tiny-llama"), "two members", repr(name))
    with pytest.raises(GoldenCorruptError, match="two members"):
        open_golden(packed)  # the store's own check, without the command line's first look


@pytest.mark.parametrize("where", ["before", "after"])
def test_bytes_outside_the_archive_are_refused(cli, packed, where, tmp_path):
    """Another zip cat'ed in front, or anything appended: its members and manifest still checked, so `vd verify`
    said "intact" of a file that is not the one vd wrote (a user test)."""
    data = packed.read_bytes()
    packed.write_bytes(data + data if where == "before" else data + b"junk\n")
    said = "bytes before its first member" if where == "before" else "bytes after its end-of-archive record"
    refused(cli("verify", packed), said)
    refused(cli("replay", packed, "--model", "tiny-llama"), said)
    with pytest.raises(GoldenCorruptError, match=said):
        open_golden(packed)


@pytest.mark.parametrize("name", ["../x", "/abs", "k2/../../x"])
def test_a_member_outside_the_golden_is_refused(cli, packed, name):
    _append(packed, name, b"foreign")
    refused(cli("verify", packed), repr(name), "outside the golden")
    with pytest.raises(GoldenCorruptError, match="outside the golden"):
        open_golden(packed)


def test_a_manifest_listing_a_name_outside_the_golden_is_refused(tiny_copy):
    from golden_edit import edit_meta

    from vd.store import manifest

    def add(meta):
        meta["manifest"]["../x"] = [0, manifest.file_digest(b"")]
        meta["golden_id"] = manifest.golden_id(meta)

    edit_meta(tiny_copy, add)
    with pytest.raises(GoldenCorruptError, match="outside the golden"):
        open_golden(tiny_copy)
