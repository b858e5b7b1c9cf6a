"""Row digests and statistics (`vd.digest`), and the comparison that uses them (`vd.gold.ByDigest`)."""

import shutil

import numpy as np
import pytest
import torch

import vd.digest as D
from vd.golden import open_golden, rewrite_summaries, row_summary, to_float


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
    monkeypatch.setattr(D, "BLOCK_BYTES", 8 * 4096 * 2)  # two rows a block: five blocks
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
    assert g.meta["format_version"] == 3 and g.meta["digest"] == D.meta(512, 2)
    for k, rec in g.runs.items():
        digests, stats = row_summary(rec.rows_by_kind())
        assert np.array_equal(rec.digests, digests) and np.array_equal(rec.stats, stats)
        values = np.concatenate([to_float(a, "bfloat16") for a in rec.rows_by_kind().values()])
        assert np.array_equal(rec.stats[:, 0], values.argmax(1)) and np.array_equal(rec.stats[:, 1], values.max(1))
        assert rec.digests.shape == (len(g.prompt) + 8 * k, D.LANES)


def test_replay_reads_rows_only_where_digests_differ(tiny_copy, monkeypatch):
    """A passing replay reads no row; a row edited in the golden (its digests rewritten, as a recording
    by a model that computed it) is read and measured; an edit without its digests goes unseen. The
    detection control reads the rows its changed draft moved."""
    import zarr

    import vd.reader as R
    from replayer.replay import replay
    from vd.models import load_model

    reads = []
    real = R.read_rows
    monkeypatch.setattr(R, "read_rows", lambda src, k, kind, idx: reads.append((k, kind, list(idx))) or
                        real(src, k, kind, idx))
    model = load_model("tiny-llama")
    assert replay(tiny_copy, model=model, control=False)["verdict"] == "PASS" and reads == []
    arr = zarr.open_array(tiny_copy / "k2" / "logits", mode="r+")
    arr[1, 0, 7] = int(arr[1, 0, 7]) ^ 1
    assert replay(tiny_copy, model=model, control=False)["verdict"] == "PASS" and reads == []  # not read
    rewrite_summaries(tiny_copy, 2)
    r = replay(tiny_copy, model=model, control=False)
    # Step 1's first row (verify row 2 of K=2) to measure it, then step 1's rows for the failure bundle.
    assert r["verdict"] == "FAIL" and reads == [(2, "verify", [2]), (2, "verify", [2, 3])]
    c = r["verify"][0]["comparisons"][0]
    assert c["mismatched_step_list"] == [1] and c["first_mismatch"]["index"] == 7
    reads.clear()
    r = replay(tiny_copy, model=model, ks=[3])
    assert r["verify"][0]["detection_control"]["fired"]
    assert reads and {(k, kind) for k, kind, _ in reads} == {(3, "verify")}
    changed = r["verify"][0]["detection_control"]["mismatched_step_list"]
    assert sorted({i // 3 for _, _, idx in reads for i in idx}) == changed


def test_a_golden_without_digests_replays_as_before(cli, rows_golden, tmp_path):
    code, out, err = cli("replay", rows_golden, "--report", tmp_path / "r.json")
    assert code == 0, err


def test_a_broken_digests_array_is_a_corrupt_golden(cli, tiny_copy):
    shutil.rmtree(tiny_copy / "k3" / "digests")
    code, out, err = cli("replay", tiny_copy)
    assert code == 2 and "k3" in err and "digests" in err and "Traceback" not in err


def test_reading_a_golden_whole_checks_every_digest_against_its_row(cli, tiny_copy):
    """`open_golden` (and so `vd show`, `vd diff`) reads every row: a row whose bytes disagree with its
    stored digest (an edit that left the digests alone) is a corrupt golden."""
    import zarr

    arr = zarr.open_array(tiny_copy / "k3" / "logits", mode="r+")
    arr[2, 1, 5] = int(arr[2, 1, 5]) ^ 1
    code, out, err = cli("show", tiny_copy)
    assert code == 2 and "k3/digests: 1 row(s) disagree with the stored rows (first: verify row 7)" in err
    rewrite_summaries(tiny_copy, 3)
    code, out, err = cli("show", tiny_copy)
    assert code == 0 and "each checked against its row's bytes" in out


def test_a_stored_digest_that_disagrees_with_its_row_is_a_corrupt_golden(cli, tiny_copy):
    """A replay reads a golden row only where digests differ, and checks what it reads against the stored
    digest: a digest edited (or a row edited without `rewrite_summaries`) is a corrupt golden, exit 2,
    not a difference of the model's."""
    import zarr

    arr = zarr.open_array(tiny_copy / "k3" / "digests", mode="r+")
    arr[5, 2] = int(arr[5, 2]) + 1  # the prefill's row 5
    code, out, err = cli("replay", tiny_copy, "--k", "3")
    assert code == 2 and "k3/digests: 1 row(s) disagree with the stored rows (first: prefill row 5)" in err
    assert "Traceback" not in err
    rewrite_summaries(tiny_copy, 3)
    code, out, err = cli("replay", tiny_copy, "--k", "3")
    assert code == 0, err
