"""`vd pack`: a golden copied whole between stores (directory, zip, S3), file for file: the copy verifies and
is the same golden (ID, content digest, history), and replays as its source does."""

import shutil
from pathlib import Path

from vd.store import open_golden

DATA = Path(__file__).parent.parent / "data"


def _same(a, b) -> None:
    ga, gb = open_golden(a), open_golden(b)
    assert gb.meta["golden_id"] == ga.meta["golden_id"] and gb.content_digest() == ga.content_digest()
    assert gb.history == ga.history and gb.manifest == ga.manifest


def test_pack_between_directory_zip_and_s3(cli, tiny_golden, tmp_path, s3):
    route = [tiny_golden, tmp_path / "g.zip", f"{s3}/g.zarr", tmp_path / "back.zarr"]
    for src, dst in zip(route, route[1:]):
        code, out, err = cli("pack", src, dst)
        assert code == 0 and "the source's" in out, err
        assert cli("verify", dst)[0] == 0
        _same(tiny_golden, dst)
    code, out, err = cli("replay", tmp_path / "back.zarr", "--k", "2")
    assert code == 0 and "PASS" in out, err


def test_pack_refuses_what_it_cannot_copy_and_keeps_what_is_there(cli, tiny_golden, tmp_path):
    assert cli("pack", tiny_golden, tmp_path / "g.zip")[0] == 0
    before = (tmp_path / "g.zip").read_bytes()
    code, out, err = cli("pack", tiny_golden, tmp_path / "g.zip")
    assert code == 2 and "already holds a golden; pass --refresh" in err and (tmp_path / "g.zip").read_bytes() == before
    assert cli("pack", tiny_golden, tmp_path / "g.zip", "--refresh")[0] == 0 and (tmp_path / "g.zip").is_file()
    code, out, err = cli("pack", DATA / "tiny-llama-v1.zarr", tmp_path / "old.zip")
    assert code == 2 and "vd migrate" in err and not (tmp_path / "old.zip").exists()
    code, out, err = cli("pack", tiny_golden, tiny_golden / "inside.zip")
    assert code == 2 and "inside the golden" in err
    damaged = tmp_path / "damaged.zarr"
    shutil.copytree(tiny_golden, damaged)
    chunk = next(p for p in damaged.rglob("c/*") if p.is_file())
    chunk.write_bytes(bytes(b ^ 1 for b in chunk.read_bytes()))
    code, out, err = cli("pack", damaged, tmp_path / "d.zip")
    assert code == 2 and not (tmp_path / "d.zip").exists(), err
