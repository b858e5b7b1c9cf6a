"""The Inductor artifacts a compiled recording keeps (`vd.models.inductor`): saved once per process while
nothing new is compiled, saved afresh after a new compilation."""

import hashlib
import shutil

import pytest
import torch

from vd.models import inductor


@pytest.mark.skipif(shutil.which("cc") is None, reason="Inductor compiles C++ for the CPU: no compiler here")
def test_artifacts_are_saved_again_only_after_a_new_compilation():
    inductor.inductor_settings()
    torch.compile(lambda x: x * 2 + 1)(torch.ones(4))
    first = inductor.save_artifacts()
    assert first is not None and first[1].get("inductor", 0) >= 1
    assert inductor.save_artifacts() is first  # nothing compiled since: the same blob, not serialised again
    torch.compile(lambda x: x * 3 - 1)(torch.ones(4))
    second = inductor.save_artifacts()
    assert second is not None and second is not first
    assert second[1]["inductor"] > first[1]["inductor"] and len(second[0]) > len(first[0])
    assert second[2] == hashlib.sha256(second[0]).hexdigest()


@pytest.mark.skipif(shutil.which("cc") is None, reason="Inductor compiles C++ for the CPU: no compiler here")
def test_artifacts_are_not_said_to_be_reused_where_inductor_looks_in_no_cache(monkeypatch):
    """With Inductor's caches off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``, or its FX graph cache), artifacts loaded
    into them go unused: a replay then compiled and timed afresh and FAILed on the GPU while its note said the
    recording's artifacts were reused (tools/h200/compiled-mtp-drafts-after.json). Loading says why instead."""
    inductor.inductor_settings()
    torch.compile(lambda x: x * 5 + 2)(torch.ones(4))
    saved = inductor.save_artifacts()
    assert saved is not None
    data, digest = saved[0], "f" * 64  # a digest this process does not hold, so loading is tried
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    why = inductor.load_artifacts(data, digest)
    assert why is not None and "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1" in why and not inductor.held(digest)
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", False)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    why = inductor.load_artifacts(data, digest)
    assert why is not None and "TORCHINDUCTOR_FX_GRAPH_CACHE=0" in why and not inductor.held(digest)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", True)
    assert inductor.load_artifacts(data, digest) is None and inductor.held(digest)
