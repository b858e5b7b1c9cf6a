"""The goldens committed for tests (one of each format) replay here, and where a machine's numerics differ
(another CPU vector ISA, here forced with ATEN_CPU_CAPABILITY) the report says so instead of failing
silently."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
COMMITTED = [DATA / "tiny-llama-v1.zarr", DATA / "tiny-llama-mtp-v2.zarr", DATA / "tiny-llama-mtp-v3.zarr",
             DATA / "tiny-llama-mtp-v4.zarr"]


def _replay(tmp_path, env_extra, golden=COMMITTED[0]):
    report = tmp_path / "r.json"
    env = {**os.environ, **env_extra}
    proc = subprocess.run([sys.executable, "-m", "vd", "replay", str(golden), "--report", str(report)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode, json.loads(report.read_text())


def _judge(code, r) -> list[str]:
    """Whatever the environment, the verdict and the exit code agree and every control fired (or, in a failing
    replay, was inconclusive); a machine
    whose numerics-relevant environment matches the recording's must PASS, and a FAIL elsewhere must name
    the environment's differences as the likely cause."""
    diffs = r["environment"]["numerics_differences"]
    assert (code == 0) == (r["verdict"] == "PASS") == (r["reasons"] == [])
    # A control fires, or is inconclusive where the forward's own run already fails at its step (another ISA).
    assert all(v["detection_control"]["fired"] or (code == 1 and v["detection_control"]["inconclusive"])
               for v in r["verify"])
    if not diffs:
        assert code == 0, r["reasons"]
    elif code == 1:
        assert any("replaying environment differs" in x for x in r["reasons"]), r["reasons"]
    return diffs


@pytest.mark.parametrize("golden", COMMITTED, ids=lambda p: p.name)
def test_committed_golden_replays_here(tmp_path, golden):
    code, r = _replay(tmp_path, {}, golden)
    _judge(code, r)
    assert r["environment"]["recorded"]["threads"] == 1 == r["environment"]["replayed"]["threads"]


@pytest.mark.skipif(sys.platform != "linux", reason="ATEN_CPU_CAPABILITY is an x86 Linux switch")
def test_other_vector_isa_is_explained(tmp_path):
    code, r = _replay(tmp_path, {"ATEN_CPU_CAPABILITY": "default"})
    diffs = _judge(code, r)
    assert any(d.startswith("cpu_capability") for d in diffs), diffs
    assert code == 1  # the committed golden's bf16 rows differ under the default ISA
