"""The drafter feed: MTP draft heads recorded, replayed and diffed, native (HF MtpModel) and attached."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vd.loop import DrafterFeed, run_verify
from vd.models import load_model
from vd.testing import DraftHeadConformance, ModelConformance

PLUGINS = Path(__file__).parent.parent / "plugins"  # tests/plugins


# The tiny-llama-mtp head is a test fixture: on random weights a head learns little that carries to new
# prompts, so the goldens here use one of its training prompts, where it drafts both accept kinds.
FIXTURE_PROMPT = "The three laws of thermodynamics state that"


@pytest.fixture(scope="session")
def mtp_golden(cli, golden_dir) -> Path:
    path = golden_dir / "mtp.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama-mtp", "--feed", "mtp", "--steps", "8",
                         "--prompt", FIXTURE_PROMPT)
    assert code == 0, err
    return path


def test_mtp_round_trip_passes(cli, mtp_golden, tmp_path):
    code, out, err = cli("replay", mtp_golden, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 0 and r["verdict"] == "PASS", r["reasons"]
    # The report's head is the attached head the golden was recorded with. (Its "warmup" field is a constant:
    # test_first_propose_matches_later_ones checks what it claims.)
    assert r["mtp"] is True and r["head"]["source"] == "attached" and r["head"]["hidden"].startswith("post_norm")
    for v in r["verify"]:
        c = v["comparisons"][0]
        assert c["draft_mismatched_steps"] == 0 and c["draft_first_mismatch"] is None and c["bootstrap_equal"]
        assert v["detection_control"]["fired"]
        acc = v["accepted"]
        assert (v["k"] - 1) in acc and min(acc) < v["k"] - 1  # full and partial accepts both occur
    code, out, err = cli("show", mtp_golden)
    assert "MTP head" in out and "acceptance" in out and "feed mtp" in out


def test_perturbed_head_fails_in_draft_rows_only(cli, mtp_golden, tmp_path, monkeypatch):
    monkeypatch.setenv("VD_PERTURB_STEP", "2")
    code, out, err = cli("replay", mtp_golden, "--model", f"{PLUGINS / 'perturb_head.py'}:factory",
                         "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 1
    for v in r["verify"]:
        c = v["comparisons"][0]
        assert c["prefill_equal"] and c["mismatched_steps"] == 0 and c["bootstrap_equal"]
        assert c["draft_mismatched_step_list"] == [2]
        m = c["draft_first_mismatch"]
        assert (m["step"], m["row"], m["index"]) == (2, 0, 7)
    assert all(x.startswith("draft head K=") for x in r["reasons"])


def test_never_accepted_head_is_too_thin(cli, tmp_path):
    spec = f"{PLUGINS / 'never_accepted.py'}:factory"
    path = tmp_path / "never.zarr"
    code, out, err = cli("record", path, "--model", spec, "--feed", "mtp", "--steps", "6")
    assert code == 1 and "too thin" in err and not path.exists()
    assert cli("record", path, "--model", spec, "--feed", "mtp", "--steps", "6", "--allow-thin")[0] == 0
    code, out, err = cli("replay", path, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 1
    assert all(set(v["accepted"]) == {0} for v in r["verify"])
    assert len([x for x in r["reasons"] if "needs both full and partial accepts" in x]) == 3


@pytest.mark.parametrize("spec", ["tiny-llama-mtp", "tiny-deepseek-mtp"])
def test_drafter_commits_plain_greedy(spec):
    model = load_model(spec, dtype="float32")
    prompt = model.encode("The drafter commits what greedy decoding would.")
    run = run_verify(model, prompt, 4, 10, DrafterFeed(4, 10))
    committed = run.committed()
    ids = torch.tensor([prompt])
    hf = model.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                              max_new_tokens=len(committed), min_new_tokens=len(committed), eos_token_id=None)
    assert committed == hf[0, len(prompt):].tolist()


def test_mtp_needs_a_head(cli, tmp_path, mtp_golden):
    code, out, err = cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--feed", "mtp")
    assert code == 2 and "no MTP draft head" in err
    code, out, err = cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--feed", "medusa")
    assert code == 2 and "--feed" in err
    code, out, err = cli("replay", mtp_golden, "--model", "tiny-llama")
    assert code == 2 and "recorded with an MTP draft head" in err


def test_head_file_attaches_and_is_fingerprinted(cli, tmp_path, mtp_golden):
    from vd.models.mtp import new_attached_layer, save_head

    other = tmp_path / "other-head.safetensors"
    base = load_model("tiny-llama")
    layer, cfg = new_attached_layer(base.model, intermediate_size=64)
    save_head(layer, cfg, other)
    code, out, err = cli("replay", mtp_golden, "--model", "tiny-llama", "--head", other)
    assert code == 2 and "MTP head fingerprint" in err
    path = tmp_path / "attached.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama", "--head", other, "--feed", "mtp", "--steps", "4",
                         "--allow-thin")
    assert code == 0, err
    code, out, err = cli("replay", path, "--report", tmp_path / "r.json")  # the golden's head file again
    r = json.loads((tmp_path / "r.json").read_text())
    assert all(c["draft_mismatched_steps"] == 0 for v in r["verify"] for c in v["comparisons"])
    (tmp_path / "bad.safetensors").write_bytes(b"not a head")
    code, out, err = cli("record", tmp_path / "x.zarr", "--model", "tiny-llama", "--head", tmp_path / "bad.safetensors")
    assert code == 2 and "MTP head" in err


def test_native_head_round_trip(cli, tmp_path):
    path = tmp_path / "ds.zarr"
    code, out, err = cli("record", path, "--model", "tiny-deepseek-mtp", "--feed", "mtp", "--steps", "4",
                         "--allow-thin")
    assert code == 0, err
    code, out, err = cli("replay", path, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["head"]["source"] == "native" and r["head"]["block"] == "DeepseekV3DecoderLayer"
    for v in r["verify"]:
        c = v["comparisons"][0]
        assert c["mismatched_steps"] == 0 and c["draft_mismatched_steps"] == 0 and v["detection_control"]["fired"]
    # A random head is never accepted, so the only reasons are thinness.
    assert all("full and partial" in x for x in r["reasons"])


def test_first_propose_matches_later_ones():
    """A process's first proposal equals its later ones, so no warm-up run is discarded (the report's
    ``warmup: false``): checked in a fresh process, where nothing has run before."""
    code = """
import torch
from vd.loop import DrafterFeed, run_verify
from vd.models import load_model
m = load_model("tiny-llama-mtp")
p = m.encode("warm-up check")
runs = [run_verify(m, p, 4, 6, DrafterFeed(4, 6)) for _ in range(3)]
same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0].draft_rows, r.draft_rows))
print("SAME" if same and runs[0].drafts == runs[1].drafts == runs[2].drafts else "DIFFERENT")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "SAME", out.stderr


class TestAttachedHeadConformance(ModelConformance, DraftHeadConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return load_model("tiny-llama-mtp")


class TestNativeDeepSeekConformance(ModelConformance, DraftHeadConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return load_model("tiny-deepseek-mtp")


class TestNativeGlm4MoeConformance(ModelConformance, DraftHeadConformance):
    @pytest.fixture(scope="class")
    @classmethod
    def model(cls):
        return load_model("tiny-glm4moe-mtp", dtype="float32")


def test_native_head_from_checkpoint(tmp_path, cli):
    """A checkpoint that carries its MTP layer the way DeepSeek-V3 ships it (``model.layers.61.*``,
    ``shared_head.norm``) loads with HF's own MtpModel.from_pretrained, weights intact."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config

    from vd.models.mtp import native_layer
    from vd.models.seeded import build_random

    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=61,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2, n_shared_experts=1, num_experts_per_tok=1,
        n_group=1, topk_group=1, first_k_dense_replace=62, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8, num_nextn_predict_layers=1, max_position_embeddings=256,
        initializer_range=0.1)
    main = build_random(cfg, seed=0, name="ds", device=torch.device("cpu"), dtype=torch.float32).model
    layer, _ = native_layer(main, seed=1)  # HF's MtpModel over ``main``, seeded
    ckpt = tmp_path / "ds-ckpt"
    main.save_pretrained(ckpt)
    weights = load_file(ckpt / "model.safetensors")
    for k, v in layer.state_dict().items():  # back to the checkpoint's names
        weights["model.layers.61." + k.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")] = v
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})

    model = load_model(str(ckpt), dtype="float32")
    assert model.head_info()["source"] == "native"
    want, got = layer.state_dict(), model.head_layer.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    code, out, err = cli("record", tmp_path / "g.zarr", "--model", ckpt, "--feed", "mtp", "--k", "2", "--steps", "3",
                         "--dtype", "float32", "--allow-thin")
    assert code == 0, err
