"""The static-cache forwards on the CPU (`static`; the graphed and compiled ones need CUDA: test_gpu.py),
vd's lean step against HF's modules, and the generated-weight presets' generator."""

import numpy as np
import pytest
import torch

from vd.models import load_model
from vd.models.generated import build_generated, device_checksum, hash_uniform_
from vd.models.static import capacity_for
from vd.testing import DraftHeadConformance, ModelConformance

FIXTURE_PROMPT = "The three laws of thermodynamics state that"


class TestStaticConformance(ModelConformance, DraftHeadConformance):
    @pytest.fixture
    def model(self):
        m = load_model("tiny-llama-mtp")
        m.set_forward("static")
        return m


def test_static_forwards_offered_by_device():
    fw = load_model("tiny-llama").forwards()
    assert "static" in fw
    assert not {"graphed", "compiled", "compiled-graphed"} & set(fw)  # CUDA only


def test_static_matches_dynamic_sdpa_closely_but_is_its_own_forward():
    """The static forward attends over the whole preallocated cache with an additive mask: the same
    function as SDPA over a growing cache, but not the same arithmetic."""
    m = load_model("tiny-llama")
    prompt = m.encode(FIXTURE_PROMPT)
    rows = {}
    for f in ("sdpa", "static"):
        m.set_forward(f)
        m.reset()
        m.forward(prompt)
        rows[f] = m.forward([1, 2, 3]).float()
    d = (rows["sdpa"] - rows["static"]).abs().max().item()
    assert d < 0.1 * rows["sdpa"].abs().max().item()
    assert rows["sdpa"].argmax(-1).tolist() == rows["static"].argmax(-1).tolist()


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-qwen2"])
def test_lean_step_does_hf_arithmetic_and_leaves_hf_forwards_alone(spec):
    """vd's lean step (fused GEMMs, one rotary, grouped-query SDPA) against HF's own modules: in fp32 on
    the CPU within float rounding, and building it (fusing the weights into shared storage) changes
    neither the weights' values nor HF's eager forward."""
    from vd.models.static import StaticRunner

    m = load_model(spec, dtype="float32")
    prompt = m.encode(FIXTURE_PROMPT)

    def run(forward):
        m.set_forward(forward)
        m.reset()
        pre = m.forward(prompt)
        step = m.forward([5, 6, 7])
        m.rewind(2)
        return pre, step, m.forward([8, 9])

    eager_before = run("eager")
    hf = StaticRunner(m.model, "static", hidden=False, lean=False)  # HF's modules: same cache, same mask
    rows_hf = []
    with torch.inference_mode():
        hf.reset()
        for toks in (prompt, [5, 6, 7]):
            rows_hf.append(hf.forward(toks)[0])
    lean = run("static")
    stack = m.static_runner.lean
    assert stack is not None
    eager_after = run("eager")
    for a, b in zip(eager_before, eager_after):
        assert torch.equal(a, b)
    for a, b in zip(rows_hf, lean):
        assert (a - b).abs().max().item() < 1e-4 * a.abs().max().item()
    w = stack.layers[0].wqkv
    q = m.model.model.layers[0].self_attn.q_proj.weight
    assert q.data_ptr() == w.data_ptr()  # the module's weight is a view into the fused tensor
    again = StaticRunner(m.model, "static", hidden=False)
    assert again.lean.layers[0].wqkv.data_ptr() == w.data_ptr()  # a second stack reuses it


def test_lean_step_is_only_for_the_architectures_it_knows():
    from vd.models.lean import unsupported

    assert unsupported(load_model("tiny-llama").model) is None
    assert "DeepseekV3ForCausalLM" in unsupported(load_model("tiny-deepseek-mtp").model)
    m = load_model("tiny-glm4moe-mtp")
    m.set_forward("static")
    assert m.static_runner.lean is None and "HF transformers' modules" in m.forwards()["static"]


def test_static_capacity_is_enforced_and_prepare_grows_it():
    m = load_model("tiny-llama")
    m.set_forward("static")
    m.prepare(10)
    m.reset()
    m.forward(list(range(200)))
    with pytest.raises(RuntimeError, match="holds 256 positions"):
        m.forward(list(range(60)))
    m.prepare(20)
    assert m.length() == 0  # prepare starts a new sequence (its graph warm-ups write from position 0)
    m.forward(list(range(200)))
    m.prepare(300)
    assert m.static_runner.kv.capacity == capacity_for(300) == 512
    m.reset()
    assert m.forward(list(range(300))).shape == (300, m.vocab_size)


def test_hash_uniform_is_fixed_and_has_the_asked_spread():
    t = torch.empty(6, dtype=torch.float32)
    hash_uniform_(t, 123, 0.02)
    again = torch.empty(6, dtype=torch.float32)
    hash_uniform_(again, 123, 0.02, chunk=4)  # chunking does not change a value
    assert torch.equal(t, again)
    # Pinned: a change to the generator changes every generated preset's weights and fingerprint.
    assert t.tolist() == pytest.approx(
        [0.019165, 0.0012131, -0.0068359, -9.0122e-05, -0.0042419, -0.019043], rel=0.02, abs=1e-4)
    big = torch.empty(200_000)
    hash_uniform_(big, 7, 0.05)
    assert abs(big.std().item() - 0.05) < 0.001 and abs(big.mean().item()) < 0.001
    assert big.abs().max().item() <= 0.05 * np.sqrt(3) + 1e-6


def test_generated_model_is_reproducible_and_fingerprinted_by_content():
    from transformers import LlamaConfig

    def cfg():
        return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05)

    a = build_generated(cfg(), seed=3, name="a", device=torch.device("cpu"), dtype=torch.bfloat16)
    b = build_generated(cfg(), seed=3, name="b", device=torch.device("cpu"), dtype=torch.bfloat16)
    c = build_generated(cfg(), seed=4, name="c", device=torch.device("cpu"), dtype=torch.bfloat16)
    assert a.identity().fingerprint == b.identity().fingerprint != c.identity().fingerprint
    with torch.no_grad():
        b.model.lm_head.weight[0, 0] += 1
    b.forget_identity()
    assert b.identity().fingerprint != a.identity().fingerprint  # the checksum sees one changed weight
    assert device_checksum(torch.tensor([1, 2], dtype=torch.int16)) == 1 * 1 + 2 * 2


def test_a_graph_is_captured_with_the_collector_paused(monkeypatch):
    """`GraphSet.capture` runs its warm-ups and capture with Python's cyclic collector paused (a collection there
    could reset an earlier model's graphs mid-capture: the GPU test
    ``test_a_collection_inside_a_capture_cannot_reset_an_earlier_graph``), and leaves it as it was."""
    import gc

    from vd.models.static import GraphSet

    seen = []
    monkeypatch.setattr(GraphSet, "_capture", lambda self, key, inputs, fn: seen.append((key, fn, gc.isenabled())))
    step = lambda: None  # noqa: E731
    GraphSet(step, torch.device("cpu")).capture("k", ())
    assert seen == [("k", step, False)] and gc.isenabled()
