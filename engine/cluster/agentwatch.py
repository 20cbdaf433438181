"""Ends a torchrun agent that can no longer see its workers end: the agent's own wait on a frozen store host.

torchrun's agent (torch/distributed/elastic/agent/server/api.py ``SimpleElasticAgent._invoke_run``) loops on
``time.sleep(monitor_interval)`` (0.1 s), ``_monitor_workers`` (which reaps an exited worker) and, while its workers
are healthy, ``rdzv_handler.num_nodes_waiting()``: a read of the c10d rendezvous store. When the host serving that
store is frozen (SIGSTOP, a hung kernel) or cut off, the read never returns: the TCPStore client's timeout bounds
waiting for a key, not for the server's reply, and its socket stays open. The agent's SIGTERM handler cannot help
either: it raises in Python, which runs only once the store call returns. So the ranks end within the heartbeat's
bound naming the store (engine/cluster/heartbeat.py), and their agent stays for as long as the freeze lasts, its
dead workers unreaped, telling the scheduler nothing.

The worker is the only place the engine runs, so the worker starts this watchdog as it ends on a heartbeat
verdict, in a session of its own (it outlives the worker). It waits for the worker to exit, then gives the agent
``grace`` seconds (the heartbeat's store-call timeout) to reap it: an agent that is monitoring reaps within
``monitor_interval``, and then stops its other workers, restarts them (``--max-restarts``) or exits as torchrun
decides. An agent that has not reaped its worker within ``grace`` is blocked outside its monitor loop, in a
store call, and is ended with SIGKILL (the only signal a blocked agent obeys): the scheduler sees a non-zero end
(killed by signal 9, status 137 under a shell) within the heartbeat's bound plus ``grace``, and ``srun
--kill-on-bad-exit`` ends the rest. It touches nothing but the worker's own parent, and only under a torchrun
agent (``TORCHELASTIC_RUN_ID`` set): another parent (the deepspeed launcher, a shell, slurmstepd) is never killed.
The pids are checked against their start times, so a reused pid is never signalled.

Run as a script (``python agentwatch.py WORKER WORKER_START AGENT AGENT_START GRACE``): standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EXIT_WAIT_S = 30.0  # the worker exits right after starting the watchdog; past this, something else holds it


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, start time in clock ticks since boot) of ``pid`` from /proc; None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), fields[19]


def _unreaped(worker: int, started: str, agent: int) -> bool:
    """The worker has exited and is still its agent's zombie: the agent has not waited for it."""
    st = _stat(worker)
    return st is not None and st[2] == started and st[0] == "Z" and st[1] == agent


def watch(worker: int, worker_start: str, agent: int, agent_start: str, grace: float) -> bool:
    """Wait for the worker to exit, then ``grace`` seconds for the agent to reap it; SIGKILL the agent when it did
    not. True when the agent was ended."""
    deadline = time.monotonic() + EXIT_WAIT_S
    while (st := _stat(worker)) is not None and st[2] == worker_start and st[0] != "Z":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    deadline = time.monotonic() + grace
    while _unreaped(worker, worker_start, agent) and time.monotonic() < deadline:
        time.sleep(0.05)
    owner = _stat(agent)
    if not _unreaped(worker, worker_start, agent) or owner is None or owner[2] != agent_start:
        return False
    print(
        f"engine-heartbeat: the torchrun agent (pid {agent}) has not reaped its ended worker (pid {worker}) within "
        f"{grace:.0f} s: it is blocked on the store of a frozen or cut-off host; ending it (SIGKILL)",
        file=sys.stderr,
        flush=True,
    )
    os.kill(agent, signal.SIGKILL)
    return True


def start(grace: float) -> subprocess.Popen | None:
    """Start the watchdog of this worker's torchrun agent; None when the parent is not one (or /proc is missing)."""
    agent = os.getppid()
    me, parent = _stat(os.getpid()), _stat(agent)
    if not os.environ.get("TORCHELASTIC_RUN_ID") or me is None or parent is None or agent <= 1:
        return None
    args = [str(os.getpid()), me[2], str(agent), parent[2], f"{grace:.3f}"]
    try:
        return subprocess.Popen(
            [sys.executable, "-S", str(Path(__file__).resolve()), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # stderr stays the worker's: the agent's log gets the line of a kill
            start_new_session=True,  # outlives the worker, and the agent's kill of the worker's process group
            close_fds=True,
        )
    except OSError:
        return None


if __name__ == "__main__":
    worker_pid, worker_started, agent_pid, agent_started, grace_s = sys.argv[1:6]
    watch(int(worker_pid), worker_started, int(agent_pid), agent_started, float(grace_s))
