"""Model specs as a golden stores them: portable where they name a file.

A spec naming a file (a plug-in ``path/to/file.py:factory``, ``llamacpp:PATH.gguf``, a checkpoint directory
or ``.gguf`` file, an MTP head file) is stored with that path relative to the project (the directory vd
ran in) when the file lies inside it, else relative to the folder holding the golden when it lies there,
else relative to the nearest folder above the directory vd ran in that holds the golden and the file (a
command run in the project's tests/), else as typed; the golden notes which (``spec_base``, ``head_base``:
``project`` or ``golden``). A replay (or a refresh, or a suite) resolves it back against the same base (a
project file not in the working directory is looked for in the folders above it, then above the golden), so a
golden recorded on one machine names the same file on another checkout, from the project or a subfolder. A
suite declaration's model file is relative to the declaring file (`anchored`). Presets and
``package.module:factory`` plug-ins are portable as they are. Imports nothing heavy.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import overload

_FILE_PLUGIN = re.compile(r"^(?P<target>.+\.py):(?P<factory>[A-Za-z_]\w*)$")
LLAMACPP = "llamacpp:"


def _split(spec: str, *, exists: bool) -> tuple[str, str, str] | None:
    """``spec`` as (prefix, file path, suffix), or None where it names no file (``exists``: a bare path counts
    only if it exists, as `vd.models.spec_kind` decides)."""
    if spec.startswith(LLAMACPP):
        return LLAMACPP, spec[len(LLAMACPP):], ""
    m = _FILE_PLUGIN.match(spec)
    if m and not Path(spec).exists():
        return "", m["target"], f":{m['factory']}"
    if not exists or Path(spec).exists():
        return "", spec, ""
    return None


def portable(spec: str | None, golden_dir: Path | None) -> tuple[str | None, str | None]:
    """The spec to store and its base (None: stored as typed)."""
    parts = None if spec is None else _split(spec, exists=True)
    if parts is None:
        return spec, None
    prefix, path, suffix = parts
    absolute = Path(os.path.abspath(path))
    for base, root in (("project", Path.cwd()), ("golden", golden_dir), *_projects_above(golden_dir)):
        if root is not None and absolute.is_relative_to(os.path.abspath(root)):
            return prefix + absolute.relative_to(os.path.abspath(root)).as_posix() + suffix, base
    return spec, None


def _projects_above(golden_dir: Path | None) -> list[tuple[str, Path]]:
    """The folders above the working directory that hold the golden too (nearest first; not the filesystem's
    root): the project a command run in its subfolder (tests/) works in, which `resolve` finds again from there."""
    if golden_dir is None:
        return []
    golden = Path(os.path.abspath(golden_dir))
    return [("project", folder) for folder in Path(os.path.abspath(Path.cwd())).parents
            if folder.parent != folder and golden.is_relative_to(folder)]


@overload
def resolve(spec: str, base: str | None, golden_dir: Path | None) -> str: ...
@overload
def resolve(spec: None, base: str | None, golden_dir: Path | None) -> None: ...


def resolve(spec: str | None, base: str | None, golden_dir: Path | None) -> str | None:
    """A stored spec back to one naming the file from here (unchanged where it has no base, or where the
    base is the golden's folder and the golden is not local). The project is the folder vd ran in when it
    recorded: the working directory, or, where the file is not there (a command run in a subfolder of the
    project, its tests/), the nearest folder above it, else above the golden, that holds it."""
    if spec is None or base not in ("project", "golden"):
        return spec
    root = Path.cwd() if base == "project" else golden_dir
    parts = _split(spec, exists=False)
    if root is None or parts is None:
        return spec
    prefix, path, suffix = parts
    if base == "project" and not os.path.isabs(path) and not (root / path).exists():
        above = [*Path.cwd().parents, *([golden_dir, *golden_dir.parents] if golden_dir is not None else [])]
        root = next((folder for folder in above if (folder / path).exists()), root)
    return prefix + os.path.normpath(os.path.join(root, path)) + suffix


def anchored(spec: str, base: Path) -> str:
    """A declared SPEC naming a file by a relative path (``file.py:factory``, ``llamacpp:PATH``, a checkpoint
    that exists there), made absolute from ``base``, the declaring file's folder, as a declared ``path`` is;
    a preset or a ``package.module:factory`` plug-in unchanged."""
    parts = _split(spec, exists=False)
    if parts is None:
        return spec
    prefix, path, suffix = parts
    if os.path.isabs(path) or not (prefix or suffix or (base / path).exists()):
        return spec
    return prefix + os.path.normpath(os.path.join(base, path)) + suffix


def names_stored(asked: str, meta_model: Mapping, golden_dir: Path | None) -> bool:
    """Whether the model SPEC ``asked`` names the golden's own (its metadata's ``model``): as stored, or naming
    the same file; a spec stored relative to its project, from any folder: a path ending in the stored one (the
    absolute spec a command replaying a failure passes, run from elsewhere)."""
    spec: str = meta_model["spec"]
    if asked == spec:
        return True
    mine, theirs = _split(asked, exists=False), _split(spec, exists=False)
    if mine is None or theirs is None or mine[0] != theirs[0] or mine[2] != theirs[2]:
        return False
    path = Path(os.path.abspath(mine[1]))
    if meta_model.get("spec_base") == "project":
        return path.as_posix().endswith("/" + Path(theirs[1]).as_posix().lstrip("/"))
    return path == Path(os.path.abspath(resolve(spec, meta_model.get("spec_base"), golden_dir)))


def stored(meta_model: Mapping, golden_dir: Path | None) -> tuple[str, str | None]:
    """A golden's model spec and head file (its metadata's ``model``), resolved from here."""
    spec: str = meta_model["spec"]  # every golden has one (`vd.store.schema`)
    head: str | None = meta_model.get("head")
    return (resolve(spec, meta_model.get("spec_base"), golden_dir),
            resolve(head, meta_model.get("head_base"), golden_dir))


def golden_dir(location) -> Path | None:
    """The local folder holding a golden (a directory or a zip file), None on an object store."""
    target = getattr(location, "target", None) or getattr(location, "path", None)
    return None if target is None else Path(os.path.abspath(target)).parent
