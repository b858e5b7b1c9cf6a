# Sourced on a lent GPU machine from the repository root, with .whl/ carried (`carry: [".whl"]`): installs
# vd's wheel and the wheels the machine lacks (py3.12; transformers pinned as in pyproject.toml) into
# /tmp/site, and puts them and tools/ (the benchmarks' shared `figures`) on the path. Run Python with -P
# there, so the source tree's folders never shadow the installed vd.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/tools
