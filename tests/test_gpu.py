"""The same record/replay code on CUDA (marker ``gpu``; skipped without a CUDA device).

Run on a GPU machine with ``python3 -m pytest -m gpu``.
"""

import json

import pytest
import torch

from vd.models import load_model
from vd.testing import DraftHeadConformance, ModelConformance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("spec, feed", [("tiny-llama", "reference"), ("tiny-qwen2", "reference"),
                                        ("tiny-llama-mtp", "mtp")])
def test_cuda_round_trip(cli, tmp_path, spec, feed):
    path = tmp_path / "g.zarr"
    code, out, err = cli("record", path, "--model", spec, "--feed", feed, "--device", "cuda", "--steps", "8",
                         "--allow-thin")
    assert code == 0, err
    offered = list(load_model(spec, device="cuda").forwards())  # eager, sdpa and each pinned SDPA backend
    assert offered[:2] == ["eager", "sdpa"] and "sdpa-math" in offered
    args = [x for f in offered for x in ("--forward", f)]
    code, out, err = cli("replay", path, *args, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["environment"]["recorded"]["device"] == "cuda" and r["environment"]["recorded"]["gpu_name"]
    for v in r["verify"]:
        eager = v["comparisons"][0]
        assert eager["prefill_equal"] and eager["mismatched_steps"] == 0 and not eager["draft_mismatched_steps"]
        assert v["detection_control"]["fired"]
    print(json.dumps({v["k"]: [(c["variant"], c["mismatched_steps"], c["max_abs_diff"]) for c in v["comparisons"]]
                      for v in r["verify"]}))


def test_cpu_golden_on_cuda_names_the_device(cli, tiny_golden, tmp_path):
    code, out, err = cli("replay", tiny_golden, "--device", "cuda", "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert any(d.startswith("device: cpu → cuda") for d in r["environment"]["numerics_differences"])
    if code == 1:
        assert any("replaying environment differs" in x for x in r["reasons"])


class TestCudaConformance(ModelConformance, DraftHeadConformance):
    @pytest.fixture(scope="class")
    def model(self):
        return load_model("tiny-llama-mtp", device="cuda")
