"""Where a golden lives: a directory, a zip file written once through zarr's ZipStore, or a prefix of a real
S3 server (SeaweedFS, started by the tests); each published whole, never half."""

import zipfile

import numpy as np
import pytest
import zarr
from store_data import write

from vd.errors import GoldenError, GoldenNotFoundError, NotAGoldenError, UsageError
from vd.store import locate, open_golden
from vd.store.location import Directory, ObjectPrefix, ZipFile


def test_locate_by_what_was_typed(tmp_path):
    assert isinstance(locate(tmp_path / "g.zarr"), Directory) and isinstance(locate("g.zip"), ZipFile)
    assert isinstance(locate("s3://bucket/g.zarr"), ObjectPrefix)
    with pytest.raises(UsageError, match="unsupported URL scheme 'gs'"):
        locate("gs://bucket/g.zarr")
    with pytest.raises(UsageError, match="needs a bucket and a prefix"):
        locate("s3://bucket")


def _same(a, b) -> bool:
    ga, gb = open_golden(a), open_golden(b)
    return ga.ks == gb.ks and all(np.array_equal(ga.verify_rows(k)[kind], gb.verify_rows(k)[kind])
                                  for k in ga.ks for kind in ("prefill", "verify"))


def test_a_zip_golden_is_one_file_of_stored_members_zarr_json_last(tmp_path):
    write(tmp_path / "g.zarr", ks=(2, 3))
    write(tmp_path / "g.zip", ks=(2, 3))
    assert _same(tmp_path / "g.zarr", tmp_path / "g.zip")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr", "g.zip"]  # nothing staged is left
    with zipfile.ZipFile(tmp_path / "g.zip") as z:
        infos = z.infolist()
        assert infos[-1].filename == "zarr.json"  # the golden is complete only once its last member is there
        assert len({i.filename for i in infos}) == len(infos)  # written once: no member twice
        assert {i.compress_type for i in infos} == {zipfile.ZIP_STORED}  # the chunks are compressed already
    root = zarr.open_group(zarr.storage.ZipStore(tmp_path / "g.zip", mode="r"), mode="r")  # plain zarr
    assert root["k3/logits.hi"].shape == (3, 3, 8)


def test_a_failed_zip_publish_leaves_the_old_zip(tmp_path, monkeypatch):
    path = tmp_path / "g.zip"
    old = write(path, seed=1)
    before = path.read_bytes()
    calls = []

    def failing_set(self, key, value):
        calls.append(key)
        if len(calls) == 5:
            raise OSError("disk full")
        return real_set(self, key, value)

    real_set = zarr.storage.ZipStore.set
    monkeypatch.setattr(zarr.storage.ZipStore, "set", failing_set)
    with pytest.raises(OSError, match="disk full"):
        write(path, seed=2, refresh=True)
    assert path.read_bytes() == before and len(calls) == 5
    assert np.array_equal(open_golden(path).verify_rows(2)["verify"], old[2]["verify"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zip"]


def test_s3_golden_round_trip_and_refresh(s3, tmp_path):
    write(tmp_path / "g.zarr", ks=(2, 3))
    write(s3, ks=(2, 3))
    assert _same(tmp_path / "g.zarr", s3)
    assert locate(s3).state() == "golden" and locate(s3 + "-nothing").state() == "absent"
    with pytest.raises(GoldenNotFoundError, match="does not exist"):
        open_golden(s3 + "-nothing")
    # A refresh with fewer widths leaves none of the old golden's keys behind.
    write(s3, ks=(2,), seed=3, refresh=True)
    g = open_golden(s3)
    assert g.ks == [2] and not [k for k in _keys(s3) if k.startswith("k3/")]


def _keys(url: str) -> list[str]:
    from zarr.core.sync import sync

    async def keys():
        return [k async for k in locate(url).store().list()]

    return sync(keys())


def test_a_partial_s3_upload_never_opens_as_a_complete_golden(s3, monkeypatch):
    """Uploads stop after five keys: a new golden is not there at all, and a refreshed one no longer opens
    (its root zarr.json went first), where it would otherwise mix old and new arrays."""
    calls = []
    real_set = zarr.storage.FsspecStore.set

    async def failing_set(self, key, value):
        calls.append(key)
        if len(calls) == 5:
            raise OSError("connection reset")
        return await real_set(self, key, value)

    write(s3 + "-old")
    monkeypatch.setattr(zarr.storage.FsspecStore, "set", failing_set)
    for url, refresh in ((s3, False), (s3 + "-old", True)):
        calls.clear()
        with pytest.raises(GoldenError, match="connection reset"):
            write(url, seed=2, refresh=refresh)
        with pytest.raises(NotAGoldenError, match="no zarr.json"):
            open_golden(url)
        assert "zarr.json" not in _keys(url)


def test_s3_credentials_are_checked(s3, monkeypatch):
    import s3fs

    write(s3)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec keeps a file system per process; a new vd starts without
    with pytest.raises(GoldenError, match="cannot read s3:.*PermissionError"):
        open_golden(s3)
