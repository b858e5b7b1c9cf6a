"""`vd migrate`: a committed golden of each earlier format rewritten in the current one, every file in its
manifest, its numbers unchanged (content digest), and replaying as the old one did."""

from pathlib import Path

import pytest

from vd.errors import UsageError
from vd.replayer import ReplaySettings, replay
from vd.store import FORMAT_VERSION, migrate, open_golden

DATA = Path(__file__).parent.parent / "data"


@pytest.mark.parametrize("name", ["tiny-llama-v1.zarr", "tiny-llama-mtp-v2.zarr", "tiny-llama-mtp-v3.zarr",
                                  "tiny-llama-mtp-v4.zarr", "tiny-llama-mtp-v5.zarr", "tiny-llama-v6.zarr"])
def test_every_earlier_format_migrates_with_its_numbers_unchanged(tmp_path, name, cli):
    old = open_golden(DATA / name)
    new = open_golden(migrate(DATA / name, tmp_path / "new.zarr"))
    assert new.info.version == FORMAT_VERSION and old.info.version < FORMAT_VERSION
    assert new.content_digest() == old.content_digest() and new.manifest and new.history[-1]["reason"].startswith(
        f"migrated from format {old.info.version}")
    # A golden with a history (format 5) keeps its versions and gains one for the migration.
    assert new.history[:-1] == old.history and new.history[-1]["version"] == len(old.history) + 1
    assert new.history[-1]["content_digest"] == old.content_digest()
    assert cli("verify", tmp_path / "new.zarr")[0] == 0
    # Replayed as the old one is, here: the same verdict and reasons. On a machine whose numerics match the
    # recording's both PASS; elsewhere (another CPU vector ISA) both FAIL alike, naming the difference.
    was, now = (replay(p, ReplaySettings(ks=(2,))) for p in (DATA / name, tmp_path / "new.zarr"))
    assert (now.verdict, [x.text for x in now.reasons]) == (was.verdict, [x.text for x in was.reasons])
    assert now.verdict == "PASS" or now.environment.numerics_differences, [x.text for x in now.reasons]
    with pytest.raises(UsageError, match="in the current format"):
        migrate(tmp_path / "new.zarr", tmp_path / "again.zarr")
