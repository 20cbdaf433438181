"""The one check of a Hugging Face config.json, before anything is built from it (launch/convert.py import and
model.init_from both read it through engine/hf/folder.py; engine/hf/families.py ``model_config`` calls
``checked``).

Every key engine/hf/families.py and moe_families.py read is checked for its JSON type and range, the keys each
family needs for being there, and the keys that must agree (heads, experts), each failure one line naming the key,
the value and what is valid (CheckpointError). Before: a string, a fraction, NaN or a list where a number belongs
became a Python traceback or a model that transformers would not build. No torch.
"""

from __future__ import annotations

import math
from pathlib import Path

from engine.errors import CheckpointError
from engine.json_input import load_object, shown
from engine.kinds.families import FAMILIES

# Whole-number keys and their least value; none above 2**31 - 1 (more than any published model has, and every
# tensor size stays an int64).
INTS = {
    "vocab_size": 1,
    "hidden_size": 1,
    "intermediate_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 1,
    "max_position_embeddings": 1,
    "sliding_window": 0,
    "num_experts": 0,
    "num_local_experts": 0,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 1,
    "shared_expert_intermediate_size": 0,
    "decoder_sparse_step": 1,
    "original_max_position_embeddings": 1,
}
MAX_INT = 2**31 - 1
# Number keys: the least value and whether it may be equal to it (rope factors: engine/model/rope.py)
FLOATS = {
    "rms_norm_eps": (0.0, False),
    "initializer_range": (0.0, True),
    "rope_theta": (0.0, False),
    "router_jitter_noise": (0.0, True),
    "factor": (1.0, True),
    "low_freq_factor": (0.0, False),
    "high_freq_factor": (0.0, False),
}
BOOLS = ("tie_word_embeddings", "use_sliding_window", "norm_topk_prob", "attention_bias", "mlp_bias", "qkv_bias")
STRINGS = ("hidden_act", "model_type", "_name_or_path", "rope_type", "type")
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
ROPE_KEYS = ("rope_parameters", "rope_scaling")
# What each RoPE type needs beside rope_type (transformers' rope_config_validation)
ROPE_NEEDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def read_config_json(folder: Path) -> dict:
    """``folder/config.json``'s object (its keys are checked by families.py model_config, ``checked``);
    CheckpointError in one line when it is missing or not one JSON object."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a Hugging Face model folder: {path} is missing")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read ({e})") from None
    return load_object(text, str(path), CheckpointError)


def _bad(source, key: str, value, valid: str) -> CheckpointError:
    return CheckpointError(f"{source}: config.json {key}={shown(value)} is not valid; {valid}")


def _check_value(source, key: str, value) -> None:
    """The type and range of one key's value (None: absent, checked by the caller where required)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in INTS and not (isinstance(value, int) and not isinstance(value, bool) and INTS[key] <= value <= MAX_INT):
        raise _bad(source, key, value, f"use a whole number in [{INTS[key]}, {MAX_INT}]")
    if key in FLOATS:
        low, equal = FLOATS[key]
        if not (is_number and math.isfinite(value) and (value > low or equal and value == low)):
            raise _bad(source, key, value, f"use a finite number {'>=' if equal else '>'} {low:g}")
    if key in BOOLS and not isinstance(value, bool):
        raise _bad(source, key, value, "use true or false")
    if key in STRINGS and not isinstance(value, str):
        raise _bad(source, key, value, "use a string")


def check_kind(hf: dict, source) -> None:
    """``architectures`` (a list of class names) and ``model_type`` (a name), which say the family and so come first
    (a string for the list read as its letters before)."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise _bad(source, "architectures", archs, 'use a list of one class name, such as ["LlamaForCausalLM"]')
    if not isinstance(hf.get("model_type", ""), (str, type(None))):
        raise _bad(source, "model_type", hf["model_type"], 'use a name, such as "llama"')


def checked(hf: dict, source) -> dict:
    """``hf`` without its null values (what families.py reads as absent), every key it reads checked; the keys
    that depend on the family are checked by ``check_family``."""
    for key in REQUIRED:
        if key not in hf:
            raise CheckpointError(f"{source}: config.json has no '{key}'")
        if hf[key] is None:
            raise _bad(source, key, None, f"use a whole number in [{INTS[key]}, {MAX_INT}]")
    out = {k: v for k, v in hf.items() if v is not None}
    for key, value in out.items():
        _check_value(source, key, value)
    layers = out.get("mlp_only_layers", [])
    if not isinstance(layers, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < out["num_hidden_layers"] for i in layers
    ):
        raise _bad(source, "mlp_only_layers", layers, f"use a list of layer indices in [0, {out['num_hidden_layers']})")
    for key in ROPE_KEYS:
        if key in out:
            _check_rope(source, key, out[key])
            out[key] = {k: v for k, v in out[key].items() if v is not None}
    _check_heads(source, out)
    return out


def _check_rope(source, key: str, rope) -> None:
    """rope_parameters (transformers 5) or rope_scaling (4): an object whose rope_type has the factors it needs."""
    if not isinstance(rope, dict):
        raise _bad(source, key, rope, 'use an object such as {"rope_type": "default", "rope_theta": 10000.0}')
    for sub, value in rope.items():
        if value is not None:
            _check_sub(source, key, sub, value)
    kind = rope.get("rope_type", rope.get("type")) or "default"
    for need in ROPE_NEEDS.get(kind, ()):
        if rope.get(need) is None:
            raise CheckpointError(
                f"{source}: config.json {key} has rope_type {kind!r} but no '{need}'; "
                f"{kind} needs {', '.join(ROPE_NEEDS[kind])}"
            )
    if kind == "llama3" and not rope["low_freq_factor"] < rope["high_freq_factor"]:
        raise _bad(
            source,
            f"{key}.high_freq_factor",
            rope["high_freq_factor"],
            f"it must exceed low_freq_factor={shown(rope['low_freq_factor'])}",
        )


def _check_sub(source, key: str, sub: str, value) -> None:
    """One key of a RoPE object, named as ``rope_parameters.factor`` in the message."""
    try:
        _check_value(source, sub, value)
    except CheckpointError as e:
        raise CheckpointError(str(e).replace(f"config.json {sub}=", f"config.json {key}.{sub}=", 1)) from None


def _check_heads(source, hf: dict) -> None:
    """Grouped-query heads divide, and a head's width is whole and even (RoPE rotates pairs)."""
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads", hf["num_attention_heads"])
    if heads % kv:
        raise _bad(source, "num_key_value_heads", kv, f"it must divide num_attention_heads={heads}")
    if "head_dim" not in hf and hf["hidden_size"] % heads:
        raise _bad(
            source,
            "hidden_size",
            hf["hidden_size"],
            f"without head_dim it must be divisible by num_attention_heads={heads}",
        )
    width = hf.get("head_dim") or hf["hidden_size"] // heads
    if width % 2:
        raise CheckpointError(
            f"{source}: config.json gives heads {width} wide (head_dim, or hidden_size / "
            f"num_attention_heads); RoPE needs an even width"
        )


def check_family(hf: dict, family: str, source) -> None:
    """The keys ``family`` needs (its MoeSpec, engine/kinds/families.py), and k <= the expert count (checked
    training, but an import of num_experts_per_tok 9 over 8 experts was written before)."""
    moe = FAMILIES[family].moe
    if moe is None:
        return
    if moe.layer_keys and "moe_intermediate_size" not in hf:
        raise CheckpointError(f"{source}: config.json of {family} has no 'moe_intermediate_size' (each expert's width)")
    count_key = next((k for k in moe.count_keys if hf.get(k)), None)
    k = hf.get("num_experts_per_tok", 2)
    if count_key and k > hf[count_key]:
        raise _bad(source, "num_experts_per_tok", k, f"it must be at most {count_key}={hf[count_key]}")
