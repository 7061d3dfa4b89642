"""A sweep's worker processes: results as in one process, and nothing left running when a worker
dies or the sweep is interrupted (real processes, real signals)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from kvstore.synthetic_traces import agent_sessions
from kvstore.trace import write_trace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def group_processes(pgid: int) -> list[tuple[int, str, bool]]:
    """(pid, state, is a sweep worker) of every process in the group, zombies included."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                worker = b"spawn_main" in f.read()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            found.append((int(name), fields[0], worker))
    return found


def ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (the ``SigIgn`` mask of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(line for line in f if line.startswith("SigIgn:")).split()[1]
    return bool(int(mask, 16) >> (signal.SIGINT - 1) & 1)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture(scope="module")
def agent_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "agent.jsonl"
    write_trace(str(path), agent_sessions(seed=1))  # each adaptive replay takes seconds
    return str(path)


@pytest.fixture
def sweep_running(agent_trace):
    """A parallel sweep in its own process group, with SIGINT as a terminal leaves it, once both
    of its workers run and it has stopped ignoring SIGINT (it ignores it while it starts them, so
    they inherit that, and a Ctrl-C sent before it stops is lost: under load both workers were
    seen running while the sweep still ignored it); killed whole at the end whatever the test did."""
    command = [sys.executable, "-m", "kvstore.cli", "replay", agent_trace, "--sweep", "--jobs", "2", "--policies",
               "adaptive", "--capacities", "100k,200k,300k,400k,500k,600k,700k,800k"]
    sweep = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": REPO},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        running = lambda: sum(worker and state != "Z" for _, state, worker in group_processes(sweep.pid)) == 2  # noqa: E731
        wait_until(lambda: running() and not ignores_sigint(sweep.pid), 120, "the workers never started")
        assert sweep.poll() is None, "the sweep ended before the test acted"
        yield sweep
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
        sweep.communicate()


def workers_of(sweep) -> list[int]:
    return [pid for pid, _, worker in group_processes(sweep.pid) if worker]


def ended(pids: list[int], pgid: int) -> bool:
    """Every one of ``pids`` has exited (a zombie has: reaping it is its new parent's business)."""
    return all(state == "Z" for pid, state, _ in group_processes(pgid) if pid in pids)


def test_ctrl_c_ends_a_parallel_sweep_and_its_workers_at_once(sweep_running):
    workers = workers_of(sweep_running)
    os.killpg(sweep_running.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
    interrupted = time.monotonic()
    sweep_running.wait(timeout=60)
    took = time.monotonic() - interrupted
    _, err = sweep_running.communicate(timeout=60)
    assert sweep_running.returncode == 130 and took < 5, (took, err)
    assert b"Traceback" not in err, err
    wait_until(lambda: ended(workers, sweep_running.pid), 10, "workers outlived the sweep")


def test_sigterm_to_the_sweep_alone_ends_its_workers_too(sweep_running):
    workers = workers_of(sweep_running)
    sweep_running.terminate()  # the parent only, as a service manager or kill PID would
    sweep_running.wait(timeout=60)
    assert sweep_running.returncode == 128 + signal.SIGTERM
    wait_until(lambda: ended(workers, sweep_running.pid), 10, "workers outlived the sweep")


def test_a_worker_killed_mid_replay_fails_the_sweep_with_its_exit_code(sweep_running):
    workers = workers_of(sweep_running)
    os.kill(workers[0], signal.SIGKILL)  # as the out-of-memory killer would
    sweep_running.wait(timeout=60)
    _, err = sweep_running.communicate(timeout=60)
    assert sweep_running.returncode == 2
    assert b"a replay worker died (exit code -9)" in err and b"Traceback" not in err, err
    wait_until(lambda: ended(workers, sweep_running.pid), 10, "the other worker outlived the sweep")
