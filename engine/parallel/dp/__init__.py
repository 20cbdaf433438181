"""Data parallelism: one ``DataParallel`` (engine/parallel/dp/base.py) per dp mode, chosen here by name.

- ``ddp``: torch DistributedDataParallel, bucketed all-reduce overlapped with the last backward (ddp.py)
- ``fsdp``: torch FSDP2, parameters, gradients and Adam state sharded over dp (fsdp.py)
- ``zero``: DeepSpeed ZeRO stages 1-3 (zero.py; its state in zero_state.py, its config in ds_json.py)

``MODES`` is the registry: each mode's DpModeSpec (registry.py) declares its code, the keys only it reads and its
checks (checks.py), what it composes with (schedules' sync points, offload, compile), its planner model
(engine/planning/dp.py) and its checkpoint state classes. Everything outside this package asks the spec and never
compares a mode's name. A new mode is its DataParallel subclass, its checkpoint state, its planner model and one
entry here (docs/architecture.md, "A new dp mode", names every file). No torch: the config checks read this.
"""

from __future__ import annotations

from engine.errors import ConfigError
from engine.kinds import load
from engine.kinds.schedules import CHUNK_BACKWARD, CHUNK_LAST_W, LAST_BACKWARD, LAST_W
from engine.parallel.dp import checks
from engine.parallel.dp.registry import DpModeSpec

_TORCH_STATE = ("engine.parallel.dp.state:TorchState",)
_PLAN = "engine.planning.dp:"
_ALL_SYNCS = frozenset({LAST_BACKWARD, CHUNK_BACKWARD, LAST_W})

MODES: dict[str, DpModeSpec] = {
    s.name: s
    for s in (  # parallel.dp_mode -> its DpModeSpec
        # DDP's reducer follows any backward; under zero bubble (and ZB-V, per chunk) each chunk's buckets are
        # all-reduced as its last W completes them, a weight two chunks share once after the step (ddp.py last_weight).
        DpModeSpec(
            "ddp",
            "engine.parallel.dp.ddp:DDP",
            _TORCH_STATE,
            _PLAN + "DDPModel",
            keys=("grad_compression",),
            refuse_key=checks.refuse_ddp_key,
            check=checks.check_ddp,
            grad_syncs=_ALL_SYNCS | {CHUNK_LAST_W},
            expert_parallel=True,
        ),
        # FSDP: each model chunk its own root, reduce-scattered after its last backward or, under zero bubble and zbv,
        # its last W (zbv with a tied embedding refused: checks.check_fsdp_layout); experts: units over expert-dp
        DpModeSpec(
            "fsdp",
            "engine.parallel.dp.fsdp:FSDP",
            _TORCH_STATE,
            _PLAN + "FSDPModel",
            check=checks.check_fsdp,
            check_layout=checks.check_fsdp_layout,
            offload=("none", "optimizer_and_params"),
            bf16_weights=True,
            grad_syncs=_ALL_SYNCS | {CHUNK_LAST_W},
            expert_parallel=True,
        ),
        DpModeSpec(
            "zero",
            "engine.parallel.dp.zero:ZeRO",
            ("engine.parallel.dp.zero_state:Zero12State", "engine.parallel.dp.zero_state:Zero3State"),
            _PLAN + "ZeroModel",
            keys=("zero_stage", "ds_config"),
            refuse_key=checks.refuse_zero_key,
            check=checks.check_zero,
            check_layout=checks.check_zero_supported,
            offload=("none", "optimizer", "optimizer_and_params"),
            compile=False,  # compile: DeepSpeed's hooks
            bf16_weights=True,
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


def build(model, cfg, ctx):
    """Wrap the stage ``model`` (tensor-parallel, materialised, identical on every dp rank) in parallel.dp_mode;
    returns its engine.parallel.dp.base.DataParallel."""
    return load(MODES[cfg.parallel.dp_mode].impl)(model, cfg, ctx)
