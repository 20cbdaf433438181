"""The watchdog of a torchrun agent blocked on a frozen store host (engine/cluster/agentwatch.py) without torchrun:
an "agent" process that starts a worker and then never reaps it (as one blocked in a store call) or reaps it (as
one monitoring its workers); the worker starts the watchdog through ``agentwatch.start`` and exits. In seconds;
tests/cluster/test_store_host.py freezes a real store host under torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.cluster import agentwatch
from tests import hosts
from tests.cli import ROOT

WORKER = """import sys
sys.path.insert(0, {root!r})
from engine.cluster import agentwatch
watchdog = agentwatch.start({grace})
print(watchdog.pid if watchdog else "none", flush=True)
import time
time.sleep({linger})  # a worker's teardown (atexit, process groups) before it exits
"""

# The agent: starts the worker in a session of its own (as torchrun's does), then reaps it, or (blocked) does not,
# and kills the ended worker's process group as torchrun stops a worker group; then waits (60 s at most)
AGENT = """import os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)
if sys.argv[2] == "reaps":
    worker.wait()
else:
    while open(f"/proc/{worker.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.02)
try:
    os.killpg(worker.pid, signal.SIGKILL)
except OSError:
    pass
time.sleep(60)
"""


def _agent(
    tmp_path: Path, reaps: bool, grace: float = 0.5, run_id: str = "job1", linger: float = 0
) -> tuple[subprocess.Popen, str]:
    """The agent and the watchdog's pid as its worker printed it ('none': not started); the worker exits ``linger``
    seconds after starting the watchdog."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if run_id:
        env["TORCHELASTIC_RUN_ID"] = run_id
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            AGENT,
            WORKER.format(root=str(ROOT), grace=grace, linger=linger),
            "reaps" if reaps else "blocked",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return agent, agent.stdout.readline().strip()


def _ended(pid: int, timeout_s: float = 30) -> bool:
    try:
        psutil.Process(pid).wait(timeout=timeout_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.parametrize("linger", [0, 1.5], ids=["exits", "exits-later"])
def test_an_agent_that_never_reaps_its_ended_worker_is_killed_with_one_line(tmp_path, linger):
    """Also when the worker exits a while after starting the watchdog (which waits EXIT_WAIT_S for that)."""
    agent, watchdog = _agent(tmp_path, reaps=False, linger=linger)
    try:
        assert watchdog != "none"
        assert agent.wait(timeout=30) == -9  # SIGKILL, within the grace (0.5 s) of the worker's exit
        line = agent.stderr.read()
        assert "engine-heartbeat: the torchrun agent (pid " in line and "within 0 s: it is blocked" in line, line
        assert _ended(int(watchdog))
    finally:
        agent.kill()


def test_an_agent_that_reaps_its_worker_is_left_alone(tmp_path):
    agent, watchdog = _agent(tmp_path, reaps=True, grace=0.5)
    try:
        assert watchdog != "none" and _ended(int(watchdog))  # gone without killing anyone
        assert agent.poll() is None
    finally:
        agent.kill()
        agent.wait()


def test_no_watchdog_outside_torchrun():
    """Only under a torchrun agent (TORCHELASTIC_RUN_ID set): another parent (a shell, the deepspeed launcher,
    slurmstepd) is never watched."""
    agent, watchdog = _agent(Path(), reaps=True, run_id="")
    agent.kill()
    agent.wait()
    assert watchdog == "none"


def test_a_worker_that_never_exits_or_a_pid_reused_is_never_signalled(tmp_path, monkeypatch):
    """The watchdog checks start times: an agent whose start time is not the one given (its pid reused) is not
    killed, nor is one whose worker pid belongs to another process; a worker still running after EXIT_WAIT_S
    (something else holds it) leaves its agent alone."""
    agent, watchdog = _agent(tmp_path, reaps=False, grace=30)  # its own watchdog waits 30 s: this test acts first
    worker = psutil.Process(agent.pid).children()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert len(worker) == 1 and watchdog != "none"
        zombie = worker[0].pid
        while agentwatch._stat(zombie)[0] != "Z":
            time.sleep(0.05)
        started, agent_started = agentwatch._stat(zombie)[2], agentwatch._stat(agent.pid)[2]
        assert not agentwatch.watch(zombie, started, agent.pid, str(int(agent_started) + 1), 0.1)
        assert not agentwatch.watch(zombie, str(int(started) + 1), agent.pid, agent_started, 0.1)
        assert agent.poll() is None
        monkeypatch.setattr(agentwatch, "EXIT_WAIT_S", 0.3)
        assert not agentwatch.watch(sleeper.pid, agentwatch._stat(sleeper.pid)[2], agent.pid, agent_started, 0.1)
        assert agent.poll() is None and sleeper.poll() is None
        assert agentwatch.watch(zombie, started, agent.pid, agent_started, 0.1)  # the real one: ended
        assert agent.wait(timeout=10) == -9
    finally:
        for proc in (agent, sleeper):
            proc.kill()
            proc.wait()
    assert agentwatch._stat(sleeper.pid) is None


def test_the_start_time_read_is_the_processes_own(tmp_path):
    """A reused pid is told apart by its start time: the one /proc gives in clock ticks since boot, as psutil reads
    it independently (another field, the same for every process, would let a reused pid be signalled); also for a
    process whose name holds ')', which /proc/PID/stat does not quote."""
    python = tmp_path / "py) x"
    python.symlink_to(sys.executable)
    sleeper = subprocess.Popen([str(python), "-c", "import time; time.sleep(30)"])
    try:
        while psutil.Process(sleeper.pid).name() != "py) x":  # until its exec
            time.sleep(0.01)
        for pid in (os.getpid(), sleeper.pid):
            state, parent, ticks = agentwatch._stat(pid)
            assert state in ("R", "S") and parent == psutil.Process(pid).ppid()
            assert (
                abs(int(ticks) / os.sysconf("SC_CLK_TCK") + psutil.boot_time() - psutil.Process(pid).create_time())
                < 0.02
            )
    finally:
        sleeper.kill()
        sleeper.wait()


# A worker whose agent has died, adopted by init (pid 1): init is nobody's agent, so no watchdog starts (one would
# wait on init and could signal it); a watchdog that did start is stopped at once
ORPHAN = """import os, sys, time
sys.path.insert(0, {root!r})
from engine.cluster import agentwatch
parent = os.getpid()
if os.fork():
    os._exit(0)
while os.getppid() == parent:
    time.sleep(0.01)
watchdog = agentwatch.start(0.1)
if watchdog:
    watchdog.kill()
print(os.getppid(), "none" if watchdog is None else "started", flush=True)
"""


def test_an_orphaned_worker_starts_no_watchdog_over_init():
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job1"}
    out = subprocess.run(
        [sys.executable, "-c", ORPHAN.format(root=str(ROOT))], env=env, capture_output=True, text=True, timeout=30
    ).stdout.split()
    if out[0] != "1":
        pytest.skip(f"orphans are adopted by a subreaper here (pid {out[0]}), not by init")
    assert out == ["1", "none"]


def test_no_watchdog_when_the_agent_is_gone_before_it_is_read(monkeypatch):
    """The agent dies between the worker's getppid() and the read of its /proc entry: nothing to watch, no error."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setattr(os, "getppid", lambda: gone.pid)
    assert agentwatch._stat(gone.pid) is None and agentwatch.start(0.1) is None


def test_no_watchdog_when_it_cannot_be_started(monkeypatch):
    """A watchdog that cannot be started (no such Python, no process left to fork) leaves the worker to end as it
    would without one."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job1")
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    assert agentwatch.start(0.1) is None


def test_an_agent_at_pid_2_of_a_container_is_watched():
    """A container whose init (tini, a shell) is PID 1 runs torchrun as PID 2: its worker watches it like any other
    (pid 1 alone means the agent is gone and init adopted the worker). A new PID namespace with /proc mounted for
    it: a shell as its PID 1, the blocked agent PID 2, its worker 3; the agent is killed within its grace."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        hosts.unavailable("a PID namespace needs root and util-linux's unshare")
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job1"}
    worker = WORKER.format(root=str(ROOT), grace=0.5, linger=0)
    # --kill-child: the namespace (its init, then everything in it) ends with unshare, whatever the test's outcome
    container = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c"]
    command = '"$0" -c "$1" "$2" blocked; echo $?'
    with subprocess.Popen(
        [*container, command, sys.executable, AGENT, worker], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as run:
        try:
            assert run.stdout.readline().strip() != b"none"
            status, errors = run.communicate(timeout=30)
        finally:
            run.kill()
    assert status.strip() == b"137", status  # 128 + SIGKILL
    assert b"engine-heartbeat: the torchrun agent (pid 2) has not reaped its ended worker (pid 3)" in errors, errors


# A worker that ends on a heartbeat verdict as launch/pretrain.py's do (exit_fn os._exit): its peer failed on its
# own, so the verdict comes at the first beat; the worker serves the job's store itself, as rank 0 does
VERDICT_WORKER = """import os, sys, time
sys.path.insert(0, {root!r})
from datetime import timedelta
import torch.distributed as dist
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port))
from engine.cluster.heartbeat import Heartbeat, connect
connect(5.0).set("hb/1", "failed")
Heartbeat(0, 2, 0.6).start()
time.sleep(60)
"""


def test_a_worker_ending_on_a_heartbeat_verdict_under_torchrun_starts_the_watchdog():
    """engine/cluster/heartbeat.py's end (os._exit after the line) starts the watchdog of its torchrun agent: an
    agent blocked on a frozen store (here: one that never reaps) is killed once its worker has ended on the line."""
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "job1"}
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, VERDICT_WORKER.format(root=str(ROOT)), "blocked"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.wait(timeout=30) == -9
        err = agent.communicate()[1]
        assert "error: rank 1 on host " in err and "failed (its own error is printed above)" in err, err[-2000:]
        assert "engine-heartbeat: the torchrun agent (pid " in err, err[-2000:]
    finally:
        agent.kill()
        agent.wait()
