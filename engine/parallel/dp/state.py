"""What each rank holds of every parameter and its Adam state, under each dp_mode, as pieces of the checkpoint format.

A ``Slot`` describes one local parameter in the terms of engine/checkpoint/format.py: its tp block (tp_dim, tp_size,
tp_rank), the flat range [start, end) of that block this rank holds, and the range it writes; its ``parts`` give the
same per Hugging Face tensor it holds (global name and shape, ranges of that tensor's tp block): one part for a
plain parameter, q/k/v or gate/up for a fused one (engine/model/fused.py), so checkpoints keep the names, shapes
and tp cuts they had before the fusion and reshard across tp as before. Replicas are written once: a
tp-replicated weight (a norm) by tp rank 0 only, the last stage's copy of a tied embedding never (it is read back
from the embedding's pieces), and a ddp replica split evenly over the dp ranks so that they write in parallel.
The state classes read and write those ranges:

- ``TorchState`` (ddp, fsdp): the parameter itself or its FSDP2 DTensor shard (Shard(0): a row range of the
  block), and torch AdamW's per-parameter ``exp_avg``/``exp_avg_sq``/``step``.
- ZeRO's own (``Zero12State``, ``Zero3State``) live with the rest of ZeRO in engine/parallel/dp/zero_state.py.
Each dp mode hands its state object to the checkpointer (``DataParallel.checkpoint_state``); every one follows
``CheckpointState``, the protocol engine/checkpoint/ calls (each dp mode's DpModeSpec.state names its classes, and
tests/parallel/dp/test_checkpoint_state.py checks them against it).
Adam's bias correction needs its step count, stored once in the index (every parameter steps every step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from engine.model.fused import part_blocks
from engine.model.init import full_shape
from engine.model.shards import local as _local
from engine.model.shards import tp_dim
from engine.parallel.ep import expert_parameters

TIED_COPY, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


@dataclass
class Part:
    """One Hugging Face tensor a slot holds (the slot itself, or q/k/v of a fused qkv_proj), in its own terms."""

    name: str  # the name its pieces are stored under (a tied LM-head copy: the embedding's)
    shape: list[int]  # global shape
    at: int  # flat offset of its tp block in the local parameter
    start: int  # flat range [start, end) of its tp block held on this rank
    end: int
    write: tuple[int, int] | None  # the part of that range this rank writes; None: nothing


@dataclass
class Slot:
    name: str  # the parameter's name in the model
    param: nn.Parameter
    tp_dim: int | None  # the tp cut, the same for every part
    tp_size: int
    tp_rank: int
    start: int  # flat range [start, end) of the local parameter held on this rank
    end: int
    write: tuple[int, int] | None  # the part of that range this rank writes; None: written elsewhere
    parts: list[Part]  # what it holds, under the names checkpoints store: ranges are those above, cut per part


def step_tensor(group: dict, step: int, device) -> torch.Tensor:
    """Adam's step count as torch.optim.Adam keeps it: a 0-d fp32 tensor, on the device when capturable/fused."""
    on_device = group.get("capturable") or group.get("fused")
    return torch.tensor(float(step), dtype=torch.float32, device=device if on_device else "cpu")


@runtime_checkable
class CheckpointState(Protocol):
    """What engine/checkpoint/ asks of a dp mode's state (``DataParallel.checkpoint_state``) to save and load the
    pieces of engine/checkpoint/format.py. Save: ``held`` and ``writes`` place the rank's ranges in each slot,
    ``state_names`` and ``get`` read them, ``adam_step`` gives the step count. Load: ``prepare`` creates the Adam
    state to overwrite, ``set`` writes each range, ``finish`` hands the values back to the optimizer."""

    def held(self, p: nn.Parameter, numel: int) -> tuple[int, int]:
        """The flat range [start, end) of the local parameter ``p`` (``numel`` elements) this rank holds."""

    def writes(self, start: int, end: int, param: nn.Parameter | None = None) -> tuple[int, int]:
        """Of the held range [start, end) of ``param``, the part this rank writes (replicas are written once; an
        expert-parallel weight's replicas are its expert-dp ranks)."""

    def state_names(self, slot: Slot) -> list[str]:
        """The optimizer states of ``slot`` shaped like it (Adam's exp_avg, exp_avg_sq), besides "param"."""

    def get(self, slot: Slot, state: str) -> torch.Tensor:
        """The held range of ``slot``'s ``state`` ("param" or an optimizer state), flat."""

    def set(self, slot: Slot, state: str, value: torch.Tensor) -> None:
        """Write ``value`` (flat, the held range) into ``slot``'s ``state``."""

    def prepare(self, slots: list[Slot], names: list[str], step: int) -> None:
        """Before ``set``: create the optimizer states ``names`` and the step count ``step`` to be overwritten."""

    def finish(self) -> None:
        """After every ``set``: make the optimizer use the values written (a copy back, or nothing)."""

    def adam_step(self) -> int | None:
        """Adam's step count, None before the first step."""


class TorchState(CheckpointState):
    """ddp and fsdp: torch AdamW over plain (ddp) or FSDP2-sharded DTensor (fsdp) parameters."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx, fsdp: bool):
        self.model, self.optimizer, self.ctx, self.fsdp = model, optimizer, ctx, fsdp
        self.group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        self.experts = {id(p) for _, p in expert_parameters(model)}

    def held(self, p: nn.Parameter, numel: int) -> tuple[int, int]:
        if not self.fsdp:
            return 0, numel
        # FSDP shards over dp x cp (ctx.grad_mesh), an expert-parallel weight over its expert-dp group (fsdp.py)
        size, rank = (
            (self.ctx.size("edp"), self.ctx.axis_rank("edp"))
            if id(p) in self.experts
            else (self.ctx.grad_size, self.ctx.grad_rank)
        )
        rows = p.shape[0]  # FSDP2 chunks dim 0 like torch.chunk: ceil(rows / size) rows per rank, the last fewer
        per = -(-rows // size)
        first = min(rank * per, rows)
        if _local(p).shape[0] != min(per, rows - first):
            raise RuntimeError(
                f"unexpected FSDP shard of {tuple(p.shape)} on rank {rank} of {size}: {tuple(_local(p).shape)}"
            )  # FSDP2 changed its sharding: a bug here
        row = numel // rows if rows else 0
        return first * row, (first + _local(p).shape[0]) * row

    def writes(self, start: int, end: int, param: nn.Parameter | None = None) -> tuple[int, int]:
        """Replicas (ddp) split the block evenly over dp x cp ranks (an expert-parallel weight: over its expert-dp
        ranks, the dp ranks holding the same experts); a shard (fsdp) is written by its holder."""
        if self.fsdp:
            return start, end
        expert = param is not None and id(param) in self.experts
        size, rank = (
            (self.ctx.size("edp"), self.ctx.axis_rank("edp")) if expert else (self.ctx.grad_size, self.ctx.grad_rank)
        )  # the replicas: dp x cp ranks
        per = -(-(end - start) // size)
        lo = min(start + rank * per, end)
        return lo, min(lo + per, end)

    def state_names(self, slot: Slot) -> list[str]:
        state = self.optimizer.state.get(slot.param, {})
        return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == slot.param.shape]

    def get(self, slot: Slot, state: str) -> torch.Tensor:
        t = slot.param if state == "param" else self.optimizer.state[slot.param][state]
        return _local(t).detach().reshape(-1)

    def adam_step(self) -> int | None:
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(float(state["step"]))
        return None

    def prepare(self, slots: list[Slot], names: list[str], step: int) -> None:
        """Create the Adam state torch would create at its first step, to be overwritten by the checkpoint's."""
        for slot in slots:
            p = slot.param
            state = self.optimizer.state[p]
            for name in names:
                state.setdefault(name, torch.zeros_like(p, memory_format=torch.preserve_format))
            state["step"] = step_tensor(self.group_of[id(p)], step, _local(p).device)

    @torch.no_grad()
    def set(self, slot: Slot, state: str, value: torch.Tensor) -> None:
        t = slot.param if state == "param" else self.optimizer.state[slot.param][state]
        _local(t).view(-1).copy_(value)

    def finish(self) -> None:
        pass


def _cut(lo: int, hi: int, at: int, numel: int) -> tuple[int, int]:
    """The flat range [lo, hi) of a parameter, seen from a part at [at, at + numel): a range of the part."""
    a = min(max(lo - at, 0), numel)
    return a, max(a, min(hi - at, numel))


def _parts(
    module: nn.Module,
    name: str,
    attr: str,
    local_shape: torch.Size,
    dim: int | None,
    start: int,
    end: int,
    write: tuple[int, int] | None,
) -> list[Part]:
    """The slot's Hugging Face tensors (engine/model/fused.py part_blocks) with their global shapes and ranges."""
    out = []
    for part, at, shape in part_blocks(module, name, local_shape):
        numel = shape.numel()
        lo, hi = _cut(start, end, at, numel)
        w = _cut(*write, at, numel) if write else None
        out.append(
            Part(
                part,
                list(full_shape(module, attr, shape)) if dim is not None else list(shape),
                at,
                lo,
                hi,
                w if w and w[0] < w[1] else None,
            )
        )
    return out


def slots(model: nn.Module, access, ctx, tie_embeddings: bool) -> list[Slot]:
    """Every local parameter once (tied weights by their first name), with its tp cut, ranges and parts."""
    modules = dict(model.named_modules())
    out = []
    for name, p in model.named_parameters():
        mod_name, _, attr = name.rpartition(".")
        module = modules[mod_name]
        size = getattr(module, "tp_size", 1)
        dim = tp_dim(module, attr)
        rank = getattr(module, "tp_rank", 0) if size > 1 else 0
        local_shape = torch.Size(p.ds_shape) if hasattr(p, "ds_shape") else p.shape  # ZeRO-3: p is empty
        numel = local_shape.numel()
        start, end = access.held(p, numel)
        tied_copy = tie_embeddings and name == TIED_COPY and ctx.pp > 1
        written = not tied_copy and (dim is not None or ctx.tp_rank == 0)  # replicated over tp: once
        write = access.writes(start, end, p) if written else None
        write = write if write and write[0] < write[1] else None
        parts = _parts(module, EMBEDDING if tied_copy else name, attr, local_shape, dim, start, end, write)
        out.append(Slot(name, p, dim, size if dim is not None else 1, rank, start, end, write, parts))
    return out
