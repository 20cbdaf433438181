"""Memory measured on any device, CPU included: bytes of tensors a rank holds, saved for backward, or alive at once.

There is no allocator to ask on CPU, so memory is counted as tensor storages (each distinct storage once):
- ``tensor_bytes_held(model, optimizer)``: parameters, gradients and optimizer state as this rank holds them (the
  local shard of a DTensor; FSDP2's unsharded gradients accumulated between reduce-scatters; gathered weights).
- ``SavedActivations``: ``torch.autograd.graph.saved_tensors_hooks`` that count the storages autograd saves for
  backward (parameters excluded) and their peak; a saved tensor is released when autograd frees it.
- ``LiveTensorBytes``: a ``TorchDispatchMode`` that counts every storage an op allocates until it is freed (as
  torch.distributed._tools.mem_tracker does, without its allocator rounding): the step's peak of new memory, which
  also sees what activation checkpointing keeps (its own saved-tensor hooks hide it from ``SavedActivations``).
launch/bench/measure.py runs a Trainer's step under all three; engine/planning/planner.py is checked against it
(tests/planning/test_planner.py, launch/bench/tp.py).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from engine.internals import private


def _storages(t: torch.Tensor) -> list:
    """The storages under ``t``: its own, or those of the inner tensors of a wrapper subclass (DTensor: the local
    shard), found through the subclass protocol's ``__tensor_flatten__``."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = [getattr(t, name) for name in names]
        return [s for i in inner if isinstance(i, torch.Tensor) for s in _storages(i)]
    return [t.untyped_storage()]


def storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the distinct storages of ``tensors`` not already in ``seen``."""
    total = 0
    for t in tensors:
        for storage in [] if t is None else _storages(t):
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def fsdp_params(model: nn.Module) -> list:
    """FSDP2's per-parameter records (torch.distributed.fsdp internals: ``FSDPParam``), empty without FSDP.
    They hold what the module tree does not show: gradients accumulated unsharded while gradient sync is off, and
    the all-gathered (unsharded) weights. Private API of torch 2.13: if it moves, engine.internals.private fails
    naming the attribute and the tested torch, rather than this returning [] and the accounting going wrong."""
    out = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = private(module, "torch", "_get_fsdp_state")()
            for group in private(state, "torch", "_fsdp_param_groups"):
                out.extend(private(group, "torch", "fsdp_params"))
    return out


def gathered_weight_bytes(records: list) -> int:
    """Bytes of FSDP2's all-gathered weights allocated right now, given ``fsdp_params(model)`` (a freed one has a
    storage of size 0)."""
    return storage_bytes([t for fp in records for t in private(fp, "torch", "all_gather_outputs")], set())


def tensor_bytes_held(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"params", "grads", "optimizer"}: bytes of the distinct storages this rank holds for each (tied weights once;
    FSDP: local shards plus unsharded gradients accumulated under no-sync)."""
    seen: set[int] = set()
    params = list(model.parameters())
    out = {"params": storage_bytes(params, seen)}
    # _unsharded_param appears at FSDP2's first all-gather, so its absence before that is no version change.
    unsharded = [
        g
        for fp in fsdp_params(model)
        for g in (
            private(fp, "torch", "unsharded_accumulated_grad"),
            getattr(getattr(fp, "_unsharded_param", None), "grad", None),
        )
    ]
    out["grads"] = storage_bytes([p.grad for p in params] + unsharded, seen)
    state = (
        []
        if optimizer is None
        else [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    )
    out["optimizer"] = storage_bytes(state, seen)
    return out


class SavedActivations:
    """Bytes of distinct storages saved for backward and alive at once, with the peak. Parameters and views of
    parameters (FSDP's unsharded weights included) are not activations and are not counted; ``on_event`` (if set)
    is called at every save and every use in backward, e.g. to sample other quantities at those moments."""

    class Held:
        def __init__(self, tensor: torch.Tensor):
            self.tensor = tensor

    def __init__(self, model: nn.Module, on_event=None):
        self.params = {s.data_ptr() for p in model.parameters() for s in _storages(p)}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0
        self.on_event = on_event

    def pack(self, t: torch.Tensor):
        if self.on_event is not None:
            self.on_event()
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return t
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self.params or nbytes == 0:
            return t
        if not self.refs.get(key):
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        held = self.Held(t)
        weakref.finalize(held, self.release, key, nbytes)  # runs when autograd frees this saved tensor
        return held

    def release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes

    def unpack(self, saved):
        if self.on_event is not None:
            self.on_event()
        return saved.tensor if isinstance(saved, SavedActivations.Held) else saved

    def hooks(self):
        """The context manager that makes autograd report to this tracker."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages allocated by ops run inside this mode and still alive, and their peak.

    Outputs that alias an input (in-place ops, views) are not allocations and are skipped; a storage is released
    when its last tensor goes (``weakref.finalize`` on the storage, whose Python object torch keeps for its
    lifetime). Memory resized outside any op (FSDP2 frees and re-allocates gathered weights that way) is not seen:
    ``extra()``, if given, returns such bytes allocated right now, and is added at every op to find the peak.
    """

    def __init__(self, extra=None):
        super().__init__()
        self.live = self.peak = 0
        self.extra = extra
        self._tracked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        # a list return (unbind, split, chunk: "Tensor(a)[]") is one schema return for all its tensors: every one
        # aliases the input (unbinding a parameter made before this mode would count its storage as allocated)
        listed = len(returns) == 1 and isinstance(out, list)
        for i, t in enumerate(outputs):
            aliased = (listed or i < len(returns)) and returns[0 if listed else i].alias_info is not None
            if isinstance(t, torch.Tensor) and not aliased:
                for storage in _storages(t):
                    self._track(storage)
        if self.extra is not None:
            self.peak = max(self.peak, self.live + self.extra())
        return out

    def _track(self, storage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if key in self._tracked or nbytes == 0:
            return
        self._tracked.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, key, nbytes)

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes
