"""Hugging Face folders of the families of engine/hf/families.py (Llama, Qwen2, Mistral, Qwen3 and the MoE ones)
<-> engine checkpoints, through safetensors both ways (launch/convert.py).

Checkpoints store the tensors of ``transformers.LlamaForCausalLM`` under its names (engine/model/transformer.py's fused
q/k/v and gate/up are stored as their parts; Qwen2 and Mistral use the same names), so conversion is only about
layout: export assembles each full tensor from a checkpoint saved at any
(tp, pp, dp, dp_mode) with ``ckpt_format.Reader.full`` and writes the standard folder: ``config.json`` (the
config class of ``model.family``, engine/hf/families.py), the weights as ``model.safetensors`` or, above
``max_shard_bytes``, ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (transformers'
sharded format: {"metadata": {"total_size"}, "weight_map"}), and the run's tokenizer: the files of its tokenizer
folder copied as they are (with ``generation_config.json``), or ``save_pretrained`` for a hub name. Import checks
such a folder whole (engine/hf/folder.py, as init_from does) and reads it into a *model-only* checkpoint:
step 0, no optimizer state, the tokenizer and generation config copied into ``CKPT/hf_files``;
``--checkpoint.resume CKPT`` starts a run from it at any layout with a fresh AdamW and the data from the beginning. It
also writes ``CKPT/config.yaml``, a full engine config for the imported shape.
The checkpoint is published as a training save is (engine/checkpoint/publish.py): written under a temporary name,
renamed into place and named by ``latest`` last. Both directions write the whole target folder beside it under a
temporary name and rename it into place (engine/checkpoint/folder.py), so a failure leaves the target as it was
and two exports never mix; a non-empty target is refused unless ``overwrite`` (which replaces it as a whole).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from engine.checkpoint import folder
from engine.checkpoint.checkpointer import resolve
from engine.checkpoint.contents import header
from engine.checkpoint.format import (
    CheckpointError,
    Reader,
    fsync_write,
    merge_index,
    piece_key,
    read_index,
    save_safetensors,
    verify_shard,
    write_part,
    write_shard,
)
from engine.checkpoint.parts import RunPosition
from engine.checkpoint.publish import publish, staging_dir, step_name
from engine.config import Config, ModelConfig
from engine.hf.families import hf_config  # noqa: F401 (hf.hf_config: the public name)
from engine.hf.folder import param_shapes, read_folder, skip_reason

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# Copied verbatim from an imported folder to the checkpoint and from there to an export (chat template, special
# tokens, sampling defaults), so a round trip gives back what the user brought.
CARRIED_FILES = (
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "merges.txt",
    "vocab.json",
    "chat_template.jinja",
    "generation_config.json",
)
IMPORT_EXTRA = ("config.json",)  # AutoTokenizer reads its model_type to pick the tokenizer class


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


def export(
    ckpt: Path, out: Path, max_shard_bytes: int = 5 * 2**30, dtype: str = "fp32", overwrite: bool = False
) -> dict:
    """Write the HF folder ``out`` from the checkpoint ``ckpt`` (a step_* dir, or a dir with ``latest``): into a
    temporary folder beside it, renamed into place at the end (engine/checkpoint/folder.py; ``overwrite``: an
    existing non-empty ``out`` is replaced as a whole)."""
    (path,) = resolve(ckpt)
    index = read_index(path)  # every part and shard, as one process of one rank checks them
    for file in index["_share"]:
        verify_shard(path, index, file)
    source = index["config"].get("data", {}).get("tokenizer", "")
    if source:
        carried(Path(source).expanduser())  # no link out of the tokenizer folder, before anything is written
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
    files = (
        ["model.safetensors"]
        if len(groups) == 1
        else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    )
    weight_map = {}
    for file, names in zip(files, groups):
        tensors = {n: reader.full(n).to(DTYPES[dtype]).contiguous() for n in names}
        save_safetensors(tensors, out / file)  # the mode of config.json beside it, not safetensors' 0600
        weight_map.update({n: file for n in names})
    reader.close()
    if len(groups) > 1:
        total = sum(torch.Size(s).numel() * element for s in shapes.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
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
    names = carried(src, extra)
    if not names:
        return False
    dst.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(src / name, dst / name)
    return True


def carried(src: Path, extra: tuple[str, ...] = ()) -> list[str]:
    """The files of ``src`` that ``carry_files`` copies ([] without a tokenizer); CheckpointError, before anything
    is written, for a symbolic link out of ``src`` (``outside_link``): its target, any file the user can read, was
    copied into the checkpoint and every later export."""
    if not src.is_dir() or not any((src / f).is_file() for f in TOKENIZER_FILES):
        return []
    names = [name for name in (*CARRIED_FILES, *extra) if (src / name).is_file()]
    for name in names:
        outside = outside_link(src, name)
        if outside is not None:
            raise CheckpointError(
                f"{src / name} is a symbolic link to {outside}, outside {src}; copy the file itself into the "
                f"folder (a link out of it is never followed: it would copy the file it names into the "
                f"checkpoint and every export of it)"
            )
    return names


def outside_link(src: Path, name: str) -> Path | None:
    """Where ``src/name`` leads when a symbolic link (of it, or of a folder on the way) takes it out of ``src``;
    None when it stays inside. A Hugging Face cache snapshot (``snapshots/<rev>/name -> ../../blobs/<hash>``, how
    the hub stores every file) is its own kind of inside: the blob folder of the same repository."""
    home, real = Path(os.path.realpath(src)), Path(os.path.realpath(src / name))
    if home in real.parents:
        return None
    if home.parent.name == "snapshots" and real.parent == home.parent.parent / "blobs":
        return None
    return real


def import_hf(hf_dir: Path, root: Path, max_file_bytes: int = 2 * 2**30, overwrite: bool = False) -> Path:
    """Write the model-only checkpoint ``root/step_000000`` (+ ``root/latest``, ``root/config.yaml``): into a
    temporary folder beside ``root``, renamed into place at the end (engine/checkpoint/folder.py)."""
    checked = read_folder(hf_dir)  # config.json, the headers and the two against each other, nothing allocated
    carried(hf_dir, IMPORT_EXTRA)  # no link out of the folder, before anything is written
    for name in checked.skipped:
        print(f"import: skipping {name} ({skip_reason(name)})")
    with folder.written(root, overwrite, "checkpoint directory", sources=(hf_dir,)) as tmp:
        _write_import(hf_dir, checked.model, param_shapes(checked.model), checked.where, root, tmp, max_file_bytes)
    return root / step_name(0)


def _write_import(
    hf_dir: Path, m: ModelConfig, shapes: dict, where: dict, root: Path, tmp: Path, max_file_bytes: int
) -> None:
    """The checkpoint's files, written into ``tmp``; paths inside them (config.yaml) name the final ``root``."""
    token = uuid.uuid4().hex[:8]
    path = staging_dir(tmp, 0, token)
    groups = _shards({n: torch.Size(s).numel() * 4 for n, s in shapes.items()}, max_file_bytes)
    metas = []
    for i, names in enumerate(groups):  # files of at most ~max_file_bytes, so memory stays bounded
        tensors, params = {}, {}
        for name in names:  # read_folder checked every name and shape
            with safe_open(str(where[name]), framework="pt") as f:
                t = f.get_tensor(name)
            tensors[piece_key(name, "param", 0, 0)] = t.float().reshape(-1).contiguous()
            params[name] = {
                "shape": shapes[name],
                "tp_dim": None,
                "tp_size": 1,
                "states": {"param": [[0, 0, t.numel()]]},
            }
        file = f"import_{i:05d}.safetensors"
        meta = {"rank": i, "file": file, "params": params, **write_shard(path / file, tensors)}
        metas.append(write_part(path, i, meta))  # the part of the index a rank writes, a plan for the top level
    cfg = Config(model=m)
    # config.json too: AutoTokenizer reads its model_type to pick the tokenizer class, so the copy loads as
    # the source folder does (and as --model.init_from of it does)
    if carry_files(hf_dir, tmp / "hf_files", extra=IMPORT_EXTRA):
        cfg.data.tokenizer = str((root / "hf_files").resolve())
    cfg.checkpoint.resume = str(root.resolve())
    fsync_write(
        tmp / "config.yaml",
        "# written by launch/convert.py import: the imported model's shape\n"
        + yaml.safe_dump(cfg.to_dict(), sort_keys=False),
    )
    # Published last, through the one commit path of every checkpoint: `latest` appears only once all is written.
    run = header(RunPosition(0, 0), cfg, {"imported_from": str(hf_dir.resolve())}, model_only=True)
    index, locator = merge_index(metas, {**run, "adam_step": None})
    publish(tmp, 0, token, index, extra=locator)
