"""vd as a user drives it: record, replay, break things on purpose, read the verdict and the errors."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from vd.golden import rewrite_summaries, to_float
from vd.models import load_model

PLUGINS = Path(__file__).parent / "plugins"


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


def _one_line_error(code, out, err, *needles):
    assert code == 2, (code, out, err)
    assert err.startswith("vd: error: ") and err.strip().count("\n") == 0, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


def test_round_trip_passes_with_report(cli, tiny_golden, tmp_path):
    report = tmp_path / "out" / "report.json"
    code, out, err = cli("replay", tiny_golden, "--report", report)
    assert code == 0, out + err
    assert "PASS" in out
    r = json.loads(report.read_text())
    for field in ("graphs", "mtp", "steps", "variants", "verify", "verdict", "reasons", "golden", "environment"):
        assert field in r
    assert r["verdict"] == "PASS" and r["reasons"] == [] and r["mtp"] is False and r["graphs"] == "eager"
    assert r["golden"] == str(tiny_golden)
    assert set(r["environment"]) >= {"recorded", "replayed"}
    assert r["environment"]["recorded"]["torch"] == r["environment"]["replayed"]["torch"]
    assert [v["k"] for v in r["verify"]] == [2, 3, 4]
    for v in r["verify"]:
        (c,) = v["comparisons"]
        assert c["variant"] == "eager" and c["prefill_equal"] and c["mismatched_steps"] == 0
        assert c["steps"] == 8 and c["first_mismatch"] is None and c["max_abs_diff"] == 0.0
        assert {"k", "accepted", "comparisons", "timings", "detection_control"} <= set(v)
        # The control changed step 4's last draft: steps before it still match, step 4 differs.
        dc = v["detection_control"]
        assert dc["fired"] and dc["changed_step"] == 4 and dc["mismatched_step_list"][0] == 4


def test_eager_and_sdpa_reported_as_they_really_compare(cli, tiny_golden, tmp_path):
    report = tmp_path / "r.json"
    code, out, err = cli("replay", tiny_golden, "--forward", "eager", "--forward", "sdpa", "--report", report)
    r = json.loads(report.read_text())
    # Compute the two prefills directly, outside vd's loop.
    m = load_model("tiny-llama")
    prompt = zarr.open_group(tiny_golden, mode="r")["prompt"][:].tolist()
    rows = {}
    for name in ("eager", "sdpa"):
        m.set_forward(name)
        m.reset()
        rows[name] = m.forward(prompt)
    really_equal = torch.equal(rows["eager"], rows["sdpa"])
    for v in r["verify"]:
        eager, sdpa = v["comparisons"]
        assert (eager["variant"], sdpa["variant"]) == ("eager", "sdpa")
        assert eager["prefill_equal"] and eager["mismatched_steps"] == 0
        assert sdpa["prefill_equal"] == really_equal
    assert (code == 0) == (r["verdict"] == "PASS")
    assert (code == 0) == really_equal  # tiny-llama, bf16, CPU: SDPA differs from eager
    assert [x["name"] for x in r["variants"]] == ["eager", "sdpa"]
    assert all(x["description"] for x in r["variants"])


def test_one_edited_element_is_the_first_mismatch(cli, tiny_copy, tmp_path):
    arr = zarr.open_array(tiny_copy / "k3" / "logits", mode="r+")
    original = int(arr[5, 2, 100])
    arr[5, 2, 100] = original ^ 0x0001  # the next-door bf16 value
    rewrite_summaries(tiny_copy, 3)  # as a recording whose model computed that value
    code, out, err = cli("replay", tiny_copy, "--report", tmp_path / "r.json")
    assert code == 1 and "FAIL" in out
    r = json.loads((tmp_path / "r.json").read_text())
    by_k = {v["k"]: v["comparisons"][0] for v in r["verify"]}
    assert by_k[2]["mismatched_steps"] == 0 and by_k[4]["mismatched_steps"] == 0
    c = by_k[3]
    assert c["prefill_equal"] and c["mismatched_steps"] == 1 and c["mismatched_step_list"] == [5]
    golden, got = (float(to_float(np.array([b], dtype=np.uint16), "bfloat16")[0]) for b in (original ^ 1, original))
    assert c["first_mismatch"] == {"step": 5, "row": 2, "index": 100, "golden": golden, "got": got}
    assert c["max_abs_diff"] == abs(golden - got)
    assert any("K=3, eager" in x and "step 5 row 2 index 100" in x for x in r["reasons"])


def test_perturbed_plugin_fails_at_that_step(cli, tiny_golden, tmp_path, monkeypatch):
    monkeypatch.setenv("VD_PERTURB_STEP", "3")
    code, out, err = cli("replay", tiny_golden, "--model", f"{PLUGINS / 'perturb.py'}:factory",
                         "--report", tmp_path / "r.json")
    assert code == 1, out + err
    r = json.loads((tmp_path / "r.json").read_text())
    for v in r["verify"]:
        c = v["comparisons"][0]
        assert c["prefill_equal"] and c["mismatched_step_list"] == [3]
        assert (c["first_mismatch"]["step"], c["first_mismatch"]["row"], c["first_mismatch"]["index"]) == (3, 1, 7)


def test_blind_control_fails(cli, golden_dir, tmp_path):
    path = golden_dir / "deaf.zarr"
    code, out, err = cli("record", path, "--model", f"{PLUGINS / 'deaf.py'}:factory", "--steps", "8",
                         "--allow-thin")
    assert code == 0, err
    code, out, err = cli("replay", path, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and r["verdict"] == "FAIL"
    assert all(c["mismatched_steps"] == 0 for v in r["verify"] for c in v["comparisons"])
    assert all(not v["detection_control"]["fired"] for v in r["verify"])
    assert any("detection control saw no difference" in x for x in r["reasons"])


def test_thin_reference_is_refused_then_fails(cli, tmp_path):
    path = tmp_path / "thin.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama", "--steps", "1", "--k", "3")
    assert code == 1 and "too thin" in err and not path.exists()
    code, out, err = cli("record", path, "--model", "tiny-llama", "--steps", "1", "--k", "3", "--allow-thin")
    assert code == 0 and path.exists()
    code, out, err = cli("replay", path, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 1
    assert r["verify"][0]["comparisons"][0]["mismatched_steps"] == 0
    assert any("needs both full and partial accepts" in x for x in r["reasons"])


def test_refused_overwrite_leaves_golden_intact(cli, tiny_golden):
    before = _tree_hash(tiny_golden)
    code, out, err = cli("record", tiny_golden, "--model", "tiny-qwen2", "--steps", "8")
    _one_line_error(code, out, err, "already holds a golden", "--refresh")
    assert _tree_hash(tiny_golden) == before


def test_refresh_replaces(cli, tmp_path):
    path = tmp_path / "g.zarr"
    assert cli("record", path, "--model", "tiny-llama", "--steps", "4", "--k", "2")[0] == 0
    assert cli("record", path, "--model", "tiny-qwen2", "--steps", "4", "--k", "2", "--refresh")[0] == 0
    code, out, err = cli("show", path)
    assert code == 0 and "tiny-qwen2" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.zarr"]


def _flip(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "zarr.json"])
def test_damaged_goldens_exit_2(cli, tiny_copy, damage):
    chunk = tiny_copy / "k4" / "logits" / "c" / "6" / "0" / "0"
    if damage == "flip":
        _flip(chunk)
    elif damage == "truncate":
        chunk.write_bytes(chunk.read_bytes()[:10])
    elif damage == "delete":
        chunk.unlink()
    else:
        (tiny_copy / "zarr.json").write_text((tiny_copy / "zarr.json").read_text()[:50])
    for cmd in ("replay", "show"):
        code, out, err = cli(cmd, tiny_copy)
        _one_line_error(code, out, err, str(tiny_copy))


def test_non_golden_paths_exit_2(cli, tmp_path):
    _one_line_error(*cli("replay", tmp_path / "nope.zarr"), "does not exist")
    (tmp_path / "dir").mkdir()
    _one_line_error(*cli("replay", tmp_path / "dir"), "not a vd golden")
    (tmp_path / "f.txt").write_text("x")
    _one_line_error(*cli("show", tmp_path / "f.txt"), "not a vd golden")
    zarr.create_group(tmp_path / "plain.zarr")
    _one_line_error(*cli("replay", tmp_path / "plain.zarr"), "not a vd golden")


@pytest.mark.parametrize("args, needle", [
    (["--model", "no-such-model"], "unknown model"),
    (["--model", "tiny-llama", "--forward", "flash"], "no forward 'flash'"),
    (["--model", "tiny-llama", "--k", "2,x"], "comma-separated"),
    (["--model", "tiny-llama", "--k", "1"], "K must be 2"),
    (["--model", "tiny-llama", "--k", "2,2"], "repeated"),
    (["--model", "tiny-llama", "--steps", "0"], "--steps"),
    (["--model", "tiny-llama", "--dtype", "int8"], "unknown dtype"),
    (["--model", f"{PLUGINS / 'notamodel.py'}:factory"], "lacks"),
    (["--model", f"{PLUGINS / 'absent.py'}:factory"], "does not exist"),
    (["--model", "tiny-llama", "--device", "cuda"] if not torch.cuda.is_available() else
     ["--model", "tiny-llama", "--device", "tpu"], "device"),
    (["--model", "tiny-llama", "--bogus-flag"], "No such option"),
])
def test_bad_record_input_exits_2(cli, tmp_path, args, needle):
    path = tmp_path / "g.zarr"
    _one_line_error(*cli("record", path, *args), needle)
    assert not path.exists()


def test_model_mismatch(cli, tiny_golden, tmp_path):
    _one_line_error(*cli("replay", tiny_golden, "--model", "tiny-qwen2"), "vocab")
    reseeded = f"{PLUGINS / 'reseeded.py'}:factory"
    _one_line_error(*cli("replay", tiny_golden, "--model", reseeded), "fingerprint", "--allow-model-mismatch")
    code, out, err = cli("replay", tiny_golden, "--model", reseeded, "--allow-model-mismatch",
                         "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and r["verdict"] == "FAIL" and r["notes"] and "fingerprint" in r["notes"][0]


def test_replay_unknown_forward_exits_2(cli, tiny_golden):
    _one_line_error(*cli("replay", tiny_golden, "--forward", "flash"), "no forward 'flash'", "eager")


def test_replay_of_a_forward_this_device_lacks_names_the_choice(cli, tiny_copy):
    """A golden recorded with a forward this machine does not offer (``graphed`` on CUDA, replayed on
    a CPU): one line saying which forward it was and what to pass, not a bare 'no forward'."""
    meta_file = tiny_copy / "zarr.json"
    doc = json.loads(meta_file.read_text())
    assert doc["attributes"]["vd"]["forward"] == "eager"
    doc["attributes"]["vd"]["forward"] = "graphed"
    meta_file.write_text(json.dumps(doc))
    _one_line_error(*cli("replay", tiny_copy), "recorded with forward 'graphed'", "on cpu", "--forward", "eager")
    code, out, err = cli("replay", tiny_copy, "--forward", "eager")
    assert code == 0, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_golden_on_a_cpu_machine_says_what_to_pass(cli, tiny_copy):
    """A golden recorded on CUDA with a CUDA-only forward, replayed where there is no GPU: the one line
    names both flags it takes (--device cpu, and --forward unless one was given)."""
    meta_file = tiny_copy / "zarr.json"
    doc = json.loads(meta_file.read_text())
    doc["attributes"]["vd"].update(device="cuda", forward="graphed")
    meta_file.write_text(json.dumps(doc))
    _one_line_error(*cli("replay", tiny_copy), "no CUDA device", "--device cpu", "--forward", "'graphed'")
    code, out, err = cli("replay", tiny_copy, "--forward", "eager")
    assert code == 2 and "--device cpu" in err and "--forward" not in err
    code, out, err = cli("replay", tiny_copy, "--device", "cpu", "--forward", "eager")
    assert code == 0, err


def test_show_models_forwards(cli, tiny_golden):
    code, out, err = cli("show", tiny_golden)
    assert code == 0
    assert "tiny-llama" in out and "sha256:" in out and "eager" in out
    assert "K=4  accepted [3, 1, 3, 0, 3, 2, 3, 1]" in out or "K=4  accepted" in out
    assert "histogram {0:" in out and "AVX" in out or "threads" in out
    assert "MB; logits rows bytes + crc32c" in out  # uncompressed unless recorded with --compress
    code, out, err = cli("models")
    assert code == 0 and "smollm2" in out and "tiny-llama" in out and "module:factory" in out
    code, out, err = cli("forwards", "--model", "tiny-llama")
    assert code == 0 and out.splitlines()[0].startswith("eager") and "sdpa" in out


def test_module_factory_plugin(cli, tiny_golden, monkeypatch, tmp_path):
    """The ``package.module:factory`` form: an importable module, here put on sys.path."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("VD_PERTURB_STEP", "5")
    code, out, err = cli("replay", tiny_golden, "--model", "perturb:factory", "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    assert code == 1 and all(v["comparisons"][0]["mismatched_step_list"] == [5] for v in r["verify"])
    _one_line_error(*cli("replay", tiny_golden, "--model", "no_such_module_xyz:factory"), "cannot import plug-in")


def test_unwritable_destinations_exit_2(cli, tiny_golden, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _one_line_error(*cli("record", blocker / "g.zarr", "--model", "tiny-llama"), "is not a directory")
    _one_line_error(*cli("replay", tiny_golden, "--report", blocker / "r.json"), "is not a directory")
    _one_line_error(*cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--prompt", ""), "no tokens")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_pinned_sdpa_backends_compared_as_they_are(cli, tiny_golden, tmp_path):
    """SDPA pinned to each backend the device runs is a forward of its own; each is reported as it
    really compares with the golden's eager rows."""
    m = load_model("tiny-llama")
    pinned = [f for f in m.forwards() if f.startswith("sdpa-")]
    assert "sdpa-math" in pinned  # every device has the math backend
    args = [x for f in ["sdpa", *pinned] for x in ("--forward", f)]
    code, out, err = cli("replay", tiny_golden, *args, "--report", tmp_path / "r.json")
    r = json.loads((tmp_path / "r.json").read_text())
    prompt = zarr.open_group(tiny_golden, mode="r")["prompt"][:].tolist()
    rows = {}
    for name in ["eager", "sdpa", *pinned]:
        m.set_forward(name)
        m.reset()
        rows[name] = m.forward(prompt)
    for c in r["verify"][0]["comparisons"]:
        assert c["prefill_equal"] == torch.equal(rows[c["variant"]], rows["eager"]), c["variant"]
    assert {v["name"] for v in r["variants"]} == {"sdpa", *pinned}


def test_record_compress_stores_blosc_rows_that_replay(cli, tmp_path):
    """``--compress``: Blosc-LZ4 rows (smaller on real logits), shown by ``vd show``, replayed as any."""
    path = tmp_path / "packed.zarr"
    code, out, err = cli("record", path, "--model", "tiny-llama", "--steps", "8", "--k", "2,4", "--compress")
    assert code == 0, err
    code, out, err = cli("show", path)
    assert code == 0 and "logits rows bytes + blosc + crc32c" in out
    code, out, err = cli("replay", path)
    assert code == 0 and "PASS" in out, out + err
