"""What a checkpoint holds of a rank, and putting it back: the pieces of every parameter and Adam moment this
rank writes (engine/parallel/dp/state.py), its RNG states, and the run's position (step, data position), config and
layout.

``contents`` is one rank's part of a save, from explicit parts (engine/checkpoint/parts.py); ``load_into``
overwrites freshly built parts, at any layout, with a checkpoint (engine/checkpoint/checkpointer.py chooses and
validates it first) and returns the position it was saved at. RNG streams belong to ranks, so they are
restored only at the layout that wrote them; nothing in training draws from them (initialisation and the data
order use their own seeded generators), so losses do not depend on it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from engine.checkpoint.format import (
    INDEX,
    MODEL_SHAPE_KEYS,
    CheckpointError,
    Reader,
    piece_key,
    rank_entry,
    shard_name,
)
from engine.checkpoint.parts import CheckpointParts, RunPosition
from engine.config import ModelConfig
from engine.parallel.dp.state import slots


def _rng_state(device: torch.device) -> tuple[dict, dict]:
    """RNG states of torch (CPU and this rank's CUDA device), Python and NumPy: tensors and JSON parts."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["rng/cuda"] = torch.cuda.get_rng_state(device)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(keys.astype(np.int64))
    version, state, gauss = random.getstate()
    return tensors, {"python": [version, list(state), gauss], "numpy": [kind, int(pos), int(has_gauss), cached]}


def _set_rng_state(path: Path, meta: dict, device: torch.device) -> None:
    with safe_open(str(path), framework="pt") as f:
        torch.set_rng_state(f.get_tensor("rng/torch"))
        if device.type == "cuda" and "rng/cuda" in f.keys():
            torch.cuda.set_rng_state(f.get_tensor("rng/cuda"), device)
        keys = f.get_tensor("rng/numpy").numpy().astype(np.uint32)
    kind, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, keys, pos, has_gauss, cached))
    version, state, gauss = meta["python"]
    random.setstate((version, tuple(state), gauss))


def snapshot(parts: CheckpointParts) -> tuple[dict, dict, int | None]:
    """CPU copies of the pieces this rank writes, their index entries, and Adam's step count."""
    access = parts.state()
    tensors, params = {}, {}
    for slot in slots(parts.model, access, parts.ctx, parts.cfg.model.tie_embeddings):
        if slot.write is None:
            continue
        held = {state: access.get(slot, state) for state in ["param", *access.state_names(slot)]}  # [start, end)
        for part in slot.parts:  # stored per Hugging Face tensor: q/k/v of a fused qkv_proj apart
            if part.write is None:
                continue
            lo, hi = part.write
            entry = params.setdefault(
                part.name, {"shape": part.shape, "tp_dim": slot.tp_dim, "tp_size": slot.tp_size, "states": {}}
            )
            for state, values in held.items():
                piece = values[part.at + lo - slot.start : part.at + hi - slot.start]
                tensors[piece_key(part.name, state, slot.tp_rank, lo)] = host_copy(piece)
                entry["states"].setdefault(state, []).append([slot.tp_rank, lo, hi])
    if parts.ctx.device.type == "cuda":
        torch.cuda.synchronize(parts.ctx.device)  # the one wait for every host_copy of the snapshot
    return tensors, params, access.adam_step()


def host_copy(piece: torch.Tensor) -> torch.Tensor:
    """An fp32 CPU copy of ``piece`` (n,). From CUDA: queued into pinned host memory without waiting (the copies
    of a snapshot overlap, and snapshot waits once); complete only after a synchronize."""
    if piece.device.type != "cuda":
        return piece.to("cpu", torch.float32, copy=True)
    out = torch.empty(piece.shape, dtype=torch.float32, pin_memory=True)
    # the fp32 cast (a temporary for bf16 pieces) runs on the device, on the stream the copy is queued on
    return out.copy_(piece.to(torch.float32), non_blocking=True)


def header(position: RunPosition, cfg, layout: dict, model_only: bool = False) -> dict:
    """The index's run-wide entries (everything but the pieces, files and ranks; Adam's step is added on commit)."""
    out = {
        "step": position.step,
        "consumed_samples": position.consumed_samples,
        "model_only": model_only,
        "config": cfg.to_dict(),
        "layout": layout,
    }
    if not model_only:
        out["scheduler"] = {"kind": "warmup_cosine (engine.optim.lr_at)", "step": position.step}
    return out


def contents(parts: CheckpointParts, position: RunPosition) -> tuple[dict, dict, dict]:
    """This rank's save: (CPU tensors to write, its index entry, the run's header (used by rank 0))."""
    ctx = parts.ctx
    tensors, params, adam_step = snapshot(parts)
    rng_tensors, rng = _rng_state(ctx.device)
    tensors.update(rng_tensors)
    meta = {
        "rank": ctx.rank,
        "file": shard_name(ctx.rank),
        "coords": ctx.coords(),
        "rng": rng,
        "params": params,
        "adam_step": adam_step,
    }
    return tensors, meta, header(position, parts.cfg, layout_of(parts.cfg, ctx))


def load_into(parts: CheckpointParts, path: Path, index: dict) -> RunPosition:
    """Overwrite the parts' weights, Adam state and (same layout) the rank's RNG from ``path``; returns the run
    position the checkpoint was saved at, for the caller to continue from."""
    ctx, cfg = parts.ctx, parts.cfg
    reader, access = Reader(path, index), parts.state()
    local = slots(parts.model, access, ctx, cfg.model.tie_embeddings)
    names = [] if index.get("model_only") else [s for s in reader.states(local[0].parts[0].name) if s != "param"]
    if names:
        access.prepare(local, names, index["adam_step"])
    for slot in local:
        for part in slot.parts:
            saved = reader.params.get(part.name, {}).get("shape")
            if saved != part.shape:
                raise CheckpointError(f"{path / INDEX}: {part.name} has shape {saved}, this model needs {part.shape}")
        for state in ["param", *names]:
            if slot.start < slot.end:  # the held range, assembled part by part (a fused q/k/v: in stacking order)
                value = torch.cat(
                    [
                        reader.read(p.name, state, slot.tp_dim, slot.tp_size, slot.tp_rank, p.start, p.end)
                        for p in slot.parts
                    ]
                )
                access.set(slot, state, value.to(ctx.device))
    access.finish()
    reader.close()
    same = index["layout"] == layout_of(cfg, ctx)
    meta = rank_entry(path, index, ctx.rank) if same else {}  # version 2: its own part, read only then
    if same and "rng" in meta:  # RNG streams belong to ranks; another layout
        _set_rng_state(path / meta["file"], meta["rng"], ctx.device)  # starts fresh ones
    return RunPosition(index["step"], index["consumed_samples"])


def layout_of(cfg, ctx) -> dict:
    p = cfg.parallel
    cp = {"cp": ctx.size("cp")} if ctx.size("cp") > 1 else {}  # absent at cp 1: a pre-cp checkpoint's layout
    return {
        "tp": ctx.tp,
        "pp": ctx.pp,
        "dp": ctx.dp,
        **cp,
        "dp_mode": p.dp_mode,
        "zero_stage": p.zero_stage,
        "world_size": ctx.world_size,
    }


def layout_change(index: dict, cfg, ctx) -> str | None:
    """The one line saying at which layout a resume continues and why, when it is not the checkpoint's; the
    elastic restart's (README "Elastic restart"): torchrun restarted with fewer hosts and dp = -1 shrank."""
    saved, now = index["layout"], layout_of(cfg, ctx)
    axes = ("tp", "pp", "dp", "cp")
    if all(saved.get(a, 1) == now.get(a, 1) for a in axes):
        return None

    def named(layout: dict) -> str:
        return " ".join(f"{a}{layout.get(a, 1)}" for a in axes if a != "cp" or layout.get("cp", 1) > 1)

    before, after = saved.get("world_size") or math.prod(saved.get(a, 1) for a in axes), now["world_size"]
    why = (
        f"the world {'shrank' if after < before else 'grew'} from {before} to {after}"
        if before != after
        else "parallel.tp, pp, dp or cp differ from the checkpoint's run"
    )

    def ranks(n: int) -> str:
        return f"{n} rank{'s' * (n != 1)}"

    return (
        f"resume: checkpoint step {index['step']} was saved at {named(saved)} ({ranks(before)}); continuing at "
        f"{named(now)} on {ranks(after)}: {why}"
    )


def check_model(path: Path, index: dict, model_cfg) -> None:
    # Rebuilt as a ModelConfig: an older checkpoint's missing keys take their defaults, and its head_dim (absent
    # before model.head_dim) resolves from its own hidden_size / num_heads
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    saved = ModelConfig(**{k: v for k, v in index["config"].get("model", {}).items() if k in known})
    diff = [
        f"model.{k}={getattr(saved, k)!r} (this run: {getattr(model_cfg, k)!r})"
        for k in MODEL_SHAPE_KEYS
        if getattr(saved, k) != getattr(model_cfg, k)
    ]
    if diff:
        raise CheckpointError(
            f"{path / INDEX} was written for another model: {', '.join(diff)}; use its model "
            f"settings, another checkpoint.dir, or checkpoint.resume=none"
        )


# What the tokens, the text and their order are made of: another value resumes the weights on other data.
RUN_KEYS = (("data", "tokenizer"), ("data", "paths"), ("data", "weights"), ("train", "seed"))


def data_changes(index: dict, cfg) -> list[str]:
    """One notice per data-shaping setting that differs from the checkpoint's, saying what it does to the data
    position (consumed_samples, engine/data/dataset.py GlobalBatchSampler): the run goes on, but not as before;
    and one naming every RUN_KEYS value that differs (of a model-only checkpoint, which starts a run on any data,
    the tokenizer only)."""
    train_cfg, consumed = cfg.train, index["consumed_samples"]
    saved = index["config"].get("train", {})
    notes = _run_changes(index["config"], cfg, RUN_KEYS[:1] if index.get("model_only") else RUN_KEYS)
    if saved.get("seq_len", train_cfg.seq_len) != train_cfg.seq_len:
        notes.append(
            f"train.seq_len is {train_cfg.seq_len}, the checkpoint's run had {saved['seq_len']}: the corpus "
            f"is cut into other samples in another order, so the {consumed} samples consumed no longer say "
            f"which text was seen (some will repeat, some be skipped)"
        )
    if saved.get("global_batch_size", train_cfg.global_batch_size) != train_cfg.global_batch_size:
        notes.append(
            f"train.global_batch_size is {train_cfg.global_batch_size}, the checkpoint's run had "
            f"{saved['global_batch_size']}: the data continues after sample {consumed} exactly, but each "
            f"step from here takes {train_cfg.global_batch_size} samples (the step count and learning-rate "
            f"schedule no longer match the samples seen)"
        )
    return notes


def _run_changes(saved: dict, cfg, keys: tuple) -> list[str]:
    """[the line naming each of ``keys`` whose value in ``cfg`` differs from the checkpoint's ``saved`` config]."""
    changed = []
    for section, key in keys:
        was, now = saved.get(section, {}).get(key), getattr(getattr(cfg, section), key)
        if was is not None and was != now:
            changed.append(f"{section}.{key} {_shown(was)} -> {_shown(now)}")
    if not changed:
        return []
    return [
        f"{'; '.join(changed)} (the checkpoint's run had the first): the weights trained on its tokens, text "
        f"and sample order go on with these"
    ]


def _shown(value) -> str:
    """A config value for a notice, cut to 80 characters (data.paths may list thousands)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
