"""The training loop: build the parallel model, split each global batch into micro-batches, step the optimizer.

Order of construction (docs/architecture.md): meta-device model -> keep this pipeline stage's layers -> tensor
parallel -> expert parallel -> materialise and initialise on the device (the same weights at every layout) ->
activation checkpointing -> data parallel (parallel.dp_mode: DDP, FSDP2 or ZeRO, engine/parallel/dp/; the trainer
never asks which). A step consumes one global batch of ``global_batch_size`` sequences: each dp rank runs its share
as ``micro_batches`` forward/backward passes of ``micro_batch_size`` (gradient accumulation, as Megatron).
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist

from engine.checkpoint.checkpointer import Checkpointer
from engine.checkpoint.parts import CheckpointParts, RunPosition
from engine.config import Config, ConfigError
from engine.data import dataset as data_lib
from engine.data.feed import BatchFeed
from engine.hf.init import adopt_shape, load_weights
from engine.metrics import moe as moe_metrics
from engine.metrics.logger import MetricsLogger
from engine.metrics.stepstats import StepStats
from engine.metrics.tensorboard import build_sinks
from engine.optim import lr_at
from engine.parallel import dp as dp_lib
from engine.parallel.cp.inputs import micro_batch_inputs
from engine.parallel.layout.checks import micro_batches_per_step, resolve_layout
from engine.parallel.layout.context import ParallelContext
from engine.parallel.pp import tied
from engine.parallel.pp.executor import PipelineExecutor
from engine.parallel.tp.layers import vocab_parallel_cross_entropy
from engine.planning.balance import describe as describe_split
from engine.stage import build_executors, build_model  # noqa: F401 (build_model: launch/bench imports it here)
from engine.trust import oplog, saved
from engine.trust.goodput import Goodput
from engine.trust.hang import HangWatch
from engine.trust.replicas import ReplicaCheck
from engine.trust.stragglers import StragglerReport


class TrainingAborted(RuntimeError):
    """Training cannot usefully go on (train.max_bad_steps non-finite losses in a row)."""


class Trainer:
    """Holds the model, optimizer and data of one rank and runs optimizer steps."""

    def __init__(self, cfg: Config, ctx: ParallelContext):
        started = time.time()  # start-up in the goodput ledger: from here to the first step
        adopt_shape(cfg)  # model.init_from: the HF folder's shape (launch/pretrain.py did it before ctx, too)
        resolve_layout(cfg, ctx.world_size)  # the layout (and the supported combinations) against that shape
        self.cfg, self.ctx = cfg, ctx
        t = cfg.train
        self.micro_batches = micro_batches_per_step(t, ctx.dp)
        torch.manual_seed(t.seed)
        self.dp = dp_lib.build(build_model(cfg, ctx), cfg, ctx)  # gradient sync, the update, the rank's state
        self.model = self.dp.module  # the stage itself (names and parameters as a checkpoint sees them)
        moe_metrics.weigh_losses(self.model, cfg, self.micro_batches)  # MoE aux/z losses' weight in backward
        self.tokenizer = data_lib.load_tokenizer(cfg.data.tokenizer)
        if len(self.tokenizer) > cfg.model.vocab_size:
            raise ConfigError(
                f"the tokenizer has {len(self.tokenizer)} tokens but model.vocab_size="
                f"{cfg.model.vocab_size}; raise model.vocab_size to at least {len(self.tokenizer)}"
            )
        self.feed = BatchFeed(cfg, ctx, self.tokenizer)
        if ctx.rank == 0:
            self._announce()
        self.stats = StepStats(cfg, ctx)  # throughput, MFU, memory, time per phase (metrics.jsonl)
        self.param_dtype = next(self.model.parameters()).dtype
        self.executor, self.eval_executor = build_executors(
            cfg, ctx, self.model, self.micro_batches, self.stats.timer.waiting
        )
        self.step = 0
        self.stop_agreed: bool | None = None  # the stop decision of this step's agreement (``agree``)
        # Callables observe(event) at "backward" (before each micro-batch's backward) and "update" (after the last
        # backward, before the update): measurements hook in here (launch/bench/measure.py).
        self.observers: list = []
        self.bad_steps = self.skipped_steps = 0  # consecutive and total steps skipped for a NaN/inf loss
        # checkpoint.resume (auto | none | PATH) loads weights, Adam state and RNG into the parts and hands back
        # the step and data position to continue from (engine/checkpoint/checkpointer.py). The Checkpointer first
        # probes and locks train.out_dir and checkpoint.dir (every rank gets rank 0's verdict), so nothing is
        # written to out_dir before this job owns it.
        self.parts = CheckpointParts(self.model, self.dp.checkpoint_state, cfg, ctx)
        self.checkpointer = Checkpointer(cfg, ctx)
        self.metrics = MetricsLogger(
            t.out_dir,
            enabled=ctx.rank == 0,
            progress=cfg.log.progress,
            total_steps=t.steps,
            sinks=build_sinks(cfg, create=ctx.rank == 0),
            on_failure=self.checkpointer.stop.fail,
        )  # disk full: save, stop, exit 3
        if cfg.checkpoint.verify:  # the probe loss a save records and a resume compares (engine/trust/saved.py)
            self.checkpointer.probe = self.probe_loss
        resumed = self.checkpointer.resume(self.parts)
        if resumed is not None:
            self.step = resumed.step
            self.feed.seek(resumed.consumed_samples)
        elif cfg.model.init_from:
            load_weights(self.parts, Path(cfg.model.init_from).expanduser())
        self.metrics.rewind(self.step)  # a resume rolls back the steps logged after its checkpoint
        self.replicas = ReplicaCheck(cfg, ctx, self.model)  # train.check_replicas_every (engine/trust/replicas.py)
        self.goodput = Goodput(t.out_dir, ctx.rank == 0 and cfg.log.goodput, self.step, started)  # goodput.json
        self.hang = HangWatch(cfg, ctx)  # parallel.hang_timeout_s (engine/trust/hang.py), started by fit
        self.stragglers = StragglerReport(cfg, ctx)  # log.straggler_ratio (engine/trust/stragglers.py)

    def _announce(self) -> None:
        """Rank 0's start-up lines: the data, a MoE config whose layers are all dense, an automatic pp split."""
        cfg = self.cfg
        print(self.feed.describe(), flush=True)
        if moe_metrics.dense_notice(cfg):
            print(moe_metrics.dense_notice(cfg), flush=True)
        if cfg.parallel.pp_layers == "auto" and self.ctx.pp > 1:  # the split chosen by cost (planning/balance.py)
            print(describe_split(cfg, self.ctx.pp), flush=True)

    @property
    def position(self) -> RunPosition:
        """Where the run stands: what a checkpoint saves beside the parts."""
        return RunPosition(self.step, self.feed.consumed_samples)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.dp.optimizer

    def run_schedule(
        self, executor: PipelineExecutor, local_batch: torch.Tensor | None, over_pp: bool = True, **kwargs
    ) -> torch.Tensor:
        """Run ``executor`` on this rank's share of a global batch (None on middle stages unless data.document_mask).
        local_batch: (B/dp, s+1) token ids. Each micro-batch's mean loss is divided by the number of micro-batches,
        so the sum is the mean over this rank's tokens; returned (detached) on every stage via a pp all-reduce
        (``over_pp``; else the stage's own term, zero where the stage computes no loss: the step's ``agree``)."""
        ctx = self.ctx
        micro = (
            []
            if local_batch is None
            else [m.to(ctx.device, non_blocking=True) for m in local_batch.split(self.cfg.train.micro_batch_size)]
        )
        # (mbs, s/cp) inputs and labels each, and the forward's RoPE positions and document ids (cp/inputs.py)
        eos = self.tokenizer.eos_token_id if self.cfg.data.document_mask else None
        inputs, labels, extra = micro_batch_inputs(
            micro, self.micro_batches, eos, ctx.size("cp"), ctx.axis_rank("cp"), self.cfg.train.seq_len, ctx.device
        )

        def loss_fn(logits: torch.Tensor, mb: int) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits, labels[mb], ctx.tp_group) / self.micro_batches

        timer = self.stats.timer  # the loss counts as forward time
        forwards = [timer.wrap("forward", functools.partial(self.stage_forward, chunk=c)) for c in range(executor.v)]
        loss = executor.run(forwards, timer.wrap("forward", loss_fn), inputs, extra_inputs=extra, **kwargs)
        if ctx.pp > 1 and over_pp:
            with oplog.logged("all-reduce", ctx.pp_group, "loss", 4):
                dist.all_reduce(loss, group=ctx.pp_group)  # only the last stage's term is non-zero
        return loss

    def stage_forward(self, x: torch.Tensor, chunk: int = 0, **kwargs) -> torch.Tensor:
        """dp.forward of one micro-batch; received hidden states (b, s, h) in the wire dtype go back to the
        weights' dtype (autocast's fp32 residual stream), whose backward casts their gradient to the wire dtype."""
        if x.is_floating_point():
            x = x.to(self.param_dtype)
        return self.dp.forward(x, chunk=chunk, **kwargs)

    def forward_backward(self, local_batch: torch.Tensor | None, over_pp: bool = True) -> torch.Tensor:
        """Accumulate the gradient of this rank's share of the global batch; returns its mean loss (``over_pp``
        False: the stage's own term of it, as ``run_schedule``)."""
        backward = self.stats.timer.wrap("backward", self.dp.backward)
        loss = self.run_schedule(
            self.executor,
            local_batch,
            over_pp,
            before_backward=self.before_backward,
            backward=backward,
            last_weight=self.dp.last_weight,
        )
        self.sync_tied_embedding()
        return loss

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over train.eval_batches global batches of the held-out split (None if it is empty)."""
        losses = self.eval_losses(self.feed.valid_batches(self.cfg.train.eval_batches))
        if not losses:
            return None
        return self.mean_over_data(torch.stack(losses).mean()).item()

    @torch.no_grad()
    def probe_loss(self) -> float:
        """The loss of the fixed probe batch (engine/trust/saved.py) with the weights as they are: one forward."""
        (loss,) = self.eval_losses([saved.probe_batch(self.cfg, self.ctx, len(self.tokenizer), self.feed.needs_batch)])
        return self.mean_over_data(loss).item()

    def eval_losses(self, batches) -> list[torch.Tensor]:
        """Each local batch's loss through the eval schedule, in eval mode (evaluation, the probe); not part of the
        next step's time breakdown."""
        self.dp.train(False)
        losses = [self.run_schedule(self.eval_executor, batch) for batch in batches]
        self.dp.train(True)
        self.stats.timer.discard()
        return losses

    def mean_over_data(self, loss: torch.Tensor) -> torch.Tensor:
        """A rank's mean loss -> the mean over dp x cp: each cp rank's mean is over the same number (s/cp) of its
        row's tokens, so the cp mean is the whole sequence's."""
        if self.ctx.grad_size > 1:
            with oplog.logged("all-reduce", self.ctx.grad_group, "loss", 4):
                dist.all_reduce(loss, group=self.ctx.grad_group)
            loss = loss / self.ctx.grad_size
        return loss

    def agree(self, loss: torch.Tensor) -> tuple[float, dict]:
        """The step's one meeting of every rank before the update: one SUM all-reduce over the world of a small
        float64 vector [loss term, the stop flag's 3 one-hot slots, the MoE sums]; returns (the global-batch mean
        loss, the MoE metrics), the same on every rank, and keeps the stop decision for ``after_step``.
        ``loss``: this stage's term of the rank's mean loss (zero on stages without the loss). Its tp peers hold
        the same term and MoE sums, so only tp rank 0 adds them: the sum is over pp (one stage's term is non-zero)
        and dp x cp, as the pp and dp x cp all-reduces it replaces. The stop flag, a MAX over ranks, rides as counts
        (engine/checkpoint/signals.py ``slots``). The grad-norm all-reduce stays in the update (the math needs the
        loss first: a NaN loss skips it), and the peak memory's MAX runs on logging steps (StepStats)."""
        ctx, stop = self.ctx, self.checkpointer.stop
        moe = moe_metrics.local_sums(self.model, self.cfg, ctx.device)  # None when dense
        if ctx.world_size == 1:
            self.stop_agreed = None  # after_step reads the local flag, no collective
            return moe_metrics.step_loss(loss.item(), moe, self.cfg, ctx, self.micro_batches)
        vec = torch.zeros(4 + (0 if moe is None else moe.numel()), dtype=torch.float64, device=ctx.device)
        if ctx.tp_rank == 0:
            vec[0] = loss.detach()
            if moe is not None:
                vec[4:] = moe
        vec[1:4] = torch.tensor(stop.slots(), dtype=torch.float64)
        if oplog.FAULT is None or not oplog.fault("skip_collective"):  # test-only: a rank skips it
            with oplog.logged("all-reduce", None, "step agreement", vec.numel() * vec.element_size()):
                dist.all_reduce(vec)
        values = vec.tolist()  # one device-to-host copy
        self.stop_agreed = stop.settle(values[1:4], self.checkpointer.stop_exchange)
        sums = None if moe is None else vec[4:]
        return moe_metrics.step_loss(values[0] / ctx.grad_size, sums, self.cfg, ctx, self.micro_batches)

    def before_backward(self, mb: int, is_last: bool, chunk: int = 0) -> None:
        """Before each micro-batch's backward: the dp mode reduces a chunk's gradients only in its last one."""
        self.observe("backward")
        self.dp.before_backward(is_last, chunk)

    def observe(self, event: str) -> None:
        for observer in self.observers:
            observer(event)

    def sync_tied_embedding(self) -> None:
        """Sum the gradients of the two copies of a tied embedding (first and last stage; engine/parallel/pp/tied.py),
        so both copies take the same optimizer step and stay equal."""
        weight = tied.stage_copy(self.model, self.cfg, self.ctx)
        if weight is not None:
            self.dp.all_reduce_grad(weight, self.ctx.embed_group)

    def train_step(self, local_batch: torch.Tensor) -> dict:
        """One optimizer step on one global batch; returns the step's metrics (loss is the global-batch mean)."""
        t = self.cfg.train
        start = time.perf_counter()
        # The loss is the global-batch mean on every rank (one all-reduce: ``agree``), so every rank takes the
        # same decision.
        loss_value, moe = self.agree(self.forward_backward(local_batch, over_pp=False))
        lr = lr_at(self.step, t)
        self.stats.before_update(self.dp.bytes_held)
        if not math.isfinite(loss_value):
            grad_norm = self.skip_update("loss")
        else:
            grad_norm = self.optimizer_step(lr)  # not applied when the global gradient norm is not finite
            if math.isfinite(grad_norm):
                self.bad_steps = 0
            else:  # a finite loss can still have NaN/inf gradients (an overflow in backward, a huge lr)
                self.count_bad_step("gradient norm")
        self.step += 1  # a skipped step still consumed its batch and its place in the LR schedule (Megatron)
        lap = self.stats.clock.lap()  # under fit: from the previous step's record, data and logging included
        step_time = lap if lap is not None else time.perf_counter() - start
        record = {
            "step": self.step,
            "loss": loss_value,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": t.global_batch_size * t.seq_len / step_time,
            "step_time": step_time,
            **moe,
        }
        if self.skipped_steps:
            record["skipped_steps"] = self.skipped_steps
        return self.stats.finish(record, logged=self.logs(self.step))

    def logs(self, step: int) -> bool:
        """Whether step ``step``'s record is logged (metrics.jsonl, the progress line): every log.every steps and
        the last."""
        return step % self.cfg.log.every == 0 or step == self.cfg.train.steps

    def count_bad_step(self, what: str) -> None:
        """Count a skipped step (``what``: loss or gradient norm was NaN/inf); abort after train.max_bad_steps
        in a row. Every rank decides alike: the loss and the norm are global values."""
        self.bad_steps += 1
        self.skipped_steps += 1
        limit = self.cfg.train.max_bad_steps
        if self.ctx.rank == 0:
            print(
                f"step {self.step + 1}: {what} is not finite; update skipped ({self.bad_steps} in a row"
                f"{f', abort at {limit}' if limit else ''})",
                flush=True,
            )
        if limit and self.bad_steps >= limit:
            raise TrainingAborted(
                f"{self.bad_steps} steps in a row (up to step {self.step + 1}) had a NaN or inf "
                f"loss or gradient norm (train.max_bad_steps={limit}); lower train.lr, raise "
                f"train.warmup_steps or resume from an earlier checkpoint"
            )

    def skip_update(self, what: str) -> float:
        """Drop this step's gradients without updating (a NaN/inf loss)."""
        self.count_bad_step(what)
        self.dp.skip()
        return float("nan")

    def optimizer_step(self, lr: float) -> float:
        """Finish the dp reduction, clip by the global norm, update; returns the norm before clipping. A NaN/inf
        norm (the same on every rank: it is reduced over dp, tp and pp) drops the gradients unapplied."""
        self.observe("update")
        with self.stats.timer.phase("dp_comm"):  # what of the dp reduction did not overlap with backward
            self.dp.reduce_gradients()
        with self.stats.timer.phase("optimizer"):
            return self.dp.step(lr)

    def next_local_batch(self) -> torch.Tensor | None:
        """This dp rank's (B/dp, s+1) slice of the next global batch (None on a middle pipeline stage)."""
        return self.feed.next_train()

    def fit(self) -> list[dict]:
        """Train until cfg.train.steps; returns the metrics of every step (all ranks)."""
        history = []
        self.dp.train(True)
        self.checkpointer.start()  # SIGTERM/SIGINT from here on: save after the current step and return
        if self.step >= self.cfg.train.steps and self.ctx.rank == 0:
            print(
                f"nothing to do: the run is at step {self.step} and train.steps={self.cfg.train.steps}; raise "
                f"train.steps to train further",
                flush=True,
            )
        clock = self.stats.clock  # a step's time runs from the previous step's record to its own, data included
        clock.start()
        self.goodput.begin()
        self.hang.start(self.step + 1)  # the progress watchdog: no operation and no step for parallel.hang_timeout_s
        stop = False
        while self.step < self.cfg.train.steps:
            oplog.LOG.step = self.step + 1
            with self.stats.timer.phase("data"):
                batch = self.next_local_batch()
            record = self.train_step(batch)
            every = self.cfg.train.eval_every
            if every and (self.step % every == 0 or self.step == self.cfg.train.steps):
                with clock.excluded():
                    eval_loss = self.evaluate()
                if eval_loss is not None:
                    record["eval_loss"] = eval_loss
            history.append(record)
            self.goodput.step(self.step, record["step_time"], write=self.step % self.cfg.log.every == 0)
            self.replicas.maybe_check(self.step, self.checkpointer.wait)  # ends the run before this step's save
            self.stragglers.add(record)
            if self.logs(self.step):
                self.stragglers.report(record)  # every rank: one gather of a few floats to rank 0
                self.metrics.log(record)
            # saves every checkpoint.every steps, at the last, on a signal; True: stop now. The stop flag rode in
            # the step's agreement; at the last step it is asked again (a failure to log it must reach every rank),
            # an all-reduce that counts to the step; a save does not (Megatron stops its interval timer around it).
            saved, start = self.checkpointer.last_saved, time.perf_counter()
            agreed = None if self.step == self.cfg.train.steps else self.stop_agreed
            with self.hang.saving():
                stop = self.checkpointer.after_step(self.parts, self.position, self.bad_steps, agreed)
            if self.checkpointer.last_saved != saved:
                clock.exclude(time.perf_counter() - start)
                self.goodput.saved(time.perf_counter() - start)
            if stop:
                break
        clock.stop()  # train_step called on its own times itself again
        self.hang.stop()
        self.checkpointer.finish()  # an async save commits before fit returns
        self.metrics.close()
        self.goodput.end("stopped" if stop else "done")
        return history
