"""Step-time estimates and the layout search behind ``launch/plan.py``.

``step_time`` models one optimizer step of a layout as
    (m + p - 1) * t_mb  +  exposed dp communication
where t_mb is the slowest stage's time for one micro-batch, forward and backward: its FLOPs (engine/planning/flops.py,
recomputation included) at ``efficiency`` of the device peak, its tensor-parallel all-reduces, and its two
pipeline transfers. (m + p - 1) * t_mb is the 1F1B / GPipe makespan whose bubble is (p - 1) / (m + p - 1)
(Narayanan et al. 2021, Sec. 2.2.1). Collectives are rings over ``n`` ranks (Thakur et al. 2005): all-reduce moves
2 (n-1)/n of the bytes per rank, reduce-scatter and all-gather (n-1)/n each, plus a latency per ring step. A
group whose ranks fit in one node (tp fastest, then dp, then pp: engine/parallel/context.py) uses the intra-node
bandwidth, otherwise the inter-node one.

What is counted, per engine path: tp: the plan table of engine/parallel/tensor.py (one all-reduce forward per
row-parallel linear, one backward per column-parallel linear, none fused); ddp: torch DDP's bucketed gradient
all-reduce, overlapped with the last micro-batch's backward except the last bucket; fsdp: an all-gather per micro-batch forward (and another in backward with
reshard_after_forward) that overlaps compute, and the gradient reduce-scatter of the last micro-batch; zero k
(DeepSpeed, overlap_comm off in engine/parallel/dp/ds_json.py): stage 1 all-reduces gradients once, stage 2
reduce-scatters every micro-batch, stage 3 also all-gathers weights forward and backward, and stages 1-2
all-gather the updated weights. Not modelled: the optimizer update, data loading, kernel launch overheads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.planning import flops
from engine.planning.activations import sequence_share
from engine.config import Config, ConfigError
from engine.parallel.support import Layout, micro_batches_per_step, resolve_layout
from engine.parallel.tensor import LAYER_PLAN
from engine.parallel.support import reshard_after_forward
from engine.planning.planner import StageMemory, plan_memory, stage_params, with_layout


@dataclass
class Hardware:
    """One device and its links. Defaults: an H100 SXM node (NVLink 4 at 450 GB/s per direction, 8 per node,
    400 Gb/s InfiniBand per GPU between nodes)."""
    peak_tflops: float = 989.0  # dense TFLOP/s of one device in the training dtype (engine.planning.flops.peak_tflops)
    efficiency: float = 0.5  # fraction of the peak that the matmuls achieve
    memory_gb: float = 80.0  # device memory per rank, GB (1e9 bytes)
    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0  # GB/s per device per direction inside a node
    inter_node_gbps: float = 50.0  # GB/s per device between nodes
    latency_us: float = 10.0  # per ring step


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


def _ring(nbytes: float, n: int, passes: float, bw_gbps: float, latency_us: float) -> float:
    """Seconds for a ring collective moving ``passes`` * (n-1)/n of ``nbytes`` per rank (2 for all-reduce)."""
    if n <= 1:
        return 0.0
    return passes * (n - 1) / n * nbytes / (bw_gbps * 1e9) + passes * (n - 1) * latency_us * 1e-6


def _bandwidth(hw: Hardware, span: int) -> float:
    """The link a group of consecutive-rank ``span`` uses."""
    return hw.intra_node_gbps if span <= hw.gpus_per_node else hw.inter_node_gbps


def _dp_comm(cfg: Config, layout: Layout, hw: Hardware, params: int, micro_batches: int,
             compute_mb: float) -> float:
    """Exposed data-parallel communication of one step (see the module docstring)."""
    p, d = cfg.parallel, layout.dp
    bw, lat = _bandwidth(hw, layout.tp * d), hw.latency_us
    grads = 4.0 * params  # fp32 gradients (DeepSpeed bf16 accumulates in fp32 here too)
    weights = (2.0 if cfg.train.dtype == "bf16" else 4.0) * params
    if p.dp_mode == "ddp":  # buckets reduce during the last micro-batch's backward (~2/3 of its compute);
        # the last bucket's all-reduce starts only when backward ends
        bucket = min(grads, p.bucket_mb * 2**20)
        return max(_ring(grads, d, 2, bw, lat) - 2.0 / 3.0 * compute_mb, _ring(bucket, d, 2, bw, lat))
    if p.dp_mode == "fsdp":
        gathers = 1 + reshard_after_forward(cfg, layout.pp)
        hidden = max(0.0, gathers * _ring(weights, d, 1, bw, lat) - compute_mb)  # prefetch overlaps compute
        return micro_batches * hidden + _ring(grads, d, 1, bw, lat)
    stage = p.zero_stage
    reduce = _ring(grads, d, 2, bw, lat) if stage == 1 else micro_batches * _ring(grads, d, 1, bw, lat)
    gather = 2 * micro_batches * _ring(weights, d, 1, bw, lat) if stage == 3 else _ring(weights, d, 1, bw, lat)
    return reduce + gather


def step_time(cfg: Config, world_size: int, hw: Hardware) -> StepTime:
    """Estimated seconds of one optimizer step of the configured layout (see the module docstring)."""
    layout = resolve_layout(cfg, world_size)
    t, m = cfg.train, cfg.model
    micro_batches = micro_batches_per_step(t, layout.dp)
    tokens = t.micro_batch_size * t.seq_len
    act = tokens * m.hidden_size * (2 if cfg.train.dtype == "bf16" else 4)  # one (mbs, s, h) activation
    rows = sum(style == "row" for style in LAYER_PLAN.values())
    columns = len(LAYER_PLAN) - rows
    tp_bw, pp_bw = _bandwidth(hw, layout.tp), _bandwidth(hw, layout.world_size)
    worst = None
    for stage in range(layout.pp):
        params = stage_params(cfg, layout.tp, layout.pp, stage)
        first, last = stage == 0, stage == layout.pp - 1
        stage_flops = flops.stage_flops_per_token(m, t.seq_len, params["num_layers"], last,
                                                  t.activation_checkpointing) / layout.tp
        compute = tokens * stage_flops / (hw.peak_tflops * 1e12 * hw.efficiency)
        # Forward: rows + embedding all-reduces; backward: columns + the LM head's input (recomputation, full or
        # selective, repeats the forward ones: engine/model/recompute.py).
        recomputes = t.activation_checkpointing != "none"
        n_ar = params["num_layers"] * (rows * (1 + recomputes) + columns) + first + last
        tp_comm = n_ar * _ring(act, layout.tp, 2, tp_bw, hw.latency_us)
        sent = act / sequence_share(cfg, layout.tp)  # (b, s/tp, h) between stages under sequence parallelism
        pp_comm = 0.0 if layout.pp == 1 else 2 * (sent / (pp_bw * 1e9) + hw.latency_us * 1e-6)
        row = (compute + tp_comm + pp_comm, compute, tp_comm, pp_comm, params)
        worst = row if worst is None or row[0] > worst[0] else worst
    t_mb, compute, tp_comm, pp_comm, params = worst
    slots = micro_batches + layout.pp - 1
    dp = _dp_comm(cfg, layout, hw, params["layers"] + params["root"], micro_batches, compute)
    total = slots * t_mb + dp
    tokens_per_s = t.global_batch_size * t.seq_len / total
    mfu = flops.mfu(tokens_per_s / world_size, flops.flops_per_token(m, t.seq_len), hw.peak_tflops) or 0.0
    return StepTime(micro_batches * compute, micro_batches * tp_comm, micro_batches * pp_comm,
                    (layout.pp - 1) * t_mb, dp, total, tokens_per_s, mfu)


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
        mode = p.dp_mode + (f"-{p.zero_stage}" if p.dp_mode == "zero" else "")
        if p.dp_mode == "fsdp":
            mode += "-reshard" if reshard_after_forward(self.cfg, self.layout.pp) else "-keep"
        return {"tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp, "dp_mode": mode,
                "micro_batch_size": t.micro_batch_size,
                "micro_batches": micro_batches_per_step(t, self.layout.dp),
                "activation_checkpointing": t.activation_checkpointing, "peak_memory_gb": self.peak_bytes / 1e9,
                "step_s": self.time.total, "tokens_per_s": self.time.tokens_per_s, "mfu": self.time.mfu,
                "bubble_s": self.time.bubble, "tp_comm_s": self.time.tp_comm, "pp_comm_s": self.time.pp_comm,
                "dp_comm_s": self.time.dp_comm, "fits": self.fits}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


DP_MODES = [("ddp", 0, "auto"), ("fsdp", 0, "true"), ("fsdp", 0, "false"), ("zero", 1, "auto"),
            ("zero", 2, "auto"), ("zero", 3, "auto")]


def layouts(cfg: Config, world_size: int):
    """Every valid (tp, pp, dp, dp mode, micro-batch size, activation checkpointing) of ``cfg`` on ``world_size``
    ranks, as configs. Validity is engine.parallel.support.resolve_layout's; at dp = 1 only ddp
    (sharding over one rank changes nothing)."""
    gbs = cfg.train.global_batch_size
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if gbs % dp:
                continue
            pp_layers = cfg.parallel.pp_layers if pp == cfg.parallel.pp else []
            for mbs in _divisors(gbs // dp):
                for mode, stage, reshard in DP_MODES if dp > 1 else DP_MODES[:1]:
                    for ac in ("none", "full", "selective"):
                        c = with_layout(cfg, tp=tp, pp=pp, dp=dp, dp_mode=mode, zero_stage=stage,
                                        reshard_after_forward=reshard, pp_layers=pp_layers, micro_batch_size=mbs,
                                        activation_checkpointing=ac)
                        try:
                            layout = resolve_layout(c, world_size)  # refuses unsupported combinations too
                        except ConfigError:
                            continue
                        yield c, layout


def search(cfg: Config, world_size: int, hw: Hardware) -> list[Candidate]:
    """Every valid layout, planned; those that fit in hw.memory_gb first, each group by step time."""
    out = []
    for c, layout in layouts(cfg, world_size):
        memory = plan_memory(c, world_size)
        cand = Candidate(c, layout, memory, step_time(c, world_size, hw))
        cand.fits = cand.peak_bytes <= hw.memory_gb * 1e9
        out.append(cand)
    return sorted(out, key=lambda c: (not c.fits, c.time.total, c.peak_bytes))
