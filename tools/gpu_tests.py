"""Run the GPU tests and keep their outcome where the README reads it (`tools/readme_figures.py`):

    python3 tools/gpu_tests.py --out tools/h200/gpu_tests.json [-- PYTEST ARGS]

Runs ``python3 -m pytest -m gpu`` (plus any arguments after ``--``) with a JUnit XML report, and writes the
counts (passed, failed, skipped, deselected), each failure's test id and message (its first 20 lines), each
skip's reason, the GPU, the commit and the command. A traceback file a failure names (vd's "traceback in
PATH") is copied beside the JSON, into ``OUT-tracebacks/``: a lent machine is gone once the run ends.
Exits with pytest's code.
"""

from __future__ import annotations

import argparse
import atexit
import datetime as dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from figures import ROOT, cpu_model, load_average, provenance

TRACEBACK = re.compile(r"traceback in (/\S+?\.txt)")  # vd's one-line errors name the file they wrote


def keep_tracebacks(failures: list[dict], out: Path) -> None:
    """Copy the traceback files the failures name into ``OUT-tracebacks/``, each failure's list then naming the
    copies (relative to the JSON's folder); a file that is gone is named as it was."""
    folder = out.with_name(out.stem + "-tracebacks")
    for f in failures:
        kept = []
        for path in f.get("tracebacks", []):
            if os.path.isfile(path):
                folder.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, folder / Path(path).name)
                path = str((folder / Path(path).name).relative_to(out.parent))
            kept.append(path)
        f["tracebacks"] = kept


def outcomes(junit: Path) -> dict:
    """Counts and the failures' and skips' ids and first lines, from a JUnit XML report."""
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, f"{junit} holds no testsuite"
    out: dict = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "skips": []}
    for case in suite.iter("testcase"):
        tid = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            out["failed"] += 1
            lines = (bad.get("message") or "").splitlines()[:20]
            out["failures"].append({"test": tid, "message": [m[:2000] for m in lines],
                                    "tracebacks": sorted(set(TRACEBACK.findall(bad.text or "")))})
        elif skip is not None:
            out["skipped"] += 1
            out["skips"].append({"test": tid, "reason": skip.get("message") or ""})
        else:
            out["passed"] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("pytest_args", nargs="*")
    a = ap.parse_args()
    junit = Path(tempfile.mkdtemp(prefix="vd-gpu-tests-")) / "junit.xml"
    atexit.register(shutil.rmtree, junit.parent, ignore_errors=True)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", f"--junitxml={junit}",
            *a.pytest_args]
    started = provenance()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    tail = done.stdout.strip().splitlines()[-1:] or [""]
    gpu = gpu_id = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
            gpu_id = str(getattr(torch.cuda.get_device_properties(0), "uuid", "")) or None
    except Exception:  # noqa: BLE001  the summary is kept whatever torch says
        pass
    result = {"command": "python3 tools/gpu_tests.py " + " ".join(shlex.quote(x) for x in sys.argv[1:]),
              "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), **started, "load_after": load_average(),
              "machine": {"cpu_model": cpu_model(), "cpu_count": os.cpu_count()}, "gpu": gpu, "gpu_id": gpu_id,
              "exit": done.returncode, "summary": tail[0],
              **(outcomes(junit) if junit.exists() else {"error": done.stderr[-2000:]})}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    keep_tracebacks(result.get("failures", []), a.out)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(done.stdout[-4000:])
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
