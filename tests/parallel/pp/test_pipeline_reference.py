"""Independent oracle: our PipelineExecutor against torch.distributed.pipelining on CPU/gloo.

In each of pp ranks the stage is built twice from the same config and seed (``build_model`` gives identical
weights). One copy runs our executor, the other ``PipelineStage`` driven by torch's schedule of the same name
(TORCH_SCHEDULES), on the same token batch cut into the same micro-batches. For two consecutive steps (so stale
state from a first run would show), every rank compares every parameter gradient and the last stage compares
the loss: fp32, rel err max|a-b|/max|b| <= 1e-5. At m = 4 and 8 the two agree bit for bit (dividing by a power
of two is exact, so scaling the loss before backward or the gradient after gives the same bits); m = 6 (inexact
scaling) differs by rounding, measured <= 8.3e-7 on gradients (every schedule here), 0 on the loss.

The schedules with more than 1F1B's structure:
- interleaved (v = 2) against ``ScheduleInterleaved1F1B``: both sides run the chunks of engine/parallel/pp/virtual.py
  (``model_chunks``), torch with one ``PipelineStage`` per chunk (stage_index = chunk*pp + rank, num_stages =
  pp*v). 8 layers at pp = 4 (one per virtual stage), 4 at pp = 2.
- zero_bubble (our ZB-H1) against ``ScheduleInterleavedZeroBubble`` with one stage per rank: torch's ZB1P, whose
  W lag is num_1f1b_microbatches = rank, as ours. torch splits B and W on the autograd graph
  (stage_backward_input / stage_backward_weight); ours splits every linear (engine/parallel/autograd/weight_grad.py), so
  the two splits are independent implementations.
- zbv against ``ScheduleZBVZeroBubble``: both sides run ZB-V's chunks in a V (virtual stages rank and 2pp-1-rank,
  torch's "v" stage-to-rank map), so the loss is on rank 0; our turn is a local hand-off, torch's a stage-to-stage
  copy on the same rank. m = 2 is below torch's 2pp-1 warmup (it drops the missing micro-batches, as we do).
- Equal gradients do not show that both ran the same order (any order that runs each F, B, W once sums the same
  terms), so each rank also compares its compute order with the one torch's schedule computed (its
  ``pipeline_order``), and test_compute_order_matches_torch compares many (pp, v, m) without ranks. torch's
  constraint: m % max(1, m // pp) == 0 (ours is stricter for interleaved: m a multiple of pp).
- Nor do they show that B deferred anything: a B that computes every weight gradient itself, and W's that flush
  nothing, give the same numbers. A spy on our WeightGradStore checks that each W flushed the weight gradients of
  all the stage's linears (count_deferred).

Making the two comparable:
- Loss scaling. Our loss_fn returns each micro-batch's mean cross-entropy divided by the number of micro-batches
  (as Trainer.forward_backward does), so gradients accumulate to those of the mean. torch's schedules take an
  unscaled loss_fn and, with ``scale_grads=True`` (the default), divide every parameter gradient by
  ``n_microbatches`` after the last backward (``_PipelineStageBase.perform_reduce_grad``). The step's loss is our
  summed return value on one side, the mean of torch's per-micro-batch ``losses`` on the other.
- Metadata. ``PipelineStage`` gets ``input_args``/``output_args`` examples, so it runs in static mode (no extra
  metadata forward/backward): token ids (mbs, s) int64 on the first stage, hidden states (mbs, s, h) elsewhere;
  hidden states out, logits (mbs, s, V) on the last stage. The examples need ``requires_grad=True`` where the
  real tensors have it: torch derives from that flag whether an input is received as a grad-requiring leaf and
  whether gradient buffers are exchanged (with plain ``torch.empty`` examples the first stage's backward fails,
  "Failed to run stage backward ... Output gradient: ('None',)").
- Inputs. ``step`` splits the whole batch along dim 0 into equal micro-batches; we pass contiguous tensors.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining import (  # noqa: E402
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from engine.config import load  # noqa: E402
from engine.kinds.schedules import SCHEDULES  # noqa: E402
from engine.parallel.layout.context import ParallelContext  # noqa: E402
from engine.parallel.pp import schedule as sched  # noqa: E402
from engine.parallel.pp.actions import COMPUTE_OPS, Op, virtual_stage  # noqa: E402
from engine.parallel.pp.executor import PipelineExecutor  # noqa: E402
from engine.parallel.pp.virtual import model_chunks  # noqa: E402
from engine.parallel.tp.layers import vocab_parallel_cross_entropy  # noqa: E402
from engine.trainer import build_model  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.numerics import rel_err
from tests.shrunk import SHRUNK  # noqa: E402

REL = 1e-5
MBS, STEPS = 2, 2
SMALL = [
    "--config",
    "configs/tiny.yaml",
    *SHRUNK,
    "--model.num_layers",
    "4",
    "--model.vocab_size",
    "512",
    "--train.micro_batch_size",
    str(MBS),
]
TORCH_SCHEDULES = {
    "1f1b": Schedule1F1B,
    "gpipe": ScheduleGPipe,
    "interleaved": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
MULTI = {"interleaved": 2, "zero_bubble": 1, "zbv": 2}  # torch's multi-stage schedules (a list of stages): our v
CASES = [
    pytest.param(pp, name, m, 1, id=f"{name}-pp{pp}-m{m}")
    for pp in (2, 4)
    for name in ("1f1b", "gpipe")
    for m in (4, 6, 8)
]
# interleaved needs m a multiple of pp; m = pp at pp = 4 is the case where warmup takes every forward
CASES += [
    pytest.param(pp, name, m, MULTI[name], id=f"{name}-pp{pp}-m{m}")
    for name, cases in (
        ("interleaved", ((2, 4), (2, 6), (4, 4), (4, 8))),
        ("zero_bubble", ((2, 4), (2, 6), (4, 6), (4, 8))),
        ("zbv", ((2, 2), (2, 4), (2, 6), (4, 8))),
    )
    for pp, m in cases
]
TORCH_OP = {Op.FWD: "F", Op.BWD: "B", Op.BWD_INPUT: "I", Op.BWD_WEIGHT: "W"}  # torch's _ComputationType values


def torch_schedule(chunks: list, cfg, ctx, name: str, m: int):
    """torch's PipelineStage around each of our chunk modules (static metadata) and its schedule with the same
    loss. Chunk c of this rank is virtual stage c*pp + rank (zbv: in a V, rank and 2pp-1-rank); with v == 1 the
    chunk is the stage module."""
    s, h, vocab = cfg.train.seq_len, cfg.model.hidden_size, cfg.model.vocab_size
    n = ctx.pp * len(chunks)
    stages = []
    for c, module in enumerate(chunks):
        g = virtual_stage(ctx.pp, ctx.pp_rank, c, SCHEDULES[name].vshape)
        x = torch.zeros(MBS, s, dtype=torch.long) if g == 0 else torch.empty(MBS, s, h, requires_grad=True)
        y = torch.empty(MBS, s, vocab if g == n - 1 else h, requires_grad=True)
        stages.append(PipelineStage(module, g, n, ctx.device, input_args=x, output_args=y, group=ctx.pp_group))
    return TORCH_SCHEDULES[name](
        stages if name in MULTI else stages[0],
        m,
        loss_fn=lambda logits, target: vocab_parallel_cross_entropy(logits, target, ctx.tp_group),
        scale_grads=True,
    )


def compute_order(actions: list, pp: int, rank: int, vshape: bool = False) -> list[str]:
    """Our compute actions in torch's notation: "<virtual stage><F|B|I|W><micro-batch>"."""
    return [f"{virtual_stage(pp, rank, a.chunk, vshape)}{TORCH_OP[a.op]}{a.mb}" for a in actions if a.op in COMPUTE_OPS]


def torch_compute_order(actions: list) -> list[str]:
    """torch's pipeline_order of one rank (None: a bubble it inserted) in the same notation."""
    return [f"{a.stage_index}{a.computation_type.value}{a.microbatch_index}" for a in actions if a is not None]


def count_deferred(store, counts: list[int]) -> None:
    """Spy on W: before each flush, record how many weight gradients B deferred under its key. Equal numbers
    would also come from a B that computed every weight gradient itself and W's that flush nothing."""
    flush = store.flush

    def counted(key):
        counts.append(store.pending().get(key, 0))
        flush(key)

    store.flush = counted


def compare_on_rank(pp: int, name: str, m: int, v: int) -> dict:
    """Rank function: one step-pair per batch; returns per step the loss of each side and each gradient's error,
    and for torch's multi-stage schedules both compute orders of this rank."""
    cfg = load(
        [
            *SMALL,
            "--model.num_layers",
            str(max(4, pp * v)),
            "--parallel.pp",
            str(pp),
            "--parallel.schedule",
            name,
            "--parallel.virtual_stages",
            str(v),
            "--train.global_batch_size",
            str(m * MBS),
        ]
    )
    ctx = ParallelContext.from_config(cfg)
    ours, theirs = build_model(cfg, ctx), build_model(cfg, ctx)
    same_init = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    executor = PipelineExecutor(
        ctx, name, m, (MBS, cfg.train.seq_len, cfg.model.hidden_size), torch.float32, virtual_stages=v, stage=ours
    )
    vshape = SCHEDULES[name].vshape  # zbv: rank 0 holds the first and the last virtual stage
    loss_here = virtual_stage(pp, ctx.pp_rank, v - 1, vshape) == pp * v - 1
    forwards = model_chunks(ours, pp, ctx.pp_rank, v, vshape)
    schedule = torch_schedule(model_chunks(theirs, pp, ctx.pp_rank, v, vshape), cfg, ctx, name, m)
    deferred: list[int] = []
    linears = 0
    if executor.weight_grads is not None:
        count_deferred(executor.weight_grads, deferred)
        linears = sum(getattr(mod, "weight_grad_store", None) is executor.weight_grads for mod in ours.modules())
    orders = None
    if name in MULTI:
        orders = (
            compute_order(executor.actions, pp, ctx.pp_rank, vshape),
            torch_compute_order(schedule.pipeline_order[ctx.pp_rank]),
        )
    gen = torch.Generator().manual_seed(cfg.train.seed)
    steps = []
    for _ in range(STEPS):
        batch = torch.randint(0, cfg.model.vocab_size, (m * MBS, cfg.train.seq_len + 1), generator=gen)
        inputs, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()  # (m*mbs, s) each
        ys = labels.split(MBS)
        loss_ours = executor.run(
            forwards,
            lambda logits, mb: vocab_parallel_cross_entropy(logits, ys[mb], ctx.tp_group) / m,
            list(inputs.split(MBS)),
        )
        losses: list[torch.Tensor] = []
        schedule.step(
            *([inputs] if ctx.is_first_stage else []), **({"target": labels, "losses": losses} if loss_here else {})
        )
        grads = {
            n: rel_err(a.grad, b.grad) for (n, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters())
        }
        steps.append(
            {
                "loss": (loss_ours.item(), torch.stack(losses).mean().item()) if losses else None,
                "grads": grads,
                "deferred": deferred[:],
            }
        )
        deferred.clear()
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)
    return {
        "stage": ctx.pp_rank,
        "last": loss_here,
        "same_init": same_init,
        "steps": steps,
        "orders": orders,
        "linears": linears,
    }


@pytest.mark.parametrize("pp,name,m,v", CASES)
def test_executor_matches_torch_pipelining(pp, name, m, v):
    results = run_ranks(compare_on_rank, pp, pp, name, m, v)
    assert [r["stage"] for r in results] == list(range(pp))
    for r in results:
        stage = r["stage"]
        assert r["same_init"], f"stage {stage}: two build_model calls gave different weights"
        if name in MULTI:
            ours, theirs = r["orders"]
            assert ours == theirs, f"stage {stage}: our {name} order {ours} vs torch's {theirs}"
        for step, got in enumerate(r["steps"]):
            assert got["grads"], f"stage {stage} holds no parameters"
            # zero bubble: each of the m W's computed the weight gradients of every linear of the stage
            # zbv: each of the 2m W's those of its chunk, half of them (the LM head is not split)
            want = {"zero_bubble": [r["linears"]] * m, "zbv": [r["linears"] // 2] * (2 * m)}.get(name, [])
            assert r["linears"] or not want, f"stage {stage}: no linear layer defers its weight gradient"
            assert got["deferred"] == want, f"step {step} stage {stage}: gradients deferred per W {got['deferred']}"
            bad = {n: e for n, e in got["grads"].items() if not e <= REL}
            assert not bad, f"step {step} stage {stage}: gradients differ from torch's {name} (rel err): {bad}"
            if r["last"]:
                ours, theirs = got["loss"]
                assert abs(ours - theirs) <= REL * abs(theirs), f"step {step}: loss {ours} vs torch's {theirs}"
            else:
                assert got["loss"] is None


def torch_order_without_ranks(name: str, pp: int, v: int, m: int, rank: int) -> list[str]:
    """torch's compute order of one rank, computed as its constructor does but without stages or a process
    group: torch 2.13's private ``_calculate_single_rank_operations`` on a bare instance with the attributes its
    constructor sets. (Private: a torch upgrade that renames them fails here loudly, not silently.)"""
    schedule = object.__new__(TORCH_SCHEDULES[name])
    schedule.n_local_stages, schedule.pp_group_size, schedule._n_microbatches = v, pp, m
    schedule.number_of_rounds = max(1, m // pp)
    schedule.microbatches_per_round = m // schedule.number_of_rounds
    return torch_compute_order(schedule._calculate_single_rank_operations(rank))


ORDER_CASES = [("interleaved", pp, v, m) for pp in (2, 3, 4, 8) for v in (2, 3, 4) for m in (pp, 2 * pp, 3 * pp)]
ORDER_CASES += [
    ("zero_bubble", pp, 1, m) for pp in (2, 3, 4, 8) for m in range(pp, 3 * pp + 1) if m % max(1, m // pp) == 0
]  # torch's constraint on m (rounds of pp micro-batches)


def test_compute_order_matches_torch():
    """Every rank's F/B/I/W order equals torch's ScheduleInterleaved1F1B (Megatron's order) and
    ScheduleInterleavedZeroBubble with one stage per rank (ZB1P = our ZB-H1) over many (pp, v, m)."""
    for name, pp, v, m in ORDER_CASES:
        for rank in range(pp):
            ours = compute_order(sched.build(name, pp, m, rank, v), pp, rank)
            theirs = torch_order_without_ranks(name, pp, v, m, rank)
            assert ours == theirs, f"{name} pp={pp} v={v} m={m} rank {rank}: {ours} vs torch's {theirs}"
