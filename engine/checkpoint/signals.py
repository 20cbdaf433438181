"""SIGTERM/SIGHUP/SIGINT as a request to stop cleanly: save a checkpoint after the current step, then leave fit().

A cluster scheduler (SLURM, Kubernetes) sends SIGTERM some time before it kills a job; a dropped ssh session sends
SIGHUP (the default action ended the run at once, exit 129, nothing saved); Ctrl-C sends SIGINT. The handler only
sets a flag: a save from inside a signal handler could run in the middle of a collective. Every rank must stop at
the same step, and the signal may reach only some ranks (torchrun forwards it to all of its workers, a scheduler may
signal one node first): the flag rides, as one-hot counts (``slots``), in the step's one agreement all-reduce beside
the loss (engine/trainer.py ``agree``, before the update), and at the last step in an all-reduce of its own
(``agreed``). A signal that comes after a step's agreement stops the run after the next step. A second SIGINT while
the first is pending raises ``Interrupted`` at once: the user wants out now; a save it cuts short is dropped and
``latest`` keeps naming the last good checkpoint (engine/checkpoint/checkpointer.py), and the launcher prints one
line, exit status 130 (128 + SIGINT, as the shell reports it).

The same flag stops a run whose metrics cannot be written (``fail``, engine/metrics/logger.py, rank 0 only): the
flag then carries 3, so every rank learns that this stop is a failure (saved, then exit 3: engine/storage.py).

Under torchrun a SIGTERM has two senders that want different ends. A user or a scheduler sends it to stop the job
(a preemption notice): save and exit 0. The worker's own torchrun agent sends it (``os.killpg``) to restart its
workers: a host joined the job (a membership change: ``num_nodes_waiting() > 0``, agent/server/api.py
``_invoke_run``) or a worker failed. torch tells the workers nothing more (no variable, no store key), and an
agent that sees its workers exit 0 takes the job as finished, exits 0 and closes the rendezvous: a host rejoining an
elastic job ended it. Only the signal's sender tells the two apart, and Python's handlers do not see it. So
``watch_agent_sigterm`` (launch/pretrain.py, first thing, while the process has one thread: every later thread
inherits the mask) blocks SIGTERM and takes it in a thread of its own with ``sigwaitinfo``, which names the
sender. The parent process (the agent) asks for a restart: the flag carries 2, every rank saves and exits 1, and
every agent restarts (one that had not yet seen the new host counts a failure), meets the others at the new size and
resumes. Anyone else's SIGTERM is the stop it always was. Outside fit the thread does what SIGTERM does by default.
"""

from __future__ import annotations

import os
import signal
import threading

from engine.trust import oplog

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SIGNALLED, RESTART, FAILED = 1.0, 2.0, 3.0  # the flag's values (MAX over ranks: a failure outranks the rest)


class _AgentSigterm:
    """The thread that takes every SIGTERM (blocked in all the others) and hands it to the running fit."""

    def __init__(self, agent: int):
        self.agent = agent  # the parent process: torchrun's agent starts the worker itself
        self.target: StopSignal | None = None  # the StopSignal of the fit in progress

    def run(self) -> None:
        while True:
            sender = signal.sigwaitinfo({signal.SIGTERM}).si_pid
            target = self.target
            if target is not None:
                target.take(signal.SIGTERM, restart=sender == self.agent)
                continue
            # Not training: what SIGTERM does without a handler (it ends the process, as torchrun reports it)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
            signal.raise_signal(signal.SIGTERM)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # a handler took it: back to waiting


_watch: _AgentSigterm | None = None


def watch_agent_sigterm() -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set), in a process that has one thread: block SIGTERM and take it in
    a thread that tells the agent's from anyone else's. Elsewhere (python, the deepspeed launcher, a process with
    threads already, which could take the signal unseen) SIGTERM stays as it is: a stop, never a restart."""
    global _watch
    if _watch is not None or "TORCHELASTIC_RUN_ID" not in os.environ or not hasattr(signal, "sigwaitinfo"):
        return
    try:
        if len(os.listdir("/proc/self/task")) != 1:
            return
    except OSError:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _watch = _AgentSigterm(os.getppid())
    threading.Thread(target=_watch.run, name="engine-sigterm", daemon=True).start()
    os.register_at_fork(after_in_child=_unwatch)  # a forked child has no such thread: SIGTERM as it was


def _unwatch() -> None:
    global _watch
    _watch = None
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


class Interrupted(KeyboardInterrupt):
    """A second SIGINT: leave now; ``str(e)`` is the one line the launcher prints."""


class StopSignal:
    def __init__(self):
        self.requested = False
        self.failed = False  # the stop is a failure (a write refused), not a signal
        self.restart = False  # the stop is torchrun's agent restarting the workers (a host joined; exit 1)
        self.failure: str | None = None  # its line, on the rank that failed (every rank after ``share``)
        self.signal_name = ""
        self._previous: dict = {}

    def install(self) -> None:
        """Catch the signals (only possible in the main thread; elsewhere the default behaviour stays)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for sig in SIGNALS:  # SIGTERM's handler too: where no thread watches it, or one that started early took it
            self._previous[sig] = signal.signal(sig, self._handle)
        if _watch is not None:
            _watch.target = self

    def uninstall(self) -> None:
        if _watch is not None and _watch.target is self:
            _watch.target = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            self.uninstall()
            raise Interrupted("a second SIGINT: stopped at once")
        self.take(signum)

    def take(self, signum: int, restart: bool = False) -> None:
        """Stop after this step; ``restart``: the agent's SIGTERM (the watching thread calls this too)."""
        self.requested, self.signal_name = True, self.signal_name or signal.Signals(signum).name
        self.restart = self.restart or restart

    def fail(self, message: str) -> None:
        """Stop after this step because a write failed (``message``: its one line)."""
        self.requested, self.failed, self.failure = True, True, message

    def slots(self) -> list[float]:
        """This rank's flag as one-hot counts (signalled, restart, failed): summed over the ranks (the trainer's one
        step agreement, or ``agreed``), the highest non-zero slot is the MAX of the flags (a failure outranks a
        restart, which outranks a signal), so the flag rides in a SUM all-reduce beside the loss."""
        value = FAILED if self.failed else RESTART if self.restart else SIGNALLED if self.requested else 0.0
        return [float(value == flag) for flag in (SIGNALLED, RESTART, FAILED)]

    def settle(self, counts: list[float], exchange=None) -> bool:
        """Take the summed ``slots`` of every rank (collective only when some rank failed: its line through the
        store); True when the run stops after this step, the same on every rank."""
        value = next((flag for flag, n in zip((FAILED, RESTART, SIGNALLED), counts[::-1]) if n > 0), 0.0)
        self.requested, self.failed, self.restart = bool(value), value == FAILED, value == RESTART
        if self.failed:
            self.failure = exchange.broadcast(self.failure)
        return self.requested

    def agreed(self, ctx, exchange=None) -> bool:
        """Collective: True on every rank when any rank was signalled or failed (one 3-element all-reduce); ``failed``
        and ``restart`` then say, on every rank, whether any rank failed or was stopped by its agent, and
        ``failure`` is rank 0's line (rank 0 writes the metrics), sent through the store (``exchange``: the
        checkpointer's engine/cluster/exchange.py StoreExchange for it). The trainer asks it only at the last step:
        on the others the flag rode in the step's agreement (engine/trainer.py ``agree``)."""
        if ctx.world_size == 1:
            return self.requested
        import torch  # here, not at the top: launch/pretrain.py imports this module before anything starts a thread
        import torch.distributed as dist

        flags = torch.tensor(self.slots(), device=ctx.device)
        with oplog.logged("all-reduce", None, "stop signal", flags.numel() * flags.element_size()):
            dist.all_reduce(flags, group=None)
        return self.settle(flags.tolist(), exchange)
