"""What each step's metrics.jsonl record says beyond the loss: throughput, FLOP/s and MFU, memory, time per phase.

- ``step_time``: wall seconds from the previous step's record to this one (engine/metrics/timers.py StepClock,
  under Trainer.fit): the data phase and the previous step's logging count (and, at the last step, the checkpointer's
  stop-signal all-reduce); evaluation and checkpoint saves do not. A ``train_step`` called outside fit times itself.
- ``tokens_per_s`` (global, global_batch_size * seq_len / step_time) and ``tokens_per_s_per_device`` (/ world size).
- ``warmup``: true on the first WARMUP_STEPS steps of a process (compilation, first touch of memory, DDP's
  re-bucketing), which the progress line's ETA leaves out; absent on later steps.
- ``tflops``: achieved model TFLOP/s per device, ``tokens_per_s_per_device * flops_per_token`` with PaLM's
  6N + 12 L H Q T per token (engine/model/flops.py); ``mfu`` = tflops / the device's peak (``log.peak_tflops``, else
  engine/model/flops.py's table by CUDA device name; absent where no peak is known, a CPU for one).
- ``peak_mem_bytes``: on logged steps only (log.every and the last); on CUDA the allocator's peak since the previous
  logged step (``torch.cuda.max_memory_allocated``);
  on CPU, which has no allocator to ask, the bytes of tensors the rank holds for weights, gradients and optimizer
  state at the update (engine/metrics/memory.py), activations not included. ``mem_source`` says which. The
  maximum over all ranks (one scalar all-reduce a logged step): the rank closest to running out, whichever writes it.
- ``time``: seconds per phase of the step (engine/metrics/timers.py; CUDA events on CUDA): data, forward, backward,
  pp_wait (stalled on pipeline receives), dp_comm (the part of the dp gradient reduction that did not overlap with
  backward: none under DDP, whose bucketed all-reduce runs inside the last backward), optimizer (clip + update;
  DeepSpeed's step() with its reductions under zero). FSDP's and ZeRO-2/3's collectives run inside forward and
  backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package
from engine.config import Config
from engine.metrics.timers import PhaseTimer, StepClock
from engine.model.flops import device_peak_tflops, flops_per_token

# Steps of a process marked "warmup": the first compiles (train.compile; recompiles later are rare), touches fresh
# CUDA memory and is DDP's last before it re-buckets. On CPU without compile it is not slower (launch/bench/timers.py).
WARMUP_STEPS = 1


class StepStats:
    """Per-step measurements of one rank; ``finish`` adds them to the step's record."""

    def __init__(self, cfg: Config, ctx):
        self.cfg, self.ctx = cfg, ctx
        self.timer = PhaseTimer(ctx.device, cfg.log.breakdown)
        self.clock = StepClock()  # started by Trainer.fit: step boundary to step boundary
        self.steps_done = 0
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_tflops = device_peak_tflops(ctx.device, cfg.train.dtype, cfg.log.peak_tflops)
        self.cuda = ctx.device.type == "cuda"
        self.state_bytes = 0

    def before_update(self, bytes_held) -> None:
        """Called between the last backward and the update, when gradients and optimizer state are both held;
        ``bytes_held()`` counts them (the dp mode's DataParallel.bytes_held), on CPU only."""
        if not self.cuda:
            self.state_bytes = sum(bytes_held().values())

    def max_over_ranks(self, value: int) -> int:
        """The largest ``value`` of any rank (every rank calls it once a step, at the same point)."""
        if self.ctx.world_size == 1:
            return value
        t = torch.tensor(value, dtype=torch.int64, device=self.ctx.device)
        with oplog.logged("all-reduce", None, "step stats", 8):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the world group: stages and tp/dp shards hold different bytes
        return int(t.item())

    def add_memory(self, record: dict) -> None:
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.ctx.device)
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        else:
            peak = self.state_bytes
        record.update(
            peak_mem_bytes=self.max_over_ranks(peak), mem_source="cuda_allocator" if self.cuda else "tensors_held"
        )

    def finish(self, record: dict, logged: bool = True) -> dict:
        """Add this step's measurements to ``record``; ``logged``: the record is written (Trainer.logs), the only
        steps whose peak memory is reduced over the ranks and reported (on CUDA, the peak since the last one)."""
        self.steps_done += 1
        if self.steps_done <= WARMUP_STEPS:
            record["warmup"] = True
        self.timer.add("pp_wait", 0.0)  # present at pp = 1 too (the executor's waiting hook adds the stalls)
        per_device = record["tokens_per_s"] / self.ctx.world_size
        tflops = per_device * self.flops_per_token / 1e12
        record.update(tokens_per_s_per_device=per_device, tflops=tflops)
        if self.peak_tflops:
            record["mfu"] = tflops / self.peak_tflops
        if logged:
            self.add_memory(record)
        if self.timer.enabled:
            record["time"] = {k: round(v, 6) for k, v in self.timer.pop().items()}
        return record
