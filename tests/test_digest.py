"""Row digests and statistics (`vd.digest`): exact integer sums, any changed bit seen, and what a golden stores."""

import numpy as np
import pytest
import torch

import vd.digest as D
from vd.dtypes import to_float, to_tensor
from vd.store import FORMAT_VERSION, open_golden


def _exact(rows: torch.Tensor) -> np.ndarray:
    """The digest by its definition, in exact integer arithmetic (numpy int64, no float involved)."""
    x = rows.reshape(rows.shape[0], -1).contiguous().view(torch.int16).numpy().astype(np.int64)
    return x @ D.weights(x.shape[1]).numpy().astype(np.int64)


@pytest.mark.parametrize("dtype, width", [(torch.bfloat16, 151936), (torch.float16, 1000), (torch.float32, 50000)])
def test_digest_is_the_exact_integer_sum(dtype, width):
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(5, width, generator=g) * 1e3).to(dtype)
    rows[0, :7] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 65504.0, -1e-8]).to(dtype)
    d = D.digest(rows)
    assert d.dtype == torch.float64 and d.shape == (5, D.LANES)
    assert np.array_equal(d.numpy().astype(np.int64), _exact(rows))
    assert np.abs(_exact(rows)).max() < 2 ** 53  # every sum exact in float64, in any order


def test_any_changed_bit_changes_the_digest_and_blocks_do_not(monkeypatch):
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(9, 4096, generator=g).to(torch.bfloat16)
    base = D.digest(rows)
    monkeypatch.setattr(D, "CPU_BLOCK_BYTES", 8 * 4096 * 2)  # two rows a block: five blocks
    assert torch.equal(D.digest(rows), base)
    bits = rows.view(torch.int16)
    for r, col, flip in ((0, 0, 1), (3, 4095, -32768), (8, 1234, 1 << 7)):
        changed = rows.clone()
        changed.view(torch.int16)[r, col] = bits[r, col] ^ flip
        differ = (D.digest(changed) != base).any(dim=1)
        assert differ.nonzero().flatten().tolist() == [r]
    zero, negzero = torch.zeros(1, 8, dtype=torch.bfloat16), torch.full((1, 8), -0.0, dtype=torch.bfloat16)
    assert not torch.equal(D.digest(zero), D.digest(negzero))  # -0.0 and 0.0 are different bits


def test_weight_width_keeps_every_sum_exact():
    assert D.bits_for(151936) == D.bits_for(2 ** 18) == 20
    assert D.bits_for(2 ** 18 + 1) == 19 and D.bits_for(2 ** 22) == 16
    for n in (1000, 151936, 2 ** 18, 2 ** 20):
        assert n * 2 ** 15 * (2 ** D.bits_for(n) - 1) < 2 ** 53
    assert D.meta(151936, 4) == {"scheme": D.SCHEME, "lanes": 6, "bits": 19, "words": 303872}


def test_a_recorded_golden_stores_its_rows_digests_and_statistics(tiny_golden):
    g = open_golden(tiny_golden)
    assert g.meta["format_version"] == FORMAT_VERSION and g.meta["digest"] == D.meta(512, 2)
    for k in g.ks:
        rows = g.verify_rows(k)
        digests, stats = D.summarise({kind: to_tensor(a) for kind, a in rows.items()})
        d, s = g.summary(k)
        assert np.array_equal(d, digests) and np.array_equal(s, stats)
        values = np.concatenate([to_float(a, "bfloat16") for a in rows.values()])
        assert np.array_equal(s[:, 0], values.argmax(1)) and np.array_equal(s[:, 1], values.max(1))
        assert d.shape == (len(g.prompt) + 8 * k, D.LANES)


def test_summarise_in_blocks_equals_all_at_once(monkeypatch):
    """Rows given as a run's steps and summarised a few rows at a time (small parts joined, large ones
    cut) give what one tensor of every row gives."""
    g = torch.Generator().manual_seed(3)
    prefill = torch.randn(11, 300, generator=g).bfloat16()
    steps = [torch.randn(4, 300, generator=g).bfloat16() for _ in range(9)]
    whole = D.summarise({"prefill": prefill, "verify": torch.cat(steps)})
    monkeypatch.setattr(D, "CPU_BLOCK_BYTES", 8 * 300 * 6)  # six rows a block
    parts = D.summarise({"prefill": prefill, "verify": steps})
    assert all(np.array_equal(a, b) for a, b in zip(whole, parts))
    assert parts[0].shape == (11 + 36, D.LANES)


def test_argmax_rows_is_the_first_statistic():
    """`argmax_rows` (what the verify-vs-decode axis needs) gives `stats_tensor`'s argmax without its other
    statistics, for every stored dtype and with a tie (the first index)."""
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(50, 1000, generator=g) * 3).to(dt)
        x[3, 10] = x[3, 20] = x[3].max() + 1
        assert torch.equal(D.argmax_rows(x), D.stats_tensor(x)[0].to(torch.int64)), dt
        assert int(D.argmax_rows(x)[3]) == 10


def test_stats_tensor_in_blocks_is_the_whole_rows(monkeypatch):
    """`stats_tensor` over more rows than a block holds gives what one pass over them gives."""
    rows = (torch.randn(40, 3000, generator=torch.Generator().manual_seed(1)) * 5).to(torch.bfloat16)
    whole = D.stats_tensor(rows)
    monkeypatch.setattr(D, "CPU_BLOCK_BYTES", 8 * 3000 * 7)  # 7 rows a block
    assert torch.equal(D.stats_tensor(rows), whole)
