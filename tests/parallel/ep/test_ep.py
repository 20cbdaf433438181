"""Expert parallelism (parallel.ep, engine/parallel/ep/):

- the all-to-all Function alone: rows reach the rank they are sent to with variable (and zero) split sizes, and
  backward sends each row's gradient back to where the row came from (the forward's splits swapped);
- ``ExpertParallelExperts`` on two ranks equals the whole ``Experts`` run on each rank's tokens, outputs and the
  gradients summed over the ranks, with a rank whose experts get no token;
- the engine at ep 2 and 4 (dp 2 and 4, pp 2 with activation checkpointing or zero bubble), under ddp and fsdp
  (experts: FSDP units over the expert-dp mesh), equals one process: loss with the aux and z losses, grad norm
  with clipping off (each expert counted once), every parameter (tests/parity/runner.py, fp32 bounds); also under
  zero bubble with DDP's exposed (not overlapped) reduction, whose all-reduce must leave the experts out;
- a checkpoint resumed across ep sizes 2 -> 1 -> 4 continues the uninterrupted single-process run, under ddp and
  across dp modes (fsdp ep 2 -> ddp ep 1 -> fsdp ep 4);
- what is not built is refused in one line.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.config import ConfigError, load
from engine.model.moe import Experts
from engine.parallel.dp.ddp import DDP
from engine.parallel.ep.dispatch import AllToAll, ExpertParallelExperts
from engine.parallel.layout.checks import resolve_layout
from tests.dist import run_ranks
from tests.parity import runner
from tests.references import one_process

H = 6


def _exchange() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = [(rank + 2 * q) % 3 for q in range(world)]  # rows to each rank: 0, 1 or 2 (some ranks send none)
    recvs = [(r + 2 * rank) % 3 for r in range(world)]
    # row j to rank q carries (source, destination, j)
    x = (
        torch.tensor(
            [[rank, q, j] + [0.5] * (H - 3) for q in range(world) for j in range(sends[q])], dtype=torch.float64
        )
        .reshape(-1, H)
        .requires_grad_()
    )
    out = AllToAll.apply(x, recvs, sends, dist.group.WORLD)
    (out * (2 * out.detach() + 1)).sum().backward()  # d/d(out) = 2 out + 1: each row's own values
    return {"out": out.detach(), "grad": x.grad, "x": x.detach(), "recvs": recvs}


def test_all_to_all_sends_rows_by_variable_splits_and_backward_returns_them():
    for rank, got in enumerate(run_ranks(_exchange, 3, timeout_s=300)):
        want = [[r, rank, j] for r in range(3) for j in range(got["recvs"][r])]
        assert got["out"][:, :3].tolist() == want, rank
        assert torch.equal(got["grad"], 2 * got["x"] + 1), rank  # the gradient of each row came back to it


def _experts(ep_counts: list[list[int]]) -> dict:
    """Rank r routes counts ep_counts[r] (E,) copies; returns EP and whole-experts outputs and gradients."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = Experts(4, H, 5, "mixtral").double()
    torch.nn.init.normal_(full.gate_up_proj)
    torch.nn.init.normal_(full.down_proj)
    counts = torch.tensor(ep_counts[rank])
    x = torch.randn(int(counts.sum()), H, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    part = Experts(2, H, 5, "mixtral").double()
    with torch.no_grad():
        part.gate_up_proj.copy_(full.gate_up_proj[2 * rank : 2 * rank + 2])
        part.down_proj.copy_(full.down_proj[2 * rank : 2 * rank + 2])
    part.__class__, part.ep_group, part.ep_size, part.first_expert = (
        ExpertParallelExperts,
        dist.group.WORLD,
        2,
        2 * rank,
    )
    xs = [x.clone().requires_grad_() for _ in range(2)]
    ys = [full(xs[0], counts), part(xs[1], counts)]
    for y in ys:
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    grads = [full.gate_up_proj.grad.clone(), full.down_proj.grad.clone()]
    for g in grads:
        dist.all_reduce(g)  # the whole experts' gradient summed over the ranks' tokens
    mine = [g[2 * rank : 2 * rank + 2] for g in grads]
    got = [torch.zeros_like(m) if p.grad is None else p.grad for m, p in zip(mine, (part.gate_up_proj, part.down_proj))]
    return {
        "y": (ys[0] - ys[1]).abs().max().item(),
        "x_grad": (xs[0].grad - xs[1].grad).abs().max().item(),
        "w_grad": max((a - b).abs().max().item() for a, b in zip(mine, got)),
    }


@pytest.mark.parametrize(
    "counts", [[[3, 0, 2, 5], [1, 4, 0, 2]], [[3, 2, 0, 0], [1, 4, 0, 0]]], ids=["uneven", "rank1-experts-idle"]
)
def test_expert_parallel_experts_equal_the_whole_experts(counts):
    for rank, got in enumerate(run_ranks(_experts, 2, counts, timeout_s=300)):
        assert got["y"] < 1e-12 and got["x_grad"] < 1e-12 and got["w_grad"] < 1e-12, (rank, got)


BASE = runner.MOE_BASE
FSDP = ["--parallel.dp_mode", "fsdp"]
EP_RUNS = {
    2: [
        ["--parallel.dp", "2", "--parallel.ep", "2"],
        # fsdp: expert-dp size 1 here, 2 at dp 4 x ep 2: an expert gradient averaged over expert-dp instead of
        # divided by dp is off by 2 in both
        [*FSDP, "--parallel.dp", "2", "--parallel.ep", "2"],
    ],
    4: [
        ["--parallel.dp", "4", "--parallel.ep", "2"],
        ["--parallel.dp", "4", "--parallel.ep", "4"],
        ["--parallel.pp", "2", "--parallel.dp", "2", "--parallel.ep", "2", "--train.activation_checkpointing", "true"],
        # zero bubble: no DDP reducer armed; the dp all-reduce after the last W must leave the experts out
        ["--parallel.pp", "2", "--parallel.dp", "2", "--parallel.ep", "2", "--parallel.schedule", "zero_bubble"],
        [*FSDP, "--parallel.dp", "4", "--parallel.ep", "2"],
        [*FSDP, "--parallel.dp", "4", "--parallel.ep", "4", "--parallel.reshard_after_forward", "false"],
        # fsdp under zero bubble: the expert units are reduce-scattered by hand after the last W
        [*FSDP, "--parallel.pp", "2", "--parallel.dp", "2", "--parallel.ep", "2", "--parallel.schedule", "zero_bubble"],
    ],
}
# resume hops: (world, dp mode args, dp, ep) saved every step, each hop resuming the previous hop's next step
HOPS = {
    "ddp": [(2, [], 2, 2), (2, [], 2, 1), (4, [], 4, 4)],
    "fsdp-ddp-fsdp": [(2, FSDP, 2, 2), (2, [], 2, 1), (4, FSDP, 4, 4)],
}


reference = one_process(BASE)


@pytest.mark.parametrize("world", sorted(EP_RUNS))
def test_engine_at_ep_equals_one_process(world, reference, tmp_path):
    for extra, run in zip(EP_RUNS[world], runner.run_layouts(world, BASE, EP_RUNS[world], tmp_path)):
        runner.assert_matches(run, reference, extra)


def test_zero_bubble_exposed_reduction_leaves_experts_out(reference, tmp_path, monkeypatch):
    """DDP's older zero-bubble path (overlap_weight_reduction off: every chunk's gradients all-reduced over dp in
    reduce_gradients, after the last W) must leave the expert weights out as the overlapped path does: at dp 2,
    ep 2 each dp rank holds other experts, so averaging them over dp would mix two experts' gradients."""
    monkeypatch.setattr(DDP, "overlap_weight_reduction", False)  # set before the ranks fork: they inherit it
    extra = ["--parallel.pp", "2", "--parallel.dp", "2", "--parallel.ep", "2", "--parallel.schedule", "zero_bubble"]
    runner.assert_matches(runner.run_layouts(4, BASE, [extra], tmp_path)[0], reference, extra)


@pytest.mark.parametrize("modes", sorted(HOPS))
def test_resume_across_ep_2_1_4_matches_the_uninterrupted_run(modes, reference, tmp_path):
    """Save every step at ep 2 (dp 2), resume step 1 at ep 1 (dp 2), resume that run's step 2 at ep 4 (dp 4); under
    ddp throughout, and across dp modes (fsdp -> ddp -> fsdp: expert shards over expert-dp read back as ddp's whole
    experts and resharded)."""
    runs, resume = [], "none"
    for i, (world, mode, dp, ep) in enumerate(HOPS[modes]):
        name = "abc"[i]
        runs.append(
            runner.checkpointed_run(
                world, [*BASE, *mode, "--parallel.dp", str(dp), "--parallel.ep", str(ep)], tmp_path, name, resume
            )
        )
        resume = str(tmp_path / name / f"step_{i + 1:06d}")
    for offset, run in enumerate(runs[1:], start=1):
        runner.assert_matches(run, reference, offset, offset)


@pytest.mark.parametrize(
    "extra,world,words",
    [
        (
            ["--model.family", "llama", "--model.num_experts", "0", "--parallel.ep", "2"],
            2,
            "parallel.ep=2 needs an MoE model",
        ),
        (["--parallel.ep", "4"], 2, "parallel.ep=4 must divide dp * cp = 2 * 1 = 2"),
        (["--parallel.ep", "3", "--model.num_experts", "6"], 3, None),
        (["--parallel.ep", "2", "--model.num_experts", "6"], 4, None),
        (["--parallel.ep", "4", "--model.num_experts", "6"], 4, "parallel.ep=4 must divide model.num_experts=6"),
        (["--parallel.ep", "2", "--parallel.dp_mode", "fsdp"], 2, None),  # tests/test_ep_fsdp.py
        (
            ["--parallel.ep", "2", "--parallel.dp_mode", "zero", "--parallel.zero_stage", "1"],
            2,
            "parallel.ep=2 with parallel.dp_mode=zero is not supported (DeepSpeed's flat buffers partition every "
            "parameter over the whole dp group, while the experts differ between ep ranks",
        ),
        (["--parallel.ep", "0"], 2, "parallel.ep=0"),
    ],
)
def test_refusals_name_the_value(extra, world, words):
    argv = [*BASE, "--train.global_batch_size", "24", *extra]
    try:
        resolve_layout(load(argv), world)
    except ConfigError as e:
        assert words is not None and words in str(e) and "\n" not in str(e), str(e)
    else:
        assert words is None, f"accepted: {extra}"
