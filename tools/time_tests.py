"""Measures the README's test command as a user runs it, part by part, into a JSON file that
tools/readme_figures.py renders into the README ("Run the tests"):

    python tools/time_tests.py --out tools/test_time.json
    python tools/time_tests.py --parts pytest --pytest-args "-m 'not slow'" --out /tmp/test_time.json

The parts are the README's command, `bash tools/setup.sh && bash tools/setup_llamacpp.sh && python -m pytest`:
``setup``, ``llamacpp`` (whether its wheel came from the cache or was built from source) and ``pytest`` (its
summary line kept). Each part's wall time is recorded with the machine (CPU model, cores), its load average
before and after, the commit, the date and this command line. Run it in the README's virtual environment on
a quiet machine: the load average says how busy the machine was, and a busy machine's figure says that, not
how long the tests take. Like the README's ``&&`` it stops at the first part that fails, keeping what it
measured and that part's exit code. It times the command and nothing else: no part is run twice.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from figures import ROOT, commit, cpu_model, load_average

PARTS = ("setup", "llamacpp", "pytest")
BUILT = "from source"  # what tools/setup_llamacpp.sh says when it builds the wheel instead of installing a cached one
SUMMARY = re.compile(r"(\d+ [a-z]+(?:, \d+ [a-z]+)*) in [\d.]+s")  # pytest's "12 passed, 3 skipped in 4.56s"


def commands(pytest_args: list[str]) -> dict[str, list[str]]:
    """Each part's command as the README gives it (pytest under this interpreter, the environment's)."""
    return {"setup": ["bash", "tools/setup.sh"], "llamacpp": ["bash", "tools/setup_llamacpp.sh"],
            "pytest": [sys.executable, "-m", "pytest", *pytest_args]}


def run(cmd: list[str]) -> tuple[float, int, list[str]]:
    """Runs ``cmd`` in the checkout, its output passed through as it comes; wall seconds, exit code, last lines."""
    tail: collections.deque[str] = collections.deque(maxlen=200)
    t = time.perf_counter()
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
    return time.perf_counter() - t, proc.returncode, list(tail)


def describe(name: str, lines: list[str]) -> dict:
    """What a part's output says beyond its time: where llama-cpp-python's wheel came from, pytest's summary."""
    if name == "llamacpp":
        # pip may answer the build from its own cache of built wheels: the figure is then not a build's
        pip_cache = os.environ.get("PIP_NO_CACHE_DIR", "").lower() not in ("1", "true", "yes", "on")
        return {"wheel": "built" if any(BUILT in line for line in lines) else "cache", "pip_cache": pip_cache}
    if name == "pytest":
        found = next((m for line in reversed(lines) if (m := SUMMARY.search(line))), None)
        if found:
            counts = {w: int(n) for n, w in (c.split(" ", 1) for c in found[1].split(", "))}
            return {"summary": found[1], "counts": counts}
    return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON file to write (tools/test_time.json)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help=f"the parts to run, in the README's order, comma-separated (default: {','.join(PARTS)})")
    ap.add_argument("--pytest-args", default="", help="arguments for pytest, as one shell-quoted string")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        ap.error(f"--parts: {', '.join(unknown) or 'none given'}: choose from {', '.join(PARTS)}")
    pytest_args = shlex.split(a.pytest_args)
    cmds = commands(pytest_args)

    result: dict = {
        "command": "python tools/time_tests.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "commit": commit(),
        "machine": {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "load_before": load_average(),
        "parts": [],
    }
    code = 0
    for name in (p for p in PARTS if p in parts):
        shown = shlex.join(["python", *cmds[name][1:]]) if name == "pytest" else shlex.join(cmds[name])
        print(f"time_tests: {name}: {shown}", file=sys.stderr, flush=True)
        wall, code, tail = run(cmds[name])
        result["parts"].append({"name": name, "command": shown, "wall_s": wall, "exit": code,
                                **describe(name, tail)})
        print(f"time_tests: {name}: {wall:.1f} s, exit {code}", file=sys.stderr, flush=True)
        if code != 0:
            break
    result["load_after"] = load_average()
    result["total_s"] = sum(p["wall_s"] for p in result["parts"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"time_tests: wrote {a.out} (python tools/readme_figures.py --write puts it into the README)",
          file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
