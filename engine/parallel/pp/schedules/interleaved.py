"""Interleaved 1F1B with virtual stages (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
GPU Clusters Using Megatron-LM", Sec. 2.2.2, Fig. 4 bottom), in the order of Megatron-LM's
`forward_backward_pipelining_with_interleaving` (megatron/core/pipeline_parallel/schedules.py).

Each rank holds v model chunks (rank r: chunks r, r+pp, ..., see engine/parallel/pp/actions.py). Forwards run in
groups of pp micro-batches per chunk: the k-th forward on every rank is chunk (k // pp) % v of micro-batch
(k // (pp*v)) * pp + k % pp (Megatron's schedule table with microbatch_group_size_per_vp_stage = pp); the k-th
backward takes the same micro-batch in the mirrored chunk v-1-(k // pp) % v. With chunks 1/v the size of a
stage, the bubble shrinks by v: (p-1)/(v*m) of the ideal time instead of (p-1)/m (Narayanan et al., Sec. 2.2.2).
Like Megatron, m must be a multiple of pp (its remainder group would leave the pipeline waiting).
"""

from __future__ import annotations

from engine.parallel.pp.actions import Action, Op, peer


def interleaved_order(pp: int, micro_batches: int, v: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of the k-th forward, the same on every rank: groups of pp micro-batches, each group
    run through chunk 0, then chunk 1, ..., then the next group. Example pp=2, m=4, v=2:
    (0,0) (1,0) (0,1) (1,1) (2,0) (3,0) (2,1) (3,1)."""
    return [(group + i, chunk) for group in range(0, micro_batches, pp) for chunk in range(v) for i in range(pp)]


def interleaved_warmup(pp: int, micro_batches: int, stage: int, v: int) -> int:
    """Forwards before the first backward (Megatron's num_warmup_microbatches): (v-1)*pp to fill every chunk but
    the last, plus 2 per stage after this one (a forward there and the backward coming back), capped at m*v."""
    return min((pp - stage - 1) * 2 + (v - 1) * pp, micro_batches * v)


def _comm(pp: int, stage: int, v: int, sends: list[Action], recvs: list[Action]) -> list[Action]:
    """One batch of Megatron's p2p_communication: the sends of what was just computed, then the receives for what
    comes next, dropping those with no peer (virtual stage 0 receives no forward, the last sends none, ...). The
    order is fixed (sends, then receives; forward before backward in each) on every rank: at pp = 2 both
    neighbours are one rank and one channel, where NCCL matches in posting order."""
    return [a for a in sends + recvs if peer(pp, v, stage, a) is not None]


def interleaved_1f1b(pp: int, micro_batches: int, stage: int, v: int) -> list[Action]:
    """The action list of rank `stage` (arguments checked by schedule.build). Peak activations held: warmup + 1
    chunk micro-batches (Megatron's max_outstanding_backprops), each 1/v of a stage's.

    Communication is placed as in Megatron's forward_backward_pipelining_with_interleaving (no overlap_p2p_comm):
    each compute step ends in ONE batch that sends what it computed and receives the input of the rank's next
    forward and/or the output gradient of its next backward (send_forward_recv_forward in the warmup,
    send_forward_backward_recv_forward_backward in the steady state and at the warmup's end,
    send_backward_recv_backward in the cooldown), and the first forward's input is received before the warmup.
    Then batch t of rank r meets batch t+1 of rank r+1 in both directions, so NCCL's rendezvous sends and
    in-order batches cannot deadlock it (issue 24: posting each receive right before its compute and each send
    right after it deadlocks at m >= 2pp, the simulator shows). The compute order is unchanged by the placement.
    """
    order = interleaved_order(pp, micro_batches, v)
    total = len(order)  # m * v forwards and as many backwards
    warmup = interleaved_warmup(pp, micro_batches, stage, v)

    def fwd(k: int, op: Op) -> list[Action]:  # FWD, SEND_FWD or RECV_FWD of the k-th forward (none past the end)
        return [Action(op, order[k][0], order[k][1])] if k < total else []

    def bwd(k: int, op: Op) -> list[Action]:  # BWD, SEND_BWD or RECV_BWD of the k-th backward: mirrored chunk
        return [Action(op, order[k][0], v - 1 - order[k][1])] if k < total else []

    def comm(sends: list[Action], recvs: list[Action]) -> list[Action]:
        return _comm(pp, stage, v, sends, recvs)

    actions = comm([], fwd(0, Op.RECV_FWD))
    # Warmup Phase: forwards until the first backward can come back (never none: warmup >= (v-1)*pp >= pp); the
    # last one's batch also receives that backward's gradient.
    for k in range(warmup):
        first_grad = bwd(0, Op.RECV_BWD) if k == warmup - 1 else []
        actions += fwd(k, Op.FWD) + comm(fwd(k, Op.SEND_FWD), fwd(k + 1, Op.RECV_FWD) + first_grad)
    # Steady State Phase: one forward, one backward (the oldest micro-batch in the mirrored chunk), one batch.
    for k in range(total - warmup):
        f = warmup + k
        actions += fwd(f, Op.FWD) + bwd(k, Op.BWD)
        actions += comm(fwd(f, Op.SEND_FWD) + bwd(k, Op.SEND_BWD), fwd(f + 1, Op.RECV_FWD) + bwd(k + 1, Op.RECV_BWD))
    # Cooldown Phase: the remaining backwards.
    for k in range(total - warmup, total):
        actions += bwd(k, Op.BWD) + comm(bwd(k, Op.SEND_BWD), bwd(k + 1, Op.RECV_BWD))
    return actions
