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
