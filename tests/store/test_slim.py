"""Slim goldens: step logs, digests and statistics without rows, about 1 % of the size, judged as the full
golden is under exact and argmax, and measured against the full golden when it is named."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from golden_edit import edit_meta, edit_rows

from vd.errors import GoldenCorruptError, GoldenError, UsageError
from vd.preflight import made_from
from vd.store import FORMAT_VERSION, locate, open_golden, slim

PLUGINS = Path(__file__).parent.parent / "plugins"


@pytest.fixture(scope="module")
def slim_golden(tiny_golden, tmp_path_factory):
    out = tmp_path_factory.mktemp("slim") / "tiny-slim.zarr"
    slim(tiny_golden, out)
    return out


def test_a_slim_golden_keeps_everything_but_the_rows(tiny_golden, slim_golden):
    full, s = open_golden(tiny_golden), open_golden(slim_golden)
    assert s.slim and not full.slim and s.rows_source is None
    assert s.meta["rows"]["stored"] is False and s.meta["rows"]["slim_of"]["base"] == "slim"
    assert made_from(str(slim_golden), s.meta) == str(tiny_golden)  # (stored from the slim golden's folder)
    assert s.prompt == full.prompt and s.ks == full.ks and s.meta["greedy"] == full.meta["greedy"]
    for k in full.ks:
        assert s.checked_log(k).same_steps(full.checked_log(k))
        assert all(np.array_equal(a, b) for a, b in zip(s.summary(k), full.summary(k)))
    assert not [p for p in slim_golden.rglob("*") if ".hi" in p.name or ".lo" in p.name]
    with pytest.raises(GoldenError, match="slim"):
        s.all_rows(2)
    with pytest.raises(GoldenError, match="slim"):
        s.side(2).host_rows("verify", np.array([0]))
    assert locate(slim_golden).nbytes() < 0.25 * locate(tiny_golden).nbytes()  # a 512-wide vocabulary


def test_rows_come_from_the_full_golden_it_was_made_from(tiny_golden, slim_golden, tiny_copy):
    s = open_golden(slim_golden, rows=tiny_golden)
    assert s.rows_source.url == str(tiny_golden)
    assert np.array_equal(s.side(3).host_rows("verify", np.array([5])),
                          open_golden(tiny_golden).read_rows(3, "verify", np.array([5])))
    edit_rows(tiny_copy, 3, "verify", lambda r: r.__setitem__((5, 1), r[5, 1] ^ 1))  # another recording's rows
    with pytest.raises(GoldenError, match="is not the golden .* was made from"):
        open_golden(slim_golden, rows=tiny_copy)
    with pytest.raises(GoldenError, match="is slim too"):
        open_golden(slim_golden, rows=slim_golden)
    with pytest.raises(UsageError, match="stores its own"):
        open_golden(tiny_golden, rows=tiny_golden)


def test_slim_refuses_a_damaged_source_and_a_slim_one(tiny_copy, slim_golden, tmp_path):
    with pytest.raises(UsageError, match="slim already"):
        slim(slim_golden, tmp_path / "again.zarr")
    edit_rows(tiny_copy, 2, "prefill", lambda r: r.__setitem__((0, 0), r[0, 0] ^ 1), digests=False)
    with pytest.raises(GoldenCorruptError, match="prefill row 0"):
        slim(tiny_copy, tmp_path / "s.zarr")
    assert not (tmp_path / "s.zarr").exists()


def test_slim_refuses_a_source_whose_group_document_is_damaged(tiny_copy, tmp_path):
    """A K's zarr.json edited to the same size: every command but slim refused the source; slim wrote a slim golden
    that verified and PASSed (found by a user test). Its files are checked against the manifest first now."""
    doc = tiny_copy / "k2" / "zarr.json"
    doc.write_bytes(doc.read_bytes().replace(b'"steps": 8', b'"steps": 7'))
    with pytest.raises(GoldenCorruptError, match=r"k2/zarr.json does not match the golden's manifest"):
        slim(tiny_copy, tmp_path / "s.zarr")
    assert not (tmp_path / "s.zarr").exists()


def test_a_slim_golden_of_an_old_format_gets_digests(tmp_path):
    from pathlib import Path

    v1 = Path(__file__).parent.parent / "data" / "tiny-llama-v1.zarr"
    out = tmp_path / "v1-slim.zarr"
    slim(v1, out)
    s = open_golden(out)
    assert s.info.version == FORMAT_VERSION and s.info.digested and s.slim
    assert json.loads((out / "zarr.json").read_text())["attributes"]["vd"]["rows"]["slim_of"]["format_version"] == 1
    assert np.array_equal(s.summary(2)[0], open_golden(v1).summary(2)[0])


@pytest.mark.parametrize("old", [False, True])
def test_compiled_artifacts_missing_from_the_manifest_are_named(tiny_copy, tmp_path, old):
    """A golden whose metadata names Inductor artifacts its manifest does not list (format 6), or that has no
    manifest at all (an earlier format, edited), is refused in one line when rewritten, not with a traceback."""
    source = tiny_copy
    if old:
        source = tmp_path / "v1.zarr"
        shutil.copytree(Path(__file__).parent.parent / "data" / "tiny-llama-v1.zarr", source)
    edit_meta(source, lambda m: m.update(compiled={"artifacts": "inductor/artifacts.bin", "bytes": 3,
                                                   "sha256": "0" * 64}))
    with pytest.raises(GoldenCorruptError, match="inductor/artifacts.bin is not in the golden's manifest"):
        slim(source, tmp_path / "s.zarr")
    assert not (tmp_path / "s.zarr").exists()


def _look_at(out: str) -> list[str]:
    """The command of a FAIL's step 'Look at the first divergence', as printed (without its ``vd``)."""
    import shlex

    line = next(x for x in out.splitlines() if "Look at the first divergence" in x)
    return shlex.split(line.split("): ", 1)[1].split(" replays just that")[0])[1:]


def test_the_first_divergence_command_runs_as_printed(cli, tiny_copy, tmp_path, monkeypatch):
    """The step's command replays and writes the bundle it promises: for a full golden (never with --rows, which a
    full golden refuses) and for a slim one replayed with --rows (the golden's rows then in the bundle too)."""
    monkeypatch.chdir(tmp_path)
    s = tmp_path / "s.zarr"
    assert cli("slim", tiny_copy, s)[0] == 0
    for golden, more in ((tiny_copy, []), (s, ["--rows", str(tiny_copy)])):
        code, out, err = cli("replay", golden, "--forward", "sdpa", "--k", "2", *more)
        assert code == 1, out + err
        code, again, err = cli(*_look_at(out))
        assert code == 1 and "FAIL" in again, again + err
        assert set(np.load(tmp_path / "replay.json.bundle" / "rows.npz").files) >= {"golden", "candidate"}


def test_a_slim_golden_is_accepted_through_its_full_golden(cli, tiny_copy, tmp_path):
    """A team keeps a slim golden in its repository. A FAIL's next steps accept a change in the full golden and
    write the slim form again (each command works as written); `vd refresh` of the slim golden itself is refused
    (it would put a full golden in its place, its full golden left stale), naming the same way."""
    s = tmp_path / "s.zarr"
    assert cli("slim", tiny_copy, s)[0] == 0
    code, out, err = cli("replay", s, "--forward", "sdpa", "--k", "2", "--report", tmp_path / "r.json")
    assert code == 1 and "(the golden is slim: add --rows FULL, the full golden it was made from" in out, out + err
    (c,) = json.loads((tmp_path / "r.json").read_text())["verify"][0]["comparisons"]
    first = c["prefill_first_mismatch"] or c["first_mismatch"]  # the place known, not the values: null, not "nan"
    assert first["index"] is None and first["golden"] is None and first["got"] is None, first
    code, out, err = cli("replay", s, "--forward", "sdpa", "--k", "2", "--rows", tiny_copy)
    steps = out.split("next step:")[1]
    assert code == 1 and f"--rows {tiny_copy}" in steps and "both rows in rows.npz" in steps, out + err
    record = f"vd record {tiny_copy} --refresh --forward sdpa --reason TEXT"
    assert f"this slim one was made from: {record}, then write its slim form again: vd slim {tiny_copy} {s} " \
           "--refresh." in steps, steps
    before = {p: p.read_bytes() for p in s.rglob("*") if p.is_file()}
    code, out, err = cli("refresh", s, "--reason", "accept sdpa")
    assert code == 2 and err.count("\n") == 1 and f"(vd slim {tiny_copy} {s} --refresh)" in err, err
    assert {p: p.read_bytes() for p in s.rglob("*") if p.is_file()} == before
    code, out, err = cli("replay", s, "--model", f"{PLUGINS / 'perturb.py'}:factory", "--k", "2")  # another model:
    steps = out.split("next step:")[1]  # its rows taken as a candidate (a refresh would record the golden's own)
    assert code == 1 and f"replay with --save-candidate PATH, then vd refresh FULL --from PATH --reason " \
        f"TEXT, then write its slim form again: vd slim FULL {s} --refresh." in steps, steps  # (FULL: no --rows)
    with pytest.MonkeyPatch.context() as m:  # rows differing at every step: no candidate of them is promoted
        m.setenv("VD_PERTURB_STEP", "all")
        code, out, err = cli("replay", s, "--model", f"{PLUGINS / 'perturb.py'}:factory", "--k", "2")
    steps = out.split("next step:")[1]
    assert code == 1 and "--save-candidate" not in steps and f"record the full golden this slim one was made " \
        f"from with it: vd record FULL --refresh --model {PLUGINS / 'perturb.py'}:factory --reason TEXT, then write " \
        f"its slim form again: vd slim FULL {s} --refresh (these rows cannot be promoted" in steps, steps
    cand = tmp_path / "cand.zarr"  # a candidate saved against the slim golden is promoted into the full one
    assert cli("replay", s, "--save-candidate", cand)[0] == 0
    code, out, err = cli("refresh", s, "--from", cand, "--reason", "promote")
    assert code == 2 and f"(vd refresh {tiny_copy} --from {cand} --reason TEXT)" in err, err
    assert {p: p.read_bytes() for p in s.rglob("*") if p.is_file()} == before
    assert cli(*record.replace("TEXT", "sdpa").split()[1:])[0] == 0
    assert cli("slim", tiny_copy, s, "--refresh")[0] == 0
    code, out, err = cli("replay", s, "--forward", "sdpa", "--k", "2")
    assert code == 0 and open_golden(s).slim, out + err


def test_a_slim_goldens_full_golden_is_named_from_any_folder(cli, tiny_golden, tmp_path, monkeypatch):
    """A slim golden made with a relative path (vd slim ../full/g.zarr s.zarr) stored that path as typed, and the
    refusal of its refresh printed it: pasted from another folder, both commands failed (a user test). It is
    stored from the slim golden's folder and named from wherever the refusal is printed."""
    full, work = tmp_path / "full", tmp_path / "work"
    full.mkdir()
    work.mkdir()
    shutil.copytree(tiny_golden, full / "g.zarr")
    monkeypatch.chdir(work)
    assert cli("slim", "../full/g.zarr", "s.zarr")[0] == 0
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path / "other")
    code, _, err = cli("refresh", work / "s.zarr", "--reason", "x")
    assert code == 2 and f"(vd refresh {full / 'g.zarr'} --reason TEXT)" in err and \
        f"(vd slim {full / 'g.zarr'} {work / 's.zarr'} --refresh)" in err, err
    monkeypatch.chdir(tmp_path)
    code, out, _ = cli("show", work / "s.zarr")
    assert code == 0 and "slim: no rows (made from full/g.zarr," in out, out
