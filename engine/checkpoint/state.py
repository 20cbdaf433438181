"""What each rank holds of every parameter and its Adam state, under each dp_mode, as pieces of the checkpoint format.

A ``Slot`` describes one local parameter in the terms of engine/checkpoint/format.py: its global name and shape, its
tp block (tp_dim, tp_size, tp_rank), the flat range [start, end) of that block this rank holds, and the range it
writes. Replicas are written once: a tp-replicated weight (a norm) by tp rank 0 only, the last stage's copy of a
tied embedding never (it is read back from the embedding's pieces), and a ddp replica split evenly over the dp
ranks so that they write in parallel. The state classes read and write those ranges:

- ``TorchState`` (ddp, fsdp): the parameter itself or its FSDP2 DTensor shard (Shard(0): a row range of the
  block), and torch AdamW's per-parameter ``exp_avg``/``exp_avg_sq``/``step``.
- ``Zero12State``: DeepSpeed ZeRO-1/2 (and its BF16_Optimizer) keep fp32 master weights and moments in one flat
  partition per param group; ``param._hp_mapping`` (deepspeed/utils/tensor_fragment.py) gives the flat range of
  the parameter this rank owns (``lp_fragment_address``) and views of the master and moment fragments.
- ``Zero3State``: ZeRO-3 partitions each parameter: dp rank r holds flat elements [r*ps, (r+1)*ps) (padded);
  read and written with ``deepspeed.utils.safe_{get,set}_local_{fp32_param,optimizer_state}``.
Adam's bias correction needs its step count, stored once in the index (every parameter steps every step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from engine.model.init import full_shape
from engine.internals import private

TIED_COPY, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


@dataclass
class Slot:
    name: str  # the name its pieces are stored under (a tied LM-head copy: the embedding's)
    param: nn.Parameter
    shape: list[int]  # global shape
    tp_dim: int | None
    tp_size: int
    tp_rank: int
    start: int  # flat range [start, end) of the tp block held on this rank
    end: int
    write: tuple[int, int] | None  # the part of that range this rank writes; None: written elsewhere


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _step_tensor(group: dict, step: int, device) -> torch.Tensor:
    """Adam's step count as torch.optim.Adam keeps it: a 0-d fp32 tensor, on the device when capturable/fused."""
    on_device = group.get("capturable") or group.get("fused")
    return torch.tensor(float(step), dtype=torch.float32, device=device if on_device else "cpu")


class TorchState:
    """ddp and fsdp: torch AdamW over plain (ddp) or FSDP2-sharded DTensor (fsdp) parameters."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, ctx, fsdp: bool):
        self.model, self.optimizer, self.ctx, self.fsdp = model, optimizer, ctx, fsdp
        self.group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def held(self, p: nn.Parameter, numel: int) -> tuple[int, int]:
        if not self.fsdp:
            return 0, numel
        rows = p.shape[0]  # FSDP2 chunks dim 0 like torch.chunk: ceil(rows / dp) rows per rank, the last fewer
        per = -(-rows // self.ctx.dp)
        first = min(self.ctx.dp_rank * per, rows)
        if _local(p).shape[0] != min(per, rows - first):
            raise RuntimeError(f"unexpected FSDP shard of {tuple(p.shape)} on dp rank {self.ctx.dp_rank}: "
                               f"{tuple(_local(p).shape)}")  # FSDP2 changed its sharding: a bug here
        row = numel // rows if rows else 0
        return first * row, (first + _local(p).shape[0]) * row

    def writes(self, start: int, end: int) -> tuple[int, int]:
        """Replicas (ddp) split the block evenly over dp ranks; a shard (fsdp) is written by its holder."""
        if self.fsdp:
            return start, end
        per = -(-(end - start) // self.ctx.dp)
        lo = min(start + self.ctx.dp_rank * per, end)
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
            state["step"] = _step_tensor(self.group_of[id(p)], step, _local(p).device)

    @torch.no_grad()
    def set(self, slot: Slot, state: str, value: torch.Tensor) -> None:
        t = slot.param if state == "param" else self.optimizer.state[slot.param][state]
        _local(t).view(-1).copy_(value)

    def finish(self) -> None:
        pass


class _ZeroState:
    """What ZeRO-1/2 and ZeRO-3 share: a torch AdamW (``inner``) stepping flat fp32 partitions (``flats``)."""
    flats: list[torch.Tensor]

    def __init__(self, zero):
        self.opt = zero.engine.optimizer  # DeepSpeed's ZeRO optimizer wrapping our AdamW
        self.inner = private(self.opt, "deepspeed", "optimizer")

    def writes(self, start: int, end: int) -> tuple[int, int]:
        return start, end

    def _moments(self, flat: torch.Tensor) -> list[str]:
        state = self.inner.state.get(flat, {})
        return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == flat.shape]

    def _group_of_flat(self, i: int) -> dict:
        return self.inner.param_groups[i]

    def adam_step(self) -> int | None:
        state = self.inner.state.get(self.flats[0], {})
        return int(float(state["step"])) if "step" in state else None

    def prepare(self, slots: list[Slot], names: list[str], step: int) -> None:
        """Create every flat partition's Adam state (torch would at DeepSpeed's first step), to be overwritten."""
        for i, flat in enumerate(self.flats):
            state = self.inner.state[flat]
            for name in names:
                state.setdefault(name, torch.zeros_like(flat))
            state["step"] = _step_tensor(self._group_of_flat(i), step, flat.device)


class Zero12State(_ZeroState):
    """DeepSpeed ZeRO-1/2: fp32 master fragments and moments located through ``param._hp_mapping``."""

    def __init__(self, zero):
        super().__init__(zero)  # DeepSpeedZeroOptimizer, or BF16_Optimizer (bf16 + ZeRO-1)
        # DeepSpeedZeroOptimizer's name for the fp32 master partitions, then BF16_Optimizer's
        self.flats = private(self.opt, "deepspeed", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")

    def held(self, p: nn.Parameter, numel: int) -> tuple[int, int]:
        mapping = private(p, "deepspeed", "_hp_mapping")  # None: this rank holds none of p
        if mapping is None:
            return 0, 0
        address = mapping.lp_fragment_address
        return address.start, address.start + address.numel

    def _fragment(self, slot: Slot, state: str) -> torch.Tensor:
        """This rank's fp32 fragment of the parameter (state 'param') or of one of its Adam moments. The moments
        are cut from the flat state by the fragment's address rather than read from ``optim_fragment``: DeepSpeed
        links that after the first group's step only, so it stays empty for the second param group."""
        mapping = private(slot.param, "deepspeed", "_hp_mapping")
        if state == "param":
            return mapping.get_hp_fragment()
        address = mapping.get_hp_fragment_address()
        flat = self.flats[mapping.param_group_index]
        return self.inner.state[flat][state].narrow(0, address.start, address.numel)

    def state_names(self, slot: Slot) -> list[str]:
        return self._moments(self.flats[private(slot.param, "deepspeed", "_hp_mapping").param_group_index])

    def get(self, slot: Slot, state: str) -> torch.Tensor:
        return self._fragment(slot, state).detach()

    @torch.no_grad()
    def set(self, slot: Slot, state: str, value: torch.Tensor) -> None:
        self._fragment(slot, state).copy_(value)

    def finish(self) -> None:
        private(self.opt, "deepspeed", "update_lp_params")()  # master fragments -> every rank's working weights (an all-gather over dp)


class Zero3State(_ZeroState):
    """DeepSpeed ZeRO-3: each parameter's own partition, through DeepSpeed's local fragment API."""

    def __init__(self, zero):
        super().__init__(zero)  # DeepSpeedZeroOptimizer_Stage3
        self.flats = private(self.opt, "deepspeed", "fp32_partitioned_groups_flat")  # one fp32 flat per sub-group

    def _group_of_flat(self, i: int) -> dict:
        return self.inner.param_groups[private(self.opt, "deepspeed", "sub_group_to_group_id")[i]]

    def held(self, p: nn.Parameter, numel: int) -> tuple[int, int]:
        size = private(p, "deepspeed", "ds_tensor").ds_numel  # partition size, padded so that dp * size >= numel
        rank = dist.get_rank(group=private(p, "deepspeed", "ds_process_group"))
        return min(rank * size, numel), min((rank + 1) * size, numel)

    def state_names(self, slot: Slot) -> list[str]:
        return self._moments(self.flats[0])  # every sub-group has the same moments

    def get(self, slot: Slot, state: str) -> torch.Tensor:
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

        p = slot.param
        t = safe_get_local_fp32_param(p) if state == "param" else safe_get_local_optimizer_state(p, state)
        return t.detach().reshape(-1)[:slot.end - slot.start]  # drop the padding of the last partition

    @torch.no_grad()
    def set(self, slot: Slot, state: str, value: torch.Tensor) -> None:
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        p = slot.param
        padded = torch.zeros(private(p, "deepspeed", "ds_tensor").ds_numel, dtype=torch.float32, device=value.device)  # (ps,)
        padded[:value.numel()] = value
        if state == "param":
            safe_set_local_fp32_param(p, padded)
        else:
            safe_set_local_optimizer_state(p, padded, state)

    def finish(self) -> None:
        """What ZeRO-3's step does after updating the masters: copy them into the working partitions, and
        re-gather the parameters it keeps whole (``stage3_param_persistence_threshold``)."""
        with torch.no_grad():
            for lp, hp in zip(private(self.opt, "deepspeed", "fp16_partitioned_groups_flat"), self.flats):
                lp.data.copy_(hp.data)
        persistent = private(self.opt, "deepspeed", "persistent_parameters")
        if persistent:
            persistent[0].all_gather(persistent)


def state_for(trainer):
    """The state class for the trainer's dp_mode."""
    zero = getattr(trainer, "zero", None)
    if zero is not None:
        return Zero3State(zero) if zero.stage == 3 else Zero12State(zero)
    fsdp = trainer.cfg.parallel.dp_mode == "fsdp"
    if fsdp:
        from torch.distributed.fsdp import FSDPModule

        for module in trainer.model.modules():  # a forward-only pass (evaluation) can leave the root unsharded,
            if isinstance(module, FSDPModule):  # with plain tensors in place of the sharded DTensor parameters
                module.reshard()
    return TorchState(trainer.model, trainer.optimizer, trainer.ctx, fsdp)


def slots(model: nn.Module, access, ctx, tie_embeddings: bool) -> list[Slot]:
    """Every local parameter once (tied weights by their first name), with its tp cut and ranges."""
    modules = dict(model.named_modules())
    out = []
    for name, p in model.named_parameters():
        mod_name, _, attr = name.rpartition(".")
        module = modules[mod_name]
        size = getattr(module, "tp_size", 1)
        dim = getattr(module, "tp_dims", {}).get(attr) if size > 1 else None
        rank = getattr(module, "tp_rank", 0) if size > 1 else 0
        local_shape = torch.Size(p.ds_shape) if hasattr(p, "ds_shape") else p.shape  # ZeRO-3: p is empty
        numel = local_shape.numel()
        start, end = access.held(p, numel)
        tied_copy = tie_embeddings and name == TIED_COPY and ctx.pp > 1
        written = not tied_copy and (dim is not None or ctx.tp_rank == 0)  # replicated over tp: once
        write = access.writes(start, end) if written else None
        out.append(Slot(EMBEDDING if tied_copy else name, p,
                        list(full_shape(module, attr, local_shape)) if dim is not None else list(local_shape),
                        dim, size if dim is not None else 1, rank, start, end,
                        write if write and write[0] < write[1] else None))
    return out
