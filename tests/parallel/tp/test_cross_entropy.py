"""The chunked vocab-parallel cross-entropy (engine/parallel/tp/cross_entropy.py) against F.cross_entropy on the full
fp32 logits (the engine's loss before chunking, at tp = 1): loss and gradient at tp = 1 and 2, several chunks
(the last one short), ignored targets, fp32 and bf16 logits; and its peak memory, which must not hold an fp32
copy of the whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.metrics.memory import LiveTensorBytes
from engine.parallel.tp.cross_entropy import vocab_parallel_cross_entropy
from tests.dist import run_ranks
from tests.numerics import rel_err

V, B, S = 48, 3, 7  # n = 21 tokens; chunk_elements 120 at V/tp = 24 gives chunks of 5 tokens (the last one 1)
# Measured worst relative error of a correct run (fp32): loss 0, gradient 3.1e-7; bf16 logits: the
# gradient is the fp32 one rounded once to bf16 (2^-8 relative), the loss reads the same bf16 values.
REL = 1e-6
REL_BF16_GRAD = 2**-8


def _compare(dtype: torch.dtype, chunk_elements: int) -> dict:
    """Errors of this rank's shard (tp = world size, or 1 without a process group) against the full reference."""
    group = dist.group.WORLD if dist.is_initialized() else None
    rank, size = (dist.get_rank(), dist.get_world_size()) if group is not None else (0, 1)
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(B, S, V, generator=gen) * 4).to(dtype)
    target = torch.randint(0, V, (B, S), generator=gen)
    target[0, :3] = -100  # ignored: count neither in the loss nor in the mean
    ref_logits = full.float().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, V), target.view(-1)) * 3.5  # 3.5: a non-unit upstream gradient
    ref.backward()
    local = full.chunk(size, dim=-1)[rank].clone().requires_grad_()  # a leaf shard
    loss = vocab_parallel_cross_entropy(local, target, group, chunk_elements=chunk_elements) * 3.5
    loss.backward()
    assert torch.equal(local.detach(), full.chunk(size, dim=-1)[rank]), "the loss changed its input logits"
    ref_grad = ref_logits.grad.to(dtype).chunk(size, dim=-1)[rank]
    return {
        "loss": rel_err(loss.detach(), ref.detach()),
        "grad": rel_err(local.grad, ref_grad),
        "grad_dtype": local.grad.dtype == dtype,
    }


def _rank(dtype_name: str) -> dict:
    return _compare(getattr(torch, dtype_name), 120)


@pytest.mark.parametrize("chunk_elements", [120, 1, 10**9])  # 5-token chunks, 1 token, one chunk
def test_tp1_matches_f_cross_entropy(chunk_elements):
    errs = _compare(torch.float32, chunk_elements)
    assert errs["loss"] <= REL and errs["grad"] <= REL and errs["grad_dtype"], errs


def test_tp1_bf16_logits():
    errs = _compare(torch.bfloat16, 120)
    assert errs["loss"] <= REL and errs["grad"] <= REL_BF16_GRAD and errs["grad_dtype"], errs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_matches_f_cross_entropy(dtype):
    for errs in run_ranks(_rank, 2, dtype):
        assert errs["loss"] <= REL and errs["grad"] <= (REL if dtype == "float32" else REL_BF16_GRAD), errs


def test_peak_memory_has_no_fp32_copy_of_the_logits():
    # bf16 logits (n, V): an fp32 copy alone would be 4 n V bytes. The chunked loss may hold the bf16 gradient
    # (2 n V) and a few fp32 (chunk, V) temporaries (measured: 2.04 of them), plus O(n) vectors.
    n, v, chunk = 512, 1024, 64
    logits = torch.randn(n, v).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, v, (n,))
    with LiveTensorBytes() as live:
        vocab_parallel_cross_entropy(logits, target, None, chunk_elements=chunk * v).backward()
    assert live.peak <= 2 * n * v + 4 * (4 * chunk * v) + 64 * n, live.peak
