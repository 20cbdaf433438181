"""Zero-bubble pipeline schedule ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 3.1, Fig. 3 top).

The backward is split into B (input gradient: the previous stage waits for it) and W (weight gradient: nothing
waits for it). ZB-H1 "generally follows the 1F1B schedule, but it adjusts the starting points of W depending on
the number of warmup microbatches": stage s (of p) runs the W of micro-batch k after the B of micro-batch k + s,
so every stage holds p micro-batches until their W, the same peak as 1F1B's first stage, and the deferred W's
fill the cooldown. B reaches the first stage sooner (one B per hop instead of B+W), which cuts the bubble from
(p-1)(F+B+W) to (p-1)(F+B-W): a third of 1F1B's when F = B = W. The simulator finds this exact whenever
W <= min(F, B); a longer W no longer fits the gaps and the bubble lies between that and 1F1B's. This is
torch.distributed.pipelining's ZB1P (ScheduleInterleavedZeroBubble with one stage per rank:
num_1f1b_microbatches = rank).

Not here: ZB-H2 (Fig. 3 bottom: no bubble, but about twice 1F1B's activations and, to keep the optimizer step
out of the critical path, its post-update validation of Sec. 4). ZB-V (two chunks per rank placed in a V, r and
2p-1-r, unlike interleaving's r and r+p) is zbv.py.
"""

from __future__ import annotations

from collections import deque

from engine.parallel.pp.actions import Action, Op, backward_actions, forward_actions


def zb_h1(pp: int, micro_batches: int, stage: int) -> list[Action]:
    """The action list of `stage` (arguments checked by schedule.build; m >= pp as for 1F1B).

    Warmup: pp - stage - 1 forwards, as 1F1B. Steady: F, B, and from the (stage+1)-th step on the W of the oldest
    micro-batch still waiting for it. Cooldown: B then a deferred W. Finally the W's left over (stage of them).
    """
    warmup = min(pp - stage - 1, micro_batches)
    lag = pp - 1 - warmup  # = stage: W's deferred, so that warmup + 1 + lag = pp micro-batches are held
    waiting: deque[int] = deque()  # micro-batches whose B ran and W has not

    def backward(mb: int) -> list[Action]:
        waiting.append(mb)
        out = backward_actions(pp, stage, mb, op=Op.BWD_INPUT)
        if len(waiting) > lag:
            out.append(Action(Op.BWD_WEIGHT, waiting.popleft()))
        return out

    actions: list[Action] = []
    # Warmup Phase: fill the pipeline.
    for mb in range(warmup):
        actions += forward_actions(pp, stage, mb)
    # Steady State Phase: one forward, one input-gradient backward, and a W once `lag` of them wait.
    for i in range(micro_batches - warmup):
        actions += forward_actions(pp, stage, warmup + i)
        actions += backward(i)
    # Cooldown Phase: drain the B's of the warmup's micro-batches, each followed by a deferred W.
    for mb in range(micro_batches - warmup, micro_batches):
        actions += backward(mb)
    # The W's still deferred: later stages finish their B's first and fill the time the earlier ones still need.
    actions += [Action(Op.BWD_WEIGHT, mb) for mb in waiting]
    return actions
