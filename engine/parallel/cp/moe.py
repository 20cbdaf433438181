"""The micro-batch's expert counts for the MoE load-balancing loss under context parallelism (engine/model/moe.py
docstring): the Switch loss aux = E * sum_i f_i P_i (Fedus et al. 2021, eq. 4) needs f_i, the fraction of the
micro-batch's T tokens routed to expert i, while each cp rank routes only its T/cp tokens. The counts are summed over
the cp group in forward; they carry no gradient (argmax-like routing), so there is no backward exchange. P_i, the
mean router probability, stays each rank's own mean: linear in the tokens, its average over the cp ranks (what the
gradient average over dp x cp takes) is the micro-batch's.

The MoE layout is token-wise, so cp's head/tail chunk order (engine/parallel/cp/layout.py) does not matter to it:
routing ranks each token's own logits (a stable sort over experts), and the counts are sums over tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package


class MicroBatchCounts:
    """(counts (E,) of this rank's tokens, T/cp) -> (counts (E,) of the micro-batch, T): one all-reduce of E
    integers over the cp group per MoE layer and micro-batch (again when activation checkpointing recomputes the
    layer: every cp rank recomputes the same layers in the same order)."""

    def __init__(self, group, cp: int):
        self.group, self.cp = group, cp

    def __call__(self, counts: torch.Tensor, tokens: int) -> tuple[torch.Tensor, int]:
        total = counts.clone()
        with oplog.logged("all-reduce", self.group, "layer", total.numel() * total.element_size()):
            dist.all_reduce(total, group=self.group)
        return total, tokens * self.cp  # every cp rank holds s/cp of each row (cp/inputs.py): equal shares
