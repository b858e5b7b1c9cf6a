"""The checkout's folders are its import paths: every package the wheel installs is the folder of that dotted
path under the repository root (vd/recorder and vd/replayer are links to the card's top-level recorder/ and
replayer/, which pyproject installs there), every import of a vd module in the product, the tests and the tools
names a module that exists on disk, and the entry points name modules that exist."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _module_path(name: str) -> Path | None:
    """The file or package folder of dotted ``name`` under the root, if it exists."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_each_installed_package_is_its_folder_in_the_checkout():
    setuptools = PYPROJECT["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})
    for package in setuptools["packages"]:
        dotted = ROOT.joinpath(*package.split("."))
        installed_from = ROOT / mapped.get(package, package.replace(".", "/"))
        assert (dotted / "__init__.py").is_file(), f"{package} is not the folder {dotted}"
        assert dotted.resolve() == installed_from.resolve(), f"{package}: {dotted} is not {installed_from}"


def _vd_imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """Every absolute import of a vd module in ``path``: line, module, and the names taken from it."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "vd"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vd":
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def test_every_vd_import_names_a_module_on_disk():
    files = [p for top in ("vd", "recorder", "replayer", "tests", "tools") for p in (ROOT / top).rglob("*.py")
             if "data" not in p.relative_to(ROOT).parts]
    missing = []
    for path in files:
        for line, module, names in _vd_imports(path):
            if _module_path(module) is None:
                missing.append(f"{path.relative_to(ROOT)}:{line} {module}")
                continue
            missing += [f"{path.relative_to(ROOT)}:{line} {module}.{n}" for n in names
                        if _module_path(f"{module}.{n}") is None and not _defines(module, n)]
    assert not missing, "imports of modules that are not on disk:\n" + "\n".join(missing)


def test_no_file_imports_a_private_name_of_a_vd_module():
    """A name starting with one underscore is its module's own: a module another one needs makes it public."""
    files = [p for top in ("vd", "recorder", "replayer", "tests", "tools") for p in (ROOT / top).rglob("*.py")
             if "data" not in p.relative_to(ROOT).parts]
    private = [f"{path.relative_to(ROOT)}:{line} {module}.{n}" for path in files
               for line, module, names in _vd_imports(path)
               for n in names if n.startswith("_") and not n.startswith("__")]
    assert not private, "imports of another module's private names:\n" + "\n".join(private)


def _defines(module: str, name: str) -> bool:
    """Whether module ``module`` binds ``name`` at its top level (a function, class, constant or import, also
    inside a top-level ``if`` or ``try``), or names it in a module ``__getattr__`` (a lazy export)."""
    source = _module_path(module).read_text()
    names = _top_level_names(ast.parse(source).body)
    return name in names or ("__getattr__" in names and f'"{name}"' in source)


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):
            for part in (node.body, node.orelse, getattr(node, "finalbody", []),
                         *[h.body for h in getattr(node, "handlers", [])]):
                names |= _top_level_names(part)
    return names


def test_entry_points_name_modules_on_disk():
    project = PYPROJECT["project"]
    targets = [v.split(":")[0] for v in project["scripts"].values()]
    targets += list(project["entry-points"]["pytest11"].values())
    assert all(_module_path(t) is not None for t in targets), targets


def test_python_m_vd_runs_from_the_root_without_flags():
    """``python -m vd`` from the root imports every layer from the checkout's folders."""
    code = ("import importlib, sys; mods = ['vd.cli.app', 'vd.recorder.record', 'vd.replayer.replay', "
            "'vd.workflow.plugin']; print('\\n'.join(importlib.import_module(m).__file__ for m in mods))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(Path(f).is_relative_to(ROOT / "vd") for f in done.stdout.split()), done.stdout
    helped = subprocess.run([sys.executable, "-m", "vd", "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert helped.returncode == 0 and "record" in helped.stdout, helped.stderr
