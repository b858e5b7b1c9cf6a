"""Suite declarations: [tool.vd] in pyproject.toml or vd.toml, checked whole, one line naming the file and
the key for anything that cannot work."""

import pytest

from vd.workflow.declare import DeclarationError, find, load_suite


def _write(tmp_path, text, name="vd.toml"):
    (tmp_path / name).write_text(text)
    return tmp_path / name


def test_a_suite_declared_in_pyproject_resolves_paths_and_defaults(tmp_path):
    f = _write(tmp_path, """
[project]
name = "engine"
[tool.vd.defaults]
model = "tiny-llama"
steps = 4
[tool.vd.goldens.ref]
path = "goldens/ref.zarr"
k = [2, 3]
[tool.vd.goldens.remote]
path = "s3://bucket/goldens/ref.zarr"
steps = 8
policy = "verify=kl:0.05"
""", "pyproject.toml")
    s = load_suite(f)
    assert list(s.entries) == ["ref", "remote"]
    ref, remote = s.entries["ref"], s.entries["remote"]
    assert ref.path == str(tmp_path / "goldens" / "ref.zarr") and ref.k == (2, 3) and ref.steps == 4
    assert remote.path == "s3://bucket/goldens/ref.zarr" and remote.steps == 8 and remote.policy == ("verify=kl:0.05",)
    assert ref.declared() == {"model": "tiny-llama", "k": (2, 3), "steps": 4}
    assert find(tmp_path) == f
    (tmp_path / "sub").mkdir()
    assert find(tmp_path / "sub") == f
    assert [e.name for e in s.select(["remote"])] == ["remote"]


def test_a_folder_declaring_in_both_files_is_refused_unless_one_is_named(tmp_path, cli, monkeypatch):
    """vd.toml was read and pyproject.toml's [tool.vd] beside it ignored without a word: its goldens were never
    recorded, replayed or listed. A pyproject.toml without [tool.vd] (or one vd cannot read) is no second one."""
    _write(tmp_path, '[goldens.a]\npath = "a.zarr"\n')
    py = _write(tmp_path, "[project]\nname = 'x'\n", "pyproject.toml")
    assert find(tmp_path) == tmp_path / "vd.toml"
    py.write_text("[project\n")
    assert find(tmp_path) == tmp_path / "vd.toml"
    py.write_text('[tool.vd.goldens.b]\npath = "b.zarr"\n')
    with pytest.raises(DeclarationError, match=r"declares goldens twice, in vd.toml and in pyproject.toml's "
                                               r"\[tool.vd\]: keep one \(or name the one meant: --config FILE"):
        find(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("status", "--no-models")
    assert code == 2 and err.startswith("vd: error: ") and "declares goldens twice" in err and err.count("\n") == 1
    code, out, err = cli("status", "--no-models", "--config", "pyproject.toml")
    assert " b " in out and " a " not in out, out


@pytest.mark.parametrize("body, message", [
    ('[goldens.a]\npath = "a.zarr"\nkk = 3', r"\[goldens.a\] unknown key 'kk'"),
    ('[goldens.a]\npath = "a.zarr"\nk = "2,3"', r"\[goldens.a\] key 'k': expected a list of distinct verify widths"),
    ('[goldens.a]\npath = "a.zarr"\nk = [2, 2]', r"key 'k'"),
    ('[goldens.a]\npath = "a.zarr"\nsteps = 0', r"key 'steps': expected a step count"),
    ('[goldens.a]\npath = "a.zarr"\n[goldens.b]\npath = "./a.zarr"', r"\[goldens.b\] key 'path': './a.zarr' is also "
                                                                       r"golden a's"),
    ('[goldens.a]\nmodel = "x"', r"\[goldens.a\] has no 'path'"),
    ('[goldens.a]\npath = "a.zarr"\npolicy = "verify=close"', r"\[goldens.a\] key 'policy': unknown tolerance"),
    ('[goldens.a]\npath = "a.zarr"\nfeed = "drafty"', r"key 'feed'"),
    ('[defaults]\npath = "x"\n[goldens.a]\npath = "a.zarr"', r"\[defaults\] cannot set 'path'"),
    (f'[defaults]\npin = "sha256:{"0" * 64}"\n[goldens.a]\npath = "a.zarr"', r"\[defaults\] cannot set 'pin'"),
    ('goldens = 3', r"must be a table|no goldens"),
    ('[golden.a]\npath = "a.zarr"', r"unknown key golden"),
    ('[goldens."../goldens/tiny"]\npath = "a.zarr"', r"\[goldens.../goldens/tiny\]: a golden's name is a name"),
    ('[goldens."a/b"]\npath = "a.zarr"', r"a golden's name is a name, not a path"),
    ('[goldens."x..y"]\npath = "a.zarr"', r"a golden's name is a name"),
    ('[goldens.a]\npath = "a.zarr"\npin = "sha256:abc"', r"key 'pin': expected a content digest"),
    ('[goldens.a\npath = "a.zarr"', r"not valid TOML"),
    pytest.param('[goldens.a]\npath = "a.zarr"\nk = ' + "[" * 2000 + "2" + "]" * 2000, r"nested too deeply to read",
                 id="arrays-2000-deep"),
    pytest.param("[goldens" + ".a" * 2000 + "]\nb = 1", r"\[goldens(\.a)+\] nests more than 16 ",
                 id="table-headers-2000-deep"),
    pytest.param('[goldens.a]\npath = "a.zarr"\nmodel = ' + "[" * 17 + "]" * 17, r"\[goldens.a.model(\.0)+\] nests",
                 id="arrays-17-deep"),
])
def test_bad_declarations_name_the_file_and_the_key(tmp_path, body, message):
    f = _write(tmp_path, body)
    with pytest.raises(DeclarationError, match=message) as e:
        load_suite(f)
    assert str(e.value).startswith(str(f)) and "\n" not in str(e.value)


def test_unknown_names_and_missing_files_are_usage_errors(tmp_path):
    f = _write(tmp_path, '[goldens.a]\npath = "a.zarr"')
    with pytest.raises(DeclarationError, match="no golden named 'b'"):
        load_suite(f).select(["b"])
    with pytest.raises(DeclarationError, match="no such declaration file"):
        load_suite(tmp_path / "nope.toml")
