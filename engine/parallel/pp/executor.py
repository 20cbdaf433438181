"""Pipeline parallelism: split the model into stages and run a schedule of micro-batches over them.

The schedule is data (engine/parallel/pp/schedule.py: 1F1B of Narayanan et al. 2021, GPipe of Huang et al. 2019);
``PipelineExecutor`` walks this stage's action list. Consecutive communication actions are posted together with
``dist.batch_isend_irecv`` (Megatron's send_forward_recv_backward pairing). A batch is waited whole (NCCL returns
one Work for it) when it holds a receive; a send-only batch is waited only at the step's end. Under NCCL a send
completes only once its receiver's batch has started and a rank's batches run in order, the rules under which
the simulator (simulator.py) proves the schedule deadlock-free and tests/nccl_shim.py runs the tests over gloo.
Once a stage's output has been sent, its storage is freed and only its autograd graph is kept (Megatron's
deallocate_output_tensor / custom_backward).

The same executor runs the interleaved schedule (each action names a model chunk; sends and receives go to the rank
holding the neighbouring virtual stage, engine/parallel/pp/virtual.py) and zero bubble (B runs the backward with every
linear's weight gradient deferred to a WeightGradStore, W flushes it; engine/parallel/autograd/weight_grad.py), and
ZB-V, whose two chunks per rank sit in a V: at its turn (virtual stage pp-1 to pp, both on rank pp-1) the output is
handed over on the rank, as a detached copy in the wire dtype, and so is its gradient coming back.

    python -m engine.parallel.pp.executor --pp 4 --micro-batches 8     # print every stage's timeline
"""

from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package
from engine.kinds.schedules import SCHEDULES
from engine.parallel.autograd.weight_grad import WeightGradStore, split_weight_gradients
from engine.parallel.pp import schedule as sched
from engine.parallel.pp.actions import Action, peer, steps, virtual_stage
from engine.parallel.pp.schedule import Op
from engine.parallel.pp.simulator import simulate_actions
from engine.parallel.pp.split import chunk_layer_ranges, stage_layer_ranges


def split_stage(
    model: nn.Module,
    pp: int,
    stage: int,
    counts: list[int] | None = None,
    virtual_stages: int = 1,
    vshape: bool = False,
) -> nn.Module:
    """Keep only this stage's part of a (meta-device) Llama, in place: its layers under their global names
    (``model.layers.7`` stays ``7``), the embedding on the first stage, the final norm and LM head on the last.
    ``counts``: layers per stage, or per virtual stage with virtual stages (None: the even split). With virtual
    stages the rank keeps the layers of each of its chunks, recorded as ``model.chunk_layers`` (one range per chunk,
    what engine/parallel/pp/virtual.py model_chunks runs); in ZB-V's V (``vshape``) the last virtual stage is on
    rank 0, which keeps the norm and LM head too."""
    if pp == 1:
        return model
    if virtual_stages > 1:
        ranges = chunk_layer_ranges(len(model.model.layers), pp, virtual_stages, vshape, counts)[stage]
        model.chunk_layers = ranges
        keep = [i for r in ranges for i in r]
    else:
        keep = stage_layer_ranges(len(model.model.layers), pp, counts)[stage]
    for name in list(model.model.layers.keys()):
        if int(name) not in keep:
            del model.model.layers[name]
    if stage != 0:
        model.model.embed_tokens = None
    if stage != (0 if vshape else pp - 1):
        model.model.norm = None
        model.lm_head = None
    return model


def _free_storage(t: torch.Tensor) -> None:
    """Drop a sent output's data but keep its grad_fn, so backward can still start from it."""
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


def backward_from(output: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Backward through a stage whose output storage may have been freed: the engine call skips the shape check
    that torch.autograd.backward would make against the freed output (Megatron's custom_backward)."""
    if grad is None:  # the last stage: output is the scalar loss
        output.backward()
        return
    Variable._execution_engine.run_backward((output,), (grad,), False, False, (), True, True)


def last_weights(actions: list[Action], schedule: str) -> dict[int, int]:
    """Chunk -> micro-batch of the chunk's last W in one rank's ``actions``: after it the chunk's gradients are
    complete, and the dp mode may reduce them while the other chunks' W's still run. A B of the chunk after that W
    would add to gradients already being reduced: refused. (For a whole table the simulator's per-micro-batch
    order, F then B then W, already implies it; this names the chunk and holds for any list the executor runs.)"""
    last = {a.chunk: a.mb for a in actions if a.op == Op.BWD_WEIGHT}
    for chunk, mb in last.items():
        at = actions.index(Action(Op.BWD_WEIGHT, mb, chunk))
        if any(a.op == Op.BWD_INPUT and a.chunk == chunk for a in actions[at:]):
            raise ValueError(f"schedule {schedule}: a B of chunk {chunk} follows its last W (W{mb})")
    return last


class PipelineExecutor:
    """Runs one step's schedule on this rank. ``forward`` (one per virtual stage, or one callable when v == 1)
    runs a micro-batch through that chunk; ``loss_fn(out, mb)`` turns the last virtual stage's output into that
    micro-batch's (already averaged) loss. A schedule that splits the backward (zero bubble) needs ``stage``, the
    rank's stage module: its linear layers are switched to defer their weight gradients to this executor's
    WeightGradStore (engine/parallel/autograd/weight_grad.py), which W flushes."""

    def __init__(
        self,
        ctx,
        schedule: str,
        micro_batches: int,
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype,
        forward_only: bool = False,
        virtual_stages: int = 1,
        stage: nn.Module | None = None,
        waiting=contextlib.nullcontext,
    ):
        spec = SCHEDULES[schedule]
        self.vshape = spec.vshape  # ZB-V: rank r runs virtual stages r and 2pp-1-r
        self.ctx, self.micro_batches, self.v = ctx, micro_batches, spec.per_rank(virtual_stages)
        if forward_only:  # evaluation: run() must then be called under torch.no_grad()
            self.actions = sched.forward_only(ctx.pp, micro_batches, ctx.pp_rank, self.v, self.vshape)
        else:
            # Every rank's list, simulated against each other before anything runs: at pp = 2 forward activations
            # and backward gradients share a shape and meet in posting order, so two ranks posting in different
            # orders would silently swap them (at pp > 2, hang). The simulator refuses such a table.
            ranks = [sched.build(schedule, ctx.pp, micro_batches, r, virtual_stages) for r in range(ctx.pp)]
            simulate_actions(ranks, schedule=schedule, vshape=self.vshape)
            self.actions = ranks[ctx.pp_rank]
        self.splits_weights = any(a.op == Op.BWD_WEIGHT for a in self.actions)
        self.weight_grads = None
        if self.splits_weights:
            if stage is None:
                raise ValueError(f"schedule {schedule} splits the backward: pass the stage module")
            self.weight_grads = WeightGradStore()
            split_weight_gradients(stage, self.weight_grads)
        # The last backward of each chunk, where the dp mode reduces that chunk's gradients. None at all when W's
        # follow the B's: then no backward completes a gradient, and the dp mode reduces after the step's last W.
        self.last_backward = {a.chunk: a.mb for a in self.actions if a.op == Op.BWD}
        self.last_weight = last_weights(self.actions, schedule)
        self.act_shape, self.act_dtype = act_shape, act_dtype
        # Time the last run() spent blocked on receives. It leaves out the idle tail after this stage's last
        # action, so the whole bubble is measured between barriers (launch/bench/pipeline.py).
        self.wait_s = 0.0
        self.waiting = waiting  # a context around each receive's wait: the trainer's pp_wait (CUDA events on CUDA)

    def _post(self, actions: list, state: dict) -> tuple[list, list]:
        """Post a run of consecutive comm actions as one batch; returns (the batch's Works, (action, tensor) per
        op). NCCL coalesces a batch into ONE Work, gloo returns one per op: the Works are never paired with the
        ops, only waited together. The peer of each op is the rank holding the neighbouring virtual stage (with
        v > 1 the last rank's chunk c sends on to rank 0's chunk c+1)."""
        ctx, ops, meta, ids = self.ctx, [], [], []
        for a in actions:
            other, group = ctx.stage_ranks[peer(ctx.pp, self.v, ctx.pp_rank, a, self.vshape)[0]], ctx.pp_group
            key = (a.mb, a.chunk)
            oplog.LOG.where = (a.op.value, a.mb, a.chunk)
            if a.op in (Op.RECV_FWD, Op.RECV_BWD):
                t = torch.empty(self.act_shape, dtype=self.act_dtype, device=ctx.device)
                if oplog.FAULT is not None and oplog.fault("wrong_peer"):  # test-only: a send that never comes
                    other, group = next(r for r in range(ctx.world_size) if r not in (other, ctx.rank)), None
                ops.append(dist.P2POp(dist.irecv, t, other, group))
            elif a.op == Op.SEND_FWD:
                # The wire dtype is fixed (act_dtype): under FSDP bf16 compute the output is bf16; .to() is a
                # no-op when the dtypes already agree.
                t = state["outputs"][key]
                ops.append(dist.P2POp(dist.isend, t.detach().to(self.act_dtype), other, ctx.pp_group))
            else:  # SEND_BWD
                t = state["inputs"].pop(key).grad.to(self.act_dtype)
                ops.append(dist.P2POp(dist.isend, t, other, ctx.pp_group))
            meta.append((a, t))
            kind = "recv" if a.op in (Op.RECV_FWD, Op.RECV_BWD) else "send"
            ids.append(oplog.begin(kind, group, "pipeline", t.numel() * t.element_size(), other))
        return list(dist.batch_isend_irecv(ops)), meta, ids

    def _complete(self, posted: tuple[list, list], state: dict) -> None:
        """A batch that holds a receive is waited whole (its sends too: under NCCL they are one Work); a send-only
        batch is kept pending. Sent outputs are freed once their batch has completed."""
        works, meta, ids = posted
        if any(a.op in (Op.RECV_FWD, Op.RECV_BWD) for a, _ in meta):
            start = time.perf_counter()
            with self.waiting():  # the trainer's pp_wait: on CUDA the stream's stall, measured by events
                for work in works:
                    work.wait()
            self.wait_s += time.perf_counter() - start
            for op in ids:
                oplog.end(op)
            for a, t in meta:
                if a.op == Op.RECV_FWD:
                    state["inputs"][(a.mb, a.chunk)] = t.requires_grad_()
                elif a.op == Op.RECV_BWD:
                    state["grads"][(a.mb, a.chunk)] = t
            self._sent(meta, state)
        else:
            state["pending"].append(posted)
        still = []
        for pending in state["pending"]:
            if all(work.is_completed() for work in pending[0]):
                self._sent(pending[1], state)
                for op in pending[2]:
                    oplog.end(op)
            else:
                still.append(pending)
        state["pending"] = still

    @staticmethod
    def _sent(meta: list, state: dict) -> None:
        """Free the storage of the outputs a completed batch sent (Megatron's deallocate_output_tensor): only
        their graph is needed, for the backward, which starts from the received gradient."""
        for a, _ in meta:
            if a.op == Op.SEND_FWD and (a.mb, a.chunk) in state["outputs"]:
                _free_storage(state["outputs"][(a.mb, a.chunk)])

    def _compute(
        self,
        a,
        state: dict,
        forwards: list,
        loss_fn,
        first_inputs,
        extra_inputs,
        before_backward,
        backward,
        last_weight=None,
    ) -> torch.Tensor | None:
        """Run one compute action; returns the micro-batch loss on the last virtual stage's forward."""
        key, ctx = (a.mb, a.chunk), self.ctx
        g = virtual_stage(ctx.pp, ctx.pp_rank, a.chunk, self.vshape)
        first, last = g == 0, g == ctx.pp * self.v - 1
        oplog.LOG.where = (a.op.value, a.mb, a.chunk)
        if a.op == Op.FWD:
            if oplog.FAULT is not None and oplog.fault("sleep_forward"):  # test-only: a rank stuck in its forward
                time.sleep(3600)
            x = first_inputs[a.mb] if first else state["inputs"][key]
            out = forwards[a.chunk](x, **(extra_inputs[a.mb] if extra_inputs else {}))
            loss = None
            if last:
                out = loss = loss_fn(out, a.mb)
            elif self.vshape and g == ctx.pp - 1:  # the V's turn: chunk 1 of this rank takes it, as if received
                state["inputs"][(a.mb, 1)] = out.detach().to(self.act_dtype).requires_grad_()
            state["outputs"][key] = out
            return loss
        if a.op == Op.BWD_WEIGHT:  # W: the weight gradients that mb's B left for later
            if last_weight is not None and self.last_weight[a.chunk] == a.mb:
                last_weight(self.weight_grads, key, a.chunk)  # the dp mode flushes and starts its reduction
            else:
                self.weight_grads.flush(key)
            return None
        if before_backward is not None:
            before_backward(a.mb, is_last=self.last_backward.get(a.chunk) == a.mb, chunk=a.chunk)
        # B under zero bubble: the input gradient now, each linear layer queueing its weight gradient for W
        deferring = self.weight_grads.defer(key) if a.op == Op.BWD_INPUT else contextlib.nullcontext()
        with deferring:
            (backward or backward_from)(state["outputs"].pop(key), state["grads"].pop(key, None))
        if self.vshape and g == ctx.pp:  # back through the V's turn: chunk 0's output gradient, as if received
            state["grads"][(a.mb, 0)] = state["inputs"].pop(key).grad.to(self.act_dtype)
        return None

    def run(
        self,
        forward,
        loss_fn,
        first_inputs: list[torch.Tensor] | None,
        before_backward=None,
        backward=None,
        extra_inputs: list[dict] | None = None,
        last_weight=None,
    ) -> torch.Tensor:
        """Run every action of this rank for one step. ``forward``: the forward of each virtual stage (a list),
        or one callable when v == 1. first_inputs: the token micro-batches (first stage).
        ``extra_inputs[mb]``: keyword arguments of every stage's forward for micro-batch mb (document masking's
        position and document ids), or None.
        ``before_backward(mb, is_last, chunk)`` is called before each backward (data parallelism syncs a chunk's
        gradients only in its last one). ``backward(output, grad)`` replaces the plain autograd backward of a
        micro-batch (grad is None on the last stage, where output is the loss): the dp mode's
        (DataParallel.backward). ``last_weight(store, key, chunk)`` replaces ``store.flush(key)`` for each chunk's
        last W (DataParallel.last_weight: flush, and start reducing the chunk's gradients). Returns the sum of the
        micro-batch losses on the last stage (a zero elsewhere), detached."""
        forwards = list(forward) if isinstance(forward, (list, tuple)) else [forward]
        state = {"inputs": {}, "outputs": {}, "grads": {}, "pending": []}
        self.wait_s = 0.0
        total = torch.zeros((), device=self.ctx.device)
        for step in steps(self.actions):  # a compute, or a batch of consecutive comm actions (one Work on NCCL)
            if isinstance(step, tuple):
                self._complete(self._post(list(step), state), state)
                continue
            loss = self._compute(
                step, state, forwards, loss_fn, first_inputs, extra_inputs, before_backward, backward, last_weight
            )
            if loss is not None:
                total += loss.detach()
        for works, meta, ids in state["pending"]:
            for work in works:
                work.wait()
            self._sent(meta, state)
            for op in ids:
                oplog.end(op)
        oplog.LOG.where = ("", -1, 0)  # outside the schedule: the step's reductions
        if self.weight_grads is not None and self.weight_grads.pending():
            raise RuntimeError(f"weight gradients left unflushed after the step: {self.weight_grads.pending()}")
        return total


if __name__ == "__main__":
    sched.main(sys.argv[1:])
