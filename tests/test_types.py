"""Static analysis over the whole product, from the repository root with no flags: mypy (its settings in
pyproject.toml; the test extra installs it) follows every package, the CLI, the recorder, the replayer and
the workflow included, and finds nothing."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_nothing_in_the_product():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Success: no issues found" in done.stdout, done.stdout
