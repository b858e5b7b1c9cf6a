"""`vd warm`: a server that has done what every `vd` process does before its work (imported torch,
transformers' model code, vd's recorder, replayer and store) and forks a child per later `vd` command, so a
command's first step comes seconds after it starts instead of after the imports (issue 34's start-up target;
on the CPU hosts the imports alone were 3.8-6.3 s).

This module imports nothing heavy: `vd.launch` (the ``vd`` entry point) asks it whether a server takes the
command before anything else is imported.

Decisions, where the issue was silent:

- **Opt-in.** Nothing starts a server but ``vd warm``; without one every command runs in its own process, as
  before. A server stops after ``--idle`` seconds without a command (default an hour), on ``vd warm --stop``,
  or when vd's code under it changed.
- **Same installation, same start-up environment.** A server is keyed by the Python executable and the vd
  package it runs (one socket each, in a 0700 folder of the user's: ``$VD_WARM_DIR``, else
  ``$XDG_RUNTIME_DIR/vd``, else ``/tmp/vd-warm-<uid>``); it serves only the user who started it. A command is
  refused (and runs in its own process, saying why in one line) when a variable read while importing or
  starting (`IMPORT_TIME`: thread counts, ISA limits, torch, CUDA, Python, locale, temporary folder) differs
  from the server's, or when a source file of vd, or torch's or transformers' installation, changed since the
  server started (the server then stops). Every other variable, the working folder, the arguments and
  ``sys.path`` are the command's own.
- **The child is the command.** It gets the command's stdin, stdout and stderr (passed over the socket), runs
  `vd.cli.main` as the process would, and its exit code is the command's; the command's process forwards
  SIGINT, SIGTERM and SIGHUP to it (each it does not ignore: under ``nohup`` a SIGHUP reaches neither). A
  child that dies without an exit code (killed) is exit 3. Timings count
  from the command's process start, and a replay's report says it ran ``warm``.
- **Nothing computed before the fork.** The server imports only: no tensor op has run (so no thread pool
  exists) and CUDA is not initialised (its device check uses NVML), so a child's numbers are a fresh
  process's; the tests replay goldens both ways and compare bytes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

from vd.errors import UsageError

# Environment variables a process reads while starting or importing, by prefix or name: a command whose
# values differ from the server's would not be the process it would have been, so it runs on its own.
IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "ONEDNN_", "DNNL_", "ATEN_", "TORCH", "PYTORCH_",
               "CUDA_", "CUBLAS", "CUDNN", "NVIDIA_", "NCCL_", "HF_", "TRANSFORMERS_", "PYTHON", "LD_", "LANG",
               "LC_", "TMPDIR", "TEMP", "TMP")
IDLE_S = 3600.0
_ORIGIN: list[float | None] = []  # in a server's child: when the command's own process started (monotonic clock)


# --- where a server lives --------------------------------------------------------------------------------

def folder() -> Path:
    if os.environ.get("VD_WARM_DIR"):
        return Path(os.environ["VD_WARM_DIR"])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "vd"
    return Path(f"/tmp/vd-warm-{os.getuid()}")


def _package() -> str:
    return os.path.realpath(os.path.dirname(os.path.abspath(__file__)))


def key() -> str:
    """This installation: the Python executable and the vd package it imports."""
    who = f"{os.path.realpath(sys.executable)}\0{_package()}"
    return hashlib.sha256(who.encode()).hexdigest()[:12]


def socket_path() -> Path:
    return folder() / f"warm-{key()}.sock"


def _private(path: Path) -> bool:
    """``path`` is a folder only this user can enter."""
    try:
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and (st.st_mode & 0o077) == 0


# --- what must match ---------------------------------------------------------------------------------------

def start_env(environ: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME)}


def code_state() -> str:
    """A digest of vd's source files (names, sizes, modification times) and of torch's and transformers'
    installations: what the server imported, and must still be what a command would import."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(_package(), followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            st = os.stat(os.path.join(root, name))
            h.update(f"{root}/{name} {st.st_size} {st.st_mtime_ns}\n".encode())
    import importlib.util
    for dist in ("torch", "transformers"):
        spec = importlib.util.find_spec(dist)
        if spec is not None and spec.origin:
            st = os.stat(spec.origin)
            h.update(f"{spec.origin} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def differences(server: dict[str, str], command: dict[str, str]) -> list[str]:
    """The start-up variables whose values differ (set on one side only counts)."""
    return sorted(k for k in set(server) | set(command) if server.get(k) != command.get(k))


# --- the protocol: a length-prefixed JSON request (with the command's stdio), JSON lines back ---------------

def send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    frame = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [frame], fds) if fds else 0
    if sent < len(frame):  # (an empty send after the whole frame would fail, EPIPE, once the server has answered
        sock.sendall(frame[sent:])  # and closed: a refusal comes that fast)


def receive(sock: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, 65536, 3)
    if len(data) < 4:
        raise ConnectionError("short request")
    size = struct.unpack("!I", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            raise ConnectionError("request cut short")
        data += more
    return json.loads(data), list(fds)


def reply(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


# --- the command's side ------------------------------------------------------------------------------------

def adopt(origin: float | None) -> None:
    """In a server's child: this process is the command whose process started at ``origin`` (monotonic)."""
    _ORIGIN[:] = [origin]


def forked() -> bool:
    """This process is a warm server's child, running a command for it."""
    return bool(_ORIGIN)


def process_start() -> float | None:
    """When this `vd` command's process started, on `time.monotonic`'s clock: its own start, or, in a child a
    warm server forked for it, the command's (None where /proc cannot say)."""
    return _ORIGIN[0] if _ORIGIN else _own_start()


@functools.cache
def _own_start() -> float | None:
    """When this process started, on `time.monotonic`'s clock, from /proc (read once)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, in clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.monotonic() - max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def connect(timeout: float | None = 2.0) -> socket.socket | None:
    """A connection to this installation's server, or None when none runs."""
    path = socket_path()
    if not _private(path.parent) or not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except OSError:
        sock.close()
        return None
    return sock


# Resource limits a command's process would have (`ulimit`), applied in its child: memory, files, stack, core.
LIMITS = ("RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_NOFILE", "RLIMIT_STACK", "RLIMIT_CORE", "RLIMIT_CPU")


def limits() -> dict[str, list[int]]:
    import resource

    return {name: list(resource.getrlimit(getattr(resource, name))) for name in LIMITS if hasattr(resource, name)}


def unreachable_limits(server: dict[str, list[int]], command: dict[str, list[int]]) -> list[str]:
    """The limits a child could not take: above the server's hard limit (only lowering is allowed)."""
    import resource

    def above(value: int, hard: int) -> bool:
        return hard != resource.RLIM_INFINITY and (value == resource.RLIM_INFINITY or value > hard)

    return sorted(name for name, (soft, hard) in command.items()
                  if name in server and (above(soft, server[name][1]) or above(hard, server[name][1])))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def forward(argv: list[str]) -> int | None:
    """Run this command in a child of the warm server: its exit code, or None when no server runs or the one
    running refused (then it says why on stderr, and the caller runs the command itself)."""
    if (len(argv) > 1 and argv[1] == "warm") or os.environ.get("VD_WARM") == "off":
        return None
    sock = connect()
    if sock is None:
        return None
    with sock:
        try:
            main = sys.modules["__main__"]  # how the command was started, as click names it in its help
            request = {"op": "run", "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "path": sys.path,
                       "origin": process_start(), "main": [getattr(main, "__package__", None),
                                                          getattr(main, "__file__", None)],
                       "umask": _umask(), "limits": limits()}
            send(sock, request, [0, 1, 2])
            sock.settimeout(None)
            lines = sock.makefile("rb")
            first = json.loads(lines.readline() or b"{}")
        except (OSError, ValueError) as e:
            print(f"vd: warm server not used: {e}", file=sys.stderr)
            return None
        if "pid" not in first:
            print(f"vd: warm server not used: {first.get('refused', 'no answer')}", file=sys.stderr)
            return None
        return _wait(first["pid"], lines)


def _wait(pid: int, lines) -> int:
    """The child's exit code, forwarding this process's interrupts to it meanwhile."""
    def relay(signum, frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # one ignored here (nohup's SIGHUP) the child never sees
            signal.signal(signum, relay)
    while True:
        try:
            line = lines.readline()
            break
        except InterruptedError:
            continue
    try:
        return int(json.loads(line)["exit"])
    except (ValueError, KeyError, TypeError):
        print(f"vd: error: the warm server's child {pid} ended without an exit code (killed?)", file=sys.stderr)
        return 3


def ask(op: str) -> dict | None:
    """A server's answer to ``status`` or ``stop``; None when none runs."""
    sock = connect(timeout=10.0)
    if sock is None:
        return None
    with sock:
        send(sock, {"op": op})
        line = sock.makefile("rb").readline()
    return json.loads(line) if line else None


# --- `vd warm` ---------------------------------------------------------------------------------------------

def start(idle_s: float = IDLE_S, wait_s: float = 600.0) -> dict:
    """Start this installation's server unless one answers (``already`` in the answer), and wait until it
    serves: its status. Raises RuntimeError (with its log's tail) if it ends first."""
    running = ask("status")
    if running is not None and not running.get("stopping"):
        return {**running, "already": True}
    import subprocess

    where = folder()
    if where.exists() and not where.is_dir():  # (mkdir said only "File exists")
        raise UsageError(f"{where} is a file, not a folder: vd's warm socket lives in a folder (VD_WARM_DIR names it)")
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _private(where):
        raise PermissionError(f"{where} must be a folder only you can enter (mode 0700) to hold vd's warm socket")
    log = where / f"warm-{key()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vd.workflow.warm", "--idle", str(idle_s)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            answer = ask("status")  # another `vd warm` started one first
            if answer is not None:
                return {**answer, "already": True}
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"the warm server ended (exit {proc.returncode}): {tail[0]} (log: {log})")
        answer = ask("status")
        if answer is not None and answer.get("pid") == proc.pid:
            return {**answer, "log": str(log)}
        time.sleep(0.05)
    proc.terminate()
    raise RuntimeError(f"the warm server did not answer within {wait_s:.0f} s (log: {log})")
