"""Interleaved 1F1B with virtual stages (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Sec. 2.2.2, Fig. 4 bottom), in the order of Megatron-LM's
`forward_backward_pipelining_with_interleaving` (megatron/core/pipeline_parallel/schedules.py).

Each rank holds v model chunks (rank r: chunks r, r+pp, ..., see engine/parallel/actions.py). Forwards run in
groups of pp micro-batches per chunk: the k-th forward on every rank is chunk (k // pp) % v of micro-batch
(k // (pp*v)) * pp + k % pp (Megatron's schedule table with microbatch_group_size_per_vp_stage = pp); the k-th
backward takes the same micro-batch in the mirrored chunk v-1-(k // pp) % v. With chunks 1/v the size of a
stage, the bubble shrinks by v: (p-1)/(v*m) of the ideal time instead of (p-1)/m (Narayanan et al., Sec. 2.2.2).
Like Megatron, m must be a multiple of pp (its remainder group would leave the pipeline waiting).
"""
from __future__ import annotations

from engine.parallel.actions import Action, Op, backward_actions, forward_actions


def interleaved_order(pp: int, micro_batches: int, v: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of the k-th forward, the same on every rank: groups of pp micro-batches, each group
    run through chunk 0, then chunk 1, ..., then the next group. Example pp=2, m=4, v=2:
    (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1)."""
    return [(group + i, chunk) for group in range(0, micro_batches, pp) for chunk in range(v) for i in range(pp)]


def interleaved_warmup(pp: int, micro_batches: int, stage: int, v: int) -> int:
    """Forwards before the first backward (Megatron's num_warmup_microbatches): (v-1)*pp to fill every chunk but
    the last, plus 2 per stage after this one (a forward there and the backward coming back), capped at m*v."""
    return min((pp - stage - 1) * 2 + (v - 1) * pp, micro_batches * v)


def interleaved_1f1b(pp: int, micro_batches: int, stage: int, v: int) -> list[Action]:
    """The action list of rank `stage` (arguments checked by schedule.build). Peak activations held: warmup + 1
    chunk micro-batches (Megatron's max_outstanding_backprops), each 1/v of a stage's."""
    order = interleaved_order(pp, micro_batches, v)
    total = len(order)  # m * v forwards and as many backwards
    warmup = interleaved_warmup(pp, micro_batches, stage, v)

    def fwd(k: int) -> list[Action]:
        mb, chunk = order[k]
        return forward_actions(pp, stage, mb, chunk, v)

    def bwd(k: int) -> list[Action]:
        mb, chunk = order[k]
        return backward_actions(pp, stage, mb, v - 1 - chunk, v, Op.BWD)

    actions: list[Action] = []
    # Warmup Phase: forwards until the first backward can come back to this rank.
    for k in range(warmup):
        actions += fwd(k)
    # Steady State Phase: one forward, then one backward (of the oldest micro-batch in the mirrored chunk).
    for k in range(total - warmup):
        actions += fwd(warmup + k)
        actions += bwd(k)
    # Cooldown Phase: the remaining backwards.
    for k in range(total - warmup, total):
        actions += bwd(k)
    return actions
