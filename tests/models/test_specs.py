"""Model specs naming a file are stored portably (`vd.models.specs`): relative to the project or to the golden's
folder, and resolved back there, so a golden recorded on one checkout names the same file on another."""

import os
import shutil
from pathlib import Path

from vd.models.specs import golden_dir, portable, resolve, stored
from vd.store import locate, open_golden

PLUGINS = Path(__file__).parent.parent / "plugins"


def test_a_file_spec_is_stored_relative_to_the_project_or_the_golden(tmp_path):
    inside = f"{PLUGINS / 'perturb.py'}:factory"  # the tests run from the project root
    spec, base = portable(inside, tmp_path)
    assert (spec, base) == (f"{(PLUGINS / 'perturb.py').relative_to(Path.cwd()).as_posix()}:factory", "project")
    assert resolve(spec, base, None) == os.path.normpath(PLUGINS / "perturb.py") + ":factory"
    beside = tmp_path / "engines" / "x.gguf"
    beside.parent.mkdir()
    beside.write_bytes(b"GGUF")
    assert portable(f"llamacpp:{beside}", tmp_path) == ("llamacpp:engines/x.gguf", "golden")
    moved = resolve("llamacpp:engines/x.gguf", "golden", tmp_path / "moved")
    assert moved == f"llamacpp:{tmp_path}/moved/engines/x.gguf"
    assert portable("tiny-llama", tmp_path) == ("tiny-llama", None)  # presets and module plug-ins are portable
    assert portable("vd.models.presets:nothing", tmp_path) == ("vd.models.presets:nothing", None)
    assert portable(None, tmp_path) == (None, None)
    assert portable("/nowhere/else.py:factory", tmp_path) == ("/nowhere/else.py:factory", None)


def test_a_golden_and_its_plugin_moved_together_replay_from_their_new_place(cli, tmp_path):
    """A plug-in beside the golden (outside the project) is stored relative to the golden's folder: the two
    moved elsewhere still replay without --model."""
    first = tmp_path / "first"
    first.mkdir()
    shutil.copy(PLUGINS / "reseeded.py", first / "engine.py")
    g = first / "g.zarr"
    code, _, err = cli("record", g, "--model", f"{first / 'engine.py'}:factory", "--k", "2", "--steps", "4",
                       "--allow-thin")
    assert code == 0, err
    model = open_golden(g).meta["model"]
    assert (model["spec"], model["spec_base"]) == ("engine.py:factory", "golden")
    moved = tmp_path / "elsewhere"
    shutil.move(first, moved)
    assert stored(open_golden(moved / "g.zarr").meta["model"], golden_dir(locate(moved / "g.zarr")))[0] == \
        f"{moved / 'engine.py'}:factory"
    code, out, err = cli("replay", moved / "g.zarr")
    assert code == 0 and out.rstrip().endswith("PASS"), out + err


def test_a_failure_of_a_project_relative_model_replays_from_any_folder(cli, tmp_path, monkeypatch):
    """A golden whose plug-in is stored relative to its project (the folder it was recorded in) resolves it
    against the folder a replay runs in: the command a FAIL prints, and its bundle's command.sh, passed no
    --model and failed from any other folder ('unknown model'); they pass the file that ran, made absolute, and
    the replay they run still takes it as the golden's own model (its accept step a refresh, not a new model)."""
    import shlex

    project, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    shutil.copy(PLUGINS / "reseeded.py", project / "engine.py")
    monkeypatch.chdir(project)
    code, _, err = cli("record", "g.zarr", "--model", "engine.py:factory", "--k", "2", "--steps", "4",
                       "--allow-thin")
    assert code == 0 and open_golden(project / "g.zarr").meta["model"]["spec_base"] == "project", err
    code, out, err = cli("replay", "g.zarr", "--forward", "sdpa")
    assert code == 1, out + err
    look = next(line for line in out.splitlines() if "Look at the first divergence" in line)
    assert f"--model {project / 'engine.py'}:factory" in look, look
    assert cli("replay", "g.zarr", "--forward", "sdpa", "--report", "r.json")[0] == 1
    monkeypatch.chdir(elsewhere)
    command = (project / "r.json.bundle" / "command.sh").read_text().splitlines()[-1]
    assert f"--model {project / 'engine.py'}:factory" in command, command
    argv = shlex.split(command.replace('"$@" ', "").replace('"$here/replay.json"', str(elsewhere / "again.json")))
    code, again, err = cli(*argv)
    assert code == 1 and "FAIL" in again.splitlines(), again + err  # as the original replay: not 2, no model
    accept = next(line for line in again.splitlines() if "To make sdpa the golden's forward" in line)
    assert "--refresh --forward sdpa --reason TEXT" in accept and "--model" not in accept, accept
