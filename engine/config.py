"""Typed configuration: nested dataclasses, one YAML file, dotted CLI overrides.

Precedence (lowest to highest): dataclass defaults < YAML file (``--config``) < ``--section.key value`` overrides.
Unknown sections or keys and values of the wrong type are a :class:`ConfigError` whose message is one line naming
the key, the value and what would be valid (the launcher prints it and exits 2, with no traceback).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from engine.config_checks import validate
from engine.config_types import HeadDim, coerce, explicit_head_dim
from engine.config_yaml import BoundedLoader, LiteralLoader, UniqueKeyLoader
from engine.errors import ConfigError
from engine.json_input import long_integer

__all__ = ["Config", "ConfigError", "load", "load_yaml", "parse_args", "validate"]


@dataclass
class ModelConfig:
    """Llama-family decoder shape (names follow Hugging Face ``LlamaConfig`` where one exists)."""

    name: str = "tiny"
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4  # GQA: num_heads % num_kv_heads == 0; == num_heads is plain MHA
    # Width of one attention head (HF's head_dim); 0: hidden_size // num_heads. Reading it gives the resolved width
    # (config_types.HeadDim). q is num_heads * head_dim wide, which need not be hidden_size (Qwen3-0.6B: 16 x 128
    # on hidden 1024).
    head_dim: int = HeadDim()
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02  # N(0, init_std) for every linear and embedding weight, as HF Llama's _init_weights
    # What the supported families differ in (engine/hf/families.py maps them to and from HF config.json).
    # llama | qwen2 | mistral | qwen3 | mixtral | qwen2_moe | olmoe | qwen3_moe: the HF architecture export writes
    family: str = "llama"
    attention_bias: bool = False  # bias on q/k/v (Qwen2); o_proj never has one here
    # RoPE frequency scaling, HF's rope_scaling/rope_parameters: none | linear | llama3 (Llama 3.1 and later)
    rope_scaling: str = "none"
    rope_factor: float = 1.0  # linear and llama3: wavelengths stretched by this factor
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_position_embeddings: int = 8192  # llama3 only: the context the model was pretrained at
    sliding_window: int = 0  # Mistral/Qwen2 window (0: none); full attention equals it while seq_len <= window
    num_experts: int = 0  # mixture of experts (the MoE families; engine/model/moe.py); 0: dense
    experts_per_token: int = 2  # k: experts each token is routed to
    moe_intermediate_size: int = 0  # each expert's SwiGLU width; 0: intermediate_size
    moe_layers: list[int] | str = "all"  # all | indices of the MoE layers (others dense; HF's mlp_only_layers ...)
    moe_norm_topk_prob: bool = True  # softmax-then-top-k gating: renormalise the k weights to sum 1
    moe_shared_expert_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert width (0: none)
    moe_capacity_factor: float = 0.0  # 0: dropless; else at most ceil(cf * tokens * k / E) copies per expert
    init_from: str = ""  # a Hugging Face folder whose shape and weights start the run (engine/hf/init.py)


@dataclass
class ParallelConfig:
    """Layout of the world: world_size = tp * pp * dp * cp, tp fastest-varying (TP peers share a node)."""

    tp: int = 1
    pp: int = 1
    dp: int = -1  # -1: world_size // (tp * pp * cp)
    # Context parallelism: the sequence split over cp ranks (load-balanced head/tail chunks, engine/parallel/cp/);
    # cp_mode ring (K/V blocks rotate, online softmax) | all_to_all (Ulysses: sequence <-> heads around attention)
    cp: int = 1
    cp_mode: str = "ring"
    ep: int = 1  # expert parallelism: experts split over ep consecutive dp x cp ranks (MoE models; engine/parallel/ep/)
    dp_mode: str = "ddp"  # ddp | fsdp | zero
    zero_stage: int = 0  # 1..3 with dp_mode=zero
    ds_config: str = ""  # zero: a DeepSpeed JSON merged over the defaults (engine/kinds/ds_config.py); '' none
    # Optimizer / parameter offload to host memory (ZeRO-Offload, Ren et al. 2021): none | optimizer (zero: fp32
    # master weights, gradient partition and Adam state on the host, the update there) | optimizer_and_params
    # (also the weights: zero stage 3's offload_param, or fsdp's CPUOffloadPolicy)
    offload: str = "none"
    # dp_mode=ddp (torch DDP): gradient bucket size in MB, and DDP's communication hook: none | bf16 | fp16 (each
    # bucket cast for the all-reduce) | powersgd (rank-powersgd_rank factors after powersgd_warmup_steps plain steps)
    bucket_mb: float = 25.0
    grad_compression: str = "none"
    powersgd_rank: int = 4
    powersgd_warmup_steps: int = 10
    reshard_after_forward: str = "auto"  # fsdp: true (ZeRO-3) | false (keep gathered to backward) | auto (pp == 1)
    # fsdp: sharded (each micro-batch's backward reduce-scatters its gradients into the sharded fp32 gradient: 4 bytes
    # per parameter / dp held) | unsharded (no-sync: the fp32 gradients accumulate whole, 4 bytes per parameter, and
    # are reduce-scattered once, in the last micro-batch's backward: fewer collectives). zero_bubble and zbv reduce
    # after the last W either way (W adds weight gradients outside autograd; engine/parallel/dp/fsdp.py).
    fsdp_grad_accumulation: str = "sharded"
    # 1f1b | gpipe | interleaved (virtual_stages model chunks per rank) | zero_bubble (ZB-H1;
    # engine/parallel/pp/schedule.py)
    # | zbv (ZB-V: 2 chunks per rank in a V, implied; engine/parallel/pp/schedules/zbv.py)
    schedule: str = "1f1b"
    virtual_stages: int = 1  # interleaved: model chunks per rank (>= 2); layers split into pp * virtual_stages chunks
    # Megatron's sequence parallelism (Korthikanti et al. 2022): norms and residual stream sharded over tp on the
    # sequence dim; all-gather before column-parallel, reduce-scatter after row-parallel layers. Needs tp > 1.
    sequence_parallel: bool = False
    # Under sequence parallelism: each tp all-gather and reduce-scatter as a ring of tp steps whose transfers overlap
    # the linear's matmul chunk by chunk (collective matmul, Wang et al. 2023; engine/parallel/autograd/
    # collective_matmul.py): p2p transfers instead of one blocking collective. Needs sequence_parallel; not with the
    # zero-bubble schedules (their deferred weight gradients gather blocking).
    tp_comm_overlap: bool = False
    # layers per stage, e.g. [3, 5]; empty = as even as possible; auto = the split minimising the slowest stage's
    # FLOPs, LM head included (engine/planning/balance.py)
    pp_layers: list[int] | str = field(default_factory=list)
    backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    # The dtype of activations and their gradients between pipeline stages. auto: the stage output's own (the
    # weights': fp32 under bf16 autocast, whose residual stream is fp32), so every pp layout computes the one-process
    # model exactly. bf16 (train.dtype bf16): half the p2p bytes, the residual stream rounded to bf16 at each stage
    # boundary (as Megatron's bf16 residual is); measured at tp1-pp4 interleaved tied: grad norm 6.1e-2 off one
    # process, against 0 with auto (tests/parity), so the parity matrix runs auto.
    p2p_dtype: str = "auto"
    # Seconds any collective (and the start-up rendezvous) may wait for a peer before this rank fails, so a
    # dead or stuck rank ends the job instead of hanging it. 600 is NCCL's own default (gloo's is 1800): long
    # enough for a slow first step or checkpoint write, short enough not to burn an allocation.
    timeout_s: float = 600.0
    # Seconds for every rank to join the job's store and connect, before each that did exits naming the ranks and
    # nodes that did not (engine/cluster/startup.py); timeout_s stays the collectives' bound.
    startup_timeout_s: float = 60.0
    # A peer whose heartbeat (engine/cluster/heartbeat.py) has not moved for this many seconds is dead, frozen or
    # cut off: every rank prints one line naming its host and rank and exits 1. 0 turns the heartbeat off. Until the
    # first step is done (start-up) the silence allowed is startup_timeout_s, if longer.
    heartbeat_timeout_s: float = 30.0
    # A rank that completes no communication operation and no step for this many seconds while every process lives
    # (a deadlock, a rank stuck in its forward) starts the hang report: one line naming the operation and the
    # rank(s) that never entered it, out_dir/hang-<step>.json, exit status 5 (engine/trust/hang.py). The first step
    # and a checkpoint save get 3x this (at least startup_timeout_s). 0 turns it off; so does a value not below
    # timeout_s (a collective's timeout ends the job first; rank 0 says so).
    hang_timeout_s: float = 120.0


@dataclass
class TrainConfig:
    steps: int = 200  # train until this optimizer step (also after a resume)
    global_batch_size: int = 16  # sequences per optimizer step, all dp ranks together
    micro_batch_size: int = 4  # sequences per forward/backward on one rank
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0  # global L2 norm; 0 disables
    # A step whose global loss is NaN or inf is skipped (no update; counted as skipped_steps in metrics); this
    # many in a row abort the run (0: never abort).
    max_bad_steps: int = 5
    # Every this many steps the ranks that must hold identical weights compare a digest per tensor (engine/trust/
    # replicas.py); a mismatch stops the run before the next save, exit status 4. 0: off.
    check_replicas_every: int = 0
    seed: int = 1234
    dtype: str = "fp32"  # fp32 | bf16 (autocast; weights, grads and optimizer state stay fp32)
    tf32: bool = True  # CUDA only: fp32 matmuls on TF32 tensor cores (engine/parallel/layout/context.py apply_tf32)
    # Recompute in backward instead of keeping activations: none | full (keep each block's input) | selective
    # (keep matmul outputs, recompute norms/attention/elementwise; engine/model/recompute.py). true/false: full/none.
    activation_checkpointing: str = "none"
    compile: bool = False  # torch.compile each decoder block (engine/model/compile.py)
    moe_aux_loss_coef: float = 0.01  # MoE load-balancing loss weight (Switch Transformer; engine/model/moe.py)
    moe_z_loss_coef: float = 0.0  # MoE router z-loss weight (ST-MoE)
    eval_every: int = 0  # validation loss every N steps (0: never); logged as eval_loss in metrics.jsonl
    eval_batches: int = 4  # global batches of the held-out split per evaluation
    out_dir: str = "runs/tiny"  # metrics.jsonl, LOCK, tensorboard/ ('' is refused: not the current directory)


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)  # empty: the bundled corpus
    weights: list[float] = field(default_factory=list)
    tokenizer: str = ""  # '' = the bundled tokenizer; else a local folder or HF name
    # Packed sequences: attention stops at each EOS and RoPE positions restart after it (engine/model/docmask.py)
    document_mask: bool = False
    valid_fraction: float = 0.01  # share of each dataset's samples held out for validation (its tail)
    text_key: str = "text"  # the field holding the text in raw .json/.jsonl/.parquet files


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (engine/checkpoint/checkpointer.py): <dir>/step_NNNNNN/ and <dir>/latest."""

    dir: str = ""  # '' = no checkpoints
    every: int = 0  # save every N steps (0: only at the last step and on SIGTERM/SIGINT)
    keep: int = 3  # newest complete checkpoints kept; 0 keeps all
    resume: str = "auto"  # auto (latest good one in dir, if any) | none | PATH (a step_* dir or a dir with latest)
    async_save: bool = False  # write and commit in a background thread while training continues
    # record digests of the state and a probe loss at each save; a resume recomputes and compares them
    verify: bool = True  # (engine/trust/saved.py)


@dataclass
class LogConfig:
    every: int = 1  # log a metrics.jsonl line every N steps
    progress: bool = True  # the progress line with ETA on rank 0
    breakdown: bool = True  # seconds per phase in each record (on CUDA from events, no host synchronize)
    straggler_ratio: float = 1.4  # name a rank whose compute phase is this many times its peers' median; 0: off
    goodput: bool = True  # keep <train.out_dir>/goodput.json, its line at start and end (engine/trust/goodput.py)
    peak_tflops: float = 0.0  # device peak for MFU; 0: engine/model/flops.py's table by CUDA device name (none on CPU)
    tensorboard: bool = False  # TensorBoard event files in <train.out_dir>/tensorboard (engine/metrics/tensorboard.py)
    wandb_project: str = ""  # '' = off; else log to Weights & Biases (offline unless WANDB_MODE says otherwise)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        """Every field, model.head_dim as given (0 where it is hidden_size / num_heads), so a saved config whose
        hidden_size or num_heads is overridden later derives its head width again."""
        out = dataclasses.asdict(self)
        out["model"]["head_dim"] = explicit_head_dim(self.model)
        return out


# Other spellings of a key: HF's name for our max_seq_len (the longest position the model is meant for).
ALIASES = {"model.max_position_embeddings": "model.max_seq_len"}
# Other spellings of a value: activation_checkpointing was a bool before it had modes (old configs, saved headers).
VALUE_ALIASES = {"train.activation_checkpointing": {"true": "full", "false": "none"}}


@functools.lru_cache(maxsize=None)  # typing.get_type_hints costs ~1 ms; the parity tests load ~10^4 configs
def _field_types(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _wants_text(typ, value) -> bool:
    """Whether a string field (or a list of strings) got something YAML typed as a number, boolean or date."""
    if typ is str:
        return isinstance(value, (bool, int, float, datetime.date))
    if typ != list[str]:
        return False
    return any(_wants_text(str, v) for v in value) if isinstance(value, list) else _wants_text(str, value)


def _set(cfg: Config, dotted: str, value, literal: Callable[[], object] | None = None) -> None:
    """Set ``section.key`` on cfg from a raw value, checking that the key exists. ``literal``: the same value with
    every scalar as the text written (engine/config_yaml.py LiteralLoader), which a string field takes instead of
    what YAML 1.1 typed (``0700`` is not 448, ``on`` is not true: a path is the text the user gave)."""
    sections = _field_types(Config)
    dotted = ALIASES.get(dotted, dotted)
    section, _, key = dotted.partition(".")
    if section not in sections or not key:
        raise ConfigError(f"unknown config key '{dotted}'; sections are: {', '.join(sections)} (write section.key)")
    sub = getattr(cfg, section)
    fields = _field_types(type(sub))
    if key not in fields:
        raise ConfigError(f"unknown config key '{dotted}'; valid keys in '{section}': {', '.join(fields)}")
    if literal is not None and _wants_text(fields[key], value):
        value = literal()
    value = coerce(dotted, value, fields[key])
    if dotted in VALUE_ALIASES:
        value = VALUE_ALIASES[dotted].get(value, value)
    setattr(sub, key, value)


def _apply_mapping(cfg: Config, data, source: str, texts: Callable[[], dict] | None = None) -> None:
    """``texts``: the document read again with its scalars as written (LiteralLoader), asked only when needed."""
    if data is None:
        return
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(data).__name__}")
    for section, body in data.items():
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: section '{section}' must be a mapping of keys, got {body!r}")
        for key, value in body.items():
            literal = None if texts is None else functools.partial(lambda s, k: texts()[s][k], section, key)
            _set(cfg, f"{section}.{key}", value, literal)


def load_yaml(path: str | Path, cfg: Config | None = None) -> Config:
    """Apply a YAML file on top of ``cfg`` (or the defaults)."""
    cfg = cfg or Config()
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file '{path}' is a directory; give a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        text = path.read_text(encoding="utf-8")
        data = _parsed(text, UniqueKeyLoader)
    except ConfigError as e:
        raise ConfigError(f"config file '{path}': {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {e.start}); give a YAML file") from None
    except OSError as e:  # permission denied, a directory swapped in, an I/O error
        raise ConfigError(
            f"config file '{path}' cannot be read ({e.strerror or e}); give a readable YAML file"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file '{path}' is not valid YAML{where}") from None
    except ValueError:  # YAML's int() of a number past Python's digit limit
        raise ConfigError(f"config file '{path}' holds {long_integer(text)}") from None
    _apply_mapping(cfg, data, str(path), functools.cache(lambda: _parsed(text, LiteralLoader)))
    return cfg


@functools.lru_cache(maxsize=1024)
def _parsed(text: str, loader):
    """yaml.load(text, Loader=loader), kept for the last texts: the parity checks load ~35,000 configs from a
    handful of files and override values (34 s of the suite, 16 s kept); a launcher reads one. Read only: a
    Config never holds a piece of it (engine.config_types.coerce builds every list anew)."""
    return yaml.load(text, Loader=loader)


def parse_args(argv: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Split argv into the --config path and (key, value) overrides. Accepts ``--k v`` and ``--k=v``; drops the
    ``--local_rank=N`` argument that the deepspeed launcher appends (LOCAL_RANK is read from the environment)."""
    config_path, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}'; use --config FILE and --section.key value")
        name, eq, value = arg[2:].partition("=")
        if name in ("local_rank", "local-rank"):
            i += 1 if eq else 2
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"argument '{arg}' has no value")
            value, i = argv[i + 1], i + 1
        i += 1
        if name == "config":
            config_path = value
        else:
            overrides.append((name, value))
    return config_path, overrides


def _cli_value(key: str, value: str, loader=BoundedLoader):
    """A ``--key value`` value read as YAML, so that 1e-3, true and [a,b] mean what they mean in the file (text
    that is not YAML stays the text)."""
    try:
        return _parsed(value, loader) if value != "" else ""
    except ConfigError as e:  # an alias bomb (engine/config_yaml.py); first: ConfigError is a ValueError
        raise ConfigError(f"--{key}: {e}") from None
    except (yaml.YAMLError, ValueError):  # not YAML, or an integer past Python's digits: the text, checked by
        return value  # its field's type


def load(argv: list[str]) -> Config:
    """Build the Config from ``--config FILE`` and ``--section.key value`` arguments, then validate it."""
    config_path, overrides = parse_args(argv)
    cfg = load_yaml(config_path) if config_path else Config()
    for key, value in overrides:
        _set(cfg, key, _cli_value(key, value), functools.partial(_cli_value, key, value, LiteralLoader))
    validate(cfg)
    return cfg
