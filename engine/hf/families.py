"""A Hugging Face config.json into our ModelConfig and back, for every family of engine/kinds/families.py
(``FAMILIES``: each family's architecture, config class, q/k/v bias, q/k norm, window rule and MoE part; the MoE
keys: engine/hf/moe_families.py). This file asks the family's spec and never compares its name.

``head_dim`` is read and written for all (Qwen3's need not be hidden_size / num_attention_heads: 0.6B has 16 heads
of 128 on hidden 1024).

RoPE scaling (none, linear, llama3) is read and written for any of them, as transformers computes it for all.

``model_config`` reads a config.json (transformers 4's ``rope_scaling``/``rope_theta`` or 5's
``rope_parameters``) into our ModelConfig and refuses, naming the key, what engine/model/transformer.py does not
compute;
``hf_config`` is the inverse, for export.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import ModelConfig
from engine.errors import CheckpointError  # not checkpoint/format's import: the config checks read this torch-free
from engine.hf.config_json import check_family, check_kind, checked
from engine.hf.moe_families import moe_hf_keys, moe_model_keys
from engine.kinds.families import FAMILIES

DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def family_of(hf: dict, source: Path) -> str:
    """The family named by config.json's ``architectures`` (its ``model_type`` when that list is absent)."""
    archs = hf.get("architectures") or []
    if not archs and hf.get("model_type") in FAMILIES:
        return hf["model_type"]
    by_architecture = {s.architecture: name for name, s in FAMILIES.items()}
    if len(archs) != 1 or archs[0] not in by_architecture:
        raise CheckpointError(
            f"{source}: architecture {', '.join(map(str, archs)) or '(none)'} is not supported; "
            f"import handles {', '.join(by_architecture)}"
        )
    return by_architecture[archs[0]]


def _rope(hf: dict, source: Path) -> dict:
    """ModelConfig's RoPE fields from rope_parameters (transformers 5) or rope_scaling + rope_theta (4)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type")) or "default"
    out = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if kind == "default":
        return out
    if kind not in ("linear", "llama3"):
        raise CheckpointError(
            f"{source}: rope_type={kind!r} is not supported by engine/model/rope.py (default, linear, llama3)"
        )
    out.update(rope_scaling=kind, rope_factor=float(rope["factor"]))
    if kind == "llama3":
        out.update(
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    return out


def model_config(hf: dict, source: Path) -> ModelConfig:
    """Our ModelConfig from a config.json dict; refuses, naming the key, what engine/model/transformer.py does not
    compute
    (and, engine/hf/config_json.py, values of the wrong type or range)."""
    check_kind(hf, source)
    family = family_of(hf, source)
    hf = checked(hf, source)  # the keys hf_config.REQUIRED are there from here on
    check_family(hf, family, source)
    spec = FAMILIES[family]
    # Llama's attention_bias also puts a bias on o_proj, which Qwen2 (the family with q/k/v biases) lacks.
    for key, ok in (
        ("attention_bias", spec.qkv_bias or not hf.get("attention_bias")),
        ("qkv_bias", not spec.qkv_bias or hf.get("qkv_bias", True)),
        ("clip_qkv", hf.get("clip_qkv") is None),
        ("mlp_bias", not hf.get("mlp_bias")),
        ("hidden_act", hf.get("hidden_act", "silu") == "silu"),
    ):
        if not ok:
            raise CheckpointError(
                f"{source}: {key}={hf.get(key)!r} is not supported by engine/model/transformer.py for "
                f"{spec.architecture} (no o_proj or MLP biases, SiLU)"
            )
    heads = hf["num_attention_heads"]
    m = ModelConfig(
        name=str(hf.get("_name_or_path") or source.name),
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=int(hf.get("head_dim") or 0),
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(hf.get("tie_word_embeddings")),
        init_std=float(hf.get("initializer_range", 0.02)),
        family=family,
        attention_bias=spec.qkv_bias,
        sliding_window=spec.window.read(hf, source, spec.architecture),
        **_rope(hf, source),
        **moe_model_keys(hf, family, source),
    )
    return m


def _rope_scaling(m: ModelConfig) -> dict | None:
    if m.rope_scaling == "none":
        return None
    out = {"rope_type": m.rope_scaling, "factor": m.rope_factor}
    if m.rope_scaling == "llama3":
        out.update(
            low_freq_factor=m.rope_low_freq_factor,
            high_freq_factor=m.rope_high_freq_factor,
            original_max_position_embeddings=m.rope_original_max_position_embeddings,
        )
    return out


def hf_config(m: ModelConfig, dtype: str = "fp32", tokenizer=None):
    """The transformers config (the FamilySpec's config_class) of our model, head_dim always written (Qwen3Config's
    default is 128, not hidden_size / num_heads)."""
    import transformers

    spec = FAMILIES[m.family]
    if m.attention_bias != spec.qkv_bias:
        raise CheckpointError(
            f"model.attention_bias={m.attention_bias} cannot be written as "
            f"{spec.architecture}: only Qwen2 has q/k/v biases (and always has them)"
        )
    special = {}
    if tokenizer is not None:
        special = {
            k: getattr(tokenizer, k)
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if getattr(tokenizer, k, None) is not None
        }
    # the family's fixed keys, then its window's (in this order: the config's own attributes keep it)
    extra = {**spec.hf_extra, **spec.window.write(m.sliding_window, spec.architecture)}
    extra.update(moe_hf_keys(m))
    cls = getattr(transformers, spec.config_class)
    return cls(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_seq_len,
        rope_theta=m.rope_theta,
        rope_scaling=_rope_scaling(m),
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        hidden_act="silu",
        initializer_range=m.init_std,
        architectures=[spec.architecture],
        torch_dtype=DTYPE_NAMES[dtype],
        **extra,
        **special,
    )
