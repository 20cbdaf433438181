"""Each dp mode's planner model: the bytes one rank holds per parameter (weights, gradients, optimizer state, sharded or
not; Rajbhandari et al. 2020, "ZeRO", Sec. 5), what it gathers and buffers, what it offloads, its exposed
communication per step, and the variants the layout search tries. Its DpModeSpec names its class
(engine/kinds/dp_modes.py; ``model_class`` below resolves it); engine/planning/planner.py and search.py call these
methods and never compare a mode's name; a mode without one is refused by the planner (planner.dp_model). The
formulas are explained in those two modules' docstrings; this file only says which applies to which mode.

Methods, each (cfg, layout, ...): ``state(params, micro_batches)`` -> (weights, grads, optimizer) bytes;
``step_buffers(params, adamw)``: temporaries of the optimizer step (``adamw``: one of ADAMW); ``buffers(params)`` ->
(gathered weights, gradient bucket); ``offloaded(local, parts)`` -> (weights, grads, optimizer, step_buffers, host);
``dp_comm(hw, params, micro_batches, compute_mb, last)``: exposed seconds (``last``: the parameters reduced last, after
the backward); ``label``: its name in tables. Attributes: ``shards`` (sharding over one rank changes nothing, so the
search tries only non-sharding modes at dp = 1), ``grads_whole_step(layout)`` (gradients held through the whole step,
from the previous update: ddp's bucket views; ``layout``: the data layout, dp x cp), ``per_tensor_step`` (AdamW's fp32
step counter per parameter tensor), ``variants(offload)``: the (zero_stage, reshard_after_forward, offload,
fsdp_grad_accumulation) it is searched with. Under expert parallelism the planner calls the methods once for the
dense weights and once for this rank's experts with the expert-dp group as ``layout.dp`` (engine/planning/planner.py
state_groups); ``experts_overlap``: whether the experts' reduction overlaps the backward as the dense one does (ddp:
no, it runs after the backward).
"""

from __future__ import annotations

from engine.kinds.dp_checks import fsdp_unsharded_grads
from engine.kinds.dp_modes import DpModeSpec
from engine.kinds.ds_config import load_base_config, offload_of
from engine.kinds.offload import OFFLOADS
from engine.parallel.layout.checks import reshard_after_forward
from engine.planning.links import link_bandwidth, ring_time

# bytes per parameter: (weights, gradients, optimizer state)
PRECISIONS = {
    "mixed": (2, 2, 12),
    "fp32": (4, 4, 8),
    "fp32_master": (4, 4, 12),  # DeepSpeed ZeRO in fp32: a flat fp32 master partition besides the weights
    "bf16_fp32_grads": (2, 4, 12),
}  # DeepSpeed bf16 with grad_accum_dtype fp32 (engine/parallel/dp/zero.py)


def model_state_bytes(params: int, dp: int, zero_stage: int, precision: str = "mixed") -> float:
    """Bytes of weights + gradients + optimizer state held by one rank for ``params`` parameters over ``dp``
    data-parallel ranks at ZeRO ``zero_stage`` (0 = plain data parallelism; FSDP with resharding is stage 3)."""
    return sum(model_state_parts(params, dp, zero_stage, precision))


def model_state_parts(params: int, dp: int, zero_stage: int, precision: str = "mixed") -> tuple[float, ...]:
    """(weights, gradients, optimizer state) bytes of model_state_bytes, in that order."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} is not one of 0, 1, 2, 3")
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    w, g, k = PRECISIONS[precision]
    # ZeRO's stage s shards the last s of (optimizer state, gradients, weights).
    return (
        params * w / (dp if zero_stage >= 3 else 1),
        params * g / (dp if zero_stage >= 2 else 1),
        params * k / (dp if zero_stage >= 1 else 1),
    )


def overlapped(reduce: float, compute_mb: float, last: float) -> float:
    """Exposed seconds of a gradient reduction issued during one micro-batch's backward (~2/3 of its ``compute_mb``,
    the forward being 1/3), as torch DDP's buckets and FSDP's per-block reduce-scatters run: what the backward
    cannot hide, and at least the ``last`` piece's, which starts only as the backward ends."""
    return max(reduce - 2.0 / 3.0 * compute_mb, last)


def group_span(layout) -> int:
    """Consecutive global ranks the reduction group spans: its dp ranks (dp x cp for the dense weights, ``layout``
    from planner.data_layout), tp apart, and for the experts (engine/planning/ep.py expert_layout) the expert-dp
    ranks, ep of those apart."""
    return layout.tp * layout.dp * layout.ep


# torch AdamW's implementations (engine.optim.adamw_implementation picks "fused" on CUDA and on CPU, "foreach" for
# parameters on mixed devices; "loop" is torch's per-tensor default) and their temporaries in the step
ADAMW = ("fused", "foreach", "loop")


class TorchAdamWModel:
    """What ddp and fsdp share: torch AdamW on fp32 weights, nothing offloaded, nothing gathered; the step's
    temporaries those of the AdamW that runs (``step_buffers``)."""

    shards, per_tensor_step, experts_overlap = False, True, True

    def grads_whole_step(self, layout) -> bool:
        return False

    def step_buffers(self, cfg, layout, params: dict, adamw: str) -> float:
        """The fused kernel: none (it reads each parameter, gradient and moment once and writes in place); foreach:
        a sqrt buffer per parameter group, ~4 bytes per local parameter; the per-tensor loop: ~2 of the largest
        tensor."""
        if adamw not in ADAMW:
            raise ValueError(f"adamw={adamw!r} is not one of {', '.join(ADAMW)}")
        if adamw == "fused":
            return 0.0
        m = cfg.model
        shard = layout.dp if self.shards else 1
        local = params["layers"] + params["root"]
        largest = max(
            m.hidden_size * max(m.intermediate_size, m.num_heads * m.head_dim) // layout.tp,
            m.vocab_size * m.hidden_size // layout.tp if params["root"] > m.hidden_size else 0,
        )
        return 4.0 * local / shard if adamw == "foreach" else 8.0 * largest / shard

    def buffers(self, cfg, layout, params: dict) -> tuple[float, float]:
        return 0.0, 0.0

    def offloaded(self, cfg, layout, local: int, parts: tuple) -> tuple[float, ...]:
        return (*parts, 0.0)


class DDPModel(TorchAdamWModel):
    """ZeRO stage 0 in fp32; its gradients are views into DDP's buckets (at dp x cp > 1), held through the whole
    step, and its reduction adds no buffer. Expert gradients stay out of the buckets: one all-reduce over expert-dp
    after the backward (engine/parallel/ep/__init__.py reduce_expert_gradients)."""

    experts_overlap = False

    def grads_whole_step(self, layout) -> bool:
        """The bucket views exist where DDP wraps the stage, dp x cp > 1; at 1 the gradients are freed after each
        update (engine/parallel/dp/ddp.py) and appear chunk by chunk at the first backward, as in the other modes."""
        return layout.dp > 1

    def variants(self, offload: str) -> list[tuple[int, str, str, str]]:
        return [] if OFFLOADS[offload].offloads else [(0, "auto", offload, "sharded")]

    def label(self, cfg, layout) -> str:
        return cfg.parallel.dp_mode

    def state(self, cfg, layout, params: int, micro_batches: int) -> tuple[float, float, float]:
        return model_state_parts(params, layout.dp, 0, "fp32")

    def dp_comm(self, cfg, layout, hw, params: int, micro_batches: int, compute_mb: float, last: int = 0) -> float:
        """Buckets reduce during the last micro-batch's backward; the last bucket's all-reduce starts only when
        backward ends."""
        d, bw, lat = layout.dp, link_bandwidth(hw, group_span(layout)), hw.latency_us
        grads = 4.0 * params
        bucket = min(grads, cfg.parallel.bucket_mb * 2**20)
        return overlapped(ring_time(grads, d, 2, bw, lat), compute_mb, ring_time(bucket, d, 2, bw, lat))


class FSDPModel(TorchAdamWModel):
    """ZeRO stage 3 in fp32: gradients reduce-scattered every micro-batch into the sharded fp32 gradient
    (parallel.fsdp_grad_accumulation=sharded), or held unsharded until the last micro-batch (unsharded: no-sync
    accumulation; zero bubble and zbv always: engine/kinds/dp_checks.py ``fsdp_unsharded_grads``), the gathered
    weights extra (one block plus the root unit with reshard_after_forward, the whole stage without);
    CPUOffloadPolicy moves the sharded weights, gradients, AdamW state and its temporaries to the host."""

    shards = True

    def variants(self, offload: str) -> list[tuple[int, str, str, str]]:
        """Resharding after forward or not, each with the gradients accumulated sharded or unsharded (the no-sync
        trade: one reduce-scatter a step for 4 bytes a parameter; the search drops it where the step has one
        micro-batch or the schedule accumulates unsharded anyway, engine/planning/layouts.py); offloaded, the
        sharded ones (the host holds the sharded gradient)."""
        spec = OFFLOADS[offload]
        if spec.optimizer != spec.params:  # CPUOffloadPolicy moves weights, gradients and Adam state together
            return []
        if spec.offloads:
            return [(0, "true", offload, "sharded")]
        return [(0, reshard, offload, acc) for reshard in ("true", "false") for acc in ("sharded", "unsharded")]

    def label(self, cfg, layout) -> str:
        nosync = "-nosync" if cfg.parallel.fsdp_grad_accumulation == "unsharded" else ""
        return cfg.parallel.dp_mode + ("-reshard" if reshard_after_forward(cfg, layout.pp) else "-keep") + nosync

    def state(self, cfg, layout, params: int, micro_batches: int) -> tuple[float, float, float]:
        weights, grads, optimizer = model_state_parts(params, layout.dp, 3, "fp32")
        if micro_batches > 1 and fsdp_unsharded_grads(cfg):
            grads = 4.0 * params  # accumulated unsharded (fp32 reduce dtype) until the last micro-batch's backward
        return weights, grads, optimizer

    def buffers(self, cfg, layout, params: dict) -> tuple[float, float]:
        # offloaded: gathered from the host even at dp 1
        if layout.dp == 1 and not OFFLOADS[cfg.parallel.offload].offloads:
            return 0.0, 0.0
        # The root unit (embedding, norm, head) is never resharded after forward; the blocks are, with
        # reshard_after_forward: then one is gathered at the peak (the last one as the backward starts; later
        # FSDP2 prefetches the next while freed activations make room). Without it every block stays gathered.
        blocks = params["layer"] if reshard_after_forward(cfg, layout.pp) else params["layers"]
        return (2 if cfg.train.dtype == "bf16" else 4) * (params["root"] + blocks), 0.0

    def offloaded(self, cfg, layout, local: int, parts: tuple) -> tuple[float, ...]:
        weights, grads, optimizer, step_buffers = parts
        if not OFFLOADS[cfg.parallel.offload].params:
            return (*parts, 0.0)
        sharded_grads = 4.0 * local / layout.dp
        on_device = grads if grads > sharded_grads else 0.0  # the no-sync accumulation buffer (several micro-batches)
        return 0.0, on_device, 0.0, 0.0, weights + sharded_grads + optimizer + step_buffers

    def dp_comm(self, cfg, layout, hw, params: int, micro_batches: int, compute_mb: float, last: int = 0) -> float:
        """An all-gather per micro-batch forward (and backward with resharding) that prefetch overlaps with compute,
        and the gradient reduce-scatter: the last micro-batch's (unsharded accumulation), or every micro-batch's,
        all but the last overlapping the next micro-batches' compute as the all-gathers do. The last micro-batch's
        runs unit by unit as each block's backward ends: overlapped with the rest of that backward, all but the
        ``last`` parameters' (the first block's and the root unit's)."""
        d, bw, lat = layout.dp, link_bandwidth(hw, group_span(layout)), hw.latency_us
        weights = (2.0 if cfg.train.dtype == "bf16" else 4.0) * params
        gathers = 1 + reshard_after_forward(cfg, layout.pp)
        gather, reduce = gathers * ring_time(weights, d, 1, bw, lat), ring_time(4.0 * params, d, 1, bw, lat)
        exposed_gather = max(0.0, gather - compute_mb)
        last_reduce = overlapped(reduce, compute_mb, ring_time(4.0 * last, d, 1, bw, lat))
        if micro_batches == 1 or fsdp_unsharded_grads(cfg):
            return micro_batches * exposed_gather + last_reduce
        return (micro_batches - 1) * max(0.0, gather + reduce - compute_mb) + exposed_gather + last_reduce


class ZeroModel:
    """DeepSpeed ZeRO stage k with its fp32 master copy (K = 12; bf16 weights and fp32 gradients in bf16 runs),
    one step counter per flat group, its own buckets (kinds/ds_config.py) and its offload (ZeRO-Offload)."""

    shards, per_tensor_step, experts_overlap = True, False, True

    def grads_whole_step(self, layout) -> bool:
        return False

    def variants(self, offload: str) -> list[tuple[int, str, str, str]]:
        stages = (3,) if OFFLOADS[offload].params else (1, 2, 3)  # DeepSpeed offloads parameters only in ZeRO-3
        return [(stage, "auto", offload, "sharded") for stage in stages]

    def label(self, cfg, layout) -> str:
        return f"{cfg.parallel.dp_mode}-{cfg.parallel.zero_stage}"

    def state(self, cfg, layout, params: int, micro_batches: int) -> tuple[float, float, float]:
        precision = "bf16_fp32_grads" if cfg.train.dtype == "bf16" else "fp32_master"
        return model_state_parts(params, layout.dp, cfg.parallel.zero_stage, precision)

    def step_buffers(self, cfg, layout, params: dict, adamw: str) -> float:
        return 0.0  # DeepSpeed's own buffers (reduce/all-gather buckets): ``buffers``

    def buffers(self, cfg, layout, params: dict) -> tuple[float, float]:
        """(gathered weights, gradient bucket) from DeepSpeed's settings (parallel.ds_config merged): a reduce bucket
        of reduce_bucket_size gradients (fp32 here) in stages 2 and 3; under stage 3 the module being run plus the
        prefetch bucket of weights. Not measured on CPU: DeepSpeed allocates inside its own engine."""
        stage, local = cfg.parallel.zero_stage, params["layers"] + params["root"]
        zero = load_base_config(stage, cfg.parallel.ds_config or None).get("zero_optimization", {})
        bucket = 4.0 * min(local, int(zero.get("reduce_bucket_size", 5e8))) if stage >= 2 else 0.0
        gathered = 0.0
        if stage == 3:
            w = 2 if cfg.train.dtype == "bf16" else 4
            prefetch = int(zero.get("stage3_prefetch_bucket_size", 5e7))
            gathered = w * min(local, params["layer"] + params["root"] + prefetch)
        return gathered, bucket

    def offloaded(self, cfg, layout, local: int, parts: tuple) -> tuple[float, ...]:
        """The host holds the fp32 master weights, Adam moments and fp32 gradient partition (K P / N + 4 P / N),
        with offload_param also the 16-bit weight partition."""
        p = cfg.parallel
        weights, grads, optimizer, step_buffers = parts
        if p.zero_stage not in (1, 2, 3):
            return (*parts, 0.0)
        opt, params = offload_of(p.zero_stage, p.ds_config or None, p.offload)
        if not opt:
            return (*parts, 0.0)
        host = optimizer + 4.0 * local / layout.dp
        if p.zero_stage >= 2:
            grads = 0.0  # reduced bucket by bucket (the bucket is in ``buffers``) into the host partition
        if params:
            host, weights = host + weights, 0.0
        return weights, grads, 0.0, step_buffers, host

    def dp_comm(self, cfg, layout, hw, params: int, micro_batches: int, compute_mb: float, last: int = 0) -> float:
        """Stage 1 all-reduces gradients once, stage 2 reduce-scatters every micro-batch, stage 3 also all-gathers
        weights forward and backward; stages 1-2 all-gather the updated weights (overlap_comm off)."""
        d, bw, lat, stage = layout.dp, link_bandwidth(hw, group_span(layout)), hw.latency_us, cfg.parallel.zero_stage
        grads, weights = 4.0 * params, (2.0 if cfg.train.dtype == "bf16" else 4.0) * params
        reduce = ring_time(grads, d, 2, bw, lat) if stage == 1 else micro_batches * ring_time(grads, d, 1, bw, lat)
        gather = ring_time(weights, d, 1, bw, lat) * (2 * micro_batches if stage == 3 else 1)
        return reduce + gather


# The planner models a DpModeSpec.planner may name (engine/kinds/dp_modes.py): a new dp mode adds its class here.
MODELS = {c.__name__: c for c in (DDPModel, FSDPModel, ZeroModel)}


def model_class(spec: DpModeSpec) -> type:
    """The planner model class ``spec.planner`` names."""
    if spec.planner not in MODELS:
        raise LookupError(f"dp mode {spec.name}: no planner model {spec.planner!r} (one of {', '.join(MODELS)})")
    return MODELS[spec.planner]
