"""DeepSpeed's tunable settings for dp_mode zero: built-in defaults per ZeRO stage, and the user's override file.

The defaults live here, in code, so that every install has them (an editable checkout and ``pip install .``
alike); nothing is read from the repository. ``parallel.ds_config`` names an optional JSON file whose keys are
merged over them, dicts key by key (``{"zero_optimization": {"overlap_comm": true}}`` changes that one key).
engine/parallel/dp/zero.py ``ds_config`` then fills in every key our config decides (batch sizes, stage, precision,
clipping), so those are refused in the file, with the engine key to set instead. No torch import: config checks
(engine/config_checks.py) read the file when the configuration is loaded, so a bad one fails before any rank
starts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from engine.errors import ConfigError
from engine.json_input import dotted, leaves, load_object, not_finite, shown
from engine.kinds.offload import OFFLOADS

_BUCKET = 50_000_000  # elements per reduce / all-gather bucket (DeepSpeed's default is 5e8)
_COMMON = {"steps_per_print": 10**9, "wall_clock_breakdown": False}  # DeepSpeed prints nothing of its own
# overlap_comm off: gradient reduction does not overlap backward, which is what engine/planning/search.py models.
DEFAULTS = {
    1: {
        "zero_optimization": {
            "stage": 1,
            "reduce_bucket_size": _BUCKET,
            "allgather_bucket_size": _BUCKET,
            "overlap_comm": False,
            "contiguous_gradients": True,
        },
        **_COMMON,
    },
    2: {
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": _BUCKET,
            "allgather_bucket_size": _BUCKET,
            "reduce_scatter": True,
            "overlap_comm": False,
            "contiguous_gradients": True,
        },
        **_COMMON,
    },
    3: {
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": _BUCKET,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "stage3_prefetch_bucket_size": _BUCKET,
            "stage3_param_persistence_threshold": 100_000,
            "stage3_max_live_parameters": 10**9,
            "stage3_max_reuse_distance": 10**9,
            "stage3_gather_16bit_weights_on_model_save": False,
        },
        **_COMMON,
    },
}
# DeepSpeed keys our config decides (engine/parallel/dp/zero.py ds_config), and the engine key to set instead.
OURS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size / (train.micro_batch_size * dp)",
    "gradient_clipping": "train.grad_clip",
    "bf16": "train.dtype",
    "optimizer": "train.lr, train.beta1, ...",
    "scheduler": "train.lr, train.warmup_steps, train.min_lr_ratio",
    "zero_force_ds_cpu_optimizer": "parallel.offload (the engine picks the offload optimizer)",
    "zero_allow_untested_optimizer": "parallel.offload (the engine picks the optimizer)",
}
# The offload sub-keys the engine honours; DeepSpeed's others (nvme_path, ratio, super_offload, ...) are refused.
OFFLOAD_KEYS = {
    "offload_optimizer": ("device", "pin_memory"),
    "offload_param": ("device", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu"),
}
# The keys DeepSpeed reads as counts (elements, bytes, steps), with an example, and as flags: those of the defaults,
# and the other ZeRO sizes and offload buffers users tune.
COUNTS = {
    **{
        dotted(p): v
        for stage in DEFAULTS.values()
        for p, v in leaves(stage)
        if isinstance(v, int) and not isinstance(v, bool)
    },
    **{
        f"zero_optimization.{k}": v
        for k, v in (
            ("sub_group_size", 10**9),
            ("stage3_model_persistence_threshold", 10**5),
            ("offload_param.buffer_count", 5),
            ("offload_param.buffer_size", 10**8),
            ("offload_param.max_in_cpu", 10**9),
        )
    },
}
FLAGS = {dotted(p) for stage in DEFAULTS.values() for p, v in leaves(stage) if isinstance(v, bool)} | {
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_param.pin_memory",
    "zero_optimization.round_robin_gradients",
    "zero_optimization.elastic_checkpoint",
}
# DeepSpeed's deprecated spellings of the offload keys, and the key to write instead.
OLD_OFFLOAD = {
    "cpu_offload": "offload_optimizer",
    "cpu_offload_param": "offload_param",
    "cpu_offload_use_pin_memory": "offload_optimizer.pin_memory",
}


def read_user_config(path: str | Path) -> dict:
    """The file named by parallel.ds_config, checked: a JSON object that sets none of the keys we decide."""
    path = Path(path)
    where = f"parallel.ds_config '{path}'"
    if not path.is_file():
        raise ConfigError(
            f"{where} is not a file; give a DeepSpeed JSON file, or leave parallel.ds_config empty "
            f"for the built-in defaults"
        )
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} cannot be read ({e})") from None
    user = load_object(text, where, ConfigError)  # one object, no key twice, not nested deep
    _check_values(user, where)
    for key, ours in OURS.items():
        if key in user:
            raise ConfigError(f"{where} sets '{key}'; remove it: the engine sets it from {ours}")
    fp16, zero = user.get("fp16"), user.get("zero_optimization", {})
    if isinstance(fp16, dict) and fp16.get("enabled"):
        raise ConfigError(f"{where} enables fp16; use train.dtype=bf16 instead")
    if not isinstance(zero, dict):
        raise ConfigError(f"{where} has a 'zero_optimization' that is not an object of keys")
    if "stage" in zero:
        raise ConfigError(
            f"{where} sets 'zero_optimization.stage'; remove it: the engine sets it from parallel.zero_stage"
        )
    _check_offload_keys(zero, where)
    return user


def _check_values(user: dict, where: str) -> None:
    """Every number finite, and the keys DeepSpeed reads as counts or flags of those types: DeepSpeed's own
    validation (pydantic, at deepspeed.initialize) would refuse them only after the model is built, a traceback
    on every rank."""
    bad = not_finite(user)
    if bad:
        raise ConfigError(f"{where} sets '{bad[0]}'={shown(bad[1])}; it must be a finite number")
    for path, value in leaves(user):
        key = dotted(path)
        if key in COUNTS and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or value != int(value)
        ):
            raise ConfigError(
                f"{where} sets '{key}'={shown(value)}; it must be a whole number >= 0 (such as {COUNTS[key]})"
            )
        if key in FLAGS and not isinstance(value, bool):
            raise ConfigError(f"{where} sets '{key}'={shown(value)}; it must be true or false")


def _check_offload_keys(zero: dict, where: str) -> None:
    """Offload sub-keys of the file the engine can honour: device none or cpu (nvme needs an aio build and a
    path), pin_memory and ZeRO-3's parameter buffers; anything else is refused with the key named."""
    for old, new in OLD_OFFLOAD.items():
        if old in zero:
            raise ConfigError(
                f"{where} sets 'zero_optimization.{old}' (deprecated by DeepSpeed); write "
                f"'zero_optimization.{new}' or set parallel.offload"
            )
    for key, allowed in OFFLOAD_KEYS.items():
        sub = zero.get(key)
        if sub is None:
            continue
        if not isinstance(sub, dict):
            raise ConfigError(f"{where} has a 'zero_optimization.{key}' that is not an object of keys")
        for k in sub:
            if k not in allowed:
                raise ConfigError(
                    f"{where} sets 'zero_optimization.{key}.{k}', which this engine does not honour; "
                    f"keep only {', '.join(allowed)}"
                )
        if sub.get("device", "none") not in ("none", "cpu"):
            raise ConfigError(
                f"{where} sets 'zero_optimization.{key}.device'={sub['device']!r}; use 'cpu' or "
                f"'none' (NVMe offload is not supported here)"
            )


def offload_of(stage: int, path: str | None, offload: str) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded) for ZeRO ``stage``: parallel.offload (``offload``) or the file's
    offload_optimizer / offload_param with device cpu; refused where the two disagree, and parameter offload
    outside stage 3 (DeepSpeed would ignore it silently)."""
    zero = load_base_config(stage, path).get("zero_optimization", {})
    on = {k: zero.get(k, {}).get("device", "none") == "cpu" for k in OFFLOAD_KEYS}
    wanted = {"offload_optimizer": OFFLOADS[offload].optimizer, "offload_param": OFFLOADS[offload].params}
    for key in OFFLOAD_KEYS:
        if wanted[key] and key in zero and not on[key]:
            raise ConfigError(
                f"parallel.offload={offload} and parallel.ds_config '{path}' (zero_optimization.{key}."
                f"device={zero[key].get('device', 'none')!r}) disagree; remove one of them"
            )
    opt, params = (on[k] or wanted[k] for k in OFFLOAD_KEYS)
    if params and stage != 3:
        raise ConfigError(
            f"parallel.ds_config '{path}' offloads parameters (zero_optimization.offload_param), which "
            f"DeepSpeed does only in ZeRO-3 (zero_stage={stage}); remove offload_param or use "
            f"zero_stage=3"
        )
    if params and not opt:
        raise ConfigError(
            f"parallel.ds_config '{path}' offloads parameters without the optimizer; set "
            f"parallel.offload=optimizer_and_params instead"
        )
    return opt, params


def check_overlap_comm(stage: int, path: str | Path) -> None:
    """The file's ``zero_optimization.overlap_comm``: a JSON boolean, and true only at ZeRO stage 2 or 3. The engine
    owns the accumulation boundary (engine/parallel/dp/zero.py: managed_gradient_accumulation false), with which
    DeepSpeed 0.19.8 overlaps the reduction only when it partitions gradients (``DeepSpeedEngine._do_sanity_check``
    asserts it at initialize, a traceback on every rank)."""
    zero = read_user_config(path).get("zero_optimization", {})
    if "overlap_comm" not in zero:
        return
    value = zero["overlap_comm"]
    where = f"parallel.ds_config '{path}' sets 'zero_optimization.overlap_comm'={json.dumps(value)}"
    if not isinstance(value, bool):
        raise ConfigError(f"{where}; it must be true or false")
    if value and stage == 1:
        raise ConfigError(
            f"{where}, which DeepSpeed allows only when it partitions gradients (zero_stage 2 or 3; "
            f"got parallel.zero_stage={stage}); set it to false or remove it, or use zero_stage 2 or 3"
        )


def merged(base: dict, over: dict) -> dict:
    """``base`` with ``over``'s keys put in, dicts merged key by key (neither argument is changed)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_base_config(stage: int, path: str | Path | None = None) -> dict:
    """The tunable part of DeepSpeed's config for ZeRO ``stage``: the built-in defaults, with the file at
    ``path`` (parallel.ds_config) merged over them when one is given."""
    if stage not in DEFAULTS:
        raise ConfigError(f"parallel.zero_stage={stage} has no DeepSpeed defaults; use 1, 2 or 3")
    return merged(DEFAULTS[stage], read_user_config(path)) if path else copy.deepcopy(DEFAULTS[stage])
