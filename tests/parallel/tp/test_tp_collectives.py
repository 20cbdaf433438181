"""Collectives per decoder layer under tensor parallelism, counted where they reach the process group.

One forward and one backward of one decoder layer at tp = 2 (GQA, Qwen2 q/k/v biases), every c10d collective
counted by launch/bench/tp_collectives.py (table d of the tp benchmark prints the same counts at tp 2 and 4).
Megatron's layout (Shoeybi et al. 2019, Sec. 3): forward one all-reduce after each row-parallel layer (o_proj,
down_proj) = 2; backward one all-reduce in front of each column-parallel GEMM. With q/k/v and gate/up each fused
into one GEMM (engine/model/fused.py) that is 2, where separate q, k, v, gate and up linears ran 5 (measured with
this test on the code before the fusion, commit c38bd66). Under full activation checkpointing backward also
recomputes o_proj's forward all-reduce: 3 (was 6, measured the same way). Not down_proj's: torch's non-reentrant
checkpoint stops recomputing once the last tensor backward needs (down_proj's input) is back, and nothing needs
the block's output.

With sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2; engine/parallel/autograd/comm.py): forward an all-gather
along the sequence in front of qkv_proj and gate_up_proj and a reduce-scatter after o_proj and down_proj (2 + 2).
Backward: the all-gather of the gradient for each reduce-scatter (2), each column layer's reduce-scatter of its
input gradient (2) and its all-gather of its (b, s/tp, h) input again for the weight gradient (2, it keeps only
the local chunk), and one all-reduce per norm weight (input_layernorm, post_attention_layernorm: copy_to_parallel,
inside backward) = 2 + 4 + 2. Full checkpointing recomputes the forward up to down_proj's input: both all-gathers
and o_proj's reduce-scatter, + 2 all-gathers + 1 reduce-scatter. Selective keeps o_proj's and down_proj's
reduce-scattered outputs (engine/parallel/autograd/comm.py sequence_reduced_linear): it recomputes the two
all-gathers and no reduce-scatter (it kept o_proj's partial sums and reduced them again: + 1, measured on the code
before).
"""

from __future__ import annotations

import pytest

from launch.bench.tp_collectives import count_layer
from tests.dist import run_ranks

ARGV = [
    "--model.num_layers",
    "1",
    "--model.family",
    "qwen2",
    "--model.attention_bias",
    "true",
    "--model.num_heads",
    "4",
    "--model.num_kv_heads",
    "2",
    "--model.hidden_size",
    "64",
    "--model.intermediate_size",
    "96",
    "--parallel.tp",
    "2",
    "--train.micro_batch_size",
    "2",
    "--train.global_batch_size",
    "2",
]
B, S, H = 2, 8, 64


@pytest.mark.parametrize(
    "sp,recompute,forward,backward",
    [
        (False, "none", {"all_reduce": 2}, {"all_reduce": 2}),
        (False, "full", {"all_reduce": 2}, {"all_reduce": 3}),
        (True, "none", {"all_gather": 2, "reduce_scatter": 2}, {"all_reduce": 2, "all_gather": 4, "reduce_scatter": 2}),
        (True, "full", {"all_gather": 2, "reduce_scatter": 2}, {"all_reduce": 2, "all_gather": 6, "reduce_scatter": 3}),
        (
            True,
            "selective",
            {"all_gather": 2, "reduce_scatter": 2},
            {"all_reduce": 2, "all_gather": 6, "reduce_scatter": 2},
        ),
    ],
)
def test_collectives_per_layer_at_tp2(sp, recompute, forward, backward):
    argv = ARGV + ["--parallel.sequence_parallel", str(sp).lower()]
    for rank, counts in enumerate(run_ranks(count_layer, 2, argv, recompute, S)):
        calls = {phase: {kind: got[0] for kind, got in kinds.items()} for phase, kinds in counts.items()}
        assert calls == {"forward": forward, "backward": backward}, f"rank {rank}: {calls}"
        # Every gather, scatter and activation all-reduce moves one full (b, s, h) fp32 buffer: none is skipped or
        # doubled in size. The norm weights' all-reduces move (h,) each.
        full = B * S * H * 4
        for phase, kinds in counts.items():
            for kind, (n, nbytes) in kinds.items():
                norms = 2 if sp and phase == "backward" and kind == "all_reduce" else 0
                assert nbytes == (n - norms) * full + norms * H * 4, f"rank {rank} {phase} {kind}: {nbytes} B"
