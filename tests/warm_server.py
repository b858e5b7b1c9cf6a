"""A `vd warm` server as a user starts one, and `vd` commands run as processes (tests/workflow/test_warm.py, and
tests/test_gpu.py on CUDA)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def vd_run(args, env, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vd", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=600, **kw)


def start_server(where: Path) -> tuple[dict, dict]:
    """A server whose socket lives in ``where``: the environment that reaches it, and its status."""
    env = {k: v for k, v in os.environ.items() if k != "VD_WARM"} | {"VD_WARM_DIR": str(where)}
    done = vd_run(["warm", "--json", "--idle", "600"], env)
    assert done.returncode == 0, done.stderr
    return env, json.loads(done.stdout)


def stop_server(env: dict, pid: int) -> None:
    vd_run(["warm", "--stop"], env)
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
