"""Context parallelism applied to a built stage: every Attention module's core (engine/model/attention.py
AttentionCore) swapped for one that attends across the cp group, by parallel.cp_mode. Applied in
engine/stage.py build_model after tensor parallelism (the core sees the tp-local heads) and before activation
checkpointing and compile (which then wrap the swapped core); docs/architecture.md, "The order in which
parallelism is applied". The rest of the model runs on its s/cp tokens unchanged: the trainer gives it the global
RoPE positions of those tokens and the whole sequence's document ids (engine/parallel/cp/inputs.py).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kinds.cp_modes import CP_MODES, CpModeSpec
from engine.model.attention import AttentionCore
from engine.model.moe import moe_blocks
from engine.parallel.cp import layout
from engine.parallel.cp.moe import MicroBatchCounts
from engine.parallel.cp.ulysses import UlyssesCore


class RingCore(AttentionCore):
    """cp_mode ring: engine/parallel/cp/ring.py ``ring_attention``, which takes the whole sequence's document ids
    (b, s) rather than a mask (it masks each K/V block as it arrives), so that is what ``mask`` builds."""

    def __init__(self, group, cp: int):
        from engine.parallel.cp.ring import ring_attention  # layout.checks.check_context_parallel: it exists

        self.ring_attention, self.group, self.cp = ring_attention, group, cp

    def mask(self, doc_ids: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        return doc_ids

    def __call__(self, q, k, v, doc_ids):
        seq_len = q.shape[2] * self.cp  # q (b, nh, L, hd), L = s/cp
        indices = layout.all_chunk_indices(seq_len, self.cp, q.device)  # (cp, L)
        return self.ring_attention(q, k, v, self.group, indices, doc_ids)


# The attention cores a CpModeSpec.core may name (engine/kinds/cp_modes.py): a new cp mode adds its class here.
CORES: dict[str, type[AttentionCore]] = {c.__name__: c for c in (RingCore, UlyssesCore)}


def core_class(spec: CpModeSpec) -> type[AttentionCore]:
    """The attention core class ``spec.core`` names."""
    if spec.core not in CORES:
        raise LookupError(f"cp mode {spec.name}: no attention core {spec.core!r} (one of {', '.join(CORES)})")
    return CORES[spec.core]


def apply_context_parallel(model: nn.Module, cp_mode: str, group, cp: int) -> None:
    """Give every attention module of ``model`` (a Llama or one of its stages) the cp core of ``cp_mode``, one
    object shared by the layers (decode asks the first layer's for the mask), and every MoE block the micro-batch's
    expert counts for its load-balancing loss (engine/parallel/cp/moe.py). cp 1: nothing changes."""
    if cp == 1:
        return
    core = core_class(CP_MODES[cp_mode])(group, cp)  # CpModeSpec.core (engine/kinds/cp_modes.py)
    for layer in model.model.layers.values():
        layer.self_attn.core = core
    for block in moe_blocks(model):
        block.micro_batch_counts = MicroBatchCounts(group, cp)
