"""Hugging Face Llama folders <-> engine checkpoints, through safetensors both ways (launch/convert.py).

Our parameter names are those of ``transformers.LlamaForCausalLM`` (engine/model.py), so conversion is only
about layout: export assembles each full tensor from a checkpoint saved at any (tp, pp, dp, dp_mode) with
``ckpt_format.Reader.full`` and writes the standard folder: ``config.json`` (a ``LlamaConfig``), the weights as
``model.safetensors`` or, above ``max_shard_bytes``, ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json`` (transformers' sharded format: {"metadata": {"total_size"}, "weight_map"}), and
the run's tokenizer (``save_pretrained``). Import reads such a folder into a *model-only* checkpoint: step 0, no
optimizer state; ``--checkpoint.resume CKPT`` starts a run from it at any layout with a fresh AdamW and the data
from the beginning. It also writes ``CKPT/config.yaml``, a full engine config for the imported shape.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from engine import model as model_lib
from engine.checkpoint import resolve, step_name
from engine.ckpt_format import (CheckpointError, Reader, fsync_write, merge_index, piece_key, read_index,
                                verify_shard, write_shard)
from engine.config import Config, ModelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def hf_config(m: ModelConfig, dtype: str = "fp32", tokenizer=None):
    """transformers.LlamaConfig of our model shape (no biases, SiLU, plain RoPE: what engine/model.py computes)."""
    import transformers

    special = {}
    if tokenizer is not None:
        special = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                   if getattr(tokenizer, k, None) is not None}
    return transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings, attention_bias=False, mlp_bias=False, hidden_act="silu",
        initializer_range=m.init_std, architectures=["LlamaForCausalLM"], torch_dtype=DTYPES[dtype], **special)


def model_config(hf: dict, source: Path) -> ModelConfig:
    """Our ModelConfig from a config.json dict; refuses, naming the key, what engine/model.py does not compute."""
    def need(key):
        if key not in hf:
            raise CheckpointError(f"{source}: config.json has no '{key}'")
        return hf[key]

    if hf.get("model_type") != "llama":
        raise CheckpointError(f"{source}: model_type={hf.get('model_type')!r}; only 'llama' folders can be imported")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}  # transformers 5 | 4
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    for key, ok in (("rope_type", rope_type in ("default", None)), ("attention_bias", not hf.get("attention_bias")),
                    ("mlp_bias", not hf.get("mlp_bias")), ("hidden_act", hf.get("hidden_act", "silu") == "silu")):
        if not ok:
            value = rope_type if key == "rope_type" else hf.get(key)
            raise CheckpointError(f"{source}: {key}={value!r} is not supported by engine/model.py (plain RoPE, "
                                  f"no biases, SiLU)")
    heads = need("num_attention_heads")
    m = ModelConfig(name=str(hf.get("_name_or_path") or source.name), vocab_size=need("vocab_size"),
                    hidden_size=need("hidden_size"), intermediate_size=need("intermediate_size"),
                    num_layers=need("num_hidden_layers"), num_heads=heads,
                    num_kv_heads=hf.get("num_key_value_heads") or heads,
                    max_seq_len=hf.get("max_position_embeddings", 2048),
                    rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                    norm_eps=float(hf.get("rms_norm_eps", 1e-5)), tie_embeddings=bool(hf.get("tie_word_embeddings")),
                    init_std=float(hf.get("initializer_range", 0.02)))
    if hf.get("head_dim") not in (None, m.head_dim):
        raise CheckpointError(f"{source}: head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads="
                              f"{m.head_dim}, which engine/model.py assumes")
    return m


def param_shapes(m: ModelConfig) -> dict[str, list[int]]:
    """HF names and shapes of every distinct parameter, in module order (a tied LM head is the embedding)."""
    return {n: list(p.shape) for n, p in model_lib.build(m, device="meta").named_parameters()}


def _shards(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Greedy split in order, as transformers' save_pretrained does: a new shard when the next tensor would
    push the current one past ``limit`` (a tensor larger than the limit gets a shard of its own)."""
    shards, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > limit:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    return shards + [current] if current else shards


def export(ckpt: Path, out: Path, max_shard_bytes: int = 5 * 2**30, dtype: str = "fp32") -> dict:
    """Write the HF folder ``out`` from the checkpoint ``ckpt`` (a step_* dir, or a dir with ``latest``)."""
    (path,) = resolve(ckpt)
    index = read_index(path)
    for file in index["files"]:
        verify_shard(path, index, file)
    cfg = index["config"]
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    m = ModelConfig(**{k: v for k, v in cfg["model"].items() if k in known})
    shapes = param_shapes(m)
    reader = Reader(path, index)
    element = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    groups = _shards({n: torch.Size(s).numel() * element for n, s in shapes.items()}, max_shard_bytes)
    out.mkdir(parents=True, exist_ok=True)
    files = ["model.safetensors"] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for file, names in zip(files, groups):
        tensors = {n: reader.full(n).to(DTYPES[dtype]).contiguous() for n in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in names})
    if len(groups) > 1:
        total = sum(torch.Size(s).numel() * element for s in shapes.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    from engine.data import load_tokenizer

    tokenizer = load_tokenizer(cfg.get("data", {}).get("tokenizer", ""))
    hf_config(m, dtype, tokenizer).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return {"step": index["step"], "files": files, "params": len(shapes)}


def _hf_tensors(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or the sharded index)."""
    sharded, single = hf_dir / "model.safetensors.index.json", hf_dir / "model.safetensors"
    if sharded.is_file():
        return {n: hf_dir / f for n, f in json.loads(sharded.read_text())["weight_map"].items()}
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {n: single for n in f.keys()}
    raise CheckpointError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json (save the model "
                          f"with save_pretrained(..., safe_serialization=True) first)")


def import_hf(hf_dir: Path, root: Path, max_file_bytes: int = 2 * 2**30) -> Path:
    """Write the model-only checkpoint ``root/step_000000`` (+ ``root/latest``, ``root/config.yaml``)."""
    config_json = hf_dir / "config.json"
    if not config_json.is_file():
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model folder: {config_json} is missing")
    if root.exists() and any(root.iterdir()):
        raise CheckpointError(f"{root} exists and is not empty; import into a new directory")
    m = model_config(json.loads(config_json.read_text()), hf_dir)
    shapes, where = param_shapes(m), _hf_tensors(hf_dir)
    path = root / step_name(0)
    path.mkdir(parents=True, exist_ok=True)
    groups = _shards({n: torch.Size(s).numel() * 4 for n, s in shapes.items()}, max_file_bytes)
    metas = []
    for i, names in enumerate(groups):  # files of at most ~max_file_bytes, so memory stays bounded
        tensors, params = {}, {}
        for name in names:
            if name not in where:
                raise CheckpointError(f"{hf_dir}: the weights have no tensor '{name}'")
            with safe_open(str(where[name]), framework="pt") as f:
                t = f.get_tensor(name)
            if list(t.shape) != shapes[name]:
                raise CheckpointError(f"{where[name]}: {name} has shape {list(t.shape)}, config.json implies "
                                      f"{shapes[name]}")
            tensors[piece_key(name, "param", 0, 0)] = t.float().reshape(-1).contiguous()
            params[name] = {"shape": shapes[name], "tp_dim": None, "tp_size": 1,
                            "states": {"param": [[0, 0, t.numel()]]}}
        file = f"import_{i:05d}.safetensors"
        metas.append({"rank": i, "file": file, "params": params, **write_shard(path / file, tensors)})
    cfg = Config(model=m)
    if any((hf_dir / f).is_file() for f in TOKENIZER_FILES):
        cfg.data.tokenizer = str(hf_dir.resolve())
    cfg.checkpoint.resume = str(root.resolve())
    header = {"step": 0, "consumed_samples": 0, "adam_step": None, "model_only": True, "config": cfg.to_dict(),
              "layout": {"imported_from": str(hf_dir.resolve())}}
    fsync_write(path / "index.json", json.dumps(merge_index(metas, header)))
    fsync_write(root / "latest", path.name + "\n")
    (root / "config.yaml").write_text("# written by launch/convert.py import: the imported model's shape\n" +
                                      yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return path
