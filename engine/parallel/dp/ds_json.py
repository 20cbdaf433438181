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

_BUCKET = 50_000_000  # elements per reduce / all-gather bucket (DeepSpeed's default is 5e8)
_COMMON = {"steps_per_print": 10**9, "wall_clock_breakdown": False}  # DeepSpeed prints nothing of its own
# overlap_comm off: gradient reduction does not overlap backward, which is what engine/planning/search.py models.
DEFAULTS = {
    1: {"zero_optimization": {"stage": 1, "reduce_bucket_size": _BUCKET, "allgather_bucket_size": _BUCKET,
                              "overlap_comm": False, "contiguous_gradients": True}, **_COMMON},
    2: {"zero_optimization": {"stage": 2, "reduce_bucket_size": _BUCKET, "allgather_bucket_size": _BUCKET,
                              "reduce_scatter": True, "overlap_comm": False, "contiguous_gradients": True}, **_COMMON},
    3: {"zero_optimization": {"stage": 3, "reduce_bucket_size": _BUCKET, "overlap_comm": False,
                              "contiguous_gradients": True, "stage3_prefetch_bucket_size": _BUCKET,
                              "stage3_param_persistence_threshold": 100_000,
                              "stage3_max_live_parameters": 10**9, "stage3_max_reuse_distance": 10**9,
                              "stage3_gather_16bit_weights_on_model_save": False}, **_COMMON},
}
# DeepSpeed keys our config decides (engine/parallel/dp/zero.py ds_config), and the engine key to set instead.
OURS = {"train_batch_size": "train.global_batch_size", "train_micro_batch_size_per_gpu": "train.micro_batch_size",
        "gradient_accumulation_steps": "train.global_batch_size / (train.micro_batch_size * dp)",
        "gradient_clipping": "train.grad_clip", "bf16": "train.dtype", "optimizer": "train.lr, train.beta1, ...",
        "scheduler": "train.lr, train.warmup_steps, train.min_lr_ratio"}


def read_user_config(path: str | Path) -> dict:
    """The file named by parallel.ds_config, checked: a JSON object that sets none of the keys we decide."""
    path = Path(path)
    where = f"parallel.ds_config '{path}'"
    if not path.is_file():
        raise ConfigError(f"{where} is not a file; give a DeepSpeed JSON file, or leave parallel.ds_config empty "
                          f"for the built-in defaults")
    try:
        user = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(user, dict):
        raise ConfigError(f"{where} holds a JSON {type(user).__name__}, not an object of DeepSpeed keys")
    for key, ours in OURS.items():
        if key in user:
            raise ConfigError(f"{where} sets '{key}'; remove it: the engine sets it from {ours}")
    fp16, zero = user.get("fp16"), user.get("zero_optimization", {})
    if isinstance(fp16, dict) and fp16.get("enabled"):
        raise ConfigError(f"{where} enables fp16; use train.dtype=bf16 instead")
    if not isinstance(zero, dict):
        raise ConfigError(f"{where} has a 'zero_optimization' that is not an object of keys")
    if "stage" in zero:
        raise ConfigError(f"{where} sets 'zero_optimization.stage'; remove it: the engine sets it from "
                          f"parallel.zero_stage")
    return user


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
