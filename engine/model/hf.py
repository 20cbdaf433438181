"""Hugging Face folders of the families of engine/model/families.py (Llama, Qwen2, Mistral, Qwen3 and the MoE ones)
<-> engine checkpoints, through safetensors both ways (launch/convert.py).

Checkpoints store the tensors of ``transformers.LlamaForCausalLM`` under its names (engine/model/transformer.py's fused
q/k/v and gate/up are stored as their parts; Qwen2 and Mistral use the same names), so conversion is only about
layout: export assembles each full tensor from a checkpoint saved at any
(tp, pp, dp, dp_mode) with ``ckpt_format.Reader.full`` and writes the standard folder: ``config.json`` (the
config class of ``model.family``, engine/model/families.py), the weights as ``model.safetensors`` or, above
``max_shard_bytes``, ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (transformers'
sharded format: {"metadata": {"total_size"}, "weight_map"}), and the run's tokenizer: the files of its tokenizer
folder copied as they are (with ``generation_config.json``), or ``save_pretrained`` for a hub name. Import reads
such a folder into a *model-only* checkpoint: step 0, no optimizer state, the tokenizer and generation config
copied into ``CKPT/hf_files``; ``--checkpoint.resume CKPT`` starts a run from it at any layout with a fresh AdamW
and the data from the beginning. It also writes ``CKPT/config.yaml``, a full engine config for the imported shape.
The checkpoint is published as a training save is (engine/checkpoint/publish.py): written under a temporary name,
renamed into place and named by ``latest`` last. Both directions write the whole target folder beside it under a
temporary name and rename it into place (engine/checkpoint/folder.py), so a failure leaves the target as it was
and two exports never mix; a non-empty target is refused unless ``overwrite`` (which replaces it as a whole).
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model import transformer as model_lib
from engine.checkpoint.checkpointer import resolve
from engine.checkpoint.contents import header
from engine.checkpoint.format import (CheckpointError, Reader, fsync_write, merge_index, piece_key, read_index,
                                      verify_shard, write_shard)
from engine.checkpoint.parts import RunPosition
from engine.checkpoint import folder
from engine.checkpoint.publish import publish, staging_dir, step_name
from engine.config import Config, ModelConfig
from engine.model.fused import part_blocks
from engine.model.families import hf_config, model_config  # noqa: F401 (hf.hf_config: the public name)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Copied verbatim from an imported folder to the checkpoint and from there to an export (chat template, special
# tokens, sampling defaults), so a round trip gives back what the user brought.
CARRIED_FILES = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt", "vocab.json",
                 "chat_template.jinja", "generation_config.json")


def param_shapes(m: ModelConfig) -> dict[str, list[int]]:
    """HF names and shapes of every distinct parameter, in module order (a tied LM head is the embedding; a fused
    q/k/v or gate/up weight is its parts, engine/model/fused.py)."""
    model = model_lib.build(m, device="meta")
    modules = dict(model.named_modules())
    return {part: list(shape) for n, p in model.named_parameters()
            for part, _, shape in part_blocks(modules[n.rpartition(".")[0]], n, p.shape)}


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


def export(ckpt: Path, out: Path, max_shard_bytes: int = 5 * 2**30, dtype: str = "fp32",
           overwrite: bool = False) -> dict:
    """Write the HF folder ``out`` from the checkpoint ``ckpt`` (a step_* dir, or a dir with ``latest``): into a
    temporary folder beside it, renamed into place at the end (engine/checkpoint/folder.py; ``overwrite``: an
    existing non-empty ``out`` is replaced as a whole)."""
    (path,) = resolve(ckpt)
    index = read_index(path)
    for file in index["files"]:
        verify_shard(path, index, file)
    with folder.written(out, overwrite, "export folder", sources=(ckpt, path)) as tmp:
        return _write_export(path, index, tmp, max_shard_bytes, dtype)


def _write_export(path: Path, index: dict, out: Path, max_shard_bytes: int, dtype: str) -> dict:
    """The folder's files, written into ``out`` (the temporary folder)."""
    cfg = index["config"]
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    m = ModelConfig(**{k: v for k, v in cfg["model"].items() if k in known})
    shapes = param_shapes(m)
    reader = Reader(path, index)
    element = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    groups = _shards({n: torch.Size(s).numel() * element for n, s in shapes.items()}, max_shard_bytes)
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
    from engine.data.dataset import load_tokenizer

    source = cfg.get("data", {}).get("tokenizer", "")
    tokenizer = load_tokenizer(source)
    hf_config(m, dtype, tokenizer).save_pretrained(str(out))
    if not (source and carry_files(Path(source).expanduser(), out)):
        tokenizer.save_pretrained(str(out))  # a hub name or the bundled tokenizer: transformers writes its files
    return {"step": index["step"], "files": files, "params": len(shapes)}


def carry_files(src: Path, dst: Path, extra: tuple[str, ...] = ()) -> bool:
    """Copy the tokenizer and generation config files (and ``extra``) of folder ``src`` into ``dst``; True if it
    had a tokenizer (otherwise nothing is copied)."""
    if not src.is_dir() or not any((src / f).is_file() for f in TOKENIZER_FILES):
        return False
    dst.mkdir(parents=True, exist_ok=True)
    for name in (*CARRIED_FILES, *extra):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return True


def _weight_map(hf_dir: Path) -> dict[str, str] | None:
    """The sharded index's tensor name -> file name; None for a single ``model.safetensors``."""
    sharded, single = hf_dir / "model.safetensors.index.json", hf_dir / "model.safetensors"
    if sharded.is_file():
        try:
            weight_map = json.loads(sharded.read_text()).get("weight_map")
        except (ValueError, AttributeError):  # not JSON, or not a JSON object
            weight_map = None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{sharded} is not a safetensors index (JSON with a 'weight_map' of tensor "
                                  f"name -> file name)")
        return weight_map
    if single.is_file():
        return None
    raise CheckpointError(f"{hf_dir} has no model.safetensors or model.safetensors.index.json (save the model "
                          f"with save_pretrained(..., safe_serialization=True) first)")


def _tensor_names(file: Path, listed_in: str) -> set[str]:
    """The tensor names in ``file``'s header; CheckpointError if it is missing, truncated or not safetensors."""
    if not file.is_file():
        raise CheckpointError(f"weight file {file}{listed_in} is missing")
    try:
        with safe_open(str(file), framework="pt") as f:  # checks that the header covers the file's bytes
            return set(f.keys())
    except Exception as e:  # SafetensorError: truncated, or not a safetensors file
        raise CheckpointError(f"weight file {file}{listed_in} is not a readable safetensors file, truncated or "
                              f"damaged ({e})") from None


def hf_tensors(hf_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or the sharded index), every file checked to
    exist, be readable and hold the tensors the index places in it: the one check of an HF folder's weights,
    shared by ``import_hf`` and ``--model.init_from`` (engine/model/hf_init.py)."""
    weight_map = _weight_map(hf_dir)
    if weight_map is None:
        single = hf_dir / "model.safetensors"
        return {n: single for n in _tensor_names(single, "")}
    listed_in = f" listed in {hf_dir / 'model.safetensors.index.json'}"
    held = {f: _tensor_names(hf_dir / f, listed_in) for f in sorted(set(weight_map.values()))}
    for name, f in weight_map.items():
        if name not in held[f]:
            raise CheckpointError(f"weight file {hf_dir / f} does not hold tensor '{name}'{listed_in}")
    return {n: hf_dir / f for n, f in weight_map.items()}


def import_hf(hf_dir: Path, root: Path, max_file_bytes: int = 2 * 2**30, overwrite: bool = False) -> Path:
    """Write the model-only checkpoint ``root/step_000000`` (+ ``root/latest``, ``root/config.yaml``): into a
    temporary folder beside ``root``, renamed into place at the end (engine/checkpoint/folder.py)."""
    config_json = hf_dir / "config.json"
    if not config_json.is_file():
        raise CheckpointError(f"{hf_dir} is not a Hugging Face model folder: {config_json} is missing")
    m = model_config(json.loads(config_json.read_text()), hf_dir)
    shapes, where = param_shapes(m), hf_tensors(hf_dir)
    with folder.written(root, overwrite, "checkpoint directory", sources=(hf_dir,)) as tmp:
        _write_import(hf_dir, m, shapes, where, root, tmp, max_file_bytes)
    return root / step_name(0)


def _write_import(hf_dir: Path, m: ModelConfig, shapes: dict, where: dict, root: Path, tmp: Path,
                  max_file_bytes: int) -> None:
    """The checkpoint's files, written into ``tmp``; paths inside them (config.yaml) name the final ``root``."""
    token = uuid.uuid4().hex[:8]
    path = staging_dir(tmp, 0, token)
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
    # config.json too: AutoTokenizer reads its model_type to pick the tokenizer class, so the copy loads as
    # the source folder does (and as --model.init_from of it does)
    if carry_files(hf_dir, tmp / "hf_files", extra=("config.json",)):
        cfg.data.tokenizer = str((root / "hf_files").resolve())
    cfg.checkpoint.resume = str(root.resolve())
    fsync_write(tmp / "config.yaml", "# written by launch/convert.py import: the imported model's shape\n" +
                yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    # Published last, through the one commit path of every checkpoint: `latest` appears only once all is written.
    run = header(RunPosition(0, 0), cfg, {"imported_from": str(hf_dir.resolve())}, model_only=True)
    publish(tmp, 0, token, merge_index(metas, {**run, "adam_step": None}))
