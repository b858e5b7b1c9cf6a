"""The CI example (examples/ci) runs: its project's pytest, in a temporary directory, records its tiny golden
with --vd-update, passes, fails on the engine's deliberate regression with vd's reasons, and its GitHub
Actions workflow is valid YAML naming both jobs."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "ci"


def _pytest(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=600, env={**os.environ, **env})


def test_the_example_project_guards_its_engine(tmp_path):
    project = tmp_path / "my-engine"
    shutil.copytree(EXAMPLE / "project", project)
    first = _pytest(project, "--vd", "-k", "tiny or engine", "--vd-update")
    assert first.returncode == 0, first.stdout[-3000:]
    assert "vd: goldens refreshed" in first.stdout and (project / "goldens" / "tiny.zarr" / "zarr.json").is_file()
    again = _pytest(project, "--vd", "-k", "tiny or engine", "-v")
    assert again.returncode == 0 and "pyproject.toml::tiny PASSED" in again.stdout, again.stdout[-3000:]
    broken = _pytest(project, "-k", "engine", MY_ENGINE_BUG="1")
    assert broken.returncode == 1, broken.stdout[-3000:]
    assert "vd golden 'tiny'" in broken.stdout and "1 of 8 steps differ (first at step 3 row 1" in broken.stdout


def test_the_workflow_names_a_record_and_a_replay_job():
    yaml = pytest.importorskip("yaml")
    flow = yaml.safe_load((EXAMPLE / ".github" / "workflows" / "vd.yml").read_text())
    assert set(flow["jobs"]) == {"record", "replay"}
    steps = " ".join(str(s.get("run", "")) for s in flow["jobs"]["replay"]["steps"])
    assert "pytest --vd --junitxml" in steps and "vd replay --suite" in steps
