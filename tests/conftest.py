"""Shared fixtures: goldens recorded once per session from the small random-weight presets, and a
CLI runner that returns exit code, stdout and stderr separately."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vd.cli import app

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
def rows_golden(tiny_golden, tmp_path):
    """The session golden as a golden without row digests (format 2, or a digest scheme this vd does
    not compute): a GPU replay reads its rows beside the run."""
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
