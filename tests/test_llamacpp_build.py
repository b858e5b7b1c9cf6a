"""A llama-cpp-python build that would crash vd's process is refused with one line (exit 2), before llama.cpp
loads anything: a shared library exporting its own static copy of libstdc++ (as nvcc's link of llama.cpp's
libggml-cuda.so under CUDA 13 made, crashing in std::regex beside PyTorch on the H200). The check reads ELF
dynamic symbol tables, tried here on libraries g++ links the three ways; it needs no llama-cpp-python."""

import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from vd.models.llamacpp import HIDE_STATIC, libstdcxx_exporters

SOURCE = """#include <regex>
#include <string>
extern "C" int match(const char* s) { return std::regex_match(std::string(s), std::regex("[a-z]+")); }
"""


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    """libstatic.so (libstdc++ linked in and exported), libhidden.so (linked in, hidden), libshared.so."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ to link the test libraries with")
    d = tmp_path_factory.mktemp("so")
    (d / "x.cpp").write_text(SOURCE)
    for name, flags in (("static", ["-static-libstdc++"]), ("hidden", ["-static-libstdc++", HIDE_STATIC]),
                        ("shared", [])):
        subprocess.run(["g++", "-shared", "-fPIC", *flags, str(d / "x.cpp"), "-o", str(d / f"lib{name}.so")],
                       check=True)
    (d / "x.cpp").unlink()
    (d / "notes.so.txt").write_text("not a library")  # a file that is not ELF is skipped
    return d


def test_only_a_library_exporting_libstdcxx_is_named(libs):
    assert libstdcxx_exporters(libs) == ["libstatic.so"]
    (libs / "libstatic.so.0").symlink_to(libs / "libstatic.so")  # a soname link is the same file, named once
    assert libstdcxx_exporters(libs) == ["libstatic.so"]


def test_a_build_exporting_libstdcxx_is_refused_in_one_line(cli, libs, tmp_path, monkeypatch):
    pkg = tmp_path / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    shutil.copy(libs / "libstatic.so", pkg / "lib" / "libggml-cuda.so")
    fake = types.ModuleType("llama_cpp")
    fake.__file__ = str(pkg / "__init__.py")
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    (tmp_path / "m.gguf").touch()  # (a missing GGUF is refused before the library is looked at)
    code, _, err = cli("record", tmp_path / "g.zarr", "--model", f"llamacpp:{tmp_path / 'm.gguf'}", "--steps", "2")
    line = err.strip().splitlines()[-1]
    assert code == 2 and "libggml-cuda.so" in line and "libstdc++" in line and HIDE_STATIC in line, err
    assert not (tmp_path / "g.zarr").exists()
