"""What a promotion (``vd refresh GOLDEN --from CANDIDATE``) refuses before anything is published: a slim
candidate over a full golden (unless asked), a candidate edited after it was written, one of another model,
and one whose zip holds a file its manifest does not list; each in one line (exit 2), the golden untouched."""

import json
import warnings
import zipfile
from pathlib import Path

import pytest
from golden_edit import edit_meta, files, restate_content
from refusal import refused

from vd.recorder import RecordSettings, record
from vd.replayer import ReplaySettings, replay
from vd.store import open_golden

SETTINGS = RecordSettings(model="tiny-llama", steps=4, ks=(2, 3))


@pytest.fixture
def golden(tmp_path, tiny):
    path = tmp_path / "g.zarr"
    assert record(path, SETTINGS, model=tiny, reason="trusted build, first recording").location is not None
    return path


@pytest.fixture
def cand(golden, tmp_path, perturbed):
    """A sound candidate for ``golden``: a replay of a build of the same model off by one ULP."""
    path = tmp_path / "cand.zarr"
    replay(golden, ReplaySettings(model="perturbed-tiny-llama", save_candidate=str(path),
                                  allow_model_mismatch=True), model=perturbed)
    assert open_golden(path).meta["candidate"]["of_content"] == open_golden(golden).content_digest()
    return path


def _promote(cli, golden: Path, cand: Path, *more: str):
    return cli("refresh", golden, "--from", cand, "--reason", "accept the candidate", *more)


def test_a_slim_candidate_over_a_full_golden_is_refused_unless_asked(cli, golden, cand, tmp_path):
    slim = tmp_path / "slim.zarr"
    assert cli("slim", cand, slim)[0] == 0
    was = files(golden)
    refused(_promote(cli, golden, slim), "is slim", "--allow-slim")
    assert files(golden) == was
    refused(cli("refresh", golden, "--reason", "r", "--allow-slim"), "--allow-slim goes with --from")
    code, _, err = _promote(cli, golden, slim, "--allow-slim")
    assert code == 0, err
    assert open_golden(golden).slim


def _same_size_edit(path: Path, old: str, new: str) -> None:
    assert len(old) == len(new)
    text = path.read_text()
    assert old in text, text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("where, old, new", [
    ("k2/zarr.json", '"steps": 4', '"steps": 3'),
    ("k2/digests/zarr.json", '"fill_value": 0', '"fill_value": 1'),
])
def test_a_candidate_edited_inside_is_refused_and_the_golden_kept(cli, golden, cand, where, old, new):
    doc = json.loads((cand / where).read_text())  # written compactly or not: edit its own spelling
    (cand / where).write_text(json.dumps(doc, indent=2))
    edit_meta(cand, lambda m: None)  # sealed as written, so only the edit below is damage
    assert cli("verify", cand)[0] == 0
    _same_size_edit(cand / where, old, new)
    was = files(golden)
    refused(_promote(cli, golden, cand), where, "manifest")
    assert files(golden) == was


def test_a_candidate_of_another_model_is_refused(cli, golden, cand):
    edit_meta(cand, lambda m: m["model"].update(fingerprint="sha256:" + "0" * 64))
    restate_content(cand)  # sealed, its content digest of that model: an intact candidate
    assert cli("verify", cand)[0] == 0
    was = files(golden)
    refused(_promote(cli, golden, cand), "another model fingerprint")
    assert files(golden) == was


def test_a_candidate_zip_with_a_member_outside_it_is_refused(cli, golden, cand, tmp_path):
    packed = tmp_path / "sub" / "cand.zip"
    assert cli("pack", cand, packed)[0] == 0
    with warnings.catch_warnings(), zipfile.ZipFile(packed, "a") as z:
        warnings.simplefilter("ignore")
        z.writestr("../x", b"foreign")
    was = files(golden)
    refused(_promote(cli, golden, packed), "'../x'", "outside the golden")
    assert files(golden) == was and not (tmp_path / "x").exists()
