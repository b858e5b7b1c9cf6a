"""Damage never passes: every file of a golden flipped, truncated, deleted, replaced by a directory or by a
chunk of another golden, or rewritten through zarr with its checksum made good, is caught by `vd verify`
and by a replay (exit 2, naming the file), never judged; and metadata mutated at random (a property-based
campaign) gives exit 0, 1 or 2, never a traceback."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from golden_edit import damage, edit_meta
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from vd.cli import app
from vd.errors import GoldenError, ModelMismatchError, UsageError
from vd.models import load_model
from vd.recorder import RecordSettings, record
from vd.replayer import ReplaySettings, replay
from vd.store import open_golden

SETTINGS = RecordSettings(model="tiny-llama", steps=4, ks=(2, 3))
HOWS = ("flip", "truncate", "delete", "directory", "foreign", "rewritten")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama")


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny):
    """A golden and another one of other numbers (the source of foreign chunks)."""
    root = tmp_path_factory.mktemp("integrity")
    record(root / "g.zarr", SETTINGS, model=tiny)
    record(root / "other.zarr", RecordSettings(model="tiny-llama", steps=4, ks=(2, 3), prompt="Other words."),
           model=tiny)
    return root


def _files(golden: Path) -> list[str]:
    return sorted(open_golden(golden).manifest)


def _harm(golden: Path, other: Path, key: str, how: str) -> None:
    path = golden / key
    if how == "foreign":
        shutil.copyfile(other / key, path)
    elif how == "rewritten":  # the array's first value changed, re-encoded as a writer would: checksums good
        array = zarr.open_array(zarr.storage.LocalStore(golden / key.split("/c/")[0]), mode="r+")
        a = array[...]
        a.flat[0] = a.flat[0] + 1 if a.dtype != np.bool_ else not a.flat[0]
        array[...] = a
    else:
        damage(path, how)


def _keys(golden: Path, how: str) -> list[str]:
    """The files to harm: every file, or for ``rewritten`` each array's first chunk."""
    keys = _files(golden)
    if how == "rewritten":
        keys = [k for k in keys if "/c/" in k and set(k.split("/c/")[1].split("/")) == {"0"}]
    return keys


def _cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.stderr


def test_every_file_is_in_the_manifest(made):
    g = open_golden(made / "g.zarr")
    on_disk = {p.relative_to(made / "g.zarr").as_posix() for p in (made / "g.zarr").rglob("*") if p.is_file()}
    assert on_disk - set(g.manifest) == {"zarr.json", "run/zarr.json"}
    assert len(g.manifest) > 40 and g.meta["golden_id"].startswith("sha256:")


@pytest.mark.parametrize("how", HOWS)
def test_any_damage_to_any_file_fails_verify_naming_it(made, tmp_path, how):
    caught = 0
    for key in _keys(made / "g.zarr", how):
        if how == "foreign" and (made / "other.zarr" / key).read_bytes() == (made / "g.zarr" / key).read_bytes():
            continue  # the same bytes in both goldens (an array's zarr.json): nothing changes
        copy = tmp_path / f"{caught}.zarr"
        shutil.copytree(made / "g.zarr", copy)
        _harm(copy, made / "other.zarr", key, how)
        code, err = _cli("verify", copy)
        assert code == 2 and key in err and err.count("\n") == 1, (key, how, err)
        caught += 1
    assert caught >= (12 if how == "rewritten" else 20)


def _damage_replays(made, tmp_path, tiny, how: str, every: int) -> None:
    for i, key in enumerate(_keys(made / "g.zarr", how)[::every]):
        if how == "foreign" and (made / "other.zarr" / key).read_bytes() == (made / "g.zarr" / key).read_bytes():
            continue
        copy = tmp_path / f"{i}.zarr"
        shutil.copytree(made / "g.zarr", copy)
        _harm(copy, made / "other.zarr", key, how)
        with pytest.raises(GoldenError, match=key.replace(".", r"\.")):
            replay(copy, ReplaySettings(), model=tiny)


@pytest.mark.parametrize("how", HOWS)
def test_damage_never_reaches_a_verdict(made, tmp_path, tiny, how):
    """A replay (the model given, as a test or the plugin runs it) refuses every damaged golden: a sample of
    files here, every one with -m campaign."""
    _damage_replays(made, tmp_path, tiny, how, every=7)


@pytest.mark.campaign
@pytest.mark.parametrize("how", HOWS)
def test_damage_campaign(made, tmp_path, tiny, how):
    _damage_replays(made, tmp_path, tiny, how, every=1)


# -- metadata mutated at random -------------------------------------------------------------------------------
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.lists(st.integers(-3, 600), max_size=6),
                    st.dictionaries(st.text(max_size=5), st.integers(-2, 5), max_size=3))


def _paths(meta, prefix=()) -> list[tuple]:
    out = []
    for key, v in meta.items():
        if key in ("manifest", "golden_id"):
            continue
        out.append((*prefix, key))
        if isinstance(v, dict):
            out.extend(_paths(v, (*prefix, key)))
    return out


def _mutate(meta: dict, path: tuple, value, delete: bool) -> None:
    node = meta
    for key in path[:-1]:
        node = node[key]
    if delete:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


@pytest.fixture(scope="module")
def meta_paths(made):
    return _paths(json.loads((made / "g.zarr" / "zarr.json").read_text())["attributes"]["vd"])


def _fuzz(made, tiny, meta_paths, tmp_path_factory, data, sealed: bool) -> None:
    path = meta_paths[data.draw(st.integers(0, len(meta_paths) - 1))]
    value, delete = data.draw(_VALUES), data.draw(st.booleans())
    copy = tmp_path_factory.mktemp("fuzz") / "g.zarr"
    shutil.copytree(made / "g.zarr", copy)
    before = (copy / "zarr.json").read_text()
    edit_meta(copy, lambda m: _mutate(m, path, value, delete), sealed=sealed)
    changed = json.loads((copy / "zarr.json").read_text()) != json.loads(before)
    code, err = _cli("verify", copy)
    assert code in (0, 2) and (code == 0 or err.count("\n") == 1), (path, value, delete, err)
    if code == 0:  # a field no check needs: the replay still ends in a verdict or one line
        try:
            r = replay(copy, ReplaySettings(), model=tiny)
            assert r.verdict in ("PASS", "FAIL")
        except (GoldenError, ModelMismatchError):  # a golden written so for another model: refused, one line
            pass
    if not sealed and changed:  # edited after it was written: never judged, whichever check names it
        assert code == 2, (path, value, delete)


# The default run's samples are derandomized (the same examples on every run: a red CI is a real change); the
# random exploration is the -m campaign tests', and what they find becomes a fixed test (as the wrong-type one).
@pytest.mark.parametrize("sealed", [False, True], ids=["edited", "written-so"])
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_metadata_mutations_end_in_a_verdict_or_one_line(made, tiny, meta_paths, tmp_path_factory, data, sealed):
    _fuzz(made, tiny, meta_paths, tmp_path_factory, data, sealed)


@pytest.mark.campaign
@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), sealed=st.booleans())
def test_metadata_mutation_campaign(made, tiny, meta_paths, tmp_path_factory, data, sealed):
    _fuzz(made, tiny, meta_paths, tmp_path_factory, data, sealed)


# -- arrays rewritten at random, as a writer would store them (checksums and manifest made good) ---------------
_SMALL = ("prompt", "k2/tokens", "k2/accepted", "k2/digests", "k2/stats", "k3/tokens", "k3/accepted")


def _fuzz_array(made, tiny, tmp_path_factory, data) -> None:
    name = data.draw(st.sampled_from(_SMALL))
    copy = tmp_path_factory.mktemp("fuzz-array") / "g.zarr"
    shutil.copytree(made / "g.zarr", copy)
    array = zarr.open_array(zarr.storage.LocalStore(copy / name), mode="r+")
    a = array[...]
    i = data.draw(st.integers(0, a.size - 1))
    if a.dtype.kind == "f":
        a.flat[i] = data.draw(st.floats(allow_nan=True, allow_infinity=True, width=64))
    else:
        a.flat[i] = data.draw(st.integers(int(np.iinfo(a.dtype).min), int(np.iinfo(a.dtype).max)))
    array[...] = a
    edit_meta(copy, lambda m: None)  # sealed: only the checks of the contents can find it
    code, err = _cli("verify", copy)
    assert code in (0, 2) and (code == 0 or err.count("\n") == 1), (name, i, err)
    if code == 0:
        try:
            assert replay(copy, ReplaySettings(), model=tiny).verdict in ("PASS", "FAIL")
        except GoldenError:
            pass


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data())
def test_arrays_rewritten_at_random_end_in_a_verdict_or_one_line(made, tiny, tmp_path_factory, data):
    _fuzz_array(made, tiny, tmp_path_factory, data)


@pytest.mark.campaign
@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_array_mutation_campaign(made, tiny, tmp_path_factory, data):
    _fuzz_array(made, tiny, tmp_path_factory, data)


_WRONG = (True, -1, "x", [], {}, [-1], {"2": True})


@pytest.mark.parametrize("value", _WRONG, ids=[repr(v) for v in _WRONG])
def test_each_field_written_with_a_wrong_type_ends_in_a_verdict_or_one_line(made, tiny, meta_paths, tmp_path, value):
    """Every metadata field, written so by a writer (sealed) with a value of the wrong type: `vd verify` and a
    replay end in a verdict or one line, never a traceback (the random campaign found `left_greedy: true`)."""
    for i, path in enumerate(p for p in meta_paths if len(p) == 1):
        copy = tmp_path / f"{i}" / "g.zarr"
        shutil.copytree(made / "g.zarr", copy)
        edit_meta(copy, lambda m, path=path: _mutate(m, path, value, False), sealed=True)
        code, err = _cli("verify", copy)
        assert code in (0, 2) and (code == 0 or err.count("\n") == 1), (path, err)
        if code == 0:
            try:
                assert replay(copy, ReplaySettings(), model=tiny).verdict in ("PASS", "FAIL"), path
            except (GoldenError, ModelMismatchError, UsageError):  # refused, one line (e.g. no forward "x")
                pass


def _forge_content(meta: dict) -> None:
    meta["content_digest"] = meta["history"][-1]["content_digest"] = "sha256:" + "1" * 64


def _break_chain(meta: dict) -> None:
    meta["history"].append({**meta["history"][0], "version": 2, "reason": "again", "previous": "sha256:" + "0" * 64})


def _accept_more(golden: Path) -> None:
    """Step 1 of K=2 (a corrupted draft, 0 accepted) said to accept its draft, in the array and the metadata's copy."""
    array = zarr.open_array(zarr.storage.LocalStore(golden / "k2" / "accepted"), mode="r+")
    a = array[...]
    assert a[1] == 0
    a[1] = 1
    array[...] = a
    edit_meta(golden, lambda m: m["logs"]["2"]["accepted"].__setitem__(1, 1))


@pytest.mark.parametrize("forge, said", [
    (lambda g: edit_meta(g, lambda m: m.__setitem__("content_digest", "sha256:" + "1" * 64)),
     ("metadata field 'content_digest' is 'sha256:111", ", not its history's last version's")),
    (lambda g: edit_meta(g, _forge_content), ("metadata field 'content_digest' is sha256:" + "1" * 64,
                                              ", not what its step logs and row digests make (sha256:")),
    (lambda g: edit_meta(g, _break_chain), ("metadata field 'history': version 2's previous content digest is "
                                            "'sha256:000", ", not version 1's")),
    (_accept_more, ("k2: step 1 accepted 1 draft(s) of [", "and its rows' argmaxes"))])
def test_a_golden_whose_own_figures_disagree_is_refused_by_verify(made, tmp_path, forge, said):
    """Edits a golden's files cannot show once its manifest and ID are made again to match (found by a user test):
    a content digest that is not its history's last, or not what its logs and row digests make (a pin copies it
    from `vd show`); a history whose versions do not chain; an accept count its rows' argmaxes do not make. `vd
    verify` said intact; each is refused (exit 2, one line) and a replay of it never PASSes."""
    golden = tmp_path / "g.zarr"
    shutil.copytree(made / "g.zarr", golden)
    forge(golden)
    code, err = _cli("verify", golden)
    assert code == 2 and all(n in err for n in said) and err.count("\n") == 1, err
    code, err = _cli("replay", golden, "--model", "tiny-llama", "--verify")
    assert code == 2 and all(n in err for n in said), err
