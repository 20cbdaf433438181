"""SIGTERM/SIGHUP/SIGINT as a request to stop cleanly: save a checkpoint after the current step, then leave fit().

A cluster scheduler (SLURM, Kubernetes) sends SIGTERM some time before it kills a job; a dropped ssh session
sends SIGHUP (the default action ended the run at once, exit 129, nothing saved); Ctrl-C sends SIGINT. The
handler only sets a flag: a save from inside a signal handler could run in the middle of a collective. The trainer
asks ``agreed(ctx)`` after every step: an all-reduce MAX of the flag, because the signal may reach only some ranks
(torchrun forwards it to all of its workers, a scheduler may signal one node first) and every rank must stop at
the same step. A second SIGINT while the first is pending raises ``Interrupted`` at once: the user wants out now;
a save it cuts short is dropped and ``latest`` keeps naming the last good checkpoint (engine/checkpoint/
checkpointer.py), and the launcher prints one line, exit status 130 (128 + SIGINT, as the shell reports it).

The same flag stops a run whose metrics cannot be written (``fail``, engine/metrics/logger.py, rank 0 only): the
flag then carries 2, so every rank learns that this stop is a failure (saved, then exit 3: engine/storage.py).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SIGNALLED, FAILED = 1.0, 2.0  # the flag's values (MAX over ranks: a failure outranks a signal)


class Interrupted(KeyboardInterrupt):
    """A second SIGINT: leave now; ``str(e)`` is the one line the launcher prints."""


class StopSignal:
    def __init__(self):
        self.requested = False
        self.failed = False  # the stop is a failure (a write refused), not a signal
        self.failure: str | None = None  # its line, on the rank that failed (every rank after ``share``)
        self.signal_name = ""
        self._previous: dict = {}

    def install(self) -> None:
        """Catch the signals (only possible in the main thread; elsewhere the default behaviour stays)."""
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            self.uninstall()
            raise Interrupted("a second SIGINT: stopped at once")
        self.requested, self.signal_name = True, self.signal_name or signal.Signals(signum).name

    def fail(self, message: str) -> None:
        """Stop after this step because a write failed (``message``: its one line)."""
        self.requested, self.failed, self.failure = True, True, message

    def agreed(self, ctx, exchange=None) -> bool:
        """Collective: True on every rank when any rank was signalled or failed (one 1-element all-reduce per
        step); ``failed`` then says, on every rank, whether any rank failed, and ``failure`` is rank 0's line
        (rank 0 writes the metrics), sent through the store (``exchange``: the checkpointer's
        engine/cluster/exchange.py StoreExchange for it)."""
        if ctx.world_size == 1:
            return self.requested
        flag = torch.tensor([FAILED if self.failed else SIGNALLED if self.requested else 0.0], device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.requested, self.failed = bool(flag.item()), flag.item() == FAILED
        if self.failed:
            self.failure = exchange.broadcast(self.failure)
        return self.requested
