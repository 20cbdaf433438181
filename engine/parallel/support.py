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
from engine.parallel import schedule as sched
from engine.parallel.mesh import AXES


def micro_batches_per_step(t: TrainConfig, dp: int) -> int:
    """Micro-batches each dp rank runs per optimizer step: global_batch_size / (micro_batch_size * dp), as in
    Megatron, so a change of dp keeps the global batch (resolve_layout checks that it divides)."""
    return t.global_batch_size // (t.micro_batch_size * dp)


@dataclass(frozen=True)
class Layout:
    """Validated sizes of the parallel axes (engine/parallel/mesh.py AXES). cp stays 1 until context parallelism
    exists (there is no parallel.cp key yet)."""
    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1  # expert parallelism: a split of dp (engine/parallel/mesh.py split_along), not a mesh axis

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """((name, size), ...) in mesh order, outermost first: what ParallelContext builds its mesh from."""
        return tuple((name, getattr(self, name)) for name in AXES)

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.axes)


def resolve_layout(cfg: Config, world_size: int) -> Layout:
    """Check the (tp, pp, dp) layout against the world size and the model; every factor is named in the error."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    tp, pp = p.tp, p.pp
    if tp < 1 or pp < 1:
        raise ConfigError(f"parallel.tp={tp} and parallel.pp={pp} must be >= 1")
    # Model-shape checks come first: they hold whatever the world size.
    if m.num_heads % tp or m.num_kv_heads % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.num_heads={m.num_heads} and "
                          f"model.num_kv_heads={m.num_kv_heads}")
    if m.vocab_size % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.vocab_size={m.vocab_size}")
    if m.intermediate_size % tp:
        raise ConfigError(f"parallel.tp={tp} must divide model.intermediate_size={m.intermediate_size}")
    if m.num_layers < pp:
        raise ConfigError(f"parallel.pp={pp} exceeds model.num_layers={m.num_layers}; each stage needs a layer")
    counts = p.pp_layers  # "auto": engine/planning/balance.py picks them (any pp <= num_layers has a split)
    if counts and counts != "auto" and (len(counts) != pp or sum(counts) != m.num_layers or min(counts) < 1):
        raise ConfigError(f"parallel.pp_layers={counts} must list {pp} positive layer counts (one per stage) "
                          f"summing to model.num_layers={m.num_layers}")
    dp = p.dp if p.dp != -1 else world_size // (tp * pp)
    if dp < 1 or tp * pp * dp != world_size:
        fits = world_size % (tp * pp) == 0  # then only an explicit dp is wrong: say so, not "change tp and pp"
        fix = (f"set parallel.dp={world_size // (tp * pp)} or -1 (auto)" if fits and p.dp != -1 else
               f"choose tp and pp whose product divides {world_size}" + (", and dp=-1" if p.dp != -1 else ""))
        raise ConfigError(f"invalid layout: tp({tp}) * pp({pp}) * dp({p.dp if p.dp != -1 else 'auto'}) "
                          f"!= world size({world_size}); {fix}")
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                          f"train.micro_batch_size({t.micro_batch_size}) * dp({dp}) = {per_step}")
    check_schedule(cfg, pp, micro_batches_per_step(t, dp), dp)
    check_expert_parallel(cfg, dp)
    layout = Layout(tp=tp, pp=pp, dp=dp, ep=p.ep)
    check_supported(cfg, layout)  # dp mode x layout x dtype refusals
    return layout


def check_expert_parallel(cfg: Config, dp: int) -> None:
    """parallel.ep against dp, the experts and the dp mode (engine/parallel/ep/)."""
    ep, experts, mode = cfg.parallel.ep, cfg.model.num_experts, cfg.parallel.dp_mode
    if ep == 1:
        return
    if not experts:
        raise ConfigError(f"parallel.ep={ep} needs an MoE model (model.num_experts > 0); use ep=1 for a dense model")
    if dp % ep:
        raise ConfigError(f"parallel.ep={ep} must divide dp={dp} (ep groups are carved out of the dp ranks)")
    if experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide model.num_experts={experts}")
    if mode != "ddp":
        raise ConfigError(f"parallel.ep={ep} with parallel.dp_mode={mode} is not supported (only ddp reduces expert "
                          f"gradients over the expert-dp group in this build); use dp_mode=ddp or ep=1")


def check_schedule(cfg: Config, pp: int, micro_batches: int, dp: int) -> None:
    """The pipeline schedule and its virtual stages against pp, the layers and the micro-batches per step
    (engine/parallel/schedule.py check, named by config key), and sequence parallelism against tp."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} must be >= 1")
    if p.schedule == "interleaved":
        chunks = pp * p.virtual_stages
        if pp < 2:
            raise ConfigError("parallel.schedule=interleaved needs parallel.pp >= 2 (with pp=1 there is no bubble "
                              "to shrink); use schedule 1f1b")
        if m.num_layers % chunks:
            raise ConfigError(f"parallel.schedule=interleaved splits model.num_layers={m.num_layers} into pp*"
                              f"virtual_stages={chunks} equal chunks; choose virtual_stages so that it divides")
        if p.pp_layers:
            raise ConfigError(f"parallel.pp_layers={p.pp_layers} is not supported with schedule=interleaved "
                              f"(layers split evenly into pp*virtual_stages chunks); leave pp_layers empty")
    if pp > 1:
        try:
            sched.check(p.schedule, pp, micro_batches, p.virtual_stages)
        except ValueError as e:
            raise ConfigError(f"parallel.schedule={p.schedule} with {micro_batches} micro-batches per step "
                              f"(global_batch_size {t.global_batch_size} / (micro_batch_size {t.micro_batch_size} * "
                              f"dp {dp})) and parallel.pp={pp}: {e}") from None
    elif p.virtual_stages != 1:
        raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule=interleaved and pp >= 2")
    if p.sequence_parallel and p.tp < 2:
        raise ConfigError(f"parallel.sequence_parallel=true needs parallel.tp >= 2 (got tp={p.tp}): it shards the "
                          f"sequence over the tensor-parallel group; set sequence_parallel=false")
    if p.sequence_parallel and t.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel=true needs train.seq_len={t.seq_len} divisible by "
                          f"parallel.tp={p.tp}")


def check_supported(cfg: Config, layout) -> None:
    """Refuse, with the combination named, what this build cannot run. ``layout`` has ``tp``, ``pp``, ``dp``."""
    p, m = cfg.parallel, cfg.model
    if layout.tp > 1 and m.num_experts:  # (OLMoE's whole-projection q/k norms would need a tp all-reduce too)
        raise ConfigError(f"parallel.tp={layout.tp} with model.num_experts={m.num_experts} is not supported: the "
                          f"experts and router are not tensor-parallel; use tp=1 (pp and dp work)")
    if p.schedule in ("interleaved", "zero_bubble") and p.dp_mode != "ddp":
        when = {"interleaved": "each model chunk's last backward", "zero_bubble": "the last W, not the last B"}
        raise ConfigError(f"parallel.schedule={p.schedule} with parallel.dp_mode={p.dp_mode} is not supported (the "
                          f"gradient sync would have to follow {when[p.schedule]}); use dp_mode=ddp, or "
                          f"schedule 1f1b with {p.dp_mode}")
    if cfg.parallel.dp_mode == "zero":
        check_zero_supported(cfg, layout)
    elif cfg.parallel.zero_stage:
        raise ConfigError(f"parallel.zero_stage={cfg.parallel.zero_stage} needs parallel.dp_mode=zero, not "
                          f"{cfg.parallel.dp_mode}; fsdp shards like ZeRO-3 (reshard_after_forward=true)")


def reshard_after_forward(cfg: Config, pp: int) -> bool:
    """FSDP's parallel.reshard_after_forward: true, false, or auto. Under pp > 1 each weight would be gathered once
    per micro-batch forward and again per backward, so auto keeps it gathered from forward to backward there."""
    return {"true": True, "false": False, "auto": pp == 1}[cfg.parallel.reshard_after_forward]


def check_zero_supported(cfg: Config, ctx) -> None:
    """Refuse, naming the combination, what engine/parallel/dp/zero.py cannot run correctly."""
    p = cfg.parallel
    if p.zero_stage not in (1, 2, 3):
        raise ConfigError(f"parallel.dp_mode=zero needs parallel.zero_stage 1, 2 or 3, got {p.zero_stage}")
    if ctx.pp > 1 and cfg.model.tie_embeddings and (p.zero_stage != 1 or cfg.train.dtype != "fp32"):
        raise ConfigError(f"parallel.dp_mode=zero with zero_stage={p.zero_stage}, train.dtype={cfg.train.dtype}, "
                          "parallel.pp>1 and model.tie_embeddings=true is not supported: the first and last stage's "
                          "embedding gradients must be summed before DeepSpeed reduces them, which only ZeRO-1 in "
                          "fp32 allows (ZeRO-2/3 reduce-scatter during backward; bf16 ZeRO-1 moves them into its "
                          "fp32 buffers); use zero_stage=1 with train.dtype=fp32, or dp_mode=ddp")
    if ctx.pp > 1 and p.zero_stage == 3:
        # Measured with DeepSpeed 0.19.8: ZeRO-3's parameter coordinator checks its module trace against rank 0 of
        # the whole job (a world-group broadcast at the first forward), which stages holding different layers
        # reach at different times: the job hangs.
        raise ConfigError("parallel.dp_mode=zero with zero_stage=3 and parallel.pp>1 is not supported (DeepSpeed's "
                          "ZeRO-3 compares module traces across all ranks and hangs under pipeline stages); "
                          "use zero_stage 1 or 2, or dp_mode=fsdp")
