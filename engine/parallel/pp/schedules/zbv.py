"""Zero-bubble pipeline schedule ZB-V (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 6), in the order
of torch.distributed.pipelining's ScheduleZBVZeroBubble.

Each rank holds 2 model chunks placed in a V (engine/parallel/pp/actions.py): rank r runs virtual stages r (chunk 0)
and 2p-1-r (chunk 1), so a micro-batch goes down the ranks on chunk 0, turns on rank p-1 (a local hand-off) and
comes back up on chunk 1 to rank 0, which holds the embedding and the loss. The backward is split into B (input
gradient) and W (weight gradient) as in ZB-H1 (zero_bubble.py). Every rank holds at most 2p chunk micro-batches
of half a stage each: 1F1B's peak (p stage micro-batches, on its first stage). With F = B = W per chunk this order
leaves each rank idle (p-1) F (rank r starts r late and ends p-1-r early; simulated,
tests/parallel/pp/zbv/test_schedule_zbv.py):
half of ZB-H1's (p-1)(F+B-W) on stages of twice the chunk; torch: zero bubble "only if time forward == time
backward input == time backward weights", and other ratios leave more.

Compute order (torch's ``_calculate_single_rank_operations``, with n = max(2p-1, m) and micro-batches >= m then
dropped; torch pads rank r with r idle slots first): rank r runs 2(p-r)-1 forwards of chunk 0, then r pairs
(F chunk 1, F chunk 0), then p-r (F, B, W) of chunk 1; the steady state repeats F0 B0 W0 F1 B1 W1 (the F0 while
chunk 0 has forwards left); the cooldown runs r pairs (B0, B1), p-r pairs (B0, W0), then the W's of chunk 1 and
those of chunk 0 left over.

Communication is placed from a run of that order (zbv below), not as the other tables place it (each receive
right before its compute, each send right after): in the V, channel r -> r+1 carries both chunk 0's forwards and
chunk 1's backward gradients, which that placement posts in different orders on the two ranks (and at m <= p it
deadlocks under rendezvous sends). The simulator (pp/simulator.py, NCCL's rules) finds the placed tables complete for
every pp and m that build() accepts (tests/parallel/pp/zbv/test_schedule_zbv.py,
tests/parallel/pp/test_schedule_deadlock.py).
"""

from __future__ import annotations

from engine.parallel.pp.actions import Action, Op, locate, peer, virtual_stage


def zbv_order(pp: int, micro_batches: int, rank: int) -> list[Action]:
    """The compute actions of `rank` (FWD, BWD_INPUT, BWD_WEIGHT; chunk 0 or 1), torch's ZBV order."""
    n = max(2 * pp - 1, micro_batches)  # the pipeline full for the V's warmup; extra micro-batches dropped below
    out: list[Action] = []
    f, b, w = [0, 0], [0, 0], [0, 0]  # next micro-batch to forward, to B, to W, per chunk

    def run(op: Op, chunk: int) -> None:
        count = {Op.FWD: f, Op.BWD_INPUT: b, Op.BWD_WEIGHT: w}[op]
        out.append(Action(op, count[chunk], chunk))
        count[chunk] += 1

    for _ in range(2 * (pp - rank) - 1):  # warmup: chunk 0 fills the way down
        run(Op.FWD, 0)
    for _ in range(rank):  # the turn's first micro-batches come back up on chunk 1
        run(Op.FWD, 1)
        run(Op.FWD, 0)
    for _ in range(pp - rank):
        run(Op.FWD, 1), run(Op.BWD_INPUT, 1), run(Op.BWD_WEIGHT, 1)
    while f[1] < f[0] or f[0] < n:  # steady state: F B W on each chunk
        if f[0] < n:
            run(Op.FWD, 0)
        run(Op.BWD_INPUT, 0), run(Op.BWD_WEIGHT, 0)
        run(Op.FWD, 1), run(Op.BWD_INPUT, 1), run(Op.BWD_WEIGHT, 1)
    for _ in range(rank):  # cooldown: B's first, the W's deferred into the drain
        run(Op.BWD_INPUT, 0), run(Op.BWD_INPUT, 1)
    for _ in range(pp - rank):
        run(Op.BWD_INPUT, 0), run(Op.BWD_WEIGHT, 0)
    while w[1] < b[1]:
        run(Op.BWD_WEIGHT, 1)
    while w[0] < b[0]:
        run(Op.BWD_WEIGHT, 0)
    return [a for a in out if a.mb < micro_batches]


def _producer(pp: int, rank: int, a: Action) -> tuple[int, Action] | None:
    """(rank, compute) whose result compute `a` of `rank` takes: the previous virtual stage's F for an F, the next
    one's B for a B; None on virtual stage 0's F, the last one's B, and for a W (it reads only its own rank)."""
    if a.op is Op.BWD_WEIGHT:
        return None
    g = virtual_stage(pp, rank, a.chunk, vshape=True) + (-1 if a.op is Op.FWD else 1)
    if not 0 <= g < 2 * pp:
        return None
    other, chunk = locate(pp, g, vshape=True)
    return other, Action(a.op, a.mb, chunk)


def _starts(pp: int, orders: list[list[Action]]) -> dict[tuple[int, Action], tuple[float, float]]:
    """(start, end) of every compute in a run with F = B = W = 1 and free, buffered messages: each rank takes its
    computes in order, each as soon as its input exists."""
    times: dict[tuple[int, Action], tuple[float, float]] = {}
    pos, clock = [0] * pp, [0.0] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                src = _producer(pp, r, a)
                if src is not None and src not in times:
                    break
                start = max(clock[r], times[src][1] if src else 0.0)
                times[(r, a)] = (start, start + 1.0)
                clock[r], pos[r], moved = start + 1.0, pos[r] + 1, True
    if any(p < len(o) for p, o in zip(pos, orders)):
        raise RuntimeError(f"ZB-V compute order does not complete at pp={pp}: ranks stopped at {pos}")
    return times


def zbv(pp: int, micro_batches: int, stage: int) -> list[Action]:
    """The action list of rank `stage` (arguments checked by schedule.build): zbv_order with its messages placed.

    Placement, from one run of every rank's compute order with unit costs and buffered messages (_starts): a
    send right after the compute producing it (at that compute's end t); its receive just before the receiver's
    first compute starting at or after t (never after the compute that needs it, which starts >= t). So every
    batch of every rank sits at one time of that run, each rank's batches are in time order, and on each
    channel the receiver posts in the sender's order (receives of one batch sorted by send time). The V's turn
    has no message (engine/parallel/pp/actions.py peer)."""
    orders = [zbv_order(pp, micro_batches, r) for r in range(pp)]
    times = _starts(pp, orders)
    mine = orders[stage]
    recvs: list[list[tuple[float, Action]]] = [[] for _ in range(len(mine) + 1)]
    starts = [times[(stage, a)][0] for a in mine]
    for a in mine:
        src = _producer(pp, stage, a)
        if src is None or src[0] == stage:  # nothing to receive, or the local hand-off at the turn
            continue
        sent = times[src][1]
        slot = next(i for i, t in enumerate(starts) if t >= sent)
        recvs[slot].append((sent, Action(Op.RECV_FWD if a.op is Op.FWD else Op.RECV_BWD, a.mb, a.chunk)))
    actions: list[Action] = []
    for i, a in enumerate(mine):
        actions += [r for _, r in sorted(recvs[i], key=lambda x: x[0])] + [a]
        send = Action(Op.SEND_FWD if a.op is Op.FWD else Op.SEND_BWD, a.mb, a.chunk)
        if a.op is not Op.BWD_WEIGHT and peer(pp, 2, stage, send, vshape=True) is not None:
            actions.append(send)
    return actions
