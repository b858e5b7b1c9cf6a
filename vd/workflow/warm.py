"""The server behind `vd warm` (`vd.warm` says what it is for and what it decided): import what a `vd`
command imports, listen on the installation's socket, and fork a child per command that passes the checks.

    python -m vd.workflow.warm --idle 3600      (what `vd warm` starts, in its own session)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import gc
import importlib
import os
import resource
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, NoReturn

from vd import warm

# What a `vd record` or `vd replay` imports before its first step (the CLI itself is imported in each child:
# its consoles look at the command's terminal); Inductor after them (`INDUCTOR_MODULES`).
WARM_MODULES = ("torch", "numpy", "zarr", "msgpack", "typer", "rich.console", "rich.table",
                "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                "vd.env", "vd.models.hf", "vd.models.checkpoints", "vd.models.generated", "vd.store",
                "vd.recorder", "vd.replayer", "vd.replayer.render", "vd.workflow.suite")

# What a compiled forward imports before it compiles (or loads its artifacts): 1.0 s on the 2-core CPU host, 2.8-3.6 s
# on an H200 host (tools/h200/inductor_imports*.json). Importing it asks one question of CUDA, at module level
# (torch._inductor.runtime.benchmarking: `torch.cuda.is_available()`), and torch answers it through NVML, whose start
# leaves a `cuda...` thread behind, after which no fork is safe: the server has a child forked for that question
# ask it, and hands the import the child's answer (`import_inductor`).
INDUCTOR_MODULES = ("torch._inductor.compile_fx", "torch._dynamo.backends.inductor")


class Server:
    """One installation's warm server: its socket, what it started with, and what it has served."""

    def __init__(self, listener: socket.socket, lock: IO, start_env: dict[str, str], imports_s: float,
                 idle_s: float, inductor: str = "imported"):
        self.listener, self.lock, self.start_env = listener, lock, start_env
        self.imports_s, self.idle_s, self.inductor = imports_s, idle_s, inductor
        self.code = warm.code_state()
        self.started = self.last = time.monotonic()
        self.served = 0
        self.stopping = False

    def serve(self) -> None:
        self.listener.settimeout(min(self.idle_s, 60.0))
        while not self.stopping and time.monotonic() - self.last < self.idle_s:
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(10.0)
                self.handle(conn)

    def handle(self, conn: socket.socket) -> None:
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        try:
            request, fds = warm.receive(conn)
        except (OSError, ValueError) as e:
            print(f"bad request: {e}", flush=True)
            return
        try:
            if uid != os.getuid():
                warm.reply(conn, {"refused": "the warm server serves the user who started it"})
            elif request.get("op") == "run":
                self.run(conn, request, fds)
            elif request.get("op") in ("status", "stop"):
                self.stopping = request["op"] == "stop"
                warm.reply(conn, self.status())
        finally:
            for fd in fds:
                os.close(fd)

    def status(self) -> dict:
        now = time.monotonic()
        return {"pid": os.getpid(), "age_s": now - self.started, "idle_s": now - self.last, "served": self.served,
                "imports_s": self.imports_s, "inductor": self.inductor, "idle_limit_s": self.idle_s,
                "python": sys.executable,
                "stopping": self.stopping, "frozen_objects": gc.get_freeze_count()}

    def refusal(self, request: dict) -> str | None:
        changed = warm.differences(self.start_env, warm.start_env(request["env"]))
        if changed:
            names = f"{', '.join(changed[:4])}{' and more' if len(changed) > 4 else ''}"
            return (f"{names} {'differs' if len(changed) == 1 else 'differ'} from the server's environment "
                    "(`vd warm --stop`, then `vd warm` in this one)")
        beyond = warm.unreachable_limits(warm.limits(), request.get("limits", {}))
        if beyond:
            return f"the command's {', '.join(beyond)} exceed the server's hard limits (`vd warm` under them)"
        if warm.code_state() != self.code:
            self.stopping = True
            return "vd's, torch's or transformers' files changed since it started; it stops (`vd warm` again)"
        if not forkable():
            self.stopping = True
            return "the server is no longer a clean process to fork; it stops"
        return None

    def run(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        self.last = time.monotonic()
        why = self.refusal(request)
        if why is None and len(fds) != 3:
            why = "the command's stdin, stdout and stderr did not arrive"
        if why is not None:
            warm.reply(conn, {"refused": why})
            return
        try:
            pid = os.fork()
        except OSError as e:  # out of processes or memory: the command runs on its own
            warm.reply(conn, {"refused": f"it could not fork ({e.strerror})"})
            return
        if pid == 0:
            _child((self.listener, self.lock), conn, request, fds)
        self.served += 1


def import_inductor() -> str:
    """Import `INDUCTOR_MODULES` with `torch.cuda.is_available` answered by a child forked to ask it (what the
    command's own process would answer; nothing of CUDA or NVML starts here): "imported", else why not (the
    server then serves without them, and a compiled forward imports them in the command's child)."""
    import torch

    answer = ask_apart(torch.cuda.is_available)
    if answer is None:
        return "not imported: the child asking torch.cuda.is_available() gave no answer"
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: answer  # type: ignore[assignment]  # put back below
    try:
        for name in INDUCTOR_MODULES:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001  a server without Inductor still serves: say why, go on
        return f"not imported: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        torch.cuda.is_available = real  # type: ignore[assignment]
    return "imported"


def ask_apart(question: Callable[[], bool]) -> bool | None:
    """``question()`` asked in a child forked for it (whatever it starts ends with the child); None where the
    child gave no answer."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's exit is its only report
        code = 1
        try:
            os.write(write, b"1" if question() else b"0")
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as f:
            said = f.read(1)
    finally:
        os.waitpid(pid, 0)
    return {b"1": True, b"0": False}.get(said)


def forkable() -> bool:
    """No thread of Python's but this one, and no CUDA: a child forked now is a fresh process."""
    return threading.active_count() == 1 and not cuda_started()


def cuda_started() -> bool:
    """CUDA initialised by torch, or the CUDA driver started by anything (its threads are named ``cuda...``):
    a forked child could not use it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read())
    return any(name.startswith("cuda") for name in names)


def _child(server: tuple[socket.socket, IO], conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Become the command (never returns): its stdio, folder, umask, limits, environment, arguments and start
    time, then `vd.cli.main`; its exit code goes back over ``conn``."""
    code = 3
    try:
        for held in server:  # the socket, and the lock a later server must be able to take
            held.close()
        conn.settimeout(None)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        fds.clear()
        os.chdir(request["cwd"])
        os.umask(request.get("umask", 0o022))
        for name, (soft, hard) in request.get("limits", {}).items():
            resource.setrlimit(getattr(resource, name), (soft, hard))  # checked reachable before the fork
        os.environ.clear()
        os.environ.update(request["env"])
        time.tzset()
        sys.argv, sys.path[:] = list(request["argv"]), list(request["path"])
        sys.modules["__main__"] = _main_module(*request.get("main", (None, None)))
        _stdio()
        warm.adopt(request.get("origin"))
        warm.reply(conn, {"pid": os.getpid()})
        code = _run()
    except BaseException:  # noqa: BLE001  the child must report and end whatever happened
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
            warm.reply(conn, {"exit": code})
        os._exit(code)


def _main_module(package: str | None, file: str | None) -> types.ModuleType:
    """A ``__main__`` as the command's (the server's is `vd.workflow.warm`): click names the program from it."""
    main = types.ModuleType("__main__")
    main.__package__ = package
    if file is not None:
        main.__file__ = file
    return main


def _stdio() -> None:
    """Text streams over the command's descriptors, buffered as Python buffers its own at start-up."""
    encoding, errors = sys.stdout.encoding, sys.stdout.errors
    sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding=encoding, errors=errors, closefd=False,  # noqa: SIM115
                      buffering=1 if os.isatty(1) else -1)
    sys.stderr = open(2, "w", encoding=sys.stderr.encoding, errors="backslashreplace",  # noqa: SIM115
                      closefd=False, buffering=1)


def _run() -> int:
    """`vd.cli.main` as the interpreter would run it: its exit code, then its threads joined and its exit
    handlers run, as at a process's end."""
    try:
        from vd.cli import main

        main()
        code = 0
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001  an uncaught error ends a process with a traceback and 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does first at exit
        atexit._run_exitfuncs()
    return code


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _locked(path: Path) -> IO:
    """The installation's lock file, held: one server at a time (a stopping one is waited for, 10 s)."""
    lock = open(path, "w")  # noqa: SIM115  held until the process ends
    for _ in range(100):
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            time.sleep(0.1)
    sys.exit("vd warm: another server for this installation is starting or running")


def restart_without_inductor(idle: float, environ: dict[str, str]) -> NoReturn:
    """Become a server that does not import Inductor (this process, its pid and the environment it started
    with): importing it here left a thread or CUDA started (another torch than the one `import_inductor` was
    measured on, say), after which no fork is safe. The lock is let go with this image's files."""
    sys.stdout.flush()
    why = "importing it left a thread or CUDA started in the server, which started again without it"
    os.execve(sys.executable, [sys.executable, "-m", "vd.workflow.warm", "--idle", str(idle),
                               "--without-inductor", why], environ)


def main() -> None:
    ap = argparse.ArgumentParser(description="vd's warm server (started by `vd warm`)")
    ap.add_argument("--idle", type=float, default=warm.IDLE_S)
    ap.add_argument("--without-inductor", metavar="WHY", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    path = warm.socket_path()
    lock = _locked(path.with_suffix(".lock"))  # held for the server's life
    environ = dict(os.environ)
    start_env = warm.start_env(environ)  # before this process adds its own
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch's CUDA checks without initialising CUDA
    t = time.perf_counter()
    for name in WARM_MODULES:
        with contextlib.suppress(ImportError):  # a model family this transformers lacks
            importlib.import_module(name)
    inductor = import_inductor() if a.without_inductor is None else f"not imported: {a.without_inductor}"
    imports_s = time.perf_counter() - t
    if not forkable() and a.without_inductor is None:
        restart_without_inductor(a.idle, environ)
    # What the imports made lives as long as the server, and each child shares it: out of the collector's
    # reach (Python's advice for a process that forks without exec), a child's collections walk only its own
    # objects instead of the 400 thousand or so imported, and touch none of the pages they share.
    gc.collect()
    gc.freeze()
    if not forkable():
        sys.exit("vd warm: importing left threads or CUDA started; a server could not fork cleanly")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # `vd warm` found no server answering there
    listener.bind(str(path))
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    # Python warns at every fork of a process with threads: here only native BLAS pools (torch's, 15 on an
    # H200 host), which re-create themselves in a child; Python's own threads and CUDA are checked above.
    warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    print(f"vd warm: pid {os.getpid()} serving {path} (imports {imports_s:.2f} s)", flush=True)
    try:
        Server(listener, lock, start_env, imports_s, a.idle, inductor).serve()
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # no later server has bound it: the lock is held until this process ends
        print("vd warm: stopped", flush=True)


if __name__ == "__main__":
    main()
