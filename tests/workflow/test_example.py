"""The CI example (examples/ci) runs: its project's pytest, in a temporary directory, records its tiny golden
with --vd-update, passes, fails on the engine's deliberate regression with vd's reasons, and its GitHub
Actions workflow is valid YAML naming both jobs."""

import json
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


def _workflow() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((EXAMPLE / ".github" / "workflows" / "vd.yml").read_text())


def _commands(block: str) -> list[str]:
    """The shell lines of a step's ``run`` block (continuations joined, comments dropped)."""
    text = block.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _installs(line: str) -> bool:
    """A line that makes the job's environment (a venv, pip): the test runs in its own, where vd is installed."""
    return line.startswith(("python -m venv", "pip install", ". .venv/bin/activate"))


def test_the_workflow_is_valid_and_does_what_a_team_needs():
    """Both jobs; every vd command and flag exists; the extras it uses installed; ~/.cache/vd cached; the goldens
    uploaded whatever fails; S3 credentials from secrets; the replay job runs each golden once, under a policy."""
    from typer.main import get_command

    from vd.cli import app

    flow = _workflow()
    assert set(flow["jobs"]) == {"record", "replay"}
    assert all(flow["env"][k] == f"${{{{ secrets.{k} }}}}" for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    commands = get_command(app).commands
    for name, job in flow["jobs"].items():
        steps = job["steps"]
        assert any(s.get("uses", "").startswith("actions/cache") and s["with"]["path"] == "~/.cache/vd"
                   for s in steps), name
        lines = [line for s in steps for line in _commands(s.get("run", ""))]
        assert any("'vd-goldens[s3]'" in line for line in lines), name
        for line in lines:
            words = line.split("||")[0].split()
            if words[0] != "vd":
                continue
            command = commands[words[1]]
            options = {o for p in command.params for o in p.opts}
            unknown = [w.split("=")[0] for w in words[2:] if w.startswith("--") and w.split("=")[0] not in options]
            assert not unknown, f"{line}: vd {words[1]} has no {unknown}"
    record, replay = flow["jobs"]["record"]["steps"], flow["jobs"]["replay"]["steps"]
    assert next(s for s in record if s.get("uses", "").startswith("actions/upload-artifact"))["if"] == "always()"
    replays = [line for s in replay for line in _commands(s.get("run", "")) if "vd replay" in line or "--vd " in line]
    assert len(replays) == 1 and "--tolerance kl:0.05" in replays[0], replays  # each golden once


def test_the_workflow_runs_here(tmp_path):
    """The jobs' run lines, in order, in a copy of the project (only the install lines left out: this test's
    environment has vd): the record job records the tiny golden, the replay job replays it and runs the
    engine's tests, and the files the later steps upload are there."""
    project = tmp_path / "my-engine"
    shutil.copytree(EXAMPLE / "project", project)
    flow = _workflow()
    env = {**os.environ, **{k: v for k, v in flow["env"].items() if "secrets." not in v}, "VD_GOLDENS": "tiny",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for job in ("record", "replay"):
        for step in flow["jobs"][job]["steps"]:
            lines = [line.replace("${{ github.event.inputs.reason }}", "the CI example, run by vd's tests")
                     for line in _commands(step.get("run", "")) if not _installs(line)]
            if not lines:
                continue
            done = subprocess.run(["bash", "-e", "-c", "\n".join(lines)], cwd=project, env=env, text=True,
                                  capture_output=True, timeout=900)
            assert done.returncode == 0, f"{job}: {step.get('name')}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    for name in ("vd-changes.md", "vd-status.json", "vd-report.json", "vd-report.html", "vd-goldens.xml",
                 "vd-engine.xml"):
        assert (project / name).is_file(), name
    assert json.loads((project / "vd-report.json").read_text())["verdict"] == "PASS"
    assert (project / "goldens" / "tiny.zarr" / "zarr.json").is_file()
