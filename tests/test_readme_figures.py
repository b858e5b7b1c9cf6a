"""The README's measured figures are generated from the committed benchmark JSON (tools/readme_figures.py): its
blocks must equal what the JSON gives, so a stale figure fails here; a changed figure changes its block; and
the test command's timing (tools/time_tests.py) renders whether it has been measured or not."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up while it is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.fixture(scope="module")
def figures():
    return _load("readme_figures")


@pytest.fixture
def time_tests(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))  # it imports tools/figures.py, as it does when run as a script
    return _load("time_tests")


@pytest.fixture
def sources(figures, tmp_path) -> Path:
    """A copy of every block's source JSON under ``tmp_path``, at the same relative paths."""
    for block in figures.BLOCKS.values():
        if (ROOT / block.source).exists():
            (tmp_path / block.source).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / block.source, tmp_path / block.source)
    return tmp_path


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _block(text: str, name: str, figures) -> str:
    return next(m[0] for m in figures.BLOCK.finditer(text) if m["name"] == name)


def test_the_readme_blocks_are_what_the_committed_json_gives(figures):
    differ = figures.check(ROOT / "README.md")
    assert not differ, (f"README.md's blocks {differ} differ from their JSON: run python tools/readme_figures.py "
                        "--write (python tools/readme_figures.py --check shows how)")


def test_every_block_states_command_date_commit_host_and_load(figures):
    readme = (ROOT / "README.md").read_text()
    for name, block in figures.BLOCKS.items():
        text = _block(readme, name, figures)
        assert f"from {block.source}; do not edit" in text
        if (ROOT / block.source).exists():
            assert "Made by `" in text and "commit: " in text and "host: " in text and "load" in text, name


def test_a_changed_figure_changes_its_block_and_fails_the_check(figures, sources):
    readme = (ROOT / "README.md").read_text()
    assert figures.rendered(readme, sources)[1] == []

    _edit(sources / "tools/bench_cpu.json", lambda d: d["seconds"]["record"].update(median=9.87))
    new, changed = figures.rendered(readme, sources)
    assert changed == ["bench_cpu"]
    assert "| 9.87 s |" in _block(new, "bench_cpu", figures)
    assert "| 9.87 s |" not in _block(readme, "bench_cpu", figures)

    def slower(runs):
        runs[0]["rows"][0]["spread"]["step_ms"]["max"] = 99.5
    _edit(sources / "tools/bench_gpu.json", slower)
    assert figures.rendered(readme, sources)[1] == ["bench_gpu", "bench_cpu"]


def test_a_gpu_row_without_commit_or_gpu_id_says_not_recorded(figures):
    runs = json.loads((ROOT / "tools/bench_gpu.json").read_text())
    run = copy.deepcopy(runs[0])
    run.pop("code", None)
    run.pop("commit", None)
    run.pop("gpu_id", None)
    run.update(commit="abc1234")
    assert "| abc1234 | NVIDIA H200, id not recorded |" in figures.render_bench_gpu([run])
    run.pop("commit")
    text = figures.render_bench_gpu([run])
    assert "commit: not recorded" in text and "| not recorded | NVIDIA H200, id not recorded |" in text
    run.update(gpu_id="GPU-1234", load_before=[0.5, 0.4, 0.3], load_after=[1.0, 0.6, 0.4])
    text = figures.render_bench_gpu([run])
    assert "NVIDIA H200, GPU-1234 |" in text
    assert "load average (1, 5, 15 min): 0.50 0.40 0.30 before, 1.00 0.60 0.40 after" in text


def test_check_and_write_from_the_command_line(figures, sources, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())
    _edit(sources / "tools/bench_stores.json", lambda d: d["seconds_median"]["zip"].update(record_s=1.25))

    def run(*args: str):
        return subprocess.run([sys.executable, str(TOOLS / "readme_figures.py"), *args, "--readme", str(readme),
                               "--root", str(sources)], capture_output=True, text=True, timeout=60)

    done = run("--check")
    assert done.returncode == 1, done.stderr
    assert "block bench_stores differs from tools/bench_stores.json" in done.stderr
    assert "bench_cpu" not in done.stderr
    assert run("--write").returncode == 0
    assert "| 1.25 s (" in readme.read_text()
    done = run("--check")
    assert done.returncode == 0, done.stderr

    readme.write_text(readme.read_text() + "\n<!-- figures: nonsense (x) -->\n<!-- end figures -->\n")
    done = run("--check")
    assert done.returncode == 2 and "nonsense" in done.stderr


def test_a_block_missing_from_the_readme_is_named(figures, tmp_path):
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    readme.write_text(text.replace(_block(text, "bench_stores", figures), "the figures were here"))
    assert figures.check(readme) == ["bench_stores"]


def test_the_test_time_block_renders_measured_or_not(figures, time_tests, sources, tmp_path):
    readme = (ROOT / "README.md").read_text()
    (sources / "tools/test_time.json").unlink(missing_ok=True)
    absent = figures.render("test_time", sources)
    assert "Not measured yet (`python tools/time_tests.py --out tools/test_time.json`)." in absent

    out = sources / "tools/test_time.json"
    assert time_tests.main(["--parts", "pytest", "--pytest-args=--version", "--out", str(out)]) == 0
    measured = json.loads(out.read_text())
    assert [p["name"] for p in measured["parts"]] == ["pytest"]
    assert measured["parts"][0]["command"] == "python -m pytest --version"
    assert {"cpu_model", "cpu_count"} <= set(measured["machine"]) and len(measured["load_before"]) == 3
    assert measured["load_after"] and measured["date"] and "commit" in measured
    text = figures.render("test_time", sources)
    assert "| pytest | `python -m pytest --version` |" in text and "host: " in text and "load average" in text
    assert "test_time" in figures.rendered(readme, sources)[1]


def test_time_tests_says_where_the_wheel_came_from_and_what_pytest_ran(time_tests, monkeypatch):
    assert time_tests.BUILT in (TOOLS / "setup_llamacpp.sh").read_text()  # the line it looks for is the script's
    built = "tools/setup_llamacpp.sh: building llama-cpp-python 0.3.36 from source into /x"
    for no_cache, pip_cache in (("", True), ("1", False)):
        monkeypatch.setenv("PIP_NO_CACHE_DIR", no_cache)  # pip's own cache of built wheels: off, a cold build
        assert time_tests.describe("llamacpp", ["a", built]) == {"wheel": "built", "pip_cache": pip_cache}
    assert time_tests.describe("llamacpp", ["Processing ./llama_cpp_python.whl"])["wheel"] == "cache"
    out = time_tests.describe("pytest", ["...", "== 1201 passed, 33 skipped, 2 deselected in 2101.52s (0:35:01) =="])
    assert out == {"summary": "1201 passed, 33 skipped, 2 deselected",
                   "counts": {"passed": 1201, "skipped": 33, "deselected": 2}}
    with pytest.raises(SystemExit):
        time_tests.main(["--parts", "setup,tests", "--out", "x.json"])


def test_a_target_is_met_only_where_every_repetition_is_within_it(figures):
    runs = [r for r in json.loads((ROOT / "tools/bench_gpu.json").read_text()) if r["model"] == "llama3-8b-shape"]
    run = copy.deepcopy(runs[-1])
    for r in run["rows"]:
        r["spread"]["replay_ratio"].update(min=1.0, median=1.01, max=1.02)
    line = next(x for x in figures.render_speed_targets([run]).splitlines() if x.startswith("| replay ratio")
                and "`graphed`" in x)
    assert line.endswith("| ≤ 1.03 | 1.010 | 1.020 | met |"), line
    run["rows"][-1]["spread"]["replay_ratio"]["max"] = 1.031  # one repetition of one K over
    text = figures.render_speed_targets([run])
    assert "| ≤ 1.03 | 1.010 | 1.031 | missed |" in text and "Made by `" in text
    assert figures.render_speed_targets([{**run, "model": "llama3-70b-shape"}]).count("| replay ratio") == 0
