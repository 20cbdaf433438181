"""Memory per rank of a layout. Model-state bytes follow Rajbhandari et al. 2020 ("ZeRO", Sec. 5, Fig. 1).

With mixed precision and Adam, each parameter costs 2 bytes of 16-bit weight, 2 of 16-bit gradient and K = 12 of
optimizer state (fp32 master weight, momentum, variance): 16 bytes in all. ZeRO stage 1 shards the optimizer state
over the N data-parallel ranks, stage 2 also the gradients, stage 3 also the weights:
    stage 0: (2 + 2 + K) P      stage 1: (2 + 2) P + K P / N
    stage 2: 2 P + (2 + K) P / N    stage 3: (2 + 2 + K) P / N
In fp32 training (as on CPU) weights and gradients take 4 bytes each and Adam's two moments 8, with no master copy.

``stage_memory(cfg, world_size, stage)`` applies this to what THIS engine holds on one rank of a pipeline stage:
- parameters: the stage's layers (engine.planning.balance.rank_layers: every chunk's, under a chunked schedule), the
  embedding on the first stage,
  final norm and LM head on the last (a tied head is a second copy there when pp > 1); linears and the vocab
  split by tp as engine/parallel/tp/layers.py's plan does, norms replicated.
- state by dp mode, from the mode's planner model (engine/planning/dp.py, named by its DpModeSpec; a
  mode without one is refused, never priced as another): ddp = stage 0 and fsdp = stage 3 with fp32 weights,
  gradients and AdamW moments (bf16 is autocast or FSDP's bf16 compute copy); under fsdp, gradients are
  reduce-scattered every micro-batch and stay sharded (parallel.fsdp_grad_accumulation=sharded), or stay unsharded
  until the last micro-batch (unsharded, and zero bubble / zbv: no-sync accumulation, 4 bytes per parameter), and
  the gathered weights are extra: one block plus the root unit with reshard_after_forward, the whole stage without.
  zero k = stage k with DeepSpeed's fp32 master copy (K = 12; bf16 weights in bf16 runs).
- expert parallelism (parallel.ep): a rank holds E/ep experts of each MoE layer (stage_params "experts"), their
  state priced by the same dp-mode model over the expert-dp group of dp cp / ep ranks (``state_groups``,
  engine/planning/ep.py), the dense weights over dp cp as above.
- activations: engine/planning/activations.py per micro-batch (per model chunk under interleaving), summed over
  what the schedule's action table keeps in flight on the stage (engine/planning/schedules.py: 1F1B keeps
  min(pp - stage, m), GPipe m, interleaved warmup + 1 chunks, ZB-H1 1F1B's until B, then W states until W).
  Interleaving moves no parameter but the layers (each virtual stage its run, even or parallel.pp_layers'), and
  the embedding and head stay on ranks 0 and pp-1.
- gradients beside the activations: ddp's are bucket views at dp x cp > 1, held from the previous update through
  the whole step; otherwise (ddp at dp x cp 1 frees them after each update, the other modes) each model chunk's
  appear at that chunk's first backward (its B under zero bubble: the LM head and norms are not split), its share of
  the stage's by parameter count (``chunk_shares``), so an interleaved rank's first backward, of its last chunk,
  does not yet hold the earlier chunks' gradients.
- offload (parallel.offload, or the DeepSpeed file's offload keys; Ren et al. 2021, "ZeRO-Offload"): what moves to
  host memory is counted in ``host``, not in the device fields. zero: the fp32 master weights, Adam moments and the
  fp32 gradient partition (K P / N + 4 P / N), ZeRO-3's offload_param also the 16-bit weight partition; the
  device keeps the 16-bit weights (stages 1-2), ZeRO-1's whole gradients and the buckets. fsdp (CPUOffloadPolicy):
  the sharded weights, gradients, AdamW state and its temporaries; the device keeps the gathered weights and,
  with several micro-batches under unsharded accumulation, the unsharded accumulated gradients.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from engine.config import Config, ConfigError, ModelConfig
from engine.kinds import dp_modes
from engine.kinds.families import FAMILIES
from engine.model.moe import is_moe_layer
from engine.parallel.layout.checks import Layout, micro_batches_per_step, resolve_layout
from engine.planning import activations as acts
from engine.planning import cp as cp_plan
from engine.planning import ep as ep_plan
from engine.planning.balance import rank_layers
from engine.planning.dp import model_class
from engine.planning.moe import expert_params, mlp_params
from engine.planning.schedules import activations_in_flight, head_stage, one_embedding, rank_chunks, virtual_stages


def layer_params(m: ModelConfig, tp: int, index: int = 0) -> tuple[int, int]:
    """(tp-sharded, replicated) parameter counts of decoder layer ``index`` on one tp rank: q, k, v, o and gate,
    up, down are split by tp (LAYER_PLAN in engine/parallel/tp/layers.py), with the q/k/v biases where the model has
    them (model.attention_bias); the two RMSNorm weights are replicated. An MoE layer's experts and shared expert
    (engine/planning/moe.py) are split like the MLP and OLMoE's whole-projection q/k norms like q/k; the router,
    the shared expert's gate (engine/parallel/tp/moe.py) and Qwen3's per-head q/k norms (hd,) are replicated."""
    h, hd = m.hidden_size, m.head_dim
    router = (m.num_experts + bool(m.moe_shared_expert_size)) * h if is_moe_layer(m, index) else 0
    sharded = 2 * h * m.num_heads * hd + 2 * h * m.num_kv_heads * hd + mlp_params(m, index) - router
    if m.attention_bias:
        sharded += (m.num_heads + 2 * m.num_kv_heads) * hd
    qk_norm = FAMILIES[m.family].qk_norm
    if qk_norm == "projection":  # OLMoE's, split like q/k
        sharded += (m.num_heads + m.num_kv_heads) * hd
    replicated = 2 * h + router + (2 * hd if qk_norm == "head" else 0)  # Qwen3's per-head (hd,) q/k norms: whole
    return sharded // tp, replicated


def stage_params(cfg: Config, tp: int, pp: int, stage: int) -> dict[str, int]:
    """Parameters held by one tp rank of pipeline ``stage`` (before dp sharding): {"layers", "root"}, where root is
    the embedding / final norm / LM head that the stage holds (FSDP's root unit); "layer" the largest layer.
    "layers" and "layer" count this rank's E/ep experts (parallel.ep), "experts" and "expert_layer" those alone."""
    m, ep = cfg.model, cfg.parallel.ep
    indices = rank_layers(cfg, pp, stage)  # over the rank's chunks under a chunked schedule
    experts = [expert_params(m, i) // tp // ep for i in indices] or [0]  # this rank's slice of each layer's experts
    # a layer's weights with all E experts, less the (ep - 1)/ep of them held elsewhere
    sizes = [sum(layer_params(m, tp, i)) - expert_params(m, i) // tp + e for i, e in zip(indices, experts)] or [
        sum(layer_params(m, tp))
    ]
    n_layers = len(indices)
    vocab = m.vocab_size * m.hidden_size // tp  # embedding or LM head: vocab rows split by tp
    root = 0
    if stage == 0:
        root += vocab
    if stage == head_stage(cfg, pp):  # tied at pp=1 or in zbv's V: one tensor
        root += m.hidden_size + (0 if one_embedding(cfg, pp) else vocab)
    return {
        "layers": sum(sizes) if n_layers else 0,
        "root": root,
        "num_layers": n_layers,
        "layer": max(sizes),
        "experts": sum(experts) if n_layers else 0,
        "expert_layer": max(experts),
    }


@dataclass
class StageMemory:
    """Bytes one rank of a pipeline stage holds. ``activations``: the most saved for backward at once (the
    micro-batches, or chunk micro-batches, in flight: ``in_flight`` of them; zero bubble's W state included);
    ``buffers``: short-lived ones in the backward (logits and their gradient on the last
    stage, a layer's gradients, a recomputed layer); ``step_buffers``: those of the step after the backward, when
    activations are gone (AdamW's temporaries). ``new_at_peak``: what the forward /
    backward allocates at its peak (activations, gradients, buffers), from the schedule."""

    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    gathered: float
    buffers: float
    step_buffers: float
    in_flight: int
    new_at_peak: float
    w_state: float = 0.0  # zero bubble: the part of ``activations`` that is W's queue, not saved tensors
    host: float = 0.0  # bytes offloaded to host memory (parallel.offload); every other field is device memory

    @property
    def state(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def backward_peak(self) -> float:
        return self.weights + self.optimizer + self.new_at_peak

    @property
    def total(self) -> float:
        """The step's peak: the forward/backward's or the optimizer step's, whichever is larger."""
        return max(self.backward_peak, self.state + self.step_buffers)


def data_layout(layout: Layout) -> Layout:
    """``layout`` as the dp mode's planner model sees the dense weights: cp ranks hold the same weights, so the
    gradients are reduced and the state sharded over dp x cp (engine/parallel/layout/context.py grad_mesh), consecutive
    groups of tp ranks (ep = 1: no stride; engine/planning/dp.py group_span)."""
    return dataclasses.replace(layout, dp=layout.dp * layout.cp, cp=1, ep=1)


@lru_cache(maxsize=None)
def _model(name: str):
    return model_class(dp_modes.MODES[name])()


def planner_model(name: str):
    """The planner model of dp mode ``name`` (its DpModeSpec.planner); a mode without one is refused in one line."""
    spec = dp_modes.MODES[name]
    if spec.planner is None:
        modelled = ", ".join(n for n, s in dp_modes.MODES.items() if s.planner)
        raise ConfigError(
            f"dp mode '{name}' has no planner model; declare one (DpModeSpec.planner, "
            f"engine/planning/dp.py) or plan parallel.dp_mode {modelled}"
        )
    return _model(name)


def dp_model(cfg: Config):
    """planner_model of cfg's parallel.dp_mode."""
    return planner_model(cfg.parallel.dp_mode)


def stage_memory(
    cfg: Config, world_size: int, stage: int, adamw: str = "fused", layout: Layout | None = None
) -> StageMemory:
    """Planned bytes held by one rank of pipeline ``stage`` at the peak of a training step (layout from
    ``cfg.parallel`` and ``cfg.train``, checked by engine.parallel.layout.checks.resolve_layout, unless the caller
    passes the ``layout`` it has resolved). ``adamw``: the torch AdamW that steps (engine/planning/dp.py ADAMW;
    "fused" is engine.optim's choice on CUDA and on CPU)."""
    layout = layout or resolve_layout(cfg, world_size)
    micro_batches = micro_batches_per_step(cfg.train, layout.dp)
    params = stage_params(cfg, layout.tp, layout.pp, stage)
    model, groups = dp_model(cfg), state_groups(layout, params)
    counters = 4 * _param_tensors(cfg, layout, stage)  # AdamW's fp32 `step` per parameter tensor (dense group's)
    parts = [
        _group_state(cfg, model, lay, p, micro_batches, adamw, counters if i == 0 else 0)
        for i, (lay, p) in enumerate(groups)
    ]
    # (weights, grads, optimizer, step_buffers, host, gathered, bucket) summed over the dense and expert groups;
    # the per-tensor AdamW loop's temporaries are one tensor's, the largest of either group's
    weights, grads, optimizer, step_buffers, host, gathered, bucket = (sum(x) for x in zip(*parts))
    if adamw == "loop":
        step_buffers = max(p[3] for p in parts)
    held = activations_in_flight(cfg, layout.tp, layout.pp, micro_batches, stage)
    buffers = acts.transient_bytes(cfg, layout.tp, stage == head_stage(cfg, layout.pp))
    buffers = max(buffers, vocab_grad_bytes(cfg, layout, stage, model, micro_batches, held)) + bucket
    buffers += cp_plan.buffer_bytes(cfg, layout.tp)  # the ring's K/V blocks and dK/dV accumulators
    if model.grads_whole_step(data_layout(layout)):  # DDP's bucket views at dp x cp > 1, held through the step
        new_at_peak = gathered + buffers + grads + held.peak
    else:  # each chunk's gradients appear at its first backward (schedules.InFlight.peak_with_grads)
        shares = chunk_shares(cfg, layout, stage, params)
        new_at_peak = gathered + buffers + held.peak_with_grads([grads * s for s in shares])
    return StageMemory(
        stage,
        weights,
        grads,
        optimizer,
        held.peak,
        gathered,
        buffers,
        step_buffers,
        held.count,
        new_at_peak,
        held.w_state,
        host,
    )


def vocab_grad_bytes(cfg: Config, layout: Layout, stage: int, model, micro_batches: int, held) -> float:
    """The embedding's or LM head's fp32 weight gradient (V/t x h, the largest) as its backward computes it, before
    AccumulateGrad adds it into a gradient that already exists (held through the step, or a later micro-batch's;
    not under a sharding mode, whose unsharded gradient is reduce-scattered away), beyond ``held.peak``: the
    head's beside every activation in flight (its logits' gradient in place of the logits); the embedding's at the
    end of a micro-batch's backward, whose activations (~held.peak / held.count) are gone. 0 on other stages."""
    into_grads = model.grads_whole_step(data_layout(layout)) or (micro_batches > 1 and not model.shards)
    grad = 4.0 * cfg.model.vocab_size * cfg.model.hidden_size / layout.tp
    if not into_grads:
        return 0.0
    if stage == head_stage(cfg, layout.pp):
        return grad
    return max(0.0, grad - held.peak / max(1, held.count)) if stage == 0 else 0.0


def chunk_shares(cfg: Config, layout: Layout, stage: int, params: dict) -> list[float]:
    """Each of the rank's model chunks' share of its parameters (``params``: the stage's, stage_params), and so of
    its gradients: its layers, and the embedding (first virtual stage) or final norm and LM head (last) where it
    holds them (schedules.rank_chunks)."""
    chunks, last = rank_chunks(cfg, layout.pp, stage), layout.pp * virtual_stages(cfg) - 1
    ends = [(g == 0) + (g == last) for g, _ in chunks]
    per_layer, root = params["layers"] / max(1, params["num_layers"]), params["root"] / max(1, sum(ends))
    sizes = [n * per_layer + e * root for (_, n), e in zip(chunks, ends)]
    total = sum(sizes)
    return [size / total for size in sizes] if total else [1.0 / len(sizes)] * len(sizes)


def state_groups(layout: Layout, params: dict) -> list[tuple[Layout, dict]]:
    """(layout, parameters) of each group the dp mode reduces and shards separately: the dense weights over dp x cp
    (``data_layout``) and, under expert parallelism, this rank's E/ep experts over the expert-dp group
    (engine/planning/ep.py expert_layout). At ep = 1 the experts are dense weights."""
    dense = data_layout(layout)
    if layout.ep == 1 or not params["experts"]:
        return [(dense, params)]
    experts = {
        "layers": params["experts"],
        "root": 0,
        "layer": params["expert_layer"],
        "num_layers": params["num_layers"],
        "experts": 0,
        "expert_layer": 0,
    }
    rest = {
        **params,
        "layers": params["layers"] - params["experts"],
        "layer": params["layer"] - params["expert_layer"],
        "experts": 0,
        "expert_layer": 0,
    }
    return [(dense, rest), (ep_plan.expert_layout(layout), experts)]


def _group_state(
    cfg: Config, model, layout: Layout, params: dict, micro_batches: int, adamw: str, counters: float
) -> tuple[float, ...]:
    """(weights, grads, optimizer, step_buffers, host, gathered, bucket) of one state group under the dp mode's
    planner model, ``counters`` bytes of optimizer state added before offloading."""
    local = params["layers"] + params["root"]
    weights, grads, optimizer = model.state(cfg, layout, local, micro_batches)
    state = weights, grads, optimizer + counters
    step_buffers = model.step_buffers(cfg, layout, params, adamw)
    on_device = model.offloaded(cfg, layout, local, (*state, step_buffers))
    return (*on_device, *model.buffers(cfg, layout, params))


def _param_tensors(cfg: Config, layout: Layout, stage: int) -> int:
    """Number of parameter tensors on the stage (9 per layer, 12 with q/k/v biases; embedding, final norm, LM
    head)."""
    if not dp_model(cfg).per_tensor_step:
        return 0  # DeepSpeed keeps one step counter per flat group
    p = stage_params(cfg, layout.tp, layout.pp, stage)
    root = (stage == 0) + 2 * (stage == head_stage(cfg, layout.pp)) - one_embedding(cfg, layout.pp)
    return (12 if cfg.model.attention_bias else 9) * p["num_layers"] + root


def plan_memory(cfg: Config, world_size: int, adamw: str = "fused", layout: Layout | None = None) -> list[StageMemory]:
    """stage_memory of every pipeline stage, stage 0 first (``layout`` as for stage_memory)."""
    layout = layout or resolve_layout(cfg, world_size)
    return [stage_memory(cfg, world_size, s, adamw, layout) for s in range(layout.pp)]


def with_layout(cfg: Config, **parallel_and_train) -> Config:
    """A copy of ``cfg`` with fields of its ``parallel`` and ``train`` sections replaced (names are unique across
    the two), for planning a layout other than the configured one."""
    parallel = {k: v for k, v in parallel_and_train.items() if hasattr(cfg.parallel, k)}
    train = {k: v for k, v in parallel_and_train.items() if k not in parallel}
    return dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, **parallel), train=dataclasses.replace(cfg.train, **train)
    )
