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
Sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2): a column-parallel linear's input is (b, s/tp, h) and
the same Function, given ``seq_group``, gathers it along the sequence before the matmul (forward), reduce-scatters
dL/dx back to (b, s/tp, h) (B), and queues only the local x shard, which W gathers again before g^T x, as
Megatron-LM's sequence-parallel linear does in its weight-gradient step: W keeps 1/tp of x alive between B and W
(the activation saving of sequence parallelism holds for the W queue too) at the price of one all-gather in W,
which runs in a bubble; B's critical path has only the reduce-scatter. Every tp rank runs the same schedule, so the
W's all-gathers meet in the same order on every rank of the group.
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
from collections.abc import Callable, Hashable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.fused import FusedLinear
from engine.parallel.autograd.comm import gather_seq, reduce_scatter_seq


class _Deferred(NamedTuple):
    """One linear's weight gradient, computed at flush: dW = g^T x (T tokens flattened)."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    x: torch.Tensor  # (..., in), the compute dtype (bf16 under autocast); (b, s/tp, in) under seq_group
    g: torch.Tensor  # (..., out), dL/dy in the compute dtype
    seq_group: object = None  # sequence parallelism: x is this rank's sequence shard, gathered at flush


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

    def put(
        self, weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, g: torch.Tensor, seq_group=None
    ) -> None:
        """Queue one linear's weight gradient under the current key (called from the backward); with ``seq_group``
        x is this rank's (b, s/tp, in) sequence shard, all-gathered over the group at flush."""
        self._queues.setdefault(self._key, []).append(_Deferred(weight, bias, x, g, seq_group))

    @torch.no_grad()
    def flush(self, key: Hashable, done: Callable[..., None] | None = None) -> None:
        """Run W for ``key``: add each queued g^T x (and sum g) to its parameter's ``.grad``, in B's order, then
        drop x and g. A key with nothing queued is a no-op. ``done(weight, bias)`` is called after each linear's
        gradients are added (bias None without one): the dp mode starts reducing them (dp/buckets.py)."""
        for item in self._queues.pop(key, ()):
            x = item.x if item.seq_group is None else gather_seq(item.x, item.seq_group)  # (b, s, in)
            g2 = item.g.reshape(-1, item.g.shape[-1])  # (T, out)
            _accumulate(item.weight, g2.t().mm(x.reshape(-1, x.shape[-1])))  # (out, in)
            if item.bias is not None:
                _accumulate(item.bias, g2.sum(0))  # (out,)
            if done is not None:
                done(item.weight, item.bias)

    def queued(self, key: Hashable) -> set[int]:
        """ids of the parameters (weights and biases) whose gradients flush(key) will add to."""
        return {id(p) for item in self._queues.get(key, ()) for p in (item.weight, item.bias) if p is not None}

    def pending(self) -> dict[Hashable, int]:
        """Key -> number of queued weight gradients, for the keys not yet flushed (empty when all are done)."""
        return {k: len(q) for k, q in self._queues.items() if q}

    def bytes_pending(self) -> int:
        """Bytes of the distinct x and g storages the queues hold. Per token of a queued micro-batch, in elements
        of the compute dtype (tests/parallel/autograd/test_weight_grad.py checks it): each block keeps x of the fused
        q/k/v (h), of
        o (nh*hd/tp), of the fused gate/up (h) and of down (ffn/tp), and their g: (nh*hd + 2*nkv*hd + 2*ffn)/tp
        + 2h; the LM head is not split; under sequence parallelism x of qkv and gate/up is the h/tp shard (the
        planner's engine/planning/schedules.py w_state_bytes). A plain backward frees both at B; here they live
        until W."""
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
    """y = x W^T + b; backward returns dL/dx always and dL/dW, dL/db only when ``store`` is not deferring. With
    ``seq_group`` (sequence parallelism) y = gather_seq(x) W^T + b: x (b, s/tp, in) -> y (b, s, out/tp), and
    dL/dx = reduce_scatter_seq(g W), the tp ranks' partial input gradients summed, this rank's chunk kept."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, seq_group):
        dtype = _autocast_dtype(x)  # autocast's rule for linear: every input in the lower precision
        xc, wc = (x, weight) if dtype is None else (x.to(dtype), weight.to(dtype))
        bc = bias if dtype is None or bias is None else bias.to(dtype)
        full = xc if seq_group is None else gather_seq(xc, seq_group)  # (b, s, in); only xc is saved
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(full, wc, bc)  # (..., out)
        # Under sequence parallelism x and W as given, cast again in backward: what comm.py's sequence-gathered
        # linear saves (the fp32 shard and no bf16 weight copy under autocast; engine/planning/activations.py)
        ctx.save_for_backward(*((xc, wc) if seq_group is None else (x, weight)))
        ctx.store, ctx.weight, ctx.bias, ctx.x_dtype, ctx.seq_group = store, weight, bias, x.dtype, seq_group
        ctx.dtype = dtype
        return y

    @staticmethod
    def backward(ctx, g):
        xc, wc = ctx.saved_tensors
        xc, wc = (xc, wc) if ctx.dtype is None else (xc.to(ctx.dtype), wc.to(ctx.dtype))  # no-ops unless sp
        dx = g.matmul(wc) if ctx.needs_input_grad[0] else None  # (..., in); (b, s, in) partial under seq_group
        dx = dx if dx is None else dx.to(ctx.x_dtype)
        if dx is not None and ctx.seq_group is not None:
            dx = reduce_scatter_seq(dx, ctx.seq_group)  # (b, s/tp, in)
        if ctx.store.deferring:
            ctx.store.put(ctx.weight, ctx.bias, xc, g, ctx.seq_group)
            return dx, None, None, None, None
        full = xc if ctx.seq_group is None else gather_seq(xc, ctx.seq_group)  # (b, s, in)
        g2 = g.reshape(-1, g.shape[-1])  # (T, out)
        dw = g2.t().mm(full.reshape(-1, full.shape[-1])).to(ctx.weight.dtype)  # (out, in)
        db = None if ctx.bias is None else g2.sum(0).to(ctx.bias.dtype)
        return dx, dw, db, None, None


@torch.compiler.disable
def _deferrable_linear(x, weight, bias, store, seq_group):
    # Eager even inside a compiled block: traced, the backward's choice would be fixed once (measured: never
    # deferred). The compiled block breaks its graph around each linear.
    return _LinearDeferredWeight.apply(x, weight, bias, store, seq_group)


def linear_with_deferred_weight(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, store: WeightGradStore | None, seq_group=None
) -> torch.Tensor:
    """F.linear whose weight gradient ``store`` may defer; plain F.linear without a store or without grad
    (evaluation runs exactly as before). ``seq_group``: x is (b, s/tp, in), gathered along the sequence over the
    group first (the sequence-parallel column linear; callers pass it only with a store, see
    engine/parallel/tp/layers.py)."""
    if store is None or not torch.is_grad_enabled():
        return F.linear(x if seq_group is None else gather_seq(x, seq_group), weight, bias)
    return _deferrable_linear(x, weight, bias, store, seq_group)


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
    the LM head: plain nn.Linear and FusedLinear (tp = 1) become SplitLinear / SplitFusedLinear; layers that declare
    ``weight_grad_store``
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
