"""`vd.rowmath.measure_differing` against an earlier commit's, figure by figure, on CUDA: 48 pairs of row blocks
(bf16, fp16, fp32; 1-32 rows of 5-151936 values; every second pair with a NaN and an Inf) under each of the six
policies; prints how many of the 288 cases differ in any figure (bit for bit).

    git show 8dadda1:vd/rowmath.py > OLD; python3 tools/h200/measure_same.py OLD
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import checkout  # noqa: F401,E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from measure_ab import _old  # noqa: E402

from vd import rowmath  # noqa: E402
from vd.dtypes import int_view  # noqa: E402
from vd.policy import parse_spec  # noqa: E402

SPECS = ("exact", "ulp:2", "atol:0.1,rtol:0.01", "argmax", "topk:3", "kl:0.001")
LOGICAL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def main() -> None:
    old = _old(sys.argv[1])
    torch.manual_seed(0)
    bad = n = 0
    for trial in range(48):
        d, v = [1, 3, 8, 32][trial % 4], [5, 64, 1000, 151936][(trial // 4) % 4]
        dt = [torch.bfloat16, torch.float16, torch.float32][trial % 3]
        g = (torch.randn(d, v, device="cuda") * 5).to(dt)
        c = (g.float() + torch.randn(d, v, device="cuda") * 0.01).to(dt)
        if trial % 2:
            c[0, 0], c[-1, -1] = float("nan"), float("inf")
        gb = int_view(g).clone()
        for spec in SPECS:
            a = old(gb, c, LOGICAL[dt], parse_spec(spec))
            b = rowmath.measure_differing(gb, c, LOGICAL[dt], parse_spec(spec))
            same = (a[1] == b[1]).all() and (a[2] == b[2]).all()
            same = same and all(np.array_equal(a[0][m], b[0][m], equal_nan=True) for m in rowmath.MEASURES)
            n, bad = n + 1, bad + (not same)
    print(f"cuda: {n} cases, {bad} differ")


if __name__ == "__main__":
    main()
