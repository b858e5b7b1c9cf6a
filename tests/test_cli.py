"""vd as a user drives it from a shell: exit codes, one-line errors, what is printed and written, and a
golden kept in a directory, a zip file or on S3."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import zarr
from golden_edit import chunk, damage, edit_meta

PLUGINS = Path(__file__).parent / "plugins"


def _tree_hash(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


def _one_line_error(code, out, err, *needles, exit_code=2):
    assert code == exit_code, (code, out, err)
    assert err.startswith("vd: ") and err.strip().count("\n") == 0, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


def test_round_trip_passes_with_report(cli, tiny_golden, tmp_path):
    report = tmp_path / "out" / "report.json"
    code, out, err = cli("replay", tiny_golden, "--report", report)
    assert code == 0, out + err
    assert out.rstrip().endswith("PASS")
    r = json.loads(report.read_text())
    assert r["verdict"] == "PASS" and r["reasons"] == [] and r["mtp"] is False and r["graphs"] == "eager"
    assert r["golden"] == str(tiny_golden) and r["rows"] == {"slim": False, "source": str(tiny_golden)}
    assert set(r["environment"]) == {"recorded", "replayed", "numerics_differences"}
    assert r["environment"]["recorded"]["torch"] == r["environment"]["replayed"]["torch"]
    assert [v["k"] for v in r["verify"]] == [2, 3, 4]
    for v in r["verify"]:
        (c,) = v["comparisons"]
        assert c["variant"] == "eager" and c["prefill_equal"] and c["mismatched_steps"] == 0
        assert c["steps"] == 8 and c["first_mismatch"] is None and c["max_abs_diff"] == 0.0
        assert set(v) == {"k", "accepted", "accept_histogram", "coverage", "comparisons", "timings",
                          "detection_control"}
        # The control changed step 4's last draft: steps before it still match, step 4 differs.
        dc = v["detection_control"]
        assert dc["fired"] and dc["changed_step"] == 4 and dc["mismatched_step_list"][0] == 4


def test_python_m_vd_is_the_command_line():
    done = subprocess.run([sys.executable, "-m", "vd", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "record" in done.stdout and "replay" in done.stdout and "slim" in done.stdout


def test_refused_overwrite_leaves_golden_intact(cli, tiny_golden):
    before = _tree_hash(tiny_golden)
    _one_line_error(*cli("record", tiny_golden, "--model", "tiny-qwen2", "--steps", "8"), "already holds a golden",
                    "--refresh")
    assert _tree_hash(tiny_golden) == before


@pytest.mark.parametrize("name", ["g.zarr", "g.zip"])
def test_refresh_replaces(cli, tmp_path, name):
    path = tmp_path / name
    assert cli("record", path, "--model", "tiny-llama", "--steps", "4", "--k", "2")[0] == 0
    assert cli("record", path, "--model", "tiny-qwen2", "--steps", "4", "--k", "2", "--refresh")[0] == 0
    code, out, err = cli("show", path)
    assert code == 0 and "tiny-qwen2" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "directory", "zarr.json"])
def test_damaged_goldens_exit_2(cli, tiny_copy, how):
    if how == "zarr.json":
        (tiny_copy / "zarr.json").write_text((tiny_copy / "zarr.json").read_text()[:50])
    else:
        damage(chunk(tiny_copy, 4, "logits", 6), how)
    for cmd in ("show", "replay"):  # the replay's control moves steps 4-7 of K=4: their rows are read
        _one_line_error(*cli(cmd, tiny_copy), str(tiny_copy))


def test_non_golden_paths_exit_2(cli, tmp_path):
    _one_line_error(*cli("replay", tmp_path / "nope.zarr"), "does not exist")
    (tmp_path / "dir").mkdir()
    _one_line_error(*cli("replay", tmp_path / "dir"), "not a vd golden")
    (tmp_path / "f.txt").write_text("x")
    _one_line_error(*cli("show", tmp_path / "f.txt"), "not a vd golden")
    zarr.create_group(tmp_path / "plain.zarr")
    _one_line_error(*cli("replay", tmp_path / "plain.zarr"), "not a vd golden")
    _one_line_error(*cli("replay", "gs://bucket/g.zarr"), "unsupported URL scheme")


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
    (["--model", "tiny-llama", "--compress"], "No such option"),  # rows are compact by default now
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
    """A golden recorded with a forward this machine does not offer (``graphed`` on CUDA, replayed on a
    CPU): one line saying which forward it was and what to pass, not a bare 'no forward'."""
    edit_meta(tiny_copy, lambda m: m.update(forward="graphed"))
    _one_line_error(*cli("replay", tiny_copy), "recorded with forward 'graphed'", "on cpu", "--forward", "eager")
    code, out, err = cli("replay", tiny_copy, "--forward", "eager")
    assert code == 0, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_golden_on_a_cpu_machine_says_what_to_pass(cli, tiny_copy):
    """A golden recorded on CUDA with a CUDA-only forward, replayed where there is no GPU: the one line
    names both flags it takes (--device cpu, and --forward unless one was given)."""
    edit_meta(tiny_copy, lambda m: m.update(device="cuda", forward="graphed"))
    _one_line_error(*cli("replay", tiny_copy), "no CUDA device", "--device cpu", "--forward", "'graphed'")
    code, out, err = cli("replay", tiny_copy, "--forward", "eager")
    assert code == 2 and "--device cpu" in err and "--forward" not in err
    code, out, err = cli("replay", tiny_copy, "--device", "cpu", "--forward", "eager")
    assert code == 0, err


def test_show_models_forwards(cli, tiny_golden):
    code, out, err = cli("show", tiny_golden)
    assert code == 0, err
    lines = out.splitlines()
    assert "tiny-llama" in out and "sha256:" in out and "forward   eager: " in out
    assert "K=4  accepted [3, 1, 3, 0, 3, 2, 3, 1]  histogram {0:1, 1:2, 2:1, 3:4}" in out
    assert any(line.startswith("          CPU ") and " threads" in line for line in lines)
    assert "rows as byte planes: high byte zstd-1 + crc32c, other bytes + crc32c" in out
    assert "each checked against its row's bytes" in out
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
    _one_line_error(*cli("replay", tiny_golden, "--report", blocker / "r.json"), "not a writable directory")
    _one_line_error(*cli("record", tmp_path / "g.zarr", "--model", "tiny-llama", "--prompt", ""), "no tokens")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_an_internal_error_is_one_line_naming_its_traceback_file(cli, tiny_golden, monkeypatch):
    """A crash that is no user's fault (here a model whose forward raises) exits 3 with one line; the
    traceback goes to the file that line names."""
    monkeypatch.setenv("VD_CRASH_AT_STEP", "2")
    code, out, err = cli("replay", tiny_golden, "--model", f"{PLUGINS / 'crashing.py'}:factory")
    _one_line_error(code, out, err, "internal error", "RuntimeError", "kernel fault at step 2", exit_code=3)
    trace = Path(err.split("traceback in ")[1].rstrip(")\n"))
    assert "Traceback" in trace.read_text() and "kernel fault at step 2" in trace.read_text()
    trace.unlink()


def test_slim_command_and_its_replays(cli, tiny_golden, tmp_path):
    slim = tmp_path / "s.zarr"
    code, out, err = cli("slim", tiny_golden, slim)
    assert code == 0 and f"wrote {slim}" in out and f"--rows {tiny_golden}" in out, out + err
    assert cli("replay", slim)[0] == 0
    code, out, err = cli("show", slim)
    assert code == 0 and "slim: no rows (made from" in out
    _one_line_error(*cli("replay", slim, "--tolerance", "kl:0.1"), "is slim", "--rows")
    code, out, err = cli("replay", slim, "--tolerance", "kl:0.1", "--rows", tiny_golden)
    assert code == 0, err
    _one_line_error(*cli("slim", tiny_golden, slim), "already holds a golden")
    assert cli("slim", tiny_golden, slim, "--refresh")[0] == 0


def test_goldens_in_a_zip_file_and_on_s3(cli, tiny_golden, tmp_path, s3):
    """record, replay, show, slim and diff with a golden in a zip file and one under an s3:// prefix."""
    for where in (tmp_path / "g.zip", s3):
        code, out, err = cli("record", where, "--model", "tiny-llama", "--steps", "8")
        assert code == 0 and f"recorded {where}" in out, err
        code, out, err = cli("replay", where, "--report", tmp_path / "r.json")
        assert code == 0 and json.loads((tmp_path / "r.json").read_text())["golden"] == str(where), out + err
        code, out, err = cli("show", where)
        assert code == 0 and str(where) in out.splitlines()[0], err
        assert cli("diff", tiny_golden, where)[0] == 0
    code, out, err = cli("slim", s3, tmp_path / "s.zip")
    assert code == 0, err
    assert cli("replay", tmp_path / "s.zip", "--rows", s3, "--tolerance", "kl:0.1")[0] == 0
    _one_line_error(*cli("record", s3, "--model", "tiny-llama"), "already holds a golden")
