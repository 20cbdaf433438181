"""Mixture of experts under context parallelism, and ep carved from dp x cp (issue 26; engine/parallel/cp/moe.py,
engine/parallel/ep/, engine/parallel/layout/mesh.py split_along):

- one MoE block on cp = 2 ranks, each given its head/tail chunks of every row (engine/parallel/cp/layout.py), equals
  the block on the whole micro-batch: outputs, the recorded aux and z losses (averaged over cp) and tokens per
  expert (summed), and every gradient with the trainer's average over the cp ranks. Routing ties included: the
  router ranks each token's own logits, so the layout cannot change it. Fails if the counts are not summed over cp
  or f is normalised by the rank's T/cp tokens instead of the micro-batch's T;
- the engine at cp 2 (ring, all_to_all) with ep 1 and ep 2 (dp 1: ep carved from cp alone) equals one process
  (tests/parity/runner.py fp32 bounds), the reported MoE metrics included. Fails if expert gradients are divided
  by dp instead of dp x cp;
- a checkpoint at ep 2 (dp 1, cp 2) resumed at ep 1 (cp 2) and then on one process continues the uninterrupted run;
- capacity with cp is refused in one line, and ep must divide dp x cp.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.config import ConfigError, ModelConfig, load
from engine.model import moe
from engine.parallel.cp import layout
from engine.parallel.cp.moe import MicroBatchCounts
from engine.parallel.layout.checks import Layout, resolve_layout
from engine.parallel.layout.mesh import Mesh
from tests.dist import run_ranks
from tests.parity import runner
from tests.references import one_process

CP, B, S, H = 2, 2, 16, 8


def _block(tied: bool) -> moe.MoE:
    m = ModelConfig(
        family="mixtral",
        hidden_size=H,
        intermediate_size=12,
        num_heads=2,
        num_kv_heads=2,
        num_experts=4,
        experts_per_token=2,
    )
    torch.manual_seed(0)
    block = moe.MoE(m).double().train()
    for p in block.parameters():
        torch.nn.init.normal_(p)
    if tied:  # experts 1 and 2 get equal logits for every token: every tie goes to expert 1
        with torch.no_grad():
            block.gate.weight[2] = block.gate.weight[1]
    block.aux_coef, block.z_coef = 0.5, 0.1  # large, so that a wrong aux or z moves the gradients visibly
    return block


def _run(block: moe.MoE, x: torch.Tensor) -> dict:
    """Forward and backward of a per-token stand-in for the cross-entropy: its mean over the tokens given."""
    x = x.clone().requires_grad_()
    out = block(x)
    (out * torch.linspace(-1, 1, H, dtype=x.dtype)).sum(-1).mean().backward()
    r = block.records[-1]
    return {
        "out": out.detach(),
        "x": x.grad,
        "aux": r["aux"],
        "z": r["z"],
        "counts": r["counts"],
        "grads": {n: p.grad.clone() for n, p in block.named_parameters()},
    }


def _cp_block(tied: bool) -> dict:
    """Rank function (cp ranks): the worst differences from the whole micro-batch on one process."""
    rank = dist.get_rank()
    x = torch.randn(B, S, H, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = _run(_block(tied), x)
    block = _block(tied)
    block.micro_batch_counts = MicroBatchCounts(dist.group.WORLD, CP)
    got = _run(block, layout.take(x, S, CP, rank))
    for g in got["grads"].values():  # the trainer's gradient average over dp x cp
        dist.all_reduce(g)
        g.div_(CP)
    aux, z, counts = got["aux"].clone(), got["z"].clone(), got["counts"].clone()
    for t in (aux, z, counts):
        dist.all_reduce(t)
    return {
        "out": (got["out"] - layout.take(want["out"], S, CP, rank)).abs().max().item(),
        "x": (got["x"] / CP - layout.take(want["x"], S, CP, rank)).abs().max().item(),
        "grads": max((got["grads"][n] - g).abs().max().item() for n, g in want["grads"].items()),
        "aux": abs(aux.item() / CP / want["aux"].item() - 1),
        "z": abs(z.item() / CP / want["z"].item() - 1),
        "counts": counts.tolist() == want["counts"].tolist(),
        "ties": tied and _lower_wins(x),
    }


def _lower_wins(x: torch.Tensor) -> bool:
    """Every token routed to expert 2 also went to expert 1 (their logits tie), and some tokens were."""
    block = _block(True)
    _, idx = moe.route(block.gate(x.reshape(-1, H)), block.k, block.gating, block.norm_topk_prob)  # (T, k)
    two, one = (idx == 2).any(-1), (idx == 1).any(-1)
    return bool(two.any() and (one | ~two).all() and (one & ~two).any())


@pytest.mark.parametrize("tied", [False, True], ids=["distinct-logits", "tied-logits"])
def test_moe_block_on_cp_ranks_equals_the_whole_micro_batch(tied):
    # fp64 block: measured differences of outputs and gradients ~1e-15. The aux and z losses are computed in fp32
    # whatever the weights' dtype (engine/model/moe.py): measured relative error 6e-8, an fp32 rounding.
    for rank, got in enumerate(run_ranks(_cp_block, CP, tied, timeout_s=300)):
        assert got["counts"] and (got["ties"] or not tied), (rank, got)
        assert max(got[k] for k in ("out", "x", "grads")) < 1e-12 and max(got["aux"], got["z"]) < 1e-6, (rank, got)


def test_ep_is_carved_from_dp_x_cp_in_grad_rank_order():
    """dp 2 x cp 2 (pp 2, tp 2): the data ranks in dp-major order g = dp_rank * cp + cp_rank, ep 2 takes
    consecutive g: (dp 0, cp 0) with (dp 0, cp 1); expert-dp the same ep index: (dp 0, cp 0) with (dp 1, cp 0)."""
    mesh = Mesh(Layout(tp=2, pp=2, dp=2, cp=2).axes)
    ep, edp = mesh.split_groups(("dp", "cp"), 2)
    at = {(c["pp"], c["dp"], c["cp"], c["tp"]): r for r in range(16) for c in [mesh.coords(r)]}
    assert [at[0, 0, 0, 0], at[0, 0, 1, 0]] in ep and [at[0, 0, 0, 0], at[0, 1, 0, 0]] in edp
    assert len(ep) == len(edp) == 8 and all(len(g) == 2 for g in ep + edp)
    ep4, edp1 = mesh.split_groups(("dp", "cp"), 4)
    assert [at[1, d, c, 1] for d in range(2) for c in range(2)] in ep4 and edp1 == [[r] for r in range(16)]
    with pytest.raises(ValueError, match="3 does not divide the dp x cp size 4"):
        mesh.split_along(("dp", "cp"), 3, 0)


BASE = runner.MOE_BASE
CP_RUNS = [
    ["--parallel.cp", "2", "--parallel.cp_mode", "ring"],
    ["--parallel.cp", "2", "--parallel.cp_mode", "all_to_all", "--parallel.ep", "2"],
]


reference = one_process(BASE)


def _metrics_match(run: list[dict], reference: dict, offset: int = 0) -> None:
    """The reported MoE metrics of every rank equal one process's: aux and z within the loss bound, tokens per
    expert exactly."""
    for r in run:
        for got, want in zip(r["moe"], reference["moe"][offset:]):
            for key, value in want.items():
                bound = runner.FP32.loss * abs(value) if isinstance(value, float) else 0
                assert abs(got[key] - value) <= bound, (key, got[key], value)


def test_engine_at_cp_2_with_ep_equals_one_process(reference, tmp_path):
    for extra, run in zip(CP_RUNS, runner.run_layouts(2, BASE, CP_RUNS, tmp_path)):
        runner.assert_matches(run, reference, extra)
        _metrics_match(run, reference)


def test_resume_from_ep_2_over_cp_to_ep_1_matches_the_uninterrupted_run(reference, tmp_path):
    """Save every step at ep 2 (dp 1, cp 2: each rank writes its own experts), resume step 1 at ep 1 (cp 2: the
    experts replicated over cp, written once per expert-dp position), resume that run's step 2 on one process."""

    def hop(world, extra, name, resume):
        return runner.checkpointed_run(world, [*BASE, *extra], tmp_path, name, resume)

    cp2 = ["--parallel.cp", "2", "--parallel.cp_mode", "ring"]
    hop(2, [*cp2, "--parallel.ep", "2"], "a", "none")
    b = hop(2, cp2, "b", str(tmp_path / "a" / "step_000001"))
    c = hop(1, [], "c", str(tmp_path / "b" / "step_000002"))
    for run, offset in ((b, 1), (c, 2)):
        runner.assert_matches(run, reference, offset, offset)


@pytest.mark.parametrize(
    "extra,world,words",
    [
        (
            ["--parallel.cp", "2", "--model.moe_capacity_factor", "1.5"],
            2,
            "model.moe_capacity_factor=1.5 with parallel.cp=2 is not supported: capacity keeps",
        ),
        (["--parallel.cp", "2", "--parallel.ep", "2"], 2, None),
        (["--parallel.cp", "2", "--parallel.dp", "2", "--parallel.ep", "4"], 4, None),
        (["--parallel.cp", "2", "--parallel.ep", "4"], 2, "parallel.ep=4 must divide dp * cp = 1 * 2 = 2"),
    ],
)
def test_refusals_name_the_value(extra, world, words):
    try:
        resolve_layout(load([*BASE, *extra]), world)
    except ConfigError as e:
        assert words is not None and words in str(e) and "\n" not in str(e), str(e)
    else:
        assert words is None, f"accepted: {extra}"
