"""Gradient buckets averaged over dp outside DDP's reducer: what autograd hooks never see.

Zero bubble's deferred weight gradients (engine/parallel/autograd/weight_grad.py) are added to ``.grad`` by W, not by
autograd, so DDP's reducer cannot tell when a bucket is complete. ``ReadyBuckets`` plays its part for them: the
chunk's parameters are packed into buckets of about bucket_mb MB in DDP's order (reverse registration, the order
a backward, and W's flush, completes them); W marks each parameter ready as it adds its last gradient, and a bucket
whose parameters are all ready is all-reduced asynchronously while the rest of the W's run (the overlap of Li et
al. 2020, "PyTorch Distributed", Sec. 3.2.3, moved from backward to W). Buckets are launched strictly in order,
bucket i only after bucket i-1, however gradients complete: every rank of the dp group issues the same
collectives in the same order (NCCL's rule; the reducer launches its buckets in order for the same reason).
``wait`` (the exposed ``dp_comm`` phase) then only finishes what is still in flight and averages.

    buckets = ReadyBuckets(params, dp_group, bucket_mb)
    buckets.ready(*already_complete)       # gradients B finished (norms, embedding): no W adds to them
    store.flush(key, done=buckets.ready)   # the chunk's last W: each bucket starts as soon as it is complete
    buckets.wait()                         # grads are now the dp mean
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import engine.trust.oplog as oplog  # floor 0 (docs/architecture.md), not the trust package


def size_buckets(tensors: list[torch.Tensor], bucket_mb: float) -> list[list[torch.Tensor]]:
    """``tensors`` in order, packed into consecutive runs of about bucket_mb MB of one dtype (a run is closed once
    it reaches the size, as DDP's bucket_cap_mb)."""
    limit = int(bucket_mb * 2**20)
    buckets: list[list[torch.Tensor]] = [[]]
    for t in tensors:
        if buckets[-1] and (
            sum(x.numel() * x.element_size() for x in buckets[-1]) >= limit or buckets[-1][0].dtype != t.dtype
        ):
            buckets.append([])
        buckets[-1].append(t)
    return [b for b in buckets if b]


class ReadyBuckets:
    """Average the gradients of ``params`` (in launch order) over ``group``, bucket by bucket as they become
    ready. A parameter without a gradient when its bucket launches is left out (the same on every dp rank: they
    run the same schedule on the same stage)."""

    def __init__(self, params: list[torch.nn.Parameter], group, bucket_mb: float):
        self.group, self.buckets = group, size_buckets(params, bucket_mb)
        self.bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.missing = [len(b) for b in self.buckets]  # parameters not yet ready, per bucket
        self.seen: set[int] = set()
        self.next = 0  # the first bucket not yet launched
        self.in_flight: list[tuple] = []  # (Work, flat (sum of numels,), the grads it came from)

    def ready(self, *params) -> None:
        """Mark ``params`` complete (None and parameters of other chunks are ignored) and launch every bucket
        from ``next`` on that is complete."""
        for p in params:
            i = self.bucket_of.get(id(p)) if p is not None else None
            if i is not None and id(p) not in self.seen:
                self.seen.add(id(p))
                self.missing[i] -= 1
        while self.next < len(self.buckets) and not self.missing[self.next]:
            self._launch(self.buckets[self.next])
            self.next += 1

    def _launch(self, bucket: list[torch.nn.Parameter]) -> None:
        grads = [p.grad for p in bucket if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])  # a copy: W may not touch the grads any more anyway
            op = oplog.begin("all-reduce", self.group, "grad sync", flat.numel() * flat.element_size())
            self.in_flight.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, grads, op))

    def launched(self) -> int:
        return self.next

    def wait(self) -> None:
        """Finish every all-reduce and write the means back into the gradients."""
        if self.next < len(self.buckets):
            raise RuntimeError(f"gradient buckets {self.next}..{len(self.buckets) - 1} never became ready")
        size = dist.get_world_size(self.group)
        for work, flat, grads, op in self.in_flight:
            work.wait()
            oplog.end(op)
            _write_mean(flat, grads, size)
        self.in_flight.clear()


def all_reduce_mean(grads: list[torch.Tensor], group, bucket_mb: float) -> None:
    """Average ``grads`` over ``group`` in place, packed into flat buffers of about bucket_mb MB each (one
    all-reduce per buffer instead of one per tensor), one after the other (exposed: nothing overlaps)."""
    size = dist.get_world_size(group)
    for bucket in size_buckets(grads, bucket_mb):
        flat = torch.cat([g.reshape(-1) for g in bucket])  # (sum of numels,)
        with oplog.logged("all-reduce", group, "grad sync", flat.numel() * flat.element_size()):
            dist.all_reduce(flat, group=group)
        _write_mean(flat, bucket, size)


def _write_mean(flat: torch.Tensor, grads: list[torch.Tensor], size: int) -> None:
    """grads <- their pieces of the summed ``flat`` (sum of numels,) divided by the group size."""
    flat.div_(size)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
