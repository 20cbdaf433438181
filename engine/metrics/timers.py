"""Step-time breakdown: wall time per phase (data, forward, backward, optimizer, ...), summed over a step.

On CUDA, kernels run asynchronously, so a phase is bracketed by ``torch.cuda.synchronize()`` (as Megatron's timers
do at their default barrier level); that costs a few microseconds per phase per micro-batch, and ``log.breakdown:
false`` turns it off. On CPU the work is done when the call returns and no synchronisation is needed.
"""
from __future__ import annotations

import contextlib
import time

import torch


class PhaseTimer:
    """``with timer.phase("forward"): ...`` adds the block's wall time to that phase; ``pop()`` returns and
    resets the sums (seconds)."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self.sync = enabled and device.type == "cuda"
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def add(self, name: str, seconds: float) -> None:
        if self.enabled:
            self.totals[name] = self.totals.get(name, 0.0) + seconds

    def wrap(self, name: str, fn):
        """fn, timed as ``name`` on every call."""
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        return timed

    def pop(self) -> dict[str, float]:
        totals, self.totals = self.totals, {}
        return totals
