"""What a dp mode declares about itself, so that the config checks, the layout checks, the planner and the checkpoints
ask the mode instead of comparing its name: one ``DpModeSpec`` per mode, registered in ``MODES``
(engine/parallel/dp/__init__.py). No torch here: the config checks read the specs before any process exists, so the
classes are named as "module:name" strings and imported only when used (``load``, engine/kinds/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.kinds.schedules import LAST_BACKWARD


@dataclass(frozen=True)
class DpModeSpec:
    """One dp mode: its code, its keys and checks, what it composes with, its planner model and checkpoint state.

    ``impl``: "module:class" of its engine.parallel.dp.base.DataParallel. ``state``: "module:class" of each
    checkpoint state class it hands out (engine.parallel.dp.state.CheckpointState; tests check them against it).
    ``planner``: "module:class" of its planner model (engine/planning/dp.py), or None: the planner then
    refuses the mode in one line rather than pricing it as another. ``keys``: the parallel.* keys only this mode
    reads; set away from their default under another mode they are refused (``refuse_key`` says how).
    ``check``: its own world-size-free checks of cfg (engine/config_checks.py calls it), ``check_layout``: its
    refusals of (cfg, layout) (engine/parallel/layout/checks.py calls it). ``grad_syncs``: the sync points it can follow
    (engine/parallel/pp/actions.py: a schedule needing another is refused). ``offload``: the parallel.offload values
    it honours. ``compile``: whether train.compile runs under it. ``expert_parallel``: whether it reduces expert
    gradients over the expert-dp group (parallel.ep > 1, engine/parallel/ep/); ``ep_refusal``: why not, where it does
    not.
    ``bf16_weights``: train.dtype=bf16
    computes on bf16 weights (else autocast over fp32 weights: engine/planning/activations.py picks its ledger by
    this)."""

    name: str
    impl: str
    state: tuple[str, ...]
    planner: str | None = None
    keys: tuple[str, ...] = ()
    refuse_key: Callable[[object, str], str] | None = None
    check: Callable[[object], None] | None = None
    check_layout: Callable[[object, object], None] | None = None
    grad_syncs: frozenset[str] = field(default_factory=lambda: frozenset({LAST_BACKWARD}))
    offload: tuple[str, ...] = ("none",)
    compile: bool = True
    expert_parallel: bool = False
    ep_refusal: str = ""
    bf16_weights: bool = False
