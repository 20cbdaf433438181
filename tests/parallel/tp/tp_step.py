"""One micro-batch of the model at tp on this rank, built the way the tp tests compare it (sequence parallelism,
collective overlap, recomputation): shared by the sequence-parallel and collective-matmul tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from engine.model import transformer as model_lib
from engine.model.init import materialize
from engine.model.recompute import apply_activation_checkpointing
from engine.parallel.tp.layers import apply_tensor_parallel, vocab_parallel_cross_entropy


def token_ids(cfg, batch: int) -> torch.Tensor:
    """(batch, seq_len + 1) token ids, the same on every rank (seed 0): inputs [:, :-1], labels [:, 1:]."""
    return torch.randint(
        0, cfg.model.vocab_size, (batch, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(0)
    )


def tp_model(cfg, sequence_parallel: bool, comm_overlap: bool = False, recompute: str = "none") -> nn.Module:
    """cfg's model split over the world as its tp group, materialised on the CPU (seed 0, std 0.02)."""
    model = model_lib.build(cfg.model, device="meta")
    apply_tensor_parallel(model, dist.group.WORLD, sequence_parallel=sequence_parallel, comm_overlap=comm_overlap)
    materialize(model, torch.device("cpu"), seed=0, std=0.02)
    apply_activation_checkpointing(model, recompute)
    return model


def loss_of(model: nn.Module, ids: torch.Tensor, **kw) -> torch.Tensor:
    """The vocab-parallel loss of ``model`` on ``ids`` (forward only; ``kw``: the model's position and document ids)."""
    return vocab_parallel_cross_entropy(model(ids[:, :-1], **kw), ids[:, 1:], dist.group.WORLD)
