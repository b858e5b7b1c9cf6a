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
