"""What every `vd` command shares (`vd.cli.app` and `vd.cli.team` register theirs on `app`): the group that
turns every error into one line and its exit code, the consoles, the parameter types and the checks made
before torch is imported or a model loaded, progress, and JSON output.

Exit codes are decided here alone: 0 PASS, 1 FAIL (a difference, a thin reference, a blind control), 2 bad
input or usage, printed as one line on stderr, 3 an internal error (one line naming the file its traceback
went to). Progress goes to stderr: a bar on a terminal, plain lines otherwise; results to stdout.

Arguments are checked before torch, zarr or a model is loaded (choices, K lists and devices by their
parameter types; then, first thing in each command, goldens by their root metadata, `vd.preflight`, widths,
model specs, forward names, threads, CUDA and tolerances), so a mistyped command answers at once; torch and the
layers below are imported inside the commands.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import inspect
import os
import re
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from typer.core import TyperCommand, TyperGroup

import vd
from vd import preflight
from vd.errors import (
    GoldenNotFoundError,
    ModelSpecError,
    Terminated,
    UsageError,
    VdError,
    system_refusal,
    write_traceback,
)
from vd.outputs import ReaderGone, json_text, stream, to_stdout, write_text
from vd.progress import Lines

EXIT_PASS, EXIT_FAIL, EXIT_BAD, EXIT_INTERNAL = 0, 1, 2, 3

# typer 0.2x vendors click; older releases use click itself. Find the base either way.
_ClickException = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
_UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def crash(e: BaseException) -> int:
    """An internal error: its traceback to a file, one line naming it."""
    where = write_traceback(e, "vd-crash-")
    typer.echo(f"vd: internal error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
               f"(traceback in {where})", err=True)
    return EXIT_INTERNAL


class _PlainFlags:
    """Boolean flags listed in the help as bare flags (typer would label each ``<bool>``), and arguments by
    their metavar alone (typer would add ``<str>`` or ``<list[str]>``)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_bool_flag", False) and p.metavar is None:
                p.metavar = ""
            if p.param_type_name == "argument":
                p.display_type_rich = lambda ctx: None
        return params


class Command(_PlainFlags, TyperCommand):
    """A vd command. Its docstring's paragraphs are joined into one line each, for the help to wrap at the
    terminal's width: typer's rich help keeps a docstring's line breaks (and wraps each line again)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.help:
            self.help = "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(self.help).split("\n\n"))

    def parse_args(self, ctx, args):
        """Refuse an option that takes one value given twice (click keeps the last without a word: ``--k 2 --k 3``
        ran K=3 alone); an option meant to repeat (``--forward``, ``--tolerance``) may."""
        single = {o: p for p in self.get_params(ctx) if p.param_type_name == "option" and not p.multiple
                  and not p.is_flag and not p.count for o in p.opts}
        seen: dict[str, list[str]] = {}
        i = 0
        while i < len(args) and args[i] != "--":
            name, eq, value = args[i].partition("=")
            if name in single:
                if not eq:  # the value is the next word (even one that looks like an option: --prompt --k)
                    i += 1
                    value = args[i] if i < len(args) else ""
                seen.setdefault(single[name].name, []).append(value)
            i += 1
        for name, values in seen.items():
            if len(values) > 1:
                flag = "--" + name.replace("_", "-")
                raise _UsageError(f"{flag} given {len(values)} times ({', '.join(values)}): it takes one value"
                                       + (f" (--k {','.join(values)} for several widths)" if flag == "--k" else ""))
        return super().parse_args(ctx, args)


class _Interrupted(Exception):
    """A command's KeyboardInterrupt (Ctrl-C), carried past typer, which would end the process with 130 and say
    nothing, to `Group.main`, which says so in one line with what the command noted (`interrupted`)."""


def interrupted(e: BaseException) -> str:
    """The one line a command cut short by Ctrl-C (``e`` a KeyboardInterrupt) or a signal (`vd.errors.Terminated`)
    prints: what ended it, then what the command noted on the way out (``e.add_note``: what it left and how to
    go on, such as a recording's journal and ``--resume``)."""
    what = "aborted (Ctrl-C)"
    if isinstance(e, Terminated):
        what = f"terminated (exit {e.code})"
        with contextlib.suppress(ValueError, TypeError):
            what = f"terminated by {signal.Signals(int(e.code) - 128).name}"  # type: ignore[arg-type]
    notes = getattr(e, "__notes__", None) or []
    return f"vd: {what}" + "".join(f"; {n}" for n in notes)


def kept_journal(out_path: str) -> Path | None:
    """The journal a recording into ``out_path`` cut short left (`vd record --resume` continues it), if any."""
    from vd.store import journal, locate

    kept = journal.of_location(locate(out_path))
    return kept if kept is not None and kept.is_file() else None


@contextlib.contextmanager
def resumable(out_path: str):
    """Around a recording into ``out_path``: cut short by Ctrl-C or a signal, where it kept a journal (it had
    written rows), the one line `interrupted` prints says so and how to go on."""
    try:
        yield
    except (KeyboardInterrupt, Terminated) as e:
        with contextlib.suppress(Exception):  # (a path that cannot be located journals nothing)
            if (kept := kept_journal(out_path)) is not None:
                e.add_note(f"{out_path} was not written; its journal {kept} keeps the rows computed: "
                           f"vd record {shlex.quote(out_path)} --resume continues it")
        raise


def note_journal(out_path: str) -> None:
    """Say so where a recording starts afresh beside the journal of one cut short (`vd record --resume`
    continues that one instead): the new recording replaces the journal, and with it the rows it kept."""
    if (kept := kept_journal(out_path)) is not None:
        err.print(f"vd: note: {kept} keeps the rows of a recording of {out_path} that was cut short; this one "
                  f"starts afresh and replaces it (vd record {shlex.quote(out_path)} --resume continues that one "
                  "instead)")


class Group(_PlainFlags, TyperGroup):
    """Turns every error into one stderr line and its exit code, for the CLI and CliRunner alike."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise _Interrupted() from e
        except BrokenPipeError as e:  # not stdout's or stderr's (`ReaderGone`): click would exit 1 without a word
            raise RuntimeError(f"a broken pipe: {e}") from e

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        streams = sys.stdout, sys.stderr
        # `vd ... | head`: exit as judged
        sys.stdout, sys.stderr = ReaderGone(sys.stdout, "standard output"), ReaderGone(sys.stderr, "standard error")
        try:
            self._main(args, prog_name, complete_var, **extra)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = streams
            out.file = None  # type: ignore[assignment]  # (`check_writable` may have moved it; rich's: sys.stdout)

    def _main(self, args, prog_name, complete_var, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.Exit as e:
            sys.exit(e.exit_code)
        except _Interrupted as e:
            typer.echo(interrupted(e.__cause__ or KeyboardInterrupt()), err=True)
            sys.exit(128 + signal.SIGINT)
        except Terminated as e:  # SIGTERM, SIGHUP: the recording's staging and lock are cleaned up by now
            typer.echo(interrupted(e), err=True)
            raise
        except _ClickException as e:
            ctx = getattr(e, "ctx", None)
            if type(e).__name__ != "NoArgsIsHelpError":  # typer has printed the help already
                hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
                message = e.format_message().replace(": Value error, ", ": ")  # (pydantic's, under typer 0.2x)
                typer.echo(f"vd: error: {message}{hint}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("vd: aborted", err=True)
            sys.exit(130)
        except VdError as e:
            typer.echo(f"vd: error: {e}", err=True)
            sys.exit(EXIT_BAD)
        except OSError as e:  # a path the user gave that the system refused (permissions, space, ...)
            typer.echo(f"vd: error: {system_refusal(e)}", err=True)
            sys.exit(EXIT_BAD)
        except Exception as e:  # a bug of vd's or a crashing engine: never a bare traceback
            sys.exit(crash(e))
        sys.exit(rv if isinstance(rv, int) else EXIT_PASS)


app = typer.Typer(
    cls=Group,
    help="Record-and-replay golden files for the logits of an LLM's speculative-decoding verify path.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Markup and emoji codes off (model names hold brackets, a plug-in spec ":factory:"); wide when piped so lines and
# tables stay whole in logs.
out = Console(highlight=False, markup=False, emoji=False, soft_wrap=True,
              width=None if sys.stdout.isatty() else 160)
err = Console(stderr=True, highlight=False, markup=False, emoji=False, soft_wrap=True)
GOLDEN_HELP = "a .zarr directory, a .zip file or s3://bucket/prefix"
GOLDEN_OR_NAME = f"{GOLDEN_HELP}, or a declared golden's name"
CONFIG_HELP = "The file declaring the suite (default: vd.toml, or a pyproject.toml with a tool.vd table, here " \
              "or above)."
DEVICE_METAVAR = "cpu|cuda|cuda:N"
TOLERANCE_METAVAR = "[KIND=]SPEC"


def foreign_vd() -> str | None:
    """Why vd cannot run here, where another distribution owning the import name ``vd`` is installed (PyPI's
    ``vd``, a vector-database facade, also installs a ``vd`` package and a ``vd`` command): the two overwrite
    each other's files. vd's own distribution is ``vd-goldens``; None where no other claims the name."""
    import importlib.metadata as md

    try:
        other = md.distribution("vd")
    except md.PackageNotFoundError:
        return None
    return (f"the distribution 'vd' {other.version} ({other.metadata['Summary'] or 'another project'}) is "
            "installed in this environment and owns the same import name and command as vd-goldens, so their "
            "files overwrite each other; uninstall both (pip uninstall vd vd-goldens) and install vd-goldens "
            "alone, or use another environment")


def examples(*lines: str) -> str:
    """A command's help epilog: example command lines, one a line."""
    return "Examples:\n" + "\n".join(f"  {line}" for line in lines)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"vd {vd.__version__}")
        raise typer.Exit(EXIT_PASS)


@app.callback(epilog=examples("vd record goldens/smollm2.zarr --refresh",
                               "vd replay goldens/smollm2.zarr --report report.json"))
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print vd's version and exit.")] = False) -> None:
    pass  # the group's own options; the commands do the work


class Feed(enum.StrEnum):
    """Where a recording's drafts come from (`vd.recorder.record.FEEDS`; a test holds the two equal)."""

    reference = "reference"
    mtp = "mtp"


class Dtype(enum.StrEnum):
    """The dtypes a model computes in (`vd.dtypes.DTYPES`; a test holds the two equal)."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


class Widths(tuple):
    """Verify widths K from ``--k 2,3,4``."""


def parse_widths(text: str) -> Widths:
    """``--k``'s widths: comma-separated integers, each once (``2,,3`` or ``2,2`` is a typo, not a request)."""
    try:
        widths = [int(x) for x in text.split(",")]
    except ValueError:
        raise typer.BadParameter(f"takes comma-separated integers like 2,3,4; got {text!r}") from None
    if len(set(widths)) != len(widths):
        raise typer.BadParameter(f"names a verify width twice: {text!r}")
    return Widths(widths)


def parse_head(text: str) -> str:
    """``--head FILE``: a file that exists, refused before anything is imported (not after the model loads)."""
    if not Path(text).is_file():
        raise typer.BadParameter(f"MTP head {text} does not exist" if not Path(text).exists()
                                 else f"MTP head {text} is not a file")
    return text


def parse_device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise typer.BadParameter(f"unknown device {text!r} (use cpu, cuda or cuda:N)")
    return text


def default_bundle(report: Path | None) -> Path | None:
    """Where a replay's first-divergence bundle goes unless --bundle says: beside its report (none where the
    report goes to a stream: ``-``, /dev/stdout, /dev/null)."""
    return None if report is None or stream(report) else report.with_name(report.name + ".bundle")


def check_writable(flag: str, path: Path | str | None, inputs: Sequence[str | Path | None] = (), *,
                   directory: bool = False) -> None:
    """Refuse, before any work, an output that could not be written or that would land in (or on) a golden:
    one the command reads (``inputs``) or any other (`check_no_golden`). ``directory``: an output directory
    (a bundle), written into: one that exists already is used (CI often makes its artifacts' folder first).
    A stream (``-``, /dev/stdout, /dev/null, a named pipe: `vd.outputs.stream`) is written through, nothing
    made beside it; one that is standard output (``--report -``) moves the command's own lines (`out`) to
    stderr, so that ``vd replay GOLDEN --report - | jq .verdict`` reads that file alone. Every output a command
    takes passes here before the command prints."""
    if not directory and to_stdout(path):
        out.file = sys.stderr  # (put back when the command ends: `Group.main`)
    if path is None or (not directory and stream(path)):
        return
    path = Path(path)
    check_outside(flag, path, inputs)
    check_no_golden(flag, path, directory=directory)
    if directory and path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} is a file; give a directory")
    if not directory and path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file path")
    parent = path.absolute() if path.is_dir() else path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK) or not _can_create_in(parent):
        raise UsageError(f"cannot write {flag} {path}: {parent} is not a writable directory")


def check_distinct(outputs: Mapping[str, Path | str | None]) -> None:
    """Refuse two of a command's outputs (by flag) that name one file, where the second written would replace the
    first, or that both go to standard output, where one would run into the other (``--report - --junit -``)."""
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None or (stream(path) and not to_stdout(path)):  # (/dev/null takes any number)
            continue
        key = "-" if to_stdout(path) else os.path.realpath(path)
        if key in seen:
            where = "standard output" if key == "-" else str(path)
            raise UsageError(f"{seen[key]} and {flag} both write {where}: give each its own path")
        seen[key] = flag


def _can_create_in(folder: Path) -> bool:
    """Whether a file can be made in ``folder`` (tried and removed: permission bits do not say it for root, nor for
    /proc, a read-only mount or a full quota)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=".vd-probe-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True


def check_no_golden(flag: str, path: str | Path | None, *, directory: bool = True, replace: bool = False) -> None:
    """Refuse an output path that is a golden or lies inside one (`vd.preflight.golden_over`): every output of
    every command. ``replace``: the path itself may be a golden (``--refresh`` replaces it on purpose)."""
    if path is None:
        return
    hit = preflight.golden_over(path, follow=directory)
    if hit is None or (hit[1] and replace):
        return
    golden, itself = hit
    if itself:
        raise UsageError(f"{flag} {path} is the golden {golden}; refusing to replace it (write it elsewhere)")
    raise UsageError(f"{flag} {path} is inside the golden {golden}; write it elsewhere")


def check_outside(flag: str, path: str | Path | None, inputs: Sequence[str | Path | None]) -> None:
    """Refuse an output path in (or on) a golden the command reads."""
    if path is None or "://" in str(path):
        return
    out = Path(os.path.realpath(path))
    for where in inputs:
        if where is not None and "://" not in str(where):
            golden = Path(os.path.realpath(where))
            if out == golden:
                raise UsageError(f"{flag} {path} is the golden {where} the command reads; write it elsewhere")
            if golden in out.parents:
                raise UsageError(f"{flag} {path} is inside the golden {where}; write it elsewhere")


def check_golden(where: str) -> Mapping[str, Any] | None:
    """A local golden that is not there or is no golden, refused before anything heavy is imported (the store
    says the same when it opens one; an s3:// prefix is asked when opened); its metadata where it is local."""
    return preflight.check_readable(where)


def golden_path(target: str, config: str | os.PathLike | None = None) -> str:
    """The golden a GOLDEN argument names: where ``target`` is a declared golden's NAME (in ``config``, else in
    the declaration found from here, `vd.workflow.declare.declared`), that golden's path; else ``target`` as
    given, a path. A name wins over a path of the same spelling, as in every command that takes one."""
    from vd.workflow.declare import DeclarationError, declared, load_suite

    entry = declared(target, config)
    if entry is not None and entry.name == target:
        if "://" not in entry.path and not os.path.lexists(entry.path):
            raise GoldenNotFoundError(f"{entry.path} does not exist: {target}, which {entry.file} declares, is not "
                                      f"recorded yet (vd record --suite {target})")
        return entry.path
    if entry is None and target and "://" not in target and not os.path.lexists(target):
        try:  # a mistyped name: "does not exist" alone hid the names a declaration here holds
            suite = load_suite(config)
        except DeclarationError:
            suite = None
        if suite is not None and suite.entries:
            raise UsageError(f"{target} does not exist, and {suite.file} declares no golden of that name (it "
                             f"declares {', '.join(suite.entries)})")
    return target


def check_replay(golden: str, meta: Mapping[str, Any] | None, ks, model: str | None, forwards: list[str],
                 device: str | None, threads: int | None) -> None:
    """What a replay of one golden asks of it and of this machine, checked from its metadata alone: the verify
    widths it holds, forward names its model has, CUDA where it runs on CUDA, a thread count this machine has."""
    preflight.check_threads(threads)
    if meta is None:  # an s3:// golden: checked once it is opened
        return
    if ks:
        preflight.check_widths(golden, ks, meta.get("k") or [])
    if model is not None:
        check_model(model, forwards)
    elif isinstance(spec := (meta.get("model") or {}).get("spec"), str):
        try:
            check_model(spec, forwards)
        except ModelSpecError:  # a file the golden names relative to itself: resolved once it is opened
            pass
    dev = device or meta.get("device") or "cpu"
    if dev.startswith("cuda") and preflight.cuda_here() is False:
        from vd.models.device import cpu_forward_hint

        raise preflight.no_cuda(golden, device, str(meta.get("device")),
                                cpu_forward_hint(str(meta.get("forward")), forwards))


def check_model(spec: str, forwards: list[str], device: str | None = None) -> None:
    """A SPEC that names nothing, or a forward no built-in model has (or, given the ``device``, has on CUDA
    alone), refused without importing torch."""
    from vd.models import check_forward_names

    check_forward_names(spec, forwards, device)


def check_tolerances(items: list[str] | None) -> None:
    """``--tolerance`` items that do not parse, refused before a model is loaded; and one kind named twice
    (``verify=kl:0.1`` and ``verify=argmax``), of which the last alone would count. A SPEC without a kind is for
    every kind, and an item naming one after it still sets that kind's (``ulp:2`` then ``verify=exact``)."""
    if items:
        from vd.policy import Policy

        Policy.parse(items)
        named: dict[str, list[str]] = {}
        for item in items:
            kind, sep, spec = item.partition("=")
            if sep:
                named.setdefault(kind.strip(), []).append(spec.strip())
        for kind, specs in named.items():
            if len(specs) > 1:
                raise UsageError(f"--tolerance {kind}= given {len(specs)} times ({', '.join(specs)}): a kind takes "
                                 "one SPEC (the last would count alone)")


# Variables a bundle's command.sh never sets: the shell's own, and anything that looks like a secret.
_NOT_EXPORTED = re.compile(r"(HOME|PATH|USER|LOGNAME|SHELL|PWD|OLDPWD|TERM|LANG|LC_\w+|TMPDIR|TZ|DISPLAY|COLUMNS|LINES|"
                           r"HOSTNAME|SHLVL|_)$|KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.IGNORECASE)


# A value holding a URL's credentials (``scheme://user:password@host``) is never exported, whatever its name.
_CREDENTIALS = re.compile(r"://[^/@\s:]+:[^/@\s]+@")


def _tracing() -> bool:
    """Whether torch.compile (Dynamo) is tracing the code running now. A lookup it traces runs only then, so noting
    it would put vd's bookkeeping into the traced code: on torch 2.11 a graph break where transformers' attention
    asks for TRANSFORMERS_SDPA_FORCE_GQA (so other kernels and other numbers than the recording's, which ran
    unwatched), on 2.13 guards on the bookkeeping and a recompile after every copy of the environment. torch is
    not imported for this: where no one has imported it (or it is still importing), nothing is compiling."""
    compiling = getattr(getattr(sys.modules.get("torch"), "compiler", None), "is_compiling", None)
    return compiling is not None and compiling()


class _Reading(os._Environ):  # type: ignore[name-defined]  # os._Environ is os.environ's class
    """``os.environ`` while `reading_environment` watches it: every name looked up is noted, but for the lookups
    of a copy (``dict(os.environ)``, ``{**os.environ}``, ``.items()``, a subprocess's environment made from it):
    those read each name in the order the iteration before them gave, and are not a reader asking for it (a bundle
    re-exported every variable of the shell, a database URL's password included, before they were told apart)."""

    read: set[str] = set()
    copying: collections.deque[str] = collections.deque()  # names an iteration gave, in order, not looked up yet

    def __iter__(self):
        if _tracing():  # (see __getitem__)
            return super().__iter__()
        names = list(super().__iter__())
        _Reading.copying = collections.deque(names)
        return iter(names)

    def __getitem__(self, key):
        if _tracing():  # a lookup inside code torch.compile traces: as os.environ's own, or the watch changes its graph
            return os._Environ.__getitem__(self, key)  # type: ignore[attr-defined]
        if isinstance(key, str):  # (os.get_exec_path tries a bytes key too)
            if _Reading.copying and _Reading.copying[0] == key:
                _Reading.copying.popleft()  # the next name of a copy
            else:
                _Reading.read.add(key)
        return super().__getitem__(key)


@contextlib.contextmanager
def reading_environment():
    """Note the environment variables Python code looks up meanwhile (a plug-in's switch, torch's settings);
    yields the mapping of those that were set when it began, with the values they had then (a variable the
    process set itself, vd's kernel-cache caps or torch's TORCHINDUCTOR_CACHE_DIR, is set again by a command
    run again: pinning it would pin this machine's paths), secrets and the shell's own left out, filled when it
    ends."""
    found: dict[str, str] = {}
    given = dict(os.environ)
    before, _Reading.read, _Reading.copying = os.environ.__class__, set(), collections.deque()
    os.environ.__class__ = _Reading
    try:
        yield found
    finally:
        os.environ.__class__ = before
        found.update({name: given[name] for name in sorted(_Reading.read) if name in given
                      and not _NOT_EXPORTED.search(name) and not _CREDENTIALS.search(given[name])})


@contextlib.contextmanager
def reporting():
    """A bar on a terminal; plain lines (`vd.progress.Lines`) on a pipe or a CI log (asked of the stream
    itself: rich counts FORCE_COLOR, which CI services set, as a terminal)."""
    if sys.stderr.isatty():
        with TerminalBar() as bar:
            yield bar
    else:
        lines = Lines(sys.stderr)
        yield lines
        lines.end()  # not on an error: its one line says what happened


class TerminalBar:
    """A progress bar on stderr (a terminal), one task per phase."""

    def __init__(self, console: Console = err):
        self.console = console
        self.progress: Progress | None = None
        self.task: TaskID | None = None

    def phase(self, name: str, total: int) -> None:
        """A new phase: the last one finished (its timer stopped, a phase of unknown length included)."""
        if self.progress is None:  # (the first phase, or the first after `end`: bars of their own)
            self.progress = Progress(
                TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                console=self.console, transient=True,
            )
            self.progress.start()
        elif self.task is not None:
            done = self.progress.tasks[self.task].total or 1
            self.progress.update(self.task, total=done, completed=done)
            self.progress.stop_task(self.task)
        self.task = self.progress.add_task(name, total=total or None)

    def step(self, _s: int) -> None:
        if self.progress is not None and self.task is not None:
            self.progress.advance(self.task)

    def end(self, failed: bool = False) -> None:
        """The phases so far are over (as `vd.progress.Lines.end`; ``failed`` changes nothing here, as the line
        the command prints next says what failed): the bars taken off the terminal, so that what the command
        prints next (a suite's line for each golden) stands on lines of its own rather than inside the bars'
        redrawing; the next phase starts bars anew."""
        if self.progress is not None:
            self.progress.stop()
        self.progress, self.task = None, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.end()


def write_json(path: Path, data: dict) -> None:
    """``data`` as JSON at ``path`` (`vd.outputs.json_text`), a link there replaced, never followed."""
    write_text(path, json_text(data))
