"""Activation recomputation modes: one ``RecomputeSpec`` per ``train.activation_checkpointing``, registered in
``RECOMPUTE`` (the config's choices, in the order the planner's search tries them; true/false are read as
full/none, engine/config.py VALUE_ALIASES). What each keeps and re-runs is engine/model/recompute.py's (the
policy: recompute_run.py); the planner's FLOPs (engine/model/flops.py), its activation ledger
(engine/planning/activations.py), the collectives it repeats (engine/planning/search.py, ep.py) ask the spec and
never compare the name. No torch: the config checks read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecomputeSpec:
    """One mode. ``recomputes``: backward re-runs the block's forward, its tp collectives and ep all-to-alls
    included (which are not GEMMs), and the planner counts the checkpointed ledger (the block's input kept per
    micro-batch, one layer rebuilt at a time). ``keeps_matmul_outputs``: the ledger also keeps the GEMM outputs
    (selective). FLOPs per token and layer (PaLM's hardware FLOPs) add one more forward of: the matmuls,
    2 N (``matmul_flops``; less a dense block's down_proj, which torch's checkpoint does not re-run:
    engine/model/flops.py recomputed_matmul_params), and of the attention core, 4 H Q T (``attention_flops``)."""

    name: str
    recomputes: bool = False
    keeps_matmul_outputs: bool = False
    matmul_flops: bool = False
    attention_flops: bool = False


RECOMPUTE: dict[str, RecomputeSpec] = {
    s.name: s
    for s in (  # train.activation_checkpointing -> its spec
        RecomputeSpec("none"),
        # Chen et al. 2016: keep each block's input, recompute the whole block in backward
        RecomputeSpec("full", recomputes=True, matmul_flops=True, attention_flops=True),
        # Korthikanti et al. 2022 Sec. 5 (op-level, as torchtitan): keep the matmul outputs, recompute the cheap rest
        RecomputeSpec("selective", recomputes=True, keeps_matmul_outputs=True, attention_flops=True),
    )
}
