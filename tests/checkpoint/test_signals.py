"""The stop signal (engine/checkpoint/signals.py) in one process: real signals to this process, two forked gloo
ranks for the agreement, and a child under torchrun's variables for the agent's SIGTERM. The launcher runs
(tests/checkpoint/test_checkpoint.py, tests/cluster/test_elastic.py) take 20-45 s; these take seconds.

- SIGTERM, SIGHUP and SIGINT each ask for a stop after the step, named; the handlers before ``install`` come back
  at ``uninstall``; a second SIGINT raises ``Interrupted`` at once, a second SIGTERM does not.
- The flag as one-hot counts: a failure outranks a restart, which outranks a signal, summed over ranks.
- Two ranks, one signalled (or one failed): both stop, and the failed rank's line reaches the other.
- Under torchrun's variables, a SIGTERM from the parent (the agent) is a restart, anyone else's a stop; outside a
  fit it ends the process as SIGTERM does, and a process whose main ends exits (the watching thread keeps none
  alive).
- One process stops on its own flag (a refused metrics write too); the stop's all-reduce is logged for a hang
  report with its bytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import types

import pytest

from engine.checkpoint.signals import FAILED, RESTART, SIGNALLED, SIGNALS, Interrupted, StopSignal
from engine.trust import oplog
from tests.cli import ROOT
from tests.dist import run_ranks


@pytest.fixture
def stop():
    stop = StopSignal()
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    stop.install()
    yield stop
    stop.uninstall()
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_each_signal_asks_for_a_stop_and_is_named(stop, sig):
    assert not stop.requested and stop.slots() == [0.0, 0.0, 0.0]
    os.kill(os.getpid(), sig)
    assert stop.requested and stop.signal_name == sig.name and not (stop.failed or stop.restart)
    assert stop.slots() == [1.0, 0.0, 0.0]
    os.kill(os.getpid(), signal.SIGTERM)  # another signal later: still a stop, still named by the first
    assert stop.requested and stop.signal_name == sig.name


def test_a_second_sigint_stops_at_once_and_gives_the_handlers_back(stop):
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested
    with pytest.raises(Interrupted, match="a second SIGINT: stopped at once"):
        os.kill(os.getpid(), signal.SIGINT)
    assert all(signal.getsignal(sig) != stop._handle for sig in SIGNALS)  # the ones from before install


def test_uninstall_gives_the_handlers_back_and_install_outside_the_main_thread_catches_nothing():
    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    stop, errors = StopSignal(), []

    def install():
        try:
            stop.install()
        except Exception as e:  # signal.signal outside the main thread raises ValueError
            errors.append(e)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert errors == [] and {sig: signal.getsignal(sig) for sig in SIGNALS} == before
    stop.install()
    stop.install()  # twice: the handlers of before are kept, not this one's own
    assert all(signal.getsignal(sig) == stop._handle for sig in SIGNALS)
    stop.uninstall()
    assert {sig: signal.getsignal(sig) for sig in SIGNALS} == before


class _Exchange:
    """Rank 0's line, as engine/cluster/exchange.py's broadcast gives it (one rank: itself)."""

    def broadcast(self, obj):
        return obj


def test_the_flag_rides_as_counts_and_the_highest_wins():
    signalled, restart, failed = StopSignal(), StopSignal(), StopSignal()
    signalled.take(signal.SIGTERM)
    restart.take(signal.SIGTERM, restart=True)
    failed.fail("metrics: disk full")
    assert (signalled.slots(), restart.slots(), failed.slots()) == ([1, 0, 0], [0, 1, 0], [0, 0, 1])
    assert (SIGNALLED, RESTART, FAILED) == (1.0, 2.0, 3.0)
    restart.take(signal.SIGTERM)  # a later plain SIGTERM leaves it a restart
    assert restart.restart and restart.slots() == [0, 1, 0]
    for counts, want in (
        ([0, 0, 0], (False, False, False)),
        ([3, 0, 0], (True, False, False)),
        ([5, 1, 0], (True, True, False)),
        ([2, 7, 1], (True, False, True)),
        ([0, 0, 2], (True, False, True)),
    ):
        rank = StopSignal()
        rank.failure = "metrics: disk full"
        assert rank.settle(counts, _Exchange()) is want[0]
        assert (rank.requested, rank.restart, rank.failed) == want, counts
        assert rank.failure == "metrics: disk full"
    one = types.SimpleNamespace(world_size=1)  # one process: the flag itself, no all-reduce
    assert StopSignal().agreed(one) is False and signalled.agreed(one) is True
    assert failed.agreed(one) is True and failed.failed  # a metrics write refused stops a one-process run too


def _agree(which: str) -> tuple:
    """Rank function (2 ranks): rank 1 is signalled (or fails, or its agent restarts it); both agree."""
    import torch
    import torch.distributed as dist

    from engine.cluster.exchange import StoreExchange

    rank = dist.get_rank()
    ctx = types.SimpleNamespace(world_size=2, rank=rank, device=torch.device("cpu"))
    exchange = StoreExchange(dist.distributed_c10d._get_default_store(), rank, 2, 30.0, "test/stop")
    stop = StopSignal()
    if rank == 1 and which == "signal":
        stop.take(signal.SIGHUP)
    if rank == 1 and which == "restart":
        stop.take(signal.SIGTERM, restart=True)
    if which == "fail":  # rank 0 writes the metrics; rank 1 was signalled too
        stop.fail("metrics: no space left") if rank == 0 else stop.take(signal.SIGTERM)
    agreed = stop.agreed(ctx, exchange)
    record = oplog.LOG.tail(1)[0]  # what a hang report would show of it: [seq, kind, group, what, peer, bytes, ...]
    assert (record[1], record[3], record[5]) == ("all-reduce", "stop signal", 3 * 4)  # three fp32 counts
    return agreed, stop.restart, stop.failed, stop.failure


@pytest.mark.parametrize("which", ["none", "signal", "restart", "fail"])
def test_two_ranks_stop_together_when_one_is_signalled(which):
    want = {
        "none": (False, False, False, None),
        "signal": (True, False, False, None),
        "restart": (True, True, False, None),
        "fail": (True, False, True, "metrics: no space left"),
    }[which]
    assert run_ranks(_agree, 2, which, timeout_s=60) == [want, want]


_CHILD = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
if sys.argv[1] != "plain":  # plain: not under torchrun
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
from engine.checkpoint.signals import StopSignal, watch_agent_sigterm
watch_agent_sigterm()
stop = StopSignal()
if sys.argv[1] == "done":  # main ends at once: the watching thread must not keep the process alive
    sys.exit(0)
if sys.argv[1] in ("fit", "plain"):
    stop.install()
    print("ready", flush=True)
    deadline = time.monotonic() + 30
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.01)
    print(stop.requested, stop.restart, stop.signal_name, flush=True)
    stop.uninstall()
print("idle", flush=True)
time.sleep(30)
print("not ended", flush=True)
"""


def _child(mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_CHILD.format(root=str(ROOT))), mode],
        stdout=subprocess.PIPE,
        text=True,
    )


def _ends_on_sigterm(child: subprocess.Popen) -> None:
    """Outside a fit (idle): SIGTERM ends the process as it does without a handler (torchrun reports it so)."""
    assert child.stdout.readline() == "idle\n"
    child.send_signal(signal.SIGTERM)
    assert child.communicate(timeout=30)[0] == "" and child.returncode == -signal.SIGTERM


def test_under_torchrun_the_agents_sigterm_is_a_restart_and_anyone_elses_a_stop():
    agent = _child("fit")  # this process started it: its agent
    assert agent.stdout.readline() == "ready\n"
    agent.send_signal(signal.SIGTERM)
    assert agent.stdout.readline() == "True True SIGTERM\n"
    _ends_on_sigterm(agent)  # the fit is over: the next SIGTERM ends it
    other = _child("fit")
    assert other.stdout.readline() == "ready\n"
    subprocess.run(["kill", "-TERM", str(other.pid)], check=True)  # sent by another process
    assert other.stdout.readline() == "True False SIGTERM\n"
    _ends_on_sigterm(other)
    _ends_on_sigterm(_child("idle"))  # no fit at all
    done = _child("done")  # a run that finished: the process ends, its SIGTERM thread with it
    try:
        assert done.communicate(timeout=30)[0] == "" and done.returncode == 0
    finally:
        done.kill()  # nothing once it ended
    plain = _child("plain")  # not under torchrun: the parent's SIGTERM is a stop as anyone's
    assert plain.stdout.readline() == "ready\n"
    plain.send_signal(signal.SIGTERM)
    assert plain.stdout.readline() == "True False SIGTERM\n"
    plain.kill()
    plain.communicate(timeout=30)
