"""dp_mode=ddp: torch DistributedDataParallel over the dp group, its reduction overlapped with the last backward.

DDP (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training") packs gradients
into ``parallel.bucket_mb`` buckets in reverse registration order and all-reduces each bucket as soon as backward
has produced all of its gradients, while backward goes on computing the earlier layers. With
``gradient_as_bucket_view`` the gradients *are* views into the buckets: no second copy of the model's gradients.

The buckets and the averaging are the same at every step, so a resumed run repeats the uninterrupted one bit for
bit at any dp (``static_buckets``). torch's DDP changes both after its first step: that step reduces all gradients
in one bucket and scales them while copying them in (``grad * (1/dp)``), later steps reduce buckets rebuilt in the
order the gradients arrived and divide in place (``bucket / dp``). The ring all-reduce sums an element in an order
set by its position in the bucket, and ``x * (1/3) != x / 3`` for some x, so at dp 3 a resumed run's first step
(DDP's first) differed from the uninterrupted run's by an ulp (dp 2's two-term sums and halving are exact).

Gradient accumulation over micro-batches and pipeline schedules: every forward runs under ``no_sync`` (DDP then
arms no reduction), and before the step's last backward the reducer is armed by hand, as
torch.distributed.pipelining's stage does (``backward_maybe_with_nosync``). Arming at the last *forward* would
be wrong under 1F1B: on every stage but the last, the last forward is followed by other micro-batches' backwards,
whose partial gradients would then be reduced. Gradients accumulate in the bucket views between steps (zeroed,
not freed), so they never exist twice.

``parallel.grad_compression`` picks DDP's communication hook: ``none`` (all-reduce in the gradient dtype; equal to
one process up to summation order), ``bf16`` / ``fp16`` (each bucket cast down for the all-reduce and back: half
the bytes on the wire), or
``powersgd`` (Vogels et al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization": rank ``parallel.powersgd_rank`` factors with error feedback, after ``parallel.powersgd_warmup_steps``
uncompressed steps; tensors too small to gain stay uncompressed).
"""

from __future__ import annotations

import inspect
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package
from engine.config import Config
from engine.internals import TESTED, UnsupportedVersion, installed_version, private
from engine.parallel.dp.base import DataParallel, TorchOptimizerMixin
from engine.parallel.dp.buckets import ReadyBuckets, all_reduce_mean
from engine.parallel.dp.state import TorchState
from engine.parallel.ep import expert_parameters, reduce_expert_gradients
from engine.parallel.pp import tied
from engine.parallel.pp.schedule import chunking
from engine.parallel.pp.virtual import model_chunks


def cast_hook(dtype: torch.dtype):
    """DDP's cast-compression hook (torch's fp16/bf16_compress_hook, default_hooks.py): the bucket is divided by the
    dp size, cast to ``dtype``, all-reduced, and copied back. torch refuses its bf16 hook off NCCL/XCCL, though
    gloo reduces bf16 (CPU runs), so this mirror of it serves bf16 there."""

    # No annotations: DDP checks them against dist.GradBucket, and `from __future__ import annotations` makes
    # them strings.
    def hook(group, bucket):  # bucket: dist.GradBucket; returns a Future of the reduced buffer
        buffer = bucket.buffer()  # (bucket numel,) in the gradient dtype
        compressed = buffer.to(dtype).div_(dist.get_world_size(group))
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(fut) -> torch.Tensor:
            buffer.copy_(fut.value()[0])
            return buffer

        return future.then(decompress)

    return hook


def comm_hook(cfg: Config, ctx):
    """(state, hook) for ``DistributedDataParallel.register_comm_hook``, or None for DDP's own all-reduce."""
    p = cfg.parallel
    if p.grad_compression == "none":
        return None
    if p.grad_compression == "bf16":
        native = ctx.backend == "nccl"  # torch's own hook checks for it
        return ctx.grad_group, default_hooks.bf16_compress_hook if native else cast_hook(torch.bfloat16)
    if p.grad_compression == "fp16":
        return ctx.grad_group, default_hooks.fp16_compress_hook
    state = powerSGD_hook.PowerSGDState(
        process_group=ctx.grad_group,
        matrix_approximation_rank=p.powersgd_rank,
        start_powerSGD_iter=p.powersgd_warmup_steps,
        random_seed=cfg.train.seed,
    )
    return state, powerSGD_hook.powerSGD_hook if ctx.backend == "nccl" else one_bucket_at_a_time(
        powerSGD_hook.powerSGD_hook
    )


def one_bucket_at_a_time(hook):
    """``hook`` finished before DDP reduces the next bucket. PowerSGD issues its second all-reduce (Q, after P)
    from a future callback, which under gloo runs on gloo's thread and races the next bucket's all-reduce from
    the backward thread: with several buckets the ranks then issue collectives in different orders and gloo
    aborts ("Received data size doesn't match expected size"). Waiting serialises the buckets (no overlap with
    backward: CPU runs only)."""

    def serialised(state, bucket):  # no annotations (see cast_hook)
        future = hook(state, bucket)
        future.wait()
        return future

    return serialised


def _no_buffer_sync() -> dict:
    """DDP's argument that turns off the per-forward buffer broadcast: ``forward_sync_buffers`` where this torch
    has it (``broadcast_buffers`` is deprecated there), else ``broadcast_buffers``."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


class ReverseOrderDDP(DistributedDataParallel):
    """DistributedDataParallel whose reducer lists the parameters in reverse registration order, so that buckets
    built in the reducer's own order (``static_buckets``) launch in about the order backward completes them."""

    def _build_params_for_reducer(self):
        params, sparse = super()._build_params_for_reducer()
        return params[::-1], sparse[::-1]


def static_buckets(chunk: nn.Module, cfg: Config, ctx) -> DistributedDataParallel:
    """``chunk`` under DDP with the same buckets and the same averaging at every step (module docstring): the
    buckets are built now, in reverse registration order (1 MB first, then ``parallel.bucket_mb``, as DDP sizes
    them), instead of after the first step in arrival order; and the gradients start as zeros, which DDP turns into
    bucket views at once, so every step divides them in place. No memory beyond DDP's own: the gradients are the
    bucket views DDP allocates anyway."""
    private(DistributedDataParallel, "torch", "_build_params_for_reducer")  # what ReverseOrderDDP overrides
    ignored = {name for name, _ in expert_parameters(chunk)}
    for name, p in chunk.named_parameters():
        if p.requires_grad and name not in ignored and p.grad is None:
            p.grad = torch.zeros_like(p)
    ddp = ReverseOrderDDP(
        chunk,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        process_group=ctx.grad_group,
        bucket_cap_mb=cfg.parallel.bucket_mb,
        gradient_as_bucket_view=True,
        init_sync=False,
        **_no_buffer_sync(),
    )
    reducer = private(ddp, "torch", "reducer")
    private(reducer, "torch", "_push_all_rebuilt_params")()  # every parameter, in the reducer's order
    if not private(reducer, "torch", "_rebuild_buckets")():  # a broadcast of the layout over the dp group
        raise UnsupportedVersion(
            f"DDP did not rebuild its buckets at start-up in torch {installed_version('torch')}; the engine is "
            f"tested with torch {TESTED['torch']}"
        )
    return ddp


class DDP(TorchOptimizerMixin, DataParallel):
    """The stage replicated over dp; DDP averages gradients during the last micro-batch's backward.

    With virtual stages (interleaved schedule) each model chunk is its own DistributedDataParallel, armed before
    that chunk's last backward: a rank's chunks finish their gradients at different backwards (at dp 1 the chunks
    run unwrapped). Under a schedule that defers weight gradients (zero bubble) no backward finishes one, so no
    reducer is armed: each chunk's gradients are averaged in buckets launched during its last W as each bucket
    completes (dp/buckets.py ReadyBuckets), overlapped with the rest of the W's; reduce_gradients waits for them.
    ``overlap_weight_reduction = False`` keeps the older exposed path instead, one all-reduce per bucket after the
    last W (launch/bench/schedules.py compares the two)."""

    overlap_weight_reduction = True
    zero_grad_to_none = False  # keep the bucket views: accumulation writes into them

    def __init__(self, model: nn.Module, cfg: Config, ctx):
        super().__init__(cfg, ctx)
        self.module = model
        self.chunks = model_chunks(model, ctx.pp, ctx.pp_rank, *chunking(cfg.parallel))
        # Every rank built the same weights and buffers (engine/model/init.py): no start-up broadcast, and no
        # buffer broadcast before each forward (a collective the pipeline schedule does not expect). At dp 1 there
        # is nothing to reduce: no wrapper (its buckets would copy every gradient and its hooks run for nothing).
        # Expert-parallel weights stay out of DDP: reduced over the expert-dp group (reduce_gradients)
        for chunk in self.chunks:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                chunk, [name for name, _ in expert_parameters(chunk)]
            )
        self.ddps = [static_buckets(chunk, cfg, ctx) for chunk in self.chunks] if ctx.grad_size > 1 else []
        # No bucket views at dp x cp 1: gradients freed after each update, so the first backward of a step writes
        # them (AccumulateGrad takes its tensor) instead of a fill with zeros and an add into them; the planner
        # prices the same (engine/planning/dp.py DDPModel.grads_whole_step)
        self.zero_grad_to_none = not self.ddps
        for ddp in self.ddps:  # a hook state per chunk: PowerSGD keys its error feedback by bucket index
            hook = comm_hook(cfg, ctx)
            if hook is not None:
                ddp.register_comm_hook(*hook)
        self.armed: set[int] = set()  # chunks whose reducer ran in this step's backward, or whose W launched
        self.syncing = False  # the next backward runs an armed reducer (logged as the grad sync)
        self.launched: list[ReadyBuckets] = []  # zero bubble: the chunks' reductions started in their last W
        # The stage's copy of a tied embedding is summed over the embedding group after the W's (the trainer's
        # sync_tied_embedding): it is averaged over dp after that sum, in reduce_gradients, not in the W.
        self.tied, self.tied_after_weights = tied.stage_copy(model, cfg, ctx), False
        # A weight two chunks share (ZB-V's tied embedding: rank 0's chunk 0 embeds, its chunk 1 is the head) is
        # complete only after both chunks' backwards, so no chunk's last W reduces it: reduce_gradients does, once.
        held = Counter(id(p) for chunk in self.chunks for p in chunk.parameters())
        self.shared = {i for i, n in held.items() if n > 1}
        # Expert-parallel weights: reduced over the expert-dp group (reduce_expert_gradients), never in dp buckets
        self.experts = {id(p) for _, p in expert_parameters(model)}
        self._build_optimizer()

    def forward(self, x, chunk: int = 0, **kwargs):
        if not self.ddps:  # dp 1
            with self.autocast():
                return self.chunks[chunk](x, **kwargs)
        with self.ddps[chunk].no_sync(), self.autocast():  # the reducer is armed in before_backward, not here
            return self.ddps[chunk](x, **kwargs)

    def before_backward(self, is_last: bool, chunk: int = 0) -> None:
        if is_last and self.ddps:
            # DDP arms its reducer in forward when sync is on; here it is armed for this backward alone. With
            # find_unused_parameters off the outputs are not searched, so none are passed.
            private(self.ddps[chunk], "torch", "reducer").prepare_for_backward([])
            self.armed.add(chunk)
            self.syncing = True

    def backward(self, output: torch.Tensor, grad: torch.Tensor | None) -> None:
        """A backward whose reducer is armed runs DDP's own gradient all-reduces (and waits for them at its end):
        logged as one operation (engine/trust/oplog.py), from the backward's start."""
        if not self.syncing:
            return super().backward(output, grad)
        self.syncing = False
        with oplog.logged("all-reduce", self.ctx.grad_group, "grad sync"):
            super().backward(output, grad)

    def last_weight(self, store, key, chunk: int = 0) -> None:
        """Chunk ``chunk``'s last W, reducing its buckets as they complete: the parameters W does not add to
        finished in B (norms, embedding) and are ready at once; the others as W adds their last gradient. Every
        dp rank runs the same W's in the same order, so the buckets launch alike (ReadyBuckets keeps them in
        order regardless)."""
        if not self.ddps or not self.overlap_weight_reduction:
            store.flush(key)
            return
        params = [
            p
            for p in reversed(list(self.chunks[chunk].parameters()))  # DDP's order
            if p.requires_grad and id(p) not in self.experts
        ]
        if any(p is self.tied or id(p) in self.shared for p in params):
            params = [p for p in params if p is not self.tied and id(p) not in self.shared]
            self.tied_after_weights = True
        buckets = ReadyBuckets(params, self.ctx.grad_group, self.cfg.parallel.bucket_mb)
        queued = store.queued(key)
        buckets.ready(*(p for p in params if id(p) not in queued))
        store.flush(key, done=buckets.ready)
        self.launched.append(buckets)
        self.armed.add(chunk)

    def reduce_gradients(self) -> None:
        """Finish the reductions the W's started, then average over dp the gradients of every chunk whose
        reducer did not run in this step's backward (and the tied copy, after its sum over the embedding group)."""
        for buckets in self.launched:
            buckets.wait()
        later = [self.tied] if self.tied is not None else []
        later += [p for chunk in self.chunks for p in chunk.parameters() if id(p) in self.shared]
        by_id = {id(p): p.grad for p in later if self.tied_after_weights and p.grad is not None}
        for chunk, ddp in enumerate(self.ddps):
            if chunk not in self.armed and self.ctx.grad_size > 1:
                by_id |= {id(p): p.grad for p in ddp.module.parameters() if p.grad is not None}
        # keyed by parameter: a weight two chunks share is reduced once, not per chunk; experts below
        grads = [g for key, g in by_id.items() if key not in self.experts]
        if grads:
            all_reduce_mean(grads, self.ctx.grad_group, self.cfg.parallel.bucket_mb)
        reduce_expert_gradients(self.module, self.ctx)
        self.armed.clear()
        self.launched.clear()
        self.tied_after_weights = False

    def skip(self) -> None:
        for buckets in self.launched:  # launched collectives must still complete, on every dp rank alike
            buckets.wait()
        self.armed.clear()
        self.launched.clear()
        self.tied_after_weights = False
        super().skip()

    def checkpoint_state(self):
        return TorchState(self.module, self.optimizer, self.ctx, fsdp=False)
