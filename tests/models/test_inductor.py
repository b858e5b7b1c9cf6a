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
def test_artifacts_handed_ahead_are_handed_again_only_after_a_new_compilation():
    """A recording hands its artifacts to the writer during its K runs (`vd.recorder.record._Ahead`) and asks again
    at its publish: the same artifacts are not handed twice (a file sent again waits for every job sent before it),
    artifacts compiled since are."""
    inductor.inductor_settings()
    torch.compile(lambda x: x * 7 + 3)(torch.ones(4))
    handed: list[str] = []

    def add_file(key, data, digest):
        assert digest == hashlib.sha256(data).hexdigest()
        handed.append(digest)

    early = inductor.keep_artifacts("compiled", add_file, "inductor.bin")
    assert handed == [early["compiled"]["sha256"]]
    assert inductor.keep_artifacts("compiled", add_file, "inductor.bin", early) is early and len(handed) == 1
    torch.compile(lambda x: x * 7 - 3)(torch.ones(4))  # compiled after the early hand-over
    late = inductor.keep_artifacts("compiled", add_file, "inductor.bin", early)
    assert late["compiled"]["sha256"] != early["compiled"]["sha256"] and handed == [early["compiled"]["sha256"],
                                                                                   late["compiled"]["sha256"]]
    assert inductor.keep_artifacts("eager", add_file, "inductor.bin", early) == {} and len(handed) == 2


@pytest.mark.skipif(shutil.which("cc") is None, reason="Inductor compiles C++ for the CPU: no compiler here")
def test_artifacts_are_not_said_to_be_reused_where_inductor_looks_in_no_cache():
    """With Inductor's caches off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``, or its FX graph cache), artifacts loaded
    into them go unused: a replay then compiled and timed afresh and FAILed on the GPU while its note said the
    recording's artifacts were reused (tools/h200/compiled-mtp-drafts-after.json). Loading says why instead."""
    inductor.inductor_settings()
    torch.compile(lambda x: x * 5 + 2)(torch.ones(4))
    saved = inductor.save_artifacts()
    assert saved is not None
    data, digest = saved[0], "f" * 64  # a digest this process does not hold, so loading is tried
    config = torch._inductor.config
    with config.patch(force_disable_caches=True):  # (Inductor's own way to set its config for a while)
        why = inductor.load_artifacts(data, digest)
    assert why is not None and "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1" in why and not inductor.held(digest)
    with config.patch(fx_graph_cache=False):
        why = inductor.load_artifacts(data, digest)
    assert why is not None and "TORCHINDUCTOR_FX_GRAPH_CACHE=0" in why and not inductor.held(digest)
    assert inductor.load_artifacts(data, digest) is None and inductor.held(digest)


class _NamedCompiled:
    """tiny-llama whose eager forward is also offered under the name ``compiled``: a recording that takes it for a
    compiled one (it keeps Inductor artifacts for it), on the CPU."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forwards(self):
        return {**self.inner.forwards(), "compiled": "eager, named as vd's compiled forward"}

    def set_forward(self, name):
        self.inner.set_forward("eager" if name == "compiled" else name)


def test_a_compiled_recording_where_inductor_caches_are_off_warns_it_keeps_no_artifacts(tmp_path):
    """Recorded with ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` a compiled golden kept no Inductor artifacts, silently
    (seen on an H100): its replays elsewhere compile afresh. The recording now says so."""
    import torch._inductor.config

    from vd.models import load_model
    from vd.recorder import RecordSettings, record

    model = _NamedCompiled(load_model("tiny-llama"))
    with torch._inductor.config.patch(force_disable_caches=True):
        r = record(tmp_path / "g.zarr", RecordSettings(model="tiny-llama", forward="compiled", steps=4, ks=(2,)),
                   model=model)
    assert r.location is not None and any("no Inductor artifacts stored" in p and "TORCHINDUCTOR_FORCE_DISABLE_CACHES"
                                          in p and p.startswith("warning: ") for p in r.problems()), r.problems()
    r = record(tmp_path / "h.zarr", RecordSettings(model="tiny-llama", forward="compiled", steps=4, ks=(2,)),
               model=model)
    assert not [p for p in r.problems() if "Inductor" in p], r.problems()
