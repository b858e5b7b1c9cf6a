"""`vd diff`: two goldens of the same recording judged against each other without a model."""

import json
import shutil
from pathlib import Path

import numpy as np
from golden_edit import chunk, edit_rows, flip_byte

from vd.dtypes import to_float
from vd.store import open_golden, slim

DATA = Path(__file__).parent / "data"


def _bump(value: float):
    """An edit setting verify row 17 (step 5, row 2 of K=3) at index 100 to ``value``."""
    bits = (np.float32(value).view(np.uint32) >> 16).astype(np.uint16)
    return lambda rows: rows.__setitem__((17, 100), bits)


def test_diff_two_goldens(cli, tiny_golden, tmp_path):
    other = tmp_path / "other.zarr"
    shutil.copytree(tiny_golden, other)
    code, out, err = cli("diff", tiny_golden, other)
    assert code == 0 and "PASS" in out
    gold = float(to_float(open_golden(tiny_golden).read_rows(3, "verify", np.array([17]))[:, 100], "bfloat16")[0])
    edit_rows(other, 3, "verify", _bump(gold + 0.0625))  # another machine computed one value differently
    code, out, err = cli("diff", tiny_golden, other, "--report", tmp_path / "d.json")
    r = json.loads((tmp_path / "d.json").read_text())
    assert code == 1 and len(r["reasons"]) == 1 and "K=3" in r["reasons"][0]
    c = next(v for v in r["verify"] if v["k"] == 3)["comparison"]
    assert (c["first_failure"]["step"], c["first_failure"]["row"], c["first_failure"]["index"]) == (5, 2, 100)
    assert c["summary"]["verify"]["rows_failed"] == 1
    assert cli("diff", tiny_golden, other, "--tolerance", "atol:0.0625,rtol:0")[0] == 0
    code, out, err = cli("diff", tiny_golden, other, "--tolerance", "topk:512")  # every token: PASSed (a user test)
    assert code == 2 and "the vocabulary has 512 tokens, so the top 512 are all of them" in err, out + err
    assert cli("diff", tiny_golden, other, "--tolerance", "atol:0.06,rtol:0")[0] == 1


def test_diff_refuses_what_is_not_the_same_recording_or_has_no_rows(cli, tiny_golden, tmp_path):
    code, out, err = cli("diff", tiny_golden, DATA / "tiny-llama-mtp-v2.zarr")
    assert code == 2 and "not recordings of the same thing" in err
    slim(tiny_golden, tmp_path / "s.zarr")
    code, out, err = cli("diff", tiny_golden, tmp_path / "s.zarr")
    assert code == 2 and "is slim: vd diff judges B's rows" in err
    code, out, err = cli("diff", tmp_path / "s.zarr", tiny_golden)  # A slim: judged by digests, exactly
    assert code == 0 and "PASS" in out


def test_diff_across_locations(cli, tiny_golden, tmp_path, s3):
    code, out, err = cli("record", tmp_path / "g.zip", "--model", "tiny-llama", "--steps", "8")
    assert code == 0, err
    code, out, err = cli("record", s3, "--model", "tiny-llama", "--steps", "8")
    assert code == 0, err
    assert cli("diff", tiny_golden, tmp_path / "g.zip")[0] == 0
    assert cli("diff", tmp_path / "g.zip", s3)[0] == 0


def test_a_damaged_golden_is_refused_on_either_side(cli, tiny_golden, tmp_path):
    """A damaged golden is no reference: refused (exit 2, naming the file) as A, whose rows are read only where
    B's differ, as well as B, before any row is judged."""
    damaged = tmp_path / "a.zarr"
    shutil.copytree(tiny_golden, damaged)
    flip_byte(chunk(damaged, 3, index=2))
    for a, b in ((damaged, tiny_golden), (tiny_golden, damaged)):
        code, out, err = cli("diff", a, b)
        assert code == 2 and "PASS" not in out, out + err
        assert "a.zarr/k3/logits.hi/c/2" in err and "does not match the golden's manifest" in err, err


def test_a_reference_whose_rows_disagree_with_its_digests_is_refused(cli, tiny_golden, tmp_path):
    """A's rows edited behind its digests' back, its manifest and ID made again to match: `vd verify` refused it,
    and `vd diff A B` PASSed, A's rows being read only where B's differ (found by a user test)."""
    damaged = tmp_path / "a.zarr"
    shutil.copytree(tiny_golden, damaged)
    edit_rows(damaged, 3, "verify", _bump(3.0), digests=False)
    assert cli("verify", damaged)[0] == 2
    code, out, err = cli("diff", damaged, tiny_golden)
    assert code == 2 and "PASS" not in out and "row(s) disagree with the stored rows" in err, out + err


def test_diff_says_how_the_goldens_were_made_and_judges_bs_own_equivalence(cli, tmp_path):
    """vd diff never said that A was recorded with eager and B with sdpa, or B in a batch; `--tolerance
    equivalence=exact` was echoed and not judged (PASS over B's own failing pairs); the decode group's rows were
    called verify rows. Now: the ways they were made differently, B's own verify-vs-decode judged, decode named."""
    args = ("--model", "tiny-llama", "--k", "2", "--steps", "16")
    paths = {name: tmp_path / f"{name}.zarr" for name in ("eager", "sdpa", "batched")}
    assert cli("record", paths["eager"], *args)[0] == 0
    assert cli("record", paths["sdpa"], *args, "--forward", "sdpa")[0] == 0
    assert cli("record", paths["batched"], *args, "--forward", "sdpa", "--batch", "2", "--slot", "1")[0] == 0
    code, out, err = cli("diff", paths["eager"], paths["sdpa"], "--report", tmp_path / "d.json")
    assert code == 1 and "made differently: forward: eager vs sdpa" in out, out
    assert "decode 32/32 rows differ" in out and "decode 32/32 rows fail" in out, out
    assert json.loads((tmp_path / "d.json").read_text())["made"] == ["forward: eager vs sdpa"]
    code, out, err = cli("diff", paths["sdpa"], paths["batched"])
    assert "made differently: batch: alone vs in a batch of 2 (slot 1, seed 0)" in out, out
    code, out, err = cli("diff", paths["sdpa"], paths["sdpa"])
    assert code == 0 and "made differently" not in out
    code, out, err = cli("diff", paths["sdpa"], paths["sdpa"], "--tolerance", "equivalence=exact")
    assert code == 1 and "verify K=2, B (sdpa):" in out and "fail equivalence=exact" in out, out
    assert cli("diff", paths["eager"], paths["eager"], "--tolerance", "equivalence=exact")[0] == 0


def test_the_steps_reason_of_decode_rows_names_no_accept_count():
    """Two recordings whose greedy continuations part: the decode rows' steps are one-token decodes, each fed
    the token the step before chose, which accept nothing ("[5] accepting 0 vs [7] accepting 0" said so)."""
    from vd.layout import Step
    from vd.replayer import words

    decode = words.steps_reason(1, [3, 4], Step((5,), 0), Step((7,), 0), 16).text
    assert decode == ("decode: 2 of 16 steps decoded from another token: the greedy continuations part (first at "
                      "step 3: [5] vs [7])") and "accepting" not in decode
    verify = words.steps_reason(2, [3], Step((5, 6), 1), Step((5, 6), 0), 16).text
    assert verify == ("K=2: 1 of 16 steps verified other tokens or accepted another count (first at step 3: "
                      "[5, 6] accepting 1 vs [5, 6] accepting 0)")
