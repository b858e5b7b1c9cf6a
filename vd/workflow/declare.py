"""A suite of goldens declared once (`load_suite`): ``[tool.vd]`` in a project's ``pyproject.toml``, or a
``vd.toml`` beside the goldens, names each golden and what records it::

    [tool.vd.goldens.smollm2-default]      # in vd.toml: [goldens.smollm2-default]
    path = "goldens/smollm2.zarr"          # a directory, a .zip file or s3://bucket/prefix
    model = "smollm2"
    k = [2, 3, 4]
    steps = 16
    prompt = "Write one sentence about the sea."

Every key but ``path`` may be left out (the recorder's default) or set once for all goldens under
``[tool.vd.defaults]``. A relative path is relative to the declaring file. A declaration that cannot work
(an unknown key, a value of the wrong type, two goldens with one path) is refused whole with one line naming
the file and the key (`DeclarationError`, exit 2), before anything is recorded, replayed or removed.
This module imports neither torch nor a model, so declarations are checked in a fraction of a second.
"""

from __future__ import annotations

import fcntl
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from vd.errors import UsageError, VdError
from vd.models.specs import anchored
from vd.preflight import check_batch

FILES = ("vd.toml", "pyproject.toml")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a golden's name: it names files (NAME.zarr, NAME/)


class DeclarationError(UsageError):
    """A suite declaration that cannot work (exit 2)."""


def _ints(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def _strs(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# Each key a golden's declaration may hold: (a check of its TOML value, what the check wants).
KEYS = {
    "path": (lambda v: isinstance(v, str) and v.strip() != "", "a path or URL"),
    "model": (lambda v: isinstance(v, str) and v != "", "a model SPEC"),
    "head": (lambda v: isinstance(v, str) and v != "", "an MTP head file"),
    "feed": (lambda v: v in ("reference", "mtp"), '"reference" or "mtp"'),
    "prompt": (lambda v: isinstance(v, str) and v != "", "a prompt text"),
    "k": (lambda v: _ints(v) and all(2 <= x <= 16 for x in v) and len(set(v)) == len(v),
          "a list of distinct verify widths 2..16, like [2, 3, 4]"),
    "steps": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a step count of at least 1"),
    "forward": (lambda v: isinstance(v, str) and v != "", "a forward name"),
    "decode_forward": (lambda v: isinstance(v, str) and v != "", "a forward name (vd record --decode-forward)"),
    "device": (lambda v: isinstance(v, str) and v.split(":")[0] in ("cpu", "cuda"), '"cpu", "cuda" or "cuda:N"'),
    "dtype": (lambda v: v in ("bfloat16", "float16", "float32"), '"bfloat16", "float16" or "float32"'),
    "threads": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a thread count"),
    "deterministic": (lambda v: isinstance(v, bool), "true or false"),
    "policy": (lambda v: isinstance(v, str) or _strs(v), 'a SPEC or a list of "[KIND=]SPEC"'),
    "require_coverage": (lambda v: isinstance(v, bool), "true or false"),
    "allow_thin": (lambda v: isinstance(v, bool), "true or false"),
    "trace": (lambda v: isinstance(v, bool), "true or false"),
    "batch": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a batch size (vd record --batch N)"),
    "slot": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a slot in the batch (--slot I)"),
    "batch_seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a seed (--batch-seed S)"),
    "pin": (lambda v: isinstance(v, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", v) is not None,
            'a content digest, "sha256:" and 64 hex digits (vd show prints it)'),
}
# Keys that say what a golden must be rather than how it is recorded (`Entry.declared` leaves them out).
CHECKS = ("pin",)


@dataclass(frozen=True, slots=True)
class Entry:
    """One declared golden; a field left None is the recorder's default."""

    name: str
    path: str  # resolved: absolute, or a URL as written
    model: str | None = None
    head: str | None = None
    feed: str | None = None
    prompt: str | None = None
    k: tuple[int, ...] | None = None
    steps: int | None = None
    forward: str | None = None
    decode_forward: str | None = None  # the decode rows' forward, where another than ``forward``
    device: str | None = None
    dtype: str | None = None
    threads: int | None = None
    deterministic: bool | None = None
    policy: tuple[str, ...] | None = None
    require_coverage: bool | None = None
    allow_thin: bool | None = None
    trace: bool | None = None
    batch: int | None = None  # recorded as one member of a batch of this size (`vd.batch`); None: alone
    slot: int | None = None
    batch_seed: int | None = None
    pin: str | None = None  # the content digest the golden must have (a replay refuses another; a refresh updates it)
    file: Path | None = field(default=None, compare=False, repr=False)  # the declaration declaring it

    def declared(self) -> dict:
        """The recording settings this entry states (its name, path, pin and file left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("name", "path", "file", *CHECKS) and getattr(self, f.name) is not None}


@dataclass(frozen=True, slots=True)
class Suite:
    """The goldens a file declares, by name (in the file's order)."""

    file: Path
    entries: dict[str, Entry]

    def select(self, names: list[str] | tuple[str, ...] = ()) -> list[Entry]:
        """The named entries (all when none are named); an unknown name is exit 2."""
        unknown = [n for n in names if n not in self.entries]
        twice = sorted({n for n in names if list(names).count(n) > 1})
        if twice:  # (each would run again: two verdicts, or two refreshes, of one golden)
            raise DeclarationError(f"golden {', '.join(map(repr, twice))} named more than once; name each once")
        if unknown:
            raise DeclarationError(f"{self.file}: no golden named {', '.join(map(repr, unknown))} "
                                   f"(declared: {', '.join(self.entries) or 'none'})")
        return [self.entries[n] for n in names] if names else list(self.entries.values())

    def by_path(self, where: str) -> Entry | None:
        """The entry declaring the golden at ``where`` (a path or URL), if any."""
        key = resolve(where, Path.cwd())
        return next((e for e in self.entries.values() if e.path == key), None)


def resolve(path: str, base: Path) -> str:
    """A declared path as vd opens it: a URL unchanged, a local path absolute (relative to ``base``)."""
    if "://" in path:
        return path
    return str(Path(os.path.normpath(base / Path(path).expanduser())))


def find(start: Path | None = None) -> Path | None:
    """The declaring file for ``start`` (the working directory): the nearest ``vd.toml``, or the nearest
    ``pyproject.toml`` with a ``[tool.vd]`` table, looking in ``start`` and then its parents. A folder holding
    both is refused (`DeclarationError`): one would be read and the other's goldens never checked, unsaid."""
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        py = folder / "pyproject.toml"
        if (folder / "vd.toml").is_file():
            if declares(py):
                raise DeclarationError(f"{folder} declares goldens twice, in vd.toml and in pyproject.toml's "
                                       "[tool.vd]: keep one (or name the one meant: --config FILE, in pytest "
                                       "--vd-config FILE)")
            return folder / "vd.toml"
        if py.is_file() and "vd" in _read(py).get("tool", {}):
            return py
    return None


def declares(pyproject: Path) -> bool:
    """Whether ``pyproject`` is a readable pyproject.toml with a ``[tool.vd]`` table."""
    try:
        return pyproject.is_file() and "vd" in _read(pyproject).get("tool", {})
    except DeclarationError:  # (beside a vd.toml, a pyproject.toml vd cannot read is none of its business)
        return False


def _read(file: Path) -> dict:
    try:
        return tomllib.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise DeclarationError(f"{file}: cannot read it ({e})") from e
    except tomllib.TOMLDecodeError as e:
        raise DeclarationError(f"{file}: not valid TOML: {e}") from e
    except RecursionError:  # tomllib reads nested arrays and inline tables recursively
        raise DeclarationError(f"{file}: nested too deeply to read (arrays or inline tables inside each other "
                               "hundreds deep)") from None


# How deep a suite's table may nest: its deepest setting is goldens.NAME.KEY, a list at most; far deeper is no
# suite (and a value nested thousands deep, as [goldens.a.model.a.a...] headers make, cannot even be printed).
MAX_DEPTH = 16


def _check_depth(file: Path, table: Mapping, where: str) -> None:
    """A DeclarationError for a suite table nested more than `MAX_DEPTH` deep, naming the file and the key where
    it passes that; walked without recursion."""
    stack: list[tuple[object, str, int]] = [(table, where, 0)]
    while stack:
        value, at, depth = stack.pop()
        if depth > MAX_DEPTH:
            shown = at if len(at) <= 60 else f"{at[:60]}..."
            raise DeclarationError(f"{file}: [{shown}] nests more than {MAX_DEPTH} tables or arrays deep; a suite "
                                   "declares goldens.NAME.KEY")
        items = value.items() if isinstance(value, Mapping) else enumerate(value) if isinstance(value, list) else ()
        stack.extend((v, f"{at}.{k}" if at else str(k), depth + 1) for k, v in items)


def load_suite(file: str | os.PathLike | None = None) -> Suite:
    """The suite declared in ``file`` (default: `find` from the working directory), checked whole."""
    if file is None:
        found = find()
        if found is None:
            raise DeclarationError(f"no suite declared: no vd.toml, and no pyproject.toml with [tool.vd], in "
                                   f"{Path.cwd()} or its parents")
        file = found
    file = Path(file)
    if file.is_dir():
        raise DeclarationError(f"{file} is a folder; --config names the declaration file (a vd.toml, or a "
                               "pyproject.toml with [tool.vd])")
    if not file.is_file():
        raise DeclarationError(f"{file}: no such declaration file")
    doc = _read(file)
    table, where = (doc, "") if file.name != "pyproject.toml" else (doc.get("tool", {}).get("vd"), "tool.vd")
    if not isinstance(table, Mapping):
        raise DeclarationError(f"{file}: no [tool.vd] table")
    _check_depth(file, table, where)
    return Suite(file, _entries(file, table, where))


def entry_for(target: str, config: str | os.PathLike | None = None) -> Entry | None:
    """The declared entry ``target`` names (a NAME, or a declared golden's path): in the suite ``config``, else
    in the declarations `_declarations` reads for it (the one found from here, then the golden's own)."""
    if config is not None:
        return _lookup(load_suite(config), target, by_name=True)
    for file, by_name in _declarations(target):
        entry = _lookup(load_suite(file), target, by_name)
        if entry is not None:
            return entry
    return None


def _declarations(target: str) -> list[tuple[Path, bool]]:
    """The declarations a command on one golden reads for ``target``, each with whether it is looked up by name
    too: the one `find` finds from the working directory (by name or path); then, where ``target`` is a local
    path (a golden on disk, or one to record into an existing folder), the one found from the golden's own
    folder, if another (by path only: a name is the project's where the command runs). A golden named from
    outside its project is still checked against its pin, a refresh of it writes its new pin there, and a first
    recording of it takes its declared settings (it took the defaults, a user test found)."""
    here = find()
    files = [(here, True)] if here is not None else []
    local = "://" not in target
    if local and (os.path.lexists(target) or Path(target).absolute().parent.is_dir()):
        beside = find(Path(target).absolute().parent)
        if beside is not None and beside != here:
            files.append((beside, False))
    return files


def _lookup(suite: Suite, target: str, by_name: bool) -> Entry | None:
    if by_name and target in suite.entries:
        return suite.entries[target]
    return suite.by_path(target)


def declared(target: str, config: str | os.PathLike | None = None) -> Entry | None:
    """`entry_for` for a command on one golden. A declaration found (from here, or from the golden's folder) that
    cannot be read is passed over where it plainly does not declare ``target`` (its TOML read, and no golden in
    it of that name or path: the command does not depend on it; a suite command refuses it). Where it may
    declare it, or its TOML cannot be read at all, its error is the command's (exit 2): the golden's pin and
    settings are in it, and a pin must not go unchecked without a word. One named by ``config`` is the user's,
    and its error is theirs."""
    if config is not None:
        return entry_for(target, config)
    for file, by_name in _declarations(target):
        try:
            entry = _lookup(load_suite(file), target, by_name)
        except DeclarationError:
            if _may_declare(file, target, by_name):
                raise
            continue
        if entry is not None:
            return entry
    return None


def _may_declare(file: Path, target: str, by_name: bool = True) -> bool:
    """Whether the declaration ``file`` (which `load_suite` refuses) may declare ``target`` (a NAME, where
    ``by_name``, or a path): true unless its TOML reads and no golden in it has that name or a ``path`` leading
    there."""
    try:
        doc = _read(file)
    except DeclarationError:
        return True
    table = doc if file.name != "pyproject.toml" else doc.get("tool", {}).get("vd")
    goldens = table.get("goldens") if isinstance(table, Mapping) else None
    if goldens is None:
        return False
    if not isinstance(goldens, Mapping):
        return True
    here = resolve(target, Path.cwd())
    for name, body in goldens.items():
        path = body.get("path") if isinstance(body, Mapping) else None
        if (by_name and name == target) or (isinstance(path, str) and resolve(path, file.parent.absolute()) == here):
            return True
    return False


def _entries(file: Path, table: Mapping, where: str) -> dict[str, Entry]:
    prefix = f"{where}." if where else ""
    extra = sorted(set(table) - {"goldens", "defaults"})
    if extra:
        raise DeclarationError(f"{file}: unknown key {prefix}{extra[0]} (a suite has 'goldens' and 'defaults')")
    defaults = _table(file, table.get("defaults", {}), f"{prefix}defaults")
    for own in ("path", "pin"):  # (a pin is one golden's content digest)
        if own in defaults:
            raise DeclarationError(f"{file}: [{prefix}defaults] cannot set {own!r}: each golden has its own")
    goldens = table.get("goldens")
    if not isinstance(goldens, Mapping) or not goldens:
        raise DeclarationError(f"{file}: no goldens declared (add a [{prefix}goldens.NAME] table with a path)")
    entries: dict[str, Entry] = {}
    paths: dict[str, str] = {}
    for name, body in goldens.items():
        at = f"{prefix}goldens.{name}"
        if not NAME.fullmatch(name) or ".." in name:
            raise DeclarationError(f"{file}: [{at}]: a golden's name is a name, not a path: letters, digits, '.', '_' "
                                   "and '-', at most 128, starting with a letter or digit (it names files: a "
                                   "candidate NAME.zarr, a bundle NAME/)")
        values = {**defaults, **_table(file, body, at)}
        if "path" not in values:
            raise DeclarationError(f"{file}: [{at}] has no 'path'")
        e = _entry(name, values, file, f"{file}: [{at}]")
        if e.path in paths:
            raise DeclarationError(f"{file}: [{at}] key 'path': {values['path']!r} is also golden "
                                   f"{paths[e.path]}'s; each golden needs its own path")
        for other, other_name in paths.items():  # a golden inside another's folder would damage it
            inner, outer = (e.path, other) if e.path.startswith(other.rstrip("/") + "/") else (other, e.path)
            if inner.startswith(outer.rstrip("/") + "/"):
                raise DeclarationError(f"{file}: [{at}] key 'path': {values['path']!r} and golden "
                                       f"{other_name}'s path are one inside the other; a golden cannot hold "
                                       "another: give each a folder of its own")
        entries[name], paths[e.path] = e, name
    return entries


def _table(file: Path, body, at: str) -> dict:
    if not isinstance(body, Mapping):
        raise DeclarationError(f"{file}: [{at}] must be a table of settings")
    for key, value in body.items():
        if key not in KEYS:
            raise DeclarationError(f"{file}: [{at}] unknown key {key!r} (known: {', '.join(KEYS)})")
        check, want = KEYS[key]
        if not check(value):
            raise DeclarationError(f"{file}: [{at}] key {key!r}: expected {want}, got {value!r}")
    return dict(body)


def _entry(name: str, values: Mapping, file: Path, at: str) -> Entry:
    v = dict(values)
    v["path"] = resolve(v["path"], file.parent.absolute())
    for spec in ("model", "head"):  # a file they name is relative to the declaring file too
        if spec in v:
            v[spec] = anchored(v[spec], file.parent.absolute())
    if "k" in v:
        v["k"] = tuple(v["k"])
    if "policy" in v:
        v["policy"] = (v["policy"],) if isinstance(v["policy"], str) else tuple(v["policy"])
        from vd.policy import Policy  # imported only here: it brings torch

        try:
            Policy.parse(v["policy"])
        except UsageError as e:
            raise DeclarationError(f"{at} key 'policy': {e}") from e
    try:
        check_batch(v.get("batch"), v.get("slot"), v.get("batch_seed"), v.get("feed") == "mtp",
                    recording=True)
    except UsageError as e:  # (its words are the flags'; a declaration's are its keys)
        said = re.sub(r"--(batch-seed|batch|slot)( N)?", lambda m: m[1].replace("-", "_") + (" = N" if m[2] else ""),
                      str(e)).replace("without batch", "without a batch")
        raise DeclarationError(f"{at}: {said}") from e
    return Entry(name=name, file=file, **v)


def shard(entries: list[Entry], spec: str | None) -> list[Entry]:
    """The entries of shard ``I/N`` (1 <= I <= N): every N-th entry in name order, starting at the I-th."""
    if spec is None:
        return entries
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise UsageError(f"--shard takes I/N like 2/4; got {spec!r}") from None
    if n < 1:
        raise UsageError(f"--shard {spec}: N, the number of shards, must be at least 1")
    if not 1 <= i <= n:
        raise UsageError(f"--shard {spec}: I must be 1..{n} (shard I of {n})")
    ordered = sorted(entries, key=lambda e: e.name)
    return ordered[i - 1::n]


def check_pin_writable(entry: Entry | None) -> None:
    """Refuse (`DeclarationError`), before anything is published, a pinned golden whose pin `set_pin` could not
    change in the file declaring it: its pin's text not there once, or the file not writable. A refresh that
    published and then failed to write the pin would leave a golden its own pin refuses."""
    if entry is None or entry.pin is None or entry.file is None:
        return
    file = entry.file
    text = file.read_text()
    if text.count(f'"{entry.pin}"') + text.count(f"'{entry.pin}'") != 1:
        raise DeclarationError(f"{file}: golden {entry.name}'s pin {entry.pin} does not appear exactly once, so a "
                               "refresh could not change it with the golden; write it once (pin = \"sha256:...\")")
    if not os.access(file, os.W_OK):
        raise DeclarationError(f"{file} cannot be written, and golden {entry.name}'s pin must change with it: "
                               "make it writable first (nothing was recorded)")


def set_pin(file: Path, entry: Entry, digest: str) -> None:
    """Write ``digest`` as ``entry``'s pin in the declaration ``file`` (a refresh of a pinned golden: the new pin in
    the same review as the new golden). The old pin's text is replaced where it occurs once in the file (else
    `DeclarationError`: the line to change is named), and the file read back must declare the new one. The file
    is locked while it is rewritten (pytest-xdist workers updating two goldens of one declaration)."""
    old = entry.pin
    if old is None or old == digest:
        return
    with open(file, "r+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        text = f.read()
        if text.count(f'"{old}"') + text.count(f"'{old}'") != 1:
            raise DeclarationError(f"{file}: golden {entry.name}'s pin {old} appears more than once, or not at "
                                   f'all; set pin = "{digest}" for it by hand')
        quote = '"' if f'"{old}"' in text else "'"
        f.seek(0)
        f.write(text.replace(f"{quote}{old}{quote}", f"{quote}{digest}{quote}"))
        f.truncate()
    if load_suite(file).entries[entry.name].pin != digest:
        raise DeclarationError(f"{file}: could not update golden {entry.name}'s pin; set pin = \"{digest}\" by hand")


def repin(entry: Entry | None, path: str) -> str | None:
    """A refreshed golden's new pin written into its declaration (`set_pin`), where it is pinned and its content
    digest moved; the new digest, or None where nothing was written. A pin that cannot be written now (checked
    before the refresh, `check_pin_writable`; changed since) is a `DeclarationError` saying the golden was
    published and what to write by hand."""
    if entry is None or entry.pin is None or entry.file is None:
        return None
    from vd.store import content_digest_at  # (only here: a declaration is read without the store)

    digest = content_digest_at(path)
    if digest is None or digest == entry.pin:
        return None
    try:
        set_pin(entry.file, entry, digest)
    except (OSError, DeclarationError) as e:
        raise DeclarationError(f"{path} was published, but its pin in {entry.file} could not be written "
                               f"({str(e).splitlines()[0]}): set pin = \"{digest}\" for {entry.name} by hand") from e
    return digest


def check_recordable(e: Entry) -> None:
    """What `vd record` checks of its flags before anything heavy is imported, checked of a declared golden's
    settings (the model SPEC and forwards on its device, the device, the thread count; the policy and the batch
    are the declaration's own checks): a suite one of whose declarations cannot work here is refused whole, not
    after the goldens before it were recorded, and a missing golden's next step says so rather than name a
    recording that would be refused."""
    why = recording_refusal(e)
    if why is not None:
        raise UsageError(why)


def recording_refusal(e: Entry) -> str | None:
    """Why `vd record` would refuse the declared golden ``e`` here (`check_recordable`), None where it would not:
    said by `vd status` and as a missing golden's next step (a suite replay's, `pytest --vd`'s)."""
    from vd.models import DEFAULT_MODEL, check_recording

    try:
        check_recording(e.model or DEFAULT_MODEL, [f for f in (e.forward, e.decode_forward) if f],
                        e.device or "cpu", e.threads)
    except VdError as err:  # (an unknown model is a ModelSpecError)
        return f"golden {e.name!r} cannot be recorded as declared: {err}"
    return None
