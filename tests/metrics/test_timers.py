"""Step timing (engine/metrics/timers.py): CUDA events instead of host synchronizes, pp_wait as the stream's stall,
step time from boundary to boundary with the data phase, warm-up steps marked and left out of the ETA.

The CUDA path runs on CPU with a fake device: FakeStream's Event stamps the stream's own clock when recorded, so a
figure taken from events differs from one taken from the host clock, which the fake work does not advance."""

from __future__ import annotations

import time
import types

import pytest
import torch
import torch.distributed as dist

from engine.config import load
from engine.metrics import logger as logger_lib
from engine.metrics.timers import PhaseTimer, StepClock
from engine.parallel.layout.context import ParallelContext
from engine.parallel.pp.executor import PipelineExecutor
from engine.trainer import Trainer
from tests.dist import run_ranks
from tests.metrics.stats import SMALL


class FakeStream:
    """A CUDA stream's timeline: ``run(s)`` enqueues s seconds of device work (the host returns at once)."""

    def __init__(self):
        self.now, self.reads, self.waits = 0.0, 0, 0
        stream = self

        class Event:
            def __init__(self, enable_timing: bool = False):
                assert enable_timing, "an event without timing cannot be read"
                self.at = None

            def record(self, stream_=None):
                self.at = stream.now

            def synchronize(self):
                stream.waits += 1

            def elapsed_time(self, end) -> float:  # milliseconds, as torch.cuda.Event
                stream.reads += 1
                return 1000.0 * (end.at - self.at)

        self.Event = Event

    def run(self, seconds: float) -> None:
        self.now += seconds


def fake_cuda(monkeypatch) -> tuple[FakeStream, list]:
    """torch.cuda.Event -> FakeStream's, torch.cuda.synchronize -> a counter of host synchronizes."""
    stream, syncs = FakeStream(), []
    monkeypatch.setattr(torch.cuda, "Event", stream.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(a))
    return stream, syncs


def test_cuda_phases_are_timed_by_events_without_a_host_synchronize(monkeypatch):
    stream, syncs = fake_cuda(monkeypatch)
    timer = PhaseTimer(torch.device("cuda"))
    for _ in range(2):  # two micro-batches
        with timer.phase("forward"):
            stream.run(0.5)
        with timer.waiting():  # a receive that stalls the stream
            stream.run(0.25)
        with timer.phase("backward"):
            stream.run(1.0)
    assert syncs == [], "a host synchronize inside the step's phases"
    assert stream.reads == 0 and stream.waits == 0, "events read before the step ended"
    assert timer.pop() == pytest.approx({"forward": 1.0, "pp_wait": 0.5, "backward": 2.0})
    assert syncs == [] and stream.waits <= 6  # pop waits on the events themselves, not on the device
    assert timer.pop() == {}


def test_cpu_phases_keep_the_host_clock(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", None)  # never asked for on CPU
    now = [0.0]
    timer = PhaseTimer(torch.device("cpu"), clock=lambda: now[0])
    with timer.phase("data"):
        now[0] += 0.3
    timer.add("pp_wait", 0.1)
    with timer.phase("data"):
        now[0] += 0.2
    assert timer.pop() == pytest.approx({"data": 0.5, "pp_wait": 0.1})
    with timer.phase("forward"):
        now[0] += 1.0
    timer.discard()
    assert timer.pop() == {}


def test_pp_wait_is_the_stream_stall_around_each_receive(monkeypatch):
    """NCCL's work.wait() returns at once and makes the stream wait: the executor's host wait_s reads ~0, the
    events recorded around the wait through the timer's hook see the stall."""
    stream, syncs = fake_cuda(monkeypatch)
    stall, ops = 0.25, []

    class Work:
        def __init__(self, op):
            self.recv = op.op is dist.irecv

        def wait(self):
            if self.recv:
                stream.run(stall)

        def is_completed(self):
            return True

    monkeypatch.setattr(dist, "P2POp", lambda op, t, peer, group: types.SimpleNamespace(op=op, t=t))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda batch: ops.extend(batch) or [Work(o) for o in batch])
    # the first of two stages (1F1B, 3 micro-batches): it receives one output gradient per micro-batch
    ctx = types.SimpleNamespace(
        pp=2,
        pp_rank=0,
        stage_ranks=[0, 1],
        pp_group=None,
        device=torch.device("cpu"),
        is_first_stage=True,
        is_last_stage=False,
    )
    timer = PhaseTimer(torch.device("cuda"))
    executor = PipelineExecutor(ctx, "1f1b", 3, (1, 4), torch.float32, waiting=timer.waiting)
    weight = torch.ones(4, requires_grad=True)
    executor.run(
        timer.wrap("forward", lambda x: x * weight), None, [torch.ones(1, 4)] * 3, backward=lambda out, grad: None
    )
    receives = sum(o.op is dist.irecv for o in ops)
    assert receives == 3 and syncs == []
    assert executor.wait_s < stall  # the host did not block
    assert timer.pop()["pp_wait"] == pytest.approx(receives * stall)


def fit_with_cuda_timer(argv: list[str]) -> dict:
    """Trainer.fit whose phase timer believes it runs on CUDA (events stamped with the host clock)."""
    syncs = []
    torch.cuda.synchronize = lambda *a, **k: syncs.append(a)  # a forked rank of its own: nothing to restore

    class Event:
        def __init__(self, enable_timing: bool = False):
            self.at = None

        def record(self, stream=None):
            self.at = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end) -> float:
            return 1000.0 * (end.at - self.at)

    cfg = load(argv)
    trainer = Trainer(cfg, ParallelContext.from_config(cfg))
    timer = PhaseTimer(torch.device("cuda"), event=Event)
    trainer.stats.timer, trainer.executor.waiting = timer, timer.waiting  # the step's phases, the pp_wait hook
    return {"history": trainer.fit(), "syncs": len(syncs)}


def test_a_training_step_on_the_cuda_path_never_synchronizes_the_host(tmp_path):
    got = run_ranks(fit_with_cuda_timer, 2, [*SMALL, "--parallel.pp", "2", "--train.out_dir", str(tmp_path)])[-1]
    assert got["syncs"] == 0
    for r in got["history"]:
        assert {"data", "forward", "backward", "pp_wait", "optimizer"} <= set(r["time"])
        assert r["time"]["forward"] > 0 and sum(r["time"].values()) <= r["step_time"]


def test_step_clock_runs_boundary_to_boundary_minus_excluded_spans():
    now = [10.0]
    clock = StepClock(clock=lambda: now[0])
    assert clock.lap() is None  # not started: the caller times the step itself
    clock.start()
    now[0] += 2.0
    assert clock.lap() == pytest.approx(2.0)
    with clock.excluded():
        now[0] += 5.0
    now[0] += 1.0
    clock.exclude(0.25)
    assert clock.lap() == pytest.approx(0.75)


def test_progress_eta_leaves_out_the_warmup_step(monkeypatch, tmp_path, capsys):
    now = [0.0]
    monkeypatch.setattr(logger_lib, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    metrics = logger_lib.MetricsLogger(str(tmp_path), enabled=True, progress=True, total_steps=10)
    base = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0}
    for step, seconds, warm in ((1, 100.0, True), (2, 1.0, False), (3, 1.0, False)):
        now[0] += seconds
        metrics.log({**base, "step": step, "step_time": seconds, **({"warmup": True} if warm else {})})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("ETA after warm-up")
    assert lines[-1].endswith("ETA 0:00:07")  # 1 s a step, 7 steps left: the 100 s warm-up step not averaged in
