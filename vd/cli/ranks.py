"""The command line split over ranks (`vd.models.tp`): ``--tp N`` launches the command under torchrun, and a
command torchrun started runs on rank 0 while every other rank serves its model calls.

Under torchrun (``WORLD_SIZE`` > 1) rank 0 runs the command as the command line always does; every other rank runs
`vd.models.tp.follow` and prints nothing unless it fails (one line, its traceback in a file). Rank 0 ends the others
when its command is done (exit 0, 1 or 2); an internal error (3) or a signal ends it without them, and torchrun ends
the rest. ``--tp N`` runs ``python -m torch.distributed.run --standalone --nproc-per-node N -m vd ...`` with the
same arguments and passes on the ranks' own lines (torchrun's logging and failure reports left out, its log folders
made in a temporary folder removed after it); rank 0 hands its exit code back through a file (``VD_TP_STATUS``) and
exits 0 after a verdict or a refusal, so torchrun sees no failed rank for an ordinary FAIL; ``vd`` exits with rank
0's code, or 3 with one line when the ranks ended without one (a rank failed and torchrun ended the rest).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import typer

from vd.cli.common import EXIT_INTERNAL, crash
from vd.errors import UsageError, write_traceback

STATUS = "VD_TP_STATUS"


def ranks() -> int:
    """How many ranks torchrun started this process among (1: it runs alone)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def launch(tp: int | None, environ: dict[str, str] | None = None) -> int | None:
    """``--tp``: None where the command runs in this process (no ``--tp``, ``--tp 1``, or torchrun started it
    with as many ranks), else rank 0's exit code after torchrun ran the command over ``tp`` ranks (``environ``:
    variables the ranks get besides this process's)."""
    if tp is None or (tp == 1 and ranks() == 1):
        return None
    if ranks() > 1:
        if tp != ranks():
            raise UsageError(f"--tp {tp}, but torchrun started {ranks()} ranks")
        return None
    argv = _without_tp(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="vd-tp-") as d:
        status = Path(d) / "status"
        env = {**os.environ, **(environ or {}), STATUS: str(status)}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp)))
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
               f"--log-dir={Path(d) / 'torchrun'}", "-m", "vd", *argv]  # its log folders go with this one
        with subprocess.Popen(run, env=env, stderr=subprocess.PIPE, text=True, bufsize=1) as proc:
            assert proc.stderr is not None  # stderr=PIPE
            for line in proc.stderr:  # the ranks' own lines; torchrun's logging and failure reports left out
                if line.startswith("vd:"):
                    sys.stderr.write(line)
                    sys.stderr.flush()
        rc = proc.returncode
        if status.is_file():
            return int(status.read_text())
    typer.echo(f"vd: error: the {tp} tensor-parallel ranks ended without an outcome (torchrun exited {rc}; "
               "each rank's error is above)", err=True)
    return EXIT_INTERNAL


def tensor_parallel(command):
    """A command taking ``--tp``: launched under torchrun first where it asks for it (`launch`), or, without
    ``--tp``, where the golden it replays or refreshes (or a suite's) was recorded over ranks (`recorded`), as a
    replay takes the golden's forward and device unless told otherwise; its ranks sum as the golden's did where
    ``VD_TP_COLLECTIVES`` does not say (gloo on CUDA: ranks sharing one GPU, which NCCL refuses)."""

    @functools.wraps(command)
    def run(*args, **kwargs):
        tp, environ = kwargs.get("tp"), {}
        if ranks() == 1 and (tp is None or tp > 1):
            degree, collectives = recorded(kwargs)
            if tp is None and degree > 1:
                tp = degree
                whose = "the suite's goldens were" if kwargs.get("suite") else "the golden was"
                typer.echo(f"vd: --tp {tp}, as {whose} recorded (--tp 1: in one process, another build)", err=True)
            if tp is not None and tp > 1 and collectives == "gloo" and "VD_TP_COLLECTIVES" not in os.environ:
                environ["VD_TP_COLLECTIVES"] = "gloo"  # (the ranks' alone, not this process's; none on the CPU)
        code = launch(tp, environ)
        return command(*args, **kwargs) if code is None else code

    return run


def recorded(params: dict) -> tuple[int, str | None]:
    """The degree over which the golden a replay, a recording's ``--refresh`` or `vd refresh` names was recorded,
    and its collectives (its environment's ``tp`` and ``collectives``), or, with ``--suite``, the degree its goldens
    (those named, of the shard) share, and in which ``vd record --suite`` records those missing: (1, None) for a
    new recording, a suite none of whose goldens is there yet (or none missing, recording without ``--refresh``)
    or a path holding no readable golden (the command says why). A suite whose goldens were recorded over
    different degrees is refused (`UsageError`): it runs over one. An s3:// golden's root document is read as
    it is now, one GET before the command opens it."""
    from vd.cli.common import golden_path
    from vd.errors import VdError
    from vd.preflight import tensor_parallel

    targets = params.get("targets") or ([params["target"]] if params.get("target") else [])  # (vd refresh's)
    if params.get("from_") is not None and params.get("tp") is not None:
        raise UsageError("--tp splits the model a refresh records; a promotion (--from) records nothing")
    suite, new = params.get("suite"), params.get("refresh") is False  # (new: vd record without --refresh)
    one = len(targets) == 1 and not suite
    if (new and not suite) or params.get("resume") or params.get("from_") is not None or not (one or suite):
        return 1, None
    try:
        paths = _suite_paths(params) if suite else {"": golden_path(targets[0], params.get("config"))}
    except VdError:
        return 1, None  # (the command says why)
    found: dict[str, tuple[int, str | None]] = {}
    missing = False
    for name, path in paths.items():
        try:
            meta = _root_meta(path)
        except (VdError, OSError):
            continue
        if meta is not None:  # (a golden not recorded yet takes the others' degree)
            found[name] = tensor_parallel(meta)
        missing = missing or meta is None
    if new and not missing:
        return 1, None  # (vd record --suite records only missing goldens: here none)
    degrees = {tp for tp, _ in found.values()}
    if len(degrees) > 1:
        by = "; ".join(f"{', '.join(n for n in found if found[n][0] == d)}: {d}" for d in sorted(degrees))
        raise UsageError(f"the suite's goldens were recorded over different numbers of tensor-parallel ranks ({by}) "
                         "and a suite runs over one: give --tp N, or name the goldens of one degree")
    collectives = {c for _, c in found.values()}
    return (degrees.pop() if degrees else 1, collectives.pop() if len(collectives) == 1 else None)


def _root_meta(path: str):
    """`vd.store.root_meta`, importing vd.store (1.3 s) for an s3:// golden alone."""
    from vd.preflight import peek

    if "://" not in path:
        return peek(path).meta
    from vd.store import root_meta

    return root_meta(path)


def _suite_paths(params: dict) -> dict[str, str]:
    """The paths of the goldens a suite command runs over, by name (a replay's ``--shard`` taken)."""
    from vd.workflow.declare import load_suite, shard

    entries = load_suite(params.get("config")).select(params.get("targets") or [])
    return {e.name: e.path for e in shard(entries, params.get("shard"))}


def _without_tp(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--tp":
            skip = True
        elif not a.startswith("--tp="):
            out.append(a)
    return out


def ranked(app) -> None:
    """Run the command line as one of the ranks torchrun started (see the module's docstring); exits."""
    from vd.models import tp

    w = tp.world()
    assert w is not None, "started by torchrun (WORLD_SIZE > 1)"
    if w.rank != 0:
        try:
            tp.follow()
        except SystemExit:  # torchrun ending this rank (SIGTERM) after another one failed
            raise
        except BaseException as e:  # noqa: BLE001 (one line for anything, as the command line's own errors)
            first = str(e).splitlines()[0] if str(e) else ""
            typer.echo(f"vd: error: rank {w.rank}: {type(e).__name__}: {first} (traceback in "
                       f"{write_traceback(e, 'vd-rank-')})", err=True)
            sys.stderr.flush()
            os._exit(EXIT_INTERNAL)  # at once: rank 0 and torchrun see the rank gone
        tp.finish()
        tp.leave(0)
    code = EXIT_INTERNAL
    left = False  # the groups left together: the process then ends without the interpreter's finalization
    try:
        app()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_INTERNAL)
    if code in (0, 1, 2):
        try:
            tp.stop()
            tp.finish()
            left = True
        except Exception as e:  # another rank is gone: rank 0's outcome cannot be trusted to have been shared
            code = crash(e)
    status = os.environ.get(STATUS)
    if status and code in (0, 1, 2, EXIT_INTERNAL):  # not when torchrun ended it (another rank failed)
        Path(status).write_text(str(code))
        code = 0 if code in (0, 1, 2) else code
    if left:
        tp.leave(code)
    sys.exit(code)
