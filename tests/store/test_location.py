"""Where a golden lives: a directory, a zip file written once through zarr's ZipStore, or a prefix of a real
S3 server (SeaweedFS, started by the tests); each published whole, never half."""

import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import zarr
from store_data import write

from vd.errors import GoldenBusyError, GoldenError, GoldenNotFoundError, NotAGoldenError, UsageError
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


def test_the_test_s3_server_keeps_its_socket_and_logs_in_its_folder(tmp_path):
    """The tests' SeaweedFS (`seaweed.serve`) puts its S3 socket and its log files in its own folder, not in /tmp,
    where each run used to leave them."""
    import seaweed

    try:
        with seaweed.serve(tmp_path) as endpoint:
            port = endpoint.rsplit(":", 1)[1]
            assert (tmp_path / "s3.sock").is_socket() and not Path(f"/tmp/seaweedfs-s3-{port}.sock").exists()
            assert any(".log.INFO." in p.name for p in tmp_path.iterdir())
    except seaweed.Unavailable as e:
        pytest.skip(str(e))


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

    async def keys():  # the live prefix, through zarr itself
        return [k async for k in zarr.storage.FsspecStore.from_url(url, read_only=True).list()]

    return sync(keys())


def test_a_partial_s3_upload_never_opens_as_a_golden(s3, monkeypatch):
    """Uploads stop after five keys: neither a new golden nor a refreshed one opens (the placeholder root went
    first); a reader waits for the write (VD_S3_WAIT_S), then names the writer; the next writer replaces it."""
    calls = []
    real_set = zarr.storage.FsspecStore.set

    async def failing_set(self, key, value):
        calls.append(key)
        if len(calls) == 5:
            raise OSError("connection reset")
        return await real_set(self, key, value)

    write(s3 + "-old")
    monkeypatch.setenv("VD_S3_WAIT_S", "0.5")
    with monkeypatch.context() as m:
        m.setattr(zarr.storage.FsspecStore, "set", failing_set)
        for url, refresh in ((s3, False), (s3 + "-old", True)):
            calls.clear()
            with pytest.raises(GoldenError, match="connection reset"):
                write(url, seed=2, refresh=refresh)
            assert locate(url).state() == "partial"
            with pytest.raises(NotAGoldenError, match=r"is being written by .* pid \d+ since .*, or that write was "
                                                      r"interrupted: waited 0 s \(VD_S3_WAIT_S\)"):
                open_golden(url)
    rows = write(s3, seed=3)  # no --refresh needed: there was no golden to lose
    assert np.array_equal(open_golden(s3).verify_rows(2)["verify"], rows[2]["verify"])


def test_s3_credentials_are_checked(s3, monkeypatch):
    import s3fs

    write(s3)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec keeps a file system per process; a new vd starts without
    with pytest.raises(GoldenError, match="cannot read s3:.*PermissionError"):
        open_golden(s3)


def test_s3_without_credentials_says_where_they_come_from(s3, cli, monkeypatch, tmp_path):
    """No credentials at all: reading and recording refuse (exit 2) in one line naming the golden (not the lock a
    writer takes first) and where credentials come from."""
    import s3fs

    write(s3)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    where = "(S3 credentials come from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials)"
    code, out, err = cli("show", s3)
    assert code == 2 and err.startswith(f"vd: error: cannot read {s3}: NoCredentialsError: ") and where in err, err
    code, out, err = cli("record", s3 + "-new", "--model", "tiny-llama", "--steps", "4")
    assert code == 2 and err.startswith(f"vd: error: cannot read {s3}-new (its writers' lock s3://") and where in err
    assert err.count("\n") == 1, err


def _golden_id(url) -> str:
    g = open_golden(url)
    try:
        g.check_contents()
        g.check_files()
        return g.meta["golden_id"]
    finally:
        g.close()


def test_an_s3_reader_keeps_the_version_it_opened(s3):
    """A golden opened before a refresh is read whole from the version it opened; one opened while the
    placeholder is up waits for the new version."""
    import asyncio
    import threading

    old = write(s3, seed=1)
    g = open_golden(s3)
    new = write(s3, seed=2, refresh=True)
    assert np.array_equal(g.verify_rows(2)["verify"], old[2]["verify"])  # read after the refresh published
    g.check_files()
    g.close()
    assert np.array_equal(open_golden(s3).verify_rows(2)["verify"], new[2]["verify"])
    # A refresh held up after its placeholder: the reader waits and reads the new golden.
    gate = threading.Event()
    real_set = zarr.storage.FsspecStore.set
    started = threading.Event()

    async def slow_set(self, key, value):
        if key != "zarr.json":
            started.set()
            while not gate.is_set():  # zarr runs every store call on one event loop: never block it
                await asyncio.sleep(0.05)
        return await real_set(self, key, value)

    import unittest.mock

    with unittest.mock.patch.object(zarr.storage.FsspecStore, "set", slow_set):
        t = threading.Thread(target=write, args=(s3,), kwargs={"seed": 3, "refresh": True})
        t.start()
        assert started.wait(30) and locate(s3).state() == "partial"
        threading.Timer(1.0, gate.set).start()
        reader = open_golden(s3)  # the placeholder is up: waits until the new root is written
        t.join(30)
    newest = k_data_rows(3)
    assert np.array_equal(reader.verify_rows(2)["verify"], newest)


def k_data_rows(seed):
    from store_data import k_data

    return k_data(2, seed=seed)[2]["verify"]


def test_s3_readers_during_refreshes_see_old_or_new_never_a_mix(s3):
    """Readers open, check every file and every row while another thread publishes refreshes one after
    another: each judged golden is whole and one of the published versions."""
    import threading

    from store_data import meta  # noqa: F401  (the published goldens are store_data's)

    ids, seen, errors = set(), [], []
    write(s3, seed=0)
    ids.add(_golden_id(s3))
    done = threading.Event()

    def refreshes():
        try:
            for seed in range(1, 7):
                write(s3, seed=seed, refresh=True)
                ids.add(_golden_id(s3))
        finally:
            done.set()

    def reads():
        while not done.is_set():
            try:
                seen.append(_golden_id(s3))
            except Exception as e:  # any error is a failure of the guarantee
                errors.append(repr(e))

    threads = [threading.Thread(target=refreshes), threading.Thread(target=reads), threading.Thread(target=reads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and seen and set(seen) <= ids and len(ids) == 7


def test_one_s3_writer_at_a_time(s3, monkeypatch):
    """A second writer is refused with one line naming the first; a lock left by a dead process of this host
    is taken over; the lock is gone after the write."""
    from vd.store.objects import ObjectPrefix

    write(s3, seed=1)
    a = ObjectPrefix(s3)
    assert a.wait_writer(0)
    with a.writer():
        with pytest.raises(GoldenBusyError, match=r"being written by another vd process \(.* pid \d+ since .*; it "
                                                  r"holds s3://.*\.lock\)"):
            with ObjectPrefix(s3).writer():
                pass
        assert not ObjectPrefix(s3).wait_writer(0.6)  # (pytest workers updating one golden wait for each other)
    assert ObjectPrefix(s3).wait_writer(0)
    with ObjectPrefix(s3).writer():  # released
        pass
    # A lock whose process is gone (a SIGKILLed writer on this host) is taken over.
    import json
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    store = a._store(False)
    parent, _, name = store.path.rpartition("/")
    from zarr.core.sync import sync

    holder = {"host": __import__("socket").gethostname(), "pid": int(dead), "since": "then", "token": "x"}
    sync(store.fs._pipe_file(f"{parent}/.{name}.lock", json.dumps(holder).encode()))
    assert ObjectPrefix(s3).wait_writer(0)  # nothing to wait for
    with ObjectPrefix(s3).writer():
        pass
    assert not sync(store.fs._exists(f"{parent}/.{name}.lock"))


@pytest.mark.parametrize("doc, said", [(b"", "it is empty"), (b"[]", "an array where a zarr group's document is a JSON "
                                       "object"), (b'"x"', "a string where"), (b"null", "null where"),
                                       (b'{"a":', "not valid JSON (Expecting value at line 1, column 6)")])
def test_a_root_document_that_is_no_json_object_is_said_in_words(tiny_golden, tmp_path, doc, said):
    """A golden's root zarr.json emptied or holding another JSON value was refused with Python's own message
    ("'list' object has no attribute 'get'", "Expecting value: line 1 column 1 (char 0)")."""
    g = tmp_path / "g.zarr"
    shutil.copytree(tiny_golden, g)
    (g / "zarr.json").write_bytes(doc)
    with pytest.raises(GoldenError, match=re.escape(f"{g}/zarr.json is unreadable: {said}")):
        open_golden(g)


def test_s3_folder_markers_are_no_part_of_a_golden(s3, monkeypatch):
    """An empty object whose key ends in "/" (the AWS console's "Create folder", rclone) under a golden's prefix:
    every read waited VD_S3_WAIT_S (60 s) and then said a refresh was publishing it (a user test). And a prefix
    with an empty folder (s3://b/a//g.zarr), written, was never found again: refused."""
    import botocore.session

    rows = write(s3, ks=(2,))
    bucket, _, prefix = s3[len("s3://"):].partition("/")
    client = botocore.session.get_session().create_client("s3")
    for key in (f"{prefix}/", f"{prefix}/k2/"):
        client.put_object(Bucket=bucket, Key=key, Body=b"")
    monkeypatch.setenv("VD_S3_WAIT_S", "0.5")
    assert np.array_equal(open_golden(s3).verify_rows(2)["verify"], rows[2]["verify"])
    with pytest.raises(UsageError, match=r"an empty folder in an S3 prefix \('//'\)"):
        locate(f"s3://{bucket}/a//g.zarr")


def test_a_hung_s3_endpoint_is_one_line_in_bounded_time(cli, monkeypatch):
    """An endpoint that accepts connections and never answers (a stopped server): vd waited minutes without a word
    (botocore's 60 s per attempt, s3fs's five tries; a user test gave up after 200 s). Now VD_S3_TIMEOUT_S per try."""
    import socket
    import time

    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # (one cached for another endpoint would be asked instead)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)  # connections complete in the backlog; nothing is ever read or answered
    try:
        for name, value in {"AWS_ACCESS_KEY_ID": "vd", "AWS_SECRET_ACCESS_KEY": "vd-secret", "AWS_REGION": "us-east-1",
                            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.getsockname()[1]}",
                            "VD_S3_TIMEOUT_S": "0.5"}.items():
            monkeypatch.setenv(name, value)
        t = time.monotonic()
        code, out, err = cli("verify", "s3://goldens/hung.zarr")
        assert code == 2 and "ReadTimeoutError" in err and "each try waits VD_S3_TIMEOUT_S seconds" in err, err
        assert time.monotonic() - t < 30 and len(err.strip().splitlines()) == 1, err
        monkeypatch.setenv("VD_S3_TIMEOUT_S", "soon")
        code, out, err = cli("verify", "s3://goldens/hung.zarr")
        assert code == 2 and "VD_S3_TIMEOUT_S='soon': give seconds" in err, err
    finally:
        server.close()
        s3fs.S3FileSystem.clear_instance_cache()


def test_a_failed_s3_upload_leaves_no_upload_running(s3, monkeypatch):
    """One key's upload fails (the server died): the others in flight are cancelled before the error is raised.
    `asyncio.gather` left them running, so a process that ended then printed a traceback per key (a user test)."""
    import asyncio
    import time

    real_set, done, failed = zarr.storage.FsspecStore.set, [], []

    async def set_slowly(self, key, value):
        if key.startswith("k2/") and not failed:
            failed.append(key)
            raise OSError("connection reset")
        await asyncio.sleep(0.3)
        await real_set(self, key, value)
        done.append(time.monotonic())

    monkeypatch.setattr(zarr.storage.FsspecStore, "set", set_slowly)
    with pytest.raises(GoldenError, match="connection reset"):
        write(s3, ks=(2,))
    raised = time.monotonic()
    time.sleep(1.0)
    assert failed and not [t for t in done if t > raised]  # no upload went on after the error was raised


def test_a_placeholder_whose_writer_died_here_is_said_at_once(s3, monkeypatch):
    """A write cut short (its writer killed) leaves the placeholder root; a reader on the writer's host waited
    VD_S3_WAIT_S (60 s) for a process that no longer runs, then said "record it again" (a user test restored it
    with vd pack --refresh). It says so at once, naming both ways to write it again."""
    import json
    import socket
    import subprocess
    import sys
    import time

    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    write(s3)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    holder = {"host": socket.gethostname(), "pid": gone.pid, "token": "x", "since": "2026-12-08T00:00:00+00:00"}
    doc = {"zarr_format": 3, "node_type": "group", "attributes": {"vd_partial": holder}}
    store = zarr.storage.FsspecStore.from_url(s3, read_only=False)
    sync(store.set("zarr.json", default_buffer_prototype().buffer.from_bytes(json.dumps(doc).encode())))
    monkeypatch.setenv("VD_S3_WAIT_S", "60")
    t = time.monotonic()
    with pytest.raises(NotAGoldenError, match=rf"holds a write cut short: its writer, .* pid {gone.pid} .*, no longer "
                                              r"runs; write it again \(vd record --refresh, vd pack SOURCE DEST"):
        open_golden(s3)
    assert time.monotonic() - t < 10
