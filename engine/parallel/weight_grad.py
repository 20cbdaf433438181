"""The split backward of zero-bubble pipelining (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 2):
B computes only d(loss)/d(input), which the previous stage waits for; W computes d(loss)/d(weight) later, in a
bubble. For a linear y = x W^T + b (x: (T, in), g = dL/dy: (T, out), T tokens):

    B:  dL/dx = g W          W:  dL/dW = g^T x,  dL/db = sum_T g

Only the linear layers are split: they hold almost all of a block's weight-gradient FLOPs. The embedding, the
RMSNorm weights and every non-linear op get their gradients in B, as before. A linear whose store is attached
runs ``linear_with_deferred_weight`` (one autograd Function) and decides at *backward* time: outside
``store.defer`` it returns both gradients, like F.linear's backward; inside, it returns only dL/dx and queues
(x, g) under the key, to be turned into dL/dW (and dL/db) by ``store.flush(key)``. This is the mechanism of the
paper's code and of Megatron-LM's ``WeightGradStore``, kept per key (the executor's micro-batch, chunk) on an
instance instead of in class-level globals, so W of any queued micro-batch can run in any order.

Tensor parallelism: ColumnParallelLinear / RowParallelLinear call the same function between their collectives
(copy_to_parallel / reduce_from_parallel), so B still all-reduces dL/dx and W is local (no communication).
Under ``torch.autocast`` the Function casts as autocast would (bf16 x, W and b; bf16 matmuls, fp32 ``.grad``).
Activation checkpointing recomputes the forward during B, inside ``defer``; the recomputed x is what is queued.

Usage (the executor; ``model`` is one materialised, tensor-parallel stage, before any dp wrapper):

    store = WeightGradStore()
    split_weight_gradients(model, store)           # once; parameter names and the module tree are unchanged
    out = model(x)                                 # F, as before
    with store.defer((mb, chunk)):                 # B: dL/dx of every linear, dL/dW of everything else
        backward_from(out, grad)
    store.flush((mb, chunk))                       # W: dL/dW += g^T x for the queued linears, in B's order
    assert not store.pending()                     # nothing left at the step's end

Deferred gradients are added to ``param.grad`` directly (in place when it exists, so DDP's bucket views stay the
storage), not through autograd: no gradient hook (DDP's reducer, post-accumulate hooks) sees them, so a data-
parallel reduction must be started after the last W. What W keeps alive from B is x and g of each linear (see
``WeightGradStore.bytes_pending``). Inside a torch.compile'd block the split linears stay eager (graph breaks).
The decision reads a flag of the store, not of the thread, so it holds on the autograd engine's device threads
(CUDA).
"""
from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.fused import FusedLinear


class _Deferred(NamedTuple):
    """One linear's weight gradient, computed at flush: dW = g^T x (T tokens flattened)."""
    weight: nn.Parameter
    bias: nn.Parameter | None
    x: torch.Tensor  # (..., in), the compute dtype (bf16 under autocast)
    g: torch.Tensor  # (..., out), dL/dy in the compute dtype


class WeightGradStore:
    """Per-key FIFO queues of deferred weight-gradient computations (see the module docstring)."""

    def __init__(self):
        self._queues: dict[Hashable, list[_Deferred]] = {}
        self._key: Hashable | None = None
        self._deferring = False

    @contextlib.contextmanager
    def defer(self, key: Hashable) -> Iterator[None]:
        """Backwards run inside queue the weight gradients of the split linears under ``key`` (not nestable)."""
        if self._deferring:
            raise RuntimeError(f"WeightGradStore.defer({key!r}) inside defer({self._key!r})")
        self._key, self._deferring = key, True
        try:
            yield
        finally:
            self._key, self._deferring = None, False

    @property
    def deferring(self) -> bool:
        return self._deferring

    def put(self, weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, g: torch.Tensor) -> None:
        """Queue one linear's weight gradient under the current key (called from the backward)."""
        self._queues.setdefault(self._key, []).append(_Deferred(weight, bias, x, g))

    @torch.no_grad()
    def flush(self, key: Hashable) -> None:
        """Run W for ``key``: add each queued g^T x (and sum g) to its parameter's ``.grad``, in B's order, then
        drop x and g. A key with nothing queued is a no-op."""
        for item in self._queues.pop(key, ()):
            g2 = item.g.reshape(-1, item.g.shape[-1])  # (T, out)
            _accumulate(item.weight, g2.t().mm(item.x.reshape(-1, item.x.shape[-1])))  # (out, in)
            if item.bias is not None:
                _accumulate(item.bias, g2.sum(0))  # (out,)

    def pending(self) -> dict[Hashable, int]:
        """Key -> number of queued weight gradients, for the keys not yet flushed (empty when all are done)."""
        return {k: len(q) for k, q in self._queues.items() if q}

    def bytes_pending(self) -> int:
        """Bytes of the distinct x and g storages the queues hold. Per token of a queued micro-batch, in elements
        of the compute dtype (tests/test_weight_grad.py checks it): each block keeps x of the fused q/k/v (h), of
        o (nh*hd/tp), of the fused gate/up (h) and of down (ffn/tp), and their g: (nh*hd + 2*nkv*hd + 2*ffn)/tp
        + 2h; the LM head is not split. A plain backward frees both at B; here they live until W."""
        seen: dict[int, int] = {}
        for queue in self._queues.values():
            for item in queue:
                for t in (item.x, item.g):
                    s = t.untyped_storage()
                    seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """param.grad += grad in place (fp32 += bf16 under autocast: the cast is exact); a new tensor when None."""
    if param.grad is None:
        param.grad = grad.to(param.dtype, memory_format=torch.contiguous_format)
    else:
        param.grad.add_(grad)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


class _LinearDeferredWeight(torch.autograd.Function):
    """y = x W^T + b; backward returns dL/dx always and dL/dW, dL/db only when ``store`` is not deferring."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        dtype = _autocast_dtype(x)  # autocast's rule for linear: every input in the lower precision
        xc, wc = (x, weight) if dtype is None else (x.to(dtype), weight.to(dtype))
        bc = bias if dtype is None or bias is None else bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(xc, wc, bc)  # (..., out)
        ctx.save_for_backward(xc, wc)
        ctx.store, ctx.weight, ctx.bias, ctx.x_dtype = store, weight, bias, x.dtype
        return y

    @staticmethod
    def backward(ctx, g):
        xc, wc = ctx.saved_tensors
        dx = (g.matmul(wc) if ctx.needs_input_grad[0] else None)  # (..., in)
        dx = dx if dx is None else dx.to(ctx.x_dtype)
        if ctx.store.deferring:
            ctx.store.put(ctx.weight, ctx.bias, xc, g)
            return dx, None, None, None
        g2 = g.reshape(-1, g.shape[-1])  # (T, out)
        dw = g2.t().mm(xc.reshape(-1, xc.shape[-1])).to(ctx.weight.dtype)  # (out, in)
        db = None if ctx.bias is None else g2.sum(0).to(ctx.bias.dtype)
        return dx, dw, db, None


@torch.compiler.disable
def _deferrable_linear(x, weight, bias, store):
    # Eager even inside a compiled block: traced, the backward's choice would be fixed once (measured: never
    # deferred). The compiled block breaks its graph around each linear.
    return _LinearDeferredWeight.apply(x, weight, bias, store)


def linear_with_deferred_weight(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                store: WeightGradStore | None) -> torch.Tensor:
    """F.linear whose weight gradient ``store`` may defer; plain F.linear without a store or without grad
    (evaluation runs exactly as before)."""
    if store is None or not torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    return _deferrable_linear(x, weight, bias, store)


class SplitLinear(nn.Linear):
    """nn.Linear with a ``weight_grad_store`` (same parameters and names). Made by split_weight_gradients by
    re-classing an nn.Linear in place, so the module object, its parameters and references to it stay."""

    weight_grad_store: WeightGradStore | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_with_deferred_weight(x, self.weight, self.bias, self.weight_grad_store)


class SplitFusedLinear(SplitLinear, FusedLinear):
    """A FusedLinear (q/k/v or gate/up, engine/model/fused.py) with a ``weight_grad_store``, as SplitLinear."""


_SPLIT = {nn.Linear: SplitLinear, FusedLinear: SplitFusedLinear}  # the exact class -> its split class


def split_weight_gradients(model: nn.Module, store: WeightGradStore) -> int:
    """Attach ``store`` to every linear layer of ``model`` (a materialised, possibly tensor-parallel stage) but
    the LM head: plain nn.Linear and FusedLinear (tp = 1) become SplitLinear / SplitFusedLinear; layers that declare ``weight_grad_store``
    (ColumnParallelLinear, RowParallelLinear) get it set. The embedding and RMSNorm weights are not split: their
    gradients come in B. Neither is the LM head: its W would keep the logits' gradient (tokens x V/tp) of every
    micro-batch between its B and W, pp of them on the last stage under ZB-H1, far above 1F1B's peak for a large
    vocabulary (ZB-H1's point is 1F1B's peak memory); its weight gradient stays in the last stage's B. Returns
    how many layers were split."""
    count = 0
    for name, module in model.named_modules():
        if name.split(".")[-1] == "lm_head":
            continue
        if type(module) in _SPLIT:
            module.__class__ = _SPLIT[type(module)]
        if hasattr(type(module), "weight_grad_store"):
            module.weight_grad_store = store
            count += 1
    return count
