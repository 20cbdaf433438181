"""SIGTERM/SIGINT as a request to stop cleanly: save a checkpoint after the current step, then leave fit().

A cluster scheduler (SLURM, Kubernetes) sends SIGTERM some time before it kills a job; Ctrl-C sends SIGINT. The
handler only sets a flag: a save from inside a signal handler could run in the middle of a collective. The trainer
asks ``agreed(ctx)`` after every step: an all-reduce MAX of the flag, because the signal may reach only some ranks
(torchrun forwards it to all of its workers, a scheduler may signal one node first) and every rank must stop at
the same step. A second SIGINT while the first is pending raises KeyboardInterrupt at once.
"""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    def __init__(self):
        self.requested = False
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
            raise KeyboardInterrupt
        self.requested = True

    def agreed(self, ctx) -> bool:
        """Collective: True on every rank when any rank was signalled (one 1-element all-reduce per step)."""
        if ctx.world_size == 1:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.requested = bool(flag.item())
        return self.requested
