"""The goldens committed for tests (one of each format) replay here, and where a machine's numerics differ
(another CPU vector ISA, here forced with ATEN_CPU_CAPABILITY) the report says so instead of failing
silently."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vd import env

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
    if code == 1 and env.onednn_isa() not in (None, "AVX2"):  # a host offering more than the recording's AVX2
        assert any("under ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2" in x for x in r["reasons"]), r["reasons"]


@pytest.mark.skipif(env.onednn_isa() is None, reason="oneDNN's ISA levels are x86-64's")
@pytest.mark.parametrize("golden", COMMITTED, ids=lambda p: p.name)
def test_committed_golden_replays_bit_for_bit_under_the_recordings_kernels(tmp_path, golden):
    """The goldens were recorded where torch ran AVX2; the environment the report names (oneDNN and ATen held to
    AVX2) gives their rows back bit for bit on any x86-64 host with AVX2, AVX-512 ones included."""
    code, r = _replay(tmp_path, {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}, golden)
    assert code == 0 and r["environment"]["replayed"]["onednn_isa"] == "AVX2", r["reasons"]


@pytest.mark.parametrize("limit, host, expected", [(None, "AVX512_CORE_BF16", "AVX512_CORE_BF16"),
                                                   ("avx2", "AVX512_CORE_BF16", "AVX2"),
                                                   ("AVX512_CORE_AMX", "AVX2", "AVX2"),
                                                   ("ALL", "AVX512_CORE", "AVX512_CORE"),
                                                   ("AVX2_VNNI", "AVX512_CORE", "AVX2_VNNI")])
def test_onednn_isa_is_the_hosts_level_under_its_limit(monkeypatch, limit, host, expected):
    levels = env.ONEDNN_NAMES
    monkeypatch.setattr(env.platform, "machine", lambda: "x86_64")
    for name, check in env.ONEDNN_LEVELS:
        monkeypatch.setattr(env.torch.cpu, check, lambda name=name: levels.index(name) <= levels.index(host))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    if limit is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    assert env.onednn_isa() == expected


@pytest.mark.parametrize("recorded, replayed, hint", [
    ({"cpu_capability": "AVX2"}, "AVX512_CORE_BF16", "ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2"),
    ({"cpu_capability": "AVX512", "onednn_isa": "AVX512_CORE"}, "AVX512_CORE_AMX",
     "ONEDNN_MAX_CPU_ISA=AVX512_CORE ATEN_CPU_CAPABILITY=avx512"),
    ({"cpu_capability": "AVX512"}, "AVX512_CORE_AMX", None),  # before onednn_isa: the host's level unknown
    ({"cpu_capability": "AVX2", "onednn_isa": "AVX2"}, "AVX2", None),  # nothing more here
    ({"cpu_capability": "AVX512", "onednn_isa": "AVX512_CORE_BF16"}, "AVX2", None),  # less here: no way back
])
def test_the_hint_names_the_recordings_kernels_where_this_host_offers_more(recorded, replayed, hint):
    assert env.same_kernels_hint({"device": "cpu", **recorded}, {"device": "cpu", "onednn_isa": replayed}) == hint
    assert env.same_kernels_hint({"device": "cuda", **recorded}, {"device": "cuda", "onednn_isa": replayed}) is None


@pytest.mark.skipif(sys.platform != "linux", reason="ATEN_CPU_CAPABILITY is an x86 Linux switch")
def test_other_vector_isa_is_explained(tmp_path):
    code, r = _replay(tmp_path, {"ATEN_CPU_CAPABILITY": "default"})
    diffs = _judge(code, r)
    assert any(d.startswith("cpu_capability") for d in diffs), diffs
    assert code == 1  # the committed golden's bf16 rows differ under the default ISA
