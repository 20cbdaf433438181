"""Data-parallel modes: what each declares about itself, so that the config checks, the layout checks, the planner and
the checkpoints ask the mode instead of comparing its name: one ``DpModeSpec`` per ``parallel.dp_mode``, registered in
``MODES``. No torch here: the config checks read the specs before any process exists, so a spec names its code on
the floors above by names those floors resolve: its DataParallel class and checkpoint state classes as
"module:class" within engine/parallel/dp/ (``impl_class``, ``state_classes`` there), its planner model as a class
of engine/planning/dp.py (``model_class`` there). Its world-size-free checks and layout refusals are
engine/kinds/dp_checks.py.

- ``ddp``: torch DistributedDataParallel, bucketed all-reduce overlapped with the last backward (dp/ddp.py)
- ``fsdp``: torch FSDP2, parameters, gradients and Adam state sharded over dp (dp/fsdp.py)
- ``zero``: DeepSpeed ZeRO stages 1-3 (dp/zero.py; its state in dp/zero_state.py, its config in
  engine/kinds/ds_config.py)
A new mode is its DataParallel subclass, its checkpoint state, its planner model and one entry here
(docs/recipes.md names every file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.errors import ConfigError
from engine.kinds import dp_checks as checks
from engine.kinds.schedules import CHUNK_BACKWARD, CHUNK_LAST_W, LAST_BACKWARD, LAST_W


@dataclass(frozen=True)
class DpModeSpec:
    """One dp mode: its code, its keys and checks, what it composes with, its planner model and checkpoint state.

    ``impl``: "module:class" in engine/parallel/dp/ of its engine.parallel.dp.base.DataParallel. ``state``:
    "module:class" in engine/parallel/dp/ of each checkpoint state class it hands out
    (engine.parallel.dp.state.CheckpointState; tests check them against it). ``planner``: the class name of its
    planner model in engine/planning/dp.py, or None: the planner then refuses the mode in one line rather than
    pricing it as another. ``keys``: the parallel.* keys only this mode
    reads; set away from their default under another mode they are refused (``refuse_key`` says how).
    ``check``: its own world-size-free checks of cfg (engine/config_checks.py calls it), ``check_layout``: its
    refusals of (cfg, layout) (engine/parallel/layout/checks.py calls it). ``grad_syncs``: the sync points it can follow
    (engine/parallel/pp/actions.py: a schedule needing another is refused). ``offload``: the parallel.offload values
    it honours. ``compile``: whether train.compile runs under it. ``expert_parallel``: whether it reduces expert
    gradients over the expert-dp group (parallel.ep > 1, engine/parallel/ep/); ``ep_refusal``: why not, where it does
    not.
    ``bf16_weights``: train.dtype=bf16
    computes on bf16 weights (else autocast over fp32 weights: engine/planning/activations.py picks its ledger by
    this). ``identical_over``: the groups (names ctx.group answers) over which this mode keeps every parameter's
    local tensor identical, which train.check_replicas_every compares (engine/trust/replicas.py): over "tp" only the
    parameters every tp rank holds whole (norms); over "dp_cp" all but the expert-parallel ones (compared over
    "edp")."""

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
    identical_over: tuple[str, ...] = ("tp",)


_TORCH_STATE = ("state:TorchState",)
_ALL_SYNCS = frozenset({LAST_BACKWARD, CHUNK_BACKWARD, LAST_W})

MODES: dict[str, DpModeSpec] = {
    s.name: s
    for s in (  # parallel.dp_mode -> its DpModeSpec
        # DDP's reducer follows any backward; under zero bubble (and ZB-V, per chunk) each chunk's buckets are
        # all-reduced as its last W completes them, a weight two chunks share once after the step (ddp.py last_weight).
        DpModeSpec(
            "ddp",
            "ddp:DDP",
            _TORCH_STATE,
            "DDPModel",
            keys=("grad_compression",),
            refuse_key=checks.refuse_ddp_key,
            check=checks.check_ddp,
            grad_syncs=_ALL_SYNCS | {CHUNK_LAST_W},
            expert_parallel=True,
            identical_over=("dp_cp", "tp"),  # every replica holds the whole stage; tp peers the norms whole
        ),
        # FSDP: each model chunk its own root, reduce-scattered after every backward (fsdp_grad_accumulation=sharded)
        # or its last one (unsharded) or, under zero bubble and zbv, after its last W (zbv with a tied embedding
        # refused: checks.check_fsdp_layout); experts: units over expert-dp
        DpModeSpec(
            "fsdp",
            "fsdp:FSDP",
            _TORCH_STATE,
            "FSDPModel",
            keys=("fsdp_grad_accumulation",),
            refuse_key=checks.refuse_fsdp_key,
            check=checks.check_fsdp,
            check_layout=checks.check_fsdp_layout,
            offload=("none", "optimizer_and_params"),
            bf16_weights=True,
            grad_syncs=_ALL_SYNCS | {CHUNK_LAST_W},
            expert_parallel=True,
            identical_over=("tp",),  # shards differ over dp; tp peers hold the same shard of each norm
        ),
        DpModeSpec(
            "zero",
            "zero:ZeRO",
            ("zero_state:Zero12State", "zero_state:Zero3State"),
            "ZeroModel",
            keys=("zero_stage", "ds_config"),
            refuse_key=checks.refuse_zero_key,
            check=checks.check_zero,
            check_layout=checks.check_zero_supported,
            offload=("none", "optimizer", "optimizer_and_params"),
            compile=False,  # compile: DeepSpeed's hooks
            bf16_weights=True,
            # DeepSpeed's partitions differ over dp (stage 1/2 replicate the module weights, stage 3 does not; not
            # yet told apart here); tp peers hold the same norms
            identical_over=("tp",),
            grad_syncs=_ALL_SYNCS,  # what DeepSpeed cannot follow: checks.check_zero_schedule
            ep_refusal="DeepSpeed's flat buffers partition every parameter over the whole dp group, while the "
            "experts differ between ep ranks: they would need a second partition over expert-dp",
        ),
    )
}


def spec(cfg) -> DpModeSpec:
    """The DpModeSpec of cfg.parallel.dp_mode (config checks have refused unknown names)."""
    return MODES[cfg.parallel.dp_mode]


def check_owned_keys(cfg, defaults) -> None:
    """A key that only another mode reads, set away from its default (``defaults``: a fresh ParallelConfig), is
    refused rather than silently ignored, in that mode's words."""
    p = cfg.parallel
    for other in MODES.values():
        for key in other.keys if other.name != p.dp_mode else ():
            if getattr(p, key) != getattr(defaults, key):
                raise ConfigError(other.refuse_key(cfg, key))
