"""Collective matmuls: tensor parallelism's sequence all-gathers and reduce-scatters decomposed into ring steps that
overlap the matmuls they feed (Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition
in Large Deep Learning Models", ASPLOS; the looped collective matmul of XLA and TorchTitan's async TP, here with
point-to-point transfers instead of symmetric memory). ``parallel.tp_comm_overlap`` turns them on under sequence
parallelism (engine/parallel/tp/layers.py); without it the layers run one blocking collective and then the matmul.

Under sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) a column-parallel linear all-gathers its
(b, s/tp, in) input along the sequence before the matmul and a row-parallel one reduce-scatters its (b, s, out)
partial sums after it. Both collectives split along the sequence, and so do the matmuls: row block c of
x A^T needs only chunk c of x. So a ring of tp steps does the same work with the transfer hidden:

    gather_apply:        step k: rank r holds chunk (r - k) mod tp; it sends it to r + 1 and receives chunk
                         (r - k - 1) from r - 1 while ``visit`` runs on the chunk held (the column matmul forward,
                         the weight gradient's g_c^T x_c backward);
    reduce_scatter_ring: step k: rank r computes its partial sums for chunk d = (r - k - 1) mod tp, adds those
                         received from r - 1 (the same chunk, summed over the ranks before it) and sends the sum
                         on while computing the next chunk's; after tp steps chunk r has visited every rank.

Each step moves 1/tp of the collective's bytes and computes 1/tp of the matmul: the transfer is exposed only where a
chunk's transfer takes longer than a chunk's matmul (engine/planning/search.py prices it so). The sums of the
reduce-scatter are taken in ring order (rank d + 1 first), a different order from a library's reduce-scatter:
results agree to rounding (tests/parallel/tp/test_collective_matmul.py).

Communication follows NCCL's point-to-point rules as engine/parallel/cp/ring.py's ring does (tests/nccl_shim.py
checks them): every step is ONE ``batch_isend_irecv``, the send to the next rank then the receive from the previous
one, posted before the step's matmul and waited on after it; peers are the group's global ranks. The op log
(engine/trust/oplog.py) records a ring as the collective it replaces, so a hang inside one is named as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package


def _ring(group) -> tuple[int, int, int, int]:
    """(tp, this rank's index, global rank of the next rank, of the previous one)."""
    size, r = dist.get_world_size(group), dist.get_rank(group)
    return size, r, dist.get_global_rank(group, (r + 1) % size), dist.get_global_rank(group, (r - 1) % size)


def _post(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group) -> list:
    """One batch: the send to the next rank, then the receive from the previous one (the same order on every rank)."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)])


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def chunks(x: torch.Tensor, tp: int) -> torch.Tensor:
    """(b, s, ...) -> (b, tp, s/tp, ...): ``[:, c]`` is sequence chunk c (a view)."""
    return x.unflatten(1, (tp, x.shape[1] // tp))


def gather_apply(x: torch.Tensor, group, visit: Callable[[int, torch.Tensor], None]) -> None:
    """All-gather x (b, s/tp, ...) along the sequence as a ring: ``visit(c, chunk)`` runs once on every rank's
    chunk c (this rank's first), each while the next chunk is in flight. What visit computes is its own."""
    tp, r, nxt, prv = _ring(group)
    held = x.contiguous()
    with oplog.logged("all-gather", group, "layer", held.numel() * held.element_size()):
        for k in range(tp):
            works, coming = [], None
            if k < tp - 1:
                coming = torch.empty_like(held)
                works = _post(held, coming, nxt, prv, group)
            visit((r - k) % tp, held)
            _wait(works)
            held = coming if coming is not None else held


def reduce_scatter_ring(part: Callable[[int], torch.Tensor], group) -> torch.Tensor:
    """Sum over the group of every rank's partial sums for this rank's sequence chunk, as a ring: ``part(d)`` is
    this rank's (b, s/tp, ...) partial for chunk d, computed while the previous sum is in flight. Returns the sum
    for this rank's chunk, (b, s/tp, ...)."""
    tp, r, nxt, prv = _ring(group)
    mine = part((r - 1) % tp).contiguous()
    with oplog.logged("reduce-scatter", group, "layer", mine.numel() * mine.element_size() * tp):
        for k in range(1, tp):
            arriving = torch.empty_like(mine)
            works = _post(mine, arriving, nxt, prv, group)
            local = part((r - k - 1) % tp)  # chunk r - k - 1: the sum arriving is for it too
            _wait(works)
            mine = (arriving + local).contiguous()
    return mine


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group) -> torch.Tensor:
    """F.linear(gather_seq(x), weight, bias) with the gather overlapped: (b, s/tp, in) -> (b, s, out/tp)."""
    out: list = [None] * dist.get_world_size(group)

    def visit(c: int, chunk: torch.Tensor) -> None:
        out[c] = torch.nn.functional.linear(chunk, weight, bias)  # (b, s/tp, out/tp)

    gather_apply(x, group, visit)
    return torch.cat(out, dim=1)


def linear_scattered(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """reduce_scatter_seq(F.linear(x, weight)) with the reduce-scatter overlapped: (b, s, in/tp) partial over the
    group -> (b, s/tp, out), summed."""
    xs = chunks(x, dist.get_world_size(group))  # (b, tp, s/tp, in/tp)
    return reduce_scatter_ring(lambda d: torch.nn.functional.linear(xs[:, d], weight), group)


def weight_grad_gathered(g: torch.Tensor, x: torch.Tensor, group) -> torch.Tensor:
    """g^T gather_seq(x), the column-parallel weight gradient, gathering x chunk by chunk: g (b, s, out/tp),
    x (b, s/tp, in) -> (out/tp, in), summed over the chunks in ring order."""
    gs, total = chunks(g, dist.get_world_size(group)), []

    def visit(c: int, chunk: torch.Tensor) -> None:
        term = torch.matmul(gs[:, c].flatten(0, -2).t(), chunk.flatten(0, -2))  # (out/tp, in)
        total.append(term if not total else total.pop() + term)

    gather_apply(x, group, visit)
    return total[0]


def input_grad_scattered(g: torch.Tensor, weight: torch.Tensor, group, dtype: torch.dtype) -> torch.Tensor:
    """reduce_scatter_seq((g A).to(dtype)), the column-parallel input gradient: g (b, s, out/tp) -> (b, s/tp, in),
    each rank's partial sums cast to ``dtype`` (x's) before they are summed, as the blocking path sums them."""
    gs = chunks(g, dist.get_world_size(group))
    return reduce_scatter_ring(lambda d: torch.matmul(gs[:, d], weight).to(dtype), group)


def row_grads_gathered(
    g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row-parallel backward with the output gradient gathered chunk by chunk: g (b, s/tp, out), x (b, s, in/tp),
    A (out, in/tp) -> (dL/dx = gather(g) A (b, s, in/tp), dL/dA = gather(g)^T x (out, in/tp))."""
    tp = dist.get_world_size(group)
    xs, dx, dw = chunks(x, tp), [None] * tp, []

    def visit(c: int, chunk: torch.Tensor) -> None:
        dx[c] = torch.matmul(chunk, weight)  # (b, s/tp, in/tp)
        term = torch.matmul(chunk.flatten(0, -2).t(), xs[:, c].flatten(0, -2))  # (out, in/tp)
        dw.append(term if not dw else dw.pop() + term)

    gather_apply(g, group, visit)
    return torch.cat(dx, dim=1), dw[0]
