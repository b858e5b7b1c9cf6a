"""Errors a user or a file can cause. Each maps to exit code 2 in the CLI and prints as one line.

Internal invariants use `assert`; everything here is something the user can fix.
"""

import contextlib
import os

TRACEBACK_DIR = "VD_TRACEBACK_DIR"


def write_traceback(e: BaseException, prefix: str) -> str:
    """Write ``e``'s traceback to a new file ``PREFIX*.txt`` and return its path, for the one line that names it
    (an internal error's, a plug-in's, a rank's). The file goes to ``$VD_TRACEBACK_DIR`` where that is set
    (made if missing: a CI job points it at the folder it keeps as an artifact), else to the system's temporary
    folder, as also when that folder cannot be made or written: a bad setting never loses the traceback."""
    chosen = os.environ.get(TRACEBACK_DIR)
    if chosen:
        try:
            os.makedirs(chosen, exist_ok=True)
            return _write_traceback(e, prefix, chosen)
        except OSError:
            pass  # the system's temporary folder takes it
    return _write_traceback(e, prefix, None)


def _write_traceback(e: BaseException, prefix: str, folder: str | None) -> str:
    import tempfile
    import traceback

    with tempfile.NamedTemporaryFile("w", prefix=prefix, suffix=".txt", delete=False, dir=folder) as f:
        traceback.print_exception(e, file=f)
    return f.name


@contextlib.contextmanager
def naming(path: str | os.PathLike):
    """An `OSError` raised inside named with ``path`` where the system named no file: a write refused for want of
    space, a quota or a file size limit names none, and the one line the CLI prints of it then says where."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = os.fspath(path)
        raise


def system_refusal(e: OSError) -> str:
    """An `OSError` (a path the system refused: permissions, space) as the one line vd prints of it: its
    reason, then the file it names (`naming`)."""
    return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")


class VdError(Exception):
    """Base of every error vd reports to a user as bad input (exit code 2)."""


class UsageError(VdError, ValueError):
    """A flag or argument that cannot work (an unknown forward, a bad K list, ...)."""


class GoldenError(VdError):
    """Something is wrong with a golden store."""


class GoldenNotFoundError(GoldenError, FileNotFoundError):
    """The golden path does not exist."""


class NotAGoldenError(GoldenError):
    """The path exists but holds no vd golden (no zarr group or no vd metadata)."""


class GoldenCorruptError(GoldenError):
    """A golden whose bytes fail their checksum, whose chunks are missing or whose arrays disagree."""


class GoldenBusyError(GoldenError):
    """Another process is writing the golden (it holds the writers' lock): refused at once, or waited for
    (`vd.store.Location.wait_writer`)."""


class CandidateOutdatedError(UsageError):
    """A saved candidate of a version the golden has moved on from (another process refreshed it since)."""


class GoldenExistsError(GoldenError, FileExistsError):
    """Recording over an existing golden without --refresh."""


class ModelSpecError(VdError, LookupError):
    """A --model SPEC that names nothing vd can load."""


class ModelMismatchError(VdError):
    """The model's fingerprint or shape differs from the golden's."""


class ModelOutputError(VdError):
    """A model returned logits the protocol does not allow (shape, rank, dtype) or, recording, non-finite ones."""


class PluginError(VdError):
    """A plug-in's method raised while it ran: bad input (exit 2), named with what it raised; its traceback is
    kept in a file the message names (``traceback_file``), and ``where`` says which call of a run it was
    (``K=2 step 4``, set by the run, `vd.loop.run_verify`). A built-in engine that raises stays an internal
    error (exit 3)."""

    def __init__(self, message: str, traceback_file: str | None = None):
        self.message, self.traceback_file = message, traceback_file
        self.where: str | None = None
        super().__init__(message)

    def __str__(self) -> str:
        said = [*([f"at {self.where}"] if self.where else []),
                *([f"traceback in {self.traceback_file}"] if self.traceback_file else [])]
        return self.message + (f" ({'; '.join(said)})" if said else "")


class AdapterError(RuntimeError):
    """A model adapter broke the protocol in a way that would store or judge wrong rows: rows it returned
    share memory with rows an earlier forward returned (a reused output buffer). Not bad input but a broken
    engine: an internal error (exit 3) naming the adapter."""


class Terminated(SystemExit):
    """vd's process was sent a signal that ends it (SIGTERM, what CI timeouts send): raised by the command line's
    handler wherever the main thread is, and passed on as raised by the plug-in boundary (`vd.models._guarded`),
    so the process ends with ``128 + signum`` and a recording's staging folder and lock are cleaned up."""
