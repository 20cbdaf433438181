"""The MoE block under tensor parallelism (engine/parallel/tp/moe.py; issue 26, tp 2 x ep 2):

- one step of a tiny Mixtral, Qwen2-MoE (shared expert, a dense layer, q/k/v biases) and OLMoE (whole-projection
  q/k norms) on 2 tp ranks, with and without sequence parallelism, aux and z losses on: the loss and EVERY
  gradient equal the same model at tp 1 (each tp-sharded gradient equal to its block of the whole one, the
  router's and the other replicated ones whole on each rank). This is what fails when the experts' tp all-reduce
  comes after the gate weights (the router's gradient is then partial), when the sequence-parallel gather at the
  block's entry has the wrong backward, or when OLMoE's q/k norm misses its all-reduce;
- the engine at tp 2 x ep 2 (dp 2), saved each step, resumed at tp 1 ep 1 and at tp 2 ep 1, continues the
  uninterrupted single-process run (tests/parity/runner.py, fp32 bounds);
- an expert width tp does not divide is refused in one line.
"""

from __future__ import annotations

import pytest

from engine.config import ConfigError, load
from engine.parallel.layout.checks import resolve_layout
from tests.dist import run_ranks
from tests.parallel.tp.moe_step import FAMILIES, REL, _compare, _held
from tests.parity import runner
from tests.references import one_process


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_step_equals_tp1_in_loss_and_every_gradient(family, sp):
    for rank, errors in enumerate(run_ranks(_compare, 2, FAMILIES[family], sp, timeout_s=300)):
        worst = max(errors, key=errors.get)
        assert errors[worst] <= REL, (rank, worst, errors[worst])
        if family == "mixtral":  # the names compared include the router and each expert's pieces
            assert "model.layers.0.block_sparse_moe.gate.weight" in errors
            assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in errors


@pytest.mark.parametrize("family", list(FAMILIES))
def test_planner_counts_the_parameters_a_tp_rank_holds(family):
    for held, planned in run_ranks(_held, 2, FAMILIES[family], timeout_s=300):
        assert held == planned, family


BASE = runner.MOE_BASE
reference = one_process(BASE)


def test_resume_from_tp2_ep2_at_tp1_and_at_tp2_ep1_matches_the_uninterrupted_run(reference, tmp_path):
    """Save every step at tp 2 x ep 2 (dp 2); resume its step 1 at tp 1 (one process) and its step 2 at tp 2 ep 1."""

    def hop(world, extra, name, resume):
        return runner.checkpointed_run(world, [*BASE, *extra], tmp_path, name, resume)

    a = hop(
        4,
        ["--parallel.tp", "2", "--parallel.dp", "2", "--parallel.ep", "2", "--parallel.sequence_parallel", "true"],
        "a",
        "none",
    )
    b = hop(1, [], "b", str(tmp_path / "a" / "step_000001"))
    c = hop(2, ["--parallel.tp", "2"], "c", str(tmp_path / "a" / "step_000002"))
    for run, offset in ((a, 0), (b, 1), (c, 2)):
        runner.assert_matches(run, reference, offset, offset)


@pytest.mark.parametrize(
    "extra,words",
    [
        (["--model.moe_intermediate_size", "33"], "model.moe_intermediate_size=33 must be divisible by parallel.tp=2"),
        (
            ["--model.family", "qwen2_moe", "--model.moe_shared_expert_size", "17"],
            "model.moe_shared_expert_size=17 must be divisible by parallel.tp=2",
        ),
    ],
)
def test_an_expert_width_tp_does_not_divide_is_refused_in_one_line(extra, words):
    with pytest.raises(ConfigError) as e:
        resolve_layout(load([*BASE, "--parallel.tp", "2", *extra]), 2)
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)
