"""`vd warm` (`vd.warm`, `vd.workflow.warm`): a real server started as a user starts it, and `vd` commands run
as processes, forked from it or on their own; their results, exit codes, errors and signals compared."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from warm_server import start_server, stop_server, vd_run

import vd
from vd import warm

PLUGINS = Path(__file__).parent.parent / "plugins"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server for this module's commands: the environment that reaches it, and its status when it started."""
    env, info = start_server(tmp_path_factory.mktemp("warm"))
    yield env, info
    stop_server(env, info["pid"])


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if int(ppid) == pid and state != "Z":
            found.append(int(stat.parent.name))
    return found


def comparisons(report: Path) -> dict:
    r = json.loads(report.read_text())
    return {"verdict": r["verdict"], "reasons": r["reasons"],
            "verify": [[v["k"], v["accepted"], v["comparisons"], v["detection_control"], v["equivalence"]]
                       for v in r["verify"]]}


def test_a_replay_forked_from_the_server_is_the_replay_it_would_have_been(server, tiny_golden, tmp_path):
    env, info = server
    forked = vd_run(["replay", tiny_golden, "--report", tmp_path / "forked.json"], env)
    own = vd_run(["replay", tiny_golden, "--report", tmp_path / "own.json"], {**env, "VD_WARM": "off"})
    assert forked.returncode == own.returncode == 0, forked.stderr + own.stderr
    assert forked.stderr.count("warm server not used") == 0
    assert json.loads((tmp_path / "forked.json").read_text())["timing"]["warm"] is True
    assert json.loads((tmp_path / "own.json").read_text())["timing"]["warm"] is False
    assert comparisons(tmp_path / "forked.json") == comparisons(tmp_path / "own.json")
    assert forked.stdout.splitlines()[-1] == own.stdout.splitlines()[-1] == "PASS"
    status = json.loads(vd_run(["warm", "--status", "--json"], env).stdout)
    assert status["pid"] == info["pid"] and status["served"] >= 1
    assert status["frozen_objects"] > 100_000  # what the imports made, out of the children's collections
    assert status["inductor"] == "imported"  # and it left the server forkable (it started)


def test_a_recording_forked_from_the_server_replays_in_a_process_of_its_own(server, tmp_path):
    env, _ = server
    golden = tmp_path / "forked.zarr"
    done = vd_run(["record", golden, "--model", "tiny-llama", "--steps", "6"], env)
    assert done.returncode == 0 and "warm server not used" not in done.stderr, done.stderr
    again = vd_run(["replay", golden, "--report", tmp_path / "r.json"], {**env, "VD_WARM": "off"})
    assert again.returncode == 0, again.stdout + again.stderr  # every row byte for byte


def test_exit_codes_errors_environment_and_program_name_are_the_commands(server, tiny_golden, tmp_path):
    env, _ = server
    bad = vd_run(["replay", tmp_path / "none.zarr"], env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [f"vd: error: {tmp_path / 'none.zarr'} "
                                                                       "does not exist"]
    # a plug-in file and a variable read at run time (the step it perturbs): the command's, not the server's
    failed = vd_run(["replay", tiny_golden, "--model", f"{PLUGINS / 'perturb.py'}:factory", "--report",
                     tmp_path / "r.json"], {**env, "VD_PERTURB_STEP": "5"})
    r = json.loads((tmp_path / "r.json").read_text())
    assert failed.returncode == 1 and r["timing"]["warm"] is True
    assert all(v["comparisons"][0]["mismatched_step_list"] == [5] for v in r["verify"])
    assert vd_run(["--help"], env).stdout.splitlines()[1].strip().startswith("Usage: python -m vd [OPTIONS]")
    here = vd_run(["show", "tiny.zarr"], env, cwd=tiny_golden.parent)  # the command's working folder
    assert here.returncode == 0 and here.stdout.startswith("tiny.zarr"), here.stderr


def test_a_command_with_other_start_up_settings_runs_in_its_own_process(server, tiny_golden, tmp_path):
    env, _ = server
    done = vd_run(["replay", tiny_golden, "--k", "2", "--report", tmp_path / "r.json"],
                  {**env, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0].startswith("vd: warm server not used: OMP_NUM_THREADS differs from the "
                                                  "server's environment")
    assert json.loads((tmp_path / "r.json").read_text())["timing"]["warm"] is False


def test_sigterm_to_the_command_ends_its_child_as_it_would_the_process(server, tmp_path):
    """What a CI timeout sends: the command forwards it, the child cleans its staging folder up and ends with
    143, and the server serves on."""
    env, info = server
    golden = tmp_path / "long.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "vd", "record", str(golden)],  # the default model: seconds
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    assert proc.stderr is not None
    for line in proc.stderr:  # the child is at its steps
        if line.startswith("vd: greedy continuation ("):
            break
    assert children(info["pid"]), "no child forked"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143
    assert not golden.exists() and not [p for p in tmp_path.iterdir() if p.name != "long.zarr"]
    for _ in range(100):
        if not children(info["pid"]):
            break
        time.sleep(0.1)
    assert not children(info["pid"])
    assert json.loads(vd_run(["warm", "--status", "--json"], env).stdout)["pid"] == info["pid"]


def test_a_sighup_the_command_ignores_never_reaches_its_child(server, tmp_path):
    """A command started under ``nohup`` (SIGHUP ignored): the terminal closing does not end it, so the command
    does not forward that SIGHUP to the child, which records its golden to the end."""
    env, info = server
    golden = tmp_path / "kept.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "vd", "record", str(golden), "--model", "tiny-llama", "--steps",
                             "200", "--k", "2"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("vd: greedy continuation ("):
            break
    assert children(info["pid"]), "no child forked"
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    assert golden.is_dir()


def test_the_server_stops_when_vds_code_changes(tmp_path):
    env, info = start_server(tmp_path / "warm")
    again = vd_run(["warm"], env)
    assert again.returncode == 0 and f"pid {info['pid']} already runs" in again.stdout
    source = Path(vd.__file__).parent / "layout.py"
    before = source.stat()
    try:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        done = vd_run(["models"], env)
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
        stop_server(env, info["pid"])
    assert done.returncode == 0 and "tiny-llama" in done.stdout
    assert done.stderr.splitlines()[0] == ("vd: warm server not used: vd's, torch's or transformers' files changed "
                                           "since it started; it stops (`vd warm` again)")
    assert vd_run(["warm", "--status"], env).stdout.startswith("no warm server runs")


def test_status_exits_1_when_no_server_runs_and_stop_is_then_a_no_op(tmp_path):
    """A script asks `vd warm --status` whether a server runs: the exit code answers (0 yes, 1 no)."""
    env = {k: v for k, v in os.environ.items() if k != "VD_WARM"} | {"VD_WARM_DIR": str(tmp_path / "none")}
    status = vd_run(["warm", "--status"], env)
    assert status.returncode == 1 and status.stdout.startswith("no warm server runs"), status
    as_json = vd_run(["warm", "--status", "--json"], env)
    assert as_json.returncode == 1 and json.loads(as_json.stdout) is None
    stop = vd_run(["warm", "--stop"], env)  # what --stop asks for holds already
    assert stop.returncode == 0 and stop.stdout.startswith("no warm server runs"), stop
    both = vd_run(["warm", "--status", "--stop"], env)  # two questions: which exit code answers?
    assert both.returncode == 2 and both.stderr.strip() == (
        "vd: error: --status and --stop ask different things: give one"), both


def test_a_folder_others_can_enter_is_refused(tmp_path):
    where = tmp_path / "open"
    where.mkdir(mode=0o755)
    where.chmod(0o755)
    done = vd_run(["warm"], {**os.environ, "VD_WARM_DIR": str(where)})
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"vd: error: {where} must be a folder only you can enter (mode 0700) to hold vd's warm socket"]


def test_what_must_match():
    assert warm.start_env({"OMP_NUM_THREADS": "2", "HOME": "/h", "LC_ALL": "C", "VD_CACHE_DIR": "x"}) == {
        "OMP_NUM_THREADS": "2", "LC_ALL": "C"}
    assert warm.differences({"OMP_NUM_THREADS": "2", "LANG": "C"}, {"OMP_NUM_THREADS": "2", "TMPDIR": "/t"}) == [
        "LANG", "TMPDIR"]


def test_a_server_refuses_to_fork_once_the_cuda_driver_runs():
    """The CUDA driver's threads are named ``cuda...``: a thread renamed so stands for one."""
    from vd.workflow.warm import cuda_started

    named, release = threading.Event(), threading.Event()

    def driver_like() -> None:
        Path("/proc/thread-self/comm").write_text("cuda-probe")
        named.set()
        release.wait(30)

    assert not cuda_started()
    t = threading.Thread(target=driver_like)
    t.start()
    try:
        assert named.wait(30) and cuda_started()
    finally:
        release.set()
        t.join()
    # join returns once the thread's Python code is done; its OS thread (and /proc entry) can linger a moment
    deadline = time.monotonic() + 10
    while cuda_started() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not cuda_started()


def test_a_question_asked_apart_leaves_what_it_starts_in_its_child():
    """`ask_apart`: what answering starts (here a thread named as the CUDA driver's are) stays in the child;
    a child that fails to answer gives None."""
    from vd.workflow.warm import ask_apart, cuda_started

    def starts_a_driver_like_thread() -> bool:
        threading.Thread(target=lambda: (Path("/proc/thread-self/comm").write_text("cuda-probe"),
                                         time.sleep(5)), daemon=True).start()
        time.sleep(0.2)
        return cuda_started()

    before = threading.active_count()
    assert ask_apart(starts_a_driver_like_thread) is True
    assert not cuda_started() and threading.active_count() == before
    assert ask_apart(lambda: False) is False
    assert ask_apart(lambda: 1 / 0 > 0) is None


def test_inductor_is_imported_with_the_childs_answer_and_is_available_put_back(monkeypatch):
    import torch

    from vd.workflow import warm as w

    real = torch.cuda.is_available
    asked = []
    monkeypatch.setattr(w, "ask_apart", lambda question: asked.append(question) or True)
    assert w.import_inductor() == "imported"
    assert asked == [real] and torch.cuda.is_available is real
    assert all(name in sys.modules for name in w.INDUCTOR_MODULES)
    monkeypatch.setattr(w, "ask_apart", lambda question: None)
    assert w.import_inductor().startswith("not imported: the child asking")


def test_a_server_whose_inductor_import_starts_a_thread_starts_again_without_it(tmp_path):
    """Where importing Inductor leaves the server unforkable (here a stand-in module that starts a thread named
    as the CUDA driver's), the server becomes one without it: the same process, the environment it started with
    (commands are not refused over the server's own variables), serving, and saying why."""
    (tmp_path / "driver_like.py").write_text(
        "import threading, time\nfrom pathlib import Path\n"
        "def _run():\n    Path('/proc/thread-self/comm').write_text('cuda-probe')\n    time.sleep(600)\n"
        "threading.Thread(target=_run, daemon=True).start()\ntime.sleep(0.2)\n")
    env = {k: v for k, v in os.environ.items() if k != "VD_WARM"} | {"VD_WARM_DIR": str(tmp_path / "warm")}
    code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); import vd.workflow.warm as w; "
            "w.INDUCTOR_MODULES = ('driver_like',); w.main()")
    (tmp_path / "warm").mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), "--idle", "120"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        status = None
        for _ in range(1200):
            done = vd_run(["warm", "--status", "--json"], {**env, "VD_WARM": "off"})
            status = json.loads(done.stdout) if done.stdout.strip().startswith("{") else None
            if status is not None or proc.poll() is not None:
                break
            time.sleep(0.5)
        assert status is not None, proc.stderr.read() if proc.poll() is not None else "no answer"
        assert status["pid"] == proc.pid and status["inductor"].startswith("not imported: importing it left")
        forked = vd_run(["--version"], env)
        assert forked.returncode == 0 and "warm server not used" not in forked.stderr, forked.stderr
        assert json.loads(vd_run(["warm", "--status", "--json"], env).stdout)["served"] == 1
    finally:
        stop_server(env, proc.pid)
        proc.wait(timeout=30)


def test_the_commands_umask_and_a_second_server(server, tmp_path):
    """A recording forked from the server creates its files under the command's umask; a second server for
    the same installation does not start beside the first."""
    env, info = server
    golden = tmp_path / "private.zarr"
    done = subprocess.run(f"umask 077 && exec {sys.executable} -m vd record {golden} --model tiny-llama --steps 6",
                          shell=True, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "warm server not used" not in done.stderr, done.stderr
    modes = {p.stat().st_mode & 0o777 for p in golden.rglob("*")}
    assert modes and all(m & 0o077 == 0 for m in modes), sorted(map(oct, modes))
    second = subprocess.run([sys.executable, "-m", "vd.workflow.warm"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert second.returncode == 1 and "another server for this installation" in second.stderr
    assert json.loads(vd_run(["warm", "--status", "--json"], env).stdout)["pid"] == info["pid"]


def test_limits_a_child_could_not_take():
    import resource

    inf = resource.RLIM_INFINITY
    server = {"RLIMIT_NOFILE": [1024, 4096], "RLIMIT_AS": [inf, inf]}
    assert warm.unreachable_limits(server, {"RLIMIT_NOFILE": [512, 4096], "RLIMIT_AS": [2**30, 2**30]}) == []
    assert warm.unreachable_limits(server, {"RLIMIT_NOFILE": [1024, 8192]}) == ["RLIMIT_NOFILE"]
    assert warm.unreachable_limits(server, {"RLIMIT_NOFILE": [inf, inf]}) == ["RLIMIT_NOFILE"]


def test_a_request_sent_whole_is_not_followed_by_an_empty_write(monkeypatch):
    """A refusal can come, and the server close, as soon as the request is read: a command that then wrote the
    (empty) rest of its frame got EPIPE and printed "warm server not used: Broken pipe" instead of the reason
    (one in five commands on a loaded 2-core host)."""
    client, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    real = socket.send_fds

    def sent_then_answered(sock, buffers, fds):
        n = real(sock, buffers, fds)
        request, passed = warm.receive(server)  # the server reads the whole request, answers and closes
        for fd in passed:
            os.close(fd)
        server.close()
        assert request == {"op": "run"}
        return n

    monkeypatch.setattr(socket, "send_fds", sent_then_answered)
    r, w = os.pipe()
    try:
        warm.send(client, {"op": "run"}, [r])
    finally:
        for fd in (r, w):
            os.close(fd)
        client.close()
