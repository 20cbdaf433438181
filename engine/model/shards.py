"""What part of a parameter this rank holds: its tensor-parallel cut and the local shard of an FSDP DTensor.

Two one-line questions asked by the optimizer (norms), ZeRO (DeepSpeed's tp tags), initialisation and checkpoints.
They live with the model, in a leaf module that imports nothing from the engine, so that any of those can ask them
without an import circle and initialisation (engine/model/init.py) without importing parallel/: the answers are
records on the modules (``tp_dims``, ``tp_size``, set by engine/parallel/tp/layers.py), not process groups.
"""

from __future__ import annotations

import torch
from torch import nn


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2-sharded over dp), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def tp_dim(module: nn.Module, attr: str) -> int | None:
    """The dim along which ``module.<attr>`` is split over the tp group (the module's ``tp_dims`` record, set by
    engine/parallel/tp/layers.py), or None when every tp rank holds all of it: a replicated parameter (a norm), or
    tp = 1. A module naming its own Hugging Face tensors (``hf_blocks``: stacked experts) gives the dim of each of
    those (a per-expert (ffn, h) gate is split along 0, its (h, ffn) down along 1), the terms parts are cut in."""
    if getattr(module, "tp_size", 1) <= 1:
        return None
    return getattr(module, "tp_dims", {}).get(attr)
