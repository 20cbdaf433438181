"""``--model.init_from HF_DIR``: start a run from a Hugging Face folder without a separate import step.

``adopt_shape`` replaces the model section with the folder's config.json (engine/hf/families.py; the HF folder
defines the model, so model keys given beside init_from are overridden, except ``name``) and points
``data.tokenizer`` at the folder when it has a tokenizer and none was given. ``load_weights`` then fills a
freshly built trainer's checkpoint parts (engine/checkpoint/parts.py), at any layout and dp mode, with the folder's
tensors: each rank reads only its tp block of each parameter, through the same slots a checkpoint load uses
(engine/parallel/dp/state.py). A checkpoint to resume from (checkpoint.resume) wins over init_from, so a restarted
job continues where it stopped.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open

from engine.checkpoint.format import CheckpointError
from engine.checkpoint.parts import CheckpointParts
from engine.config import Config, ConfigError, validate
from engine.hf.convert import TOKENIZER_FILES
from engine.hf.folder import hf_tensors, read_folder, skip_reason
from engine.parallel.dp.state import slots


def adopt_shape(cfg: Config) -> None:
    """Set cfg.model (and data.tokenizer if empty) from cfg.model.init_from; no-op without it. Idempotent. The
    folder is checked whole first (engine/hf/folder.py: config.json, and the weights' headers against it),
    so a wrong size is refused here, before the launcher builds anything."""
    source = cfg.model.init_from
    if not source:
        return
    folder = Path(source).expanduser()
    try:
        checked = read_folder(folder)
    except CheckpointError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    m = dataclasses.replace(
        checked.model, name=cfg.model.name if cfg.model.name != "tiny" else checked.model.name, init_from=source
    )
    if m != cfg.model:  # the first call (launch/pretrain.py, then the trainer again)
        for name in checked.skipped:
            print(f"model.init_from: skipping {name} ({skip_reason(name)})", flush=True)
    cfg.model = m
    if not cfg.data.tokenizer and any((folder / f).is_file() for f in TOKENIZER_FILES):
        cfg.data.tokenizer = str(folder.resolve())
    validate(cfg)  # train.seq_len against the folder's max_position_embeddings and sliding window


def _block(f, name: str, dim: int | None, size: int, rank: int) -> torch.Tensor:
    """This tp rank's block of tensor ``name`` (the whole tensor when it is not sharded), read alone."""
    sl = f.get_slice(name)
    if dim is None:
        return sl[:]
    n = sl.get_shape()[dim] // size
    index = [slice(None)] * len(sl.get_shape())
    index[dim] = slice(rank * n, (rank + 1) * n)
    return sl[tuple(index)]


@torch.no_grad()
def load_weights(parts: CheckpointParts, folder: Path) -> None:
    """Overwrite every local parameter of ``parts`` with the folder's weights (fp32 masters in every dp mode)."""
    ctx = parts.ctx
    try:  # a missing, truncated or foreign weight file: one line (launch/pretrain.py), as convert.py import gives
        where = hf_tensors(folder)
    except CheckpointError as e:
        raise CheckpointError(f"model.init_from: {e}") from None
    access = parts.state()
    for slot in slots(parts.model, access, ctx, parts.cfg.model.tie_embeddings):
        held = []  # the held range part by part (q, k, v of a fused qkv_proj: in stacking order)
        for part in slot.parts:
            if part.name not in where:
                raise CheckpointError(f"{folder}: the weights have no tensor '{part.name}'")
            with safe_open(str(where[part.name]), framework="pt") as f:
                shape = list(f.get_slice(part.name).get_shape())
                if shape != part.shape:
                    raise CheckpointError(
                        f"{where[part.name]}: {part.name} has shape {shape}, config.json implies {part.shape}"
                    )
                block = _block(f, part.name, slot.tp_dim, slot.tp_size, slot.tp_rank)
            held.append(block.reshape(-1)[part.start : part.end].to(torch.float32))
        if slot.start < slot.end:
            access.set(slot, "param", torch.cat(held).to(ctx.device))
    access.finish()
