#!/usr/bin/env bash
# Install llama-cpp-python, for vd's llama.cpp adapter (--model llamacpp:PATH.gguf) and its tests, into the
# active virtual environment (as tools/setup.sh; VD_SYSTEM_PIP=1 for a python outside one). PyPI has no wheel
# for it: the first run builds one from source (ninja and a C++ compiler; how long depends on the host, and
# tools/time_tests.py measures it; portable CPU code, CMAKE_ARGS=-DGGML_NATIVE=off unless CMAKE_ARGS is set) and
# caches it in $VD_WHEEL_CACHE (default ~/.cache/vd/wheels); later runs install the cached wheel in seconds.
# A CUDA build: CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" (nvcc; 4.5 minutes on an H200 host's
# 16 cores), cached apart (cuda/). This script adds the linker flags and the OpenMP setting of the build proven
# on the H200 (tools/h200/llamacpp_cuda.sh): without -Wl,--exclude-libs,ALL nvcc's link (CUDA 13) exports a
# static copy of libstdc++ from libggml-cuda.so that crashes beside PyTorch (vd refuses such a build, naming
# the flag); -Bsymbolic-functions and GGML_OPENMP=off (PyTorch brings its own libgomp) came with it.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36  # as pyproject.toml's llamacpp extra pins it
PY=python3
pip_install=("$PY" -m pip install --quiet)
if [ "$("$PY" -c 'import sys; print(sys.prefix != sys.base_prefix)')" != True ]; then
  if [ "${VD_SYSTEM_PIP:-}" != 1 ]; then
    echo "tools/setup_llamacpp.sh: not in a virtual environment; make one first (see tools/setup.sh)" >&2
    exit 2
  fi
  pip_install+=(--break-system-packages)
fi
cache="${VD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/vd/wheels}"
args="${CMAKE_ARGS:--DGGML_NATIVE=off}"
case "$args" in
  *GGML_CUDA=on*|*GGML_CUDA=ON*|*GGML_CUDA=1*)
    cache="$cache/cuda"
    case "$args" in *CMAKE_SHARED_LINKER_FLAGS*) ;; *) args="$args -DCMAKE_SHARED_LINKER_FLAGS=-Wl,-Bsymbolic-functions,--exclude-libs,ALL" ;; esac
    case "$args" in *GGML_OPENMP*) ;; *) args="$args -DGGML_OPENMP=off" ;; esac ;;
esac
mkdir -p "$cache"
wheel=$(ls "$cache"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "tools/setup_llamacpp.sh: building llama-cpp-python $VERSION from source into $cache" \
       "(minutes: how many depends on the host's cores)" >&2
  start=$(date +%s)
  CMAKE_ARGS="$args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$PY" -m pip wheel --quiet --no-deps "llama-cpp-python==$VERSION" -w "$cache"
  echo "tools/setup_llamacpp.sh: built in $(( $(date +%s) - start )) s" >&2
  wheel=$(ls "$cache"/llama_cpp_python-"$VERSION"-*.whl | head -1)
fi
"${pip_install[@]}" "$wheel"
