"""Checks of a loaded configuration that need no world size (the layout is checked by
engine/parallel/layout/checks.py ``resolve_layout``): choices, ranges, divisibility, the family-specific model keys.
Every failure is a one-line :class:`ConfigError` naming the key, its value and what would be valid."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config_types import explicit_head_dim
from engine.errors import ConfigError
from engine.kinds import dp_modes as dp
from engine.kinds.cp_modes import CP_MODES
from engine.kinds.families import FAMILIES, MOE_FAMILIES
from engine.kinds.offload import OFFLOADS
from engine.kinds.recompute import RECOMPUTE
from engine.kinds.schedules import SCHEDULES

if TYPE_CHECKING:
    from engine.config import Config

# Every key with a fixed set of values; a kind's values are its registry itself (engine/kinds/: families, cp modes,
# recompute modes, offload; engine/parallel/: dp modes, schedules), so that a kind registered at run time is accepted
CHOICES = {
    "parallel.dp_mode": dp.MODES,
    "parallel.grad_compression": ("none", "bf16", "fp16", "powersgd"),
    "parallel.schedule": SCHEDULES,
    "parallel.backend": ("auto", "gloo", "nccl"),
    "parallel.p2p_dtype": ("auto", "bf16"),
    "parallel.reshard_after_forward": ("auto", "true", "false"),
    "parallel.fsdp_grad_accumulation": ("sharded", "unsharded"),
    "parallel.offload": OFFLOADS,
    "parallel.cp_mode": CP_MODES,
    "train.dtype": ("fp32", "bf16"),
    "model.rope_scaling": ("none", "linear", "llama3"),
    "train.activation_checkpointing": RECOMPUTE,  # true/false read as full/none (engine/config.py)
    "model.family": FAMILIES,
}


# Adam's update is about lr per weight per step (m / sqrt(v) is about 1 per element) on weights initialised at
# model.init_std ~0.02: lr 1 replaces them every step, and far above it the fp32 step lr / (1 - beta1^t) overflows
# (--train.lr 1e39 crashed the first optimizer step, issue 42). Published runs use 1e-4 to 1e-2.
MAX_LR = 1.0
# numpy.random.RandomState's range (PowerSGD seeds one with train.seed); default_rng and torch.manual_seed take it too
MAX_SEED = 2**32 - 1


def _positive(cfg: Config, keys: list[str]) -> None:
    for dotted in keys:
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value <= 0:
            raise ConfigError(f"{dotted}={value} must be > 0")


def validate(cfg: Config) -> None:
    """Checks that need no world size; the layout is checked by engine/parallel/layout/checks.py."""
    for dotted, valid in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in valid:
            raise ConfigError(f"{dotted}={value!r} is not one of {', '.join(valid)}")
    _positive(
        cfg,
        [
            "model.vocab_size",
            "model.hidden_size",
            "model.intermediate_size",
            "model.num_layers",
            "model.num_heads",
            "model.num_kv_heads",
            "model.rope_theta",
            "parallel.tp",
            "parallel.pp",
            "parallel.cp",
            "parallel.ep",
            "parallel.timeout_s",
            "parallel.startup_timeout_s",
            "train.steps",
            "train.global_batch_size",
            "train.micro_batch_size",
            "train.seq_len",
            "log.every",
            "train.eval_batches",
        ],
    )
    if cfg.parallel.p2p_dtype == "bf16" and cfg.train.dtype != "bf16":
        raise ConfigError(
            f"parallel.p2p_dtype=bf16 needs train.dtype=bf16 (got {cfg.train.dtype}); use parallel.p2p_dtype=auto"
        )
    if cfg.parallel.heartbeat_timeout_s < 0:
        raise ConfigError(
            f"parallel.heartbeat_timeout_s={cfg.parallel.heartbeat_timeout_s} must be >= 0 (0 turns the heartbeat off)"
        )
    if cfg.parallel.hang_timeout_s < 0:
        raise ConfigError(
            f"parallel.hang_timeout_s={cfg.parallel.hang_timeout_s} must be >= 0 (0 turns the hang watchdog off; "
            f"it must be below parallel.timeout_s={cfg.parallel.timeout_s} to act)"
        )
    m = cfg.model
    validate_heads(m)
    if cfg.train.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={cfg.train.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    _validate_families(cfg)
    _validate_moe(cfg)
    if isinstance(cfg.parallel.pp_layers, str) and cfg.parallel.pp_layers != "auto":
        raise ConfigError(
            f"parallel.pp_layers={cfg.parallel.pp_layers!r} is not valid; use auto (balanced by "
            f"cost), a list of layers per stage such as [3,5], or [] (even)"
        )
    if cfg.parallel.dp == 0 or cfg.parallel.dp < -1:
        raise ConfigError(f"parallel.dp={cfg.parallel.dp} must be a positive integer or -1 (infer from world size)")
    _validate_run(cfg)
    _validate_log(cfg)
    _validate_dp(cfg)


def _validate_run(cfg: Config) -> None:
    """The run's own settings: where it writes, evaluation, data, the initial weights' and the optimizer's scalars,
    checkpoints."""
    if not cfg.train.out_dir.strip():  # '' wrote metrics.jsonl and LOCK into the current directory
        raise ConfigError(
            f"train.out_dir={cfg.train.out_dir!r} is not valid: give the directory for the run's "
            f"metrics.jsonl, LOCK and tensorboard/ (created if missing; default runs/tiny)"
        )
    if cfg.train.eval_every < 0:
        raise ConfigError(f"train.eval_every={cfg.train.eval_every} must be >= 0 (0 turns evaluation off)")
    if cfg.data.weights and len(cfg.data.weights) != len(cfg.data.paths):
        raise ConfigError(
            f"data.weights has {len(cfg.data.weights)} entries but data.paths has "
            f"{len(cfg.data.paths)}; give one weight per path or none"
        )
    if not 0.0 <= cfg.data.valid_fraction < 1.0:
        raise ConfigError(f"data.valid_fraction={cfg.data.valid_fraction} must be in [0, 1)")
    if cfg.model.init_std < 0:  # the standard deviation of the weights' normal (0, as HF's initializer_range allows)
        raise ConfigError(
            f"model.init_std={cfg.model.init_std} must be >= 0 (the weights are drawn from N(0, init_std))"
        )
    if not 0 <= cfg.train.lr <= MAX_LR:
        raise ConfigError(
            f"train.lr={cfg.train.lr} must be in [0, {MAX_LR:g}]: Adam moves every weight by about lr per step, "
            f"so above 1 nothing trains (typical: 1e-4 to 3e-3)"
        )
    if not 0 <= cfg.train.seed <= MAX_SEED:
        raise ConfigError(f"train.seed={cfg.train.seed} must be in [0, {MAX_SEED}] (2**32 - 1, numpy's seed range)")
    if not 0.0 <= cfg.train.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio={cfg.train.min_lr_ratio} must be in [0, 1]")
    for beta in ("beta1", "beta2"):  # Adam's moment decay rates (Kingma & Ba 2015): 0 <= beta < 1
        if not 0.0 <= getattr(cfg.train, beta) < 1.0:
            raise ConfigError(f"train.{beta}={getattr(cfg.train, beta)} must be in [0, 1)")
    if cfg.train.grad_clip < 0 or cfg.train.weight_decay < 0:
        raise ConfigError(
            f"train.grad_clip={cfg.train.grad_clip} and train.weight_decay={cfg.train.weight_decay} "
            f"must be >= 0 (grad_clip 0: no clipping)"
        )
    if not cfg.data.text_key:
        raise ConfigError("data.text_key is empty; name the field that holds the text (default: text)")
    if cfg.train.adam_eps <= 0:
        raise ConfigError(f"train.adam_eps={cfg.train.adam_eps} must be > 0")
    if cfg.train.max_bad_steps < 0:
        raise ConfigError(f"train.max_bad_steps={cfg.train.max_bad_steps} must be >= 0 (0: never abort)")
    if cfg.train.check_replicas_every < 0:
        raise ConfigError(
            f"train.check_replicas_every={cfg.train.check_replicas_every} must be >= 0 (0: off, N: every N steps)"
        )
    if cfg.train.warmup_steps < 0:
        raise ConfigError(f"train.warmup_steps={cfg.train.warmup_steps} must be >= 0")
    c = cfg.checkpoint
    if c.every < 0 or c.keep < 0:
        raise ConfigError(
            f"checkpoint.every={c.every} and checkpoint.keep={c.keep} must be >= 0 (0: only at the end / keep all)"
        )
    if not c.resume:
        raise ConfigError("checkpoint.resume is empty; use auto, none or a checkpoint PATH")


def _validate_log(cfg: Config) -> None:
    ratio = cfg.log.straggler_ratio
    if not (ratio == 0 or 1 < ratio < float("inf")):  # NaN fails both
        raise ConfigError(
            f"log.straggler_ratio={ratio} must be 0 (off) or a number > 1 (a rank's phase time over its peers' median)"
        )


def _validate_dp(cfg: Config) -> None:
    """What the dp mode's DpModeSpec declares (engine/kinds/dp_modes.py): whether it compiles and offloads,
    the keys only another mode reads (set away from their default: refused rather than silently ignored), and its
    own checks. The defaults the owned keys are compared with: a fresh ``type(cfg.parallel)()`` (ParallelConfig; this
    module sits below engine/config.py, which calls it, and does not import it back)."""
    p, mode = cfg.parallel, dp.spec(cfg)
    if cfg.train.compile and not mode.compile:
        compiled = " or ".join(name for name, s in dp.MODES.items() if s.compile)
        raise ConfigError(
            f"train.compile=true is not supported with parallel.dp_mode={p.dp_mode}; use dp_mode "
            f"{compiled}, or train.compile=false"
        )
    if OFFLOADS[p.offload].offloads and not any(OFFLOADS[o].offloads for o in mode.offload):
        honour = " or ".join(name for name, s in dp.MODES.items() if p.offload in s.offload)
        raise ConfigError(
            f"parallel.offload={p.offload} needs parallel.dp_mode {honour} (got {p.dp_mode}); "
            f"use offload=none with {p.dp_mode}"
        )
    dp.check_owned_keys(cfg, type(cfg.parallel)())
    if mode.check is not None:
        mode.check(cfg)
    if p.bucket_mb <= 0:
        raise ConfigError(f"parallel.bucket_mb={p.bucket_mb} must be > 0 (DDP's gradient bucket size in MB)")
    if p.powersgd_rank < 1:
        raise ConfigError(f"parallel.powersgd_rank={p.powersgd_rank} must be >= 1")
    if p.powersgd_warmup_steps < 2:  # PowerSGD's error feedback and warm start need two plain steps first (torch)
        raise ConfigError(f"parallel.powersgd_warmup_steps={p.powersgd_warmup_steps} must be >= 2")


def validate_heads(m) -> None:
    """num_heads % num_kv_heads (GQA); model.head_dim >= 0 (0: hidden_size / num_heads, which must then divide)
    and even (RoPE rotates pairs). Also run on a checkpoint's saved model (engine/checkpoint/schema.py)."""
    given = explicit_head_dim(m)
    if given < 0:
        raise ConfigError(f"model.head_dim={given} must be >= 0 (0: hidden_size / num_heads)")
    if not given and m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
            f"make it divisible or set model.head_dim"
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}")
    if m.head_dim % 2:
        what = "model.head_dim" if given else "head dim hidden_size/num_heads"
        raise ConfigError(f"{what}={m.head_dim} must be even for RoPE")


def _validate_families(cfg: Config) -> None:
    """The family-specific model keys: RoPE scaling factors, and a sliding window the sequence must fit in."""
    m = cfg.model
    if m.rope_scaling != "none" and m.rope_factor < 1.0:
        raise ConfigError(f"model.rope_factor={m.rope_factor} must be >= 1 with model.rope_scaling={m.rope_scaling}")
    if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        raise ConfigError(
            f"model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_factor="
            f"{m.rope_high_freq_factor} must satisfy 0 < low < high for rope_scaling=llama3"
        )
    if m.sliding_window < 0:
        raise ConfigError(f"model.sliding_window={m.sliding_window} must be >= 0 (0: no window)")
    if m.sliding_window and cfg.train.seq_len > m.sliding_window:
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} exceeds model.sliding_window={m.sliding_window}; "
            f"sliding-window attention is not implemented, so use train.seq_len <= "
            f"{m.sliding_window}"
        )


def _validate_moe(cfg: Config) -> None:
    """The mixture-of-experts keys (engine/model/moe.py): experts only in an MoE family, k <= E, the MoE layers."""
    m, t = cfg.model, cfg.train
    if (m.num_experts > 0) != (FAMILIES[m.family].moe is not None) or m.num_experts < 0:
        raise ConfigError(
            f"model.num_experts={m.num_experts} with model.family={m.family}: MoE families "
            f"({', '.join(MOE_FAMILIES)}) need num_experts >= 1, dense families 0"
        )
    if m.num_experts and not 1 <= m.experts_per_token <= m.num_experts:
        raise ConfigError(
            f"model.experts_per_token={m.experts_per_token} must be in [1, model.num_experts={m.num_experts}]"
        )
    layers = m.moe_layers
    if layers != "all" and (isinstance(layers, str) or any(not 0 <= i < m.num_layers for i in layers)):
        raise ConfigError(f"model.moe_layers={layers!r} must be all or a list of layer indices in [0, {m.num_layers})")
    for key in ("moe_intermediate_size", "moe_shared_expert_size", "moe_capacity_factor"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key}={getattr(m, key)} must be >= 0")
    if t.moe_aux_loss_coef < 0 or t.moe_z_loss_coef < 0:
        raise ConfigError(
            f"train.moe_aux_loss_coef={t.moe_aux_loss_coef} and train.moe_z_loss_coef={t.moe_z_loss_coef} must be >= 0"
        )
