"""What ZeRO holds, read out of DeepSpeed: checkpoint pieces of parameters and Adam state, and bytes held.

- ``Zero12State``: DeepSpeed ZeRO-1/2 (and its BF16_Optimizer) keep fp32 master weights and moments in one flat
  partition per param group; ``param._hp_mapping`` (deepspeed/utils/tensor_fragment.py) gives the flat range of
  the parameter this rank owns (``lp_fragment_address``) and views of the master and moment fragments.
- ``Zero3State``: ZeRO-3 partitions each parameter: dp rank r holds flat elements [r*ps, (r+1)*ps) (padded);
  read and written with ``deepspeed.utils.safe_{get,set}_local_{fp32_param,optimizer_state}``.
Both follow engine/parallel/dp/state.py's CheckpointState protocol (held, writes, state_names, get, set, prepare,
finish, adam_step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.internals import private
from engine.metrics.memory import storage_bytes
from engine.parallel.dp.state import CheckpointState, Slot, step_tensor


class _ZeroState(CheckpointState):
    """What ZeRO-1/2 and ZeRO-3 share: a torch AdamW (``inner``) stepping flat fp32 partitions (``flats``)."""

    flats: list[torch.Tensor]

    def __init__(self, zero):
        self.opt = zero.engine.optimizer  # DeepSpeed's ZeRO optimizer wrapping our AdamW
        self.inner = private(self.opt, "deepspeed", "optimizer")

    def writes(self, start: int, end: int, param: nn.Parameter | None = None) -> tuple[int, int]:
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
            state["step"] = step_tensor(self._group_of_flat(i), step, flat.device)


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
        private(
            self.opt, "deepspeed", "update_lp_params"
        )()  # master fragments -> every rank's working weights (an all-gather over dp)


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
        return t.detach().reshape(-1)[: slot.end - slot.start]  # drop the padding of the last partition

    @torch.no_grad()
    def set(self, slot: Slot, state: str, value: torch.Tensor) -> None:
        from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state

        p = slot.param
        padded = torch.zeros(
            private(p, "deepspeed", "ds_tensor").ds_numel, dtype=torch.float32, device=value.device
        )  # (ps,)
        padded[: value.numel()] = value
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


def _tensors(obj, depth: int = 0):
    """Tensors in obj, a tensor or (nested, up to 2 levels) list/tuple/dict of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 2 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def zero_bytes_held(zero) -> dict[str, int]:
    """``tensor_bytes_held`` (engine/metrics/memory.py) for a DeepSpeed ``ZeRO``: parameters (ZeRO-3: the local
    partition ``ds_tensor``),
    gradients (on the parameters, or DeepSpeed's reduced partitions), optimizer state (Adam moments and the fp32
    master partitions DeepSpeed gives the base optimizer as its parameters) and ``other`` DeepSpeed buffers
    (reduction buckets). Reads DeepSpeed 0.19 attribute names; one that moves is counted as ``other``."""
    seen: set[int] = set()
    params = list(zero.module.parameters())
    out = {"params": storage_bytes([getattr(p, "ds_tensor", p) for p in params], seen)}
    ds = zero.optimizer
    grads = [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
    for attr in ("averaged_gradients", "all_grad_tensors", "grads_in_partition", "grad_partitions_flat_buffer"):
        grads += list(_tensors(getattr(ds, attr, None)))
    out["grads"] = storage_bytes(grads, seen)
    base = ds.optimizer
    state = [t for st in base.state.values() for t in _tensors(st) if t.dim() > 0]
    masters = [
        t
        for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
        for t in _tensors(getattr(ds, attr, None))
    ]  # ZeRO-1/2 and ZeRO-3 names of the fp32 master copy
    out["optimizer"] = storage_bytes(state + [p for g in base.param_groups for p in g["params"]] + masters, seen)
    out["other"] = storage_bytes([t for v in vars(ds).values() for t in _tensors(v)], seen)
    return out
