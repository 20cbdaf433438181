"""Autograd-aware collectives for tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", Sec. 3, Fig. 3).

Each function is named for what it does forward / backward and takes the process group it acts on. A group of
size one makes every collective an identity, so the tp=1 model runs no communication at all.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package
from engine.model.recompute_run import save_under_selective
from engine.parallel.autograd import collective_matmul as cm


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if _size(group) == 1:
        return x
    x = x.contiguous()
    with oplog.logged("all-reduce", group, "layer", x.numel() * x.element_size()):
        dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``dim``: (..., n, ...) -> (..., n/tp, ...). No autograd."""
    size = _size(group)
    if size == 1:
        return x
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of the last dim: (..., n) -> (..., n/tp)."""
    return _split(x, group, -1)


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's chunk along the last dim: (..., n/tp) -> (..., n)."""
    size = _size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    with oplog.logged("all-gather", group, "layer", x.numel() * x.element_size()):
        dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToParallel(torch.autograd.Function):
    """Identity forward, all-reduce backward: Megatron's ``f``, in front of a column-parallel layer."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromParallel(torch.autograd.Function):
    """All-reduce forward, identity backward: Megatron's ``g``, after a row-parallel layer."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Exchange(torch.autograd.Function):
    """``forward(x, group)`` forward, ``backward(grad, group)`` backward: a pair of the no-autograd collectives of
    this file (gather one way, split or reduce-scatter the other)."""

    @staticmethod
    def forward(ctx, x, group, forward, backward):
        ctx.group, ctx.backward = group, backward
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward(grad, ctx.group), None, None, None


def copy_to_parallel(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _CopyToParallel.apply(x, group)


def reduce_from_parallel(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceFromParallel.apply(x, group)


def gather_from_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather the last dim forward, keep this rank's chunk backward."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, _gather_last, _split_last)


def scatter_to_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's chunk of the last dim forward, all-gather backward."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, _split_last, _gather_last)


# ---- sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
# Models", Sec. 4.2.2): the residual stream is (b, s/tp, h) on each tp rank; Megatron's g and g-bar. The sequence
# is dim 1 of (b, s, h); the collectives work on dim 0, so the chunks are moved there and back (a copy).

# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn); gloo and nccl
# run both, on the concatenated (tp * b, ...) form.
_all_gather_dim0 = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_dim0 = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's chunk of dim 1, in rank order: (b, s/tp, ...) -> (b, s, ...). No autograd (the Functions below,
    and engine/parallel/autograd/weight_grad.py's sequence-parallel linear, call it)."""
    size = _size(group)
    if size == 1:
        return x
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # (tp * b, s/tp, ...): gloo wants the concatenated form
    with oplog.logged("all-gather", group, "layer", x.numel() * x.element_size()):
        _all_gather_dim0(out, x.contiguous(), group=group)
    return out.unflatten(0, (size, x.shape[0])).movedim(0, 1).flatten(1, 2)  # (b, tp, s/tp, ...) -> (b, s, ...)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, keep this rank's chunk of dim 1: (b, s, ...) partial sums -> (b, s/tp, ...). No autograd."""
    size = _size(group)
    if size == 1:
        return x
    chunks = x.unflatten(1, (size, x.shape[1] // size)).movedim(1, 0)  # (tp, b, s/tp, ...)
    out = x.new_empty(chunks.shape[1:])
    with oplog.logged("reduce-scatter", group, "layer", x.numel() * x.element_size()):
        _reduce_scatter_dim0(out, chunks.flatten(0, 1).contiguous(), group=group)  # in: (tp * b, s/tp, ...)
    return out


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's chunk of dim 1: (b, s, ...) -> (b, s/tp, ...). No autograd."""
    return _split(x, group, 1)


class _SequenceGatheredLinear(torch.autograd.Function):
    """y = gather_seq(x) A^T + b: all-gather along the sequence, then the column-parallel matmul; backward
    all-gathers x again for A's gradient and reduce-scatters x's. Only the local (b, s/tp, h) input is kept for
    backward, not the gathered one: the activation saving of Korthikanti et al. Sec. 4.2.2 (Megatron's
    LinearWithGradAccumulationAndAsyncCommunication with sequence_parallel). Autocast, if on in forward, is on
    again in backward, so the gradients use the forward's matmul dtype. ``overlap``: each collective as a ring
    whose transfers overlap the matmul it feeds (engine/parallel/autograd/collective_matmul.py)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, overlap):
        device = x.device.type
        ctx.group, ctx.has_bias, ctx.overlap = group, bias is not None, overlap
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x, weight)  # x: (b, s/tp, h), never the gathered (b, s, h)
        if overlap:
            return cm.gathered_linear(x, weight, bias, group)  # (b, s, out/tp)
        return torch.nn.functional.linear(gather_seq(x, group), weight, bias)  # (b, s, out/tp)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        device, enabled, dtype = ctx.autocast
        need_x, need_w, need_b = ctx.needs_input_grad[:3]  # e.g. a backward split into input and weight parts
        grad_x = grad_w = grad_b = None
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            if need_x and ctx.overlap:  # as below, the reduce-scatter overlapping the chunks' matmuls
                grad_x = cm.input_grad_scattered(grad, weight, ctx.group, x.dtype)
            elif need_x:  # (b, s, h) partial over tp -> summed, this rank's (b, s/tp, h)
                grad_x = reduce_scatter_seq(torch.matmul(grad, weight).to(x.dtype), ctx.group)
            if need_w and ctx.overlap:  # as below, x gathered chunk by chunk behind the chunks' matmuls
                grad_w = cm.weight_grad_gathered(grad, x, ctx.group).to(weight.dtype)
            elif need_w:  # (out/tp, h), from x gathered again (b, s, h)
                full = gather_seq(x, ctx.group)
                grad_w = torch.matmul(grad.flatten(0, -2).t(), full.flatten(0, -2)).to(weight.dtype)
        if need_b and ctx.has_bias:
            grad_b = grad.flatten(0, -2).sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None


def gather_sequence_for_replicated(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the sequence forward, keep this rank's chunk backward: (b, s/tp, h) -> (b, s, h) in front of
    a block every tp rank runs whole on the whole sequence (the MoE block, engine/parallel/tp/moe.py), whose input
    gradient is then complete and equal on every rank (Megatron's gather_from_sequence_parallel_region with
    tensor_parallel_output_grad=False). A reduce-scatter backward would sum tp equal copies."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, gather_seq, split_seq)


def split_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Keep this rank's chunk of the sequence forward, all-gather backward: (b, s, h), equal on every tp rank ->
    (b, s/tp, h) (Megatron's scatter_to_sequence_parallel_region); each rank's gradient covers only its chunk."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, split_seq, gather_seq)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """S = sum over the group of every rank's x, all-reduced forward and backward: each rank's x feeds every rank's
    copy of S, so its gradient is the sum of theirs (``g`` after ``f``: a statistic over a tp-split dim)."""
    return reduce_from_parallel(copy_to_parallel(x, group), group)


def gather_from_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along the sequence forward, reduce-scatter backward: (b, s/tp, h) -> (b, s, h). Megatron's g-bar
    in front of a column-parallel layer (the gradients of the tp ranks' partial inputs are summed and scattered)."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, gather_seq, reduce_scatter_seq)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather backward: (b, s, h) partial sums -> (b, s/tp, h).
    Megatron's g after a row-parallel layer and the vocab-parallel embedding."""
    return x if _size(group) == 1 else _Exchange.apply(x, group, reduce_scatter_seq, gather_seq)


def sequence_gathered_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group, overlap: bool = False
) -> torch.Tensor:
    """(b, s/tp, h) -> (b, s, out/tp); see _SequenceGatheredLinear. A group of size one is a plain linear."""
    if _size(group) == 1:
        return torch.nn.functional.linear(x, weight, bias)
    if overlap:
        return _overlapped_gathered_linear(x, weight, bias, group)
    return _SequenceGatheredLinear.apply(x, weight, bias, group, False)


@torch.compiler.disable
def _overlapped_gathered_linear(x, weight, bias, group) -> torch.Tensor:
    # Eager even inside a compiled block (train.compile), as zero bubble's linears are: a traced Function whose
    # backward runs the rings' point-to-point calls would carry their process group into the graph
    return _SequenceGatheredLinear.apply(x, weight, bias, group, True)


# ---- the row-parallel linear and its reduce-scatter as one operator: selective recomputation
# (engine/model/recompute_run.py) keeps an operator's output, and a cached matmul output here would be the (b, s, h)
# partial sums, full width on every tp rank (more than no recomputation stores at tp 8); this operator's output is
# the (b, s/tp, h) shard, which recomputation takes as is, without the matmul or the reduce-scatter again.
_GROUPS: dict[str, dist.ProcessGroup] = {}  # custom operators take strings, not process groups
# zero bubble: the layers whose weight gradient the operator's backward may defer (a key per layer, as above)
_DEFERRING: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register_group(group) -> None:
    """Make ``group`` known to the operator by its name, eagerly (the layer's constructor calls it): a compiled block
    traces the operator's fake with the name before any eager call could register it."""
    if _size(group) > 1:
        _GROUPS.setdefault(group.group_name, group)


@torch.library.custom_op("engine::sequence_reduced_linear", mutates_args=())
def _sequence_reduced_linear(
    x: torch.Tensor, weight: torch.Tensor, group: str, layer: str, overlap: bool
) -> torch.Tensor:
    if overlap:  # the reduce-scatter as a ring overlapping the chunks' matmuls (autograd/collective_matmul.py)
        return cm.linear_scattered(x, weight, _GROUPS[group])
    return reduce_scatter_seq(torch.nn.functional.linear(x, weight), _GROUPS[group])


@_sequence_reduced_linear.register_fake
def _(x, weight, group, layer, overlap):
    return x.new_empty((*x.shape[:-2], x.shape[-2] // _size(_GROUPS[group]), weight.shape[0]))


# The overlapped backward as an operator of its own: traced into a compiled block's backward graph, the rings'
# point-to-point calls would carry their process group, which a graph cannot hold (a name can).
@torch.library.custom_op("engine::sequence_reduced_linear_grads", mutates_args=())
def _row_grads(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return cm.row_grads_gathered(grad, x, weight, _GROUPS[group])


@_row_grads.register_fake
def _(grad, x, weight, group):
    return x.new_empty(x.shape, dtype=grad.dtype), weight.new_empty(weight.shape, dtype=grad.dtype)


def _sequence_reduced_setup(ctx, inputs, output):
    x, weight, group, layer, overlap = inputs
    ctx.save_for_backward(x, weight)
    ctx.group, ctx.name, ctx.layer, ctx.overlap = _GROUPS[group], group, _DEFERRING.get(layer), overlap


def _sequence_reduced_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    store = None if ctx.layer is None else ctx.layer.weight_grad_store
    defer = store is not None and store.deferring  # zero bubble's B: W adds full^T x later (autograd/weight_grad.py)
    if ctx.overlap and not defer:  # (zero bubble with overlap is refused: engine/parallel/layout/checks.py)
        grad_x, grad_w = _row_grads(grad, x, weight, ctx.name)  # gathered chunk by chunk behind the matmuls
        return grad_x, grad_w, None, None, None
    full = gather_seq(grad, ctx.group)  # (b, s, out): every rank's chunk of the output gradient
    grad_x = torch.matmul(full, weight) if ctx.needs_input_grad[0] else None
    if defer:
        store.put(ctx.layer.weight, None, x, full)
        return grad_x, None, None, None, None
    grad_w = None
    if ctx.needs_input_grad[1]:
        grad_w = torch.matmul(full.flatten(0, -2).t(), x.flatten(0, -2))
    return grad_x, grad_w, None, None, None


_sequence_reduced_linear.register_autograd(_sequence_reduced_backward, setup_context=_sequence_reduced_setup)
# The operator as a dispatch mode sees it: whole, its reduce-scatter inside (launch/bench/tp_collectives.py counts it)
SEQUENCE_REDUCED_LINEAR = _sequence_reduced_linear._opoverload
save_under_selective(SEQUENCE_REDUCED_LINEAR)


def sequence_reduced_linear(
    x: torch.Tensor, weight: torch.Tensor, group, layer=None, overlap: bool = False
) -> torch.Tensor:
    """reduce_scatter_seq(x A^T): the row-parallel matmul's (b, s, out) partial sums summed over the group, this
    rank's (b, s/tp, out) kept; backward all-gathers the output gradient along the sequence (Megatron's g after a
    row-parallel layer). One operator (``engine::sequence_reduced_linear``): see above. Under autocast x and A are
    cast as autocast casts a linear's inputs (the cast A is what backward keeps, as autocast's linear keeps it).
    ``layer``: a module with ``weight`` (A's parameter) and a ``weight_grad_store`` (zero bubble): backward queues
    (x, g) there while the store defers, as engine/parallel/autograd/weight_grad.py's deferrable linear does.
    ``overlap``: the reduce-scatter (and backward's all-gather) as rings overlapping the matmul
    (engine/parallel/autograd/collective_matmul.py)."""
    if _size(group) == 1:
        return torch.nn.functional.linear(x, weight)
    if layer is not None:
        return _deferrable_sequence_reduced_linear(x, weight, group, layer, overlap)
    return _sequence_reduced_call(x, weight, group, "", overlap)


@torch.compiler.disable
def _deferrable_sequence_reduced_linear(
    x: torch.Tensor, weight: torch.Tensor, group, layer, overlap: bool
) -> torch.Tensor:
    # Eager even inside a compiled block, as the split linears are: the layer's key, a string constant per layer,
    # would guard the block's graph (a recompile per layer)
    key = str(id(layer))
    _DEFERRING[key] = layer
    return _sequence_reduced_call(x, weight, group, key, overlap)


def _sequence_reduced_call(x: torch.Tensor, weight: torch.Tensor, group, key: str, overlap: bool) -> torch.Tensor:
    """The operator on x and A cast as autocast casts a linear's inputs (unchanged outside autocast), its group
    registered by name (the operator takes strings only)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
    register_group(group)  # the layer registered it when built; a direct call (tests) may not have
    return _sequence_reduced_linear(x, weight, group.group_name, key, overlap)
