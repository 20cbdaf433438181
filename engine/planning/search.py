"""Step-time estimates and the layout search behind ``launch/plan.py``.

``step_time`` models one optimizer step of a layout as
    makespan of the pipeline schedule  +  exposed dp communication
where the makespan is engine.parallel.pp.simulator's event simulation of the configured schedule
(engine/planning/schedules.py), every virtual stage taking the slowest stage's time for one micro-batch / v:
forward F, input-gradient backward B and weight-gradient backward W (one backward B+W except under zero bubble),
from its FLOPs (engine/model/flops.py, recomputation included) at ``efficiency`` of the device peak, its
element-wise kernels' bytes (engine/planning/kernels.py, recomputation included) at the memory bandwidth
``hbm_gbps`` (a roofline per kernel class: the matmuls compute-bound, the element-wise kernels memory-bound), its
tensor-parallel all-reduces, and its pipeline transfers (one each way per model chunk). The bubble is what the
schedule leaves idle: for 1F1B and GPipe a makespan of (m + p - 1) (F + B), a bubble of (p - 1) / (m + p - 1)
(Narayanan et al. 2021, Sec. 2.2.1), for interleaved about 1/v of that (their Sec. 2.2.2) with v times the
transfers, for ZB-H1 (p - 1) (F + B - W) (Qi et al. 2023). Collectives are rings over ``n`` ranks (Thakur et al. 2005):
all-reduce moves
2 (n-1)/n of the bytes per rank, reduce-scatter and all-gather (n-1)/n each, plus a latency per ring step. A
group whose ranks fit in one node (tp fastest, then dp, then pp: engine/parallel/layout/context.py) uses the intra-node
bandwidth, otherwise the inter-node one.

What is counted, per engine path: tp (engine/planning/tp.py): the collectives of engine/parallel/tp/layers.py's plan
table as the model runs them (forward one per sub-layer, backward one per column-parallel linear and under sequence
parallelism its input re-gathered, and what recomputation re-runs; counted in the model), or under
parallel.tp_comm_overlap each ring step's excess over the matmul chunk it hides behind; ddp: torch DDP's bucketed
gradient all-reduce, overlapped with the last micro-batch's backward except the last bucket; fsdp: an all-gather per
micro-batch forward (and another in backward with reshard_after_forward) that overlaps compute, and the gradient
reduce-scatter of the last micro-batch, block by block as each one's backward ends (FSDP2's post-backward hooks),
overlapped with the rest of the backward except the last block's and the root unit's (engine/planning/dp.py
overlapped); zero k (DeepSpeed, overlap_comm off in engine/kinds/ds_config.py): stage 1 all-reduces gradients once,
stage 2 reduce-scatters every micro-batch, stage 3 also all-gathers weights forward and backward, and stages 1-2
all-gather the updated weights; ep (engine/planning/ep.py): the token all-to-alls, exposed, the busiest ep rank's
extra expert rows, and the experts' own reduction over expert-dp (after the backward under ddp). Not modelled: the
optimizer update, data loading, kernel launch overheads."""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from dataclasses import dataclass, field

from engine.config import Config
from engine.kinds.offload import OFFLOADS
from engine.kinds.recompute import RECOMPUTE
from engine.model import flops
from engine.parallel.layout.checks import Layout, micro_batches_per_step, resolve_layout
from engine.planning import cp as cp_plan
from engine.planning import ep as ep_plan
from engine.planning import kernels, schedules
from engine.planning import tp as tp_plan
from engine.planning.activations import mode as activation_mode
from engine.planning.activations import sequence_share
from engine.planning.balance import layer_counts, rank_layers
from engine.planning.layouts import layouts
from engine.planning.links import link_bandwidth
from engine.planning.planner import (
    StageMemory,
    data_layout,
    dp_model,
    plan_memory,
    stage_memory,
    stage_params,
    state_groups,
)
from engine.planning.schedules import head_stage, virtual_stages


@dataclass
class Hardware:
    """One device and its links. Defaults: an H100 SXM node (NVLink 4 at 450 GB/s per direction, 8 per node,
    400 Gb/s InfiniBand per GPU between nodes)."""

    peak_tflops: float = 989.0  # dense TFLOP/s of one device in the training dtype (engine.model.flops.peak_tflops)
    efficiency: float = 0.5  # fraction of the peak that the matmuls achieve
    memory_gb: float = 80.0  # device memory per rank, GB (1e9 bytes)
    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0  # GB/s per device per direction inside a node
    inter_node_gbps: float = 50.0  # GB/s per device between nodes
    latency_us: float = 10.0  # per ring step
    hbm_gbps: float = 0.0  # device memory bandwidth, GB/s, for the element-wise kernels (0: not modelled)
    # attention that writes its s x s scores (engine/planning/kernels.py; a published system before FlashAttention),
    # not this engine's SDPA: their softmax and dropout priced at hbm_gbps
    materialised_scores: bool = False


@dataclass
class StepTime:
    """Seconds per optimizer step, by part (the pipeline parts are whole-step totals on the slowest stage)."""

    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    total: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float = 0.0  # idle / makespan of the simulated schedule (the stage idling most)
    cp_comm: float = 0.0  # exposed context-parallel communication (engine/planning/cp.py), whole step
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (engine/planning/ep.py), whole step, exposed


@dataclass
class StageCost:
    """Seconds of one micro-batch on one pipeline stage (all its chunks): the forward, the input-gradient backward
    B (recomputation and the backward's all-reduces with it) and the weight-gradient backward W, which the
    schedules other than zero bubble run as one backward; ``compute``, ``tp_comm``, ``pp_comm`` are their parts."""

    fwd: float
    bwd_input: float
    bwd_weight: float
    compute: float
    tp_comm: float
    pp_comm: float
    params: dict
    cp_comm: float = 0.0
    ep_comm: float = 0.0

    @property
    def total(self) -> float:
        return self.fwd + self.bwd_input + self.bwd_weight


def stage_cost(cfg: Config, layout: Layout, hw: Hardware, stage: int) -> StageCost:
    """One micro-batch on ``stage`` (see the module docstring). W is the weight-gradient matmuls (2 FLOPs per
    weight per token, engine.model.flops.weight_grad_flops_per_token): about half the backward, as Qi et al.
    2023 take it (B = W); B is the rest (input gradients, attention's backward, recomputation)."""
    t, m = cfg.train, cfg.model
    tokens = t.micro_batch_size * t.seq_len // layout.cp  # a cp rank computes on s/cp tokens (balanced causal work)
    act = tokens * m.hidden_size * (2 if t.dtype == "bf16" else 4)  # one (mbs, s, h) activation
    pp_bw = link_bandwidth(hw, layout.world_size)
    params = stage_params(cfg, layout.tp, layout.pp, stage)
    layers, first, last = params["num_layers"], stage == 0, stage == head_stage(cfg, layout.pp)
    rate = hw.peak_tflops * 1e12 * hw.efficiency * layout.tp  # a tp rank does 1/tp of the stage's FLOPs
    cp_fwd, cp_bwd = (
        layers * x
        for x in cp_plan.comm_time(
            cfg, layout.tp, rate / layout.tp, link_bandwidth(hw, layout.cp * layout.tp), hw.latency_us
        )
    )
    moe = ep_plan.moe_layers(m, rank_layers(cfg, layout.pp, stage))
    ep_fwd, ep_bwd = (
        moe * x
        for x in ep_plan.a2a_time_per_layer(cfg, layout.ep, link_bandwidth(hw, ep_plan.ep_span(layout)), hw.latency_us)
    )
    compute = tokens * flops.stage_flops_per_token(m, t.seq_len, layers, last, t.activation_checkpointing) / rate
    fwd = tokens * flops.stage_flops_per_token(m, t.seq_len, layers, last) / 3 / rate
    mem_fwd, mem_bwd = elementwise_time(cfg, layout.tp, hw, tokens * layers)
    compute, fwd = compute + mem_fwd + mem_bwd, fwd + mem_fwd
    weight = tokens * flops.weight_grad_flops_per_token(m, layers, last) / rate
    # the busiest ep rank's extra expert rows: 2 FLOPs a weight forward, 2 B, 2 W (+ 2 recomputed under full)
    wait = tokens * moe * ep_plan.straggler_weights(cfg, layout.ep) / rate
    recompute = RECOMPUTE[t.activation_checkpointing]
    compute, fwd, weight = compute + wait * (6 + 2 * recompute.matmul_flops), fwd + 2 * wait, weight + 2 * wait
    tp_fwd, tp_bwd = tp_plan.comm_time(cfg, layout.tp, hw, tokens, layers, moe, (first, last))
    # one transfer each way per micro-batch and model chunk (v chunks under interleaving: v times the messages)
    sent = act / sequence_share(cfg, layout.tp)  # (b, s/tp, h) between stages under sequence parallelism
    p2p = 0.0 if layout.pp == 1 else virtual_stages(cfg) * (sent / (pp_bw * 1e9) + hw.latency_us * 1e-6)
    return StageCost(
        fwd + tp_fwd + p2p + cp_fwd + ep_fwd,
        compute - fwd - weight + tp_bwd + p2p + cp_bwd + ep_bwd,
        weight,
        compute,
        tp_fwd + tp_bwd,
        2 * p2p,
        params,
        cp_fwd + cp_bwd,
        ep_fwd + ep_bwd,
    )


def elementwise_time(cfg: Config, tp: int, hw: Hardware, token_layers: float) -> tuple[float, float]:
    """(forward, backward) seconds of the element-wise kernels (engine/planning/kernels.py) over ``token_layers``
    tokens x layers of one tp rank, at hw.hbm_gbps (none where it is 0)."""
    if not hw.hbm_gbps:
        return 0.0, 0.0
    fwd, bwd = kernels.step_bytes_per_token(cfg, tp, hw.materialised_scores)
    return fwd * token_layers / (hw.hbm_gbps * 1e9), bwd * token_layers / (hw.hbm_gbps * 1e9)


def pipeline_time(cfg: Config, layout: Layout, cost: StageCost, micro_batches: int) -> tuple[float, list[float]]:
    """(makespan, idle per rank) of the configured schedule, simulated with every virtual stage at ``cost`` / v
    (the slowest stage's pace, as it sets the makespan; the simulator takes one cost per op)."""
    v = virtual_stages(cfg)
    return schedules.makespan_and_idle(
        cfg.parallel.schedule,
        layout.pp,
        micro_batches,
        v,
        cost.fwd / v,
        (cost.bwd_input + cost.bwd_weight) / v,
        cost.bwd_input / v,
        cost.bwd_weight / v,
    )


def worst_stage(cfg: Config, layout: Layout, hw: Hardware) -> StageCost:
    """The slowest stage's StageCost (the first of equals), which sets the pipeline's pace."""
    return max((stage_cost(cfg, layout, hw, s) for s in range(layout.pp)), key=lambda c: c.total)


def step_time(
    cfg: Config, world_size: int, hw: Hardware, layout: Layout | None = None, worst: StageCost | None = None
) -> StepTime:
    """Estimated seconds of one optimizer step of the configured layout (see the module docstring; ``layout``:
    the resolved one, ``worst``: its worst_stage, if the caller has them)."""
    layout = layout or resolve_layout(cfg, world_size)
    t, m = cfg.train, cfg.model
    micro_batches = micro_batches_per_step(t, layout.dp)
    worst = worst or worst_stage(cfg, layout, hw)
    makespan, idle = pipeline_time(cfg, layout, worst, micro_batches)
    dp = dp_time(cfg, layout, hw, worst)
    total = makespan + dp
    tokens_per_s = t.global_batch_size * t.seq_len / total
    mfu = flops.mfu(tokens_per_s / world_size, flops.flops_per_token(m, t.seq_len), hw.peak_tflops) or 0.0
    return StepTime(
        micro_batches * worst.compute,
        micro_batches * worst.tp_comm,
        micro_batches * worst.pp_comm,
        max(idle),
        dp,
        total,
        tokens_per_s,
        mfu,
        max(idle) / makespan,
        micro_batches * worst.cp_comm,
        micro_batches * worst.ep_comm,
    )


def dp_time(cfg: Config, layout: Layout, hw: Hardware, worst: StageCost) -> float:
    """The dp mode's exposed communication (engine/planning/dp.py), over dp x cp and, under expert parallelism,
    the experts' over expert-dp."""
    model, micro_batches = dp_model(cfg), micro_batches_per_step(cfg.train, layout.dp)
    return sum(
        model.dp_comm(
            cfg,
            lay,
            hw,
            p["layers"] + p["root"],
            micro_batches,
            worst.compute if i == 0 or model.experts_overlap else 0.0,
            p["layer"] + p["root"],  # reduced last: the first block's and the root unit's (embedding) gradients
        )
        for i, (lay, p) in enumerate(state_groups(layout, worst.params))
    )


@dataclass
class Candidate:
    """One layout with its plan: the config that runs it, per-stage memory (bytes) and the step time."""

    cfg: Config
    layout: Layout
    memory: list[StageMemory]
    time: StepTime
    fits: bool = field(default=True)

    @property
    def peak_bytes(self) -> float:
        return max(s.total for s in self.memory)

    def describe(self) -> dict:
        p, t = self.cfg.parallel, self.cfg.train
        mode = dp_model(self.cfg).label(self.cfg, data_layout(self.layout))
        mode += OFFLOADS[p.offload].label
        return {
            "tp": self.layout.tp,
            "pp": self.layout.pp,
            "dp": self.layout.dp,
            "cp": self.layout.cp,
            "ep": self.layout.ep,
            "cp_mode": p.cp_mode if self.layout.cp > 1 else "",
            "sp": p.sequence_parallel,
            "dp_mode": mode,
            "schedule": p.schedule,
            "virtual_stages": p.virtual_stages,
            "pp_layers": layer_counts(self.cfg, self.layout.pp),
            "micro_batch_size": t.micro_batch_size,
            "micro_batches": micro_batches_per_step(t, self.layout.dp),
            "activation_checkpointing": t.activation_checkpointing,
            "peak_memory_gb": self.peak_bytes / 1e9,
            "host_gb": max(s.host for s in self.memory) / 1e9,
            "step_s": self.time.total,
            "tokens_per_s": self.time.tokens_per_s,
            "mfu": self.time.mfu,
            "bubble_s": self.time.bubble,
            "bubble_fraction": self.time.bubble_fraction,
            "activation_gb_per_stage": [s.activations / 1e9 for s in self.memory],
            "in_flight_per_stage": [s.in_flight for s in self.memory],
            "tp_comm_s": self.time.tp_comm,
            "pp_comm_s": self.time.pp_comm,
            "dp_comm_s": self.time.dp_comm,
            "cp_comm_s": self.time.cp_comm,
            "ep_comm_s": self.time.ep_comm,
            "fits": self.fits,
        }


def search(
    cfg: Config,
    world_size: int,
    hw: Hardware,
    schedules: tuple[tuple[str, int], ...] | None = None,
    refused: list[tuple[Layout, str]] | None = None,
    top: int = 0,
    counts: dict | None = None,
    keep=None,
) -> list[Candidate]:
    """Every valid layout (``schedules`` and ``refused`` as for layouts), planned; those that fit in
    hw.memory_gb first, each group by step time. ``top`` > 0: only the first ``top`` of those that fit, the same
    as the whole list's (see ``_best``), planning in full only the layouts a lower bound on the step time cannot
    rule out. ``counts``, if given, gets "valid" (layouts enumerated), "planned" (memory planned) and "timed"
    (step times simulated). ``keep``: layouts' predicate (only the configs it accepts are searched)."""
    counts = counts if counts is not None else {}
    memo: dict = {}
    plan = _best if top > 0 else _planned
    out = plan(cfg, world_size, hw, schedules, refused, top, memo, counts, None, keep)
    # offload only where nothing fits without
    if not OFFLOADS[cfg.parallel.offload].offloads and not any(c.fits for c in out):
        out += plan(cfg, world_size, hw, schedules, refused, top, memo, counts, "any", keep)
    out = sorted(out, key=lambda c: (not c.fits, c.time.total, c.peak_bytes))
    return out[:top] if top > 0 else out


def _cost_key(cfg: Config, layout: Layout) -> tuple:
    """What a layout's stage costs depend on within one search: its axes, schedule, micro-batch, checkpointing and
    the activations' dtype (activations.mode); not the dp mode's sharding, offload or resharding (dp_comm's)."""
    p, t = cfg.parallel, cfg.train
    return (layout, p.cp_mode, p.schedule, p.virtual_stages, repr(p.pp_layers), p.sequence_parallel) + (
        t.micro_batch_size,
        t.activation_checkpointing,
        activation_mode(cfg),
    )


def _worst(cfg: Config, layout: Layout, hw: Hardware, memo: dict) -> StageCost:
    """worst_stage, memoised over one search: the dp modes of a layout share it."""
    key = _cost_key(cfg, layout)
    if key not in memo:
        memo[key] = worst_stage(cfg, layout, hw)
    return memo[key]


def _candidate(cfg: Config, world_size: int, hw: Hardware, layout: Layout, memory: list, memo: dict) -> Candidate:
    cand = Candidate(cfg, layout, memory, step_time(cfg, world_size, hw, layout, _worst(cfg, layout, hw, memo)))
    cand.fits = cand.peak_bytes <= hw.memory_gb * 1e9
    return cand


def _dominated(cfg: Config, world_size: int, hw: Hardware, layout: Layout, memo: dict) -> bool:
    """FSDP's no-sync trade (parallel.fsdp_grad_accumulation=unsharded: whole fp32 gradients for one reduce-scatter
    a step) planned no faster than the same layout with sharded gradients, which holds less: never the better
    choice, so the search leaves it out rather than list it beside its twin. Only fsdp's variants take it
    (engine/planning/dp.py)."""
    if cfg.parallel.fsdp_grad_accumulation != "unsharded":
        return False
    twin = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, fsdp_grad_accumulation="sharded"))
    worst = _worst(cfg, layout, hw, memo)
    return step_time(cfg, world_size, hw, layout, worst).total >= step_time(twin, world_size, hw, layout, worst).total


def _planned(cfg: Config, world_size: int, hw: Hardware, schedules, refused, top, memo, counts, offload, keep) -> list:
    """Every layout planned in full (search with top 0)."""
    out = []
    for c, layout in layouts(cfg, world_size, schedules, refused, offload, keep):
        if not _dominated(c, world_size, hw, layout, memo):
            out.append(_candidate(c, world_size, hw, layout, plan_memory(c, world_size, layout=layout), memo))
    for name in ("valid", "planned", "timed"):
        counts[name] = counts.get(name, 0) + len(out)
    return out


# A lower bound is compared with step times as (1 - BOUND_SLACK) of itself: the makespan extrapolated past the
# simulated micro-batches (schedules.makespan_and_idle), or the mean of the stages' FLOPs, may round below the
# busy time by a few ulps.
BOUND_SLACK = 1e-9


def lower_bound(cfg: Config, layout: Layout, hw: Hardware, worst: StageCost) -> float:
    """Seconds no step of the layout can beat: the slowest stage's rank computes every micro-batch's forward and
    backward one after another (its busy time: the makespan adds its idle time), then the exposed dp
    communication (step_time's own)."""
    busy = micro_batches_per_step(cfg.train, layout.dp) * worst.total
    return busy * (1 - BOUND_SLACK) + dp_time(cfg, layout, hw, worst)


def compute_bound(cfg: Config, layout: Layout, hw: Hardware) -> float:
    """A lower bound below lower_bound's, without planning a stage: the slowest stage computes at least the
    mean of the stages' FLOPs (stage_cost's compute, whose other parts are communication, all >= 0)."""
    t = cfg.train
    tokens = t.micro_batch_size * t.seq_len // layout.cp
    model = flops.stage_flops_per_token(cfg.model, t.seq_len, cfg.model.num_layers, True, t.activation_checkpointing)
    rate = hw.peak_tflops * 1e12 * hw.efficiency * layout.tp
    busy = micro_batches_per_step(t, layout.dp) * (tokens * model / rate / layout.pp)
    return busy * (1 - BOUND_SLACK)


def _best(cfg: Config, world_size: int, hw: Hardware, schedules, refused, top, memo, counts, offload, keep) -> list:
    """The ``top`` fastest layouts that fit, as the whole search would rank them (step time, then peak memory, then
    the order of enumeration), or every one that fits if fewer do. Layouts are taken by their lower bound, least
    first (compute_bound until a layout comes up, then lower_bound): each is planned stage by stage, dropped at the
    first stage over hw.memory_gb, and timed only if it fits; once ``top`` fit, a layout whose bound exceeds the
    ``top``-th step time cannot enter, nor any after it."""
    found = list(layouts(cfg, world_size, schedules, refused, offload, keep))
    queue = [(compute_bound(c, layout, hw), False, i) for i, (c, layout) in enumerate(found)]
    heapq.heapify(queue)
    fitting: list[tuple[float, float, int]] = []  # (step time, peak bytes, index), kept sorted
    kept: dict[int, Candidate] = {}
    while queue and not (len(fitting) >= top and queue[0][0] > fitting[top - 1][0]):
        _, tight, i = heapq.heappop(queue)
        c, layout = found[i]
        if not tight:  # the stages' costs now: a tighter bound, back in the queue
            heapq.heappush(queue, (lower_bound(c, layout, hw, _worst(c, layout, hw, memo)), True, i))
            continue
        if _dominated(c, world_size, hw, layout, memo):
            continue
        memory = _memory_within(c, world_size, layout, hw.memory_gb * 1e9)
        counts["planned"] = counts.get("planned", 0) + 1
        if memory is None:
            continue
        kept[i] = _candidate(c, world_size, hw, layout, memory, memo)
        counts["timed"] = counts.get("timed", 0) + 1
        bisect.insort(fitting, (kept[i].time.total, kept[i].peak_bytes, i))
    counts["valid"] = counts.get("valid", 0) + len(found)
    return [kept[i] for _, _, i in fitting[:top]]


def _memory_within(cfg: Config, world_size: int, layout: Layout, limit: float) -> list[StageMemory] | None:
    """plan_memory's stages, or None at the first stage whose peak is over ``limit`` bytes."""
    memory = []
    for stage in range(layout.pp):
        memory.append(stage_memory(cfg, world_size, stage, layout=layout))
        if memory[-1].total > limit:
            return None
    return memory
