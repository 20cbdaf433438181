"""Context-parallel modes: one ``CpModeSpec`` per ``parallel.cp_mode``, registered in ``CP_MODES`` (the config's
choices, in the order the planner's search tries them). The layout checks (engine/parallel/layout/checks.py), the
model (engine/parallel/cp/apply.py swaps in the mode's attention core, named here, its class there) and the planner
(its communication model, engine/planning/cp.py, and what its core saves, engine/planning/activations.py) ask the
spec; none compares a mode's name. No torch: the config checks read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.errors import ConfigError


@dataclass(frozen=True)
class CpModeSpec:
    """One cp mode. ``core``: the name of its attention core class (engine/model/attention.py AttentionCore; built as
    ``core(group, cp)``), which engine/parallel/cp/apply.py ``core_class`` resolves. ``planner``: the name of its
    planner model class (the bytes it moves a layer and their exposed time), which engine/planning/cp.py ``model_class``
    resolves. Names, not engine paths: this floor imports nothing above it. ``check``: its refusals of a config with cp
    > 1 (ConfigError, world-size free). The activation ledger: ``masks_from_doc_ids`` (the core masks each block from
    the (b, s) document ids, so no (b, 1, s, s) mask is kept), ``saves_own_attention`` (the core saves its own q, k, v,
    output and lse, whatever the kernel path), ``reorder_indices`` ((s,) int64 token-order indices a layer keeps without
    activation checkpointing)."""

    name: str
    core: str
    planner: str
    check: Callable[[object], None] | None = None
    masks_from_doc_ids: bool = False
    saves_own_attention: bool = False
    reorder_indices: int = 0


def check_heads_split(cfg) -> None:
    """all_to_all: each cp rank takes num_heads / (cp tp) whole heads, and as many kv heads (no kv replication)."""
    p, m = cfg.parallel, cfg.model
    if m.num_heads % (p.cp * p.tp) or m.num_kv_heads % (p.cp * p.tp):
        raise ConfigError(
            f"parallel.cp_mode={p.cp_mode} needs model.num_heads={m.num_heads} and model.num_kv_heads="
            f"{m.num_kv_heads} divisible by cp * tp = {p.cp} * {p.tp} = {p.cp * p.tp}; use "
            f"cp_mode=ring or a smaller cp"
        )


CP_MODES: dict[str, CpModeSpec] = {
    s.name: s
    for s in (  # parallel.cp_mode -> its CpModeSpec
        # Ring Attention (Liu et al. 2023): K/V blocks rotate around the cp group, online softmax (cp/ring.py)
        CpModeSpec(
            "ring",
            "RingCore",
            "RingModel",
            masks_from_doc_ids=True,
            saves_own_attention=True,
        ),
        # DeepSpeed Ulysses (Jacobs et al. 2023): sequence <-> heads all-to-all around attention (cp/ulysses.py); the
        # q, k, v and output token reorders keep 4 index vectors a layer (index_select saves them, cp/layout.py)
        CpModeSpec(
            "all_to_all",
            "UlyssesCore",
            "AllToAllModel",
            check=check_heads_split,
            reorder_indices=4,
        ),
    )
}
