"""Reading a golden: every damaged or malformed part refused with a `GoldenError` naming it, old formats
read unchanged, and rows read only where asked for."""

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from golden_edit import chunk, edit_meta, edit_rows
from golden_edit import damage as damage_chunk
from store_data import V, write

from vd.errors import GoldenCorruptError, GoldenError, GoldenNotFoundError, NotAGoldenError
from vd.store import FORMAT_VERSION, locate, open_golden

DATA = Path(__file__).parent.parent / "data"


@pytest.fixture
def golden(tmp_path) -> Path:
    path = tmp_path / "g.zarr"
    write(path)
    return path


@pytest.mark.parametrize("damage, message", [
    ("flip", "fails its CRC32C checksum"),
    ("truncate", "fails its CRC32C checksum"),
    ("delete", "chunk c/1/0/0 is missing"),
    ("directory", "chunk c/1/0/0 is missing"),
])
def test_damaged_row_chunks_are_refused_when_read(golden, damage, message):
    damage_chunk(chunk(golden, 2, "logits", 1), damage)
    # The manifest finds it first: a missing or truncated file at open, a flipped byte when the files are checked.
    found = "k2/logits.hi/c/1/0/0 (is missing|has 3 bytes|does not match|is a directory)"
    with pytest.raises(GoldenCorruptError, match=found):
        open_golden(golden).check_files()
    edit_meta(golden, lambda m: None)  # as if written so: then each chunk's own checks find it when read
    g = open_golden(golden)  # the metadata alone opens
    with pytest.raises(GoldenCorruptError, match=message):
        g.verify_rows(2)
    with pytest.raises(GoldenCorruptError, match="k2/logits.hi"):
        g.read_rows(2, "verify", np.array([2]))  # step 1's rows
    assert g.read_rows(2, "verify", np.array([0])).shape == (1, V)  # step 0's chunk is intact


def test_files_added_to_a_golden_are_named_with_the_way_back(golden):
    """A Finder's .DS_Store or a .gitkeep in a golden directory: refused (a golden holds only the files its
    manifest lists), the line naming them and saying that removing them gives the golden back."""
    (golden / ".DS_Store").write_bytes(b"\0")
    with pytest.raises(GoldenCorruptError, match=r"g.zarr/.DS_Store is not in the golden's manifest \(a file added "
                       r"after it was written; a golden holds only the files it lists: remove it\)$"):
        open_golden(golden)
    (golden / "k2" / ".gitkeep").write_bytes(b"")
    with pytest.raises(GoldenCorruptError, match=r"remove it and the 1 other\(s\): k2/.gitkeep\)$"):
        open_golden(golden)
    (golden / ".DS_Store").unlink()
    (golden / "k2" / ".gitkeep").unlink()
    open_golden(golden).check_files()


def test_a_manifest_that_leaves_out_the_goldens_own_files_is_not_a_file_added(golden):
    """The manifest emptied (or cut down) and the golden ID made again to match: the line said every data file was
    "added after it was written ... remove it and the 86 other(s)", advice that deletes the golden (found by a user
    test). A file of a name the writer makes is the manifest's damage: said so, nothing to remove."""
    from vd.store import manifest

    def empty(m):
        m["manifest"] = {}
        m["golden_id"] = manifest.golden_id(m)

    edit_meta(golden, empty)
    with pytest.raises(GoldenCorruptError, match=r"is a golden's own file that its manifest does not list "
                       r"\(\d+ such\): the manifest was damaged or edited.*remove nothing") as e:
        open_golden(golden)
    assert "remove it" not in str(e.value)


def test_an_edited_field_is_said_to_be_an_edit(golden, tmp_path):
    """The root's ``steps`` edited, the ID left: the line blamed 'decode' (a field the edit made inconsistent); the
    ID is checked first now. And an edited format marker was "no vd metadata", beside the vd metadata."""
    import shutil

    marker = tmp_path / "m.zarr"
    shutil.copytree(golden, marker)
    edit_meta(golden, lambda m: m.update(steps=m["steps"] + 1), sealed=False)
    with pytest.raises(GoldenCorruptError, match="does not hash to the golden's ID .*edited or damaged after"):
        open_golden(golden)
    edit_meta(marker, lambda m: m.update(format=99), sealed=False)
    with pytest.raises(NotAGoldenError, match="not a vd golden: its vd metadata's 'format' is 99, not 'vd-golden'"):
        open_golden(marker)
    edit_meta(golden, lambda m: m.pop("golden_id"), sealed=False)  # (it said "the golden's ID None")
    with pytest.raises(GoldenCorruptError, match="metadata field 'golden_id' is missing or malformed: the metadata "
                                                 "was edited or damaged after"):
        open_golden(golden)


@pytest.mark.parametrize("field, value, said", [
    ("history", [], "metadata field 'history' is [], expected its versions 1, 2, ..."),
    ("history", [{}], "metadata field 'history' is [{}]"),
    ("greedy", [], "metadata field 'greedy' is [], expected the greedy continuation's token ids"),
    ("environment", {}, "metadata field 'environment' is {}, expected the recording's environment"),
])
def test_what_every_recording_writes_is_required(tiny_copy, field, value, said):
    """A format 7 golden's history emptied (or its greedy continuation) and the golden ID made again: `vd verify`
    said intact, and `vd history` "no history: recorded before format 5" (found by a user test). Refused, naming
    the field."""
    edit_meta(tiny_copy, lambda m: m.update({field: value}))
    with pytest.raises(GoldenCorruptError, match=re.escape(said)):
        open_golden(tiny_copy)


def test_documents_checked_out_with_crlf_line_endings_are_named_so(golden):
    """Git for Windows' core.autocrlf checks a golden's array documents out with CRLF line endings, which the
    manifest's sizes and hashes refuse: the line says that is what happened and what to do (it said only "has
    572 bytes; the manifest says 537")."""
    from vd.store import manifest

    doc = golden / "k2" / "tokens" / "zarr.json"
    lf = doc.read_bytes()
    doc.write_bytes(lf.replace(b"\n", b"\r\n"))
    with pytest.raises(GoldenCorruptError, match=r"k2/tokens/zarr.json has \d+ bytes; the manifest says \d+: its line "
                       r"endings were made CRLF on checkout \(git's core.autocrlf\); add `goldens/\*\*/zarr.json text "
                       "eol=lf` to .gitattributes"):
        open_golden(golden)
    listed = {"k2/tokens/zarr.json": [len(lf), hashlib.sha256(lf).hexdigest()]}
    with pytest.raises(GoldenCorruptError, match="tokens/zarr.json does not match the golden's manifest: its line "
                       "endings were made CRLF"):  # where a store cannot list sizes (S3), the hash finds it
        manifest.check_hashes(lambda key: doc.read_bytes(), listed, "g.zarr")
    doc.write_bytes(lf.replace(b"\n", b"\r\n", 1) + b" ")  # other damage is not called CRLF
    with pytest.raises(GoldenCorruptError, match=r"the manifest says \d+$"):
        open_golden(golden)


def test_git_lfs_pointers_in_place_of_chunks_are_named_so(golden):
    """A clone without Git LFS (or a CI checkout without ``lfs: true``) leaves each chunk file an LFS pointer,
    which the manifest refuses: the line says so and how to fetch the files. A pointer is written here as
    git-lfs writes one (its oid is the file's SHA-256, the manifest's digest)."""
    data_file = chunk(golden, 2, "logits", 0)
    data = data_file.read_bytes()
    pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
               f"size {len(data)}\n")
    data_file.write_text(pointer)
    with pytest.raises(GoldenCorruptError, match=r"has \d+ bytes; the manifest says \d+: it is a Git LFS pointer to "
                       r"it, not the file; fetch the files \(git lfs install, then git lfs pull; in GitHub Actions, "
                       r"actions/checkout with lfs: true\)$"):
        open_golden(golden)
    data_file.write_text(pointer.replace("oid sha256:", "oid sha256:0"))
    with pytest.raises(GoldenCorruptError, match="a Git LFS pointer to other bytes than the manifest lists"):
        open_golden(golden)


@pytest.mark.skipif(shutil.which("git") is None, reason="no git on the PATH")
def test_the_readmes_gitattributes_keep_a_golden_whole_through_an_autocrlf_checkout(golden, tmp_path):
    """The README's .gitattributes, in a repository cloned with core.autocrlf (Git for Windows' default): the
    golden opens and its files match; with `text` alone (the README's line before) it is refused."""
    import subprocess

    def git(*args, cwd):
        subprocess.run(["git", "-c", "user.email=vd@test", "-c", "user.name=vd", *args], cwd=cwd, check=True,
                       capture_output=True)

    for attributes, whole in (("text eol=lf diff", True), ("text diff", False)):
        repo, clone = tmp_path / f"repo-{whole}", tmp_path / f"clone-{whole}"
        shutil.copytree(golden, repo / "goldens" / "g.zarr")
        (repo / ".gitattributes").write_text(f"goldens/**/zarr.json {attributes}\n")
        git("init", "-q", cwd=repo)
        git("add", "-A", cwd=repo)
        git("commit", "-qm", "golden", cwd=repo)
        git("-c", "core.autocrlf=true", "clone", "-q", str(repo), str(clone), cwd=tmp_path)
        if whole:
            open_golden(clone / "goldens" / "g.zarr").check_files()
        else:
            with pytest.raises(GoldenCorruptError, match="line endings were made CRLF"):
                open_golden(clone / "goldens" / "g.zarr")


def test_a_row_edited_behind_its_digests_is_refused(golden):
    edit_rows(golden, 2, "verify", lambda r: r.__setitem__((3, 1), r[3, 1] ^ 1), digests=False)
    g = open_golden(golden)
    with pytest.raises(GoldenCorruptError, match="disagree with the stored rows .first: verify row 3"):
        g.verify_rows(2)
    with pytest.raises(GoldenCorruptError, match="verify row 3"):
        g.side(2).host_rows("verify", np.array([3]))
    assert g.side(2).host_rows("verify", np.array([2])).shape == (1, V)  # the row beside it is intact


def test_missing_arrays_and_groups(golden):
    shutil.rmtree(golden / "k2" / "tokens")
    with pytest.raises(GoldenCorruptError, match="k2/tokens/c/0/0 is missing"):
        open_golden(golden)  # the manifest lists it
    edit_meta(golden, lambda m: None)  # as if written without it
    with pytest.raises(GoldenCorruptError, match="k2/tokens is missing"):
        open_golden(golden).checked_log(2)
    shutil.rmtree(golden / "k2")
    edit_meta(golden, lambda m: None)
    with pytest.raises(GoldenCorruptError, match="k2"):
        open_golden(golden).checked_log(2)


def test_incomplete_future_and_unreadable_goldens(golden):
    edit_meta(golden, lambda m: m.update(complete=False))
    with pytest.raises(GoldenCorruptError, match="incomplete"):
        open_golden(golden)
    edit_meta(golden, lambda m: m.update(complete=True, format_version=FORMAT_VERSION + 1))
    with pytest.raises(GoldenError, match=f"has golden format {FORMAT_VERSION + 1}; this vd reads formats 1 to "
                                          f"{FORMAT_VERSION}"):
        open_golden(golden)
    (golden / "zarr.json").write_text("{ not json")
    with pytest.raises(GoldenCorruptError, match="unreadable"):
        open_golden(golden)


@pytest.mark.parametrize("field, value, needle", [
    ("k", [2, 2], "'k'"), ("k", [1], "'k'"), ("k", [], "'k'"), ("k", "2", "'k'"), ("steps", 0, "'steps'"),
    ("steps", "3", "'steps'"), ("vocab_size", None, "'vocab_size'"), ("vocab_size", True, "'vocab_size'"),
    ("feed", "telepathy", "'feed'"), ("forward", 3, "'forward'"), ("device", None, "'device'"),
    ("format_version", 0, "'format_version'"), ("format_version", "4", "'format_version'"),
    ("logits", {"dtype": "int8"}, "logits dtype 'int8'"), ("model", {"spec": "x"}, "'model'"),
])
def test_malformed_metadata_names_the_field(golden, field, value, needle):
    edit_meta(golden, lambda m: m.update({field: value}))
    with pytest.raises(GoldenCorruptError) as e:
        open_golden(golden)
    assert str(golden) in str(e.value) and needle in str(e.value), e.value


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["logs"]["2"].update(accepted=[0, 0, 0]), "step log in the metadata disagrees"),
    (lambda m: m["logs"]["2"].update(bootstrap=6), "step log in the metadata disagrees"),
    (lambda m: m.update(prompt_tokens=[1, 2, 3, 5]), "prompt in the metadata disagrees"),
])
def test_the_metadata_copies_a_replay_starts_on_are_checked_against_the_arrays(golden, edit, message):
    edit_meta(golden, edit)
    g = open_golden(golden)
    g.log(2)  # the copy starts a replay without reading an array ...
    with pytest.raises(GoldenCorruptError, match=message):
        g.checked_log(2)  # ... and is checked before the K is judged


@pytest.mark.parametrize("name, value, message", [
    ("accepted", 2, "counts outside 0..1"), ("tokens", V, "outside the vocabulary"),
    ("tokens", -1, "outside the vocabulary"),
])
def test_stored_step_logs_out_of_range_are_refused(golden, name, value, message):
    arr = zarr.open_array(zarr.storage.LocalStore(golden / "k2" / name), mode="r+")
    a = arr[...]
    a.flat[0] = value
    arr[...] = a
    edit_meta(golden, lambda m: None)  # the metadata's copy is right; the array, written so, is not
    with pytest.raises(GoldenCorruptError, match=message):
        open_golden(golden).checked_log(2)


def test_a_bootstrap_token_outside_the_vocabulary_is_refused(golden):
    doc = json.loads((golden / "k2" / "zarr.json").read_text())
    doc["attributes"]["bootstrap"] = V
    (golden / "k2" / "zarr.json").write_text(json.dumps(doc, indent=2))  # (its size changes: refused at open)
    with pytest.raises(GoldenCorruptError, match="k2/zarr.json has"):
        open_golden(golden)
    edit_meta(golden, lambda m: None)
    with pytest.raises(GoldenCorruptError, match="bootstrap token 8 is not in the vocabulary"):
        open_golden(golden).checked_log(2)


def test_not_goldens(tmp_path):
    with pytest.raises(GoldenNotFoundError):
        open_golden(tmp_path / "absent.zarr")
    (tmp_path / "file.zarr").write_text("hello")
    with pytest.raises(NotAGoldenError):
        open_golden(tmp_path / "file.zarr")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotAGoldenError, match="no zarr.json"):
        open_golden(tmp_path / "empty")
    zarr.create_group(tmp_path / "plain.zarr")
    with pytest.raises(NotAGoldenError, match="not a vd golden"):
        open_golden(tmp_path / "plain.zarr")
    (tmp_path / "x.zip").write_text("not a zip")
    with pytest.raises(NotAGoldenError, match="not a readable zip file"):
        open_golden(tmp_path / "x.zip")


@pytest.mark.parametrize("name, version, feed, codec", [
    ("tiny-llama-v1.zarr", 1, "reference", "zstd"),
    ("tiny-llama-mtp-v2.zarr", 2, "mtp", "zstd"),
    ("tiny-llama-mtp-v3.zarr", 3, "mtp", None),
    ("tiny-llama-mtp-v4.zarr", 4, "mtp", "zstd"),
    ("tiny-llama-mtp-v5.zarr", 5, "mtp", "zstd"),
    ("tiny-llama-v6.zarr", 6, "reference", "zstd"),
])
def test_committed_goldens_of_every_format_read_back(name, version, feed, codec):
    """Goldens of every format (rows as one uint16 array with the codecs of their day, then as byte planes;
    timings in the root metadata, then in the run group) read whole; formats before 3 have their digests and
    statistics computed from the rows."""
    g = open_golden(DATA / name)
    assert g.info.version == version and g.info.feed == feed and g.info.digested == (version >= 3)
    rows = "k2/logits.hi" if version >= 4 else "k2/logits"  # format 4: the high byte plane
    codecs = [c.to_dict()["name"] for c in zarr.open_group(DATA / name, mode="r")[rows].metadata.codecs]
    assert codecs == ["bytes", *([codec] if codec else []), "crc32c"]
    for k in g.ks:
        rows = g.verify_rows(k)
        layout = g.layout(k)
        assert {kind: a.shape for kind, a in rows.items()} == {kind: (n, g.info.vocab) for kind, n in
                                                               layout.counts.items()}
        d, s = g.summary(k)
        assert d.shape == (layout.total, 6) and s.shape == (layout.total, 5)
        log = g.checked_log(k)
        assert log.accepted.max() == k - 1 and log.accepted.min() < k - 1
        if feed == "mtp":
            drafts = g.small(k, "drafts")
            assert (drafts == log.tokens[:, 1:]).all() and log.decoded is not None


class _Counting:
    """A location that counts the keys read through it."""

    def __init__(self, path):
        self.inner, self.keys = locate(path), []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get(self, key):
        self.keys.append(key)
        return self.inner.get(key)


def test_opening_reads_the_metadata_alone_and_rows_only_their_chunks(golden):
    loc = _Counting(golden)
    loc.url = loc.inner.url
    g = open_golden(loc)
    assert loc.keys == ["zarr.json", "run/zarr.json"]  # what the numbers depend on; the run's timings
    g.log(2)
    assert loc.keys == ["zarr.json", "run/zarr.json"]  # the metadata's copy
    assert len(g.log(2).step_ms) == g.info.steps
    loc.keys.clear()
    g.read_rows(2, "verify", np.array([4, 5]))  # both rows of step 2
    chunks = [k for k in loc.keys if "/c/" in k]
    assert sorted(chunks) == ["k2/logits.hi/c/2/0/0", "k2/logits.lo/c/2/0/0/0"]


def test_statistics_that_disagree_with_their_rows_are_refused(golden):
    """A golden written with a wrong statistic (its checksums and manifest good) is refused when read whole,
    and an argmax outside the vocabulary as soon as the K is compared."""
    stats = zarr.open_array(zarr.storage.LocalStore(golden / "k2" / "stats"), mode="r+")
    a = stats[...]
    a[3, 2] = np.nan  # row 3's margin
    stats[...] = a
    edit_meta(golden, lambda m: None)
    with pytest.raises(GoldenCorruptError, match=r"k2/stats: 1 row\(s\) disagree with the stored rows \(first: "
                                                 r"prefill row 3\)"):
        open_golden(golden).verify_rows(2)
    a[3, 0] = V + 5  # its argmax
    stats[...] = a
    edit_meta(golden, lambda m: None)
    with pytest.raises(GoldenCorruptError, match="k2/stats: an argmax outside the vocabulary"):
        open_golden(golden).side(2)
