#!/usr/bin/env bash
# Install llama-cpp-python, for vd's llama.cpp adapter (--model llamacpp:PATH.gguf) and its tests, into the
# active virtual environment (as tools/setup.sh; VD_SYSTEM_PIP=1 for a python outside one). PyPI has no wheel
# for it: the first run builds one from source (about 7 minutes on 2 cores, ninja and a C++ compiler; portable
# CPU code, CMAKE_ARGS=-DGGML_NATIVE=off unless CMAKE_ARGS is set, e.g. -DGGML_CUDA=on) and caches it in
# $VD_WHEEL_CACHE (default ~/.cache/vd/wheels); later runs install the cached wheel in seconds.
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
mkdir -p "$cache"
wheel=$(ls "$cache"/llama_cpp_python-"$VERSION"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "tools/setup_llamacpp.sh: building llama-cpp-python $VERSION from source (about 7 minutes on 2 cores)" \
       "into $cache" >&2
  start=$(date +%s)
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=off}" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$PY" -m pip wheel --quiet --no-deps "llama-cpp-python==$VERSION" -w "$cache"
  echo "tools/setup_llamacpp.sh: built in $(( $(date +%s) - start )) s" >&2
  wheel=$(ls "$cache"/llama_cpp_python-"$VERSION"-*.whl | head -1)
fi
"${pip_install[@]}" "$wheel"
