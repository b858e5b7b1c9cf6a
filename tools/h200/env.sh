# Sourced on a lent GPU machine from the repository root, with .whl/ carried (`carry: [".whl"]`): installs the
# wheels the machine lacks (py3.12; transformers pinned as in pyproject.toml) into /tmp/site, and puts them and
# tools/ (the benchmarks' shared `figures`) on the path. vd itself is imported from the checkout (its folders
# are its import paths: `python3 -m vd`, `python3 -m pytest -m gpu` and `python3 tools/bench_gpu.py` run from
# the root as they are); a vd wheel in .whl is installed too and holds the same files.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/tools
