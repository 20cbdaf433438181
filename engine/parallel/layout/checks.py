"""The checks that need the world size: the (tp, pp, dp) layout against the model and the batch (resolve_layout),
and which (layout, dp mode, dtype, embedding) combinations this build runs (check_supported). Checks that need no
world size are in engine/config_checks.py; together they are every configuration check.

resolve_layout runs in ``ParallelContext.from_config``, so a bad or refused layout fails before any process group
exists, and in the planner's search. The list of refusals, with the reason for each, is also stated independently in
tests/parity/matrix.py and shown in the README ("What is proven").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import Config, ConfigError, TrainConfig
from engine.kinds import dp_modes
from engine.kinds.cp_modes import CP_MODES
from engine.kinds.schedules import SCHEDULES
from engine.parallel.layout.mesh import AXES
from engine.parallel.pp import schedule as sched


def micro_batches_per_step(t: TrainConfig, dp: int) -> int:
    """Micro-batches each dp rank runs per optimizer step: global_batch_size / (micro_batch_size * dp), as in
    Megatron, so a change of dp keeps the global batch (resolve_layout checks that it divides)."""
    return t.global_batch_size // (t.micro_batch_size * dp)


@dataclass(frozen=True)
class Layout:
    """Validated sizes of the parallel axes (engine/parallel/layout/mesh.py AXES); cp: parallel.cp (context
    parallelism)."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1  # expert parallelism: a split of dp x cp (engine/parallel/layout/mesh.py split_along), not a mesh axis

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """((name, size), ...) in mesh order, outermost first: what ParallelContext builds its mesh from."""
        return tuple((name, getattr(self, name)) for name in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.axes)


def resolve_layout(cfg: Config, world_size: int) -> Layout:
    """Check the (tp, pp, dp, cp) layout against the world size and the model; every factor is named in the error."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    tp, pp, cp = p.tp, p.pp, p.cp
    if tp < 1 or pp < 1 or cp < 1:
        raise ConfigError(f"parallel.tp={tp}, parallel.pp={pp} and parallel.cp={cp} must be >= 1")
    # Model-shape checks come first: they hold whatever the world size.
    if m.num_heads % tp or m.num_kv_heads % tp:
        raise ConfigError(
            f"parallel.tp={tp} must divide model.num_heads={m.num_heads} and model.num_kv_heads={m.num_kv_heads}"
        )
    if m.vocab_size % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.vocab_size={m.vocab_size}")
    if m.intermediate_size % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.intermediate_size={m.intermediate_size}")
    if m.num_layers < pp:
        raise ConfigError(f"parallel.pp={pp} exceeds model.num_layers={m.num_layers}; each stage needs a layer")
    check_context_parallel(cfg)
    dp = p.dp if p.dp != -1 else world_size // (tp * pp * cp)
    if dp < 1 or tp * pp * cp * dp != world_size:
        fits = world_size % (tp * pp * cp) == 0  # then only an explicit dp is wrong: say so, not "change tp and pp"
        fix = (
            f"set parallel.dp={world_size // (tp * pp * cp)} or -1 (auto)"
            if fits and p.dp != -1
            else f"choose tp, pp and cp whose product divides {world_size}" + (", and dp=-1" if p.dp != -1 else "")
        )
        raise ConfigError(
            f"invalid layout: tp({tp}) * pp({pp}) * cp({cp}) * dp({p.dp if p.dp != -1 else 'auto'}) "
            f"!= world size({world_size}); {fix}"
        )
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by "
            f"train.micro_batch_size({t.micro_batch_size}) * dp({dp}) = {per_step}"
        )
    check_schedule(cfg, pp, micro_batches_per_step(t, dp), dp)
    check_expert_parallel(cfg, dp)
    layout = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=p.ep)
    check_supported(cfg, layout)  # dp mode x layout x dtype refusals
    return layout


def check_context_parallel(cfg: Config) -> None:
    """parallel.cp against the sequence (2 cp equal chunks: engine/parallel/cp/layout.py) and the mode's own checks
    (CpModeSpec.check; all_to_all: each cp rank takes num_heads / (cp tp) whole heads, and as many kv heads)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.cp == 1:
        return
    if m.num_experts and m.moe_capacity_factor:
        raise ConfigError(
            f"model.moe_capacity_factor={m.moe_capacity_factor} with parallel.cp={p.cp} is not "
            f"supported: capacity keeps each expert's first copies in the micro-batch's token order, "
            f"which cp splits over ranks; use moe_capacity_factor=0 (dropless) or cp=1"
        )
    if t.seq_len % (2 * p.cp):
        raise ConfigError(
            f"parallel.cp={p.cp} needs train.seq_len={t.seq_len} divisible by 2 * cp = {2 * p.cp} "
            f"(each cp rank holds two of 2 cp equal chunks)"
        )
    if p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true with parallel.cp={p.cp} needs train.seq_len / cp = "
            f"{t.seq_len // p.cp} divisible by parallel.tp={p.tp}"
        )
    if (check := CP_MODES[p.cp_mode].check) is not None:  # the mode's own (all_to_all: the heads split over cp tp)
        check(cfg)


def check_expert_parallel(cfg: Config, dp: int) -> None:
    """parallel.ep against dp x cp (ep is carved from the data ranks), the experts and the dp mode
    (engine/parallel/ep/)."""
    ep, experts, mode, cp = cfg.parallel.ep, cfg.model.num_experts, cfg.parallel.dp_mode, cfg.parallel.cp
    able = " or ".join(name for name, s in dp_modes.MODES.items() if s.expert_parallel)
    if ep == 1:
        return
    if not experts:
        raise ConfigError(f"parallel.ep={ep} needs an MoE model (model.num_experts > 0); use ep=1 for a dense model")
    if (dp * cp) % ep:
        raise ConfigError(
            f"parallel.ep={ep} must divide dp * cp = {dp} * {cp} = {dp * cp} (ep groups are carved out "
            f"of the dp x cp ranks)"
        )
    if experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide model.num_experts={experts}")
    if not dp_modes.spec(cfg).expert_parallel:
        why = dp_modes.spec(cfg).ep_refusal or f"only {able} reduce expert gradients over the expert-dp group"
        raise ConfigError(
            f"parallel.ep={ep} with parallel.dp_mode={mode} is not supported ({why}); use dp_mode={able} or ep=1"
        )


def check_schedule(cfg: Config, pp: int, micro_batches: int, dp: int) -> None:
    """The pipeline schedule and its virtual stages against pp, the layers and the micro-batches per step
    (engine/parallel/pp/schedule.py check, named by config key), and sequence parallelism against tp."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} must be >= 1")
    spec = SCHEDULES[p.schedule]
    if spec.chunks:
        chunks = pp * p.virtual_stages
        if pp < 2:
            raise ConfigError(
                f"parallel.schedule={p.schedule} needs parallel.pp >= 2 (with pp=1 there is no bubble "
                "to shrink); use schedule 1f1b"
            )
        if m.num_layers % chunks and not p.pp_layers:
            raise ConfigError(
                f"parallel.schedule={p.schedule} splits model.num_layers={m.num_layers} into pp*"
                f"virtual_stages={chunks} equal chunks; choose virtual_stages so that it divides, or set "
                f"parallel.pp_layers (auto, or {chunks} counts, one per virtual stage)"
            )
    if spec.vshape:
        check_vshape(cfg, pp)
    if pp > 1:
        try:
            sched.check(p.schedule, pp, micro_batches, p.virtual_stages)
        except ValueError as e:
            raise ConfigError(
                f"parallel.schedule={p.schedule} with {micro_batches} micro-batches per step "
                f"(global_batch_size {t.global_batch_size} / (micro_batch_size {t.micro_batch_size} * "
                f"dp {dp})) and parallel.pp={pp}: {e}"
            ) from None
    elif p.virtual_stages != 1:
        chunked = " or ".join(name for name, s in SCHEDULES.items() if s.chunks)
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule={chunked} and pp >= 2")
    check_pp_layers(cfg, pp)
    if p.sequence_parallel and p.tp < 2:
        raise ConfigError(
            f"parallel.sequence_parallel=true needs parallel.tp >= 2 (got tp={p.tp}): it shards the "
            f"sequence over the tensor-parallel group; set sequence_parallel=false"
        )
    if p.tp_comm_overlap and not p.sequence_parallel:
        raise ConfigError(
            "parallel.tp_comm_overlap=true needs parallel.sequence_parallel=true: it overlaps the sequence "
            "all-gathers and reduce-scatters of the tensor-parallel linears; set tp_comm_overlap=false"
        )
    if p.tp_comm_overlap and SCHEDULES[p.schedule].split_w:
        raise ConfigError(
            f"parallel.tp_comm_overlap=true is not supported with parallel.schedule={p.schedule} (its deferred "
            f"weight gradients gather blocking); use a schedule among "
            f"{', '.join(n for n, s in SCHEDULES.items() if not s.split_w)} or tp_comm_overlap=false"
        )
    if p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true needs train.seq_len={t.seq_len} divisible by parallel.tp={p.tp}"
        )


def check_pp_layers(cfg: Config, pp: int) -> None:
    """parallel.pp_layers against what it counts (engine/parallel/pp/schedule.py layer_runs): a layer count per
    stage, or per virtual stage in virtual-stage order under a chunked schedule (interleaved: pp*v, zbv: 2*pp;
    engine/parallel/pp/split.py); "auto" (engine/planning/balance.py) needs a layer for each."""
    p, layers = cfg.parallel, cfg.model.num_layers
    runs, counts = sched.layer_runs(p, pp), p.pp_layers
    if runs > layers:
        raise ConfigError(
            f"parallel.schedule={p.schedule} at pp={pp} runs {runs} virtual stages, more than "
            f"model.num_layers={layers}; each needs a layer (fewer virtual_stages or a smaller pp)"
        )
    if counts and counts != "auto" and (len(counts) != runs or sum(counts) != layers or min(counts) < 1):
        what = "one per stage" if runs == pp else f"one per virtual stage, pp*{runs // pp}, in virtual-stage order"
        raise ConfigError(
            f"parallel.pp_layers={counts} must list {runs} positive layer counts ({what}) summing to "
            f"model.num_layers={layers}"
        )


def check_vshape(cfg: Config, pp: int) -> None:
    """A schedule with 2 chunks per rank in a V (ScheduleSpec.vshape: zbv, engine/parallel/pp/schedules/zbv.py) needs
    pp >= 2 and 2*pp equal layer chunks unless parallel.pp_layers gives them; parallel.virtual_stages is implied (1
    or 2 accepted)."""
    p, layers = cfg.parallel, cfg.model.num_layers
    if pp < 2:
        raise ConfigError(
            f"parallel.schedule={p.schedule} needs parallel.pp >= 2 (its V turns on the last rank); use 1f1b"
        )
    if layers % (2 * pp) and not p.pp_layers:
        raise ConfigError(
            f"parallel.schedule={p.schedule} splits model.num_layers={layers} into 2*pp={2 * pp} equal "
            f"chunks; choose pp so that 2*pp divides it, or set parallel.pp_layers (auto, or {2 * pp} counts, "
            f"one per virtual stage)"
        )
    if p.virtual_stages not in (1, 2):
        raise ConfigError(
            f"parallel.virtual_stages={p.virtual_stages} with schedule={p.schedule}: its 2 chunks per "
            f"rank are implied; leave virtual_stages at 1 (or 2)"
        )


def check_supported(cfg: Config, layout) -> None:
    """Refuse, with the combination named, what this build cannot run: a schedule whose gradient sync point the dp
    mode cannot follow (ScheduleSpec.grad_sync against DpModeSpec.grad_syncs), then the mode's own refusals.
    ``layout`` has ``tp``, ``pp``, ``dp``."""
    p, m = cfg.parallel, cfg.model
    if layout.tp > 1 and m.num_experts:  # experts tp-sharded (engine/parallel/tp/moe.py): their widths split
        for key, width in (
            ("moe_intermediate_size", m.moe_intermediate_size or m.intermediate_size),
            ("moe_shared_expert_size", m.moe_shared_expert_size),
        ):
            if width % layout.tp:
                raise ConfigError(
                    f"model.{key}={width} must be divisible by parallel.tp={layout.tp}: each expert's "
                    f"SwiGLU width is split over tp"
                )
    schedule, mode = SCHEDULES[p.schedule], dp_modes.spec(cfg)
    if schedule.grad_sync not in mode.grad_syncs:
        modes = " or ".join(name for name, s in dp_modes.MODES.items() if schedule.grad_sync in s.grad_syncs)
        other = next((name for name, s in SCHEDULES.items() if s.grad_sync in mode.grad_syncs), "none")
        raise ConfigError(
            f"parallel.schedule={p.schedule} with parallel.dp_mode={p.dp_mode} is not supported (the "
            f"gradient sync would have to follow {schedule.grad_sync}); use dp_mode={modes}, or "
            f"schedule {other} with {p.dp_mode}"
        )
    if mode.check_layout is not None:
        mode.check_layout(cfg, layout)


def reshard_after_forward(cfg: Config, pp: int) -> bool:
    """FSDP's parallel.reshard_after_forward: true, false, or auto. Under pp > 1 each weight would be gathered once
    per micro-batch forward and again per backward, so auto keeps it gathered from forward to backward there."""
    return {"true": True, "false": False, "auto": pp == 1}[cfg.parallel.reshard_after_forward]


def tp_across_hosts(tp: int, rank: int, local_rank: int, local_world: int, world: int) -> str | None:
    """The warning for a host of a multi-host world whose ranks are not whole tp groups. tp varies fastest (AXES),
    so a group is tp consecutive ranks, and the launchers number ranks host by host: a host's slot count that tp
    does not divide (or a tp above it) puts a group's every-layer all-reduces on the network between hosts."""
    first = rank - local_rank
    if tp < 2 or local_world >= world or (first % tp == 0 and local_world % tp == 0):
        return None
    ranks = f"rank {first}" if local_world == 1 else f"ranks {first}-{first + local_world - 1}"
    return (
        f"warning: parallel.tp={tp} puts tensor-parallel groups across hosts: this host runs {local_world} "
        f"rank{'s' if local_world > 1 else ''} ({ranks}), not whole groups of {tp} "
        f"consecutive ranks, so every layer's tp all-reduce crosses the network; give every host a multiple of "
        f"{tp} slots (hostfile slots=, torchrun --nproc-per-node) or set parallel.tp to a divisor of {local_world}"
    )
