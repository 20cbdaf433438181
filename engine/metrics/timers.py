"""Step timing: time per phase (data, forward, backward, pp_wait, dp_comm, optimizer) and wall time per step.

``PhaseTimer`` sums each phase over a step. On CPU the work is done when a call returns, so a phase is the host's
wall time (``time.perf_counter``). On CUDA kernels run asynchronously: a phase is bracketed by two CUDA events
recorded on the current stream (``torch.cuda.Event(enable_timing=True)``, the device-side timing of Megatron's
timers without their barrier), never by ``torch.cuda.synchronize()``. A host synchronize inside a step would make
the host wait on pending NCCL sends (a deadlock risk for the interleaved pipeline order) and add launch latency to
every figure. The events are read once, in ``pop()`` after the step's last phase: it waits for the step's last
event only (``Event.synchronize``), which the step's end has usually reached already.

``pp_wait`` is timed around each pipeline receive's ``work.wait()`` (the executor's ``waiting`` hook). On NCCL
``wait()`` returns at once and makes the compute stream wait on the communication stream, so the host clock reads
~0; an event recorded before the wait and one after it measure how long the stream stalled. ``dp_comm`` likewise.

``StepClock`` measures a step from step boundary to step boundary (Megatron's interval time): the data phase,
metrics logging and the checkpointer's stop-signal all-reduce are part of the step; evaluation and checkpoint
saves are excluded (``excluded()``), as Megatron stops its interval timer around them.
"""

from __future__ import annotations

import contextlib
import time

import torch


class PhaseTimer:
    """``with timer.phase("forward"): ...`` adds the block's time to that phase; ``pop()`` returns and resets the
    sums (seconds). ``clock``: the host clock (CPU); ``event``: a class like ``torch.cuda.Event`` (by default on
    a CUDA device; None on CPU) -- both injectable, so the CUDA path is testable on CPU."""

    def __init__(self, device: torch.device, enabled: bool = True, clock=time.perf_counter, event=None):
        self.enabled, self.clock = enabled, clock
        if event is None and device.type == "cuda":
            event = torch.cuda.Event
        self.event = event
        self.totals: dict[str, float] = {}
        self.spans: list[tuple] = []  # (name, start event, end event), read in pop()

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        if self.event is None:
            start = self.clock()
            try:
                yield
            finally:
                self.add(name, self.clock() - start)
            return
        begin = self.event(enable_timing=True)
        begin.record()  # on the current stream: the point the device reaches when the phase's work starts
        try:
            yield
        finally:
            end = self.event(enable_timing=True)
            end.record()
            self.spans.append((name, begin, end))

    def waiting(self):
        """The pipeline executor's hook around each receive's ``work.wait()``: time the stall as ``pp_wait``."""
        return self.phase("pp_wait")

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
        """The sums since the last pop (or discard). Call after the step's last phase: on CUDA this reads the
        events, waiting for each span's end event (the last one recorded; the others are then done already)."""
        for name, begin, end in reversed(self.spans):
            end.synchronize()
            self.add(name, begin.elapsed_time(end) / 1000.0)  # elapsed_time is in milliseconds
        self.spans = []
        totals, self.totals = self.totals, {}
        return totals

    def discard(self) -> None:
        """Drop what was timed since the last pop without reading it (evaluation is not part of a step)."""
        self.spans, self.totals = [], {}


class StepClock:
    """Wall time from one step boundary to the next. ``start()`` sets a boundary (before the first step's data);
    ``lap()`` returns the seconds since the last boundary and sets a new one (None when not started: the caller
    then times the step itself); ``excluded()``/``exclude()`` keep a span out of the step (evaluation, a save)."""

    def __init__(self, clock=time.perf_counter):
        self.clock, self.boundary = clock, None

    def start(self) -> None:
        self.boundary = self.clock()

    def stop(self) -> None:
        self.boundary = None

    def lap(self) -> float | None:
        if self.boundary is None:
            return None
        now = self.clock()
        elapsed, self.boundary = now - self.boundary, now
        return elapsed

    def exclude(self, seconds: float) -> None:
        """Keep ``seconds`` just spent out of the step (moves the boundary on)."""
        if self.boundary is not None:
            self.boundary += seconds

    @contextlib.contextmanager
    def excluded(self):
        start = self.clock()
        try:
            yield
        finally:
            self.exclude(self.clock() - start)
