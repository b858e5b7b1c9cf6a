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


def test_a_damaged_chunk_of_a_golden_without_a_manifest_is_found_by_a_replay(tmp_path):
    """A golden from before format 6 has no manifest to hash its files against: a replay checks its every chunk
    and row instead (on the reader, before its first run), so a byte flipped in a row chunk that a passing
    replay would never read still fails it, naming the chunk."""
    import shutil

    from golden_edit import flip_byte

    from vd.errors import GoldenCorruptError

    path = tmp_path / "v5.zarr"
    shutil.copytree(DATA / "tiny-llama-mtp-v5.zarr", path)
    assert open_golden(path).manifest is None
    flip_byte(path / "k2" / "logits.lo" / "c" / "1" / "0" / "0" / "0")
    with pytest.raises(GoldenCorruptError, match=r"k2/logits\.lo"):
        replay(path, ReplaySettings(ks=(2,), control=False))


def test_a_refresh_replaces_an_earlier_migration_not_another_golden(tmp_path, tiny_golden):
    """`vd migrate OLD NEW --refresh` over a golden of other numbers replaced it and its history without a word
    (a user test); over an earlier migration of OLD it is what --refresh is for."""
    import shutil

    shutil.copytree(tiny_golden, tmp_path / "other.zarr")
    with pytest.raises(UsageError, match="holds other numbers than .* --refresh replaces only an earlier migration"):
        migrate(DATA / "tiny-llama-v6.zarr", tmp_path / "other.zarr", refresh=True)
    assert open_golden(tmp_path / "other.zarr").content_digest() == open_golden(tiny_golden).content_digest()
    migrate(DATA / "tiny-llama-v6.zarr", tmp_path / "new.zarr")
    again = open_golden(migrate(DATA / "tiny-llama-v6.zarr", tmp_path / "new.zarr", refresh=True))
    assert again.content_digest() == open_golden(DATA / "tiny-llama-v6.zarr").content_digest()
